"""Structured answers and forced tool calls at the HTTP boundary: what a request may ask for and how their
logprobs read.

The served core is a tiny synthetic one with the JSON-tag tool syntax (random weights, byte-level
tokenizer, top-5 logprobs in every generating program).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helios_core.server.presentation import LOGPROB_FLOOR

from .conftest import Served, serve_fixture
from .helpers import build_synthetic_core, sse_events

NAMESPACE = "helios-tests/structured-answers"
ONE_WORD: dict[str, Any] = {"type": "json_schema", "json_schema": {"name": "word", "schema": {"enum": ["yes"]}}}
"""An answer of exactly one document, ``"yes"``: one allowed id at each position."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    built = build_synthetic_core(tmp_path_factory.mktemp("structured"), NAMESPACE, tool_syntax="json-tags")
    with serve_fixture(core=built.path, trust=built.trust) as value:
        yield value


def post(served: Served, **body: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer."}], **body}
    return httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)


def test_alternatives_a_grammar_rules_out_are_reported_at_the_floor(served: Served) -> None:
    response = post(served, response_format=ONE_WORD, logprobs=True, top_logprobs=3, temperature=0, max_tokens=10)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == '"yes"'
    entries = choice["logprobs"]["content"]
    assert [entry["token"] for entry in entries] == ['"', "y", "e", "s", '"']
    for entry in entries:
        assert entry["logprob"] == 0.0  # the only allowed id takes the whole distribution
        best, *ruled_out = entry["top_logprobs"]
        assert best["token"] == entry["token"] and best["logprob"] == 0.0
        assert [alternative["logprob"] for alternative in ruled_out] == [LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_streamed_alternatives_are_numbers_too(served: Served) -> None:
    body = {"response_format": ONE_WORD, "logprobs": True, "top_logprobs": 2, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        served.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Answer."}], **body},
        timeout=60,
    ) as response:
        response.read()
    logprobs = [
        alternative["logprob"]
        for name, event in sse_events(response)
        if name is None and event != "[DONE]" and event["choices"] and event["choices"][0]["logprobs"]
        for entry in event["choices"][0]["logprobs"]["content"]
        for alternative in entry["top_logprobs"]
    ]
    assert len(logprobs) == 10
    assert all(isinstance(value, float) and math.isfinite(value) for value in logprobs)
    assert logprobs.count(LOGPROB_FLOOR) == 5


@pytest.mark.parametrize("kind", ["string", "array", "integer", ["object", "null"]])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_function_parameters_that_are_not_an_object_schema_are_a_400(
    served: Served, kind: object, tool_choice: str
) -> None:
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": kind}}},
    ]
    response = post(served, tools=tools, tool_choice=tool_choice, max_tokens=4)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert error["message"] == (
        "tools[1].function.parameters must be a JSON schema of type 'object' (a function's arguments are an "
        f"object), not {json.dumps(kind)}"
    )


def test_parameters_without_a_type_are_accepted(served: Served) -> None:
    tools = [{"type": "function", "function": {"name": "g", "parameters": {"properties": {"a": {"type": "string"}}}}}]
    response = post(served, tools=tools, max_tokens=2)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "broken"}}])
def test_a_forced_call_names_the_function_whose_schema_does_not_compile(served: Served, tool_choice: object) -> None:
    tools = [
        {"type": "function", "function": {"name": "fine", "parameters": {"type": "object"}}},
        {
            "type": "function",
            "function": {"name": "broken", "parameters": {"type": "object", "properties": {"a": {"type": "x"}}}},
        },
    ]
    response = post(served, tools=tools, tool_choice=tool_choice, max_tokens=4)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert error["message"].startswith("tools: function 'broken' parameters: ")
    assert "Invalid type: x" in error["message"]


@pytest.mark.parametrize("kind", ["json_object", "text"])
def test_a_null_json_schema_beside_another_type_is_absent(served: Served, kind: str) -> None:
    response = post(served, response_format={"type": kind, "json_schema": None}, max_tokens=2)
    assert response.status_code == 200, response.text
