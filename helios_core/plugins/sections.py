"""Building blocks for tool-syntax parsers: streaming sections, tagged elements, argument typing.

Owns what syntax families share when parsing output: marker hold-back (``partial_suffix_length``),
schema typing of argument text (``schema_type``, ``coerce_text``), call ids and
``ToolCallWriter``, ``SectionToolParser`` (a streaming base class for "opener ... calls ... closer"
syntaxes) and ``scan_tagged_section`` for element-style calls. Plugins import these through
:mod:`helios_core.plugin_api`.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from helios_core.errors import StartupError
from helios_core.plugins.types import OutputDelta, ParserContext, ToolCallDelta

__all__ = [
    "STRING_TYPES",
    "CallScan",
    "JsonNumber",
    "ParamScan",
    "SectionScan",
    "SectionToolParser",
    "TagGrammar",
    "ToolCallWriter",
    "coerce_text",
    "decode_json_value",
    "dump_json",
    "new_call_id",
    "parse_attributes",
    "partial_suffix_length",
    "require_syntax",
    "scan_tagged_section",
    "schema_type",
    "strip_wrapping_newline",
]


def require_syntax(message: Any, path: str, names: Iterable[str]) -> None:
    """Raise StartupError naming the first of ``names`` that ``message`` (at ``path``) leaves empty."""
    for name in names:
        if not getattr(message, name):
            raise StartupError(f"{path}.{name} must be declared")


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def partial_suffix_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``: the
    part a streaming parser must hold back until the next chunk decides it.

    A final U+FFFD (the first bytes of a character the output was cut inside, as the detokenizer's
    final flush writes them) extends such a prefix when the marker's next character is not ASCII: an
    output cut inside a multi-byte character of a marker (DSML's ``｜``) holds that character's start
    back with the rest of the marker's prefix."""
    markers = list(markers)
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[len(text) - size :]):
                best = size
                break
    if text.endswith(_CUT_CHARACTER):
        head = text[:-1]
        for marker in markers:
            for size in range(min(len(marker) - 1, len(head)), -1, -1):
                if size + 1 > best and not marker[size].isascii() and marker.startswith(head[len(head) - size :]):
                    best = size + 1
                    break
    return best


_CUT_CHARACTER = "\ufffd"


class JsonNumber(float):
    """A JSON number too large for a float (its float value is infinite), with the text it was written
    as: :func:`dump_json` writes that text back, so a valid number in a model's arguments stays the
    same valid JSON number instead of becoming infinity (which JSON cannot hold)."""

    text: str

    def __new__(cls, text: str) -> JsonNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __reduce__(self) -> tuple[type[JsonNumber], tuple[str]]:
        return JsonNumber, (self.text,)


def _json_float(text: str) -> float:
    """A JSON number with a fraction or exponent: a float, or a :class:`JsonNumber` beyond float's range."""
    number = float(text)
    return number if math.isfinite(number) else JsonNumber(text)


_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def json_number_text(text: str) -> JsonNumber | None:
    """``text`` as a :class:`JsonNumber` when it is a JSON number beyond float's range, else None."""
    if not _JSON_NUMBER.fullmatch(text) or math.isfinite(float(text)):
        return None
    return JsonNumber(text)


def dump_json(value: Any) -> str:
    """JSON text as tool arguments carry it (non-ASCII kept, ``NaN`` refused, a :class:`JsonNumber` as
    written)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # an out-of-range number kept as written (or a NaN, which stays refused)
        return _dump_with_numbers(value)


def _dump_with_numbers(value: Any) -> str:
    """:func:`dump_json`'s text, item by item, writing each :class:`JsonNumber` as its text."""
    if isinstance(value, JsonNumber):
        return value.text
    if isinstance(value, dict):
        items = (f"{json.dumps(str(key), ensure_ascii=False)}: {_dump_with_numbers(v)}" for key, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_dump_with_numbers(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_json_value(text: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` is one strict JSON value, else ``(False, None)``. A number beyond
    float's range is a :class:`JsonNumber` (its text kept for :func:`dump_json`)."""
    try:
        return True, json.loads(text, parse_constant=_refuse_constant, parse_float=_json_float)
    except (ValueError, RecursionError):
        return False, None


def _literal_value(text: str) -> tuple[bool, Any]:
    try:
        value = ast.literal_eval(text)
        dump_json(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    return True, value


STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
"""Schema type names whose values are kept verbatim."""


def schema_type(schema: Mapping[str, Any] | None) -> str | None:
    """The effective type name of a parameter schema: the first non-null entry of ``type`` (a name
    or a list), else of the ``anyOf`` / ``oneOf`` branches; ``None`` when it declares none."""
    if not isinstance(schema, Mapping):
        return None
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared]
    for name in names:
        if isinstance(name, str) and name != "null":
            return name.lower()
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                found = schema_type(branch)
                if found is not None:
                    return found
    if "enum" in schema:
        return "enum"
    return None


def _allows_null(schema: Mapping[str, Any]) -> bool:
    declared = schema.get("type")
    if declared == "null" or (isinstance(declared, list) and "null" in declared):
        return True
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and any(isinstance(b, Mapping) and _allows_null(b) for b in branches):
            return True
    return False


def coerce_text(raw: str, schema: Mapping[str, Any] | None, *, undeclared: Literal["string", "json"]) -> Any:
    """Type an argument written as raw text by its JSON schema (never raises).

    String types keep the text verbatim. ``null``/``None`` become null when the schema allows null
    or is not a string type. Integer types use ``int``; number types ``float`` (a whole number
    becomes an int); boolean types compare the lower-cased text with ``true``; every other type
    tries JSON, then a Python literal. When conversion fails the raw text is kept. A parameter
    without a schema is the raw string (``undeclared="string"``) or JSON-then-raw (``"json"``)."""
    if schema is None:
        if undeclared == "string":
            return raw
        ok, value = decode_json_value(raw.strip())
        return value if ok else raw
    kind = schema_type(schema)
    if kind is not None and kind in STRING_TYPES:
        return raw
    text = raw.strip()
    if text in ("null", "None"):
        return None
    if kind is not None and kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return raw
    if kind is not None and kind.startswith(("num", "float", "double")):
        try:
            number = float(text)
        except ValueError:
            return raw
        if not math.isfinite(number):  # a JSON number beyond float's range keeps its text; "inf" stays text
            written = json_number_text(text)
            return raw if written is None else written
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    ok, value = decode_json_value(text)
    if ok:
        return value
    ok, value = _literal_value(text)
    return value if ok else raw


class ToolCallWriter:
    """Numbers calls, mints ids and writes argument fragments of one response.

    ``begin`` returns the call's first delta (id, name, ``arguments=""``); ``fragment`` returns an
    arguments piece of the current call. Fragments are JSON text; their concatenation is the final
    arguments object."""

    def __init__(self) -> None:
        self._next_index = 0

    def begin(self, name: str) -> ToolCallDelta:
        delta = ToolCallDelta(self._next_index, new_call_id(), name, "")
        self._next_index += 1
        return delta

    def fragment(self, text: str) -> ToolCallDelta:
        return ToolCallDelta(self._next_index - 1, None, None, text)


@dataclass
class ParamScan:
    """One parameter as scanned so far: ``raw`` is its value text (only the part that can no longer
    change while ``closed`` is false). ``string``: ``True`` raw text, ``False`` JSON text, ``None``
    typed by the schema."""

    key: str
    raw: str
    closed: bool
    string: bool | None = None


@dataclass
class CallScan:
    """One call as scanned so far. ``arguments_json`` is set by syntaxes that carry the arguments
    as one JSON object (they are written whole, at the call's close)."""

    name: str
    params: list[ParamScan] = field(default_factory=list)
    closed: bool = False
    arguments_json: str | None = None


@dataclass
class SectionScan:
    """The result of scanning a section's text (everything after the opener). ``end`` is the offset
    just past the section closer once it was seen. ``invalid``: the opener did not start a section
    (its text becomes content)."""

    calls: list[CallScan] = field(default_factory=list)
    end: int | None = None
    invalid: bool = False


@dataclass
class _CallProgress:
    index: int
    name: str
    params_done: int = 0
    string_sent: int = -1
    keys: set[str] = field(default_factory=set)
    skipping: bool = False
    braced: bool = False
    closed: bool = False


class SectionToolParser:
    """Streaming tool parser for syntaxes whose calls sit in sections ``opener ... closer``.

    A subclass implements ``scan_section(text, final)``, a pure function of the section text that
    must be monotone (what it reports as complete stays so as text is appended). The base class:

    * emits content outside sections, holding back a suffix that may start the opener;
    * drops whitespace between content and an opener and right after a section closer;
    * streams each call: id and name once the name is complete, ``{``, one fragment per completed
      parameter (string-typed values stream as they arrive), ``}`` at the call's close; a repeated
      parameter name is dropped (the first value wins);
    * at ``finish``: an open section with at least one named call closes every call with what it
      holds (truncated output keeps its calls); an open section without a named call, or a section
      the scanner marks ``invalid``, is content, opener included;
    * for a request that offers no tools, nothing: its whole text is content.

    Because every decision depends only on the text, the result does not depend on chunking."""

    undeclared: Literal["string", "json"] = "string"

    def __init__(self, context: ParserContext, opener: str, *, writer: ToolCallWriter | None = None) -> None:
        if not opener:
            raise StartupError("tool_syntax.opener must be declared")
        self.context = context
        self.opener = opener
        self._writer = writer or ToolCallWriter()
        self._outside = ""
        self._section: str | None = None
        self._progress: list[_CallProgress] = []
        self._held_space = ""
        self._after_section = False
        self._schemas = {spec.name: spec.parameters for spec in context.tools}
        self._parses_calls = bool(context.tools)
        """False for a request that offers no tools (none, or ``tool_choice: "none"``): call markup is
        content, as OpenAI returns no tool calls where none were offered; framing markup the syntax drops
        outside its call sections (XTML's message and response tags) is dropped all the same."""

    # -- hooks for subclasses -----------------------------------------------------------------

    def scan_section(self, text: str, final: bool) -> SectionScan:
        """Scan the section text after the opener (``final``: no more text will come)."""
        raise NotImplementedError

    def find_outside(self, text: str, final: bool) -> tuple[int, int, bool] | None:
        """Locate the next markup in content text: ``(start, end, opens_section)``; markup that
        does not open a section is dropped. ``None``: none is complete yet. The default finds the
        opener."""
        start = text.find(self.opener)
        return None if start < 0 else (start, start + len(self.opener), True)

    def outside_hold(self, text: str) -> int:
        """How much of the end of content text to hold back (a possible markup prefix)."""
        return partial_suffix_length(text, [self.opener])

    def parameter_schema(self, tool: str, key: str) -> Mapping[str, Any] | None:
        properties = self._schemas.get(tool, {}).get("properties")
        schema = properties.get(key) if isinstance(properties, Mapping) else None
        return schema if isinstance(schema, Mapping) else None

    def is_string(self, tool: str, param: ParamScan) -> bool:
        """Whether the value is raw text (streamed as it arrives)."""
        if param.string is not None:
            return param.string
        schema = self.parameter_schema(tool, param.key)
        if schema is None:
            return self.undeclared == "string"
        kind = schema_type(schema)
        return kind is not None and kind in STRING_TYPES

    def value(self, tool: str, param: ParamScan) -> Any:
        """The JSON value of a closed non-string parameter."""
        if param.string is False:
            ok, value = decode_json_value(param.raw.strip())
            return value if ok else param.raw
        return coerce_text(param.raw, self.parameter_schema(tool, param.key), undeclared=self.undeclared)

    # -- ToolParser ---------------------------------------------------------------------------

    def feed(self, text: str) -> list[OutputDelta]:
        if self._section is None:
            self._outside += text
        else:
            self._section += text
        return self._drain(final=False)

    def finish(self) -> list[OutputDelta]:
        return self._drain(final=True)

    # -- machinery ----------------------------------------------------------------------------

    def _content(self, text: str, out: list[OutputDelta], *, final: bool) -> None:
        if self._after_section:
            stripped = text.lstrip()
            if not stripped:
                return
            text = stripped
            self._after_section = False
        text = self._held_space + text
        body = text if final else text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            out.append(OutputDelta(content=body))

    def _drain(self, final: bool) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        while True:
            if self._section is None:
                found = self.find_outside(self._outside, final)
                if found is None:
                    hold = 0 if final else self.outside_hold(self._outside)
                    self._content(self._outside[: len(self._outside) - hold], out, final=final)
                    self._outside = self._outside[len(self._outside) - hold :]
                    return out
                start, end, opens = found
                self._content(self._outside[:start], out, final=False)
                if opens:
                    self._section = self._outside[end:]
                    self._section_opener = self._outside[start:end]
                    self._progress = []
                self._outside = "" if opens else self._outside[end:]
                continue
            scan = self.scan_section(self._section, final)
            if not self._parses_calls:
                # no tools were offered: the whole section, opener to close, is content as written
                if scan.end is None and not scan.invalid and not final:
                    return out
                cut = len(self._section) if scan.end is None else scan.end
                self._content(self._section_opener + self._section[:cut], out, final=False)
                self._outside = self._section[cut:]
                self._section = None
                continue
            if scan.invalid and not self._progress:
                self._reject_section()
                continue
            self._emit_calls(scan, out, final=final)
            if scan.end is not None:
                self._outside = self._section[scan.end :]
                self._section = None
                self._after_section = bool(self._progress)
                continue
            if final:
                if not self._progress:
                    self._reject_section()
                    continue
                self._section = None
                self._outside = ""
            return out

    def _reject_section(self) -> None:
        """The section is not a call section: its opener and text return to the content stream."""
        section = self._section or ""
        self._section = None
        self._outside = section
        self._progress = []
        # The opener becomes content ahead of the re-scanned text, after the held whitespace.
        self._held_space += self._section_opener
        self._after_section = False

    def _emit_calls(self, scan: SectionScan, out: list[OutputDelta], *, final: bool) -> None:
        pieces: list[ToolCallDelta] = []
        for position, call in enumerate(scan.calls):
            if position == len(self._progress):
                if not self._progress:
                    self._held_space = ""
                header = self._writer.begin(call.name)
                pieces.append(header)
                self._progress.append(_CallProgress(header.index, call.name))
            progress = self._progress[position]
            if progress.closed:
                continue
            closed = call.closed or final
            fragments: list[str] = []
            if call.arguments_json is not None or (closed and not call.params and not progress.braced):
                if closed:
                    fragments.append(call.arguments_json if call.arguments_json is not None else "{}")
                    progress.closed = True
                    pieces.append(ToolCallDelta(progress.index, None, None, "".join(fragments)))
                continue
            while progress.params_done < len(call.params):
                param = call.params[progress.params_done]
                param_closed = param.closed or final
                if progress.string_sent < 0 and (param.key in progress.keys or progress.skipping):
                    progress.skipping = not param_closed
                    if param_closed:
                        progress.params_done += 1
                        continue
                    break
                lead = ("{" if not progress.braced else ", ") + dump_json(param.key) + ": "
                if self.is_string(call.name, param):
                    if progress.string_sent < 0:
                        fragments.append(lead + '"')
                        progress.braced = True
                        progress.keys.add(param.key)
                        progress.string_sent = 0
                    fragments.append(dump_json(param.raw[progress.string_sent :])[1:-1])
                    progress.string_sent = len(param.raw)
                    if not param_closed:
                        break
                    fragments.append('"')
                elif param_closed:
                    fragments.append(lead + dump_json(self.value(call.name, param)))
                    progress.braced = True
                    progress.keys.add(param.key)
                else:
                    break
                progress.string_sent = -1
                progress.params_done += 1
            if closed and progress.params_done == len(call.params):
                fragments.append("}" if progress.braced else "{}")
                progress.closed = True
            text = "".join(fragments)
            if text:
                pieces.append(ToolCallDelta(progress.index, None, None, text))
            if not progress.closed:
                break
        if pieces:
            out.append(OutputDelta(tool_calls=tuple(pieces)))


@dataclass(frozen=True)
class TagGrammar:
    """Markers of an element-style call syntax, for ``scan_tagged_section``.

    A section holds calls ``call_open HEADER call_open_end params call_close`` and ends at
    ``section_close``; a parameter is ``param_open HEADER param_open_end VALUE param_close``.
    ``call_name`` maps a call header to its name (``None``: not a valid name); ``param_key`` maps a
    parameter header to ``(key, string flag)``. ``wrapping_newlines`` strips one newline after the
    value opener and one before its closer."""

    section_close: str
    call_open: str
    call_open_end: str
    call_close: str
    param_open: str
    param_open_end: str
    param_close: str
    call_name: Callable[[str], str | None]
    param_key: Callable[[str], tuple[str, bool | None] | None]
    wrapping_newlines: bool = False


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _is_partial(rest: str, markers: Iterable[str]) -> bool:
    return any(marker.startswith(rest) for marker in markers)


def _next_marker(text: str, pos: int, markers: Iterable[str]) -> int:
    hits = [at for at in (text.find(m, pos) for m in markers) if at >= 0]
    return min(hits) if hits else -1


def strip_wrapping_newline(value: str, enabled: bool) -> str:
    """Drop one newline after a value opener and one before its closer (also on a partial value,
    where the trailing newline is held back until the closer decides it)."""
    if enabled and value.startswith("\n"):
        value = value[1:]
    if enabled and value.endswith("\n"):
        value = value[:-1]
    return value


def scan_tagged_section(grammar: TagGrammar, text: str, final: bool) -> SectionScan:
    """Scan an element-style section (text after its opener); a pure, monotone function.

    Malformed-output rules: whitespace between elements is ignored; a value without its closer
    ends at the next parameter, call closer or section closer, or, at the end of the output, where the
    output was cut off, without the first characters of a closer it was cut off in; a call without its closer ends at
    the section closer; a call header that is not a valid name (or holds a newline) invalidates the
    section when it is the first call and ends the section's calls otherwise; stray text between
    elements is skipped."""
    g = grammar
    scan = SectionScan()
    pos = 0
    while True:
        pos = _skip_space(text, pos)
        rest = text[pos:]
        if rest.startswith(g.section_close):
            scan.end = pos + len(g.section_close)
            return scan
        if not rest.startswith(g.call_open):
            if not rest or (not final and _is_partial(rest, [g.section_close, g.call_open])):
                return scan
            if not scan.calls:
                scan.invalid = True
                return scan
            skip = _next_marker(text, pos + 1, [g.section_close, g.call_open])
            if skip < 0:
                return scan
            pos = skip
            continue
        header_at = pos + len(g.call_open)
        header_end = text.find(g.call_open_end, header_at)
        bad_header = "\n" in text[header_at : header_end if header_end >= 0 else len(text)]
        if header_end < 0 and not bad_header:
            return scan
        name = None if bad_header else g.call_name(text[header_at:header_end])
        if not name:
            return _abandon(scan, text, pos, g.section_close)
        call = CallScan(name)
        scan.calls.append(call)
        pos = header_end + len(g.call_open_end)
        while True:
            pos = _skip_space(text, pos)
            rest = text[pos:]
            if rest.startswith(g.call_close):
                call.closed = True
                pos += len(g.call_close)
                break
            if rest.startswith(g.section_close):
                call.closed = True
                break
            if not rest.startswith(g.param_open):
                if not rest or (not final and _is_partial(rest, [g.call_close, g.section_close, g.param_open])):
                    return scan
                skip = _next_marker(text, pos + 1, [g.call_close, g.section_close, g.param_open])
                if skip < 0:
                    return scan
                pos = skip
                continue
            key_at = pos + len(g.param_open)
            key_end = text.find(g.param_open_end, key_at)
            if key_end < 0:
                return scan
            parsed = g.param_key(text[key_at:key_end])
            value_at = key_end + len(g.param_open_end)
            terminators = [g.param_close, g.param_open, g.call_close, g.section_close]
            value_end = _next_marker(text, value_at, terminators)
            if value_end < 0:  # the value runs to the end, less the start of a closer it may end in
                hold = partial_suffix_length(text[value_at:], terminators)
                value, closed = text[value_at : len(text) - hold], final  # final: cut off, the value ends here
                if final:
                    pos = len(text)
            else:
                value, closed = text[value_at:value_end], True
                pos = value_end + (len(g.param_close) if text.startswith(g.param_close, value_end) else 0)
            if parsed is not None:
                key, flag = parsed
                call.params.append(ParamScan(key, strip_wrapping_newline(value, g.wrapping_newlines), closed, flag))
            if not closed:
                return scan


def _abandon(scan: SectionScan, text: str, pos: int, section_close: str) -> SectionScan:
    """A call header that is not a valid name: the section is invalid when it has no call yet;
    otherwise the remaining text up to the section closer is dropped."""
    if not scan.calls:
        scan.invalid = True
        return scan
    at = text.find(section_close, pos)
    if at >= 0:
        scan.end = at + len(section_close)
    return scan


def parse_attributes(header: str) -> dict[str, str]:
    """``key="value"`` attributes of an element header (``&quot;``, ``&lt;``, ``&gt;`` and
    ``&amp;`` unescaped)."""
    found: dict[str, str] = {}
    for match in _ATTRIBUTE.finditer(header):
        value = match.group(2)
        for escaped, plain in (("&quot;", '"'), ("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&")):
            value = value.replace(escaped, plain)
        found.setdefault(match.group(1), value)
    return found


_ATTRIBUTE = re.compile(r'([\w:.-]+)\s*=\s*"([^"]*)"')
