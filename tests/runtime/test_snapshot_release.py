"""A preempted request that leaves while it waits for readmission gives its snapshot row back.

A request preempted by snapshot waits at the front of the queue holding a snapshot row until its
restore commits. These tests make requests leave exactly then (right after their snapshot committed,
before any readmission), each way a waiting request can leave: cancelled (a client that hung up),
failed by an internal scheduler error, and cancelled by the worker's stop. Each time every snapshot row
must be free again at idle, each committed snapshot freed unrestored counted as discarded, and (for
the cancellations) a later burst must snapshot again into the released rows and produce exactly the
tokens each prompt produces alone: with penalties that holds only when preemption restores snapshots,
not when it recomputes for want of a row.

The requests are driven through the engine on the reference backend; the moment is found by hooking
the scheduler on the model worker thread (after a round's completion, or at the next plan).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import ExecutionFailed, Finished, Outgoing, SamplingParams
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.slots import Phase, RequestState
from helios_core.runtime.startup import RunningModel

from .engine_harness import (
    SNAPSHOT_CAPS,
    SignedCore,
    assert_pages_released,
    build_snapshot_core,
    request,
    run,
    solo_tokens,
    submit_all,
    token_ids,
)

NAMESPACE = "helios-tests/snapshot-release"
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)
ROWS = list(range(SNAPSHOT_CAPS.snapshots))
"""Every snapshot row of the core (4)."""
PROMPTS = [[7 + i, 40, 41, 42, 43, 44, 45, 90 + i, 12, 13] for i in range(6)]
TOKENS = 40
"""Six requests of 50 tokens each on 16 cache pages of 4 tokens (4 slots): about ten snapshots a burst."""
WAIT_S = 30.0


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    return build_snapshot_core(tmp_path_factory.mktemp("snapshot-release"), NAMESPACE)


@pytest.fixture
def running(core: SignedCore, started: list[RunningModel]) -> RunningModel:
    return run(core, started, cache_pages=16)


def _snapshotted_waiting(scheduler: Scheduler) -> list[RequestState]:
    """The preempted requests waiting for readmission with a committed snapshot."""
    return [state for state in scheduler.waiting if state.snapshot_row >= 0]


def _after_each_completion(engine: Engine, action: Callable[[list[RequestState]], None]) -> Callable[[], None]:
    """Call ``action`` with the snapshotted waiting requests after each round's completion (on the worker
    thread, before the worker drains its inbox or plans again); returns the undo."""
    scheduler = engine.scheduler
    real = scheduler.complete

    def complete(plan: RoundPlan, results: Sequence[object]) -> list[Outgoing]:
        events = real(plan, results)  # type: ignore[arg-type]
        waiting = _snapshotted_waiting(scheduler)
        if waiting:
            action(waiting)
        return events

    scheduler.complete = complete  # type: ignore[method-assign]

    def undo() -> None:
        del scheduler.complete  # type: ignore[method-assign]

    return undo


def _assert_every_row_free(engine: Engine, discarded: int) -> None:
    """Idle: every snapshot row is free, each committed snapshot was restored or discarded, no page is held."""
    assert sorted(engine.scheduler.free_snapshot_rows) == ROWS
    stats = engine.statistics()
    assert stats.snapshots_discarded == discarded
    assert stats.snapshots - stats.restores - stats.snapshots_discarded == 0
    assert_pages_released(engine)


def _assert_rows_serve_a_later_burst(engine: Engine, solo: list[list[int]]) -> None:
    """A burst without cancellations preempts by snapshot again (into the released rows), restores every
    snapshot, and each request produces exactly its solo tokens (penalties included)."""
    before = engine.statistics()
    streams = [engine.submit(request(f"again{i}", prompt, TOKENS, PENALIZED)) for i, prompt in enumerate(PROMPTS)]
    outputs = [list(stream) for stream in streams]
    after = engine.statistics()
    assert after.snapshots - before.snapshots >= len(ROWS)  # the rows were there to be used
    assert after.restores - before.restores == after.snapshots - before.snapshots
    for events, tokens in zip(outputs, solo, strict=True):
        end = events[-1]
        assert isinstance(end, Finished) and end.reason == "length", end
        assert token_ids(events) == tokens
    assert sorted(engine.scheduler.free_snapshot_rows) == ROWS


def test_a_request_cancelled_while_it_waits_with_a_snapshot_frees_its_row(running: RunningModel) -> None:
    engine = running.engine
    solo = solo_tokens(engine, PROMPTS, TOKENS, PENALIZED)
    cancelled: list[str] = []

    def cancel(waiting: list[RequestState]) -> None:
        for state in waiting:  # as a client that hangs up: through the engine's inbox
            if state.request_id not in cancelled and len(cancelled) < len(ROWS):
                cancelled.append(state.request_id)
                engine.cancel(state.request_id)

    undo = _after_each_completion(engine, cancel)
    streams = submit_all(engine, PROMPTS, TOKENS, PENALIZED)
    ends = {stream.request_id: list(stream)[-1] for stream in streams}
    undo()
    assert len(cancelled) == len(ROWS)  # as many as there are rows: every row would be gone
    for request_id, end in ends.items():
        assert isinstance(end, Finished), end
        assert end.reason == ("cancelled" if request_id in cancelled else "length")
    _assert_every_row_free(engine, discarded=len(cancelled))
    _assert_rows_serve_a_later_burst(engine, solo)


def test_an_internal_error_fails_waiting_snapshotted_requests_and_frees_their_rows(running: RunningModel) -> None:
    engine = running.engine
    solo = solo_tokens(engine, PROMPTS, TOKENS, PENALIZED)
    scheduler = engine.scheduler
    real = scheduler.next_round
    failed: list[str] = []

    def next_round() -> RoundPlan | None:
        waiting = _snapshotted_waiting(scheduler)
        if waiting and not failed:  # a scheduler bug while a preempted request waits with its snapshot
            failed.extend(state.request_id for state in waiting)
            raise RuntimeError("planning went wrong")
        return real()

    scheduler.next_round = next_round  # type: ignore[method-assign]
    streams = submit_all(engine, PROMPTS, TOKENS, PENALIZED)
    ends = [list(stream)[-1] for stream in streams]
    del scheduler.next_round  # type: ignore[method-assign]
    assert failed
    assert all(isinstance(end, ExecutionFailed) for end in ends), ends
    assert {end.message for end in ends if isinstance(end, ExecutionFailed)} == {
        "internal scheduler error: RuntimeError: planning went wrong"
    }
    stats = engine.statistics()
    assert stats.failed == len(PROMPTS)  # each request failed once
    _assert_every_row_free(engine, discarded=len(failed))
    _assert_rows_serve_a_later_burst(engine, solo)


def test_the_worker_stop_cancels_waiting_snapshotted_requests_and_frees_their_rows(running: RunningModel) -> None:
    engine = running.engine
    committed = threading.Event()
    proceed = threading.Event()
    held: list[str] = []

    def hold(waiting: list[RequestState]) -> None:
        if not held:  # the first commit: hold the worker here until the stop is in its inbox
            held.extend(state.request_id for state in waiting)
            committed.set()
            assert proceed.wait(WAIT_S)

    undo = _after_each_completion(engine, hold)
    streams = submit_all(engine, PROMPTS, TOKENS, PENALIZED)
    assert committed.wait(WAIT_S)
    stopping = threading.Thread(target=engine.shutdown)
    stopping.start()  # puts the stop into the inbox, then waits for the worker
    inbox = engine._inbox  # the stop must be there before the worker goes on
    for _ in range(int(WAIT_S / 0.01)):
        if not inbox.empty():
            break
        time.sleep(0.01)
    proceed.set()
    stopping.join(WAIT_S)
    assert not stopping.is_alive()
    undo()
    ends = [list(stream)[-1] for stream in streams]
    assert held
    for stream, end in zip(streams, ends, strict=True):
        assert isinstance(end, Finished), end
        if stream.request_id in held:
            assert end.reason == "cancelled"
    _assert_every_row_free(engine, discarded=len(held))


def test_a_request_cancelled_before_its_snapshot_committed_frees_its_row_uncounted(running: RunningModel) -> None:
    engine = running.engine
    scheduler = engine.scheduler
    real = scheduler.next_round
    marked: list[str] = []

    def next_round() -> RoundPlan | None:
        plan = real()
        for state in scheduler.running:  # marked for a snapshot while this round was planned
            if state.slot >= 0 and scheduler.table.phase_of(state.slot) == Phase.SNAPSHOT and not marked:
                marked.append(state.request_id)
                engine.cancel(state.request_id)  # reaches the worker before the snapshot round is planned
        return plan

    scheduler.next_round = next_round  # type: ignore[method-assign]
    streams = submit_all(engine, PROMPTS, TOKENS, PENALIZED)
    ends = {stream.request_id: list(stream)[-1] for stream in streams}
    del scheduler.next_round  # type: ignore[method-assign]
    assert len(marked) == 1
    end = ends[marked[0]]
    assert isinstance(end, Finished) and end.reason == "cancelled"
    _assert_every_row_free(engine, discarded=0)  # no snapshot of it committed: none discarded
