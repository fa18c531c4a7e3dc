"""A template's thinking switch (``chat_template_kwargs``) and constrained answers on a think-tag core.

The core is a tiny synthetic one with JSON-tag tool calls and think-tag reasoning (``<think>`` and
``</think>`` are single tokens). Its template opens reasoning after the generation prompt when
``enable_thinking`` is true (the core's default) and writes an empty, closed reasoning block when it is
false. A constrained answer admits a reasoning block before the document only while the prompt has not
closed reasoning.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from ignition.build import build_core
from ignition.preparation.frontend import with_think_tags
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import CHATML_JSON_TOOLS_TEMPLATE, synthetic_declaration

from helios_core.backends import reference_kernels as rk
from helios_core.container.keys import generate_keys, load_private_key
from helios_core.loading import TrustSettings
from helios_core.server.preparation import Frontend, prepare
from helios_core.server.schemas import decode_request

from .conftest import Served, serve_fixture

NAMESPACE = "helios-tests/thinking-switch"
TEMPLATE = CHATML_JSON_TOOLS_TEMPLATE.replace(
    "{{ message['content'] or '' }}",
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{{ message['content'] or '' }}",
).replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("thinking")
    keys = generate_keys(tmp / "keys")
    declaration = synthetic_declaration("tiny", seed=3, tool_syntax="json-tags", extra_special=("<think>", "</think>"))
    frontend = with_think_tags(declaration.frontend)
    frontend.template_variables.add(name="enable_thinking", json_value="true")
    declaration = dataclasses.replace(declaration, frontend=frontend, chat_template=TEMPLATE)
    caps = Capacities(max_rows=1, prefill_tokens=(64,), decode_rows=(1,), page_tokens=16, cache_pages=64, context=512)
    core = tmp / "thinking.core"
    build_core(declaration, core, caps=caps, signing_key=load_private_key(keys["signing"]), namespace=NAMESPACE)
    with serve_fixture(core=core, trust=TrustSettings((keys["public"],), NAMESPACE, None)) as value:
        yield value


def first_ids(served: Served, **body: Any) -> set[int]:
    """The ids the prepared request's grammar allows first."""
    request = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 8, **body}
    prepared = prepare(Frontend(served.running), decode_request(json.dumps(request).encode()), "thinking").request
    mask = prepared.grammar.matcher().mask()
    allowed = rk.unpack_allowed_mask(mask[None, :], mask.size * 32)[0]
    return set(np.flatnonzero(allowed).tolist())


def closer(served: Served) -> int:
    token: int = served.running.bootstrap.tokenizer.token_to_id("</think>")
    return token


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_object"}},
        {"tools": [WEATHER], "tool_choice": "required"},
    ],
    ids=["response_format", "required_call"],
)
def test_a_prompt_that_closed_reasoning_is_answered_at_once(served: Served, constraint: dict[str, Any]) -> None:
    opener = "{" if "response_format" in constraint else "<tool_call>"
    opener_id = served.running.bootstrap.tokenizer.encode(opener, add_special_tokens=False).ids[0]
    off = first_ids(served, chat_template_kwargs={"enable_thinking": False}, **constraint)
    assert off == {opener_id}  # no reasoning block: the document (or call) starts at once
    on = first_ids(served, **constraint)
    assert closer(served) in on and len(on) > 100  # the prompt opened reasoning: free text until it closes


def test_thinking_off_renders_a_closed_block(served: Served) -> None:
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(served.base_url + "/v1/chat/completions/render", json=body, timeout=60).json()["prompt_token_ids"]
    text = served.running.bootstrap.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_assistant_message_sends_its_reasoning_under_either_name(served: Served, field: str) -> None:
    import httpx

    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", field: "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    response = httpx.post(served.base_url + "/v1/chat/completions/render", json={"messages": messages}, timeout=60)
    assert response.status_code == 200, response.text
    text = served.running.bootstrap.tokenizer.decode(response.json()["prompt_token_ids"], skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>Greet back.</think>Hello.<|im_end|>" in text
