"""The engine API on a golden tiny core: admission, termination, seeds, validation, geometry."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from helios_core.errors import StartupError
from helios_core.runtime.messages import (
    AdmissionRejected,
    ExecutionFailed,
    Finished,
    PreparedRequest,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf

MESSAGES = [{"role": "user", "content": "Hello there"}]
GREEDY = SamplingParams(temperature=0.0)


def _prompt(running: RunningModel) -> list[int]:
    return running.bootstrap.encode_prompt(MESSAGES)


def test_events_are_tokens_then_one_terminal_event(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    events = list(running.engine.submit(PreparedRequest("a", _prompt(running), 5, GREEDY, ignore_eos=True)))
    assert [type(e) for e in events] == [TokenEvent] * 5 + [Finished]
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.reason, finished.prompt_tokens, finished.completion_tokens) == ("length", 30, 5)
    logprobs = [e.logprob for e in events if isinstance(e, TokenEvent)]
    assert all(lp <= 0.0 for lp in logprobs)


def test_request_outside_the_context_is_an_admission_rejection(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    (event,) = list(running.engine.submit(PreparedRequest("big", prompt, 64, GREEDY)))
    assert isinstance(event, AdmissionRejected)
    assert "exceeds the core's context of 64 tokens" in event.message
    # Rejection does not disturb the model: the next request runs normally.
    result = running.engine.generate(PreparedRequest("next", prompt, 3, GREEDY, ignore_eos=True))
    assert len(result.token_ids) == 3


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [([], 3, "the prompt is empty"), ([1, 2], 0, "max_tokens must be positive")],
)
def test_invalid_limits_are_rejected(
    prompt: list[int], max_tokens: int, message: str, start_fixture: Callable[..., RunningModel]
) -> None:
    running = start_fixture()
    (event,) = list(running.engine.submit(PreparedRequest("x", prompt, max_tokens, GREEDY)))
    assert isinstance(event, AdmissionRejected) and event.message == message


def test_greedy_is_deterministic_and_seeds_select_the_stream(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)

    def run(params: SamplingParams, rid: str) -> list[int]:
        return running.engine.generate(PreparedRequest(rid, prompt, 12, params, ignore_eos=True)).token_ids

    assert run(GREEDY, "g1") == run(GREEDY, "g2")
    hot = SamplingParams(temperature=1.0, seed=7)
    assert run(hot, "s1") == run(hot, "s2")
    assert run(hot, "s3") != run(SamplingParams(temperature=1.0, seed=8), "s4")


def test_cancellation_finishes_with_cancelled(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    engine = running.engine
    gate = threading.Event()
    original = engine.model.backend.run

    def slow_run(program: str, frame: int) -> None:
        gate.wait(timeout=5)
        original(program, frame)

    engine.model.backend.run = slow_run  # type: ignore[method-assign]
    stream = engine.submit(PreparedRequest("c", _prompt(running), 20, GREEDY, ignore_eos=True))
    engine.cancel("c")
    gate.set()
    events = list(stream)
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason == "cancelled"
    assert finished.completion_tokens < 20


def test_a_corrupt_completion_fails_only_that_request(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    engine = running.engine
    backend = engine.model.backend
    original = backend.run
    prompt = _prompt(running)

    def corrupting_run(program: str, frame: int) -> None:
        original(program, frame)
        if program.startswith("decode"):
            backend.completion(frame)[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[0] = 999

    backend.run = corrupting_run  # type: ignore[method-assign]
    events = list(engine.submit(PreparedRequest("bad", prompt, 5, GREEDY, ignore_eos=True)))
    assert isinstance(events[-1], ExecutionFailed)
    assert "generation 999 is stale" in events[-1].message
    # Only the token sampled by prefill was published; nothing from the failed round.
    assert sum(isinstance(e, TokenEvent) for e in events) == 1
    backend.run = original  # type: ignore[method-assign]
    assert len(engine.generate(PreparedRequest("good", prompt, 4, GREEDY, ignore_eos=True)).token_ids) == 4


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (mf.COMPLETION_FIELD_SAMPLED_IDS, 100_000, "outside the vocabulary"),
        (mf.COMPLETION_FIELD_RESERVED, 0, "reserved model field"),
        (mf.COMPLETION_FIELD_DRAFT_CURSOR, 3, "draft cursor"),
        (mf.COMPLETION_FIELD_EMITTED_TOKENS, 2, "emitted 2 tokens"),
        (mf.COMPLETION_FIELD_CONSUMED_TOKENS, 77, "consumed endpoint 77"),
        (mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE, -5, "echoes submission -5"),
    ],
)
def test_completion_validation_rejects_each_violation(
    field: int, value: int, message: str, start_fixture: Callable[..., RunningModel]
) -> None:
    running = start_fixture()
    backend = running.engine.model.backend
    original = backend.run

    def corrupting_run(program: str, frame: int) -> None:
        original(program, frame)
        if program.startswith("prefill"):
            backend.completion(frame)[field].reshape(-1)[0] = value

    backend.run = corrupting_run  # type: ignore[method-assign]
    events = list(running.engine.submit(PreparedRequest("v", _prompt(running), 3, GREEDY)))
    assert len(events) == 1 and isinstance(events[0], ExecutionFailed)
    assert message in events[0].message


def test_manifests_report_the_execution_geometry(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture(max_active=2, cache_pages=40)
    geometry = running.model.manifests()
    assert (geometry.backend, geometry.frames, geometry.cache_pages, geometry.page_tokens) == ("reference", 2, 40, 4)
    assert (geometry.pages_per_request, geometry.max_active, geometry.state_rows) == (16, 2, 2)
    names = {p.name: p for p in geometry.programs}
    assert names["decode_b4"].batch_capacity == 4 and names["prefill_p16"].packed_token_capacity == 16
    planes = running.model.backend.buffers["cache.k0"]
    assert planes.shape[0] == 40 and not np.any(planes)


def test_cache_pages_option_caps_and_is_checked(start_fixture: Callable[..., RunningModel]) -> None:
    assert start_fixture(cache_pages=20).model.cache_pages == 20
    with pytest.raises(StartupError, match="cannot hold one request at full context"):
        start_fixture(cache_pages=3)


def test_shutdown_gives_every_outstanding_request_a_final_event(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    prompt = _prompt(running)
    streams = [running.engine.submit(PreparedRequest(f"s{i}", prompt, 30, GREEDY, ignore_eos=True)) for i in range(6)]
    running.engine.shutdown()
    for stream in streams:
        finished = list(stream)[-1]
        assert isinstance(finished, Finished)
        assert finished.reason in ("cancelled", "length")
    running.engine.shutdown = lambda: None  # type: ignore[method-assign]  # already stopped; the fixture closes the core


def test_the_worker_inbox_carries_typed_messages(
    start_fixture: Callable[..., RunningModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every message the engine's API puts on the worker's inbox is one of the typed inbox structs."""
    import queue

    from helios_core.runtime.messages import Cancel, Stop, Submit

    sent: list[object] = []

    class RecordingQueue(queue.Queue):  # type: ignore[type-arg]
        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            sent.append(item)
            super().put(item, block, timeout)

    monkeypatch.setattr(queue, "SimpleQueue", RecordingQueue)  # the engine's inbox is made at start
    running = start_fixture()
    engine = running.engine
    request = PreparedRequest("typed", _prompt(running), 3, GREEDY, ignore_eos=True)
    events = list(engine.submit(request))
    engine.cancel("typed")
    engine.shutdown()
    assert isinstance(events[-1], Finished)
    assert not [m for m in sent if isinstance(m, tuple)]
    inbox = [m for m in sent if isinstance(m, Submit | Cancel | Stop)]  # request streams queue their events too
    assert [type(m) for m in inbox] == [Submit, Cancel, Stop]
    submitted, cancelled = inbox[0], inbox[1]
    assert isinstance(submitted, Submit) and submitted.request.request_id == "typed"
    assert isinstance(cancelled, Cancel) and cancelled.request_id == "typed"


def test_a_starved_mark_left_by_an_earlier_round_never_blocks_admission(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """The residency's starved mark (a running request lacked a page last round) holds admission back only
    while some request runs: with none running, nothing can free a page for the waiting ones, so a mark an
    earlier round left (a speculative round whose lane found no page, then every request finished or was
    preempted) must not leave requests waiting for good."""
    running = start_fixture()
    running.engine.scheduler.residency.starved = True  # the worker is idle: only admission clears it now
    events: list[object] = []
    worker = threading.Thread(
        target=lambda: events.extend(
            running.engine.submit(PreparedRequest("a", _prompt(running), 3, GREEDY, ignore_eos=True))
        ),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "the request was never admitted"
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 3
