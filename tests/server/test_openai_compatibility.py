"""What OpenAI clients send and expect beyond the chat call itself, through the real server.

A message the official SDK returned goes back as ``model_dump()``; one model is retrieved by name;
the metrics exposition declares one charset; an oversized body names the limit; a schema llguidance
cannot compile names ``response_format`` and says why.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from helios_core.server.app import MAX_BODY_BYTES

from .conftest import MODEL, Served


def _chat(served: Served, **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(served.base_url + "/v1/chat/completions", json={"max_tokens": 2, **body}, timeout=60)


def test_a_returned_message_goes_back_as_the_sdk_dumps_it(served: Served) -> None:
    first = [{"role": "user", "content": "a"}]
    reply = served.client.chat.completions.create(model=MODEL, messages=first, max_tokens=3)  # type: ignore[arg-type]
    dumped = reply.choices[0].message.model_dump()
    assert {"annotations", "audio", "function_call", "refusal", "tool_calls"} <= set(dumped)
    again = served.client.chat.completions.create(
        model=MODEL,
        messages=[*first, dumped, {"role": "user", "content": "b"}],  # type: ignore[list-item]
        max_tokens=3,
        extra_body={"ignore_eos": True},  # sampled at temperature 1: an EOS would end it before the limit
    )
    assert again.choices[0].finish_reason == "length"
    annotated = {**dumped, "annotations": [{"type": "url_citation", "url_citation": {"url": "https://a.example"}}]}
    response = _chat(served, messages=[*first, annotated, {"role": "user", "content": "b"}])
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("audio", {"id": "audio_1"}, "messages[1].audio is not supported by this server"),
        (
            "function_call",
            {"name": "f", "arguments": "{}"},
            "messages[1].function_call is not supported by this server (send earlier calls as tool_calls)",
        ),
    ],
)
def test_an_assistant_audio_or_legacy_call_is_refused(served: Served, field: str, value: Any, message: str) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", field: value}]
    response = _chat(served, messages=[*messages, {"role": "user", "content": "c"}])
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message, "type": "invalid_request_error", "param": "messages", "code": 400
    }  # fmt: skip


def test_one_model_is_retrieved_by_its_name_or_alias(served: Served) -> None:
    for name in (MODEL, "tiny"):
        model = served.client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "helios")
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("gpt-4o")
    response = httpx.get(served.base_url + "/v1/models/gpt-4o", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "model 'gpt-4o' is not served here; GET /v1/models lists the served names",
        "type": "not_found_error",
        "param": None,
        "code": 404,
    }


def test_the_metrics_declare_one_charset(served: Served) -> None:
    response = httpx.get(served.base_url + "/metrics", timeout=10)
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_an_oversized_body_names_the_limit(served: Served) -> None:
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * MAX_BODY_BYTES + b'"}]}'
    response = httpx.post(
        served.base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": f"the request body is larger than this server's limit of {MAX_BODY_BYTES} bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": 413,
    }


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "nonsense"}, "response_format.json_schema.schema: Invalid type: nonsense"),
        (
            {"type": "string", "pattern": "(unclosed"},
            "response_format.json_schema.schema: regex parse error: unclosed group",
        ),
    ],
)
def test_a_schema_that_does_not_compile_names_the_format(served: Served, schema: Any, message: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    response = _chat(served, response_format=response_format)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message, "type": "invalid_request_error", "param": "response_format", "code": 400
    }  # fmt: skip
