"""Runtime measurements and bounds: the constrained in-flight gauge, the engine's ingress bound and the
pending admission deque, and the mixed round's prefill-row value.

Each test drives the golden fixture core on the reference backend: the gauge through the engine with
a follow-up round launched while a constrained round is in flight (a normal run keeps one frame), the
bounds through a worker held inside its first launch, and the prefill row through the scheduler's own
plan of a mixed round packed into staging.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from helios_core.contract import PreparedGraph
from helios_core.contract.boundaries import PromptLayout
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.runtime.completion import LaneResult
from helios_core.runtime.engine import RequestStream
from helios_core.runtime.gates import HostGate
from helios_core.runtime.messages import (
    AdmissionRejected,
    Event,
    Finished,
    PreparedRequest,
    SamplingParams,
)
from helios_core.runtime.packing import GraphPacker, Submission
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.startup import RunningModel
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct

GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "user", "content": "Hello there"}]
WAIT_S = 30.0


# -- flare_constrained_max_inflight ------------------------------------------------------------------


def test_a_normal_constrained_run_measures_one_frame_in_flight(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    assert running.engine.statistics().constrained_max_inflight == 0  # no constrained submission yet
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    schema = json.dumps({"type": "json_object"})
    streams = [
        running.engine.submit(PreparedRequest("c", prompt, 8, GREEDY, response_format=schema)),
        running.engine.submit(PreparedRequest("u", prompt, 8, GREEDY, ignore_eos=True)),
    ]
    assert all(isinstance(list(stream)[-1], Finished) for stream in streams)
    stats = running.engine.statistics()
    assert stats.constrained_max_inflight == 1  # a constrained round waits for its feedback: one frame


def test_a_constrained_round_launched_behind_another_frame_raises_the_gauge(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """Let a constrained request's decode rounds pipeline (its gate no longer holds rounds): its follow-up
    round is submitted while the previous frame is still outstanding, so two frames are in flight."""
    running = start_fixture()
    engine = running.engine
    make_gate = engine.scheduler.make_gate
    assert make_gate is not None

    def pipelining_gate(request: PreparedRequest) -> HostGate | None:
        gate = make_gate(request)
        if gate is not None:
            gate.holds_rounds = False  # the fault under test: a constrained cohort is followed up
        return gate

    engine.scheduler.make_gate = pipelining_gate
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    schema = json.dumps({"type": "json_object"})
    events = list(engine.submit(PreparedRequest("c", prompt, 8, GREEDY, response_format=schema)))
    assert events  # it ends one way or another (its masks were computed a token ahead)
    stats = engine.statistics()
    assert stats.pipelined_rounds > 0
    assert stats.constrained_max_inflight == 2


# -- the ingress bound and the pending admission deque -----------------------------------------------


class _HeldWorker:
    """Holds the worker inside its first launch until released; records the pending deque's high mark."""

    def __init__(self, running: RunningModel) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.most_waiting = 0
        backend = running.model.backend
        real_run: Callable[..., Any] = backend.run

        def held_run(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            if not self.release.wait(WAIT_S):
                raise TimeoutError("the test never released the worker")
            return real_run(*args, **kwargs)

        backend.run = held_run  # type: ignore[method-assign]
        scheduler = running.engine.scheduler
        real_add = scheduler.add

        def counted_add(request: PreparedRequest, layout: PromptLayout | None = None) -> AdmissionRejected | None:
            rejection = real_add(request, layout)
            self.most_waiting = max(self.most_waiting, len(scheduler.waiting))
            return rejection

        scheduler.add = counted_add  # type: ignore[method-assign]


def _first_event(events: list[Event]) -> Event:
    assert events, "the stream ended without an event"
    return events[0]


def _events_within(stream: RequestStream, seconds: float) -> list[Event] | None:
    """The stream's events when it ends within ``seconds``, else None (read on a helper thread)."""
    found: list[list[Event]] = []
    reader = threading.Thread(target=lambda: found.append(list(stream)), daemon=True)
    reader.start()
    reader.join(seconds)
    return found[0] if found else None


@pytest.mark.parametrize("excess", [1, 3])
def test_the_engine_refuses_exactly_the_requests_beyond_queue_capacity_plus_max_active(
    excess: int, start_fixture: Callable[..., RunningModel]
) -> None:
    max_active, queue_capacity = 2, 3
    running = start_fixture(max_active=max_active, queue_capacity=queue_capacity)
    engine = running.engine
    assert engine.capacity == queue_capacity + max_active
    held = _HeldWorker(running)
    prompt = running.bootstrap.encode_prompt(MESSAGES)

    def request(index: int) -> PreparedRequest:
        return PreparedRequest(f"r{index}", prompt, 4, GREEDY, ignore_eos=True)

    streams = [engine.submit(request(0))]
    assert held.entered.wait(WAIT_S)  # the worker is inside its first round: nothing more is drained
    total = queue_capacity + max_active + excess
    streams += [engine.submit(request(i)) for i in range(1, total)]
    refused = streams[queue_capacity + max_active :]
    for stream in refused:  # answered at once, while the worker is still held
        events = _events_within(stream, 2.0)
        assert events is not None, f"{stream.request_id} was queued, not refused"
        assert len(events) == 1
        rejection = events[0]
        assert isinstance(rejection, AdmissionRejected)
        assert rejection.request_id == stream.request_id
        assert rejection.permanent is False  # a transient refusal: 503 with Retry-After over HTTP
        assert rejection.param is None
        assert rejection.message == (
            "the engine holds its limit of 5 requests (queue_capacity 3 + max_active 2); retry later"
        )
    held.release.set()
    outcomes = [_first_event(list(stream)) for stream in streams[: queue_capacity + max_active]]
    assert all(not isinstance(event, AdmissionRejected) for event in outcomes)
    assert held.most_waiting == queue_capacity  # the pending deque never took more than its capacity
    stats = engine.statistics()
    assert stats.finished == {"length": queue_capacity + max_active}
    assert (stats.received, stats.rejected) == (queue_capacity + max_active, excess)  # refused at the door
    # Room again: the next request is accepted.
    again = list(engine.submit(request(total)))
    assert isinstance(again[-1], Finished)


def test_a_cancelled_request_no_longer_counts_against_the_engine_bound(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture(max_active=1, queue_capacity=1)
    engine = running.engine
    held = _HeldWorker(running)
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    first = engine.submit(PreparedRequest("a", prompt, 4, GREEDY))
    assert held.entered.wait(WAIT_S)
    second = engine.submit(PreparedRequest("b", prompt, 4, GREEDY))
    engine.cancel("b")  # a client that went away: its place is free at once
    third = engine.submit(PreparedRequest("c", prompt, 4, GREEDY))
    held.release.set()
    assert isinstance(list(first)[-1], Finished)
    second_events = list(second)
    assert isinstance(second_events[-1], Finished) and second_events[-1].reason == "cancelled"
    assert isinstance(list(third)[-1], Finished)


def test_a_request_cancelled_in_the_backlog_counts_as_received_and_finished(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """``c`` waits in the worker's backlog behind ``b`` (the pending deque holds one) when both are cancelled:
    every request the worker ends was received, so in-flight counts (received less finished) never go
    negative."""
    running = start_fixture(max_active=1, queue_capacity=1)
    engine = running.engine
    held = _HeldWorker(running)
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    before = engine.statistics()
    first = engine.submit(PreparedRequest("a", prompt, 4, GREEDY))
    assert held.entered.wait(WAIT_S)
    cancelled = []
    for request_id in ("b", "c"):
        cancelled.append(engine.submit(PreparedRequest(request_id, prompt, 4, GREEDY)))
        engine.cancel(request_id)
    held.release.set()
    assert isinstance(list(first)[-1], Finished)
    assert [list(stream)[-1] for stream in cancelled] == [
        Finished("b", "cancelled", len(prompt), 0),
        Finished("c", "cancelled", len(prompt), 0),
    ]
    stats = engine.statistics()
    assert stats.received - before.received == 3
    assert stats.finished.get("cancelled", 0) - before.finished.get("cancelled", 0) == 2


def test_the_scheduler_refuses_a_request_when_its_pending_deque_is_full(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture(max_active=1, queue_capacity=2)
    scheduler = _scheduler(running)
    assert scheduler.add(PreparedRequest("a", [1, 2, 3], 4, GREEDY)) is None
    assert scheduler.add(PreparedRequest("b", [1, 2, 3], 4, GREEDY)) is None
    assert not scheduler.has_room
    rejection = scheduler.add(PreparedRequest("c", [1, 2, 3], 4, GREEDY))
    assert rejection == AdmissionRejected(
        "c", "the pending admission queue holds its limit of 2 requests; retry later", param=None, permanent=False
    )
    assert [state.request_id for state in scheduler.waiting] == ["a", "b"]


# -- MIXED_PREFILL_ROW -----------------------------------------------------------------------------


def _scheduler(running: RunningModel) -> Scheduler:
    """A scheduler of the running model's contract and selection with its own pages (driven by hand)."""
    contract = running.model.contract
    allocator = PageAllocator(
        running.model.cache_pages, contract.model.cache.page_tokens, contract.serving.cache_identity
    )
    return Scheduler(contract, running.model.selection, allocator, SchedulerStats())


def _complete(scheduler: Scheduler, token: int) -> None:
    round_ = scheduler.next_round()
    assert round_ is not None
    lanes = round_.lanes
    assert isinstance(lanes, tuple)
    scheduler.complete(round_, [LaneResult(token if lane.sample else -1, 0.0) for lane in lanes])


def _with_mixed_prefill_row(graph: PreparedGraph, destination: str) -> PreparedGraph:
    """``graph`` with ``destination`` bound to MIXED_PREFILL_ROW, one value per submission row."""
    contract = ct.GraphContract()
    contract.CopyFrom(graph.contract)
    kept = [b for b in contract.bindings if b.destination != destination]
    del contract.bindings[:]
    contract.bindings.extend(kept)
    contract.bindings.add(
        destination=destination,
        source=ct.VALUE_SOURCE_MIXED_PREFILL_ROW,
        indexing=ct.INDEXING_SUBMISSION_ROW,
        padding=0,
    )
    return dataclasses.replace(graph, contract=contract)


def test_a_mixed_round_packs_one_on_its_prefill_row(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    scheduler = _scheduler(running)
    for name in ("a", "b"):
        assert scheduler.add(PreparedRequest(name, [1, 2, 3], 8, GREEDY)) is None
    _complete(scheduler, token=5)  # initialize a and b
    _complete(scheduler, token=5)  # prefill a and b: both sample their first token and decode next
    assert scheduler.add(PreparedRequest("c", [4, 5, 6, 7, 8], 8, GREEDY)) is None
    _complete(scheduler, token=5)  # initialize c
    round_ = scheduler.next_round()
    assert round_ is not None
    assert round_.graph.operation == ct.OPERATION_MIXED
    assert round_.request_ids == ("a", "b", "c")  # decode lanes first
    assert [lane.mixed_prefill for lane in round_.lane_list()] == [False, False, True]

    contract = running.model.contract
    graph = _with_mixed_prefill_row(round_.graph, "constrained")
    staged = []
    for lanes in (round_.lanes, round_.lane_list()):  # the round's columns, and the same lanes as objects
        staging = {
            name: np.full(tuple(entry.shape), 77, dtype=NUMPY_DTYPES[entry.dtype])
            for name, entry in contract.transport.items()
        }
        GraphPacker(graph, staging).pack(Submission(lanes, 1), 0, staging)
        assert staging["constrained"].tolist() == [0, 0, 1, 0]  # row 2 is the prefill lane; the tail is padding
        assert staging["query_length"].tolist() == [1, 1, 5, 0]
        staged.append({name: array.tobytes() for name, array in staging.items()})
    assert staged[0] == staged[1]
