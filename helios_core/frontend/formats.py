"""Structured-output formats: what a request constrains, and the prepared JSON the worker compiles.

Owns these and nothing else:

* :func:`parse_response_format` validates the request's ``response_format`` (``text``,
  ``json_object``, ``json_schema``), rejecting unknown fields, and returns a typed
  :class:`ResponseFormat` (``None`` means unconstrained).
* :class:`ToolCallFormat` is the internal format of ``tool_choice`` ``"required"`` or a named
  function: exactly one call in the core's tool syntax, as the grammar fragment the selected tool
  plugin wrote for it (``helios_register_tool_grammars``). It is never accepted from a client's
  ``response_format``; it travels in ``PreparedRequest.response_format`` as JSON.
* :func:`envelope_reasoning` and :func:`answer_frames` ask the selected reasoning plugin's envelope
  (``helios_register_reasoning_envelopes``) what a constrained output may hold around its answer:
  delimited reasoning before it, or the frames the answer is written in (``AnswerFrames``).
* :func:`prepared_format_json` / :func:`read_prepared_format` write and read the prepared JSON: the
  format, plus the reasoning envelope (key ``helios_envelope``) and the answer frames (key
  ``helios_frames``) the model worker compiles it with.

Nothing here knows a syntax family: the grammar of a call or a frame comes from its plugin. A
caller without a plugin host of its own (tests, tools) gets the installed plugins' grammars.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from google.protobuf.message import Message

from helios_core.contract.prepared import TOOL_FAMILY_OF_PARSER
from helios_core.errors import PromptError
from helios_core.plugins.grammar import (
    AnswerFrames,
    GrammarFragment,
    ReasoningEnvelopeFactory,
    ToolChoice,
    ToolGrammarFactory,
    ToolGrammarRequest,
)
from helios_core.plugins.host import installed_host
from helios_core.wire import contract_pb2 as ct

__all__ = [
    "AnswerFrames",
    "PreparedFormat",
    "ResponseFormat",
    "ToolCallFormat",
    "ToolChoiceError",
    "answer_frames",
    "envelope_reasoning",
    "parse_prepared_format",
    "parse_response_format",
    "prepared_format_json",
    "read_prepared_format",
]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TYPES = ("text", "json_object", "json_schema")
_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "json_schema"}),
}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
_ANY_OBJECT: Mapping[str, Any] = {"type": "object"}
_TOOL_CALL = "tool_call"
_UNSUPPORTED = "tool_choice {choice} is not supported for this core's tool syntax"
_ENVELOPE = "helios_envelope"  # internal key of the prepared JSON: the reasoning envelope to admit
_FRAMES = "helios_frames"  # internal key of the prepared JSON: the answer frames to keep
# the built-in tool parser that reads each ToolSyntax family field (for callers holding only a syntax)
_PARSER_OF_SYNTAX: Mapping[str, int] = {family: parser for parser, family in TOOL_FAMILY_OF_PARSER.items() if family}


class ToolChoiceError(PromptError):
    """``tool_choice`` ``"required"`` or a named function cannot be served: no tools, a name that
    is not among them, or a tool syntax without a constrained call grammar."""


@dataclass(frozen=True)
class ResponseFormat:
    """A validated constrained ``response_format``.

    ``schema`` is the JSON schema the answer must satisfy (``{"type": "object"}`` for
    ``json_object``). ``name`` and ``strict`` are recorded as given; every schema is enforced
    exactly (a keyword llguidance cannot enforce is a compile error, never silently ignored).
    """

    kind: Literal["json_object", "json_schema"]
    schema: Mapping[str, Any]
    name: str | None = None
    strict: bool | None = None


def parse_response_format(value: object) -> ResponseFormat | None:
    """Validate an OpenAI ``response_format`` value; ``None`` (absent/null) or ``text`` -> None.

    Raises:
        PromptError: naming the malformed field (unknown type or keys, missing or non-object
            schema, bad name/description/strict).
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PromptError("response_format must be an object")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in _TYPES:
        raise PromptError("response_format.type must be one of 'text', 'json_object', 'json_schema'")
    _reject_unknown("response_format", value, _FORMAT_KEYS[kind])
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(kind="json_object", schema=_ANY_OBJECT)
    spec = value.get("json_schema")
    if spec is None:
        raise PromptError("response_format.json_schema is required when type is 'json_schema'")
    if not isinstance(spec, Mapping):
        raise PromptError("response_format.json_schema must be an object")
    _reject_unknown("response_format.json_schema", spec, _JSON_SCHEMA_KEYS)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PromptError("response_format.json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise PromptError("response_format.json_schema.description must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise PromptError("response_format.json_schema.strict must be a boolean or null")
    if "schema" not in spec:
        raise PromptError("response_format.json_schema.schema is required")
    schema = spec["schema"]
    if not isinstance(schema, Mapping):
        raise PromptError("response_format.json_schema.schema must be a JSON object")
    return ResponseFormat(kind="json_schema", schema=schema, name=name, strict=strict)


@dataclass(frozen=True)
class ToolCallFormat:
    """One tool call the model must emit: ``tool_choice`` ``"required"`` or a named function.

    ``tools`` are (name, parameters schema) pairs; ``choice`` is ``None`` for any of them
    (``"required"``) or the one name that must be called; ``grammar`` is the fragment the tool
    plugin wrote: its ``start`` generates exactly one such call (and, for syntaxes whose calls live
    in frames, the frames before it).
    """

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    choice: str | None
    grammar: GrammarFragment

    @property
    def open_header(self) -> bool:
        """Whether the grammar starts inside the frame header the prompt left open."""
        return self.grammar.open_header

    @classmethod
    def from_syntax(
        cls,
        tools: Sequence[tuple[str, Mapping[str, Any]]],
        choice: str | None,
        syntax: ct.ToolSyntax,
        header: Message | None = None,
        *,
        open_header: bool = False,
    ) -> ToolCallFormat:
        """The format for ``tools`` under a built-in ``syntax``, written by the installed plugin of
        the tool parser that reads it; ``header``: the frame syntax the calls live in, where the
        syntax frames them (a ``ReasoningSyntax`` field's message, copied into that field);
        ``open_header``: the prompt ends inside an open frame header.

        Raises:
            ToolChoiceError: no tools, an unknown named tool, or a syntax without a call grammar.
            ToolGrammarError: a tool the syntax cannot write.
        """
        family = syntax.WhichOneof("family")
        parser = _PARSER_OF_SYNTAX.get(family) if family is not None else None
        frontend = ct.FrontendContract(tool_syntax=syntax)
        frontend.tool_parser = parser or 0  # type: ignore[assignment]  # an enum field takes its number
        if header is not None:
            fields = [f for f in ct.ReasoningSyntax.DESCRIPTOR.fields if f.message_type is header.DESCRIPTOR]
            if len(fields) != 1:
                raise TypeError(f"{type(header).__name__} is not the message of one ReasoningSyntax field")
            getattr(frontend.reasoning_syntax, fields[0].name).CopyFrom(header)
        return cls.for_frontend(tools, choice, frontend, open_header=open_header)

    @classmethod
    def for_frontend(
        cls,
        tools: Sequence[tuple[str, Mapping[str, Any]]],
        choice: str | None,
        frontend: ct.FrontendContract,
        *,
        open_header: bool = False,
        grammar: ToolGrammarFactory | None = None,
    ) -> ToolCallFormat:
        """The format for ``tools`` on a core with ``frontend``: ``grammar`` (default: the installed
        plugins' grammar of ``frontend.tool_parser``) writes the call.

        Raises:
            ToolChoiceError: no tools, an unknown named tool, or no call grammar for this syntax.
            ToolGrammarError: a tool the syntax cannot write.
        """
        if not tools:
            raise ToolChoiceError("tool_choice 'required' or a named function needs at least one tool")
        names = [name for name, _ in tools]
        if choice is not None and choice not in names:
            raise ToolChoiceError(f"tool_choice names function {choice!r}, which is not among the request's tools")
        if grammar is None:
            provider = installed_host().grammar("tool_grammar", frontend.tool_parser) if frontend.tool_parser else None
            grammar = provider.factory if provider is not None else None
        unsupported = _UNSUPPORTED.format(choice="'required'" if choice is None else f"naming function {choice!r}")
        if grammar is None:
            raise ToolChoiceError(unsupported)
        pairs = tuple((name, schema) for name, schema in tools)
        fragment = grammar(ToolGrammarRequest(pairs, choice, frontend, open_header))
        if fragment is None:
            raise ToolChoiceError(unsupported)
        if not isinstance(fragment, GrammarFragment):
            raise TypeError(f"a tool grammar must return a GrammarFragment or None, not {type(fragment).__name__}")
        return cls(tools=pairs, choice=choice, grammar=fragment)

    def to_json(self) -> str:
        """The internal JSON form carried by ``PreparedRequest.response_format``."""
        return json.dumps({"type": _TOOL_CALL, **ToolChoice(self.tools, self.choice).to_json(),
                           "grammar": self.grammar.to_json()})  # fmt: skip


def _envelope_factory(frontend: ct.FrontendContract, envelope: ReasoningEnvelopeFactory | None) -> Any:
    """The reasoning envelope of ``frontend`` (``None`` when its reasoning parser has none)."""
    if envelope is None:
        provider = installed_host().grammar("reasoning_envelope", frontend.reasoning_parser)
        envelope = provider.factory if provider is not None else None
    return None if envelope is None else envelope(frontend)


def envelope_reasoning(
    frontend: ct.FrontendContract, envelope: ReasoningEnvelopeFactory | None = None
) -> ct.ReasoningSyntax | None:
    """The delimited reasoning a grammar admits before the answer or the call, or ``None``.

    ``envelope``: the selected reasoning plugin's envelope factory (default: the installed plugins'
    envelope of ``frontend.reasoning_parser``).
    """
    built = _envelope_factory(frontend, envelope)
    delimiters = built.delimiters() if built is not None else None
    if delimiters is None or not delimiters.open or not delimiters.close:
        return None
    return ct.ReasoningSyntax(open=delimiters.open, close=delimiters.close, terminal_marker=delimiters.terminal_marker)


def answer_frames(
    frontend: ct.FrontendContract,
    tools: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    open_header: bool = False,
    envelope: ReasoningEnvelopeFactory | None = None,
) -> AnswerFrames | None:
    """The frames a structured answer is written in on this core (``None``: the answer is not
    framed); ``tools``: the tools the frames may call.

    Raises:
        PromptError: the reasoning syntax cannot frame an answer, or a tool cannot be written.
    """
    built = _envelope_factory(frontend, envelope)
    if built is None:
        return None
    frames = built.answer_frames(tuple(tools), open_header=open_header)
    if frames is not None and not isinstance(frames, AnswerFrames):
        raise TypeError(f"a reasoning envelope's frames must be AnswerFrames or None, not {type(frames).__name__}")
    return frames


def prepared_format_json(
    value: Mapping[str, Any],
    reasoning: ct.ReasoningSyntax | None,
    *,
    initially_reasoning: bool = False,
    frames: AnswerFrames | None = None,
) -> str:
    """``PreparedRequest.response_format``: the format's JSON plus the envelope the worker compiles with."""
    out = dict(value)
    if reasoning is not None:
        out[_ENVELOPE] = {
            "open": reasoning.open,
            "close": reasoning.close,
            "terminal": reasoning.terminal_marker,
            "initially_reasoning": initially_reasoning,
        }
    if frames is not None:
        out[_FRAMES] = frames.to_json()
    return json.dumps(out)


class PreparedFormat(NamedTuple):
    """What :func:`read_prepared_format` reads: the arguments of ``GrammarCompiler.compile``."""

    format: ResponseFormat | ToolCallFormat | None
    reasoning: ct.ReasoningSyntax | None = None
    initially_reasoning: bool = False
    frames: AnswerFrames | None = None


def read_prepared_format(text: str) -> PreparedFormat:
    """The format of ``PreparedRequest.response_format`` with the envelope it is compiled in.

    Raises:
        PromptError: malformed JSON or fields.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise PromptError(f"prepared response format is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        return PreparedFormat(_prepared_format(value))
    frames = None
    if _FRAMES in value:
        try:
            frames = AnswerFrames.from_json(value.pop(_FRAMES))
        except ValueError as exc:
            raise PromptError(f"malformed prepared answer frames: {exc}") from exc
    if _ENVELOPE not in value:
        return PreparedFormat(_prepared_format(value), frames=frames)
    envelope = value.pop(_ENVELOPE)
    if not isinstance(envelope, Mapping):
        raise PromptError("malformed prepared reasoning envelope")
    open_, close, terminal = envelope.get("open"), envelope.get("close"), envelope.get("terminal", "")
    initially = envelope.get("initially_reasoning", False)
    if not all(isinstance(v, str) for v in (open_, close, terminal)) or not isinstance(initially, bool):
        raise PromptError("malformed prepared reasoning envelope")
    if not open_ or not close:
        raise PromptError("malformed prepared reasoning envelope")
    syntax = ct.ReasoningSyntax(open=open_, close=close, terminal_marker=terminal)
    return PreparedFormat(_prepared_format(value), syntax, initially, frames)


def parse_prepared_format(text: str) -> ResponseFormat | ToolCallFormat | None:
    """Read the format of ``PreparedRequest.response_format`` (internal JSON written by preparation).

    A client ``response_format`` passes through :func:`parse_response_format`; the internal
    ``tool_call`` kind and the envelope keys are accepted only here (the envelope itself is read by
    :func:`read_prepared_format`).

    Raises:
        PromptError: malformed JSON or fields.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise PromptError(f"prepared response format is not JSON: {exc}") from exc
    if isinstance(value, dict):
        value.pop(_ENVELOPE, None)
        value.pop(_FRAMES, None)
    return _prepared_format(value)


def _prepared_format(value: object) -> ResponseFormat | ToolCallFormat | None:
    """:func:`parse_prepared_format` of an already decoded value (without the internal envelope keys)."""
    if not isinstance(value, Mapping) or value.get("type") != _TOOL_CALL:
        return parse_response_format(value)
    if set(value) != {"type", "tools", "choice", "grammar"}:
        raise PromptError("malformed prepared tool-call format")
    try:
        calls = ToolChoice.from_json(value)
        fragment = GrammarFragment.from_json(value["grammar"])
    except ValueError as exc:
        raise PromptError(f"malformed prepared tool-call format: {exc}") from exc
    if not calls.tools:
        raise PromptError("malformed prepared tool-call format")
    return ToolCallFormat(tools=calls.tools, choice=calls.choice, grammar=fragment)


def _reject_unknown(where: str, value: Mapping[Any, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(str(key) for key, item in value.items() if key not in allowed and item is not None)
    if unknown:
        raise PromptError(f"{where}: unknown field(s) {', '.join(repr(k) for k in unknown)}")
