"""Example Helios plugin: bracket-call tool parser and call grammar under third-party identifier 100001.

Calls look like ``[[NAME {"arg": 1}]]``: the opener ``[[``, a name, one space, a JSON object and
``]]``. The core selects it with ``frontend.tool_parser = 100001``; its syntax needs no data. The
module imports only ``helios_core.plugin_api``, declares the plugin API version it was written
against, and registers with plain hook functions: the parser, and the grammar that lets
``tool_choice: "required"`` (or a named function) constrain output to exactly one such call.
"""

from __future__ import annotations

import json

from helios_core.plugin_api import (
    COMPACT_JSON,
    FUNCTION_NAME,
    CallScan,
    GrammarFragment,
    GrammarWriter,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    ToolGrammarError,
    ToolGrammarRequest,
    decode_json_value,
    dump_json,
)

HELIOS_PLUGIN_API = (1, 0)
IDENTIFIER = 100001
OPENER, CLOSER = "[[", "]]"


class BracketCallParser(SectionToolParser):
    """``[[NAME {json}]]`` calls; a body that is not a name and a JSON object is content."""

    def __init__(self, context: ParserContext) -> None:
        super().__init__(context, OPENER)

    def scan_section(self, text: str, final: bool) -> SectionScan:
        end = text.find(CLOSER)
        if end < 0:
            return SectionScan(invalid=final)
        name, _, body = text[:end].partition(" ")
        ok, arguments = decode_json_value(body)
        if not name or not ok or not isinstance(arguments, dict):
            return SectionScan(invalid=True)
        return SectionScan([CallScan(name, closed=True, arguments_json=dump_json(arguments))], end=end + 2)


def bracket_call_grammar(request: ToolGrammarRequest) -> GrammarFragment:
    """Exactly one call ``[[NAME {arguments}]]`` of a callable tool, its arguments compact JSON of
    that tool's parameters schema (strings inside them are not kept free of ``]]``)."""
    writer = GrammarWriter()
    calls: list[str] = []
    rules: list[str] = []
    for index, name, parameters in request.callable_tools():
        if not FUNCTION_NAME.fullmatch(name):
            raise ToolGrammarError(f"tools ({name}): the function name cannot be written in bracket calls")
        schema = {**(dict(parameters) or {"type": "object"}), "x-guidance": COMPACT_JSON}
        rules.append(f"arguments_{index}: %json {json.dumps(schema)}")
        calls.append(f"{json.dumps(name + ' ')} arguments_{index}")
    body = " | ".join(f"({call})" for call in calls)
    return writer.fragment([f"start: {writer.marker(OPENER)} ({body}) {writer.marker(CLOSER)}", *rules])


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the bracket-call tool parser."""
    register(IDENTIFIER, BracketCallParser, name="bracket-calls")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the bracket-call grammar (``tool_choice: "required"`` and named functions)."""
    register(IDENTIFIER, bracket_call_grammar, name="bracket-calls")
