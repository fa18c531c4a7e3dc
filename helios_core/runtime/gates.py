"""Host gates: what must run in the worker on each sampled token before the request's next round.

Owns, per request, the incremental detokenizer, the token-stop and string-stop matchers and the
grammar matcher, in the order the spec fixes: the token is stamped (when observed) right after
completion, then the grammar advances and yields the next mask, then token stops, then string
stops on incrementally decoded text (reasoning and tool envelopes included, before presentation).
A gate reports which (id, text) pieces presentation may show, whether a host stop matched, and the
grammar mask of the next round. A request with any gate keeps one outstanding round.

A request with no stops and no structured output needs no gate in the worker (:func:`needs_gate`):
detokenizing its tokens decides nothing about its next round, so its request stream detokenizes
them as its reader reads them (:class:`StreamText`), with the same text and pieces a gate gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from helios_core.frontend.detokenizer import IncrementalDetokenizer, TokenBytes
from helios_core.frontend.structured import GrammarCompiler
from helios_core.runtime.messages import Finished, Piece, PreparedRequest, TokenEvent


def needs_gate(request: PreparedRequest) -> bool:
    """Whether ``request`` has host work in the worker: stops or a structured-output format. Without
    them a gate would only detokenize, which its stream does instead (:class:`StreamText`)."""
    return bool(request.string_stops or request.token_stops or request.response_format is not None)


class StreamText:
    """The text of one ungated request's events, added as its stream yields them (the reader's thread).

    The worker publishes such a request's token events with empty text; each token's text is what a
    gate's incremental detokenizer gives it, in order, and a normal finish (EOS, output limit) carries
    what the detokenizer still holds, exactly as :meth:`HostGate.observe` and :meth:`HostGate.finish`.
    """

    def __init__(self, tokenizer: Tokenizer, token_bytes: TokenBytes | None = None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, token_bytes)
        self.push: Callable[[int], str] = self._detokenizer.push
        """The text a token completes."""

    def token(self, event: TokenEvent) -> TokenEvent:
        """``event`` (published with its token's text empty) with its text."""
        token = event.token_id
        return TokenEvent(
            event.request_id, token, event.logprob, [(token, self.push(token))], event.timestamp_ns, event.top
        )

    def finished(self, event: Finished) -> Finished:
        """``event`` with what the detokenizer still holds (nothing on cancellation, as for a gate)."""
        if event.reason == "cancelled":
            return event
        tail = self._detokenizer.flush()
        if not tail:
            return event
        return Finished(
            event.request_id,
            event.reason,
            event.prompt_tokens,
            event.completion_tokens,
            event.reused_prompt_tokens,
            [*event.pieces, (-1, tail)],
        )


@dataclass
class GateOutcome:
    """What one sampled token released and decided."""

    pieces: list[Piece] = field(default_factory=list)
    stopped: bool = False


class HostGate:
    """The per-request host work between rounds."""

    def __init__(
        self,
        request: PreparedRequest,
        tokenizer: Tokenizer,
        grammar_compiler: GrammarCompiler | None,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        from helios_core.frontend.stops import StringStopMatcher, TokenStopMatcher

        self._detokenizer = IncrementalDetokenizer(tokenizer, token_bytes)
        self._string_stops = StringStopMatcher(request.string_stops) if request.string_stops else None
        self._token_stops = TokenStopMatcher(request.token_stops) if request.token_stops else None
        self._grammar = None
        if request.response_format is not None:
            if grammar_compiler is None:
                raise ValueError("structured output needs a grammar compiler")
            from helios_core.frontend.structured import read_prepared_format

            prepared = read_prepared_format(request.response_format)
            if prepared.format is not None:
                grammar = grammar_compiler.compile(
                    prepared.format,
                    reasoning=prepared.reasoning,
                    initially_reasoning=prepared.initially_reasoning,
                    frames=prepared.frames,
                )
                self._grammar = grammar.matcher()
        self.holds_rounds = self._grammar is not None or self._string_stops is not None or self._token_stops is not None
        """Whether this request must keep one outstanding round (host-fed decisions)."""
        self.text: Callable[[int], str] = self._detokenizer.push
        """What :meth:`observe` presents for a token when the gate is :attr:`plain`: the text it completes."""

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    @property
    def plain(self) -> bool:
        """No grammar and no stops: the gate only detokenizes (:meth:`text`), and never stops a request."""
        return not self.holds_rounds

    def mask(self) -> npt.NDArray[np.int32] | None:
        """The grammar mask of the next round, or None when unconstrained."""
        return None if self._grammar is None else self._grammar.mask()

    def observe(self, token_id: int) -> GateOutcome:
        """Advance every gate by one sampled token."""
        if self._grammar is not None:
            self._grammar.advance(token_id)
        released = [token_id]
        outcome = GateOutcome()
        if self._token_stops is not None:
            result = self._token_stops.feed(token_id)
            released = list(result.released)
            outcome.stopped = result.matched
        for presented in released:
            text = self._detokenizer.push(presented)
            if self._string_stops is not None and not outcome.stopped:
                matched = self._string_stops.feed(text)
                text = matched.visible
                outcome.stopped = matched.matched
            outcome.pieces.append((presented, text))
        return outcome

    def finish(self) -> list[Piece]:
        """Release what is still buffered at a normal termination (EOS, output limit)."""
        pieces: list[Piece] = []
        if self._token_stops is not None:
            for presented in self._token_stops.flush():
                pieces.append((presented, self._detokenizer.push(presented)))
        tail = self._detokenizer.flush()
        if self._string_stops is not None:
            tail = (
                self._string_stops.feed(tail).visible + self._string_stops.flush()
                if tail
                else self._string_stops.flush()
            )
        if tail:
            pieces.append((-1, tail))
        return pieces
