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
"""

from __future__ import annotations

import re

from helios_core.plugin_api import (
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    StartupError,
    TagGrammar,
    contract,
    parse_attributes,
    partial_suffix_length,
    require_syntax,
    scan_tagged_section,
)
from helios_plugins.reasoning_think_tags import DelimitedReasoningParser


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


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the XTML tool parser."""
    register(contract.TOOL_PARSER_XTML, XtmlToolParser, name="xtml")


def helios_register_reasoning_parsers(register: Register) -> None:
    """Provide XTML think reasoning."""
    register(contract.REASONING_PARSER_XTML_THINK, xtml_think_parser, name="xtml-think")
