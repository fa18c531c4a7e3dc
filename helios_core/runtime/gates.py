"""Host gates: what must run in the worker on each sampled token before the request's next round.

Owns, per request, the incremental detokenizer, the token-stop and string-stop matchers and the
grammar matcher, in the order the spec fixes: the token is stamped (when observed) right after
completion, then the grammar advances and yields the next mask, then token stops, then string
stops on incrementally decoded text (reasoning and tool envelopes included, before presentation).
A gate reports which (id, text) pieces presentation may show, whether a host stop matched, and the
grammar mask of the next round (or, for a speculative round, the mask of each position along the
proposals, :meth:`HostGate.masks_along`, which leaves the grammar state alone). A request with any
gate keeps one outstanding round.

A token's piece is presented once all of its text is resolved: a token whose text a string stop holds
back (it may begin the stop) gets its piece when the stop is ruled out, with the text of the tokens
after it; when the stop matches, a token keeps the part of its text before the match, and a token
whose whole text the match swallowed has no piece (so no presentation, no logprob entry), as for
token stops. The text of an EOS id that ends the request is none: what a stop holds when the model
ends is released by the gate's finish.

A request's ``min_tokens`` holds back its ending ids and single-id token stops from its first that many
tokens: they are taken out of the mask of those rounds (with its grammar's, if any; where a grammar
allows nothing else, only an end, the grammar's mask stands), and no stop is looked for in the text or
ids of those tokens.

A request's ``logit_bias`` (``banned_ids``, ``only_ids``) narrows the mask of every round the same way (a
narrowing that would leave no id is skipped, so a grammar's output still parses, and an end given 100
stays allowed under ``min_tokens``).

A request with no stops, no structured output, no ``min_tokens`` and no ``logit_bias`` needs no gate in the
worker (:func:`needs_gate`):
detokenizing its tokens decides nothing about its next round, so its request stream detokenizes
them as its reader reads them (:class:`StreamText`), with the same text and pieces a gate gives.

A gate never compiles a grammar: the request carries its compiled
:class:`~helios_core.frontend.structured.Grammar` (``PreparedRequest.grammar``, compiled by preparation
or by ``Engine.submit`` off the worker), and the gate only instantiates a matcher from it. A request
with a ``response_format`` but no grammar did not pass through ``Engine.submit``; it is refused.

A gate belongs to one request: whatever its grammar, stops or detokenizer raise (a schema that
compiles but whose matcher fails on its first mask or on a token, for instance) ends that request
alone. The scheduler catches it at each call into a gate and fails the request with
:func:`gate_failure`'s message; :func:`format_param` names the request field a failure belongs to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from helios_core.frontend.detokenizer import (
    IncrementalDetokenizer,
    TokenBytes,
    hidden_special_ids,
    output_syntax_texts,
)
from helios_core.frontend.formats import ToolCallFormat, parse_prepared_format
from helios_core.frontend.stops import StringStopMatcher, TokenStopMatcher
from helios_core.frontend.structured import Grammar, GrammarCompiler, GrammarError, GrammarMatcher, Mask
from helios_core.runtime.messages import Finished, Piece, PreparedRequest, TokenEvent
from helios_core.wire import contract_pb2 as ct


def gate_failure(exc: BaseException) -> str:
    """The message a request fails with when its gate raised ``exc``."""
    if isinstance(exc, GrammarError):
        return f"structured output failed: {exc}"
    return f"the request's output processing failed: {type(exc).__name__}: {exc}"


def format_param(request: PreparedRequest) -> str:
    """The request field a failure of ``request``'s output constraints belongs to: ``tools`` for a forced
    tool call (``tool_choice``), ``response_format`` for another format; without a format, ``logit_bias``
    when the request has one, else ``min_tokens`` when it has that, else ``response_format``."""
    if request.response_format is None and request.grammar is None:
        if request.banned_ids or request.only_ids:
            return "logit_bias"
        return "min_tokens" if request.min_tokens > 0 else "response_format"
    if request.response_format is None:
        return "response_format"
    try:
        prepared = parse_prepared_format(request.response_format)
    except Exception:  # an unreadable format is the response format's fault
        return "response_format"
    return "tools" if isinstance(prepared, ToolCallFormat) else "response_format"


def ending_ids(request: PreparedRequest, eos_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end ``request`` when sampled: the core's EOS ids (built once by the caller), none with
    ``ignore_eos``. Their text is never presented, so a gate or stream gives them none: no stop sees it,
    and what a stop or the detokenizer holds back is released by the finish that follows, not attached
    to the EOS token."""
    return frozenset() if request.ignore_eos else eos_ids


@dataclass(frozen=True)
class TextlessIds:
    """The ids a request's generated text leaves out, built once per engine: the core's EOS ids and the
    special tokens no output syntax spells (:func:`~helios_core.frontend.detokenizer.hidden_special_ids`)."""

    eos: frozenset[int] = frozenset()
    hidden: frozenset[int] = frozenset()

    @classmethod
    def of_core(cls, tokenizer: Tokenizer, eos_token_ids: Iterable[int], frontend: ct.FrontendContract) -> TextlessIds:
        """The set of a core: its EOS ids and the special tokens its frontend's output syntax does not spell."""
        return cls(frozenset(eos_token_ids), hidden_special_ids(tokenizer, output_syntax_texts(frontend)))

    def of(self, request: PreparedRequest) -> tuple[frozenset[int], frozenset[int]]:
        """(``request``'s :func:`ending_ids`, every id whose text it leaves out: those, and the hidden special
        tokens unless it asked for them with ``skip_special_tokens: false``)."""
        ends = ending_ids(request, self.eos)
        silent = ends | self.hidden if request.skip_special_tokens else ends
        return ends, silent


def needs_gate(request: PreparedRequest) -> bool:
    """Whether ``request`` has host work in the worker: stops, a structured-output format, a minimum
    output length or a ``logit_bias``. Without them a gate would only detokenize, which its stream does
    instead (:class:`StreamText`)."""
    return bool(
        request.string_stops
        or request.token_stops
        or request.response_format is not None
        or request.grammar is not None
        or masks_rounds(request)
    )


def masks_rounds(request: PreparedRequest) -> bool:
    """Whether ``request``'s own fields (``min_tokens``, ``logit_bias``) may mask its rounds: a host gate's
    work, whatever its grammar."""
    return bool(request.min_tokens > 0 or request.banned_ids or request.only_ids)


def held_back_ids(request: PreparedRequest, ends: frozenset[int]) -> frozenset[int]:
    """The ids ``request``'s first ``min_tokens`` tokens may not be: its :func:`ending_ids` ``ends`` and its
    single-id token stops (``stop_token_ids``); empty without ``min_tokens``."""
    if request.min_tokens <= 0:
        return frozenset()
    return ends | {sequence[0] for sequence in request.token_stops if len(sequence) == 1}


class StreamText:
    """The text of one ungated request's events, added as its stream yields them (the reader's thread).

    The worker publishes such a request's token events with empty text; each token's text is what a
    gate's incremental detokenizer gives it, in order, and a normal finish (EOS, output limit) carries
    what the detokenizer still holds, exactly as :meth:`HostGate.observe` and :meth:`HostGate.finish`.
    """

    def __init__(
        self, tokenizer: Tokenizer, token_bytes: TokenBytes | None = None, silent: frozenset[int] = frozenset()
    ) -> None:
        """``silent``: the ids whose text is none (the second of :meth:`TextlessIds.of`)."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, token_bytes)
        self.push: Callable[[int], str] = _text_of(self._detokenizer.push, silent)
        """The text a token completes."""

    def token(self, event: TokenEvent) -> TokenEvent:
        """``event`` (published with its token's text empty) with its text."""
        token = event.token_id
        return TokenEvent(
            event.request_id, token, event.logprob, ((token, self.push(token)),), event.timestamp_ns, event.top
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


def _text_of(push: Callable[[int], str], silent: frozenset[int]) -> Callable[[int], str]:
    """``push``, except that an id of ``silent`` has no text and leaves the detokenizer as it was."""
    if not silent:
        return push

    def text(token_id: int) -> str:
        return "" if token_id in silent else push(token_id)

    return text


class _HeldTokens:
    """The tokens whose text has gone to a string stop matcher and is not all released yet, in order,
    each with how many of its characters were released (:class:`HostGate`)."""

    def __init__(self) -> None:
        self._tokens: deque[list[Any]] = deque()
        """``[token id, text, released characters]``; id -1 for the detokenizer's final tail."""

    def add(self, token_id: int, text: str) -> None:
        self._tokens.append([token_id, text, 0])

    def release(self, count: int) -> list[Piece]:
        """``count`` more characters of the held text are visible: the pieces of the tokens whose text
        is now all released, in order."""
        left = count
        for entry in self._tokens:
            if left <= 0:
                break
            taken = min(len(entry[1]) - entry[2], left)
            entry[2] += taken
            left -= taken
        pieces: list[Piece] = []
        tokens = self._tokens
        while tokens:
            # tokens without text (the first bytes of a character split across tokens) go with the next
            # token that has text: its text is theirs too
            ahead = 0
            while ahead < len(tokens) and not tokens[ahead][1]:
                ahead += 1
            if ahead == len(tokens) or tokens[ahead][2] < len(tokens[ahead][1]):
                break
            for _ in range(ahead + 1):
                token_id, text, _ = tokens.popleft()
                pieces.append((token_id, text))
        return pieces

    def drain(self) -> list[Piece]:
        """The tokens still held once every character is released (textless ones at the end)."""
        pieces: list[Piece] = [(token_id, text) for token_id, text, _ in self._tokens]
        self._tokens.clear()
        return pieces

    def cut(self) -> list[Piece]:
        """A stop matched after what was released: each token keeps its released text; a token with
        none was swallowed by the stop and has no piece, and so was a token without text whose next
        token with text was swallowed."""
        entries = list(self._tokens)
        last = max((index for index, entry in enumerate(entries) if entry[2]), default=-1)
        pieces: list[Piece] = [(token_id, text[:released]) for token_id, text, released in entries[: last + 1]]
        self._tokens.clear()
        return pieces


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
        ends: frozenset[int] = frozenset(),
        silent: frozenset[int] = frozenset(),
    ) -> None:
        """``grammar_compiler``: the compiler ``request.grammar`` must come from (only checked, never run);
        ``ends``: the request's :func:`ending_ids`; ``silent``: every id whose text is none (``ends``
        included: :meth:`TextlessIds.of`)."""
        self._detokenizer = IncrementalDetokenizer(tokenizer, token_bytes)
        self._string_stops = StringStopMatcher(request.string_stops) if request.string_stops else None
        self._held = _HeldTokens()
        self._token_stops = TokenStopMatcher(request.token_stops) if request.token_stops else None
        self._grammar: GrammarMatcher | None = None
        grammar = request.grammar
        if grammar is not None or request.response_format is not None:
            if grammar_compiler is None:
                raise ValueError("structured output needs a grammar compiler")
            if grammar is None:
                raise ValueError("the request's response_format was not compiled before submission (Engine.submit)")
            if not isinstance(grammar, Grammar) or not grammar_compiler.owns(grammar):
                raise ValueError("the request's grammar was not compiled by this engine's grammar compiler")
            self._grammar = grammar.matcher()
        self._min_tokens = request.min_tokens
        self._produced = 0
        """Tokens observed so far (every sampled token, whether presented or not)."""
        self._held_back_mask: Mask | None = None
        """The sampled vocabulary without :func:`held_back_ids`, while fewer than ``min_tokens`` were produced."""
        self._bias_mask: Mask | None = None
        """The ids ``logit_bias`` leaves (``only_ids``, else the sampled vocabulary, without ``banned_ids``)."""
        self._everything: Mask | None = None
        """The whole sampled vocabulary (a position of a request with no grammar that nothing else narrows)."""
        held_back = held_back_ids(request, ends)
        if held_back or request.banned_ids or request.only_ids:
            if grammar_compiler is None:
                field = "min_tokens" if held_back else "logit_bias"
                raise ValueError(f"{field} needs a grammar compiler (the token mask of each round)")
            self._everything = grammar_compiler.vocabulary_mask()
            if held_back:
                self._held_back_mask = grammar_compiler.vocabulary_mask(held_back)
            if request.banned_ids or request.only_ids:
                self._bias_mask = grammar_compiler.vocabulary_mask(request.banned_ids, only=request.only_ids or None)
        self.holds_rounds = (
            self._grammar is not None
            or self._string_stops is not None
            or self._token_stops is not None
            or self._held_back_mask is not None
            or self._bias_mask is not None
        )
        """Whether this request must keep one outstanding round (host-fed decisions)."""
        self._ends = ends
        self.text: Callable[[int], str] = _text_of(self._detokenizer.push, silent | ends)
        """What :meth:`observe` presents for a token when the gate is :attr:`plain`: the text it completes."""

    @property
    def constrained(self) -> bool:
        """Whether the next round samples under a mask: a grammar, ``logit_bias``, or ids held back until
        ``min_tokens``."""
        return self._grammar is not None or self._bias_mask is not None or self._holding_back(0)

    def _holding_back(self, ahead: int) -> bool:
        """Whether the token ``ahead`` positions after the next one is still among the first ``min_tokens``."""
        return self._held_back_mask is not None and self._produced + ahead < self._min_tokens

    def _narrowed(self, mask: Mask | None, ahead: int) -> Mask | None:
        """The grammar's ``mask`` (None: every id) for the token ``ahead`` positions after the next one,
        narrowed in turn to the ids ``logit_bias`` leaves and, while the request is short of ``min_tokens``,
        without the held-back ids. A narrowing that would leave no id is skipped: the grammar's output must
        still parse (where it allows only an end, the end stands), and ``logit_bias`` outranks
        ``min_tokens`` (an end given 100 stays allowed)."""
        held_back = self._held_back_mask if self._holding_back(ahead) else None
        for narrowing in (self._bias_mask, held_back):
            if narrowing is None:
                continue
            if mask is None:
                mask = narrowing
                continue
            both: Mask = np.bitwise_and(mask, narrowing)
            if both.any():
                both.flags.writeable = False
                mask = both
        return mask

    @property
    def plain(self) -> bool:
        """No grammar and no stops: the gate only detokenizes (:meth:`text`), and never stops a request."""
        return not self.holds_rounds

    def mask(self) -> npt.NDArray[np.int32] | None:
        """The mask of the next round (the grammar's, narrowed by ``logit_bias`` and ``min_tokens``), or None
        when unconstrained."""
        return self._narrowed(None if self._grammar is None else self._grammar.mask(), 0)

    def masks_along(self, candidates: Sequence[int]) -> list[npt.NDArray[np.int32]]:
        """The grammar masks of a speculative round offering ``candidates`` after the pending token.

        Position ``j`` samples under ``masks[j]``: the mask of the next round after the grammar accepted
        ``candidates[:j]`` (``masks[0]`` is :meth:`mask`). The list stops at the first candidate the
        grammar does not allow there (or an EOS id), so ``len(masks) - 1`` candidates may be offered.
        Empty when the request is not :attr:`constrained`. Each position's mask is narrowed as
        :meth:`mask` is (``logit_bias``; the held-back ids while the request is short of ``min_tokens``
        there), and the list also stops at a candidate that mask does not allow. The request's grammar
        state is unchanged: only :meth:`observe` advances it, on the tokens the round emits.
        """
        if not self.constrained:
            return []
        if self._grammar is not None:
            along: list[Mask | None] = list(self._grammar.masks_along(candidates))
        else:
            along = [None] * (len(candidates) + 1)
        masks: list[Mask] = []
        for ahead, mask in enumerate(along):
            narrowed = self._narrowed(mask, ahead)
            if narrowed is None:  # past min_tokens without a grammar or logit_bias: every id
                narrowed = self._everything
            if narrowed is None:
                break
            masks.append(narrowed)
            if ahead < len(along) - 1:
                token = int(candidates[ahead])
                if not (int(masks[-1][token >> 5]) >> (token & 31)) & 1:
                    break
        return masks

    def observe(self, token_id: int) -> GateOutcome:
        """Advance every gate by one sampled token."""
        if self._grammar is not None:
            self._grammar.advance(token_id)
        self._produced += 1
        stops_apply = self._produced > self._min_tokens  # no stop is looked for in the first min_tokens
        released = [token_id]
        outcome = GateOutcome()
        if self._token_stops is not None and stops_apply:
            result = self._token_stops.feed(token_id)
            released = list(result.released)
            outcome.stopped = result.matched
        for presented in released:
            if presented in self._ends:
                # the request ends here: what the stops hold is released by finish, not hidden behind EOS
                outcome.pieces.append((presented, ""))
                continue
            text = self.text(presented)
            if self._string_stops is None or outcome.stopped or not stops_apply:
                outcome.pieces.append((presented, text))
                continue
            self._held.add(presented, text)
            outcome.stopped = self._match(self._string_stops, text, outcome.pieces)
        return outcome

    def _match(self, stops: StringStopMatcher, text: str, pieces: list[Piece]) -> bool:
        """Feed ``text`` (last added to the held tokens) to the string ``stops``; add the pieces it
        resolves to ``pieces`` and say whether a stop matched."""
        result = stops.feed(text)
        pieces.extend(self._held.release(len(result.visible)))
        if result.matched:
            pieces.extend(self._held.cut())
        return result.matched

    def finish(self) -> list[Piece]:
        """Release what is still buffered at a normal termination (EOS, output limit)."""
        pieces: list[Piece] = []
        if self._token_stops is not None:
            for presented in self._token_stops.flush():
                pieces.append((presented, self.text(presented)))
        tail = self._detokenizer.flush()
        stops = self._string_stops
        if stops is not None:
            if tail:
                self._held.add(-1, tail)  # text of earlier tokens, not a token of its own
                if self._match(stops, tail, pieces):
                    return pieces
            pieces.extend(self._held.release(len(stops.flush())))
            pieces.extend(self._held.drain())
        elif tail:
            pieces.append((-1, tail))
        return pieces
