"""Recipient-header reasoning (REASONING_PARSER_RECIPIENT_HEADER) and ATEM tool calls
(TOOL_PARSER_ATEM), paired: one parser consumes complete recipient frames.

Owns both implementations. Frames are ``START ROLE PREFIX RECIPIENT MESSAGE body END|EOM`` as
declared by ``RecipientHeaderSyntax`` (``<|start|>assistant to=RECIPIENT<|message|>...<|end|>``):

* ``start``, ``message``, ``end`` and ``end_of_message`` delimit frames only when generated as their
  tokenizer tokens (each must be one token); their plain-text spellings are body text.
* The recipient is the first word after ``recipient_prefix`` in the header. ``reasoning_recipient``
  (``self``) bodies are reasoning; ``content_recipients`` (``commentary``, ``user``) bodies and
  headers without a recipient are visible content; ``generic_tool_recipient`` bodies may invoke any
  tool of the request; ``named_tool_prefix + NAME`` (or any other recipient, taken as the name)
  bodies must invoke exactly ``NAME``.
* Tool bodies hold one ATEM block ``<P BLOCK><P INVOKE name="N"><P PARAMETER name="K">V</P
  PARAMETER></P INVOKE></P BLOCK>`` (``AtemSyntax``: ``prefix``, ``block``, ``invoke``,
  ``parameter``). One invocation per frame is a call (later ones in the same frame are dropped);
  parallel calls are consecutive frames. Invocation names ``x.*`` and ``x.x`` mean ``x``. Values
  are verbatim for string schemas (and stream), otherwise JSON-decoded, else text.
* An invocation the recipient does not admit, or a tool body without a block, is visible content
  (raw text), like other malformed tool bodies; a block cut off at the end keeps its call.
* ``end`` and ``end_of_message`` both close a frame; after either another header may follow. Text
  between frames is content unless it is only whitespace. A header cut off at the end is dropped.
* The prompt's open envelope sets the start: ``open_header`` continues a header the prompt began
  (``<|start|>assistant``), ``open_recipient`` starts inside that recipient's body,
  ``initially_reasoning`` inside a reasoning body.

ATEM only appears inside these frames, so the ATEM tool parser on the content stream passes text
through; the calls come from the reasoning parser. The host refuses one without the other.

Constrained output in these frames (the ATEM call grammar and the envelope of structured answers)
is written by :mod:`helios_plugins.recipient_frames`; this module registers it.
"""

from __future__ import annotations

from enum import Enum

from helios_core.plugin_api import (
    GeneratedPiece,
    OutputDelta,
    ParserContext,
    Register,
    SectionScan,
    SectionToolParser,
    StartupError,
    TagGrammar,
    ToolCallWriter,
    contract,
    parse_attributes,
    scan_tagged_section,
)
from helios_plugins.recipient_frames import atem_grammar, recipient_envelope

HELIOS_PLUGIN_API = (1, 0)


def _normalise_name(name: str) -> str:
    if name.endswith(".*"):
        name = name[:-2]
    head, dot, tail = name.partition(".")
    return head if dot and head == tail else name


class _Route(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL = "tool"


class AtemFrameParser(SectionToolParser):
    """The ATEM block of one tool frame; admits invocations named in ``allowed``."""

    undeclared = "json"

    def __init__(self, context: ParserContext, allowed: frozenset[str], writer: ToolCallWriter) -> None:
        atem = context.frontend.tool_syntax.atem
        p = atem.prefix
        super().__init__(context, context.frontend.tool_syntax.opener or f"<{p}{atem.block}>", writer=writer)
        self._allowed = allowed
        self._grammar = TagGrammar(
            section_close=f"</{p}{atem.block}>",
            call_open=f"<{p}{atem.invoke}",
            call_open_end=">",
            call_close=f"</{p}{atem.invoke}>",
            param_open=f"<{p}{atem.parameter}",
            param_open_end=">",
            param_close=f"</{p}{atem.parameter}>",
            call_name=self._name,
            param_key=_key,
        )

    def _name(self, header: str) -> str | None:
        name = _normalise_name(parse_attributes(header).get("name", ""))
        return name if name in self._allowed else None

    def scan_section(self, text: str, final: bool) -> SectionScan:
        scan = scan_tagged_section(self._grammar, text, final)
        del scan.calls[1:]
        return scan


def _key(header: str) -> tuple[str, bool | None] | None:
    key = parse_attributes(header).get("name")
    return (key, None) if key else None


class RecipientHeaderParser:
    """Recipient-header frames of one request (see the module docstring)."""

    def __init__(self, context: ParserContext) -> None:
        frontend = context.frontend
        header = frontend.reasoning_syntax.recipient_header
        atem = frontend.tool_syntax.atem
        if not (atem.prefix or atem.block) or not atem.invoke or not atem.parameter:
            raise StartupError("tool_syntax.atem.block, .invoke and .parameter must be declared")
        ids: dict[str, int] = {}
        for field in ("start", "message", "end", "end_of_message"):
            text = getattr(header, field)
            token = context.vocabulary.single_token(text) if text else None
            if token is None:
                raise StartupError(
                    f"reasoning_syntax.recipient_header.{field} {text!r} must be one token of the tokenizer"
                )
            ids[field] = token
        if not header.reasoning_recipient:
            raise StartupError("reasoning_syntax.recipient_header.reasoning_recipient must be declared")
        self._context = context
        self._syntax = header
        self._start, self._message = ids["start"], ids["message"]
        self._closers = {ids["end"], ids["end_of_message"]}
        self._writer = ToolCallWriter()
        self._tools = frozenset(spec.name for spec in context.tools)
        self._header: str | None = None
        self._route: _Route | None = None
        self._frame: AtemFrameParser | None = None
        self._between = ""
        envelope = context.envelope
        if envelope.open_header is not None:
            self._header = envelope.open_header
        elif envelope.open_recipient is not None:
            self._open_body(envelope.open_recipient)
        elif envelope.initially_reasoning:
            self._open_body(header.reasoning_recipient)

    # -- ReasoningParser ----------------------------------------------------------------------

    def feed(self, piece: GeneratedPiece) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        token = piece.token_id
        if token == self._start:
            self._close_body(out)
            self._flush_between(out)
            self._header = ""
        elif token == self._message:
            if self._header is not None:
                self._open_body(self._recipient(self._header))
                self._header = None
        elif token in self._closers:
            self._close_body(out)
            self._header = None
        elif self._header is not None:
            self._header += piece.text
        elif self._route is None:
            self._between += piece.text
        else:
            self._body(piece.text, out)
        return out

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        self._close_body(out)
        self._flush_between(out)
        return out

    # -- machinery ----------------------------------------------------------------------------

    def _recipient(self, header: str) -> str:
        prefix = self._syntax.recipient_prefix or " to="
        at = header.find(prefix)
        if at < 0:
            at = header.find(prefix.strip())
            prefix = prefix.strip()
        words = header[at + len(prefix) :].split() if at >= 0 else []
        return words[0] if words else ""

    def _open_body(self, recipient: str) -> None:
        syntax = self._syntax
        self._frame = None
        if recipient == syntax.reasoning_recipient:
            self._route = _Route.REASONING
        elif not recipient or recipient in syntax.content_recipients:
            self._route = _Route.CONTENT
        else:
            self._route = _Route.TOOL
            if syntax.generic_tool_recipient and recipient == syntax.generic_tool_recipient:
                allowed = self._tools
            elif syntax.named_tool_prefix and recipient.startswith(syntax.named_tool_prefix):
                allowed = frozenset({_normalise_name(recipient[len(syntax.named_tool_prefix) :])})
            else:
                allowed = frozenset({_normalise_name(recipient)})
            self._frame = AtemFrameParser(self._context, allowed, self._writer)

    def _body(self, text: str, out: list[OutputDelta]) -> None:
        if not text:
            return
        if self._route is _Route.REASONING:
            out.append(OutputDelta(reasoning=text))
        elif self._route is _Route.CONTENT:
            out.append(OutputDelta(content=text))
        elif self._frame is not None:
            out.extend(self._frame.feed(text))

    def _close_body(self, out: list[OutputDelta]) -> None:
        if self._frame is not None:
            out.extend(self._frame.finish())
        self._frame = None
        self._route = None

    def _flush_between(self, out: list[OutputDelta]) -> None:
        if self._between.strip():
            out.append(OutputDelta(content=self._between))
        self._between = ""


class AtemContentPassthrough:
    """TOOL_PARSER_ATEM on the content stream: frames were consumed upstream, text passes."""

    def feed(self, text: str) -> list[OutputDelta]:
        return [OutputDelta(content=text)] if text else []

    def finish(self) -> list[OutputDelta]:
        return []


def atem_tool_parser(context: ParserContext) -> AtemContentPassthrough:
    """Factory of TOOL_PARSER_ATEM."""
    atem = context.frontend.tool_syntax.atem
    if not atem.invoke or not atem.parameter or not atem.block:
        raise StartupError("tool_syntax.atem.block, .invoke and .parameter must be declared")
    return AtemContentPassthrough()


def helios_register_tool_parsers(register: Register) -> None:
    """Provide the ATEM tool parser."""
    register(
        contract.TOOL_PARSER_ATEM, atem_tool_parser, name="atem", requires=contract.REASONING_PARSER_RECIPIENT_HEADER
    )


def helios_register_reasoning_parsers(register: Register) -> None:
    """Provide recipient-header reasoning."""
    register(contract.REASONING_PARSER_RECIPIENT_HEADER, RecipientHeaderParser, name="recipient-header")


def helios_register_tool_grammars(register: Register) -> None:
    """Provide the ATEM call grammar (one call frame after any reasoning frames)."""
    register(contract.TOOL_PARSER_ATEM, atem_grammar, name="atem")


def helios_register_reasoning_envelopes(register: Register) -> None:
    """Provide the recipient-header envelope (structured answers in frames)."""
    register(contract.REASONING_PARSER_RECIPIENT_HEADER, recipient_envelope, name="recipient-header")
