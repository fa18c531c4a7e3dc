"""Think-tag reasoning (REASONING_PARSER_THINK_TAGS): ``OPEN reasoning CLOSE answer``.

Owns the open/close delimiter reasoning parser and its registration. Syntax data
(``ReasoningSyntax``): ``open``, ``close``, ``wrapping_newlines`` and ``terminal_marker``.

Rules, in the order the parser applies them:

* A delimiter the tokenizer encodes as one token delimits only when generated as that token id; its
  plain-text spelling (several tokens) is ordinary text. A delimiter of several tokens is matched
  in the text, with a possible prefix held back at chunk ends.
* Generation starts inside reasoning when the prompt pre-opened it (``initially_reasoning``);
  otherwise an opener that comes before any non-whitespace text opens reasoning, and text without
  one is the answer.
* The closer ends reasoning once. A close or open token generated afterwards is protocol markup and
  is dropped.
* The terminal marker (the tool syntax's opener) ends reasoning implicitly; the marker and what
  follows are answer content, so the tool parser sees the call.
* ``wrapping_newlines``: one newline after the opener and one before the closer (or terminal
  marker) are dropped, and so are the newlines that start the answer after the closer.
* A structured answer is opaque: after reasoning every piece's text, delimiter tokens included, is
  answer text.
* Truncated reasoning (no closer before the end) stays reasoning.

Other modules may reuse ``DelimitedReasoningParser`` with other delimiters (XTML think does).

Constrained output (``think_tags_envelope``): reasoning between the declared open and close
delimiters may come before the answer or the call.
"""

from __future__ import annotations

from enum import Enum

from helios_core.plugin_api import (
    DelimitedEnvelope,
    DelimitedReasoning,
    GeneratedPiece,
    OutputDelta,
    ParserContext,
    Register,
    StartupError,
    contract,
    partial_suffix_length,
)

HELIOS_PLUGIN_API = (1, 0)


class _State(Enum):
    START = "start"
    REASONING = "reasoning"
    ANSWER = "answer"


class DelimitedReasoningParser:
    """Open/close delimited reasoning for one request (see the module docstring)."""

    def __init__(
        self,
        context: ParserContext,
        *,
        open_text: str,
        close_text: str,
        wrapping_newlines: bool,
        terminal_marker: str = "",
    ) -> None:
        if not open_text or not close_text:
            raise StartupError("reasoning_syntax.open and .close must be declared")
        vocabulary = context.vocabulary
        self._open = open_text
        self._close = close_text
        self._terminal = terminal_marker
        self._open_id = vocabulary.single_token(open_text)
        self._close_id = vocabulary.single_token(close_text)
        self._terminal_id = vocabulary.single_token(terminal_marker) if terminal_marker else None
        self._wrapping = wrapping_newlines
        self._structured = context.structured_answer
        self._state = _State.REASONING if context.envelope.initially_reasoning else _State.START
        self._pending = ""
        self._reasoning_started = False
        self._answer_started = False
        self._strip_answer_newlines = False

    # -- ReasoningParser ----------------------------------------------------------------------

    def feed(self, piece: GeneratedPiece) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        token = piece.token_id
        if self._state is _State.ANSWER and self._structured:
            self._answer(piece.text, out)
        elif token == self._open_id and self._open_id is not None:
            self._flush(out, final=True, before_delimiter=True)
            if self._state is _State.START:
                self._state = _State.REASONING
        elif token == self._close_id and self._close_id is not None:
            self._flush(out, final=True, before_delimiter=True)
            if self._state is _State.REASONING:
                self._end_reasoning(strip_answer=True)
        elif token == self._terminal_id and self._terminal_id is not None and self._state is _State.REASONING:
            self._flush(out, final=True, before_delimiter=True)
            self._end_reasoning(strip_answer=False)
            self._answer(piece.text, out)
        else:
            self._pending += piece.text
            self._scan(out)
        return out

    def finish(self) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        self._scan(out, final=True)
        self._flush(out, final=True, before_delimiter=False)
        return out

    # -- machinery ----------------------------------------------------------------------------

    def _end_reasoning(self, *, strip_answer: bool) -> None:
        self._state = _State.ANSWER
        self._strip_answer_newlines = strip_answer and self._wrapping

    def _text_markers(self) -> list[str]:
        """Delimiters matched as text in the current state (those that are not single tokens)."""
        if self._state is _State.START:
            return [self._open] if self._open_id is None else []
        if self._state is _State.REASONING:
            markers = [self._close] if self._close_id is None else []
            if self._terminal and self._terminal_id is None:
                markers.append(self._terminal)
            return markers
        return []

    def _scan(self, out: list[OutputDelta], final: bool = False) -> None:
        while True:
            if self._state is _State.START:
                stripped = self._pending.lstrip()
                if not stripped:
                    return
                if self._open_id is None and stripped.startswith(self._open):
                    self._pending = stripped[len(self._open) :]
                    self._state = _State.REASONING
                    continue
                if self._open_id is None and self._open.startswith(stripped) and not final:
                    return
                self._state = _State.ANSWER
                continue
            if self._state is _State.REASONING:
                hits = [(self._pending.find(m), m) for m in self._text_markers()]
                found = [(at, m) for at, m in hits if at >= 0]
                if found:
                    at, marker = min(found)
                    rest = self._pending[at + len(marker) :]
                    self._pending = self._pending[:at]
                    self._flush(out, final=True, before_delimiter=True)
                    if marker == self._close:
                        self._end_reasoning(strip_answer=True)
                        self._pending = rest
                    else:
                        self._end_reasoning(strip_answer=False)
                        self._pending = marker + rest
                    continue
                if not final:
                    self._flush(out, final=False, before_delimiter=False)
                return
            # ANSWER
            text, self._pending = self._pending, ""
            self._answer(text, out)
            return

    def _flush(self, out: list[OutputDelta], *, final: bool, before_delimiter: bool) -> None:
        """Release pending text of the current state. ``final``: nothing is held back;
        ``before_delimiter``: a delimiter token follows (it ends the pending text)."""
        if self._state is _State.START:
            if final and not before_delimiter and self._pending:
                self._state = _State.ANSWER
                self._answer(self._pending, out)
            if final:
                self._pending = ""  # whitespace before a delimiter token is dropped
            return
        if self._state is _State.ANSWER:
            text, self._pending = self._pending, ""
            self._answer(text, out)
            return
        text = self._pending
        hold = 0 if final else partial_suffix_length(text, self._text_markers())
        text, held = text[: len(text) - hold], text[len(text) - hold :]
        if self._wrapping and not self._reasoning_started:
            if not text and not final:
                return
            if text.startswith("\n"):
                text = text[1:]
            self._reasoning_started = True
        if self._wrapping and text.endswith("\n") and (before_delimiter or not final):
            text = text[:-1]
            if not before_delimiter:
                held = "\n" + held
        self._pending = held
        if text:
            out.append(OutputDelta(reasoning=text))

    def _answer(self, text: str, out: list[OutputDelta]) -> None:
        if self._strip_answer_newlines:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_answer_newlines = False
        if text:
            out.append(OutputDelta(content=text))


def think_tags_parser(context: ParserContext) -> DelimitedReasoningParser:
    """Factory of REASONING_PARSER_THINK_TAGS."""
    syntax = context.frontend.reasoning_syntax
    return DelimitedReasoningParser(
        context,
        open_text=syntax.open,
        close_text=syntax.close,
        wrapping_newlines=syntax.wrapping_newlines,
        terminal_marker=syntax.terminal_marker,
    )


def think_tags_envelope(frontend: contract.FrontendContract) -> DelimitedEnvelope:
    """Think-tag reasoning before the answer (none unless both delimiters are declared)."""
    syntax = frontend.reasoning_syntax
    if not syntax.open or not syntax.close:
        return DelimitedEnvelope(None)
    return DelimitedEnvelope(DelimitedReasoning(syntax.open, syntax.close, syntax.terminal_marker))


def helios_register_reasoning_parsers(register: Register) -> None:
    """Provide the think-tag reasoning parser."""
    register(contract.REASONING_PARSER_THINK_TAGS, think_tags_parser, name="think-tags")


def helios_register_reasoning_envelopes(register: Register) -> None:
    """Provide the think-tag envelope."""
    register(contract.REASONING_PARSER_THINK_TAGS, think_tags_envelope, name="think-tags")
