"""Example Helios plugin: bracket-call tool parser under third-party identifier 100001.

Calls look like ``[[NAME {"arg": 1}]]``: the opener ``[[``, a name, one space, a JSON object and
``]]``. The core selects it with ``frontend.tool_parser = 100001``; its syntax needs no data. The
module imports only ``helios_core.plugin_api``, and registers with a plain hook function.
"""

from __future__ import annotations

from helios_core.plugin_api import (
    CallScan,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    decode_json_value,
    dump_json,
)

IDENTIFIER = 100001


class BracketCallParser(SectionToolParser):
    """``[[NAME {json}]]`` calls; a body that is not a name and a JSON object is content."""

    def __init__(self, context: ParserContext) -> None:
        super().__init__(context, "[[")

    def scan_section(self, text: str, final: bool) -> SectionScan:
        end = text.find("]]")
        if end < 0:
            return SectionScan(invalid=final)
        name, _, body = text[:end].partition(" ")
        ok, arguments = decode_json_value(body)
        if not name or not ok or not isinstance(arguments, dict):
            return SectionScan(invalid=True)
        return SectionScan([CallScan(name, closed=True, arguments_json=dump_json(arguments))], end=end + 2)


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the bracket-call tool parser."""
    register(IDENTIFIER, BracketCallParser, name="bracket-calls")
