"""Hardening of the HTTP server: nesting limits, media types, error statuses in the OpenAPI document,
capacity refusals and retries, 500 logging, output-failure counting, one-line SSE data and shutdown.

Everything runs against the real server (uvicorn on loopback) over the golden fixture core; the
shutdown test runs its own server with :func:`~helios_core.server.serve.draining_server` and short
periods, so it takes a couple of seconds.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.startup import start
from helios_core.server.app import MAX_BODY_BYTES, chat_service, create_app
from helios_core.server.presentation import Presenter, sse_data, sse_error
from helios_core.server.schemas import MAX_JSON_DEPTH
from helios_core.server.serve import draining_server

from .conftest import CORE, KEYS, MODEL, NAMESPACE, Served, free_port
from .helpers import chat, held_requests, metric_values, scripted_replies, sse_events, wait_for

HI = '{"role": "user", "content": "hi"}'


def _post(served: Served, body: str | bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type} if content_type is not None else {}
    return httpx.post(served.base_url + "/v1/chat/completions", content=body, headers=headers, timeout=30)


def _body(field: str) -> str:
    """A request body of one user message, max_tokens 2 and ``field`` (``"name": value`` JSON text)."""
    return '{"messages": [' + HI + '], "max_tokens": 2, ' + field + "}"


def _nested_object(levels: int) -> str:
    """JSON text of ``levels`` nested objects."""
    return '{"a": ' * (levels - 1) + "{}" + "}" * (levels - 1)


def _metrics(served: Served) -> tuple[dict[str, float], dict[str, float]]:
    """(unlabelled samples, helios_requests_finished_total by reason)."""
    plain: dict[str, float] = {}
    finished: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(served.base_url + "/metrics").text):
        for sample in family.samples:
            if not sample.labels:
                plain[sample.name] = sample.value
            elif sample.name == "helios_requests_finished_total":
                finished[sample.labels["reason"]] = sample.value
    return plain, finished


# -- nesting --------------------------------------------------------------------------------------
DEEP_FIELDS = {  # %s: the deeply nested value
    "response_format": '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}',
    "tool_choice": '"tool_choice": %s',
    "tools": '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]',
    "audio": '"audio": %s',
    "functions": '"functions": [%s]',
}


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 1000, 100_000])
@pytest.mark.parametrize("field", sorted(DEEP_FIELDS))
def test_deep_nesting_is_400_naming_the_field(served: Served, field: str, levels: int) -> None:
    body = _body(DEEP_FIELDS[field].replace("%s", _nested_object(levels)))
    response = _post(served, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert f"more than {MAX_JSON_DEPTH} levels deep" in error["message"]


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deep_tool_call_arguments_are_400(served: Served, levels: int) -> None:
    arguments = json.dumps("[" * levels + "]" * levels)
    call = '{"id": "c1", "type": "function", "function": {"name": "f", "arguments": ' + arguments + "}}"
    body = '{"messages": [' + HI + ', {"role": "assistant", "tool_calls": [' + call + ']}], "max_tokens": 2}'
    response = _post(served, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith("messages[1].tool_calls[0].function.arguments nests")


def test_nesting_at_the_limit_is_accepted(served: Served) -> None:
    # response_format's own object is level 1: a schema of MAX_JSON_DEPTH - 2 levels fills the limit
    schema = _nested_object(MAX_JSON_DEPTH - 2)
    refused = _post(served, _body('"audio": ' + _nested_object(MAX_JSON_DEPTH))).json()["error"]
    assert refused["param"] == "audio" and "not supported" in refused["message"]  # refused as audio, not as depth
    fmt = '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + "}}"
    response = _post(served, _body('"response_format": ' + fmt))
    assert response.status_code != 500
    assert "levels deep" not in response.text


# -- media types and body size ----------------------------------------------------------------------
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/json; charset=latin-1"],
)
def test_a_body_not_declared_as_json_is_415(served: Served, content_type: str) -> None:
    response = _post(served, BODY, content_type)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 415 and error["param"] is None


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8", None]
)
def test_json_and_a_missing_content_type_are_accepted(served: Served, content_type: str | None) -> None:
    response = _post(served, BODY, content_type)
    assert response.status_code == 200, response.text


def test_an_oversized_body_is_413(served: Served) -> None:
    body = '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * MAX_BODY_BYTES)
    response = _post(served, body)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413


# -- OpenAPI ----------------------------------------------------------------------------------------
def _openapi(served: Served) -> dict[str, Any]:
    document: dict[str, Any] = httpx.get(served.base_url + "/schema/openapi.json").json()
    return document


def test_openapi_lists_every_error_status_with_the_error_object(served: Served) -> None:
    operation = _openapi(served)["paths"]["/v1/chat/completions"]["post"]
    assert sorted(operation["responses"]) == ["200", "400", "404", "413", "415", "429", "500", "503"]
    for status in ("400", "404", "413", "415", "429", "500", "503"):
        schema = operation["responses"][status]["content"]["application/json"]["schema"]
        assert schema["required"] == ["error"]
        assert schema["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for status in ("429", "503"):
        assert set(operation["responses"][status]["headers"]) == {"Retry-After", "retry-after-ms", "x-should-retry"}
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


# Each (field, value) lies just outside what the schema allows; the server must refuse it (400).
OUTSIDE_THE_SCHEMA: list[tuple[str, object, str]] = [
    ("messages", [], "minItems"),
    ("n", 129, "maximum"),
    ("n", 0, "minimum"),
    ("max_tokens", 0, "minimum"),
    ("max_completion_tokens", 0, "minimum"),
    ("min_tokens", -1, "minimum"),
    ("temperature", -0.5, "minimum"),
    ("top_p", 0, "exclusiveMinimum"),
    ("top_p", 1.5, "maximum"),
    ("top_k", -1, "minimum"),
    ("min_p", 1.5, "maximum"),
    ("repetition_penalty", 0, "exclusiveMinimum"),
    ("frequency_penalty", 2.5, "maximum"),
    ("presence_penalty", -2.5, "minimum"),
    ("seed", -1, "minimum"),
    ("top_logprobs", -1, "minimum"),
    ("prompt_logprobs", 1, "maximum"),
    ("stop", "", "minLength"),
    ("stop", ["a", "b", "c", "d", "e"], "maxItems"),
    ("stop_token_ids", [-1], "minimum"),
    ("stop_token_ids", list(range(17)), "maxItems"),
    ("stop_token_sequences", [[]], "minItems"),
    ("stop_token_sequences", [[1]] * 17, "maxItems"),
    ("stop_token_sequences", [[1] * 65], "maxItems"),
    ("tool_choice", "sometimes", "enum"),
    ("store", True, "enum"),
    ("service_tier", "flex", "enum"),
    ("modalities", ["audio"], "enum"),
    ("logit_bias", {"1": 1.0}, "enum"),
    ("audio", {}, "type"),
    ("response_format", {"type": "xml"}, "enum"),
]


def _schema_refuses(node: dict[str, Any], keyword: str) -> bool:
    """Whether ``keyword`` constrains the field (on it, an alternative, or its items)."""
    text = json.dumps(node)
    return f'"{keyword}"' in text or (keyword == "type" and node.get("type") == "null")


@pytest.mark.parametrize(("field", "value", "keyword"), OUTSIDE_THE_SCHEMA)
def test_the_schema_states_what_the_server_refuses(served: Served, field: str, value: object, keyword: str) -> None:
    properties = _openapi(served)["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"
    ]["schema"]["properties"]
    assert _schema_refuses(properties[field], keyword), properties[field]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    response = chat(served.base_url, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_sequences": [[]]}, "stop_token_sequences"),
        ({"stop": "x", "stop_token_ids": [1]}, "stop"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "stop": "x"}, "stop"),
    ],
)
def test_stop_and_format_refusals_name_their_field(served: Served, extra: dict[str, Any], param: str) -> None:
    response = chat(served.base_url, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


# -- capacity refusals ------------------------------------------------------------------------------
def test_a_request_beyond_the_context_is_a_permanent_503(served: Served) -> None:
    response = chat(served.base_url, max_tokens=60)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "admission_rejected" and error["code"] == 503
    assert error["param"] == "max_tokens"
    assert "context of 64 tokens" in error["message"]
    assert response.headers["x-should-retry"] == "false"
    assert "retry-after" not in response.headers


def test_the_official_client_does_not_retry_a_permanent_503(served: Served) -> None:
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", timeout=30)  # default retries
    assert client.max_retries >= 1
    before = served.running.engine.statistics().rejected
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60)
    assert caught.value.status_code == 503
    assert served.running.engine.statistics().rejected == before + 1  # one request reached the server


def test_a_stream_beyond_the_context_names_the_param_in_its_error_event(served: Served) -> None:
    response = chat(served.base_url, max_tokens=60, stream=True)
    assert response.status_code == 200
    name, data = sse_events(response)[-1]
    assert name == "error"
    assert data["error"]["type"] == "admission_rejected"
    assert data["error"]["param"] == "max_tokens"
    assert "context of 64 tokens" in data["error"]["message"]


def test_full_ingress_is_429_with_retry_after(served: Served) -> None:
    with served.slow(0.03), held_requests(served.base_url, 4) as statuses:  # queue_capacity 2 + max_active 2
        refused = chat(served.base_url, max_tokens=2)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "x-should-retry" not in refused.headers
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert statuses == [200] * 4


# -- 500s: one log line each ------------------------------------------------------------------------
@pytest.fixture
def failing_launches(served: Served) -> Iterator[None]:
    """Every model launch raises (the engine fails the round's requests: ExecutionFailed)."""
    backend = served.running.model.backend
    original = backend.run

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    backend.run = fail
    try:
        yield
    finally:
        backend.run = original


def _failure_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if request_id in r.getMessage() and r.levelno >= logging.WARNING]


def test_a_500_logs_one_line_with_its_request_id_and_error_class(
    served: Served, failing_launches: None, caplog: pytest.LogCaptureFixture
) -> None:
    response = chat(served.base_url, max_tokens=2)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "execution_error"
    request_id = response.headers["x-request-id"]
    assert request_id.startswith("chatcmpl-")
    (line,) = _failure_lines(caplog, request_id)
    assert line.startswith(f"request {request_id} failed: ExecutionError: ")
    assert "device lost" in line and "\n" not in line


def test_an_sse_execution_error_logs_one_line(
    served: Served, failing_launches: None, caplog: pytest.LogCaptureFixture
) -> None:
    response = chat(served.base_url, max_tokens=2, stream=True)
    events = sse_events(response)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "execution_error"
    request_id = events[0][1]["id"]
    assert response.headers["x-request-id"] == request_id
    (line,) = _failure_lines(caplog, request_id)
    assert line.startswith(f"request {request_id} failed: ExecutionError: ")


# -- output failures count as failed ------------------------------------------------------------------
def _raise(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("parser broke")


@pytest.mark.parametrize(
    ("method", "stream", "ends_as"),
    [
        ("collect", False, "cancelled"),  # while generating: the server stops the request
        ("stream_token", True, "cancelled"),
        ("completion", False, "length"),  # after the worker finished it
        ("stream_finish", True, "length"),
    ],
)
def test_an_output_failure_counts_as_failed(
    served: Served,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    method: str,
    stream: bool,
    ends_as: str,
) -> None:
    served.wait_idle()
    plain, finished = _metrics(served)
    failed_before, ended_before = plain["helios_requests_failed_total"], finished.get(ends_as, 0)
    monkeypatch.setattr(Presenter, method, _raise)
    with served.slow(0.02):
        response = chat(served.base_url, max_tokens=8, ignore_eos=True, stream=stream)
    if stream:
        name, data = sse_events(response)[-1]
        assert name == "error"
        error = data["error"]
        request_id = response.headers["x-request-id"]
    else:
        assert response.status_code == 500
        error = response.json()["error"]
        request_id = response.headers["x-request-id"]
    assert error["type"] == "execution_error"
    assert error["message"] == "output handling failed: ValueError: parser broke"
    (line,) = _failure_lines(caplog, request_id)
    assert line.startswith(f"request {request_id} failed: ExecutionError: output handling failed")
    served.wait_idle()
    wait_for(lambda: _metrics(served)[0]["helios_requests_failed_total"] == failed_before + 1)
    time.sleep(0.1)  # a later snapshot must not count the request's end as well
    plain, finished = _metrics(served)
    assert plain["helios_requests_failed_total"] == failed_before + 1
    assert finished.get(ends_as, 0) == ended_before


# -- SSE data lines ---------------------------------------------------------------------------------
LINE_BREAKING = "a\u2028b\u2029c\x85d\re\nf\x0bg\x0ch\x1ci\x1dj\x1ek"


def test_sse_data_is_one_line_for_any_text() -> None:
    for event in (sse_data({"content": LINE_BREAKING}), sse_error({"error": {"message": LINE_BREAKING}})):
        payload = event.decode("utf-8").removesuffix("\n\n")
        data_line = payload.splitlines()[-1]
        assert len(payload.splitlines()) == (2 if payload.startswith("event:") else 1)
        assert data_line.startswith("data: ")
        decoded = json.loads(data_line.removeprefix("data: "))
        assert decoded in ({"content": LINE_BREAKING}, {"error": {"message": LINE_BREAKING}})
        for character in ("\u2028", "\u2029", "\x85", "\r"):
            assert character not in payload


def test_generated_line_separators_stay_inside_one_data_line(served: Served) -> None:
    text = "x\u2028y\u2029z\x85w\rv"
    with scripted_replies(served.running) as say:
        say(text)
        response = chat(served.base_url, max_tokens=30, stream=True)
    raw = response.text
    for character in ("\u2028", "\u2029", "\x85", "\r"):
        assert character not in raw
    lines = [line for line in raw.splitlines() if line]  # str.splitlines breaks at all of them
    assert all(line.startswith("data: ") for line in lines)
    content = "".join(
        chunk["choices"][0]["delta"].get("content", "")
        for chunk in (json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]")
        if chunk["choices"]
    )
    assert content == text


# -- shutdown -------------------------------------------------------------------------------------
def test_shutdown_ends_running_responses_with_their_terminal_error(caplog: pytest.LogCaptureFixture) -> None:
    running = start(
        CORE,
        TrustSettings((KEYS / "signing.pub.pem",), NAMESPACE, None),
        LoadOptions(max_active=2, queue_capacity=4),
        backend="reference",
    )
    backend = running.model.backend
    real_run = backend.run

    def slow_run(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return real_run(*args, **kwargs)

    backend.run = slow_run
    port = free_port()
    app = create_app(running)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None)  # keeps caplog's handler
    server = draining_server(config, chat_service(app).drop_responses, drain_seconds=0.5, flush_seconds=0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: bool(server.started))
    results: dict[int, httpx.Response] = {}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True}

    def send(index: int) -> None:
        results[index] = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": index < 3}, timeout=30
        )

    clients = [threading.Thread(target=send, args=(index,)) for index in range(4)]
    try:
        for client in clients:
            client.start()
        wait_for(lambda: len(chat_service(app)._responses) == 4)
        server.should_exit = True  # what SIGTERM sets
        thread.join(timeout=20)
        for client in clients:
            client.join(timeout=20)
    finally:
        running.close()
    message = "the server shut down: the response was still running after the 0.5 s drain period"
    ids = []
    for index in range(3):
        events = sse_events(results[index])
        assert events[-1] == ("error", {"error": {"message": message, "type": "cancelled", "param": None, "code": 503}})
        assert (None, "[DONE]") not in events
        ids.append(events[0][1]["id"])
    assert results[3].status_code == 503
    assert results[3].json()["error"] == {"message": message, "type": "cancelled", "param": None, "code": 503}
    ids.append(results[3].headers["x-request-id"])
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert sorted(lines) == sorted(f"request {request_id} dropped before it finished: {message}" for request_id in ids)
    assert not [r for r in caplog.records if r.exc_info]


def test_a_body_cut_off_by_a_disconnect_is_no_failure(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    host, port = served.base_url.removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()
    before = metric_values(served.base_url)
    with caplog.at_level(logging.INFO), socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(head + body)  # a hundred bytes short of what it declares, then gone
    time.sleep(0.5)  # the server reads to the disconnect and answers no one
    after = metric_values(served.base_url)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert after["helios_requests_failed_total"] == before["helios_requests_failed_total"]
    assert chat(served.base_url, messages=[{"role": "user", "content": "hi"}], max_tokens=2).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models", f"/v1/models/{MODEL}"])
def test_head_on_a_read_route_answers_the_get_headers_without_a_body(served: Served, path: str) -> None:
    got = httpx.get(served.base_url + path, timeout=10)
    head = httpx.head(served.base_url + path, timeout=10)
    assert (head.status_code, got.status_code) == (200, 200)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the exposition's counters may move between the two requests
        assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content))


def test_head_on_a_generation_route_is_405(served: Served) -> None:
    response = httpx.head(served.base_url + "/v1/chat/completions", timeout=10)
    assert response.status_code == 405
    assert "POST" in response.headers["allow"] and "HEAD" not in response.headers["allow"]
