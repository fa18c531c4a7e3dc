"""One bad request never fails another, through the real server.

Each bad payload is sent while three healthy greedy streams are in flight. A payload preparation can
judge is a 400 naming the field; one that can only fail in the model worker gets its own error, and
the three healthy streams finish with exactly the text and token ids they produce alone.

The core is a tiny synthetic one with the JSON-tag tool syntax (so forced tool calls compile), four
model slots and slowed launches, so the healthy requests are running when the bad one arrives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import Served, serve_fixture
from .helpers import build_synthetic_core, sse_events

NAMESPACE = "helios-tests/isolation"
HEALTHY = ("Hello there", "hi", "What is up?")
LIMIT = 16
HUGE_REPEAT = "^a{1000000000}$"
"""A pattern that compiles, whose lexer gives up once a string is started (too many expressions)."""


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": parameters}}],
        "tool_choice": "required",
    }


SELF_REFERENCE = {"$ref": "#"}
DEFS_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
HUGE_STRING = {"type": "string", "pattern": HUGE_REPEAT}
HUGE_ARGUMENT = {"type": "object", "properties": {"a": HUGE_STRING}, "required": ["a"]}
LATE_HUGE_STRING = {
    "type": "object",
    "properties": {"x": {"type": "boolean"}, "a": HUGE_STRING},
    "required": ["x", "a"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
"""Passes preparation (its first token is fine); the string whose lexer gives up comes after a boolean."""

NO_MASK = "the schema cannot be enforced: grammar matcher failed: NoExtensionBias"
LEXER = "lexer error: too many expressions constructed"
F32_MAX = "3.4028235e+38"
F32_TINY = "1.1754944e-38"

REFUSED = [
    pytest.param(_schema(SELF_REFERENCE), "response_format", f"response_format: {NO_MASK}", id="self-reference"),
    pytest.param(_schema(DEFS_LOOP), "response_format", f"response_format: {NO_MASK}", id="defs-loop"),
    pytest.param(
        _schema(HUGE_STRING),
        "response_format",
        f"response_format: the schema cannot be enforced: grammar rejected token id 34: {LEXER}",
        id="huge-pattern",
    ),
    pytest.param(
        _tool(SELF_REFERENCE),
        "tools",
        f"tools: function 'lookup' parameters: {NO_MASK}",
        id="tool-self-reference",
    ),
    pytest.param(
        _tool(HUGE_ARGUMENT),
        "tools",
        f"tools: the schema cannot be enforced: grammar rejected token id 259: {LEXER}",
        id="tool-huge-pattern",
    ),
    pytest.param({"temperature": 1e308}, "temperature", f"temperature must lie in [0, {F32_MAX}], not 1e+308"),
    pytest.param({"top_p": 1e-320}, "top_p", f"top_p must lie in [{F32_TINY}, 1], not 1e-320"),
    pytest.param({"top_k": 2**62}, "top_k", "top_k must lie in [0, 2147483647], not 4611686018427387904"),
    pytest.param(
        {"repetition_penalty": 1e308},
        "repetition_penalty",
        f"repetition_penalty must lie in [{F32_TINY}, {F32_MAX}], not 1e+308",
        id="repetition_penalty-huge",
    ),
    pytest.param(
        {"repetition_penalty": 1e-308},
        "repetition_penalty",
        f"repetition_penalty must lie in [{F32_TINY}, {F32_MAX}], not 1e-308",
        id="repetition_penalty-tiny",
    ),
    pytest.param({"min_p": 1e308}, "min_p", "min_p must lie in [0, 1], not 1e+308"),
    pytest.param(
        {"frequency_penalty": 1e308}, "frequency_penalty", "frequency_penalty must lie in [-2, 2], not 1e+308"
    ),
    pytest.param({"presence_penalty": -1e308}, "presence_penalty", "presence_penalty must lie in [-2, 2], not -1e+308"),
    pytest.param({"seed": -1}, "seed", "seed must lie in [0, 18446744073709551615], not -1"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    built = build_synthetic_core(
        tmp_path_factory.mktemp("isolation"), NAMESPACE, seed=11, tool_syntax="json-tags", context=512, max_rows=4,
        prefill_tokens=(64,), decode_rows=(1, 2, 4),
    )  # fmt: skip
    with serve_fixture(core=built.path, trust=built.trust, max_active=4, queue_capacity=4) as value:
        yield value


def _post(served: Served, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)


def _healthy(served: Served, content: str) -> tuple[str, list[int]]:
    """The text and token ids of one healthy greedy stream (fails on anything but a normal finish)."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": LIMIT,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    response = _post(served, body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]"), events[-3:]
    chunks = [data for _, data in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    ids = [i for c in chunks if c["choices"] for i in c["choices"][0].get("token_ids") or []]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    return text, ids


@pytest.fixture(scope="module")
def alone(served: Served) -> list[tuple[str, list[int]]]:
    return [_healthy(served, content) for content in HEALTHY]


def _beside(served: Served, bad: dict[str, Any]) -> tuple[list[tuple[str, list[int]]], httpx.Response]:
    """Start the healthy streams, send ``bad`` once they are all running, and collect everything."""
    results: list[tuple[str, list[int]] | BaseException | None] = [None] * len(HEALTHY)

    def run(index: int) -> None:
        try:
            results[index] = _healthy(served, HEALTHY[index])
        except BaseException as exc:  # reported by the test thread
            results[index] = exc

    with served.slow(0.01):
        threads = [threading.Thread(target=run, args=(index,)) for index in range(len(HEALTHY))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while served.running.engine.statistics().active_requests < len(HEALTHY):
            assert time.monotonic() < deadline, "the healthy requests did not start"
            time.sleep(0.005)
        body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": LIMIT, "stream": True, **bad}
        response = _post(served, body)
        for thread in threads:
            thread.join(60)
    healthy: list[tuple[str, list[int]]] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        healthy.append(result)
    served.wait_idle()
    return healthy, response


@pytest.mark.parametrize(("bad", "param", "message"), REFUSED)
def test_a_bad_request_is_refused_and_the_others_complete(
    served: Served, alone: list[tuple[str, list[int]]], bad: dict[str, Any], param: str, message: str
) -> None:
    healthy, response = _beside(served, bad)
    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}
    }
    assert healthy == alone


def test_a_schema_that_fails_in_the_worker_ends_only_its_stream(
    served: Served, alone: list[tuple[str, list[int]]]
) -> None:
    healthy, response = _beside(served, {"temperature": 0, **_schema(LATE_HUGE_STRING)})
    assert response.status_code == 200
    events = sse_events(response)
    name, error = events[-1]
    assert name == "error"
    assert error["error"]["type"] == "execution_error" and error["error"]["code"] == 500
    assert error["error"]["message"].startswith("structured output failed: grammar rejected token id ")
    assert error["error"]["message"].endswith(LEXER)
    assert healthy == alone


@pytest.mark.parametrize("penalty", [1.1754944e-38, 3.4028235e38])
def test_a_repetition_penalty_at_either_end_of_its_range_fails_nothing(
    served: Served, alone: list[tuple[str, list[int]]], penalty: float
) -> None:
    healthy, response = _beside(served, {"repetition_penalty": penalty, "temperature": 0.7, "seed": 3})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]")
    finish = [data["choices"][0]["finish_reason"] for _, data in events[:-1] if data["choices"]][-1]
    assert finish in ("length", "stop")
    assert healthy == alone


@pytest.mark.parametrize("spelled", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
def test_a_schema_whose_text_spells_a_special_token_is_written_as_text(
    served: Served, alone: list[tuple[str, list[int]]], spelled: str
) -> None:
    healthy, response = _beside(served, {"temperature": 0, "stream": False, **_schema({"enum": [spelled]})})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == f'"{spelled}"'
    assert healthy == alone
