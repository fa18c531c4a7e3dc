"""Completion validation: a round's completion record checked before any lane retires.

Owns the rules a completion record must satisfy: the echoed submission
sequence, each lane's echoed generation, emitted counts, the consumed-token
endpoint the scheduler expects, sampled ids inside the sampled vocabulary,
the draft cursor (-1 where a program has none), the reserved model field
(always -1) and, where the record has one, the program's status word (0 is
success; any other value fails every lane of the round). A violation raises :class:`CompletionError` for the round; the
caller fails the affected requests and publishes nothing from that round.

Expectations come as a list of :class:`LaneExpectation` or as an
:class:`ExpectationBatch` (numpy columns, which the scheduler builds for
decode rounds) or a :class:`SpeculativeExpectations` (the columns of a
speculative round whose proposals the host copied). A batch of more than a few
lanes is checked with one comparison per rule over all lanes; only a lane that
violates one is then examined alone, for its first violation and message.
Either way the answer is the same, lane for lane; a batch is answered with
:class:`LaneResults`, which holds the sampled ids and logprobs as Python lists
and reads as a sequence of per-lane results, a speculative batch with
:class:`SpeculativeResults`, which keeps the record's emitted ids, counts and
logprobs as columns (completion applies them without a result per lane).

Rank agreement (a core of several tensor-parallel ranks): :func:`agree_across_ranks` validates every
rank's record by the same rules and compares each lane's fields with rank 0's; a lane that any rank
rejects, or whose fields differ between ranks, is rejected on all ranks (no rank commits it), and only its
request fails, with an error naming the rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.errors import HeliosError
from helios_core.wire import manifest_pb2 as mf


class CompletionError(HeliosError):
    """A completion record contradicts what was submitted."""


class LaneExpectation(msgspec.Struct, frozen=True):
    """What the scheduler expects of one lane's completion (a frozen struct: a round builds one a lane)."""

    generation: int
    consumed: int
    samples: bool
    top: int = 0
    """Top alternatives to read for this lane (a sampling lane of a request that asked for them)."""
    scores: tuple[int, int] = (0, 0)
    """(first packed token, count) of this lane's prompt scores to read (scored prefill only)."""
    offers: int = -1
    """A speculative lane: the proposals it was given (its ceiling); -1 for every other lane. Its
    ``consumed`` is then the endpoint before the round: the record must report ``consumed + accepted + 1``."""
    offers_exact: bool = True
    """The lane's proposals were chosen by the host (copied): the record must offer exactly ``offers``;
    otherwise ``offers`` is a ceiling the program's own allocation stays within."""
    cursor_lag: int = -1
    """A speculative lane of a program that reports a draft cursor: its lag behind target consumption
    (the cursor must be ``max(consumed - lag, 0)``); -1 for a program without one (the cursor is -1)."""


class ExpectationBatch(msgspec.Struct, frozen=True, eq=False, gc=False):
    """The expectations of every lane as columns: what :class:`LaneExpectation` says, lane by lane.

    Every lane samples or none does (``samples``); ``top`` is None when no lane reads top alternatives.
    No lane of a batch reads prompt scores.
    """

    generations: npt.NDArray[np.int64]
    consumed: npt.NDArray[np.int64]
    samples: bool
    top: npt.NDArray[np.int64] | None = None

    def __len__(self) -> int:
        return int(self.generations.shape[0])

    def to_list(self) -> list[LaneExpectation]:
        tops = self.top.tolist() if self.top is not None else [0] * len(self)
        return [
            LaneExpectation(generation, consumed, self.samples, top)
            for generation, consumed, top in zip(
                self.generations.tolist(), self.consumed.tolist(), tops, strict=True
            )
        ]


class SpeculativeExpectations(ExpectationBatch, frozen=True, eq=False, gc=False):
    """The expectations of a speculative round whose proposals the host copied, as columns: lane ``i``
    was given ``offers[i]`` proposals and ``consumed[i]`` is its endpoint before the round, as
    :class:`LaneExpectation` says with ``offers`` (exact: the record must offer exactly those) and
    ``cursor_lag`` (-1: the program reports no draft cursor). Every lane samples; none reads top
    alternatives."""

    offers: npt.NDArray[np.int64] = msgspec.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cursor_lag: int = -1

    def to_list(self) -> list[LaneExpectation]:
        lag = self.cursor_lag
        return [
            LaneExpectation(generation, consumed, True, 0, offers=offers, cursor_lag=lag)
            for generation, consumed, offers in zip(
                self.generations.tolist(), self.consumed.tolist(), self.offers.tolist(), strict=True
            )
        ]


@dataclass(frozen=True)
class LaneResult:
    """One validated lane."""

    token_id: int
    """The sampled id, or -1 when the lane sampled nothing."""
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """(id, logprob) of the top alternatives, best first (only when the lane asked for them)."""
    scores: list[float] = field(default_factory=list)
    """Prompt target logprobs of the lane's packed tokens (only when the lane asked for them)."""
    tokens: list[int] = field(default_factory=list)
    """A speculative lane: every emitted id in order (accepted proposals, then the target's token)."""
    logprobs: list[float] = field(default_factory=list)
    """A speculative lane: the logprob of each emitted id."""
    accepted: int = 0
    """A speculative lane: the proposals the target accepted."""
    offers: int = 0
    """A speculative lane: the proposals the program verified (at most its ceiling)."""


class _LaneSequence(Sequence[LaneResult | CompletionError]):
    """A batch's validated lanes read as a sequence: lane ``i`` is its :class:`LaneResult` or, when it
    broke a rule, its CompletionError (``errors``); subclasses say how many lanes there are and build a
    lane's result from their columns (``_result``)."""

    __slots__ = ()
    errors: dict[int, CompletionError]

    def _result(self, index: int) -> LaneResult:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> LaneResult | CompletionError: ...

    @overload
    def __getitem__(self, index: slice) -> list[LaneResult | CompletionError]: ...

    def __getitem__(self, index: int | slice) -> LaneResult | CompletionError | list[LaneResult | CompletionError]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        error = self.errors.get(index)
        if error is not None:
            return error
        return self._result(index)

    def __iter__(self) -> Iterator[LaneResult | CompletionError]:
        return (self[i] for i in range(len(self)))


class LaneResults(_LaneSequence):
    """The validated lanes of a batch: per lane a :class:`LaneResult` or the lane's CompletionError.

    ``token_ids`` and ``logprobs`` hold every lane's values (those of a failed lane are meaningless),
    ``ids`` the sampled ids as the record holds them (None when the lanes sample nothing); ``errors``
    and ``tops`` are keyed by lane index.
    """

    __slots__ = ("errors", "ids", "logprobs", "token_ids", "tops")

    def __init__(
        self,
        token_ids: list[int],
        logprobs: list[float],
        errors: dict[int, CompletionError],
        tops: dict[int, list[tuple[int, float]]],
        ids: npt.NDArray[Any] | None = None,
    ) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.errors = errors
        self.tops = tops
        self.ids = ids

    def __len__(self) -> int:
        return len(self.token_ids)

    def _result(self, index: int) -> LaneResult:
        return LaneResult(self.token_ids[index], self.logprobs[index], list(self.tops.get(index, ())))


class SpeculativeResults(_LaneSequence):
    """The validated lanes of a speculative batch: lane ``i`` emitted ``ids[i, :emitted[i]]`` (the
    accepted proposals, then the target's token) after accepting ``accepted[i]`` of ``offers[i]``;
    ``logprobs`` holds their logprobs (None: the record has none, or fewer columns than a lane emitted,
    and each reads 0.0). ``errors`` holds the CompletionError of each lane that broke a rule (its columns
    mean nothing). Reads as a sequence of per-lane results, as :func:`read_lanes` gives for a list.
    """

    __slots__ = ("accepted", "emitted", "errors", "ids", "logprobs", "offers")

    def __init__(
        self,
        ids: npt.NDArray[np.integer[Any]],
        logprobs: npt.NDArray[np.float64] | None,
        emitted: npt.NDArray[np.integer[Any]],
        accepted: npt.NDArray[np.integer[Any]],
        offers: npt.NDArray[np.integer[Any]],
        errors: dict[int, CompletionError],
    ) -> None:
        self.ids = ids
        self.logprobs = logprobs
        self.emitted = emitted
        self.accepted = accepted
        self.offers = offers
        self.errors = errors

    def __len__(self) -> int:
        return int(self.emitted.shape[0])

    def _result(self, index: int) -> LaneResult:
        emitted = int(self.emitted[index])
        tokens: list[int] = self.ids[index, :emitted].tolist()
        rows = self.logprobs
        values: list[float] = (
            rows[index, :emitted].tolist() if rows is not None and rows.shape[1] >= emitted else [0.0] * emitted
        )
        return LaneResult(
            tokens[-1],
            values[-1],
            tokens=tokens,
            logprobs=values,
            accepted=int(self.accepted[index]),
            offers=int(self.offers[index]),
        )

    def with_errors(self, errors: Mapping[int, CompletionError]) -> SpeculativeResults:
        """These results with ``errors`` added (a lane's own error, when it has one, is kept)."""
        return SpeculativeResults(
            self.ids, self.logprobs, self.emitted, self.accepted, self.offers, {**errors, **self.errors}
        )


_VECTORIZED_LANES = 8
"""Batches of more lanes are checked rule by rule over all lanes at once."""


@dataclass(frozen=True, slots=True)
class RecordViews:
    """Flat views of the fields of one completion record, found once per record (a frame's record
    mapping stays the same between rounds, so its reader keeps these)."""

    record: Mapping[int, npt.NDArray[np.generic]]
    sequence: npt.NDArray[np.generic]
    generation: npt.NDArray[np.generic]
    reserved: npt.NDArray[np.generic]
    cursor: npt.NDArray[np.generic]
    consumed: npt.NDArray[np.generic]
    emitted: npt.NDArray[np.generic]
    ids: npt.NDArray[np.generic]
    """The first sampled id of each lane."""
    logprobs: npt.NDArray[np.generic] | None
    lanes: int
    """The lanes every field above but ``logprobs`` holds (the shortest of them)."""
    status: npt.NDArray[np.generic] | None = None
    """The program's status word (``COMPLETION_FIELD_STATUS``, 0 = success), when the record has one."""

    def head(self, count: int) -> tuple[npt.NDArray[Any], ...]:
        """The first ``count`` lanes of generation, reserved, cursor, consumed, emitted and ids."""
        return (
            self.generation[:count],
            self.reserved[:count],
            self.cursor[:count],
            self.consumed[:count],
            self.emitted[:count],
            self.ids[:count],
        )

    @classmethod
    def of(cls, record: Mapping[int, npt.NDArray[np.generic]]) -> RecordViews:
        sampled = record[mf.COMPLETION_FIELD_SAMPLED_IDS]
        logprobs = record.get(mf.COMPLETION_FIELD_SAMPLED_LOGPROBS)
        per_lane = [
            record[field].reshape(-1)
            for field in (
                mf.COMPLETION_FIELD_GENERATION,
                mf.COMPLETION_FIELD_RESERVED,
                mf.COMPLETION_FIELD_DRAFT_CURSOR,
                mf.COMPLETION_FIELD_CONSUMED_TOKENS,
                mf.COMPLETION_FIELD_EMITTED_TOKENS,
            )
        ]
        ids = sampled.reshape(sampled.shape[0], -1)[:, 0]
        if logprobs is not None:  # the first column: a speculative core's record is [rows, widest W]
            logprobs = logprobs.reshape(logprobs.shape[0], -1)[:, 0] if logprobs.ndim > 1 else logprobs
        generation, reserved, cursor, consumed, emitted = per_lane
        return cls(
            record=record,
            sequence=record[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1),
            generation=generation,
            reserved=reserved,
            cursor=cursor,
            consumed=consumed,
            emitted=emitted,
            ids=ids,
            logprobs=logprobs.reshape(-1) if logprobs is not None else None,
            lanes=min(ids.shape[0], *(view.shape[0] for view in per_lane)),
            status=status.reshape(-1) if (status := record.get(mf.COMPLETION_FIELD_STATUS)) is not None else None,
        )


def read_lanes(
    completion: Mapping[int, npt.NDArray[np.generic]] | RecordViews,
    sequence: int,
    lanes: Sequence[LaneExpectation] | ExpectationBatch,
    sampled_size: int,
    *,
    packed_capacity: int = 0,
) -> Sequence[LaneResult | CompletionError]:
    """Validate the first ``len(lanes)`` lanes of a completion record (or of its views).

    A nonzero program status word (when the record has one) or a wrong submission sequence fails the
    whole round (raises); the status is checked first, since a failed program's other fields mean
    nothing. Every other rule is checked per lane:
    a violating lane yields its CompletionError in place of a result, so only its request fails. A list
    of expectations is answered with a list, a batch with :class:`LaneResults`.
    """
    views = completion if isinstance(completion, RecordViews) else RecordViews.of(completion)
    if views.status is not None and views.status.shape[0] and int(views.status[0]) != 0:
        raise CompletionError(f"the program reports status {int(views.status[0])} (0 is success)")
    echoed = int(views.sequence[0])
    if echoed != sequence:
        raise CompletionError(f"completion echoes submission {echoed}, expected {sequence}")
    if isinstance(lanes, SpeculativeExpectations):
        return _read_speculative_batch(views, lanes, sampled_size, packed_capacity)
    if isinstance(lanes, ExpectationBatch):
        return _read_batch(views, lanes, sampled_size)
    completion = views.record
    count = len(lanes)
    generations, reserved, cursors, consumed, emitted, ids = views.head(count)
    logprobs_field = views.logprobs
    top_ids = completion.get(mf.COMPLETION_FIELD_TOP_IDS)
    top_logprobs = completion.get(mf.COMPLETION_FIELD_TOP_LOGPROBS)
    prompt_scores = completion.get(mf.COMPLETION_FIELD_PROMPT_SCORES)
    if any(lane.offers >= 0 for lane in lanes):
        return _read_speculative(views, lanes, sampled_size, packed_capacity)
    results: list[LaneResult | CompletionError] = []
    for index, lane in enumerate(lanes):
        problem = _lane_problem(
            lane,
            int(generations[index]),
            int(reserved[index]),
            int(cursors[index]),
            int(consumed[index]),
            int(emitted[index]),
            int(ids[index]),
            sampled_size,
        )
        if problem is not None:
            results.append(CompletionError(f"lane {index}: {problem}"))
            continue
        token = int(ids[index]) if lane.samples else -1
        logprob = float(logprobs_field[index]) if logprobs_field is not None and lane.samples else 0.0
        top: list[tuple[int, float]] = []
        scores: list[float] = []
        try:
            if lane.samples and lane.top > 0:
                top = _read_top(top_ids, top_logprobs, index, lane.top, sampled_size)
            if lane.scores[1] > 0:
                scores = _read_scores(prompt_scores, *lane.scores)
        except CompletionError as exc:
            results.append(CompletionError(f"lane {index}: {exc}"))
            continue
        results.append(LaneResult(token, logprob, top, scores))
    return results


def _read_batch(views: RecordViews, lanes: ExpectationBatch, sampled_size: int) -> LaneResults:
    """:func:`read_lanes` of a batch: the same rules, checked over all lanes at once."""
    count = lanes.generations.shape[0]
    logprobs = views.logprobs[:count] if views.logprobs is not None and lanes.samples else None
    if views.lanes < count or (
        logprobs is not None and logprobs.shape[0] < count
    ):  # a record shorter than the lanes fails lane by lane, as the list of expectations would
        return as_results(read_lanes(views, int(views.sequence[0]), lanes.to_list(), sampled_size))
    completion = views.record
    generation, reserved, cursor, consumed, emitted, ids = views.head(count)
    samples = lanes.samples
    id_list: list[Any] | None = None
    if count > _VECTORIZED_LANES:
        bad = generation != lanes.generations
        bad |= reserved != -1
        bad |= cursor != -1
        bad |= consumed != lanes.consumed
        bad |= emitted != (1 if samples else 0)
        if samples:
            bad |= ids < 0
            bad |= ids >= sampled_size
        suspects = np.flatnonzero(bad).tolist() if bad.any() else []
    else:  # a few lanes: the rules, as Python values, with nothing to build for a lane that keeps them
        expected_generations = lanes.generations.tolist()
        expected_consumed = lanes.consumed.tolist()
        emits = 1 if samples else 0
        generation_list, consumed_list = generation.tolist(), consumed.tolist()
        reserved_list, cursor_list, emitted_list = reserved.tolist(), cursor.tolist(), emitted.tolist()
        id_list = ids.tolist()
        unset = [-1] * count
        if (  # every lane keeps every rule (list equality compares the values as the rules below do)
            generation_list == expected_generations
            and consumed_list == expected_consumed
            and reserved_list == unset
            and cursor_list == unset
            and emitted_list == [emits] * count
            and (
                not samples
                or not count
                or (ids.dtype.kind in "iu" and min(id_list) >= 0 and max(id_list) < sampled_size)
            )
        ):
            suspects = []
        else:
            suspects = [
                index
                for index, (g, r, c, n, e, i) in enumerate(
                    zip(generation_list, reserved_list, cursor_list, consumed_list, emitted_list, id_list, strict=True)
                )
                if g != expected_generations[index]
                or r != -1
                or c != -1
                or n != expected_consumed[index]
                or e != emits
                or (samples and not 0 <= i < sampled_size)
            ]
    errors: dict[int, CompletionError] = {}
    if suspects:
        expected_generations = lanes.generations.tolist()
        expected_consumed = lanes.consumed.tolist()
        for index in suspects:
            problem = _lane_problem(
                LaneExpectation(expected_generations[index], expected_consumed[index], samples),
                int(generation[index]),
                int(reserved[index]),
                int(cursor[index]),
                int(consumed[index]),
                int(emitted[index]),
                int(ids[index]),
                sampled_size,
            )
            if problem is not None:
                errors[index] = CompletionError(f"lane {index}: {problem}")
    token_ids: list[int] = [-1] * count
    if samples:
        listed = id_list if id_list is not None else ids.tolist()
        token_ids = listed if ids.dtype.kind in "iu" else [int(v) for v in listed]
    values: list[float] = [0.0] * count
    if logprobs is not None:
        values = logprobs.tolist() if logprobs.dtype.kind == "f" else [float(v) for v in logprobs.tolist()]
    tops: dict[int, list[tuple[int, float]]] = {}
    if samples and lanes.top is not None:
        top_ids = completion.get(mf.COMPLETION_FIELD_TOP_IDS)
        top_logprobs = completion.get(mf.COMPLETION_FIELD_TOP_LOGPROBS)
        wanted = lanes.top.tolist()
        for index in np.flatnonzero(lanes.top > 0).tolist():
            if index in errors:
                continue
            try:
                tops[index] = _read_top(top_ids, top_logprobs, index, wanted[index], sampled_size)
            except CompletionError as exc:
                errors[index] = CompletionError(f"lane {index}: {exc}")
    return LaneResults(token_ids, values, errors, tops, ids if samples else None)


def as_results(results: Sequence[LaneResult | CompletionError]) -> LaneResults:
    errors = {i: r for i, r in enumerate(results) if isinstance(r, CompletionError)}
    lanes = [r if isinstance(r, LaneResult) else LaneResult(-1, 0.0) for r in results]
    tops = {i: r.top for i, r in enumerate(lanes) if r.top}
    return LaneResults([r.token_id for r in lanes], [r.logprob for r in lanes], errors, tops)


def _read_top(
    ids_field: npt.NDArray[np.generic] | None,
    logprobs_field: npt.NDArray[np.generic] | None,
    row: int,
    count: int,
    sampled_size: int,
) -> list[tuple[int, float]]:
    if ids_field is None or logprobs_field is None:
        raise CompletionError("the program writes no top alternatives")
    ids = ids_field.reshape(ids_field.shape[0], -1)[row]
    values = logprobs_field.reshape(logprobs_field.shape[0], -1)[row]
    if count > ids.shape[0]:
        raise CompletionError(f"{count} top alternatives requested; the record holds {ids.shape[0]}")
    top = [(int(ids[i]), float(values[i])) for i in range(count)]
    bad = [token for token, _ in top if not 0 <= token < sampled_size]
    if bad:
        raise CompletionError(f"top alternative id {bad[0]} lies outside the vocabulary [0, {sampled_size})")
    return top


def _read_scores(field_: npt.NDArray[np.generic] | None, start: int, count: int) -> list[float]:
    if field_ is None:
        raise CompletionError("the program writes no prompt scores")
    flat = field_.reshape(-1)
    if start + count > flat.shape[0]:
        raise CompletionError(f"prompt scores {start}..{start + count} exceed the record's {flat.shape[0]} tokens")
    return [float(v) for v in flat[start : start + count]]


def _echo_problem(lane: LaneExpectation, generation: int, reserved: int) -> str | None:
    """The rules every lane's record keeps: its echoed generation and the reserved model field (-1)."""
    if generation != lane.generation:
        return f"generation {generation} is stale (expected {lane.generation})"
    if reserved != -1:
        return f"the reserved model field is {reserved}, not -1"
    return None


def _lane_problem(
    lane: LaneExpectation,
    generation: int,
    reserved: int,
    cursor: int,
    consumed: int,
    emitted: int,
    token: int,
    sampled_size: int,
) -> str | None:
    echo = _echo_problem(lane, generation, reserved)
    if echo is not None:
        return echo
    if cursor != -1:
        return f"draft cursor {cursor} from a program without one"
    if consumed != lane.consumed:
        return f"consumed endpoint {consumed}, expected {lane.consumed}"
    expected_emitted = 1 if lane.samples else 0
    if emitted != expected_emitted:
        return f"emitted {emitted} tokens, expected {expected_emitted}"
    if lane.samples and not 0 <= token < sampled_size:
        return _outside_problem(token, sampled_size)
    return None


NO_SAMPLEABLE_ID = -1
"""The id a sampler writes for a row its grammar mask and penalties left without a sampleable id."""


def _outside_problem(token: int, sampled_size: int) -> str:
    """Why a sampled id outside the vocabulary fails its lane (the sampler's "nothing to sample" named)."""
    if token == NO_SAMPLEABLE_ID:
        return "no id could be sampled: the request's grammar or penalties left every id impossible"
    return f"sampled id {token} lies outside the vocabulary [0, {sampled_size})"


def _speculative_fields(
    views: RecordViews, count: int, packed_capacity: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """A speculative record's offers and accepted drafts (flat), sampled ids and logprobs (a row a lane;
    logprobs ``None`` where the record has none), after the checks of the whole round: both speculative
    fields present, at least ``count`` lanes in each, and the lanes' target rows within the program's
    ``packed_capacity`` (when given)."""
    record = views.record
    offers_field = record.get(mf.COMPLETION_FIELD_OFFERS)
    accepted_field = record.get(mf.COMPLETION_FIELD_ACCEPTED_DRAFTS)
    if offers_field is None or accepted_field is None:
        raise CompletionError("a speculative program's record has no offers or accepted drafts field")
    offers, accepted = offers_field.reshape(-1), accepted_field.reshape(-1)
    sampled = record[mf.COMPLETION_FIELD_SAMPLED_IDS]
    ids = sampled.reshape(sampled.shape[0], -1)
    logprob_field = record.get(mf.COMPLETION_FIELD_SAMPLED_LOGPROBS)
    logprob_rows = logprob_field.reshape(logprob_field.shape[0], -1) if logprob_field is not None else None
    if min(offers.shape[0], accepted.shape[0], ids.shape[0]) < count:
        raise CompletionError(f"the record holds fewer than the round's {count} speculative lanes")
    rows = int(offers[:count].sum()) + count
    if packed_capacity and rows > packed_capacity:  # the program's own allocation overran its P
        raise CompletionError(f"the lanes' offers take {rows} target rows; the program holds {packed_capacity}")
    return offers, accepted, ids, logprob_rows


def _read_speculative(
    views: RecordViews, lanes: Sequence[LaneExpectation], sampled_size: int, packed_capacity: int = 0
) -> list[LaneResult | CompletionError]:
    """The lanes of a speculative round: each lane's offers, accepted drafts and emitted tokens checked
    against what it was given before any of them is used.

    The round: the lanes' target rows (offers plus their pending tokens) within the program's
    ``packed_capacity`` P (when given), else the whole round fails. Per lane: the echoed generation; the
    reserved field -1; offers equal to the proposals the lane was given when the host chose them
    (copied), else at most its ceiling; accepted at most the
    offers; emitted exactly accepted + 1; the consumed endpoint the endpoint before the round plus the
    emitted tokens; the draft cursor -1 (these programs report none); every emitted id inside the
    sampled vocabulary. A lane that breaks a rule yields its CompletionError; the others are read.
    """
    count = len(lanes)
    generations, reserved, cursors, consumed, emitted, _ = views.head(count)
    offers, accepted, ids, logprob_rows = _speculative_fields(views, count, packed_capacity)
    results: list[LaneResult | CompletionError] = []
    for index, lane in enumerate(lanes):
        problem = _speculative_problem(
            lane,
            int(generations[index]),
            int(reserved[index]),
            int(cursors[index]),
            int(consumed[index]),
            int(emitted[index]),
            int(offers[index]),
            int(accepted[index]),
            ids.shape[1],
        )
        tokens: list[int] = []
        if problem is None:
            tokens = [int(token) for token in ids[index, : int(emitted[index])]]
            outside = [token for token in tokens if not 0 <= token < sampled_size]
            if outside:
                problem = _outside_problem(outside[0], sampled_size)
        if problem is not None:
            results.append(CompletionError(f"lane {index}: {problem}"))
            continue
        values = (
            [float(v) for v in logprob_rows[index, : len(tokens)]]
            if logprob_rows is not None and logprob_rows.shape[1] >= len(tokens)
            else [0.0] * len(tokens)
        )
        results.append(
            LaneResult(
                tokens[-1],
                values[-1],
                tokens=tokens,
                logprobs=values,
                accepted=int(accepted[index]),
                offers=int(offers[index]),
            )
        )
    return results


def _read_speculative_batch(
    views: RecordViews, lanes: SpeculativeExpectations, sampled_size: int, packed_capacity: int = 0
) -> Sequence[LaneResult | CompletionError]:
    """:func:`_read_speculative` of a batch: the same round checks, then every rule over all lanes at once;
    a lane that breaks one is examined alone for its first violation and message. A record whose fields
    are shorter than the lanes, or whose ids or logprobs are not integers and floats, is read lane by
    lane (as a list)."""
    count = len(lanes)
    offers_all, accepted_all, ids_all, logprob_rows = _speculative_fields(views, count, packed_capacity)
    if (
        views.lanes < count
        or any(field.dtype.kind not in "iu" for field in (ids_all, offers_all, accepted_all, views.emitted))
        or (logprob_rows is not None and (logprob_rows.dtype.kind != "f" or logprob_rows.shape[0] < count))
    ):
        return _read_speculative(views, lanes.to_list(), sampled_size, packed_capacity)
    generation, reserved, cursor, consumed, emitted, _ = views.head(count)
    offers = cast("npt.NDArray[np.integer[Any]]", offers_all[:count])  # integers, as checked above
    accepted = cast("npt.NDArray[np.integer[Any]]", accepted_all[:count])
    ids = cast("npt.NDArray[np.integer[Any]]", ids_all[:count])
    width = ids.shape[1]
    bad = generation != lanes.generations
    bad |= reserved != -1
    bad |= offers != lanes.offers
    bad |= accepted < 0
    bad |= accepted > offers
    bad |= emitted - accepted != 1
    bad |= emitted > width
    bad |= consumed != lanes.consumed + emitted
    lag = lanes.cursor_lag
    bad |= cursor != (-1 if lag < 0 else np.maximum(consumed - lag, 0))
    shown = np.arange(width) < emitted[:, None]
    outside = (ids < 0) | (ids >= sampled_size)
    outside &= shown
    bad |= outside.any(axis=1)
    errors: dict[int, CompletionError] = {}
    if bad.any():
        expectations = lanes.to_list()
        for index in np.flatnonzero(bad).tolist():
            problem = _speculative_problem(
                expectations[index],
                int(generation[index]),
                int(reserved[index]),
                int(cursor[index]),
                int(consumed[index]),
                int(emitted[index]),
                int(offers[index]),
                int(accepted[index]),
                width,
            )
            if problem is None:
                listed = ids[index, : int(emitted[index])].tolist()
                stray = next(int(token) for token in listed if not 0 <= token < sampled_size)
                problem = _outside_problem(stray, sampled_size)
            errors[index] = CompletionError(f"lane {index}: {problem}")
    logprobs = logprob_rows[:count].astype(np.float64) if logprob_rows is not None else None
    return SpeculativeResults(ids.copy(), logprobs, emitted.copy(), accepted.copy(), offers.copy(), errors)


def _speculative_problem(
    lane: LaneExpectation,
    generation: int,
    reserved: int,
    cursor: int,
    consumed: int,
    emitted: int,
    offers: int,
    accepted: int,
    width: int,
) -> str | None:
    echo = _echo_problem(lane, generation, reserved)
    if echo is not None:
        return echo
    if offers > lane.offers or offers < 0 or (lane.offers_exact and offers != lane.offers):
        return f"offers {offers} proposals; the lane's ceiling is {lane.offers}"
    if not 0 <= accepted <= offers:
        return f"accepted {accepted} drafts of {offers} offered"
    if emitted != accepted + 1:
        return f"emitted {emitted} tokens after accepting {accepted} drafts (expected {accepted + 1})"
    if emitted > width:
        return f"emitted {emitted} tokens; the record holds {width} per lane"
    if consumed != lane.consumed + emitted:
        return f"consumed endpoint {consumed}, expected {lane.consumed + emitted}"
    if lane.cursor_lag < 0 and cursor != -1:
        return f"draft cursor {cursor} from a program without one"
    if lane.cursor_lag >= 0 and cursor != max(consumed - lane.cursor_lag, 0):
        return f"draft cursor {cursor}, expected max({consumed} - {lane.cursor_lag}, 0)"
    return None


_ROUND_FIELDS = frozenset(
    {mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE, mf.COMPLETION_FIELD_STATUS, mf.COMPLETION_FIELD_PROMPT_SCORES}
)
"""Completion fields that are not one row per lane (checked by :func:`read_lanes` on every rank, or, for
prompt scores, per lane over the lane's own packed tokens)."""


_OFFERS_NAME = mf.CompletionField.Name(mf.COMPLETION_FIELD_OFFERS)
"""The offers field's name, as :func:`_differing_lanes` reports a differing field."""


def agree_across_ranks(
    results: Sequence[LaneResult | CompletionError],
    records: Sequence[Mapping[int, npt.NDArray[np.generic]]],
    sequence: int,
    lanes: Sequence[LaneExpectation] | ExpectationBatch,
    sampled_size: int,
    *,
    packed_capacity: int = 0,
) -> Sequence[LaneResult | CompletionError]:
    """Rank agreement: ``results`` (rank 0's record ``records[0]`` read by :func:`read_lanes`) with every
    other rank's record validated by the same rules and compared with rank 0's, lane by lane.

    A lane that any rank rejects, or whose per-lane fields (a row of every field but the submission
    sequence, status and prompt scores; a lane's own prompt scores) differ from rank 0's in any bit, becomes
    a CompletionError naming the rank: it is committed by no rank (only its request fails). A rank whose
    record fails the whole round (status, submission sequence) raises CompletionError naming the rank.
    When any lane's offers differ between ranks, the ranks allocated a speculative cohort apart: every lane of
    the round is rejected (the spec's rule that a rank rejecting the cohort suppresses its commit on all ranks).
    Answers like :func:`read_lanes`: a list for a list of expectations, :class:`LaneResults` for a batch.
    """
    count = len(lanes)
    first = records[0]
    rejected: dict[int, CompletionError] = {}
    split: tuple[int, int] | None = None
    """(rank, lane) of the first lane whose offers differ from rank 0's: the ranks allocated the cohort apart."""
    for rank, record in enumerate(records[1:], start=1):
        try:
            theirs = read_lanes(record, sequence, lanes, sampled_size, packed_capacity=packed_capacity)
        except CompletionError as exc:
            raise CompletionError(f"rank {rank} rejects the round: {exc}") from exc
        own_errors = theirs.errors if isinstance(theirs, LaneResults | SpeculativeResults) else {
            index: result for index, result in enumerate(theirs) if isinstance(result, CompletionError)
        }  # fmt: skip
        for index, error in sorted(own_errors.items()):
            if index not in rejected:
                problem = str(error).removeprefix(f"lane {index}: ")
                rejected[index] = CompletionError(f"lane {index}: rank {rank} rejects it: {problem}")
        for index, field_name in _differing_lanes(first, record, count, lanes):
            if split is None and field_name == _OFFERS_NAME:
                split = (rank, index)
            if index not in rejected:
                rejected[index] = CompletionError(
                    f"lane {index}: rank {rank}'s completion differs from rank 0's in {field_name}"
                )
    if split is not None:
        # A speculative cohort's lanes share the packed rows the ranks' collectives sum: ranks that allocated it
        # apart verified every lane from mixed sums, so no lane of the round is committed, equal fields or not.
        rank, lane = split
        rejected = {
            index: CompletionError(
                f"lane {index}: rank {rank} allocated the cohort apart from rank 0 (the offers of lane {lane} "
                "differ); no lane of the round is committed"
            )
            for index in range(count)
        }
    if not rejected:
        return results
    if isinstance(results, SpeculativeResults):
        return results.with_errors(rejected)
    if isinstance(results, LaneResults):
        errors = {**rejected, **results.errors}
        tops = {index: top for index, top in results.tops.items() if index not in errors}
        return LaneResults(results.token_ids, results.logprobs, errors, tops, results.ids)
    return [
        result if isinstance(result, CompletionError) or index not in rejected else rejected[index]
        for index, result in enumerate(results)
    ]


def _differing_lanes(
    first: Mapping[int, npt.NDArray[np.generic]],
    other: Mapping[int, npt.NDArray[np.generic]],
    count: int,
    lanes: Sequence[LaneExpectation] | ExpectationBatch,
) -> Iterator[tuple[int, str]]:
    """(lane, field name) of every lane of the first ``count`` whose row of a per-lane field differs."""
    for field_id, mine in first.items():
        theirs = other.get(field_id)
        name = mf.CompletionField.Name(field_id)  # type: ignore[arg-type]
        if field_id == mf.COMPLETION_FIELD_PROMPT_SCORES:
            if theirs is not None and not isinstance(lanes, ExpectationBatch):
                yield from _differing_scores(mine, theirs, lanes, name)
            continue
        if field_id in _ROUND_FIELDS:
            continue
        rows = min(count, mine.shape[0] if mine.ndim else 0)
        if theirs is None or theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            yield from ((index, name) for index in range(rows))
            continue
        if not rows:
            continue
        ours_bytes = np.ascontiguousarray(mine[:rows]).view(np.uint8).reshape(rows, -1)
        theirs_bytes = np.ascontiguousarray(theirs[:rows]).view(np.uint8).reshape(rows, -1)
        differs = (ours_bytes != theirs_bytes).any(axis=1)
        if differs.any():
            yield from ((int(index), name) for index in np.flatnonzero(differs))


def _differing_scores(
    mine: npt.NDArray[np.generic], theirs: npt.NDArray[np.generic], lanes: Sequence[LaneExpectation], name: str
) -> Iterator[tuple[int, str]]:
    flat_mine, flat_theirs = mine.reshape(-1), theirs.reshape(-1)
    for index, lane in enumerate(lanes):
        start, length = lane.scores
        if length <= 0:
            continue
        ours = np.ascontiguousarray(flat_mine[start : start + length]).view(np.uint8)
        other = np.ascontiguousarray(flat_theirs[start : start + length]).view(np.uint8)
        if ours.shape != other.shape or bool((ours != other).any()):
            yield index, name
