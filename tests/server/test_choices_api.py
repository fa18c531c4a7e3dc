"""Several choices a request (``n``), chat and legacy completions, JSON and SSE, through the real server.

Each choice is a request of the model's with its own seed (``seed + index`` when the request names one),
so choice ``i`` of a seeded request gives exactly the tokens of the same request with one choice and the
seed ``seed + i``; the usage counts the prompt once and every choice's output. A response of ``n``
choices holds ``n`` admission permits.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.server.conftest import Served
from tests.server.helpers import admitted, chat, held_requests, sse_events, wait_for

ASK = [{"role": "user", "content": "Tell me a story."}]
HI = [{"role": "user", "content": "hi"}]
"""A prompt short enough for 30 output tokens in the fixture core's context."""
LIMIT = 6


def _post(served: Served, path: str, **body: Any) -> httpx.Response:
    if path == "/v1/chat/completions":
        body.setdefault("messages", ASK)
    else:
        body.setdefault("prompt", "Once upon a time")
    body.setdefault("max_tokens", LIMIT)
    body.setdefault("ignore_eos", True)
    return httpx.post(served.base_url + path, json=body, timeout=60)


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _text(choice: dict[str, Any]) -> str:
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


PATHS = ["/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("path", PATHS, ids=["chat", "completions"])
def test_each_seeded_choice_is_the_single_choice_request_of_its_seed(served: Served, path: str) -> None:
    body = _ok(_post(served, path, n=3, temperature=1.0, seed=7, return_token_ids=True))
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    alone = [_ok(_post(served, path, temperature=1.0, seed=7 + i, return_token_ids=True)) for i in range(3)]
    for choice, single in zip(body["choices"], alone, strict=True):
        assert choice["token_ids"] == single["choices"][0]["token_ids"]
        assert _text(choice) == _text(single["choices"][0])
        assert choice["finish_reason"] == "length"
    assert len({tuple(choice["token_ids"]) for choice in body["choices"]}) > 1  # the seeds differ
    prompt = alone[0]["usage"]["prompt_tokens"]
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 3 * LIMIT,
        "total_tokens": prompt + 3 * LIMIT,
        "prompt_tokens_details": {"cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }
    assert body["id"].startswith("chatcmpl-" if "chat" in path else "cmpl-")


def test_unseeded_choices_sample_independently_and_greedy_choices_agree(served: Served) -> None:
    greedy = _ok(_post(served, "/v1/chat/completions", n=2, temperature=0.0))
    single = _ok(_post(served, "/v1/chat/completions", temperature=0.0))
    assert [_text(choice) for choice in greedy["choices"]] == [_text(single["choices"][0])] * 2
    body = _ok(_post(served, "/v1/chat/completions", n=4, temperature=1.0, max_tokens=12, return_token_ids=True))
    assert len({tuple(choice["token_ids"]) for choice in body["choices"]}) > 1


def _streamed_choices(events: list[tuple[str | None, Any]], chat_api: bool) -> dict[int, dict[str, Any]]:
    """Per choice index: its text, finish reasons and whether a role chunk opened it."""
    out: dict[int, dict[str, Any]] = {}
    for name, data in events:
        assert name is None, (name, data)
        if data == "[DONE]":
            continue
        for choice in data["choices"]:
            entry = out.setdefault(choice["index"], {"text": "", "finish": [], "role": False})
            if chat_api:
                delta = choice["delta"]
                entry["role"] |= delta.get("role") == "assistant"
                entry["text"] += delta.get("content") or ""
            else:
                entry["text"] += choice["text"]
            if choice["finish_reason"] is not None:
                entry["finish"].append(choice["finish_reason"])
    return out


@pytest.mark.parametrize("path", PATHS, ids=["chat", "completions"])
def test_a_stream_of_several_choices_ends_once_with_their_usage(served: Served, path: str) -> None:
    chat_api = "chat" in path
    seeded = {"n": 3, "temperature": 1.0, "seed": 11}
    whole = _ok(_post(served, path, **seeded))
    response = _post(served, path, stream=True, stream_options={"include_usage": True}, **seeded)
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]") and [data for _, data in events].count("[DONE]") == 1
    usage_chunks = [data for _, data in events[:-1] if data["choices"] == []]
    assert usage_chunks == [usage_chunks[0]] and events[-2][1] is usage_chunks[0]
    assert usage_chunks[0]["usage"] == whole["usage"]
    assert all(data["usage"] is None for _, data in events[:-2])
    streamed = _streamed_choices(events, chat_api)
    assert sorted(streamed) == [0, 1, 2]
    for choice in whole["choices"]:
        entry = streamed[choice["index"]]
        assert entry["text"] == _text(choice)
        assert entry["finish"] == ["length"]
        assert entry["role"] is chat_api


def test_an_observed_stream_of_several_choices_carries_its_usage_last(served: Served) -> None:
    response = _post(served, "/v1/chat/completions", n=2, stream=True, return_token_ids=True, temperature=0.0)
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]")
    terminal = [data for _, data in events[:-1] if data["choices"] and data["choices"][0]["finish_reason"]]
    assert len(terminal) == 2 and all("usage" not in data for data in terminal)
    assert events[-2][1]["choices"] == [] and events[-2][1]["usage"]["completion_tokens"] == 2 * LIMIT
    ids: dict[int, list[int]] = {}
    for _, data in events[:-2]:
        for choice in data["choices"]:
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    assert len(ids[0]) == len(ids[1]) == LIMIT and ids[0] == ids[1]


def test_the_openai_client_reads_several_choices(served: Served) -> None:
    settings: dict[str, Any] = {"n": 2, "max_tokens": LIMIT, "temperature": 1.0, "seed": 3}
    reply = served.client.chat.completions.create(
        model="tiny", messages=ASK, extra_body={"ignore_eos": True}, **settings
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert reply.usage is not None and reply.usage.completion_tokens == 2 * LIMIT
    stream = served.client.chat.completions.create(
        model="tiny", messages=ASK, extra_body={"ignore_eos": True}, stream=True, **settings
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {choice.index: choice.message.content for choice in reply.choices}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"n": 0}, "n must lie in [1, 128], not 0"),
        ({"n": 129}, "n must lie in [1, 128], not 129"),
        ({"n": 5}, "n (5) is more than the 4 requests this server admits at once"),
    ],
)
def test_out_of_range_choices_are_400(served: Served, body: dict[str, Any], message: str) -> None:
    for path in PATHS:
        response = _post(served, path, **body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["message"]) == ("n", message)
    assert admitted(served.base_url) == 0


def test_best_of_may_only_equal_n(served: Served) -> None:
    assert _post(served, "/v1/completions", n=2, best_of=2).status_code == 200
    refused = _post(served, "/v1/completions", n=2, best_of=3)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_several_choices_take_a_permit_each(served: Served) -> None:
    with served.slow(0.03), held_requests(served.base_url, 3) as statuses:
        refused = _post(served, "/v1/chat/completions", n=2)
        assert refused.status_code == 429, refused.text
        assert admitted(served.base_url) == 3  # the refused request's first permit went back
    assert statuses == [200, 200, 200]
    wait_for(lambda: admitted(served.base_url) == 0)
    held: list[int] = []

    def several() -> None:
        held.append(_post(served, "/v1/chat/completions", messages=HI, n=3, max_tokens=30).status_code)

    with served.slow(0.03):
        thread = threading.Thread(target=several)
        thread.start()
        wait_for(lambda: admitted(served.base_url) == 3)
        assert chat(served.base_url, max_tokens=2).status_code == 200  # the fourth permit
        thread.join(30)
    assert held == [200]
    wait_for(lambda: admitted(served.base_url) == 0)


def test_a_dropped_stream_of_several_choices_cancels_them_all(served: Served) -> None:
    before = served.running.engine.statistics().finished.get("cancelled", 0)
    body = {"messages": HI, "max_tokens": 30, "ignore_eos": True, "stream": True, "n": 3}
    with served.slow(0.03), httpx.Client(timeout=10) as client:
        with client.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: served.running.engine.statistics().finished.get("cancelled", 0) == before + 3)
    served.wait_idle()
    wait_for(lambda: admitted(served.base_url) == 0)


def test_render_refuses_the_choices_generation_refuses(served: Served) -> None:
    for path, body in (
        ("/v1/chat/completions/render", {"messages": HI, "n": 5}),
        ("/v1/completions/render", {"prompt": "hi", "n": 5}),
    ):
        response = httpx.post(served.base_url + path, json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "n"
        assert httpx.post(served.base_url + path, json={**body, "n": 4}, timeout=30).status_code == 200
    assert admitted(served.base_url) == 0


def test_a_stream_of_several_choices_states_the_prompt_once(served: Served) -> None:
    body = {"n": 3, "stream": True, "return_token_ids": True, "prompt_logprobs": 0, "messages": HI, "temperature": 0.0}
    events = sse_events(_post(served, "/v1/chat/completions", **body))
    assert events[-1] == (None, "[DONE]")
    carrying = [data for _, data in events[:-1] if "prompt_logprobs" in data or "prompt_token_ids" in data]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["index"] == 0
    whole = _ok(_post(served, "/v1/chat/completions", **{**body, "stream": False}))
    assert carrying[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert carrying[0]["prompt_token_ids"] == whole["prompt_token_ids"]
