"""String stops through the HTTP API on SmolLM2-135M-Instruct, chat and legacy completions, JSON and SSE.

Greedy, the question below is answered ``The capital of France is Paris.`` and EOS. A stop that the
answer's end begins but never completes (``.\\n``, ``Paris.!``) holds that end back until the model
ends: the whole answer still comes back, with a logprob entry per token. A stop that matches ends the
text before it, and the tokens it swallows whole have no logprob entry.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import Served
from .helpers import sse_events

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
ANSWER = "The capital of France is Paris."
TIMEOUT_S = 300.0
"""Generous: the reference backend shares two cores with the rest of the suite."""


def _post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    response = httpx.post(served.base_url + path, json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response


def _chat(served: Served, stream: bool, **options: Any) -> tuple[str, str, list[dict[str, Any]]]:
    """The content, finish reason and logprob entries of a greedy chat answer."""
    body = {"messages": QUESTION, "max_tokens": 16, "temperature": 0, "logprobs": True, "stream": stream, **options}
    response = _post(served, "/v1/chat/completions", body)
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], choice["logprobs"]["content"]
    content, reason, entries = "", "", []
    for _, data in sse_events(response):
        if data == "[DONE]" or not data["choices"]:
            continue
        choice = data["choices"][0]
        content += choice["delta"].get("content") or ""
        reason = choice["finish_reason"] or reason
        if choice.get("logprobs"):
            entries.extend(choice["logprobs"]["content"])
    return content, reason, entries


def _completion(served: Served, stream: bool, **options: Any) -> tuple[str, str, list[str]]:
    """The text, finish reason and logprob tokens of a greedy legacy completion."""
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 0, "stream": stream}
    response = _post(served, "/v1/completions", {**body, **options})
    if not stream:
        choice = response.json()["choices"][0]
        return choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"]
    text, reason, tokens = "", "", []
    for _, data in sse_events(response):
        if data == "[DONE]" or not data["choices"]:
            continue
        choice = data["choices"][0]
        text += choice["text"]
        reason = choice["finish_reason"] or reason
        if choice.get("logprobs"):
            tokens.extend(choice["logprobs"]["tokens"])
    return text, reason, tokens


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("stop", [".\n", "Paris.!", "is Paris.\n"])
def test_a_stop_the_answer_only_begins_keeps_the_whole_answer(smol: Served, stop: str, stream: bool) -> None:
    plain = _chat(smol, False)
    assert plain[:2] == (ANSWER, "stop")
    content, reason, entries = _chat(smol, stream, stop=stop)
    assert (content, reason) == (ANSWER, "stop")
    assert [(e["token"], e["logprob"]) for e in entries] == [(e["token"], e["logprob"]) for e in plain[2]]
    assert "".join(e["token"] for e in entries) == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_tokens_a_matched_stop_swallows_have_no_logprob_entry(smol: Served, stream: bool) -> None:
    content, reason, entries = _chat(smol, stream, stop="e c")
    assert (content, reason) == ("Th", "stop")
    assert [e["token"] for e in entries] == ["Th"]  # "The" cut by the match; " capital" swallowed whole
    assert all(e["token"] for e in entries)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_legacy_completion_stops_present_only_what_they_release(smol: Served, stream: bool) -> None:
    plain_text, _, plain_tokens = _completion(smol, False, stop=None)
    cut = plain_text.find("\n\n")
    assert cut > 0, plain_text  # the greedy continuation has a blank line to stop at
    text, reason, tokens = _completion(smol, stream, stop=["\n\n"])
    assert (text, reason) == (plain_text[:cut], "stop")
    assert "".join(tokens) == text and all(tokens)
    assert tokens == plain_tokens[: len(tokens)]
    held, held_reason, held_tokens = _completion(smol, stream, stop=[".\n\n\n\n\n\n\n"])
    assert (held, held_reason) == (plain_text, "length")  # never matched: everything released at the limit
    assert held_tokens == plain_tokens


def test_an_empty_answer_without_tool_calls_has_empty_content(smol: Served) -> None:
    data = _post(smol, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "stop": "The"})
    message = data.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ""}
