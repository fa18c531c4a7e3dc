"""Generated special tokens in presented text, and tokens a matched stop swallows whole.

The served core is a tiny synthetic one with the JSON-tag tool syntax: its tokenizer's special tokens are
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (EOS) and the syntax's ``<tool_call>`` and
``</tool_call>``. The model's sampled ids are replaced by a scripted reply (``helpers.scripted_replies``),
so each test pins what a generated id sequence reaches the client as.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from helios_core.frontend.detokenizer import hidden_special_ids, output_syntax_texts

from .conftest import Served, serve_fixture
from .helpers import build_synthetic_core, scripted_replies, sse_events

NAMESPACE = "helios-tests/special-tokens"
MODEL = "llama-synthetic-tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    built = build_synthetic_core(tmp_path_factory.mktemp("special"), NAMESPACE, tool_syntax="json-tags")
    with serve_fixture(core=built.path, trust=built.trust) as value:
        yield value


@pytest.fixture
def say(served: Served) -> Iterator[Callable[..., None]]:
    with scripted_replies(served.running) as script:
        yield script


def ids_of(served: Served, text: str) -> list[int]:
    ids: list[int] = served.running.bootstrap.tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def chat(served: Served, stream: bool = False, **body: Any) -> tuple[str, dict[str, Any]]:
    """(the presented content, the last JSON body or chunk) of a chat request."""
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, **body}
    if not stream:
        response = httpx.post(served.base_url + "/v1/chat/completions", json=request, timeout=60)
        assert response.status_code == 200, response.text
        out = response.json()
        return out["choices"][0]["message"]["content"] or "", out
    with httpx.stream(
        "POST", served.base_url + "/v1/chat/completions", json={**request, "stream": True}, timeout=60
    ) as response:
        response.read()
    chunks = [event for name, event in sse_events(response) if name is None and event != "[DONE]"]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    return text, chunks[-1]


def test_the_hidden_ids_are_the_special_tokens_no_syntax_spells(served: Served) -> None:
    tokenizer = served.running.bootstrap.tokenizer
    hidden = hidden_special_ids(tokenizer, output_syntax_texts(served.running.verified.contract.model.frontend))
    assert sorted(tokenizer.id_to_token(token_id) for token_id in hidden) == [
        "<|endoftext|>",
        "<|im_end|>",
        "<|im_start|>",
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_are_not_presented(served: Served, say: Callable[..., None], stream: bool) -> None:
    say("Hi<|im_start|>there<|im_start|>!")
    content, _ = chat(served, stream=stream, max_tokens=20, return_token_ids=True)
    assert content == "Hithere!"


def test_eos_generated_under_ignore_eos_is_not_presented(served: Served, say: Callable[..., None]) -> None:
    eos = served.running.verified.contract.eos_token_ids[0]
    say("ab" + served.running.bootstrap.tokenizer.id_to_token(eos) + "cd", end=False)
    content, out = chat(served, max_tokens=5, ignore_eos=True, return_token_ids=True, logprobs=True)
    assert out["choices"][0]["token_ids"] == [*ids_of(served, "ab"), eos, *ids_of(served, "cd")]
    assert content == "abcd"
    assert [entry["token"] for entry in out["choices"][0]["logprobs"]["content"]] == ["a", "b", "", "c", "d"]
    assert out["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_presents_them(served: Served, say: Callable[..., None], stream: bool) -> None:
    say("Hi<|im_start|>there")
    content, _ = chat(served, stream=stream, max_tokens=20, skip_special_tokens=False)
    assert content == "Hi<|im_start|>there"


def test_special_tokens_are_hidden_beside_a_string_stop(served: Served, say: Callable[..., None]) -> None:
    say("a<|im_start|>b.c")
    content, _ = chat(served, max_tokens=20, stop=["."])
    assert content == "ab"


def test_legacy_completions_hide_special_tokens_too(served: Served, say: Callable[..., None]) -> None:
    say("x<|im_start|>y")
    body = {"model": MODEL, "prompt": "Q", "max_tokens": 10, "temperature": 0}
    out = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == "xy"
    say("x<|im_start|>y")
    kept = httpx.post(
        served.base_url + "/v1/completions", json={**body, "skip_special_tokens": False}, timeout=60
    ).json()
    assert kept["choices"][0]["text"] == "x<|im_start|>y"


def test_syntax_tokens_still_reach_the_tool_parser(served: Served, say: Callable[..., None]) -> None:
    say('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    _, out = chat(served, max_tokens=40, tools=tools)
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {}


# -- a character split across tokens, swallowed by a stop ---------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_the_first_bytes_of_a_stop_character_have_no_logprob_entry(
    served: Served, say: Callable[..., None], stream: bool
) -> None:
    """The byte-level tokenizer writes 🎉 as four tokens: the first three have no text of their own, so the
    stop that the fourth completes swallows all four."""
    say("ok🎉more")
    content, last = chat(served, stream=stream, max_tokens=20, stop=["🎉"], logprobs=True)
    assert content == "ok"
    if not stream:
        assert [entry["token"] for entry in last["choices"][0]["logprobs"]["content"]] == ["o", "k"]


def test_a_split_character_before_a_stop_keeps_its_entries(served: Served, say: Callable[..., None]) -> None:
    say("é!")
    content, out = chat(served, max_tokens=20, stop=["!"], logprobs=True)
    assert content == "é"
    assert [entry["token"] for entry in out["choices"][0]["logprobs"]["content"]] == ["", "é"]


def test_legacy_stop_on_a_split_character_leaves_no_positions(served: Served, say: Callable[..., None]) -> None:
    say("🎉🎉")
    body = {"model": MODEL, "prompt": "Q", "max_tokens": 10, "temperature": 0, "stop": "🎉", "logprobs": 0}
    out = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60).json()
    choice = out["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == [] and choice["logprobs"]["text_offset"] == []
