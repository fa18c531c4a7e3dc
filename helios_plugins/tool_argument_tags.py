"""Argument-tag tool calls (TOOL_PARSER_ARGUMENT_TAGS).

Owns the parser of ``CALL_OPEN NAME SEP KEY_OPEN k KEY_CLOSE VALUE_OPEN v VALUE_CLOSE ... CALL_CLOSE``
calls, configured by ``ArgumentTagSyntax`` (``call_open``, ``call_close``, ``key_open``,
``key_close``, ``value_open``, ``value_close``, ``name_separator``) and ``ToolSyntax.opener``.

* The name ends at the name separator, the first key opener or the call closer (the separator may
  be missing); a name that is empty or holds whitespace or ``<`` makes the section content.
* Keys are stripped. Whitespace between tags is ignored.
* Values whose schema type is a string are verbatim (whitespace kept) and stream as they arrive;
  others, and undeclared keys, are stripped and decoded as JSON, then as a Python literal, else
  kept as text.
* A missing value opener: the value starts after the key closer. A missing value closer: the value
  ends at the next key opener or the call closer. ``NAME SEP CALL_CLOSE`` is a call with ``{}``.

Constrained calls (``argument_tags_grammar``): ``CALL_OPEN NAME SEP``, then per property (required
ones; optional ones may be skipped; schema order) ``KEY_OPEN k KEY_CLOSE``, a newline,
``VALUE_OPEN v VALUE_CLOSE`` and a newline, then ``CALL_CLOSE``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from helios_core.plugin_api import (
    CallScan,
    GrammarFragment,
    GrammarWriter,
    ParamScan,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    ToolGrammarRequest,
    contract,
    partial_suffix_length,
    require_syntax,
    tag_call_rules,
)

HELIOS_PLUGIN_API = (1, 0)


class ArgumentTagParser(SectionToolParser):
    """Streaming argument-tag tool parser for one request."""

    undeclared = "json"

    def __init__(self, context: ParserContext) -> None:
        syntax = context.frontend.tool_syntax
        tags = syntax.argument_tags
        require_syntax(
            tags,
            "tool_syntax.argument_tags",
            ("call_open", "call_close", "key_open", "key_close", "value_open", "value_close"),
        )
        super().__init__(context, syntax.opener or tags.call_open)
        self._tags = tags

    def scan_section(self, text: str, final: bool) -> SectionScan:
        t = self._tags
        scan = SectionScan()
        name_ends = [m for m in (t.name_separator, t.key_open, t.call_close) if m]
        hits = [at for at in (text.find(m) for m in name_ends) if at >= 0]
        if not hits:
            candidate = text[: len(text) - partial_suffix_length(text, name_ends)].lstrip()
            scan.invalid = final or any(c.isspace() or c in "<>{" for c in candidate)
            return scan
        name_end = min(hits)
        name = text[:name_end].strip()
        if not name or any(c.isspace() or c in "<>" for c in name):
            scan.invalid = True
            return scan
        call = CallScan(name)
        scan.calls.append(call)
        separated = bool(t.name_separator) and text.startswith(t.name_separator, name_end)
        pos = name_end + (len(t.name_separator) if separated else 0)
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            rest = text[pos:]
            if rest.startswith(t.call_close):
                call.closed = True
                scan.end = pos + len(t.call_close)
                return scan
            if not rest.startswith(t.key_open):
                if not rest or (not final and any(m.startswith(rest) for m in (t.call_close, t.key_open))):
                    return scan
                skip = [at for at in (text.find(m, pos + 1) for m in (t.call_close, t.key_open)) if at >= 0]
                if not skip:
                    return scan
                pos = min(skip)
                continue
            key_end = text.find(t.key_close, pos + len(t.key_open))
            if key_end < 0:
                return scan
            key = text[pos + len(t.key_open) : key_end].strip()
            pos = key_end + len(t.key_close)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            rest = text[pos:]
            if rest.startswith(t.value_open):
                pos += len(t.value_open)
            elif not final and t.value_open.startswith(rest):
                return scan
            terminators = [t.value_close, t.key_open, t.call_close]
            hits = [at for at in (text.find(m, pos) for m in terminators) if at >= 0]
            if hits:
                end = min(hits)
                call.params.append(ParamScan(key, text[pos:end], True))
                pos = end + (len(t.value_close) if text.startswith(t.value_close, end) else 0)
                continue
            # a value cut off keeps none of the first characters of a closer it was cut off in
            hold = partial_suffix_length(text[pos:], terminators)
            call.params.append(ParamScan(key, text[pos : len(text) - hold], final))
            return scan


def argument_tags_grammar(request: ToolGrammarRequest) -> GrammarFragment | None:
    """One call in argument tags (``None`` when a marker other than the name separator is missing)."""
    syntax = request.frontend.tool_syntax
    tags = syntax.argument_tags
    texts = (tags.call_open, tags.call_close, tags.key_open, tags.key_close, tags.value_open, tags.value_close)
    if syntax.WhichOneof("family") != "argument_tags" or not all(texts):
        return None
    writer = GrammarWriter()
    ends = (tags.value_close, tags.key_open, tags.call_close, tags.call_open)

    def parameter(key: str, schema: Mapping[str, Any], value: str) -> str:
        head = f'{writer.marker(tags.key_open)} {json.dumps(key)} {writer.marker(tags.key_close)} "\\n"'
        return f'{head} {writer.marker(tags.value_open)} {value} {writer.marker(tags.value_close)} "\\n"'

    def call(name: str, parameters: str) -> str:
        separator = writer.marker(tags.name_separator) if tags.name_separator else ""
        return f"{json.dumps(name)} {separator} {parameters}"

    called, rules = tag_call_rules(request, terminators=ends, parameter=parameter, call=call)
    return writer.fragment(
        [
            f"start: {writer.marker(tags.call_open)} body {writer.marker(tags.call_close)}",
            "body: " + " | ".join(f"call_{index}" for index, _ in called),
            *rules,
        ]
    )


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the argument-tag tool parser."""
    register(contract.TOOL_PARSER_ARGUMENT_TAGS, ArgumentTagParser, name="argument-tags")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the argument-tag call grammar."""
    register(contract.TOOL_PARSER_ARGUMENT_TAGS, argument_tags_grammar, name="argument-tags")
