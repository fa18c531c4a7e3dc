"""Reusable frontend declarations: the syntax data of each built-in tool and reasoning family.

Owns the FrontendContract presets a recipe picks from, with the markers of the formats as published
(overridable per recipe), and the selection of other parsers (third-party plugins) over a preset.
They are syntax data only: Helios selects parsers by the enum identifiers and never by a model's
name, and the contract's validation checks every pairing rule (a reasoning terminal marker equals
the tool opener; XTML think needs the XTML tool parser; recipient-header reasoning needs ATEM).
"""

from __future__ import annotations

from helios_core.wire import contract_pb2 as ct

DSML_MARK = "｜DSML｜"


def plain(tool_parser: int = ct.TOOL_PARSER_NONE) -> ct.FrontendContract:
    """No reasoning channel, no image inputs, and the given tool parser."""
    return ct.FrontendContract(
        tool_parser=tool_parser,  # type: ignore[arg-type]
        reasoning_parser=ct.REASONING_PARSER_NONE,
        image_preparation=ct.IMAGE_PREPARATION_NONE,
        image_layout=ct.IMAGE_LAYOUT_NONE,
    )


def with_parsers(
    frontend: ct.FrontendContract | None, *, tool_parser: int | None = None, reasoning_parser: int | None = None
) -> ct.FrontendContract:
    """A copy of ``frontend`` (None: :func:`plain`) that selects ``tool_parser`` and ``reasoning_parser``
    (a third-party plugin's identifiers, say) where given. Its syntax data stays, for the selected
    implementations to read; the contract's validation still checks the pairing rules."""
    selected = plain()
    if frontend is not None:
        selected.CopyFrom(frontend)
    if tool_parser is not None:
        selected.tool_parser = tool_parser  # type: ignore[assignment]
    if reasoning_parser is not None:
        selected.reasoning_parser = reasoning_parser  # type: ignore[assignment]
    return selected


def with_think_tags(
    frontend: ct.FrontendContract, *, open_tag: str = "<think>", close_tag: str = "</think>", terminal: bool = False
) -> ct.FrontendContract:
    """Add think-tag reasoning; ``terminal`` makes the tool opener end reasoning implicitly."""
    frontend.reasoning_parser = ct.REASONING_PARSER_THINK_TAGS
    frontend.reasoning_syntax.open = open_tag
    frontend.reasoning_syntax.close = close_tag
    frontend.reasoning_syntax.wrapping_newlines = True
    frontend.reasoning_syntax.terminal_marker = frontend.tool_syntax.opener if terminal else ""
    return frontend


def function_tags(*, call_open: str = "<tool_call>", call_close: str = "</tool_call>") -> ct.FrontendContract:
    """``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n</tool_call>``."""
    frontend = plain(ct.TOOL_PARSER_FUNCTION_TAGS)
    frontend.tool_syntax.opener = call_open
    tags = frontend.tool_syntax.function_tags
    tags.call_open, tags.call_close = call_open, call_close
    tags.function_prefix, tags.function_close = "<function=", "</function>"
    tags.parameter_prefix, tags.parameter_close = "<parameter=", "</parameter>"
    tags.wrapping_newlines = True
    return frontend


def argument_tags(*, call_open: str = "<tool_call>", call_close: str = "</tool_call>") -> ct.FrontendContract:
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``."""
    frontend = plain(ct.TOOL_PARSER_ARGUMENT_TAGS)
    frontend.tool_syntax.opener = call_open
    tags = frontend.tool_syntax.argument_tags
    tags.call_open, tags.call_close = call_open, call_close
    tags.key_open, tags.key_close = "<arg_key>", "</arg_key>"
    tags.value_open, tags.value_close = "<arg_value>", "</arg_value>"
    tags.name_separator = "\n"
    return frontend


def dsml(*, marker: str = DSML_MARK) -> ct.FrontendContract:
    """``<MARKfunction_calls>`` / ``<MARKinvoke name=...>`` / ``<MARKparameter name=... string=...>`` blocks."""
    frontend = plain(ct.TOOL_PARSER_DSML)
    frontend.tool_syntax.opener = f"<{marker}function_calls>"
    syntax = frontend.tool_syntax.dsml
    syntax.marker, syntax.block, syntax.invoke, syntax.parameter = marker, "function_calls", "invoke", "parameter"
    syntax.block_separator = "\n\n"
    return frontend


def json_tags(*, call_open: str = "<tool_call>", call_close: str = "</tool_call>") -> ct.FrontendContract:
    """``<tool_call>{"name": N, "arguments": {...}}</tool_call>``."""
    frontend = plain(ct.TOOL_PARSER_JSON_TAGS)
    frontend.tool_syntax.opener = call_open
    frontend.tool_syntax.json_tags.call_open = call_open
    frontend.tool_syntax.json_tags.call_close = call_close
    return frontend


def xtml(
    *, open_control: str = "<|open|>", close_control: str = "<|close|>", separator: str = "<|sep|>"
) -> ct.FrontendContract:
    """XTML tool blocks paired with XTML think reasoning (one parser family consumes both)."""
    frontend = plain(ct.TOOL_PARSER_XTML)
    block_open = f"{open_control}tools{separator}"
    frontend.tool_syntax.opener = block_open
    syntax = frontend.tool_syntax.xtml
    syntax.block_open, syntax.block_close = block_open, f"{close_control}tools{separator}"
    syntax.call_element, syntax.arg_element, syntax.think_element = "call", "argument", "think"
    frontend.reasoning_parser = ct.REASONING_PARSER_XTML_THINK
    frontend.reasoning_syntax.open = f"{open_control}think{separator}"
    frontend.reasoning_syntax.close = f"{close_control}think{separator}"
    return frontend


def recipient_header() -> ct.FrontendContract:
    """``<|start|>assistant to=RECIPIENT<|message|>...`` frames with ATEM function-call blocks."""
    frontend = plain(ct.TOOL_PARSER_ATEM)
    frontend.tool_syntax.opener = "<atem:function_calls>"
    atem = frontend.tool_syntax.atem
    atem.prefix, atem.block, atem.invoke, atem.parameter = "atem:", "function_calls", "invoke", "parameter"
    frontend.reasoning_parser = ct.REASONING_PARSER_RECIPIENT_HEADER
    header = frontend.reasoning_syntax.recipient_header
    header.start, header.assistant_role, header.recipient_prefix = "<|start|>", "assistant", " to="
    header.message, header.end, header.end_of_message = "<|message|>", "<|end|>", "<|eom|>"
    header.reasoning_recipient = "self"
    header.content_recipients.extend(["commentary", "user"])
    header.generic_tool_recipient, header.named_tool_prefix = "functions", "functions."
    return frontend
