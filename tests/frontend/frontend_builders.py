"""Shared builders for the frontend tests: a byte-level tokenizer with single-token controls and
one FrontendContract per syntax family, each paired with think-tag reasoning."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ignition.preparation import frontend as declarations

from helios_core.plugin_api import CLOSED_ENVELOPE, EnvelopeState, ToolSpec
from helios_core.testing import FrontendHarness
from helios_core.wire import contract_pb2 as ct

SPECIAL = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|eom|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
]

TOOLS = [
    ToolSpec(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "tags": {"type": "array"},
                "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
        },
    ),
    ToolSpec("search", {"type": "object", "properties": {"query": {"type": "string"}}}),
]


def think(frontend: ct.FrontendContract, *, terminal: str = "") -> ct.FrontendContract:
    return declarations.with_think_tags(frontend, terminal=bool(terminal))


def base(tool_parser: int) -> ct.FrontendContract:
    return declarations.plain(tool_parser)


# The families as Ignition declares them, each paired with think-tag reasoning where the family
# leaves reasoning open (XTML and recipient-header frames carry their own).
def function_tags() -> ct.FrontendContract:
    return think(declarations.function_tags(), terminal="<tool_call>")


def argument_tags() -> ct.FrontendContract:
    return think(declarations.argument_tags(), terminal="<tool_call>")


DSML_MARK = declarations.DSML_MARK


def dsml() -> ct.FrontendContract:
    return think(declarations.dsml())


def json_tags() -> ct.FrontendContract:
    return think(declarations.json_tags(), terminal="<tool_call>")


def xtml() -> ct.FrontendContract:
    return declarations.xtml()


def recipient_header() -> ct.FrontendContract:
    return declarations.recipient_header()


def harness(
    tokenizer: Any,
    frontend: ct.FrontendContract,
    *,
    tools: Sequence[ToolSpec] = TOOLS,
    envelope: EnvelopeState = CLOSED_ENVELOPE,
    structured_answer: bool = False,
) -> FrontendHarness:
    return FrontendHarness(tokenizer, frontend, tools=tools, envelope=envelope, structured_answer=structured_answer)


def calls(result: Any) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in result.output.tool_calls]


def check(
    h: FrontendHarness, text: str, reasoning: str | None, content: str | None, expected_calls: list[tuple[str, Any]]
) -> None:
    """The unstreamed result is as expected and every split point streams to it."""
    result = h.check_split_invariance(text)
    assert (result.output.reasoning, result.output.content, calls(result)) == (reasoning, content, expected_calls)
    assert result.finish_reason == ("tool_calls" if expected_calls else "stop")
