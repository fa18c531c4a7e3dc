"""XTML tool calls (TOOL_PARSER_XTML) and XTML think reasoning (REASONING_PARSER_XTML_THINK), paired.

Owns both XTML implementations. XTML writes elements as ``OPEN NAME ATTRS SEP ... CLOSE NAME SEP``,
where the framing texts ``OPEN``, ``CLOSE`` and ``SEP`` (for example ``<|open|>``, ``<|close|>``,
``<|sep|>``, or ``<``, ``</``, ``>``) are derived from ``XtmlSyntax.block_open`` and
``block_close``: they must read ``OPEN NAME SEP`` and ``CLOSE NAME SEP`` for one element name.

Tool calls: the block ``block_open ... block_close`` holds calls ``OPEN call_element ATTRS SEP``
with their arguments ``OPEN arg_element ATTRS SEP VALUE CLOSE arg_element SEP`` and a closing
``CLOSE call_element SEP``. A call's name is its ``tool`` (or ``name``) attribute; an argument's
key its ``key`` (or ``name``) attribute. ``type="string"`` values are verbatim and stream; other
``type`` values are JSON-decoded (text kept when invalid); without ``type`` the schema decides.
Several calls in a block are parallel calls. Outside the block, every other XTML element tag
(a response element, a message close) is framing and is dropped.

Think reasoning: ``ReasoningSyntax.open`` / ``close`` (default ``OPEN think_element SEP`` /
``CLOSE think_element SEP``) delimit reasoning with the think-tag rules.

Constrained output: ``xtml_grammar`` writes the block holding one call, its arguments typed
``type="string"`` (verbatim), ``number``, ``boolean``, ``null``, ``array`` or ``object`` (JSON) by
their schema; ``xtml_think_envelope`` lets reasoning between the think delimiters come first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from helios_core.plugin_api import (
    STRING_TYPES,
    DelimitedEnvelope,
    DelimitedReasoning,
    GrammarFragment,
    GrammarWriter,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    StartupError,
    TagGrammar,
    ToolGrammarRequest,
    contract,
    parse_attributes,
    partial_suffix_length,
    require_syntax,
    scan_tagged_section,
    schema_type,
    tag_call_rules,
)
from helios_plugins.reasoning_think_tags import DelimitedReasoningParser

HELIOS_PLUGIN_API = (1, 0)

# the ``type`` attribute of a JSON-typed argument, by schema type (anything else: ``object``)
_XTML_TYPES = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null", "array": "array"}


def xtml_framing(block_open: str, block_close: str) -> tuple[str, str, str, str]:
    """``(OPEN, CLOSE, SEP, block element name)`` from the block's open and close texts."""
    for match in re.finditer(r"[A-Za-z_][\w.-]*", block_open):
        name, after = match.group(0), block_open[match.end() :]
        if block_close.endswith(name + after) and after:
            opening = block_open[: match.start()]
            closing = block_close[: len(block_close) - len(name + after)]
            if opening and closing and opening != closing:
                return opening, closing, after, name
    raise StartupError(
        f"tool_syntax.xtml.block_open {block_open!r} and block_close {block_close!r} must read "
        "OPEN NAME SEP and CLOSE NAME SEP"
    )


def _name(header: str) -> str | None:
    attributes = parse_attributes(header)
    return attributes.get("tool") or attributes.get("name") or None


def _key(header: str) -> tuple[str, bool | None] | None:
    attributes = parse_attributes(header)
    key = attributes.get("key") or attributes.get("name")
    if not key:
        return None
    kind = attributes.get("type")
    return key, None if kind is None else kind == "string"


class XtmlToolParser(SectionToolParser):
    """Streaming XTML tool parser for one request."""

    undeclared = "json"

    def __init__(self, context: ParserContext) -> None:
        syntax = context.frontend.tool_syntax
        xtml = syntax.xtml
        require_syntax(xtml, "tool_syntax.xtml", ("block_open", "block_close", "call_element", "arg_element"))
        self._open, self._close, self._sep, _ = xtml_framing(xtml.block_open, xtml.block_close)
        super().__init__(context, syntax.opener or xtml.block_open)
        o, c, s = self._open, self._close, self._sep
        self._grammar = TagGrammar(
            section_close=xtml.block_close,
            call_open=o + xtml.call_element,
            call_open_end=s,
            call_close=c + xtml.call_element + s,
            param_open=o + xtml.arg_element,
            param_open_end=s,
            param_close=c + xtml.arg_element + s,
            call_name=_name,
            param_key=_key,
        )

    def scan_section(self, text: str, final: bool) -> SectionScan:
        return scan_tagged_section(self._grammar, text, final)

    def find_outside(self, text: str, final: bool) -> tuple[int, int, bool] | None:
        pos = 0
        while True:
            hits = [(at, m) for m in (self.opener, self._open, self._close) if (at := text.find(m, pos)) >= 0]
            if not hits:
                return None
            start, marker = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            if marker == self.opener:
                return start, start + len(marker), True
            end = text.find(self._sep, start + len(marker))
            body = text[start + len(marker) : end if end >= 0 else len(text)]
            plain = "\n" not in body and self._open not in body and self._close not in body
            if end >= 0 and plain and re.fullmatch(r"\s*[A-Za-z_].*", body):
                return start, end + len(self._sep), False
            if end < 0 and plain and not final:
                return None
            pos = start + 1

    def outside_hold(self, text: str) -> int:
        hold = partial_suffix_length(text, [self.opener, self._open, self._close])
        for marker in (self._open, self._close):
            at = text.rfind(marker)
            tail = text[at + len(marker) :]
            inside = any(marker in tail for marker in (self._sep, "\n", self._open, self._close))
            if at >= 0 and not inside:
                hold = max(hold, len(text) - at)
        return hold


def xtml_think_parser(context: ParserContext) -> DelimitedReasoningParser:
    """Factory of REASONING_PARSER_XTML_THINK."""
    frontend = context.frontend
    xtml = frontend.tool_syntax.xtml
    reasoning = frontend.reasoning_syntax
    opening, closing, sep, _ = xtml_framing(xtml.block_open, xtml.block_close)
    element = xtml.think_element or "think"
    return DelimitedReasoningParser(
        context,
        open_text=reasoning.open or opening + element + sep,
        close_text=reasoning.close or closing + element + sep,
        wrapping_newlines=reasoning.wrapping_newlines,
        terminal_marker=reasoning.terminal_marker,
    )


def xtml_grammar(request: ToolGrammarRequest) -> GrammarFragment | None:
    """The XTML block holding one call (``None`` when the framing or an element name is missing)."""
    syntax = request.frontend.tool_syntax
    xtml = syntax.xtml
    if syntax.WhichOneof("family") != "xtml" or not xtml.call_element or not xtml.arg_element:
        return None
    try:
        opening, closing, separator, block = xtml_framing(xtml.block_open, xtml.block_close)
    except StartupError:
        return None
    writer = GrammarWriter()
    open_, close_, sep = writer.marker(opening), writer.marker(closing), writer.marker(separator)
    ends = (opening, closing, separator, xtml.block_close, xtml.block_open)

    def parameter(key: str, schema: Mapping[str, Any], value: str) -> str:
        kind = "string" if schema_type(schema) in STRING_TYPES else _XTML_TYPES.get(str(schema_type(schema)))
        attributes = json.dumps(f' key="{key}" type="{kind or "object"}"')
        arg = json.dumps(xtml.arg_element)
        return f"{open_} {arg} {attributes} {sep} {value} {close_} {arg} {sep}"

    def call(name: str, parameters: str) -> str:
        element = json.dumps(xtml.call_element)
        attributes = json.dumps(f" tool={json.dumps(name)}")
        return f"{open_} {element} {attributes} {sep} {parameters} {close_} {element} {sep}"

    called, rules = tag_call_rules(request, terminators=ends, parameter=parameter, call=call, quoted_keys=True)
    name = json.dumps(block)
    return writer.fragment(
        [
            f"start: {open_} {name} {sep} body {close_} {name} {sep}",
            "body: " + " | ".join(f"call_{index}" for index, _ in called),
            *rules,
        ]
    )


def xtml_think_envelope(frontend: contract.FrontendContract) -> DelimitedEnvelope:
    """XTML think reasoning before the answer: the declared delimiters, or (undeclared) the think
    element in the XTML framing, as ``xtml_think_parser`` reads them; none without a framing."""
    xtml = frontend.tool_syntax.xtml
    reasoning = frontend.reasoning_syntax
    try:
        opening, closing, sep, _ = xtml_framing(xtml.block_open, xtml.block_close)
    except StartupError:
        return DelimitedEnvelope(None)
    element = xtml.think_element or "think"
    return DelimitedEnvelope(
        DelimitedReasoning(
            open=reasoning.open or opening + element + sep,
            close=reasoning.close or closing + element + sep,
            terminal_marker=reasoning.terminal_marker,
        )
    )


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the XTML tool parser."""
    register(contract.TOOL_PARSER_XTML, XtmlToolParser, name="xtml")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the XTML call grammar."""
    register(contract.TOOL_PARSER_XTML, xtml_grammar, name="xtml")


def helios_register_reasoning_envelopes(register: Register) -> None:
    """Provide the XTML think envelope."""
    register(contract.REASONING_PARSER_XTML_THINK, xtml_think_envelope, name="xtml-think")


def helios_register_reasoning_parsers(register: Register) -> None:
    """Provide XTML think reasoning."""
    register(contract.REASONING_PARSER_XTML_THINK, xtml_think_parser, name="xtml-think")
