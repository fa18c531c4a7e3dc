"""User stops: request validation and incremental host-side matching.

Owns the request fields ``stop``, ``stop_token_ids`` and ``stop_token_sequences``:
their validation (every violation is a :class:`PromptError`, an invalid request) and
the streaming matchers the worker runs on generated output before presentation.

* :class:`StringStopMatcher` runs on the complete incremental decoded text, reasoning
  and tool envelopes included. The caller's incremental detokenizer holds back partial
  UTF-8 sequences and emits only complete characters, so matching works on ``str``.
* :class:`TokenStopMatcher` runs on raw generated token IDs.

Both matchers hold back a pending prefix (a suffix of the output that is a prefix of
some stop, overlapping prefixes included) until it is resolved, and both use one
Knuth–Morris–Pratt automaton per stop, so each fed character or ID costs amortized
constant work per stop and only the unresolved tail (at most the longest stop minus
one element) is retained.

"The first completed match" is the match whose last element arrives earliest; when
several stops complete on the same element the longest wins. The result is therefore
independent of how the output is split into pieces: the matched stop and everything
after it — including text later in the same piece — are removed, and generation stops.
On normal EOS or output-limit termination, ``flush`` releases the unmatched pending
prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from helios_core.errors import PromptError

MAX_STRING_STOPS = 4
MAX_STRING_STOP_BYTES = 4096
MAX_STOP_TOKEN_IDS = 16
MAX_STOP_TOKEN_SEQUENCES = 16
MAX_STOP_SEQUENCE_TOKENS = 64

_T = TypeVar("_T", str, int)


# --------------------------------------------------------------------------- validation


def parse_string_stops(value: object) -> tuple[str, ...]:
    """Validate the ``stop`` request field.

    Accepts ``None`` (no stops), one nonempty string, or a list of up to four nonempty
    strings. The stops together total at most 4096 UTF-8 bytes (a single string is held
    to the same total). An empty list disables string stops and returns ``()``.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        stops: list[str] = [value]
    elif isinstance(value, list):
        if len(value) > MAX_STRING_STOPS:
            raise PromptError(f"stop accepts at most {MAX_STRING_STOPS} strings, not {len(value)}")
        stops = []
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise PromptError(f"stop[{index}] must be a string, not {type(item).__name__}")
            stops.append(item)
    else:
        raise PromptError(f"stop must be null, a string or an array of strings, not {type(value).__name__}")
    for index, stop in enumerate(stops):
        if not stop:
            where = "stop" if isinstance(value, str) else f"stop[{index}]"
            raise PromptError(f"{where} must be a nonempty string")
    total = sum(len(stop.encode("utf-8")) for stop in stops)
    if total > MAX_STRING_STOP_BYTES:
        raise PromptError(f"stop totals {total} UTF-8 bytes; at most {MAX_STRING_STOP_BYTES} are allowed")
    return tuple(stops)


def _parse_token_id(value: object, where: str, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PromptError(f"{where} must be an integer token ID, not {type(value).__name__}")
    if not 0 <= value < vocab_size:
        raise PromptError(f"{where} = {value} lies outside the vocabulary [0, {vocab_size})")
    return value


def parse_token_stops(
    stop_token_ids: object, stop_token_sequences: object, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Validate ``stop_token_ids`` and ``stop_token_sequences`` into one list of sequences.

    Each field is ``None`` or a list. ``stop_token_ids`` holds at most 16 vocabulary IDs,
    each becoming a length-one sequence; these do not count toward the sixteen-sequence
    limit, which applies to ``stop_token_sequences`` alone. Each of those sequences is a
    nonempty list of at most 64 IDs. Every ID is an ``int`` (not ``bool``) inside
    ``[0, vocab_size)``. Duplicate sequences are removed, keeping first occurrences;
    the ID-derived sequences come first.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, not {vocab_size!r}")
    result: list[tuple[int, ...]] = []
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list):
            raise PromptError(
                f"stop_token_ids must be null or an array of integers, not {type(stop_token_ids).__name__}"
            )
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise PromptError(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} IDs, not {len(stop_token_ids)}")
        for index, item in enumerate(stop_token_ids):
            result.append((_parse_token_id(item, f"stop_token_ids[{index}]", vocab_size),))
    if stop_token_sequences is not None:
        if not isinstance(stop_token_sequences, list):
            raise PromptError(
                f"stop_token_sequences must be null or an array of arrays, not {type(stop_token_sequences).__name__}"
            )
        if len(stop_token_sequences) > MAX_STOP_TOKEN_SEQUENCES:
            raise PromptError(
                f"stop_token_sequences accepts at most {MAX_STOP_TOKEN_SEQUENCES} sequences, "
                f"not {len(stop_token_sequences)}"
            )
        for index, sequence in enumerate(stop_token_sequences):
            where = f"stop_token_sequences[{index}]"
            if not isinstance(sequence, list):
                raise PromptError(f"{where} must be an array of integers, not {type(sequence).__name__}")
            if not sequence:
                raise PromptError(f"{where} must not be empty")
            if len(sequence) > MAX_STOP_SEQUENCE_TOKENS:
                raise PromptError(f"{where} has {len(sequence)} tokens; at most {MAX_STOP_SEQUENCE_TOKENS} are allowed")
            result.append(
                tuple(
                    _parse_token_id(item, f"{where}[{position}]", vocab_size) for position, item in enumerate(sequence)
                )
            )
    return tuple(dict.fromkeys(result))


def check_stop_compatibility(
    string_stops: Sequence[str], token_stops: Sequence[Sequence[int]], structured: bool
) -> None:
    """Reject string stops combined with token stops or with structured output."""
    if not string_stops:
        return
    if token_stops:
        raise PromptError("stop cannot be combined with stop_token_ids or stop_token_sequences")
    if structured:
        raise PromptError("stop cannot be combined with structured output (response_format)")


# --------------------------------------------------------------------------- matching


@dataclass
class _Automaton(Generic[_T]):
    """KMP automaton for one stop: ``state`` is the longest stop prefix ending the output."""

    pattern: Sequence[_T]
    failure: list[int] = field(init=False)
    state: int = 0

    def __post_init__(self) -> None:
        pattern = self.pattern
        failure = [0] * len(pattern)
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = failure[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            failure[i] = k
        self.failure = failure

    def step(self, item: _T) -> bool:
        """Advance by one element; True when the stop has just completed."""
        pattern, state = self.pattern, self.state
        if state == len(pattern):
            state = self.failure[state - 1]
        while state and pattern[state] != item:
            state = self.failure[state - 1]
        if pattern[state] == item:
            state += 1
        self.state = state
        return state == len(pattern)


class _Matcher(Generic[_T]):
    """Shared incremental matching over elements of type ``_T``."""

    def __init__(self, stops: Sequence[Sequence[_T]]) -> None:
        self._automata: list[_Automaton[_T]] = [_Automaton(stop) for stop in stops]
        self._matched = False

    @property
    def matched(self) -> bool:
        return self._matched

    def _advance(self, pending_len: int, items: Sequence[_T]) -> tuple[int, int]:
        """Feed ``items`` after ``pending_len`` held elements.

        Returns ``(keep_end, pending)``: on a match, ``keep_end`` is where the stop begins
        in the held-plus-new elements and ``pending`` is -1; otherwise ``keep_end`` is the
        length of the safe part and ``pending`` is the held-back tail length.
        """
        for position, item in enumerate(items):
            best = 0
            for automaton in self._automata:
                if automaton.step(item):
                    best = max(best, len(automaton.pattern))
            if best:
                self._matched = True
                return pending_len + position + 1 - best, -1
        total = pending_len + len(items)
        held = max((automaton.state for automaton in self._automata), default=0)
        return total - held, held

    def _reset_states(self) -> None:
        for automaton in self._automata:
            automaton.state = 0


@dataclass(frozen=True)
class StopResult:
    """Outcome of feeding decoded text: text safe to emit now, and whether a stop matched."""

    visible: str
    matched: bool


class StringStopMatcher(_Matcher[str]):
    """Incremental matcher for string stops over decoded text pieces.

    After a match, further feeds emit nothing and report ``matched``; ``flush`` returns "".
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("string stops must be nonempty")
        super().__init__(list(stops))
        self._held = ""

    @property
    def held(self) -> str:
        """Text held back because it may still begin a stop."""
        return self._held

    def feed(self, text: str) -> StopResult:
        if self._matched:
            return StopResult("", True)
        if not text:
            return StopResult("", False)
        combined = self._held + text
        if not self._automata:
            return StopResult(combined, False)
        keep_end, pending = self._advance(len(self._held), text)
        if pending < 0:
            self._held = ""
            return StopResult(combined[:keep_end], True)
        self._held = combined[keep_end:]
        return StopResult(combined[:keep_end], False)

    def flush(self) -> str:
        """Release the unmatched held prefix on normal EOS or output-limit termination."""
        held, self._held = self._held, ""
        self._reset_states()
        return held


@dataclass(frozen=True)
class TokenStopResult:
    """Outcome of feeding one token ID: IDs safe to present now, and whether a stop matched."""

    released: list[int]
    matched: bool


class TokenStopMatcher(_Matcher[int]):
    """Incremental matcher for stop-token sequences over generated IDs.

    Matching IDs are omitted from presentation; the raw-ID observation stream is the
    caller's and is unaffected. After a match, further feeds release nothing.
    """

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        if any(not sequence for sequence in sequences):
            raise ValueError("stop token sequences must be nonempty")
        super().__init__([tuple(sequence) for sequence in sequences])
        self._held: list[int] = []

    @property
    def held(self) -> list[int]:
        """IDs held back because they may still begin a stop sequence."""
        return list(self._held)

    def feed(self, token_id: int) -> TokenStopResult:
        if self._matched:
            return TokenStopResult([], True)
        combined = [*self._held, token_id]
        keep_end, pending = self._advance(len(self._held), (token_id,))
        if pending < 0:
            self._held = []
            return TokenStopResult(combined[:keep_end], True)
        self._held = combined[keep_end:]
        return TokenStopResult(combined[:keep_end], False)

    def flush(self) -> list[int]:
        """Release buffered IDs on normal EOS or output-limit termination."""
        held, self._held = self._held, []
        self._reset_states()
        return held
