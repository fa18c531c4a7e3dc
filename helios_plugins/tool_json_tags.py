"""JSON-tag tool calls (TOOL_PARSER_JSON_TAGS): ``CALL_OPEN {"name": N, "arguments": {...}} CALL_CLOSE``.

Owns the parser configured by ``JsonTagSyntax`` (``call_open``, ``call_close``) and
``ToolSyntax.opener``. The body is one JSON object with a string ``name`` and an ``arguments``
(or ``parameters``) object; arguments given as a JSON string holding an object are decoded; absent
arguments are ``{}``. A call is emitted whole when its closer arrives (its arguments are written in
one fragment). A body that begins with ``{`` is read as JSON: a ``CALL_CLOSE`` spelled inside one
of its string literals (escapes honoured) is text of that string, not the end of the call; other
bodies end at the first ``CALL_CLOSE``. A body that is not such an object, or a section without its
closer at the end of output, is content, markers included.

Constrained calls (``json_tags_grammar``): ``CALL_OPEN`` (as its token where it is one), the object
``{"name": N, "arguments": <N's schema>}`` in compact JSON, ``CALL_CLOSE``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from helios_core.plugin_api import (
    COMPACT_JSON,
    CallScan,
    GrammarFragment,
    GrammarWriter,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    StartupError,
    ToolGrammarRequest,
    contract,
    decode_json_value,
    dump_json,
)

HELIOS_PLUGIN_API = (1, 0)


_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
"""The rest of a JSON string literal up to its closing quote (or up to the end of the text, or up to a
final backslash whose escaped character has not arrived)."""


class _BodyEnd:
    """Where a call body ends in the section text: at the first closer outside the JSON string
    literals of a body that begins with ``{`` (escapes honoured), else at the first closer.

    The answer depends only on the text. The scanner remembers the last text and the offset up to
    which nothing can change the answer (and whether that offset is inside a string), so a section
    that grows piece by piece is scanned once, not once per piece."""

    def __init__(self, close: str) -> None:
        self._close = close
        self._outside = re.compile(re.escape(close) + '|"')
        self._text = ""
        self._resume = 0
        self._in_string = False

    def find(self, text: str) -> int:
        """The offset of the closer that ends the body in ``text`` (``-1``: none yet)."""
        if not text.startswith(self._text):
            self._resume, self._in_string = 0, False
        self._text = text
        at, in_string = self._resume, self._in_string
        if at == 0 and not in_string:
            first = len(text) - len(text.lstrip())
            if first == len(text) or text[first] != "{":
                return text.find(self._close)  # not (yet) a JSON body
            at = first
        while True:
            if in_string:
                rest = _STRING_REST.match(text, at)
                stop = rest.end() if rest else at
                if stop == len(text) or text[stop] != '"':
                    self._resume, self._in_string = stop, True
                    return -1
                at, in_string = stop + 1, False
                continue
            found = self._outside.search(text, at)
            if found is None:
                self._resume, self._in_string = max(at, len(text) - len(self._close) + 1), False
                return -1
            if found.group() == self._close:
                self._resume, self._in_string = at, False
                return found.start()
            at, in_string = found.end(), True


def _call(body: str) -> CallScan | None:
    ok, value = decode_json_value(body.strip())
    if not ok or not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        ok, arguments = decode_json_value(arguments)
        if not ok:
            return None
    if not isinstance(arguments, dict):
        return None
    return CallScan(value["name"], closed=True, arguments_json=dump_json(arguments))


class JsonTagParser(SectionToolParser):
    """JSON-tag tool parser for one request."""

    def __init__(self, context: ParserContext) -> None:
        syntax = context.frontend.tool_syntax
        tags = syntax.json_tags
        if not tags.call_open or not tags.call_close:
            raise StartupError("tool_syntax.json_tags.call_open and .call_close must be declared")
        super().__init__(context, syntax.opener or tags.call_open)
        self._close = tags.call_close
        self._body_end = _BodyEnd(tags.call_close)

    def scan_section(self, text: str, final: bool) -> SectionScan:
        end = self._body_end.find(text)
        if end < 0:
            return SectionScan(invalid=final)
        call = _call(text[:end])
        if call is None:
            return SectionScan(invalid=True)
        return SectionScan([call], end=end + len(self._close))


_ARGUMENTS_POINTER = "#/properties/arguments"
"""Where a function's parameters schema sits inside the call schema :func:`json_tags_grammar` writes."""

_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a ``$ref`` key inside them is not a reference."""

_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names to schemas (a property may be called ``enum`` or ``$ref``)."""


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#`` or ``#/...``, resolved against the parameters schema's
    root) pointing at the same place under ``base``: the parameters sit inside the call schema, whose root
    is not theirs (so ``#/$defs/Item``, as Pydantic writes it, becomes ``#/properties/arguments/$defs/Item``)."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):  # names (any word) to schemas
            out[key] = {name: _rebased(item, base) for name, item in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def json_tags_grammar(request: ToolGrammarRequest) -> GrammarFragment | None:
    """One call: ``CALL_OPEN {"name": N, "arguments": ...} CALL_CLOSE`` (``None`` without both markers)."""
    syntax = request.frontend.tool_syntax
    tags = syntax.json_tags
    if syntax.WhichOneof("family") != "json_tags" or not tags.call_open or not tags.call_close:
        return None
    writer = GrammarWriter()
    alternatives = []
    for index, name, parameters in request.callable_tools():
        arguments = _rebased(parameters, _ARGUMENTS_POINTER) if parameters else {"type": "object"}
        schema = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": COMPACT_JSON,
        }
        alternatives.append((f"call_{index}", json.dumps(schema)))
    return writer.fragment(
        [
            f"start: {writer.marker(tags.call_open)} body {writer.marker(tags.call_close)}",
            "body: " + " | ".join(rule for rule, _ in alternatives),
            *(f"{rule}: %json {schema}" for rule, schema in alternatives),
        ]
    )


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the JSON-tag tool parser."""
    register(contract.TOOL_PARSER_JSON_TAGS, JsonTagParser, name="json-tags")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the JSON-tag call grammar."""
    register(contract.TOOL_PARSER_JSON_TAGS, json_tags_grammar, name="json-tags")
