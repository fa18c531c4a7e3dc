"""Logprobs, top alternatives and prompt logprobs through the HTTP API (openai client and raw SSE)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import openai
import pytest

from helios_core.server.errors import InvalidRequest
from helios_core.server.preparation import _logprob_settings
from helios_core.server.schemas import ChatCompletionRequest, UserMessage
from tests.server.conftest import MODEL, Served
from tests.server.helpers import chat, sse_events

HI: Any = [{"role": "user", "content": "hi"}]


def test_logprobs_non_stream(served: Served) -> None:
    out = served.client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert out.usage is not None and len(entries) == out.usage.completion_tokens == 6
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the sampled id is the best one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_logprobs_without_alternatives_and_off(served: Served) -> None:
    on = served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, logprobs=True)
    assert on.choices[0].logprobs is not None and on.choices[0].logprobs.content is not None
    assert all(entry.top_logprobs == [] for entry in on.choices[0].logprobs.content)
    off = served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert off.choices[0].logprobs is None


def test_logprobs_stream(served: Served) -> None:
    base = served.client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert base.choices[0].logprobs is not None and base.choices[0].logprobs.content is not None
    stream = served.client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = []
    text = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.logprobs is not None and choice.logprobs.content:
            assert choice.delta.content  # entries ride on content chunks
            entries.extend(choice.logprobs.content)
            assert "".join(e.token for e in choice.logprobs.content) == choice.delta.content
        text += choice.delta.content or ""
    assert text == base.choices[0].message.content
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in base.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_logprobs_follow_presented_text_with_a_stop(served: Served) -> None:
    base = chat(served.base_url, max_tokens=8, temperature=0, ignore_eos=True).json()
    content = base["choices"][0]["message"]["content"]
    stop = content[3:5]
    assert stop and content.find(stop) == 3
    out = chat(served.base_url, max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, stop=[stop]).json()
    choice = out["choices"][0]
    assert choice["message"]["content"] == content[:3]
    assert "".join(entry["token"] for entry in choice["logprobs"]["content"]) == content[:3]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs=true"),
        ({"logprobs": False, "top_logprobs": 1}, "top_logprobs", "requires logprobs=true"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs", "limit of 5"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", ">= 0"),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "top alternatives for prompt tokens are not supported"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", ">= 0"),
        ({"prompt_logprobs": True}, "prompt_logprobs", ""),
    ],
)
def test_invalid_logprob_requests_are_400(served: Served, body: dict[str, object], param: str, words: str) -> None:
    response = chat(served.base_url, max_tokens=2, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_invalid_logprobs_through_the_client(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="limit of 5"):
        served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, logprobs=True, top_logprobs=9)


def test_cores_without_logprobs_refuse_them() -> None:
    frontend: Any = SimpleNamespace(logprobs_top_n=None, supports_prompt_logprobs=False)
    messages: Any = [UserMessage("hi")]
    with pytest.raises(InvalidRequest, match="not supported by this core"):
        _logprob_settings(frontend, ChatCompletionRequest(messages, logprobs=True))
    with pytest.raises(InvalidRequest, match="not supported by this core"):
        _logprob_settings(frontend, ChatCompletionRequest(messages, prompt_logprobs=0))
    assert _logprob_settings(frontend, ChatCompletionRequest(messages)) == (-1, False)


def test_prompt_logprobs_non_stream(served: Served) -> None:
    out = served.client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=3,
        temperature=0,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    extra = out.model_extra or {}
    scores = extra["prompt_logprobs"]
    assert out.usage is not None and len(scores) == len(extra["prompt_token_ids"]) == out.usage.prompt_tokens
    assert scores[0] is None
    assert all(isinstance(s, float) and s <= 0.0 for s in scores[1:])
    assert out.usage.prompt_tokens_details is not None and out.usage.prompt_tokens_details.cached_tokens == 0
    plain = served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert plain.choices[0].message.content == out.choices[0].message.content
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_prompt_logprobs_stream(served: Served) -> None:
    body = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": 0, "logprobs": True}
    expected = chat(served.base_url, **body).json()
    response = chat(served.base_url, stream=True, **body)
    assert response.status_code == 200
    events = sse_events(response)
    first = events[0][1]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["prompt_logprobs"] == expected["prompt_logprobs"]
    assert all("prompt_logprobs" not in data for _, data in events[1:] if isinstance(data, dict))
    assert events[-1][1] == "[DONE]"
    streamed = [
        entry
        for _, data in events[1:-1]
        for choice in data["choices"]
        if choice["logprobs"] is not None
        for entry in choice["logprobs"]["content"]
    ]
    assert streamed == expected["choices"][0]["logprobs"]["content"]
