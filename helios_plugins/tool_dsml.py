"""DSML tool calls (TOOL_PARSER_DSML).

Owns the parser of ``<M BLOCK> <M INVOKE name="N"> <M PARAMETER name="P" string="true|false">V</M
PARAMETER> </M INVOKE> </M BLOCK>`` sections, where ``M`` is ``DsmlSyntax.marker`` (for example
``｜DSML｜``) and the element names are ``block``, ``invoke`` and ``parameter``. ``ToolSyntax.opener``
is the block's open tag. ``block_separator`` (``"\\n\\n"``) is the whitespace before the block,
which is dropped with all whitespace between content and the section.

* Several invocations in one block are parallel calls.
* ``string="true"``: the value is verbatim text (no trimming) and streams as it arrives.
  ``string="false"``: the value is JSON, inserted as decoded; invalid JSON is kept as text. No
  ``string`` attribute: typed by the request's schema (``coerce_text``).
* An invocation without its closer ends at the next invocation or the block closer; the malformed
  rules of ``scan_tagged_section`` apply. A section whose first element is not an invocation with a
  ``name`` attribute is content.
"""

from __future__ import annotations

from helios_core.plugin_api import (
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    TagGrammar,
    contract,
    parse_attributes,
    require_syntax,
    scan_tagged_section,
)


def _name(header: str) -> str | None:
    return parse_attributes(header).get("name") or None


def _key(header: str) -> tuple[str, bool | None] | None:
    attributes = parse_attributes(header)
    key = attributes.get("name")
    if not key:
        return None
    flag = attributes.get("string")
    return key, None if flag is None else flag.strip().lower() == "true"


class DsmlParser(SectionToolParser):
    """Streaming DSML tool parser for one request."""

    undeclared = "json"

    def __init__(self, context: ParserContext) -> None:
        syntax = context.frontend.tool_syntax
        dsml = syntax.dsml
        require_syntax(dsml, "tool_syntax.dsml", ("marker", "block", "invoke", "parameter"))
        mark = dsml.marker
        super().__init__(context, syntax.opener or f"<{mark}{dsml.block}>")
        self._grammar = TagGrammar(
            section_close=f"</{mark}{dsml.block}>",
            call_open=f"<{mark}{dsml.invoke}",
            call_open_end=">",
            call_close=f"</{mark}{dsml.invoke}>",
            param_open=f"<{mark}{dsml.parameter}",
            param_open_end=">",
            param_close=f"</{mark}{dsml.parameter}>",
            call_name=_name,
            param_key=_key,
        )

    def scan_section(self, text: str, final: bool) -> SectionScan:
        return scan_tagged_section(self._grammar, text, final)


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the DSML tool parser."""
    register(contract.TOOL_PARSER_DSML, DsmlParser, name="dsml")
