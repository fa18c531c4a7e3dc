"""History drafting and the validation of speculative completion records, on the host alone."""

from __future__ import annotations

import numpy as np
import pytest

from helios_core.runtime.completion import CompletionError, LaneExpectation, LaneResult, read_lanes
from helios_core.runtime.drafting import propose
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import manifest_pb2 as mf

# -- history drafting -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "limit", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # the suffix [1, 2] recurs: what followed it
        ([1, 2, 3, 4, 1, 2], 1, [3]),
        ([9, 1, 2, 3, 8, 1, 2, 3], 2, [8, 1]),  # the longest suffix [1, 2, 3] wins over shorter ones
        ([5, 1, 7, 2, 1, 7, 3, 1, 7], 2, [3, 1]),  # the most recent earlier occurrence
        ([1, 2, 1, 2], 4, [1, 2, 1, 2]),  # a repeating pattern continues past the end of the history
        ([4, 8, 8], 3, [8, 8, 8]),  # a one-token suffix at the end of what is known: the run repeats
        ([7, 1, 2, 3, 1, 2], 5, [3, 1, 2, 3, 1]),  # the stretch after the occurrence, on through the copy
        ([5, 6, 7], 3, []),  # nothing recurs
        ([4], 2, []),
        ([], 2, []),
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_history_drafting_copies_what_followed_the_longest_recurring_suffix(
    tokens: list[int], limit: int, expected: list[int]
) -> None:
    assert propose(np.asarray(tokens, dtype=np.int32), limit) == expected
    assert propose(tokens, limit) == expected


def test_a_longer_suffix_is_preferred_even_when_a_shorter_one_recurs_later() -> None:
    # [2, 3] occurs at 1 (followed by 4) and [3] alone at 5 (followed by 9): the 2-token match wins.
    assert propose([1, 2, 3, 4, 7, 3, 9, 2, 3], 1, max_ngram=2) == [4]
    assert propose([1, 2, 3, 4, 7, 3, 9, 2, 3], 1, max_ngram=1) == [9]


# -- speculative completion records ---------------------------------------------------------------------


def record(lanes: list[tuple[int, int, int, int, int, list[int]]], width: int = 4) -> dict[int, np.ndarray]:
    """A completion record of speculative lanes: (generation, offers, accepted, emitted, consumed, ids)."""
    rows = len(lanes)
    ids = np.full((rows, width), -1, dtype=np.int32)
    for row, lane in enumerate(lanes):
        ids[row, : len(lane[5])] = lane[5]
    return {
        mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE: np.array([3], dtype=np.int64),
        mf.COMPLETION_FIELD_GENERATION: np.array([lane[0] for lane in lanes], dtype=np.int32),
        mf.COMPLETION_FIELD_OFFERS: np.array([lane[1] for lane in lanes], dtype=np.int32),
        mf.COMPLETION_FIELD_ACCEPTED_DRAFTS: np.array([lane[2] for lane in lanes], dtype=np.int32),
        mf.COMPLETION_FIELD_EMITTED_TOKENS: np.array([lane[3] for lane in lanes], dtype=np.int32),
        mf.COMPLETION_FIELD_CONSUMED_TOKENS: np.array([lane[4] for lane in lanes], dtype=np.int32),
        mf.COMPLETION_FIELD_DRAFT_CURSOR: np.full(rows, -1, dtype=np.int32),
        mf.COMPLETION_FIELD_RESERVED: np.full(rows, -1, dtype=np.int32),
        mf.COMPLETION_FIELD_SAMPLED_IDS: ids,
        mf.COMPLETION_FIELD_SAMPLED_LOGPROBS: np.where(ids >= 0, -0.25, 0.0).astype(np.float32),
    }


def expect(generation: int, consumed: int, offers: int) -> LaneExpectation:
    return LaneExpectation(generation, consumed, True, 0, offers=offers)


def test_a_speculative_record_yields_every_emitted_token_per_lane() -> None:
    completion = record(
        [
            (1, 3, 3, 4, 14, [5, 6, 7, 8]),  # every proposal accepted, then the bonus token
            (2, 2, 0, 1, 21, [9]),  # the first proposal rejected: the target's own token
            (3, 0, 0, 1, 8, [4]),  # no proposal: one token, as a decode lane
        ]
    )
    results = read_lanes(completion, 3, [expect(1, 10, 3), expect(2, 20, 2), expect(3, 7, 0)], sampled_size=100)
    assert results == [
        LaneResult(8, -0.25, tokens=[5, 6, 7, 8], logprobs=[-0.25] * 4, accepted=3, offers=3),
        LaneResult(9, -0.25, tokens=[9], logprobs=[-0.25], accepted=0, offers=2),
        LaneResult(4, -0.25, tokens=[4], logprobs=[-0.25], accepted=0, offers=0),
    ]


@pytest.mark.parametrize(
    ("lane", "message"),
    [
        ((9, 2, 1, 2, 12, [5, 6]), "generation 9 is stale (expected 1)"),
        ((1, 3, 1, 2, 12, [5, 6]), "offers 3 proposals; the lane's ceiling is 2"),
        ((1, 2, 3, 4, 14, [5, 6, 7, 8]), "accepted 3 drafts of 2 offered"),
        ((1, 2, -1, 0, 10, []), "accepted -1 drafts of 2 offered"),
        ((1, 2, 1, 3, 13, [5, 6, 7]), "emitted 3 tokens after accepting 1 drafts (expected 2)"),
        ((1, 2, 1, 2, 11, [5, 6]), "consumed endpoint 11, expected 12"),
        ((1, 2, 1, 2, 12, [5, 100]), "sampled id 100 lies outside the vocabulary [0, 100)"),
        (
            (1, 2, 1, 2, 12, [5, -1]),
            "no id could be sampled: the request's grammar or penalties left every id impossible",
        ),
    ],
)
def test_a_speculative_lane_that_breaks_a_rule_fails_alone(
    lane: tuple[int, int, int, int, int, list[int]], message: str
) -> None:
    healthy = (2, 1, 1, 2, 22, [3, 4])
    results = read_lanes(record([lane, healthy]), 3, [expect(1, 10, 2), expect(2, 20, 1)], sampled_size=100)
    assert isinstance(results[0], CompletionError) and str(results[0]) == f"lane 0: {message}"
    assert results[1] == LaneResult(4, -0.25, tokens=[3, 4], logprobs=[-0.25, -0.25], accepted=1, offers=1)


def test_a_draft_cursor_or_reserved_value_fails_the_lane() -> None:
    completion = record([(1, 1, 0, 1, 11, [5]), (2, 1, 0, 1, 21, [6])])
    completion[mf.COMPLETION_FIELD_DRAFT_CURSOR][0] = 4
    completion[mf.COMPLETION_FIELD_RESERVED][1] = 0
    results = read_lanes(completion, 3, [expect(1, 10, 1), expect(2, 20, 1)], sampled_size=100)
    assert [str(r) for r in results] == [
        "lane 0: draft cursor 4 from a program without one",
        "lane 1: the reserved model field is 0, not -1",
    ]


def test_a_record_without_offers_fails_the_round() -> None:
    completion = record([(1, 1, 0, 1, 11, [5])])
    del completion[mf.COMPLETION_FIELD_OFFERS]
    with pytest.raises(CompletionError, match="no offers or accepted drafts field"):
        read_lanes(completion, 3, [expect(1, 10, 1)], sampled_size=100)


def test_a_decode_lane_reads_the_first_column_of_a_wide_record() -> None:
    """A core with speculative programs declares one record as wide as its widest program."""
    completion = record([(4, 0, 0, 1, 9, [42])])
    results = read_lanes(completion, 3, [LaneExpectation(4, 9, True)], sampled_size=100)
    assert results == [LaneResult(42, -0.25)]


def test_speculation_statistics_count_offers_acceptance_and_positions() -> None:
    stats = SchedulerStats()
    stats.count_speculation(4, offered=3, accepted=2, emitted=3)
    stats.count_speculation(4, offered=1, accepted=0, emitted=1)
    stats.count_speculation(2, offered=1, accepted=1, emitted=2)
    assert (stats.speculative_lanes, stats.proposals_offered, stats.drafts_accepted, stats.speculative_emitted) == (
        {4: 2, 2: 1},
        {4: 4, 2: 1},
        {4: 2, 2: 1},
        {4: 4, 2: 2},
    )
    assert stats.offered_by_position == {1: 3, 2: 1, 3: 1}
    assert stats.accepted_by_position == {1: 2, 2: 1}


def test_a_program_with_a_draft_cursor_must_report_it_behind_the_endpoint_by_its_lag() -> None:
    completion = record([(1, 2, 2, 3, 13, [5, 6, 7]), (2, 2, 0, 1, 21, [9]), (3, 1, 1, 2, 2, [4, 4])])
    completion[mf.COMPLETION_FIELD_DRAFT_CURSOR][:] = [12, 18, 0]
    lanes = [
        LaneExpectation(1, 10, True, 0, offers=2, cursor_lag=1),  # 13 - 1
        LaneExpectation(2, 20, True, 0, offers=2, cursor_lag=1),  # 21 - 1 = 20, not 18
        LaneExpectation(3, 0, True, 0, offers=1, cursor_lag=4),  # max(2 - 4, 0)
    ]
    results = read_lanes(completion, 3, lanes, sampled_size=100)
    assert isinstance(results[0], LaneResult) and results[0].tokens == [5, 6, 7]
    assert str(results[1]) == "lane 1: draft cursor 18, expected max(21 - 1, 0)"
    assert isinstance(results[2], LaneResult) and results[2].accepted == 1


def ceiling(generation: int, consumed: int, offers: int) -> LaneExpectation:
    """A lane of a program that allocates its own prefixes: ``offers`` is its ceiling of proposals."""
    return LaneExpectation(generation, consumed, True, 0, offers=offers, offers_exact=False)


def test_an_allocating_program_may_offer_fewer_than_the_ceiling_but_never_more() -> None:
    completion = record([(1, 1, 1, 2, 12, [5, 6]), (2, 4, 0, 1, 21, [9]), (3, 0, 0, 1, 31, [2])])
    results = read_lanes(completion, 3, [ceiling(1, 10, 3), ceiling(2, 20, 3), ceiling(3, 30, 3)], 100)
    assert isinstance(results[0], LaneResult) and (results[0].offers, results[0].tokens) == (1, [5, 6])
    assert str(results[1]) == "lane 1: offers 4 proposals; the lane's ceiling is 3"
    assert isinstance(results[2], LaneResult) and results[2].offers == 0


def test_offers_beyond_the_programs_packed_capacity_fail_the_round() -> None:
    completion = record([(1, 3, 0, 1, 11, [5]), (2, 3, 0, 1, 21, [6])])
    lanes = [ceiling(1, 10, 3), ceiling(2, 20, 3)]
    assert all(isinstance(r, LaneResult) for r in read_lanes(completion, 3, lanes, 100, packed_capacity=8))
    with pytest.raises(CompletionError, match="the lanes' offers take 8 target rows; the program holds 6"):
        read_lanes(completion, 3, lanes, 100, packed_capacity=6)


@pytest.mark.parametrize(
    ("acceptance", "widest", "expected"),
    [
        (0.0, 7, 1),  # at least one, so the rate keeps being measured
        (0.31, 7, 1),  # 0.31**2 < 0.2
        (0.5, 7, 2),  # 0.25 >= 0.2 > 0.125
        (0.8, 7, 7),  # 0.8**7 = 0.21
        (0.8, 3, 3),  # never past the widest program
        (1.0, 7, 7),
    ],
)
def test_a_request_offers_as_many_proposals_as_its_acceptance_makes_worthwhile(
    acceptance: float, widest: int, expected: int
) -> None:
    from helios_core.runtime.speculation import worthwhile_proposals

    assert worthwhile_proposals(acceptance, widest) == expected
