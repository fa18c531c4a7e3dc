"""Completion validation: a round's completion record checked before any lane retires.

Owns the rules a completion record must satisfy: the echoed submission
sequence, each lane's echoed generation, emitted counts, the consumed-token
endpoint the scheduler expects, sampled ids inside the sampled vocabulary,
the draft cursor (-1 where a program has none) and the reserved model field
(always -1). A violation raises :class:`CompletionError` for the round; the
caller fails the affected requests and publishes nothing from that round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from helios_core.errors import HeliosError
from helios_core.wire import manifest_pb2 as mf


class CompletionError(HeliosError):
    """A completion record contradicts what was submitted."""


@dataclass(frozen=True)
class LaneExpectation:
    """What the scheduler expects of one lane's completion."""

    generation: int
    consumed: int
    samples: bool
    top: int = 0
    """Top alternatives to read for this lane (a sampling lane of a request that asked for them)."""
    scores: tuple[int, int] = (0, 0)
    """(first packed token, count) of this lane's prompt scores to read (scored prefill only)."""


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


def read_lanes(
    completion: Mapping[int, npt.NDArray[np.generic]],
    sequence: int,
    lanes: Sequence[LaneExpectation],
    sampled_size: int,
) -> list[LaneResult | CompletionError]:
    """Validate the first ``len(lanes)`` lanes of a completion record.

    A wrong submission sequence fails the whole round (raises). Every other rule is checked per lane:
    a violating lane yields its CompletionError in place of a result, so only its request fails.
    """
    echoed = int(completion[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1)[0])
    if echoed != sequence:
        raise CompletionError(f"completion echoes submission {echoed}, expected {sequence}")
    count = len(lanes)
    generations = completion[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[:count]
    emitted = completion[mf.COMPLETION_FIELD_EMITTED_TOKENS].reshape(-1)[:count]
    consumed = completion[mf.COMPLETION_FIELD_CONSUMED_TOKENS].reshape(-1)[:count]
    cursors = completion[mf.COMPLETION_FIELD_DRAFT_CURSOR].reshape(-1)[:count]
    reserved = completion[mf.COMPLETION_FIELD_RESERVED].reshape(-1)[:count]
    sampled = completion[mf.COMPLETION_FIELD_SAMPLED_IDS]
    ids = sampled.reshape(sampled.shape[0], -1)[:count, 0]
    logprobs_field = completion.get(mf.COMPLETION_FIELD_SAMPLED_LOGPROBS)
    top_ids = completion.get(mf.COMPLETION_FIELD_TOP_IDS)
    top_logprobs = completion.get(mf.COMPLETION_FIELD_TOP_LOGPROBS)
    prompt_scores = completion.get(mf.COMPLETION_FIELD_PROMPT_SCORES)
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
        logprob = float(logprobs_field.reshape(-1)[index]) if logprobs_field is not None and lane.samples else 0.0
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
    if generation != lane.generation:
        return f"generation {generation} is stale (expected {lane.generation})"
    if reserved != -1:
        return f"the reserved model field is {reserved}, not -1"
    if cursor != -1:
        return f"draft cursor {cursor} from a program without one"
    if consumed != lane.consumed:
        return f"consumed endpoint {consumed}, expected {lane.consumed}"
    expected_emitted = 1 if lane.samples else 0
    if emitted != expected_emitted:
        return f"emitted {emitted} tokens, expected {expected_emitted}"
    if lane.samples and not 0 <= token < sampled_size:
        return f"sampled id {token} lies outside the vocabulary [0, {sampled_size})"
    return None
