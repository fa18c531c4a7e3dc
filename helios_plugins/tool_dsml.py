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

Constrained calls (``dsml_grammar``): ``block_separator``, the block's open tag, then one
invocation written by ``invoke_call``: each element on its own line, ``string="true"`` on
verbatim (string-typed) values and ``"false"`` on JSON ones, an empty line for a call without
parameters. ``invoke_call`` is shared with ATEM blocks (``recipient_header``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from helios_core.plugin_api import (
    STRING_TYPES,
    GrammarFragment,
    GrammarWriter,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    TagGrammar,
    ToolGrammarRequest,
    contract,
    parse_attributes,
    require_syntax,
    scan_tagged_section,
    schema_type,
    tag_call_rules,
)

HELIOS_PLUGIN_API = (1, 0)


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


def invoke_call(
    request: ToolGrammarRequest, *, parameter_tag: str, invoke_tag: str, typed: bool, ends: tuple[str, ...]
) -> tuple[list[tuple[int, str]], list[str]]:
    """``call_INDEX`` rules of one ``<INVOKE name="N">`` element holding ``<PARAMETER name="K">``
    elements (with ``string="true|false"`` when ``typed``); ``ends``: the block's open and close
    tags, which no verbatim value may spell either."""
    terminators = (f"</{parameter_tag}>", f"<{parameter_tag}", f"</{invoke_tag}>", f"<{invoke_tag}", *ends)

    def parameter(key: str, schema: Mapping[str, Any], value: str) -> str:
        flag = "true" if schema_type(schema) in STRING_TYPES else "false"
        attribute = f' string="{flag}"' if typed else ""
        head = json.dumps(f'<{parameter_tag} name="{key}"{attribute}>', ensure_ascii=False)
        return f'{head} {value} "\\n"'  # the value ends with its closing tag (value_closer)

    def call(name: str, parameters: str) -> str:
        head = json.dumps(f'<{invoke_tag} name="{name}">', ensure_ascii=False)
        close = json.dumps(f"</{invoke_tag}>", ensure_ascii=False)
        empty = '"\\n"'  # no parameters: an empty line
        return f'"\\n" {head} "\\n" {parameters or empty} {close} "\\n"'

    return tag_call_rules(
        request,
        terminators=terminators,
        parameter=parameter,
        call=call,
        quoted_keys=True,
        value_closer=f"</{parameter_tag}>",
    )


def dsml_grammar(request: ToolGrammarRequest) -> GrammarFragment | None:
    """One DSML block holding one invocation (``None`` when an element name is not declared)."""
    syntax = request.frontend.tool_syntax
    dsml = syntax.dsml
    if syntax.WhichOneof("family") != "dsml" or not all((dsml.marker, dsml.block, dsml.invoke, dsml.parameter)):
        return None
    mark = dsml.marker
    call_open, call_close = syntax.opener or f"<{mark}{dsml.block}>", f"</{mark}{dsml.block}>"
    called, rules = invoke_call(
        request,
        parameter_tag=f"{mark}{dsml.parameter}",
        invoke_tag=f"{mark}{dsml.invoke}",
        typed=True,
        ends=(call_close, call_open),
    )
    writer = GrammarWriter()
    separator = json.dumps(dsml.block_separator) + " " if dsml.block_separator else ""
    return writer.fragment(
        [
            f"start: {separator}{writer.marker(call_open)} body {writer.marker(call_close)}",
            "body: " + " | ".join(f"call_{index}" for index, _ in called),
            *rules,
        ]
    )


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the DSML tool parser."""
    register(contract.TOOL_PARSER_DSML, DsmlParser, name="dsml")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the DSML call grammar."""
    register(contract.TOOL_PARSER_DSML, dsml_grammar, name="dsml")
