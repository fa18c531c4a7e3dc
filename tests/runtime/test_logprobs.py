"""Generated-token logprobs, top alternatives and prompt scores on the golden fixture core."""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import pytest

from helios_core.runtime.completion import CompletionError, LaneExpectation, read_lanes
from helios_core.runtime.messages import (
    AdmissionRejected,
    Event,
    Finished,
    PreparedRequest,
    PromptScores,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf

GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "user", "content": "Hello there"}]


def _prompt(running: RunningModel) -> list[int]:
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    assert len(prompt) > 16  # longer than the fixture's 16-token (scored) prefill variant: several chunks
    return prompt


def _events(running: RunningModel, request: PreparedRequest) -> list[Event]:
    return list(running.engine.submit(request))


def _scores(running: RunningModel, rid: str, prompt: list[int], max_tokens: int = 1) -> tuple[list[float], list[Event]]:
    events = _events(running, PreparedRequest(rid, prompt, max_tokens, GREEDY, ignore_eos=True, prompt_logprobs=True))
    assert isinstance(events[0], PromptScores), events[0]
    assert isinstance(events[-1], Finished)
    return events[0].scores, events


def test_greedy_logprobs_match_the_top_alternative(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    events = _events(running, PreparedRequest("a", _prompt(running), 6, GREEDY, ignore_eos=True, top_logprobs=5))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 6
    for event in tokens:
        assert event.logprob <= 0.0
        assert len(event.top) == 5
        assert event.top[0] == (event.token_id, event.logprob)  # greedy picks the most likely id
        values = [logprob for _, logprob in event.top]
        assert values == sorted(values, reverse=True)
        assert len({token for token, _ in event.top}) == 5


def test_top_alternatives_only_when_asked(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    plain = [
        e
        for e in _events(running, PreparedRequest("p", prompt, 3, GREEDY, ignore_eos=True))
        if isinstance(e, TokenEvent)
    ]
    two = [
        e
        for e in _events(running, PreparedRequest("t", prompt, 3, GREEDY, ignore_eos=True, top_logprobs=2))
        if isinstance(e, TokenEvent)
    ]
    assert all(e.top == () for e in plain)
    assert [len(e.top) for e in two] == [2, 2, 2]
    assert [(e.token_id, e.logprob) for e in plain] == [(e.token_id, e.logprob) for e in two]


def test_prompt_scores_are_aligned_and_come_first(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    scores, events = _scores(running, "s", prompt, max_tokens=3)
    assert len(scores) == len(prompt) - 1
    assert all(score <= 0.0 for score in scores)
    assert [type(e) for e in events] == [PromptScores, TokenEvent, TokenEvent, TokenEvent, Finished]
    # Scoring does not change generation.
    scored_tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    plain = running.engine.generate(PreparedRequest("g", prompt, 3, GREEDY, ignore_eos=True))
    assert scored_tokens == plain.token_ids
    assert running.engine.statistics().rounds.get("scored_prefill", 0) == 2  # 30 tokens: chunks of 16 and 14


def test_prompt_scores_do_not_depend_on_chunking(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    full, _ = _scores(running, "full", prompt)  # chunks [0, 16) and [16, 30)
    for length in (5, 16, 20, 25):  # one chunk, one full chunk, two chunks with other boundaries
        part, _ = _scores(running, f"part{length}", prompt[:length])
        np.testing.assert_allclose(part, full[: length - 1], rtol=0, atol=1e-6)


def test_prompt_score_equals_the_generated_logprob(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    (first, *_) = [e for e in _events(running, PreparedRequest("g", prompt, 1, GREEDY)) if isinstance(e, TokenEvent)]
    scores, _ = _scores(running, "s", [*prompt, first.token_id])
    assert len(scores) == len(prompt)
    assert scores[-1] == pytest.approx(first.logprob, abs=1e-6)


def test_scored_requests_reuse_no_prefix(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    running.engine.generate(PreparedRequest("warm", prompt, 1, GREEDY))
    again = running.engine.generate(PreparedRequest("again", prompt, 1, GREEDY))
    assert again.reused_prompt_tokens > 0
    _, events = _scores(running, "scored", prompt)
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reused_prompt_tokens == 0


def test_scored_request_alongside_others(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    short = prompt[:12]
    solo_scores, solo_events = _scores(running, "solo", prompt, max_tokens=4)
    solo_other = running.engine.generate(PreparedRequest("solo-o", short, 4, GREEDY, ignore_eos=True)).token_ids
    streams = [
        running.engine.submit(PreparedRequest("o1", short, 4, GREEDY, ignore_eos=True)),
        running.engine.submit(
            PreparedRequest("sc", prompt, 4, GREEDY, ignore_eos=True, prompt_logprobs=True, top_logprobs=1)
        ),
        running.engine.submit(PreparedRequest("o2", short, 4, GREEDY, ignore_eos=True)),
    ]
    results = [list(stream) for stream in streams]
    for events in (results[0], results[2]):
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == solo_other
        assert not any(isinstance(e, PromptScores) for e in events)
    scored = results[1]
    assert isinstance(scored[0], PromptScores)
    np.testing.assert_allclose(scored[0].scores, solo_scores, rtol=0, atol=1e-6)
    solo_tokens = [e.token_id for e in solo_events if isinstance(e, TokenEvent)]
    assert [e.token_id for e in scored if isinstance(e, TokenEvent)] == solo_tokens


def test_one_token_prompt_has_no_scores(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    scores, _ = _scores(running, "one", _prompt(running)[:1])
    assert scores == []


def test_prompt_scores_need_scored_programs(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    running.engine.scheduler.residency.scored_prefill = False  # as on a core without scored prefill programs
    (event,) = _events(running, PreparedRequest("x", _prompt(running), 1, GREEDY, prompt_logprobs=True))
    assert isinstance(event, AdmissionRejected) and "not supported by this core" in event.message


def _record(top_ids: list[list[int]]) -> dict[int, np.ndarray]:
    rows = len(top_ids)
    return {
        mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE: np.array([7], dtype=np.int64),
        mf.COMPLETION_FIELD_GENERATION: np.array([1] * rows, dtype=np.int64),
        mf.COMPLETION_FIELD_EMITTED_TOKENS: np.array([1] * rows, dtype=np.int32),
        mf.COMPLETION_FIELD_CONSUMED_TOKENS: np.array([3] * rows, dtype=np.int32),
        mf.COMPLETION_FIELD_DRAFT_CURSOR: np.array([-1] * rows, dtype=np.int32),
        mf.COMPLETION_FIELD_RESERVED: np.array([-1] * rows, dtype=np.int32),
        mf.COMPLETION_FIELD_SAMPLED_IDS: np.array([[row[0]] for row in top_ids], dtype=np.int32),
        mf.COMPLETION_FIELD_SAMPLED_LOGPROBS: np.array([[-0.5]] * rows, dtype=np.float32),
        mf.COMPLETION_FIELD_TOP_IDS: np.array(top_ids, dtype=np.int32),
        mf.COMPLETION_FIELD_TOP_LOGPROBS: np.array([[-0.5, -1.0]] * rows, dtype=np.float32),
        mf.COMPLETION_FIELD_PROMPT_SCORES: np.array([-1.0, -2.0, 0.0, 0.0], dtype=np.float32),
    }


def test_read_lanes_reads_top_and_scores_per_lane() -> None:
    record = _record([[3, 4], [5, 99]])
    lanes = [LaneExpectation(1, 3, True, top=2, scores=(0, 2)), LaneExpectation(1, 3, True, top=2)]
    first, second = read_lanes(record, 7, lanes, sampled_size=10)
    assert not isinstance(first, CompletionError)
    assert first.top == [(3, -0.5), (4, -1.0)] and first.scores == [-1.0, -2.0]
    assert isinstance(second, CompletionError) and "top alternative id 99" in str(second)
    (plain,) = read_lanes(record, 7, [LaneExpectation(1, 3, True)], sampled_size=10)
    assert not isinstance(plain, CompletionError) and plain.top == [] and plain.scores == []


def test_published_token_events_hold_nothing_the_cyclic_collector_tracks(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """A token event's pieces and top alternatives are tuples of numbers and text, which the collector
    stops tracking at its first pass (lists stay tracked): events a slow reader leaves queued cost the
    collector's full passes nothing. Every way a token is published: concurrent plain requests (a
    round's tokens shared by its streams), timestamps, top alternatives, a string stop's gate."""
    running = start_fixture()
    prompt = _prompt(running)
    requests = [
        PreparedRequest("plain-a", prompt, 4, GREEDY, ignore_eos=True),
        PreparedRequest("plain-b", prompt, 4, GREEDY, ignore_eos=True),
        PreparedRequest("stamped", prompt, 4, GREEDY, ignore_eos=True, observe_timestamps=True),
        PreparedRequest("top", prompt, 4, GREEDY, ignore_eos=True, top_logprobs=2),
        PreparedRequest("stopped", prompt, 4, GREEDY, ignore_eos=True, string_stops=["\x00never"]),
    ]
    streams = [running.engine.submit(request) for request in requests]
    tokens = [e for stream in streams for e in stream if isinstance(e, TokenEvent)]
    assert len(tokens) == 4 * len(requests)
    assert sum(bool(e.top) for e in tokens) == 4 and sum(e.timestamp_ns >= 0 for e in tokens) >= 4
    gc.collect()  # a tuple of tuples: the inner ones stop being tracked in the first pass, the outer in the next
    gc.collect()
    assert [gc.is_tracked(e.pieces) or gc.is_tracked(e.top) for e in tokens] == [False] * len(tokens)
    assert [type(e.pieces) for e in tokens] == [tuple] * len(tokens)
