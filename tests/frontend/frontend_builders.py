"""Shared builders for the frontend tests: a byte-level tokenizer with single-token controls and
one FrontendContract per syntax family, each paired with think-tag reasoning."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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
    frontend.reasoning_parser = ct.REASONING_PARSER_THINK_TAGS
    frontend.reasoning_syntax.open = "<think>"
    frontend.reasoning_syntax.close = "</think>"
    frontend.reasoning_syntax.wrapping_newlines = True
    frontend.reasoning_syntax.terminal_marker = terminal
    return frontend


def base(tool_parser: int) -> ct.FrontendContract:
    return ct.FrontendContract(
        tool_parser=tool_parser,
        reasoning_parser=ct.REASONING_PARSER_NONE,
        image_preparation=ct.IMAGE_PREPARATION_NONE,
        image_layout=ct.IMAGE_LAYOUT_NONE,
    )


def function_tags() -> ct.FrontendContract:
    fe = base(ct.TOOL_PARSER_FUNCTION_TAGS)
    fe.tool_syntax.opener = "<tool_call>"
    t = fe.tool_syntax.function_tags
    t.call_open, t.call_close = "<tool_call>", "</tool_call>"
    t.function_prefix, t.function_close = "<function=", "</function>"
    t.parameter_prefix, t.parameter_close = "<parameter=", "</parameter>"
    t.wrapping_newlines = True
    return think(fe, terminal="<tool_call>")


def argument_tags() -> ct.FrontendContract:
    fe = base(ct.TOOL_PARSER_ARGUMENT_TAGS)
    fe.tool_syntax.opener = "<tool_call>"
    t = fe.tool_syntax.argument_tags
    t.call_open, t.call_close = "<tool_call>", "</tool_call>"
    t.key_open, t.key_close, t.value_open, t.value_close = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    t.name_separator = "\n"
    return think(fe, terminal="<tool_call>")


DSML_MARK = "｜DSML｜"


def dsml() -> ct.FrontendContract:
    fe = base(ct.TOOL_PARSER_DSML)
    fe.tool_syntax.opener = f"<{DSML_MARK}function_calls>"
    d = fe.tool_syntax.dsml
    d.marker, d.block, d.invoke, d.parameter = DSML_MARK, "function_calls", "invoke", "parameter"
    d.block_separator = "\n\n"
    return think(fe)


def json_tags() -> ct.FrontendContract:
    fe = base(ct.TOOL_PARSER_JSON_TAGS)
    fe.tool_syntax.opener = "<tool_call>"
    fe.tool_syntax.json_tags.call_open, fe.tool_syntax.json_tags.call_close = "<tool_call>", "</tool_call>"
    return think(fe, terminal="<tool_call>")


def xtml() -> ct.FrontendContract:
    fe = base(ct.TOOL_PARSER_XTML)
    fe.tool_syntax.opener = "<|open|>tools<|sep|>"
    x = fe.tool_syntax.xtml
    x.block_open, x.block_close = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
    x.call_element, x.arg_element, x.think_element = "call", "argument", "think"
    fe.reasoning_parser = ct.REASONING_PARSER_XTML_THINK
    fe.reasoning_syntax.open, fe.reasoning_syntax.close = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
    return fe


def recipient_header() -> ct.FrontendContract:
    fe = base(ct.TOOL_PARSER_ATEM)
    fe.tool_syntax.opener = "<atem:function_calls>"
    a = fe.tool_syntax.atem
    a.prefix, a.block, a.invoke, a.parameter = "atem:", "function_calls", "invoke", "parameter"
    fe.reasoning_parser = ct.REASONING_PARSER_RECIPIENT_HEADER
    h = fe.reasoning_syntax.recipient_header
    h.start, h.assistant_role, h.recipient_prefix, h.message = "<|start|>", "assistant", " to=", "<|message|>"
    h.end, h.end_of_message, h.reasoning_recipient = "<|end|>", "<|eom|>", "self"
    h.content_recipients.extend(["commentary", "user"])
    h.generic_tool_recipient, h.named_tool_prefix = "functions", "functions."
    return fe


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
