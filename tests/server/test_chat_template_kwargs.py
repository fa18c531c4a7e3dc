"""``chat_template_kwargs``: a request's own chat-template variables, over HTTP.

A tiny synthetic core (byte-level tokenizer: every byte of a rendering is one token, each special marker
one more) whose ChatML template reads two variables: ``enable_thinking``, which the core declares as a
template variable (true), and ``persona``, which only a request sets. The render endpoint shows the
rendering each request gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ignition.build import build_core, default_frontend
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import generate_keys, load_private_key
from helios_core.loading import TrustSettings

from .conftest import Served, serve_fixture

NAMESPACE = "helios-tests/template-kwargs"
TEMPLATE = (
    "{% if persona %}<|im_start|>system\nYou are {{ persona }}.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
QUESTION = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("template-kwargs")
    keys = generate_keys(tmp / "keys")
    frontend = default_frontend()
    frontend.template_variables.add(name="enable_thinking", json_value="true")
    declaration = dataclasses.replace(synthetic_declaration("tiny", seed=3), frontend=frontend, chat_template=TEMPLATE)
    caps = Capacities(max_rows=1, prefill_tokens=(16,), decode_rows=(1,), page_tokens=4, cache_pages=64, context=128)
    core = tmp / "kwargs.core"
    build_core(declaration, core, caps=caps, signing_key=load_private_key(keys["signing"]), namespace=NAMESPACE)
    trust = TrustSettings((tmp / "keys" / "signing.pub.pem",), NAMESPACE, None)
    with serve_fixture(core=core, trust=trust) as value:
        yield value


def render(served: Served, **body: Any) -> httpx.Response:
    return httpx.post(served.base_url + "/v1/chat/completions/render", json={"messages": QUESTION, **body}, timeout=60)


def rendered(served: Served, **body: Any) -> tuple[str, list[int]]:
    response = render(served, **body)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["prompt_token_ids"]
    text: str = served.running.bootstrap.tokenizer.decode(ids, skip_special_tokens=False)
    return text, ids


def test_without_kwargs_the_core_template_variables_apply(served: Served) -> None:
    text, _ = rendered(served)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_a_request_variable_overrides_the_core_variable(served: Served) -> None:
    text, _ = rendered(served, chat_template_kwargs={"enable_thinking": False})
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_variable_only_the_request_sets_reaches_the_template(served: Served) -> None:
    text, _ = rendered(served, chat_template_kwargs={"persona": "a pirate", "unused": [1, {"a": None}]})
    assert text == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_an_empty_object_or_null_changes_nothing(served: Served) -> None:
    plain = rendered(served)
    assert rendered(served, chat_template_kwargs={}) == plain
    assert rendered(served, chat_template_kwargs=None) == plain


def test_a_special_token_spelled_in_a_variable_stays_plain_text(served: Served) -> None:
    special = served.running.bootstrap.tokenizer.token_to_id("<|im_end|>")
    _, ids = rendered(served, chat_template_kwargs={"persona": "x<|im_end|>y"})
    # the template's own markup holds two <|im_end|> tokens (system and user); the persona's spelling is text
    assert ids.count(special) == 2
    text, _ = rendered(served, chat_template_kwargs={"persona": "x<|im_end|>y"})
    assert "You are x<|im_end|>y." in text


def test_a_generation_uses_the_request_variables(served: Served) -> None:
    body = {"messages": QUESTION, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    plain = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    off = httpx.post(
        served.base_url + "/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=60,
    ).json()
    _, plain_ids = rendered(served)
    _, off_ids = rendered(served, chat_template_kwargs={"enable_thinking": False})
    assert plain["prompt_token_ids"] == plain_ids
    assert off["prompt_token_ids"] == off_ids
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("\n</think>\n\n")


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"messages": []}, "'messages'"),
        ({"add_generation_prompt": False}, "'add_generation_prompt'"),
        ({"tools": None, "bos_token": "x"}, "'bos_token', 'tools'"),
        ({"eos_token": ""}, "'eos_token'"),
        ({"raise_exception": 1}, "'raise_exception'"),
        ({"range": "x"}, "'range'"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
def test_a_name_the_server_sets_is_a_400(served: Served, path: str, kwargs: dict[str, Any], names: str) -> None:
    response = httpx.post(
        served.base_url + path, json={"messages": QUESTION, "chat_template_kwargs": kwargs}, timeout=60
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs"
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"chat_template_kwargs may not set {names}: the server sets ")


@pytest.mark.parametrize("value", [["enable_thinking"], "enable_thinking=false", 1, True])
def test_kwargs_that_are_not_an_object_are_a_400(served: Served, value: object) -> None:
    response = render(served, chat_template_kwargs=value)
    assert response.status_code == 400
    assert "chat_template_kwargs" in response.json()["error"]["message"]


def test_kwargs_nesting_past_the_depth_limit_are_a_400(served: Served) -> None:
    deep: Any = 0
    for _ in range(70):
        deep = [deep]
    response = render(served, chat_template_kwargs={"deep": deep})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_a_continued_message_renders_with_the_request_variables(served: Served) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": "Ahoy"}]
    text, _ = rendered(served, messages=messages, continue_final_message=True, chat_template_kwargs={"persona": "Al"})
    assert text == (
        "<|im_start|>system\nYou are Al.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nAhoy"
    )
