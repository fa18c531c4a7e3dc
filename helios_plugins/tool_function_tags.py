"""Function-tag tool calls (TOOL_PARSER_FUNCTION_TAGS).

Owns the parser of ``CALL_OPEN <function=NAME> <parameter=P>VALUE</parameter> </function>
CALL_CLOSE`` calls, configured by ``FunctionTagSyntax`` (``call_open``, ``call_close``,
``function_prefix``, ``function_close``, ``parameter_prefix``, ``parameter_close``,
``wrapping_newlines``) and ``ToolSyntax.opener`` (normally equal to ``call_open``).

* One call per section; parallel calls are consecutive sections.
* Values are raw text typed by the request's schema (``coerce_text``); a parameter the schema does
  not declare, and every string-typed one, is a string and streams as it arrives.
* ``wrapping_newlines`` strips exactly one newline after ``>`` and one before the value closer.
* A missing value closer ends the value at the next parameter or the function closer; a missing
  function closer ends the call at the call closer.
* A section whose first element is not ``<function=NAME>`` (or whose name holds a newline or never
  closes) is content. A bare ``<function=`` without the call opener is content.

Constrained calls (``function_tags_grammar``): the call opener, a newline, ``<function=N>`` and a
newline, then one ``<parameter=K>VALUE</parameter>`` line per property (required ones; optional
ones may be skipped; schema order; ``wrapping_newlines`` puts one newline around each value),
``</function>``, a newline and the call closer. ``plugin_api.value_rule`` writes the values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from helios_core.plugin_api import (
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
    scan_tagged_section,
    tag_call_rules,
)

HELIOS_PLUGIN_API = (1, 0)


def _name(header: str) -> str | None:
    name = header.strip()
    return name if name and not any(c.isspace() or c in "<>" for c in name) else None


def _key(header: str) -> tuple[str, bool | None] | None:
    key = header.strip()
    return (key, None) if key else None


class FunctionTagParser(SectionToolParser):
    """Streaming function-tag tool parser for one request."""

    undeclared = "string"

    def __init__(self, context: ParserContext) -> None:
        syntax = context.frontend.tool_syntax
        tags = syntax.function_tags
        missing = [
            name
            for name in ("call_open", "call_close", "function_prefix", "function_close", "parameter_prefix")
            if not getattr(tags, name)
        ]
        if missing or not tags.parameter_close:
            raise StartupError(f"tool_syntax.function_tags lacks {', '.join(missing) or 'parameter_close'}")
        super().__init__(context, syntax.opener or tags.call_open)
        self._grammar = TagGrammar(
            section_close=tags.call_close,
            call_open=tags.function_prefix,
            call_open_end=">",
            call_close=tags.function_close,
            param_open=tags.parameter_prefix,
            param_open_end=">",
            param_close=tags.parameter_close,
            call_name=_name,
            param_key=_key,
            wrapping_newlines=tags.wrapping_newlines,
        )

    def scan_section(self, text: str, final: bool) -> SectionScan:
        return scan_tagged_section(self._grammar, text, final)


def function_tags_grammar(request: ToolGrammarRequest) -> GrammarFragment | None:
    """One call in function tags (``None`` when a marker is not declared)."""
    syntax = request.frontend.tool_syntax
    tags = syntax.function_tags
    texts = (tags.call_open, tags.call_close, tags.function_prefix, tags.function_close, tags.parameter_prefix)
    if syntax.WhichOneof("family") != "function_tags" or not all(texts) or not tags.parameter_close:
        return None
    writer = GrammarWriter()
    ends = (tags.parameter_close, tags.parameter_prefix, tags.function_close, tags.call_close, tags.call_open)
    wrap = '"\\n" ' if tags.wrapping_newlines else ""

    def parameter(key: str, schema: Mapping[str, Any], value: str) -> str:
        head = f'{writer.marker(tags.parameter_prefix)} {json.dumps(key)} ">"'
        return f'{head} {wrap}{value} {wrap}{writer.marker(tags.parameter_close)} "\\n"'

    def call(name: str, parameters: str) -> str:
        prefix, close = writer.marker(tags.function_prefix), writer.marker(tags.function_close)
        return f'"\\n" {prefix} {json.dumps(name)} ">\\n" {parameters} {close} "\\n"'

    called, rules = tag_call_rules(request, terminators=ends, parameter=parameter, call=call)
    return writer.fragment(
        [
            f"start: {writer.marker(tags.call_open)} body {writer.marker(tags.call_close)}",
            "body: " + " | ".join(f"call_{index}" for index, _ in called),
            *rules,
        ]
    )


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the function-tag tool parser."""
    register(contract.TOOL_PARSER_FUNCTION_TAGS, FunctionTagParser, name="function-tags")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the function-tag call grammar."""
    register(contract.TOOL_PARSER_FUNCTION_TAGS, function_tags_grammar, name="function-tags")
