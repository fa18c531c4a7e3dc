"""Prompt layouts built by chat preparation: prefix-boundary rules and assistant continuation over HTTP.

A tiny synthetic core (byte-level tokenizer, ChatML template: every byte of the rendering is one token and
each special marker one more) with snapshot, restore and RESUME programs and pages of 4 tokens declares
prefix-boundary rules: a cut is allowed after a user message always, after an assistant message unless
reasoning was stripped from one, and after a system message when no tools are declared. The server runs
on the reference backend; the programs each request runs are recorded from the backend's launches.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ignition.build import build_core, default_frontend
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import generate_keys, load_private_key
from helios_core.contract import PromptLayout, PromptMessage
from helios_core.frontend.bootstrap import compile_chat_template
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
from helios_core.server.preparation import Frontend, prepare
from helios_core.server.schemas import decode_request
from helios_core.wire import contract_pb2 as ct

from .conftest import Served, serve_fixture

NAMESPACE = "helios-tests/prompt-layout"
PENALIZED = {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.8, "presence_penalty": 0.4}


def _core(tmp: Path) -> Path:
    keys = generate_keys(tmp / "keys")
    frontend = default_frontend()
    frontend.prefix_boundaries.add(roles=[ct.MESSAGE_ROLE_USER], constraint=ct.RENDERING_CONSTRAINT_INDEPENDENT)
    frontend.prefix_boundaries.add(
        roles=[ct.MESSAGE_ROLE_ASSISTANT], constraint=ct.RENDERING_CONSTRAINT_INDEPENDENT_UNLESS_REASONING_STRIPPED
    )
    frontend.prefix_boundaries.add(
        roles=[ct.MESSAGE_ROLE_SYSTEM], constraint=ct.RENDERING_CONSTRAINT_INDEPENDENT_WITHOUT_TOOLS
    )
    declaration = dataclasses.replace(synthetic_declaration("tiny", seed=5), frontend=frontend)
    caps = Capacities(
        max_rows=2, prefill_tokens=(16,), decode_rows=(1, 2), page_tokens=4, cache_pages=128, context=256, snapshots=2
    )
    path = tmp / "layout.core"
    build_core(declaration, path, caps=caps, signing_key=load_private_key(keys["signing"]), namespace=NAMESPACE)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("layout")
    trust = TrustSettings((tmp / "keys" / "signing.pub.pem",), NAMESPACE, None)
    core = _core(tmp)
    with serve_fixture(core=core, trust=trust, max_active=2, queue_capacity=2) as value:
        yield value


@pytest.fixture
def programs(served: Served) -> Iterator[list[str]]:
    """The name of every program the backend launches while the test runs."""
    backend = served.running.model.backend
    original = backend.run
    launched: list[str] = []

    def recording(name: str, *args: Any, **kwargs: Any) -> Any:
        launched.append(name)
        return original(name, *args, **kwargs)

    backend.run = recording  # type: ignore[method-assign]
    try:
        yield launched
    finally:
        backend.run = original  # type: ignore[method-assign]


def post(served: Served, path: str, **body: Any) -> httpx.Response:
    return httpx.post(served.base_url + path, json=body, timeout=60)


def chat(served: Served, **body: Any) -> dict[str, Any]:
    response = post(served, "/v1/chat/completions", **body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def rendered_ids(served: Served, **body: Any) -> list[int]:
    response = post(served, "/v1/chat/completions/render", **body)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["prompt_token_ids"]
    return ids


def text(served: Served, ids: list[int]) -> str:
    decoded: str = served.running.bootstrap.tokenizer.decode(ids, skip_special_tokens=False)
    return decoded


# -- assistant continuation -------------------------------------------------------------------------------

STORY = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time, far away"},
]


def test_a_continued_assistant_message_resumes_and_generates_what_its_token_prefix_generates(
    served: Served, programs: list[str]
) -> None:
    body = {"messages": STORY, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, **PENALIZED}
    continued = chat(served, continue_final_message=True, add_generation_prompt=False, **body)
    prompt = continued["prompt_token_ids"]
    # the final message is left open: no end marker after its content, no generation prompt
    assert text(served, prompt) == (
        "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\nOnce upon a time, far away"
    )
    # prefill stops where the content starts (token 35: 16 + 16 + 3); its 26 tokens run in RESUME rounds
    # (16 + 10), the last of which samples; 5 decode rounds make the other tokens
    assert programs == ["initialize", *["prefill_p16"] * 3, *["resume_p16"] * 2, *["decode_b1"] * 5]
    programs.clear()
    # the same token prefix on the prefill path: no layout, so no RESUME round
    plain = PreparedRequest("plain", prompt, 6, SamplingParams(**PENALIZED), ignore_eos=True)
    events = list(served.running.engine.submit(plain))
    assert "resume_p16" not in programs
    generated = [event.token_id for event in events if isinstance(event, TokenEvent)]
    assert len(generated) == 6
    assert continued["choices"][0]["token_ids"] == generated


def test_continue_final_message_alone_leaves_out_the_generation_prompt(served: Served) -> None:
    ids = rendered_ids(served, messages=STORY, continue_final_message=True)
    assert text(served, ids).endswith("<|im_start|>assistant\nOnce upon a time, far away")


def test_add_generation_prompt_false_renders_the_conversation_as_it_is(served: Served) -> None:
    ids = rendered_ids(served, messages=STORY[:1], add_generation_prompt=False)
    assert text(served, ids) == "<|im_start|>user\nTell me a story.<|im_end|>\n"
    with_prompt = rendered_ids(served, messages=STORY[:1], add_generation_prompt=True)
    assert text(served, with_prompt) == "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"messages": STORY, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt to "
            "false to continue the final assistant message)",
        ),
        (
            {"messages": STORY[:1], "continue_final_message": True},
            "messages",
            "continue_final_message needs the final message to be an assistant message; messages[0] is a user message",
        ),
        (
            {"messages": [*STORY[:1], {"role": "assistant", "content": ""}], "continue_final_message": True},
            "messages",
            "continue_final_message needs the final assistant message to have content to continue",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
def test_a_continuation_that_cannot_be_made_is_a_400(
    served: Served, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    response = post(served, path, **body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": 400,
    }


# -- prefix-boundary rules --------------------------------------------------------------------------------

SEA = [
    {"role": "system", "content": "You answer questions about the sea."},  # ends at token 45
    {"role": "user", "content": "What lives in the deep ocean?"},  # ends at token 82
    {"role": "assistant", "content": "Anglerfish, squid and many worms."},  # ends at token 128
]
SHARED = "Tell me more about the ones that glow, "
"""Every follow-up question starts so: conversations differ from token 128 + 6 + 39 = 173 on."""


def follow_up(tail: str, *, reasoning: str | None = None) -> list[dict[str, Any]]:
    messages = [dict(message) for message in SEA]
    if reasoning is not None:
        messages[2]["reasoning_content"] = reasoning
    return [*messages, {"role": "user", "content": SHARED + tail}]


def cached(response: dict[str, Any]) -> int:
    tokens: int = response["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


def test_chat_preparation_lays_out_each_message_and_what_the_rules_depend_on(served: Served) -> None:
    frontend = Frontend(served.running)
    system, user, assistant = ct.MESSAGE_ROLE_SYSTEM, ct.MESSAGE_ROLE_USER, ct.MESSAGE_ROLE_ASSISTANT
    body = {"messages": follow_up("alpha"), "max_tokens": 2}
    layout = prepare(frontend, decode_request(json.dumps(body).encode()), "a").request.layout
    ends = (PromptMessage(system, 45), PromptMessage(user, 82), PromptMessage(assistant, 128))
    # the last user message ends 6 + 44 + 2 tokens later, before the generation prompt
    assert layout == PromptLayout((*ends, PromptMessage(user, 180)))
    stripped = {"messages": follow_up("alpha", reasoning="Think of the twilight zone."), "max_tokens": 2}
    layout = prepare(frontend, decode_request(json.dumps(stripped).encode()), "b").request.layout
    # the template drops reasoning_content: no rule allows a cut after an assistant message now
    assert layout == PromptLayout((ends[0], ends[1], PromptMessage(user, 180)), reasoning_stripped=True)
    continued = {"messages": STORY, "continue_final_message": True}
    layout = prepare(frontend, decode_request(json.dumps(continued).encode()), "c").request.layout
    # the open assistant message has no end; its content starts at token 35
    assert layout == PromptLayout((PromptMessage(user, 24),), continuation=35)


def test_a_message_whose_rendering_depends_on_later_messages_has_no_boundary(served: Served) -> None:
    """A template that marks the last message renders a conversation's prefix differently from the same
    messages inside it: only the last message's end is a boundary."""
    frontend = Frontend(served.running)
    source = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
        "{% if loop.last %} (latest){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    bootstrap = served.running.bootstrap
    frontend.bootstrap = dataclasses.replace(bootstrap, chat_template=source, template=compile_chat_template(source))
    body = {"messages": follow_up("alpha"), "max_tokens": 2}
    layout = prepare(frontend, decode_request(json.dumps(body).encode()), "a").request.layout
    assert layout == PromptLayout((PromptMessage(ct.MESSAGE_ROLE_USER, 189),))


def test_prefix_reuse_over_http_ends_at_the_last_cut_the_rules_allow(served: Served) -> None:
    first = chat(served, messages=follow_up("alpha"), max_tokens=2, temperature=0.0)
    assert cached(first) == 0
    # the second conversation shares 173 tokens with the first; the last allowed cut within them is the
    # assistant message's end (128, a page boundary): 32 pages are reused
    second = chat(served, messages=follow_up("bravo"), max_tokens=2, temperature=0.0)
    assert cached(second) == 128
    # the same kind of prompt as token ids (no layout) is matched on its tokens alone: 43 pages (172 tokens)
    ids = rendered_ids(served, messages=follow_up("charlie"))
    plain = post(served, "/v1/completions", prompt=ids, max_tokens=2, temperature=0.0)
    assert plain.status_code == 200, plain.text
    assert cached(plain.json()) == 172
    # reasoning stripped from the assistant message: the last allowed cut is the user message's end (82),
    # so 20 pages are reused
    stripped = chat(served, messages=follow_up("delta", reasoning="Glowing fish."), max_tokens=2, temperature=0.0)
    assert cached(stripped) == 80
