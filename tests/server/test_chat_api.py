"""The chat API end to end through the official openai client and raw HTTP on loopback."""

from __future__ import annotations

import json
import time

import openai
import pytest

from helios_core.server.app import ServerSettings
from tests.server.conftest import MODEL, Served, serve_fixture
from tests.server.helpers import chat, sse_events

HI = [{"role": "user", "content": "hi"}]


def test_non_stream_chat(served: Served) -> None:
    out = served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert out.object == "chat.completion"
    assert out.model == MODEL
    assert out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None
    assert out.usage.prompt_tokens == 21
    assert 1 <= out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_stream_matches_non_stream(served: Served) -> None:
    client = served.client
    whole = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_string_stop(served: Served) -> None:
    client = served.client
    base = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].message.content or ""
    assert len(text) >= 4
    stop = text[2:4]
    out = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert (out.choices[0].message.content or "") == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_include_usage(served: Served) -> None:
    chunks = list(
        served.client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_token_ids_and_timestamps_json(served: Served) -> None:
    response = chat(served.base_url, max_tokens=6, ignore_eos=True, return_token_ids=True, return_token_timestamps=True)
    assert response.status_code == 200
    body = response.json()
    choice = body["choices"][0]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"] == 21
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 6
    stamps = choice["token_timestamps_ns"]
    assert len(stamps) == 6 and stamps == sorted(stamps) and stamps[0] > 0
    performance = body["performance"]
    assert 0 < performance["ingress_ns"] <= performance["enqueue_ns"] <= stamps[0]
    assert performance["reused_prompt_tokens"] == body["reused_prompt_tokens"]


def test_token_ids_stream(served: Served) -> None:
    response = chat(served.base_url, max_tokens=5, ignore_eos=True, stream=True, return_token_ids=True)
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _, data in events[:-1]]
    assert len(chunks[0]["prompt_token_ids"]) == 21
    id_chunks = [c for c in chunks if c["choices"] and "token_ids" in c["choices"][0]]
    assert [len(c["choices"][0]["token_ids"]) for c in id_chunks] == [1] * 5
    assert all(c["choices"][0]["delta"] == {} for c in id_chunks)
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert all("token_ids" not in c["choices"][0] for c in text_chunks)
    terminal = chunks[-1]
    assert terminal["choices"][0]["finish_reason"] == "length"
    assert terminal["usage"]["completion_tokens"] == 5
    assert "reused_prompt_tokens" in terminal


def test_stop_token_ids(served: Served) -> None:
    base = chat(served.base_url, max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True).json()
    ids = base["choices"][0]["token_ids"]
    target = ids[4]
    out = chat(
        served.base_url, max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True, stop_token_ids=[target]
    ).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["token_ids"] == ids[: ids.index(target) + 1]


def test_ignore_eos_runs_to_the_limit(served: Served) -> None:
    out = served.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=30, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 30


def test_response_format_json_object(served: Served) -> None:
    out = served.client.chat.completions.create(
        model=MODEL, messages=HI, temperature=0, response_format={"type": "json_object"}
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


def test_response_format_json_schema(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    finished = []
    for seed in range(4):
        out = served.client.chat.completions.create(
            model=MODEL,
            messages=HI,
            seed=seed,
            temperature=1,
            response_format=fmt,  # type: ignore[arg-type]
        )
        if out.choices[0].finish_reason == "stop":
            finished.append(json.loads(out.choices[0].message.content or ""))
    assert finished, "no seed finished within the output limit"
    assert all(set(doc) == {"a"} and isinstance(doc["a"], int) for doc in finished)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"temperature": "hot"}, "temperature"),
        ({"return_token_ids": 1}, "return_token_ids"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"n": 129}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"stop": 3}, "stop"),
        ({"return_token_timestamps": True}, "return_token_timestamps"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ],
)
def test_invalid_requests_are_400(served: Served, body: dict[str, object], param: str) -> None:
    response = chat(served.base_url, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("stop", [[""], ["a", "b", "c", "d", "e"], "", ["x" * 4097]])
def test_bad_stop_shapes_are_400(served: Served, stop: object) -> None:
    response = chat(served.base_url, stop=stop)
    assert response.status_code == 400
    assert "stop" in response.json()["error"]["message"]


def test_tools_refused_on_a_core_without_a_tool_parser(served: Served) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        served.client.chat.completions.create(model=MODEL, messages=HI, tools=[tool])  # type: ignore[list-item]


def test_invalid_schema_is_400(served: Served) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    assert chat(served.base_url, response_format=fmt).status_code == 400


def test_context_overflow_is_503(served: Served) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=60)
    assert caught.value.status_code == 503
    body = chat(served.base_url, max_tokens=60).json()
    assert body["error"]["type"] == "admission_rejected"


def test_context_overflow_stream_is_an_error_event(served: Served) -> None:
    response = chat(served.base_url, max_tokens=60, stream=True)
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "admission_rejected"
    assert (None, "[DONE]") not in events
    with pytest.raises(openai.APIError, match="exceeds the core's context"):
        list(served.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=60, stream=True))


def test_unknown_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="nope", messages=HI, max_tokens=2)


def test_alias_is_served(served: Served) -> None:
    out = served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    assert out.model == "tiny"


def test_a_name_holding_a_slash_is_retrieved_whole() -> None:
    import httpx

    with serve_fixture(ServerSettings(aliases=("org/tiny-model",))) as served:
        assert served.client.models.retrieve("org/tiny-model").id == "org/tiny-model"
        encoded = httpx.get(served.base_url + "/v1/models/org%2Ftiny-model")
        assert encoded.status_code == 200 and encoded.json()["id"] == "org/tiny-model"
        assert served.client.models.retrieve(MODEL).id == MODEL
        missing = httpx.get(served.base_url + "/v1/models/org/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == (
            "model 'org/other' is not served here; GET /v1/models lists the served names"
        )


def test_models_and_health(served: Served) -> None:
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL, "tiny"]
    import httpx

    time.sleep(1.1)  # a creation time read from the clock at each call would move on
    later = served.client.models.list()
    assert {m.created for m in [*models.data, *later.data]} == {models.data[0].created}
    assert served.client.models.retrieve("tiny").created == models.data[0].created

    health = httpx.get(served.base_url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    schema = httpx.get(served.base_url + "/schema/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in body["content"]["application/json"]["schema"]["properties"]


def test_min_tokens_holds_back_the_stop_ids_from_the_first_tokens(served: Served) -> None:
    """vLLM's ``min_tokens``: a ``stop_token_ids`` id is never among the first ``min_tokens`` tokens (it is
    masked out where it would be sampled), and may end the output after them."""
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = chat(served.base_url, **greedy).json()["choices"][0]["token_ids"]
    target = ids[1]
    first = ids.index(target)
    stopped = chat(served.base_url, **greedy, stop_token_ids=[target]).json()["choices"][0]
    assert stopped["token_ids"] == ids[: first + 1] and stopped["finish_reason"] == "stop"
    held = chat(served.base_url, **greedy, stop_token_ids=[target], min_tokens=first + 3).json()["choices"][0]
    produced = held["token_ids"]
    assert produced[:first] == ids[:first]  # the same greedy tokens until the held-back id would come
    assert len(produced) >= first + 3 and target not in produced[: first + 3]
    if held["finish_reason"] == "stop":  # a later occurrence may end it, past min_tokens
        assert produced.index(target) == len(produced) - 1
    else:
        assert held["finish_reason"] == "length" and len(produced) == 12 and target not in produced


def test_min_tokens_holds_back_the_end_of_sequence(served: Served) -> None:
    """An integer answer may end after any digit: the first ``min_tokens`` tokens are never the EOS id,
    the answer still parses, and the EOS id may come once they are out."""
    number = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    sampled = {"max_tokens": 12, "temperature": 1.0, "return_token_ids": True, "response_format": number}
    ends = [chat(served.base_url, **sampled, seed=seed).json()["choices"][0]["token_ids"] for seed in range(4)]
    eos = ends[0][-1]
    assert min(len(ids) for ids in ends) <= 3 and all(ids[-1] == eos for ids in ends)  # an early end exists
    for minimum in (3, 6):
        for seed in range(4):
            choice = chat(served.base_url, **sampled, seed=seed, min_tokens=minimum).json()["choices"][0]
            ids = choice["token_ids"]
            assert len(ids) > minimum and eos not in ids[:minimum], (minimum, seed, ids)
            assert isinstance(json.loads(choice["message"]["content"]), int)
            assert choice["finish_reason"] == ("stop" if ids[-1] == eos else "length")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens=5 exceeds max_tokens=4"),
        ({"max_completion_tokens": 3, "min_tokens": 4}, "min_tokens=4 exceeds max_completion_tokens=3"),
        ({"min_tokens": 10_000}, "min_tokens=10000 exceeds the default output limit of"),
        ({"min_tokens": -1}, "min_tokens must be at least 0, not -1"),
    ],
)
def test_min_tokens_beyond_the_output_limit_is_400(served: Served, body: dict[str, int], message: str) -> None:
    response = chat(served.base_url, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "min_tokens" and error["message"].startswith(message), error


def test_logit_bias_minus_100_never_samples_the_token(served: Served) -> None:
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = chat(served.base_url, **greedy).json()["choices"][0]["token_ids"]
    banned = chat(served.base_url, **greedy, logit_bias={str(ids[0]): -100, str(ids[3]): 0}).json()["choices"][0]
    assert banned["token_ids"][0] != ids[0] and ids[0] not in banned["token_ids"]
    neutral = chat(served.base_url, **greedy, logit_bias={str(ids[0]): 0}).json()["choices"][0]
    assert neutral["token_ids"] == ids  # 0 changes nothing


def test_logit_bias_100_samples_only_among_the_tokens_given_100(served: Served) -> None:
    sampled = {"max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True, "return_token_ids": True}
    choice = chat(served.base_url, **sampled, logit_bias={"72": 100, "105": 100}).json()["choices"][0]
    assert len(choice["token_ids"]) == 10 and set(choice["token_ids"]) <= {72, 105}
    assert choice["message"]["content"] == "".join({72: "H", 105: "i"}[token] for token in choice["token_ids"])


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"72": 5}, "logit_bias value 5.0 for token 72 is not supported: -100 never samples a token"),
        ({"72": -101}, "logit_bias value -101.0 for token 72 is not supported"),
        ({"-1": -100}, "logit_bias key '-1' is not a token id of this core's vocabulary [0, "),
        ({"99999999": -100}, "logit_bias key '99999999' is not a token id"),
        ({"seven": 100}, "logit_bias key 'seven' is not a token id"),
        ({"9" * 5000: -100}, "logit_bias key '9999"),
        ({str(token): -100 for token in range(1025)}, "logit_bias names 1025 tokens; at most 1024"),
    ],
)
def test_logit_bias_outside_its_two_ends_is_400(served: Served, bias: dict[str, float], message: str) -> None:
    response = chat(served.base_url, max_tokens=2, logit_bias=bias)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and error["message"].startswith(message), error
