"""Schemas whose matcher fails at once are refused before generation even where framing comes first.

On a core whose grammar opens with free text (think-tag reasoning; XTML think and recipient-header
frames) or with a tool call's opener and name, the first masks of the whole grammar never reach the
schema. A response format or a forced call's parameters whose matcher fails at once (a ``$ref`` loop) is
still a 400 naming the field, as on a core without framing, and never a failure mid-generation. A function
declared without ``parameters`` takes none: a call forced to it has the arguments ``{}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Served, serve_fixture
from .helpers import build_synthetic_core

NAMESPACE = "helios-tests/schema-checks"
SELF_REFERENCE = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}
DEFS_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NO_MASK = "the schema cannot be enforced: grammar matcher failed: NoExtensionBias"
SYNTAXES = [("json-tags", "think-tags"), ("xtml", "none"), ("recipient-header", "none")]


def _serve(tmp: Path, syntax: str, reasoning: str) -> Iterator[Served]:
    built = build_synthetic_core(tmp, NAMESPACE, seed=5, tool_syntax=syntax, reasoning=reasoning)
    with serve_fixture(core=built.path, trust=built.trust) as served:
        yield served


@pytest.fixture(scope="module", params=SYNTAXES, ids=[syntax for syntax, _ in SYNTAXES])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    syntax, reasoning = request.param
    yield from _serve(tmp_path_factory.mktemp(syntax), syntax, reasoning)


def _post(served: Served, **body: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 400, "temperature": 1.0, **body}
    return httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=120)


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    return error


@pytest.mark.parametrize("schema", [SELF_REFERENCE, DEFS_LOOP], ids=["self-reference", "defs-loop"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_response_format_whose_matcher_fails_at_once_is_400(served: Served, schema: Any, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for seed in range(3):  # before, the reasoning text sampled first decided when (and whether) it failed
        error = _error(_post(served, response_format=response_format, seed=seed, stream=stream))
        assert (error["param"], error["message"]) == ("response_format", f"response_format: {NO_MASK}")


def _lookup(parameters: dict[str, Any] | None) -> list[dict[str, Any]]:
    function: dict[str, Any] = {"name": "lookup"}
    if parameters is not None:
        function["parameters"] = parameters
    return [{"type": "function", "function": function}]


@pytest.mark.parametrize("parameters", [SELF_REFERENCE, DEFS_LOOP], ids=["self-reference", "defs-loop"])
def test_forced_call_parameters_whose_matcher_fails_at_once_are_400(served: Served, parameters: Any) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        error = _error(_post(served, tools=_lookup(parameters), tool_choice=choice))
        assert error["param"] == "tools"
        if served.running.verified.contract.model.frontend.tool_syntax.WhichOneof("family") == "json_tags":
            assert error["message"] == f"tools: function 'lookup' parameters: {NO_MASK}"
        else:  # the tag syntaxes refuse references first
            assert error["message"] == (
                "tools (lookup): schema keyword(s) $defs, $ref cannot be enforced in this core's tool syntax"
            )


@pytest.fixture(scope="module")
def json_tags(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """JSON tags without reasoning: a forced call is the first thing generated."""
    yield from _serve(tmp_path_factory.mktemp("json-tags-plain"), "json-tags", "none")


def test_a_call_forced_to_a_function_without_parameters_has_no_arguments(json_tags: Served) -> None:
    for seed in range(3):
        response = _post(json_tags, tools=_lookup(None), tool_choice="required", seed=seed)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert [(call["function"]["name"], call["function"]["arguments"]) for call in calls] == [("lookup", "{}")]


def test_pydantic_style_references_in_forced_call_parameters_resolve(json_tags: Served) -> None:
    """``#/$defs/...`` references resolve against the parameters schema, which the JSON-tag call schema
    nests under ``arguments``."""
    parameters = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"],
        "additionalProperties": False,
        "$defs": {
            "Item": {
                "type": "object",
                "properties": {"size": {"enum": ["small", "large"]}},
                "required": ["size"],
                "additionalProperties": False,
            }
        },
    }
    for seed in range(3):
        response = _post(json_tags, tools=_lookup(parameters), tool_choice="required", seed=seed)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) in ({"item": {"size": "small"}}, {"item": {"size": "large"}})
