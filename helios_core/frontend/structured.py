"""Structured output: OpenAI ``response_format`` parsing and llguidance grammar masks.

Owns these and nothing else:

* :func:`parse_response_format` validates the request's ``response_format`` (``text``,
  ``json_object``, ``json_schema``), rejecting unknown fields, and returns a typed
  :class:`ResponseFormat` (``None`` means unconstrained). :class:`ToolCallFormat` is the internal
  format of ``tool_choice`` ``"required"`` or a named function: exactly one call in the core's
  declared tool syntax. It is never accepted from a client's ``response_format``; it travels in
  ``PreparedRequest.response_format`` as JSON and is read back with :func:`parse_prepared_format`.
* :class:`RecipientFrames` describes the recipient-header frames a structured answer is written in;
  it travels in the same prepared JSON (:func:`prepared_format_json`, :func:`read_prepared_format`).
* :class:`GrammarCompiler`, built once at startup from the core's tokenizer and vocabulary
  geometry (the llguidance tokenizer conversion is the expensive part), compiles a format into an
  immutable :class:`Grammar`; schema errors surface eagerly as :class:`PromptError`.
* :class:`GrammarMatcher`, one per request, produces the per-step allowed-token bitmask in the
  layout the sampling kernels read (``int32 [mask_words]``; bit ``b`` of word ``w`` allows id
  ``32*w + b``, LSB first; ids at or above the sampled vocabulary size are never allowed; EOS ids
  are allowed exactly when the grammar accepts termination) and advances on sampled tokens.

A structured answer is an opaque grammar-constrained document: the grammar constrains bytes, so
text that happens to spell a protocol delimiter inside it is answer text. When the core reasons with
think tags or XTML think, the grammar admits the reasoning envelope before the answer (``start:
reasoning? answer``): the open marker (omitted when the prompt already opened reasoning), free text
that never spells the close marker (nor the terminal marker, which would end reasoning implicitly),
the close marker, then the answer and EOS. Only the output limit bounds the reasoning. On
recipient-header cores the grammar keeps the frames (:class:`RecipientFrames`): reasoning frames and
frames calling the registered tools, then the answer frame or a last tool frame; a required ATEM
call may likewise follow reasoning frames. A marker is matched as the added tokens it spells (as
text in between). Reasoning/tool parsing and presentation live elsewhere.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import llguidance
import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from helios_core.errors import ContractError, HeliosError
from helios_core.frontend.bootstrap import PromptError
from helios_core.plugin_api import STRING_TYPES, schema_type
from helios_core.wire import contract_pb2 as ct

__all__ = [
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "PreparedFormat",
    "RecipientFrames",
    "ResponseFormat",
    "ToolCallFormat",
    "envelope_reasoning",
    "parse_prepared_format",
    "parse_response_format",
    "prepared_format_json",
    "read_prepared_format",
]

Mask = npt.NDArray[np.int32]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TYPES = ("text", "json_object", "json_schema")
_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "json_schema"}),
}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
_ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


class GrammarError(HeliosError):
    """A sampled token the request's grammar does not allow, or a matcher in an error state.

    Masked sampling never produces one; seeing it means the mask and the sampler disagree (a
    sampling or validation failure of the request, not an invalid request).
    """


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


_TOOL_CALL = "tool_call"
_JSON_TAGS = "json_tags"
_FUNCTION_TAGS = "function_tags"
_ARGUMENT_TAGS = "argument_tags"
_DSML = "dsml"
_XTML = "xtml"
_ATEM = "atem"
# Compact JSON (one space after ':' and ','; no other whitespace) keeps generated calls short and
# bounded: with flexible whitespace a sampler may emit whitespace forever.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# the RecipientHeaderSyntax texts a frame grammar needs; ``answer_recipient`` is the content
# recipient a structured answer is addressed to (see :func:`_header_markers`)
_HEADER_MARKERS = (
    "start",
    "assistant_role",
    "recipient_prefix",
    "message",
    "end",
    "end_of_message",
    "reasoning_recipient",
    "answer_recipient",
    "generic_tool_recipient",
    "named_tool_prefix",
)
_FAMILY_MARKERS: dict[str, tuple[str, ...]] = {
    _JSON_TAGS: (),
    _FUNCTION_TAGS: ("function_prefix", "function_close", "parameter_prefix", "parameter_close"),
    _ARGUMENT_TAGS: ("key_open", "key_close", "value_open", "value_close", "name_separator"),
    _DSML: ("marker", "block", "invoke", "parameter", "block_separator"),
    _XTML: ("open", "close", "separator", "block", "call_element", "arg_element"),
    _ATEM: ("prefix", "block", "invoke", "parameter", *_HEADER_MARKERS),
}
# XTML attribute ``type`` of a JSON-typed value, by schema type (anything else: ``object``)
_XTML_TYPES = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null", "array": "array"}


def _family(value: object) -> Family | None:
    """The constrained tool-call family named ``value``, or ``None``."""
    if value == _JSON_TAGS:
        return "json_tags"
    if value == _FUNCTION_TAGS:
        return "function_tags"
    if value == _ARGUMENT_TAGS:
        return "argument_tags"
    if value == _DSML:
        return "dsml"
    if value == _XTML:
        return "xtml"
    if value == _ATEM:
        return "atem"
    return None


def _xtml_framing(block_open: str, block_close: str) -> dict[str, str] | None:
    """XTML's ``open``/``close``/``separator``/``block`` texts read from the block's open and close
    texts (``OPEN NAME SEP`` and ``CLOSE NAME SEP``), or ``None``."""
    for match in re.finditer(r"[A-Za-z_][\w.-]*", block_open):
        name, after = match.group(0), block_open[match.end() :]
        if block_close.endswith(name + after) and after:
            opening = block_open[: match.start()]
            closing = block_close[: len(block_close) - len(name + after)]
            if opening and closing and opening != closing:
                return {"open": opening, "close": closing, "separator": after, "block": name}
    return None


_OPTIONAL_MARKERS = frozenset(
    {
        "name_separator",
        "block_separator",
        "prefix",
        "generic_tool_recipient",
        "named_tool_prefix",
        "end",
        "reasoning_recipient",
        "answer_recipient",
        "recipient_prefix",
    }
)
Family = Literal["json_tags", "function_tags", "argument_tags", "dsml", "xtml", "atem"]
_UNSUPPORTED = "tool_choice 'required' is not supported for this core's tool syntax"


@dataclass(frozen=True)
class ToolCallFormat:
    """One tool call the model must emit: ``tool_choice`` ``"required"`` or a named function.

    ``tools`` are (name, parameters schema) pairs; ``choice`` is ``None`` for any of them
    (``"required"``) or the one name that must be called. ``call_open``/``call_close`` are the
    call markers of the core's tool syntax; ``markers`` holds the family's other markers (sorted
    ``(field, text)`` pairs of ``FunctionTagSyntax`` or ``ArgumentTagSyntax``) and
    ``wrapping_newlines`` the function-tag value newlines. Supported families: JSON tags, function
    tags, argument tags, DSML, XTML and ATEM (whose call markers are the block's open and close tags).
    ATEM calls are one recipient-header frame (its markers include the ``RecipientHeaderSyntax``
    fields); ``open_header`` means the prompt already holds the frame's start and role.
    """

    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    choice: str | None
    call_open: str
    call_close: str
    family: Family = "json_tags"
    markers: tuple[tuple[str, str], ...] = ()
    wrapping_newlines: bool = False
    open_header: bool = False

    @classmethod
    def from_syntax(
        cls,
        tools: Sequence[tuple[str, Mapping[str, Any]]],
        choice: str | None,
        syntax: ct.ToolSyntax,
        header: ct.RecipientHeaderSyntax | None = None,
        *,
        open_header: bool = False,
    ) -> ToolCallFormat:
        """The format for ``tools`` under the core's declared ``syntax``.

        ``header``: the recipient-header frames ATEM calls live in (required for ATEM);
        ``open_header``: the prompt ends inside an open assistant header (ATEM only).

        Raises:
            PromptError: no tools, an unknown named tool, or a tool syntax family without
                constrained tool calls.
        """
        if not tools:
            raise PromptError("tool_choice 'required' or a named function needs at least one tool")
        names = [name for name, _ in tools]
        if choice is not None and choice not in names:
            raise PromptError(f"tool_choice names function {choice!r}, which is not among the request's tools")
        family = _family(syntax.WhichOneof("family"))
        if family == _JSON_TAGS:
            tags: Any = syntax.json_tags
        elif family == _FUNCTION_TAGS:
            tags = syntax.function_tags
        elif family == _ARGUMENT_TAGS:
            tags = syntax.argument_tags
        elif family == _DSML:
            tags = syntax.dsml
        elif family == _XTML:
            tags = syntax.xtml
        elif family == _ATEM and header is not None:
            tags = syntax.atem
        else:
            raise PromptError(_UNSUPPORTED)
        if family == _XTML:
            framing = _xtml_framing(tags.block_open, tags.block_close)
            if framing is None:
                raise PromptError(_UNSUPPORTED)
            framing.update(call_element=tags.call_element, arg_element=tags.arg_element)
            markers = tuple(sorted(framing.items()))
        elif family == _ATEM and header is not None:
            frame = _header_markers(header)
            frame.update({name: str(getattr(tags, name)) for name in _FAMILY_MARKERS[family][:4]})
            markers = tuple(sorted(frame.items()))
        else:
            markers = tuple(sorted((name, str(getattr(tags, name))) for name in _FAMILY_MARKERS[family]))
        if family == _XTML:
            call_open, call_close = tags.block_open, tags.block_close
        elif family == _DSML:
            call_open = syntax.opener or f"<{tags.marker}{tags.block}>"
            call_close = f"</{tags.marker}{tags.block}>"
        elif family == _ATEM:
            call_open = syntax.opener or f"<{tags.prefix}{tags.block}>"
            call_close = f"</{tags.prefix}{tags.block}>"
        else:
            call_open, call_close = tags.call_open, tags.call_close
        if not call_open or not call_close or not all(t for n, t in markers if n not in _OPTIONAL_MARKERS):
            raise PromptError(_UNSUPPORTED)
        return cls(
            tools=tuple((name, schema) for name, schema in tools),
            choice=choice,
            call_open=call_open,
            call_close=call_close,
            family=family,
            markers=markers,
            wrapping_newlines=bool(getattr(tags, "wrapping_newlines", False)),
            open_header=open_header and family == _ATEM,
        )

    def marker(self, name: str) -> str:
        """The family marker ``name`` (``""`` when absent)."""
        return dict(self.markers).get(name, "")

    def to_json(self) -> str:
        """The internal JSON form carried by ``PreparedRequest.response_format``."""
        syntax: dict[str, Any] = {"family": self.family, "call_open": self.call_open, "call_close": self.call_close}
        if self.family != _JSON_TAGS:
            syntax["markers"] = dict(self.markers)
            syntax["wrapping_newlines"] = self.wrapping_newlines
            syntax["open_header"] = self.open_header
        return json.dumps(
            {
                "type": _TOOL_CALL,
                "tools": [{"name": name, "parameters": dict(schema)} for name, schema in self.tools],
                "choice": self.choice,
                "syntax": syntax,
            }
        )


def _header_markers(header: ct.RecipientHeaderSyntax) -> dict[str, str]:
    """The frame texts of ``header`` by :data:`_HEADER_MARKERS` name.

    ``answer_recipient``, the content recipient a structured answer's frame is addressed to, is
    ``user`` when the syntax declares it among its content recipients, else the last declared one
    (``""``: a header without a recipient, which is content too).
    """
    texts = {name: str(getattr(header, name)) for name in _HEADER_MARKERS if name != "answer_recipient"}
    recipients = list(header.content_recipients)
    texts["answer_recipient"] = "user" if "user" in recipients else (recipients[-1] if recipients else "")
    return texts


_FRAME_REQUIRED = ("start", "assistant_role", "message", "end_of_message")


@dataclass(frozen=True)
class RecipientFrames:
    """The recipient-header frames a structured answer lives in (recipient-header reasoning cores).

    The grammar keeps the frames rather than constraining the whole output: any number of frames to
    the reasoning recipient (free reasoning text) and frames calling the request's registered tools
    (``calls``: generic or named tool recipients, one ATEM invocation each), then either the answer
    frame, addressed to the answer recipient and holding the constrained document, or a last tool
    frame. ``markers`` holds the :data:`_HEADER_MARKERS` texts; ``open_header`` means the prompt
    already holds the first frame's start and role.
    """

    markers: tuple[tuple[str, str], ...]
    calls: ToolCallFormat | None = None
    open_header: bool = False

    @classmethod
    def from_contract(
        cls,
        frontend: ct.FrontendContract,
        tools: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        open_header: bool = False,
    ) -> RecipientFrames | None:
        """The frames of a core with recipient-header reasoning (``None`` for any other core).

        Raises:
            PromptError: the header syntax lacks a frame text, or a tool cannot be called in the
                core's tool syntax.
        """
        if frontend.reasoning_parser != ct.REASONING_PARSER_RECIPIENT_HEADER:
            return None
        header = frontend.reasoning_syntax.recipient_header
        markers = _header_markers(header)
        if not all(markers[name] for name in _FRAME_REQUIRED):
            raise PromptError("response_format is not supported: the core's recipient header syntax is incomplete")
        calls = None
        if tools:
            calls = ToolCallFormat.from_syntax(tools, None, frontend.tool_syntax, header, open_header=open_header)
        return cls(markers=tuple(sorted(markers.items())), calls=calls, open_header=open_header)

    def marker(self, name: str) -> str:
        """The frame text ``name`` (``""`` when absent)."""
        return dict(self.markers).get(name, "")

    def to_json(self) -> dict[str, Any]:
        """The internal JSON form carried inside ``PreparedRequest.response_format``."""
        calls = None if self.calls is None else json.loads(self.calls.to_json())
        return {"markers": dict(self.markers), "calls": calls, "open_header": self.open_header}

    @classmethod
    def from_json(cls, value: object) -> RecipientFrames:
        """Read :meth:`to_json`'s form back.

        Raises:
            PromptError: malformed fields.
        """
        if not isinstance(value, Mapping):
            raise PromptError("malformed prepared recipient frames")
        markers, calls, open_header = value.get("markers"), value.get("calls"), value.get("open_header")
        if (
            not isinstance(markers, Mapping)
            or set(markers) != set(_HEADER_MARKERS)
            or not all(isinstance(text, str) for text in markers.values())
            or not all(markers[name] for name in _FRAME_REQUIRED)
            or not isinstance(open_header, bool)
        ):
            raise PromptError("malformed prepared recipient frames")
        call_format = None
        if calls is not None:
            parsed = _prepared_format(calls)
            if not isinstance(parsed, ToolCallFormat) or parsed.family != _ATEM or parsed.choice is not None:
                raise PromptError("malformed prepared recipient frames")
            call_format = parsed
        return cls(
            markers=tuple(sorted((str(k), str(v)) for k, v in markers.items())),
            calls=call_format,
            open_header=open_header,
        )


_ENVELOPE = "helios_envelope"  # internal key of the prepared JSON: the reasoning envelope to admit
_FRAMES = "helios_frames"  # internal key of the prepared JSON: the recipient frames to keep


def envelope_reasoning(frontend: ct.FrontendContract) -> ct.ReasoningSyntax | None:
    """The delimited reasoning a grammar must admit before the answer, or ``None``.

    Think tags use the declared open and close markers; XTML think uses them too, or (when they are
    not declared) ``OPEN think_element SEP`` and ``CLOSE think_element SEP`` of the XTML framing,
    as its parser does. Recipient-header reasoning lives in frames instead (:class:`RecipientFrames`).
    """
    syntax = frontend.reasoning_syntax
    if frontend.reasoning_parser == ct.REASONING_PARSER_XTML_THINK:
        xtml = frontend.tool_syntax.xtml
        framing = _xtml_framing(xtml.block_open, xtml.block_close)
        if framing is None:
            return None
        element = xtml.think_element or "think"
        return ct.ReasoningSyntax(
            open=syntax.open or framing["open"] + element + framing["separator"],
            close=syntax.close or framing["close"] + element + framing["separator"],
            terminal_marker=syntax.terminal_marker,
        )
    if frontend.reasoning_parser != ct.REASONING_PARSER_THINK_TAGS or not syntax.open or not syntax.close:
        return None
    return syntax


def prepared_format_json(
    value: Mapping[str, Any],
    reasoning: ct.ReasoningSyntax | None,
    *,
    initially_reasoning: bool = False,
    frames: RecipientFrames | None = None,
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
    """What :func:`read_prepared_format` reads: the arguments of :meth:`GrammarCompiler.compile`."""

    format: ResponseFormat | ToolCallFormat | None
    reasoning: ct.ReasoningSyntax | None = None
    initially_reasoning: bool = False
    frames: RecipientFrames | None = None


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
    frames = RecipientFrames.from_json(value.pop(_FRAMES)) if _FRAMES in value else None
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
    ``tool_call`` kind and the reasoning envelope key are accepted only here (the envelope itself
    is read by :func:`read_prepared_format`).

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
    tools = value.get("tools")
    syntax = value.get("syntax")
    choice = value.get("choice")
    if (
        not isinstance(tools, list)
        or not isinstance(syntax, Mapping)
        or not (choice is None or isinstance(choice, str))
    ):
        raise PromptError("malformed prepared tool-call format")
    pairs: list[tuple[str, Mapping[str, Any]]] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise PromptError("malformed prepared tool-call format")
        name, schema = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not isinstance(schema, Mapping):
            raise PromptError("malformed prepared tool-call format")
        pairs.append((name, schema))
    call_open, call_close, family = syntax.get("call_open"), syntax.get("call_close"), _family(syntax.get("family"))
    if family is None or not isinstance(call_open, str) or not isinstance(call_close, str):
        raise PromptError(_UNSUPPORTED)
    markers = syntax.get("markers", {})
    wrapping = syntax.get("wrapping_newlines", False)
    open_header = syntax.get("open_header", False)
    if (
        not isinstance(markers, Mapping)
        or set(markers) != set(_FAMILY_MARKERS[family])
        or not all(isinstance(text, str) for text in markers.values())
        or not isinstance(wrapping, bool)
        or not isinstance(open_header, bool)
    ):
        raise PromptError("malformed prepared tool-call format")
    if not pairs or (choice is not None and choice not in {name for name, _ in pairs}):
        raise PromptError("malformed prepared tool-call format")
    return ToolCallFormat(
        tools=tuple(pairs),
        choice=choice,
        call_open=call_open,
        call_close=call_close,
        family=family,
        markers=tuple(sorted((str(name), str(text)) for name, text in markers.items())),
        wrapping_newlines=wrapping,
        open_header=open_header and family == _ATEM,
    )


def _reject_unknown(where: str, value: Mapping[Any, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        raise PromptError(f"{where}: unknown field(s) {', '.join(repr(k) for k in unknown)}")


@dataclass(frozen=True)
class _Geometry:
    """Vocabulary geometry shared by every matcher of one compiler (read-only arrays)."""

    sampled_size: int
    mask_words: int
    llg_words: int  # words of llguidance's own mask (covers its n_vocab, >= mask_words)
    keep: Mask  # bits of ids < sampled_size
    eos: Mask  # bits of the EOS ids
    not_eos: Mask
    eos_ids: tuple[int, ...]


def _bits(ids: Sequence[int] | npt.NDArray[np.int64], words: int) -> Mask:
    flags = np.zeros(words * 32, dtype=np.uint8)
    flags[np.asarray(ids, dtype=np.int64)] = 1
    packed = np.packbits(flags, bitorder="little")  # byte k holds ids 8k..8k+7, LSB first
    return packed.view("<u4").astype(np.int32)


class GrammarCompiler:
    """Compiles response formats against one tokenizer; build once at startup and share.

    Args:
        tokenizer: the core's frontend tokenizer.
        sampled_size: ids ``>= sampled_size`` are never sampled (padding of the logits).
        logits_width: width of the logits row; masks have ``ceil(logits_width / 32)`` words.
        eos_token_ids: the core's EOS ids; allowed exactly when the grammar accepts termination.

    Raises:
        ContractError: inconsistent geometry, or a tokenizer llguidance cannot convert.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        sampled_size: int,
        logits_width: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        if not 1 <= sampled_size <= logits_width:
            raise ContractError(f"sampled_size must lie in [1, logits_width={logits_width}], not {sampled_size}")
        eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        if not eos:
            raise ContractError("structured output needs at least one EOS token id")
        bad = [t for t in eos if not 0 <= t < sampled_size]
        if bad:
            raise ContractError(f"EOS token ids {bad} lie outside the sampled vocabulary [0, {sampled_size})")
        mask_words = (logits_width + 31) // 32
        n_vocab = max(int(tokenizer.get_vocab_size(with_added_tokens=True)), logits_width)
        llg_words = (n_vocab + 31) // 32
        plain = Tokenizer.from_str(tokenizer.to_str())
        plain.no_padding()
        plain.no_truncation()
        try:
            self._llg = llguidance.LLTokenizer(plain.to_str(), n_vocab=n_vocab, eos_token=list(eos))
        except (ValueError, RuntimeError) as exc:
            raise ContractError(f"llguidance cannot use the frontend tokenizer: {exc}") from exc
        keep = _bits(np.arange(sampled_size), mask_words)
        eos_bits = _bits(eos, mask_words)
        for array in (keep, eos_bits):
            array.flags.writeable = False
        not_eos = ~eos_bits
        not_eos.flags.writeable = False
        self._geometry = _Geometry(
            sampled_size=sampled_size,
            mask_words=mask_words,
            llg_words=llg_words,
            keep=keep,
            eos=eos_bits,
            not_eos=not_eos,
            eos_ids=eos,
        )
        self._any_object: dict[tuple[str, str, str, bool] | None, Grammar] = {}
        added = sorted(
            ((token.content, int(index)) for index, token in tokenizer.get_added_tokens_decoder().items()),
            key=lambda item: -len(item[0]),
        )
        # sampled added tokens by their first character, longest first
        self._added_by_initial: dict[str, list[tuple[str, int]]] = {}
        for content, index in added:
            if content and index < sampled_size:
                self._added_by_initial.setdefault(content[0], []).append((content, index))

    @property
    def mask_words(self) -> int:
        """Words of every mask this compiler's matchers produce."""
        return self._geometry.mask_words

    def compile(
        self,
        fmt: ResponseFormat | ToolCallFormat,
        *,
        reasoning: ct.ReasoningSyntax | None = None,
        initially_reasoning: bool = False,
        frames: RecipientFrames | None = None,
    ) -> Grammar:
        """Compile and validate ``fmt``'s schema now (not at the first token).

        ``reasoning``: the delimited reasoning of the core (see :func:`envelope_reasoning`); the
        grammar then admits a reasoning envelope before the answer. ``initially_reasoning``: the
        prompt opened reasoning, so generation starts inside it (no open marker first).
        ``frames``: the recipient-header frames a :class:`ResponseFormat` answer is written in.

        Raises:
            PromptError: the schema is not valid JSON or llguidance rejects it (its message).
        """
        key = None
        if reasoning is not None:
            key = (reasoning.open, reasoning.close, reasoning.terminal_marker, initially_reasoning)
        if isinstance(fmt, ToolCallFormat):
            where = "tools" if fmt.choice is None else f"tools ({fmt.choice})"
            rules = self._tool_call_rules(fmt) if fmt.family == _JSON_TAGS else self._tag_call_rules(fmt)
            return self._compile_lark(rules, where, reasoning, initially_reasoning)
        where = "response_format.json_schema.schema" if fmt.kind == "json_schema" else "response_format"
        if frames is not None:
            try:
                schema = json.dumps(dict(fmt.schema))
            except (ValueError, TypeError) as exc:
                raise PromptError(f"{where}: {exc}") from exc
            return self._compile_lark(self._framed_answer_rules(frames, schema), where, None, False)
        cached = self._any_object.get(key)
        if fmt.kind == "json_object" and cached is not None:
            return cached
        if reasoning is None:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(fmt.schema))
            except (ValueError, TypeError) as exc:
                raise PromptError(f"{where}: {exc}") from exc
            compiled = self._matcher_grammar(grammar, where)
        else:
            try:
                schema = json.dumps(dict(fmt.schema))
            except (ValueError, TypeError) as exc:
                raise PromptError(f"{where}: {exc}") from exc
            compiled = self._compile_lark([f"answer: %json {schema}"], where, reasoning, initially_reasoning)
        if fmt.kind == "json_object":
            self._any_object[key] = compiled  # the same grammar for every request: compile it once
        return compiled

    def _tool_call_rules(self, fmt: ToolCallFormat) -> list[str]:
        """``call_open`` + ``{"name": N, "arguments": <N's schema>}`` (compact JSON) + ``call_close``.

        A marker that is one added token of the tokenizer is matched as that token (never as its
        spelling in ordinary bytes); any other marker is matched as text.
        """
        alternatives = []
        for index, (name, parameters) in enumerate(fmt.tools):
            if fmt.choice is not None and name != fmt.choice:
                continue
            arguments = dict(parameters) if parameters else {"type": "object"}
            schema = {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
                "x-guidance": _COMPACT,
            }
            alternatives.append((f"call_{index}", json.dumps(schema)))
        return [
            f"answer: {self._marker(fmt.call_open)} body {self._marker(fmt.call_close)}",
            "body: " + " | ".join(rule for rule, _ in alternatives),
            *(f"{rule}: %json {schema}" for rule, schema in alternatives),
        ]

    def _tag_call_bodies(self, fmt: ToolCallFormat) -> tuple[list[tuple[int, str]], list[str]]:
        """(index and name of each callable tool, rules): rule ``call_INDEX`` is one call of that tool
        in ``fmt``'s family (ATEM: its block, the body of a frame).

        Each call: the name fixed, then a parameter block per property.

        Required properties come in schema order; optional ones may be skipped (in the same order).
        A string-typed value (kept verbatim by the parser) is text that never spells a marker ending
        it and never starts or ends with a newline, within the string's ``enum``/``const``,
        ``pattern`` and length keywords; every other value is compact JSON of its schema (the
        parser decodes it). Strings nested inside JSON values are not kept free of the markers.
        """
        m = fmt.marker
        functions = fmt.family == _FUNCTION_TAGS
        dsml = fmt.family == _DSML
        xtml = fmt.family == _XTML
        atem = fmt.family == _ATEM
        mark = m("prefix") if atem else m("marker")
        open_, close_, sep = (self._marker(m(name)) for name in ("open", "close", "separator"))
        if functions:
            ends = [m("parameter_close"), m("parameter_prefix"), m("function_close")]
        elif dsml or atem:
            parameter, invoke = f"{mark}{m('parameter')}", f"{mark}{m('invoke')}"
            ends = [f"</{parameter}>", f"<{parameter}", f"</{invoke}>", f"<{invoke}"]
        elif xtml:
            ends = [m("open"), m("close"), m("separator")]
        else:
            ends = [m("value_close"), m("key_open")]
        terminators = [text for text in (*ends, fmt.call_close, fmt.call_open) if text]
        wrap = '"\\n" ' if functions and fmt.wrapping_newlines else ""
        rules: list[str] = []
        called: list[tuple[int, str]] = []
        for index, (name, parameters) in enumerate(fmt.tools):
            if fmt.choice is not None and name != fmt.choice:
                continue
            where = f"tools ({name})"
            if not _NAME.fullmatch(name):
                raise PromptError(f"{where}: the function name cannot be written in this core's tool syntax")
            items: list[str] = []
            for number, (key, schema, required) in enumerate(_tag_parameters(parameters, where)):
                unquotable = (dsml or xtml or atem) and ('"' in key or "&" in key)
                if not _KEY.fullmatch(key) or unquotable or any(text in key for text in terminators):
                    raise PromptError(f"{where}: parameter name {key!r} cannot be written in this core's tool syntax")
                rule = f"p_{index}_{number}"
                value = self._tag_value(f"{rule}_v", schema, terminators, rules, f"{where}: parameter {key!r}")
                if dsml or atem:
                    flag = "true" if schema_type(schema) in STRING_TYPES else "false"
                    typed = "" if atem else f' string="{flag}"'
                    head = json.dumps(f'<{parameter} name="{key}"{typed}>', ensure_ascii=False)
                    body = f'{head} {value} {json.dumps(f"</{parameter}>", ensure_ascii=False)} "\\n"'
                elif xtml:
                    kind = (
                        "string" if schema_type(schema) in STRING_TYPES else _XTML_TYPES.get(str(schema_type(schema)))
                    )
                    attributes = json.dumps(f' key="{key}" type="{kind or "object"}"')
                    arg = json.dumps(m("arg_element"))
                    body = f"{open_} {arg} {attributes} {sep} {value} {close_} {arg} {sep}"
                elif functions:
                    head = f'{self._marker(m("parameter_prefix"))} {json.dumps(key)} ">"'
                    body = f'{head} {wrap}{value} {wrap}{self._marker(m("parameter_close"))} "\\n"'
                else:
                    head = f'{self._marker(m("key_open"))} {json.dumps(key)} {self._marker(m("key_close"))} "\\n"'
                    body = f'{head} {self._marker(m("value_open"))} {value} {self._marker(m("value_close"))} "\\n"'
                rules.append(f"{rule}: {body}")
                items.append(rule if required else f"{rule}?")
            params = " ".join(items)
            if dsml or atem:
                head = json.dumps(f'<{invoke} name="{name}">', ensure_ascii=False)
                close = json.dumps(f"</{invoke}>", ensure_ascii=False)
                empty = '"\\n"'  # no parameters: an empty line
                call = f'"\\n" {head} "\\n" {params or empty} {close} "\\n"'
                if atem:  # the frame's body; the frame itself is written by _frame_rules
                    call = f"{self._marker(fmt.call_open)} {call} {self._marker(fmt.call_close)}"
            elif xtml:
                element = json.dumps(m("call_element"))
                attributes = json.dumps(f" tool={json.dumps(name)}")
                call = f"{open_} {element} {attributes} {sep} {params} {close_} {element} {sep}"
            elif functions:
                prefix, close = self._marker(m("function_prefix")), self._marker(m("function_close"))
                call = f'"\\n" {prefix} {json.dumps(name)} ">\\n" {params} {close} "\\n"'
            else:
                separator = m("name_separator")
                call = f"{json.dumps(name)} {self._marker(separator) if separator else ''} {params}"
            rules.append(f"call_{index}: {call}")
            called.append((index, name))
        return called, rules

    def _tag_call_rules(self, fmt: ToolCallFormat) -> list[str]:
        """``answer``: one call of ``fmt`` in its family's block (ATEM: in its recipient frame)."""
        called, rules = self._tag_call_bodies(fmt)
        m = fmt.marker
        if fmt.family == _ATEM:  # reasoning frames, then the frame of the call
            eom = self._marker(m("end_of_message"))
            finals = [f"{self._recipient(fmt, name)} {self._marker(m('message'))} call_{i} {eom}" for i, name in called]
            lead = [self._reasoning_frame(m)] if m("reasoning_recipient") else []
            return [*self._frame_rules(m, fmt.open_header, lead, finals), *rules]
        if fmt.family == _XTML:
            open_, close_, sep = (self._marker(m(name)) for name in ("open", "close", "separator"))
            block = json.dumps(m("block"))
            answer = f"answer: {open_} {block} {sep} body {close_} {block} {sep}"
        else:
            separator = json.dumps(m("block_separator")) + " " if fmt.family == _DSML and m("block_separator") else ""
            answer = f"answer: {separator}{self._marker(fmt.call_open)} body {self._marker(fmt.call_close)}"
        return [answer, "body: " + " | ".join(f"call_{index}" for index, _ in called), *rules]

    def _recipient(self, fmt: ToolCallFormat, name: str) -> str:
        """The recipient of the frame calling ``name`` under ``tool_choice``: the generic tool
        recipient for ``"required"`` (when declared), else ``named_tool_prefix + name``."""
        m = fmt.marker
        generic, named = m("generic_tool_recipient"), m("named_tool_prefix")
        if fmt.choice is None and generic:
            recipient = generic
        elif named or not generic:
            recipient = named + name
        else:
            recipient = generic
        return json.dumps(m("recipient_prefix") + recipient)

    def _reasoning_frame(self, m: Callable[[str], str]) -> str:
        """A reasoning frame after the role: the reasoning recipient, free text, then end (or end of message)."""
        closers = [self._marker(m(name)) for name in ("end", "end_of_message") if m(name)]
        recipient = json.dumps(m("recipient_prefix") + m("reasoning_recipient"))
        return f"{recipient} {self._marker(m('message'))} FRAME_TEXT? ({' | '.join(closers)})"

    def _frame_rules(self, m: Callable[[str], str], open_header: bool, lead: list[str], finals: list[str]) -> list[str]:
        """``answer``: any frames of the ``lead`` kinds, then one frame of a ``finals`` kind.

        Each kind is a frame's text after the assistant role (recipient, message marker, body,
        closer); with ``open_header`` the first frame's start and role are already in the prompt.
        """
        head = f"{self._marker(m('start'))} {json.dumps(m('assistant_role'))}"
        rules = [f"final_frame: {head} final_suffix", "final_suffix: " + " | ".join(f"({k})" for k in finals)]
        if lead:
            rules += [f"lead_frame: {head} lead_suffix", "lead_suffix: " + " | ".join(f"({k})" for k in lead)]
            rules.append("FRAME_TEXT: /(?s:.+)/")
            answer = "lead_suffix lead_frame* final_frame | final_suffix" if open_header else "lead_frame* final_frame"
        else:
            answer = "final_suffix" if open_header else "final_frame"
        return [f"answer: {answer}", *rules]

    def _framed_answer_rules(self, frames: RecipientFrames, schema: str) -> list[str]:
        """A structured answer in recipient-header frames: reasoning frames and frames calling the
        registered tools (generic or named recipients), then the answer frame (the document, then an
        optional end) or a last tool frame."""
        m = frames.marker
        message, eom = self._marker(m("message")), self._marker(m("end_of_message"))
        end = f" {self._marker(m('end'))}?" if m("end") else ""
        answer = f"{json.dumps(m('recipient_prefix') + m('answer_recipient'))} {message} answer_document{end}"
        tools: list[str] = []
        rules = [f"answer_document: %json {schema}"]
        if frames.calls is not None:
            _, call_rules = self._tag_call_bodies(frames.calls)
            rules += call_rules
            generic, named = m("generic_tool_recipient"), m("named_tool_prefix")
            for index, (name, _) in enumerate(frames.calls.tools):
                names = dict.fromkeys(r for r in (generic, named + name if named or not generic else "") if r)
                recipients = " | ".join(json.dumps(m("recipient_prefix") + r) for r in names)
                tools.append(f"({recipients}) {message} call_{index} {eom}")
        lead = ([self._reasoning_frame(m)] if m("reasoning_recipient") else []) + tools
        return [*self._frame_rules(m, frames.open_header, lead, [answer, *tools]), *rules]

    def _tag_value(
        self, rule: str, schema: Mapping[str, Any], terminators: list[str], rules: list[str], where: str
    ) -> str:
        """A Lark expression for one value (appending the rules it needs to ``rules``)."""
        if schema_type(schema) not in STRING_TYPES:
            try:
                text = json.dumps({**schema, "x-guidance": _COMPACT})
            except (ValueError, TypeError) as exc:
                raise PromptError(f"{where}: {exc}") from exc
            rules.append(f"{rule}: %json {text}")
            return rule
        string = _string_schema(schema, where)
        forbidden = "|".join(_regex_literal(text) for text in terminators)
        literals = string.get("enum", [string["const"]] if "const" in string else None)
        if literals is not None:
            if not isinstance(literals, list) or not all(isinstance(v, str) for v in literals) or not literals:
                raise PromptError(f"{where}: a string enum must list strings")
            if any(text in v for v in literals for text in terminators):
                raise PromptError(f"{where}: an enum value spells a marker of this core's tool syntax")
            spelled = [json.dumps(v, ensure_ascii=False) for v in dict.fromkeys(literals) if v]
            if not spelled:
                return ""
            rules.append(f"{rule}: " + " | ".join(spelled))
            return f"{rule}?" if "" in literals else rule
        low, high = string.get("minLength", 0), string.get("maxLength")
        if not isinstance(low, int) or not (high is None or isinstance(high, int)) or low < 0:
            raise PromptError(f"{where}: minLength and maxLength must be non-negative integers")
        if high == 0:
            return ""
        lexeme = rule.upper()
        parts = [
            f"/(?s:.{{{max(low, 1)},{'' if high is None else high}}})/",
            f"~/(?s:.*({forbidden}).*)/",
            "~/(?s:\\n.*|.*\\n)/",
        ]
        pattern = string.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise PromptError(f"{where}: pattern must be a string")
            parts.append(f"/{_pattern_regex(pattern)}/")
        rules.append(f"{lexeme}: " + " & ".join(parts))
        return f"{lexeme}?" if low == 0 and (pattern is None or _matches_empty(pattern)) else lexeme

    def _compile_lark(
        self, answer: list[str], where: str, reasoning: ct.ReasoningSyntax | None, initially_reasoning: bool
    ) -> Grammar:
        """``start: reasoning? answer`` (or ``start: answer`` without a reasoning syntax), then EOS."""
        if reasoning is None:
            head = ["start: answer"]
        else:
            forbidden = [reasoning.close] + ([reasoning.terminal_marker] if reasoning.terminal_marker else [])
            spelled = "|".join(_regex_literal(text) for text in forbidden)
            opener = "" if initially_reasoning else f"{self._marker(reasoning.open)} "
            head = [
                "start: thought answer" if initially_reasoning else "start: thought? answer",
                f"thought: {opener}THOUGHT? {self._marker(reasoning.close)} GAP?",
                f"THOUGHT: /(?s:.+)/ & ~/(?s:.*({spelled}).*)/",
                "GAP: /\\n{1,2}/",
            ]
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark("\n".join([*head, *answer]))
        except (ValueError, TypeError) as exc:
            raise PromptError(f"{where}: {_first_line(str(exc))}") from exc
        return self._matcher_grammar(grammar, where)

    def _matcher_grammar(self, grammar: str, where: str) -> Grammar:
        prototype = llguidance.LLMatcher(self._llg, grammar, log_level=0)
        if prototype.is_error():
            raise PromptError(f"{where}: {_first_line(prototype.get_error())}")
        return Grammar(prototype=prototype, geometry=self._geometry, source=grammar)

    def _marker(self, text: str) -> str:
        """A Lark term matching ``text``: each added token it spells as that token (the longest at
        each position), the text between them as literal text."""
        terms: list[str] = []
        literal = ""
        at = 0
        while at < len(text):
            token = self._added_at(text, at)
            if token is None:
                literal += text[at]
                at += 1
                continue
            if literal:
                terms.append(json.dumps(literal, ensure_ascii=False))
                literal = ""
            terms.append(f"<[{token[0]}]>")
            at += token[1]
        if literal or not terms:
            terms.append(json.dumps(literal, ensure_ascii=False))
        return terms[0] if len(terms) == 1 else "(" + " ".join(terms) + ")"

    def _added_at(self, text: str, at: int) -> tuple[int, int] | None:
        """(id, length) of the longest sampled added token spelled at ``text[at:]``, or ``None``."""
        for content, token in self._added_by_initial.get(text[at], ()):
            if text.startswith(content, at):
                return token, len(content)
        return None


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated grammar; share it and call :meth:`matcher` per request."""

    prototype: Any  # llguidance.LLMatcher in its initial state; only ever deep-copied
    geometry: _Geometry
    source: str  # llguidance's grammar text (diagnostics)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the document."""
        with self._lock:
            copy = self.prototype.deep_copy()
        return GrammarMatcher(copy, self.geometry)


class GrammarMatcher:
    """Per-request grammar state; not thread-safe (one request, one worker at a time).

    Per step: :meth:`mask` (upload to the device), sample, :meth:`advance` with the sampled id.
    """

    def __init__(self, matcher: Any, geometry: _Geometry) -> None:
        self._matcher = matcher
        self._geometry = geometry
        self._scratch: Mask = np.zeros(geometry.llg_words, dtype=np.int32)
        self._mask: Mask | None = None

    def mask(self) -> Mask:
        """Allowed ids of the next token: read-only ``int32 [mask_words]`` in the kernels' layout.

        Cached until the next :meth:`advance`. Raises :class:`GrammarError` if the matcher is in
        an error state.
        """
        if self._mask is None:
            self._mask = self._compute()
        return self._mask

    def _compute(self) -> Mask:
        g = self._geometry
        scratch = self._scratch
        self._matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"grammar matcher failed: {_first_line(self._matcher.get_error())}")
        out: Mask = np.bitwise_and(scratch[: g.mask_words], g.keep)
        if self._matcher.is_accepting():
            np.bitwise_or(out, g.eos, out=out)
        else:
            np.bitwise_and(out, g.not_eos, out=out)
        out.flags.writeable = False
        return out

    def advance(self, token_id: int) -> None:
        """Consume the sampled ``token_id``.

        Raises:
            GrammarError: the id is outside the sampled vocabulary or not allowed here.
        """
        g = self._geometry
        token = int(token_id)
        if not 0 <= token < g.sampled_size:
            raise GrammarError(f"token id {token} lies outside the sampled vocabulary [0, {g.sampled_size})")
        allowed = self.mask()
        if not (int(allowed[token >> 5]) >> (token & 31)) & 1:
            raise GrammarError(f"token id {token} is not allowed by the response grammar at this point")
        if not self._matcher.consume_token(token):
            raise GrammarError(f"grammar rejected token id {token}: {_first_line(self._matcher.get_error())}")
        self._mask = None

    @property
    def is_accepting(self) -> bool:
        """Whether the document so far is complete (EOS may end it)."""
        return bool(self._matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """Whether nothing but EOS can follow: the matcher stopped, or it accepts and only EOS is allowed."""
        if self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        return bool(np.array_equal(self.mask(), self._geometry.eos))


_KEY = re.compile(r"[^<>\s](?:[^<>\n]*[^<>\s])?")
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "description", "title", "$schema"})
_STRING_KEYS = frozenset(
    {"type", "description", "title", "default", "examples", "enum", "const", "pattern", "minLength", "maxLength"}
)


def _tag_parameters(parameters: Mapping[str, Any], where: str) -> list[tuple[str, Mapping[str, Any], bool]]:
    """(name, schema, required) of each property of a tool's parameters, in schema order.

    Raises:
        PromptError: a schema keyword the tag families cannot enforce, or a required property
            without a schema.
    """
    unknown = sorted(str(key) for key in parameters if key not in _OBJECT_KEYS)
    if unknown:
        raise PromptError(
            f"{where}: schema keyword(s) {', '.join(unknown)} cannot be enforced in this core's tool syntax"
        )
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        raise PromptError(f"{where}: properties must be an object and required a list")
    missing = [str(key) for key in required if key not in properties]
    if missing:
        raise PromptError(f"{where}: required parameter(s) {', '.join(missing)} have no schema")
    out: list[tuple[str, Mapping[str, Any], bool]] = []
    for key, schema in properties.items():
        if not isinstance(key, str) or not isinstance(schema, Mapping):
            raise PromptError(f"{where}: each property needs a schema object")
        out.append((key, schema, key in required))
    return out


def _string_schema(schema: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The string schema a verbatim (string-typed) value must satisfy: the schema or its string
    ``anyOf`` branch.

    Raises:
        PromptError: a keyword that cannot be enforced on raw text.
    """
    if "type" not in schema and "enum" not in schema:
        branches = schema.get("anyOf")
        if isinstance(branches, list) and "oneOf" not in schema:
            for branch in branches:
                if isinstance(branch, Mapping) and schema_type(branch) in STRING_TYPES:
                    return _string_schema(branch, where)
        raise PromptError(f"{where}: this string schema cannot be enforced in this core's tool syntax")
    unknown = sorted(str(key) for key in schema if key not in _STRING_KEYS)
    if unknown:
        raise PromptError(f"{where}: keyword(s) {', '.join(unknown)} cannot be enforced in this core's tool syntax")
    return schema


def _matches_empty(pattern: str) -> bool:
    """Whether ``pattern`` accepts the empty string (``False`` when Python cannot read it)."""
    try:
        return re.search(pattern, "") is not None
    except re.error:
        return False


def _pattern_regex(pattern: str) -> str:
    """A JSON-schema ``pattern`` (a search) as a whole-text regex for a Lark lexeme."""
    core = pattern[1:] if pattern.startswith("^") else pattern
    end = core.endswith("$") and not core.endswith("\\$")
    core = core[:-1] if end else core
    head = "" if pattern.startswith("^") else "(?s:.*)"
    return (head + f"(?:{core})" + ("" if end else "(?s:.*)")).replace("/", "\\/")


def _regex_literal(text: str) -> str:
    """``text`` as a regex of its exact characters (each as ``\\x{...}``: nothing to escape)."""
    return "".join(f"\\x{{{ord(char):x}}}" for char in text)


def _first_line(message: str) -> str:
    """llguidance errors append a multi-line parser dump; keep the human-readable first line."""
    return message.strip().splitlines()[0] if message.strip() else "unknown llguidance error"
