"""One request's fault ends that request alone: host gates that raise, and values that do not pack.

Each test runs three healthy greedy requests alone for their reference tokens, then again beside one
faulty request, all four in the engine at once (the tiny core holds four): the faulty one ends with
its own terminal event, naming the problem, and every healthy one produces exactly its reference
tokens and finishes normally.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from helios_core.runtime.gates import GateOutcome, HostGate
from helios_core.runtime.messages import (
    AdmissionRejected,
    Event,
    ExecutionFailed,
    Finished,
    PreparedRequest,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.packing import LaneBatch, PackedInput, SamplingLimits, _packed_input
from helios_core.runtime.startup import RunningModel
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

GREEDY = SamplingParams(temperature=0.0)
HEALTHY = (
    [{"role": "user", "content": "Hello there"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "What is up?"}],
)
LIMIT = 12
SELF_REFERENCE = json.dumps({"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}})
"""Compiles, but its matcher fails on the first mask (computed when the request's first sampling round is planned)."""


def _healthy(running: RunningModel, tag: str) -> list[PreparedRequest]:
    return [
        PreparedRequest(f"{tag}{index}", running.bootstrap.encode_prompt(messages), LIMIT, GREEDY, ignore_eos=True)
        for index, messages in enumerate(HEALTHY)
    ]


def _alone(running: RunningModel) -> list[list[int]]:
    return [running.engine.generate(request).token_ids for request in _healthy(running, "alone")]


def _beside(running: RunningModel, faulty: PreparedRequest) -> tuple[list[list[int]], list[Event]]:
    """Submit the healthy requests, then ``faulty``, before the first round completes (each launch is slowed
    so every request is admitted while the others run): the healthy tokens and the faulty request's events."""
    backend = running.model.backend
    real_run = backend.run

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.005)
        return real_run(*args, **kwargs)

    backend.run = slowed  # type: ignore[method-assign]
    try:
        streams = [running.engine.submit(request) for request in _healthy(running, "beside")]
        faulty_events = _read(running.engine.submit(faulty))
        results: list[list[int]] = []
        for stream in streams:
            events = _read(stream)
            assert isinstance(events[-1], Finished) and events[-1].reason == "length", events[-1]
            results.append([event.token_id for event in events if isinstance(event, TokenEvent)])
    finally:
        backend.run = real_run  # type: ignore[method-assign]
    return results, faulty_events


def _read(stream: Iterable[Event], timeout: float = 30.0) -> list[Event]:
    """Every event of ``stream``; fails (rather than hangs) when its terminal event does not come."""
    events: list[Event] = []
    reader = threading.Thread(target=lambda: events.extend(stream), daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), f"no terminal event after {events}"
    return events


@pytest.fixture
def running(start_fixture: Callable[..., RunningModel]) -> Iterator[RunningModel]:
    model = start_fixture()
    yield model
    deadline = time.monotonic() + 10
    while (stats := model.engine.statistics()).active_requests or stats.waiting_requests:
        assert time.monotonic() < deadline, "the engine kept requests after the test"
        time.sleep(0.01)


def _failure(events: list[Event]) -> ExecutionFailed:
    failed = events[-1]
    assert isinstance(failed, ExecutionFailed), events
    return failed


# -- host gates -------------------------------------------------------------------------------------


def test_a_schema_whose_first_mask_fails_ends_only_its_request(running: RunningModel) -> None:
    reference = _alone(running)
    prompt = running.bootstrap.encode_prompt(HEALTHY[0])
    faulty = PreparedRequest("bad", prompt, LIMIT, GREEDY, response_format=SELF_REFERENCE)
    healthy, events = _beside(running, faulty)
    assert healthy == reference
    assert events == [ExecutionFailed("bad", "structured output failed: grammar matcher failed: NoExtensionBias")]
    assert running.engine.statistics().failed == 1


class _Faulty(HostGate):
    """A real gate (string stops) whose ``where`` call raises from the ``after``-th call on."""

    def __init__(self, gate_args: tuple[Any, ...], where: str, after: int) -> None:
        super().__init__(*gate_args)
        self.where = where
        self.calls = 0
        self.after = after

    def _maybe_raise(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls >= self.after:
                raise ValueError(f"{where} broke")

    def mask(self) -> Any:
        self._maybe_raise("mask")
        return super().mask()

    def observe(self, token_id: int) -> GateOutcome:
        self._maybe_raise("observe")
        return super().observe(token_id)

    def finish(self) -> list[tuple[int, str]]:
        self._maybe_raise("finish")
        return super().finish()


def _inject(running: RunningModel, where: str, after: int) -> None:
    """Give request ``bad`` a gate whose ``where`` raises from its ``after``-th call (others keep theirs)."""
    scheduler = running.engine.scheduler
    make_gate = scheduler.make_gate
    assert make_gate is not None
    tokenizer = running.bootstrap.tokenizer
    compiler = running.grammar_compiler

    def faulty_gate(request: PreparedRequest) -> HostGate | None:
        if request.request_id == "bad":
            return _Faulty((request, tokenizer, compiler), where, after)
        return make_gate(request)

    scheduler.make_gate = faulty_gate


@pytest.mark.parametrize(
    ("where", "after"),
    [
        ("observe", 1),  # the first token, applied with the prefill round
        ("observe", 4),  # a later token, applied with a decode round
        ("mask", 3),  # a later round's mask, while the round is planned
        ("finish", 1),  # the flush at the output limit
    ],
)
def test_a_gate_that_raises_ends_only_its_request(running: RunningModel, where: str, after: int) -> None:
    reference = _alone(running)
    _inject(running, where, after)
    prompt = running.bootstrap.encode_prompt(HEALTHY[1])
    json_object = json.dumps({"type": "json_object"})
    fields: dict[str, Any] = {"response_format": json_object} if where == "mask" else {"string_stops": ["\x00never"]}
    faulty = PreparedRequest("bad", prompt, LIMIT, GREEDY, ignore_eos=True, **fields)
    healthy, events = _beside(running, faulty)
    assert healthy == reference
    failed = _failure(events)
    assert failed.message == f"the request's output processing failed: ValueError: {where} broke"
    tokens = [event for event in events if isinstance(event, TokenEvent)]
    expected = {("observe", 1): 0, ("observe", 4): 3, ("mask", 3): 2, ("finish", 1): LIMIT}[(where, after)]
    assert len(tokens) == expected


def test_a_gate_that_cannot_be_built_is_an_admission_rejection(running: RunningModel) -> None:
    reference = _alone(running)
    scheduler = running.engine.scheduler

    def broken(request: PreparedRequest) -> HostGate | None:
        raise ValueError("no grammar here")

    real = scheduler.make_gate
    scheduler.make_gate = lambda request: broken(request) if request.request_id == "bad" else real(request)  # type: ignore[misc]
    prompt = running.bootstrap.encode_prompt(HEALTHY[2])
    faulty = PreparedRequest("bad", prompt, LIMIT, GREEDY, response_format=json.dumps({"type": "json_object"}))
    healthy, events = _beside(running, faulty)
    assert healthy == reference
    assert events == [
        AdmissionRejected(
            "bad",
            "cannot prepare the request's output constraints: ValueError: no grammar here",
            param="response_format",
            permanent=True,
        )
    ]


@pytest.mark.parametrize(("prompt", "outside"), [([5, -1, 6], -1), ([5, 6, 10**6], 10**6), ([2**40], 2**40)])
def test_a_prompt_outside_the_input_vocabulary_is_an_admission_rejection(
    running: RunningModel, prompt: list[int], outside: int
) -> None:
    """Such ids would reach the prompt histogram and the packed tokens of rounds shared with others."""
    reference = _alone(running)
    healthy, events = _beside(running, PreparedRequest("bad", prompt, LIMIT, GREEDY))
    assert healthy == reference
    message = f"prompt token id {outside} lies outside the input vocabulary [0, 259)"
    assert events == [AdmissionRejected("bad", message, param="messages", permanent=True)]


# -- values that do not pack ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "param", "message"),
    [
        (SamplingParams(temperature=1e308), "temperature", "temperature=1e+308 does not fit the core's f32 "
         "sampling input: it must lie in [-3.4028235e+38, 3.4028235e+38]"),
        (SamplingParams(top_p=1e-320), "top_p", "top_p=1e-320 does not fit the core's f32 sampling input: it must "
         "lie in [1.1754944e-38, 3.4028235e+38]"),
        (SamplingParams(top_k=2**62), "top_k", "top_k=4611686018427387904 does not fit the core's i32 sampling "
         "input: it must lie in [-2147483648, 2147483647]"),
        (SamplingParams(repetition_penalty=1e-308), "repetition_penalty", "repetition_penalty=1e-308 does not fit "
         "the core's f32 sampling input: it must lie in [1.1754944e-38, 3.4028235e+38]"),
    ],
)  # fmt: skip
def test_a_value_that_does_not_pack_is_rejected_at_admission(
    running: RunningModel, sampling: SamplingParams, param: str, message: str
) -> None:
    reference = _alone(running)
    prompt = running.bootstrap.encode_prompt(HEALTHY[0])
    healthy, events = _beside(running, PreparedRequest("bad", prompt, LIMIT, sampling))
    assert healthy == reference
    assert events == [AdmissionRejected("bad", message, param=param, permanent=True)]


def test_a_value_no_slot_column_holds_is_rejected_at_admission(running: RunningModel) -> None:
    """Past the core's packed ranges (not checked here), a value must still fit its per-slot column exactly:
    every round of the request packs the column's value."""
    running.engine.scheduler.residency.sampling_limits = SamplingLimits()  # as a value no packed range foresaw
    prompt = running.bootstrap.encode_prompt(HEALTHY[0])
    (event,) = _read(running.engine.submit(PreparedRequest("bad", prompt, LIMIT, SamplingParams(seed=2**64 + 5))))
    assert event == AdmissionRejected(
        "bad",
        "seed 18446744073709551621 does not fit the per-request uint64 sampling column",
        param="seed",
        permanent=True,
    )


@pytest.mark.parametrize("sampling", [SamplingParams(top_k=2**62), SamplingParams(top_k=-(2**40))])
def test_a_round_that_does_not_pack_fails_only_the_requests_that_do_not_fit(
    running: RunningModel, sampling: SamplingParams
) -> None:
    reference = _alone(running)
    running.engine.scheduler.residency.sampling_limits = SamplingLimits()  # past admission, as a value no check foresaw
    prompt = running.bootstrap.encode_prompt(HEALTHY[0])
    healthy, events = _beside(running, PreparedRequest("bad", prompt, LIMIT, sampling))
    assert healthy == reference
    failed = _failure(events)
    assert failed.message.startswith("the request's values cannot be packed: OverflowError: "), failed.message
    assert not any(isinstance(event, TokenEvent) for event in events)


def test_a_decode_round_that_does_not_pack_fails_only_that_lane(running: RunningModel) -> None:
    """The faulty value appears only once the request decodes (its lanes are planned as a batch of columns
    by then), so the round that raises is a decode round of all four requests."""
    reference = _alone(running)
    planner = running.engine.scheduler.planner
    original = planner._decode_plan

    def poisoned(cohort: Any, *, ahead: int) -> Any:
        plan = original(cohort, ahead=ahead)
        lanes = plan.lanes
        if isinstance(lanes, LaneBatch) and "bad" in plan.request_ids:
            rows = dict(lanes.rows)
            column = np.array(rows[ct.VALUE_SOURCE_TOP_K], dtype=np.int64)
            column[plan.request_ids.index("bad")] = 2**40
            rows[ct.VALUE_SOURCE_TOP_K] = column
            plan = msgspec.structs.replace(plan, lanes=msgspec.structs.replace(lanes, rows=rows, staged_as=None))
        return plan

    planner._decode_plan = poisoned  # type: ignore[method-assign]
    prompt = running.bootstrap.encode_prompt(HEALTHY[0])
    healthy, events = _beside(running, PreparedRequest("bad", prompt, LIMIT, GREEDY, ignore_eos=True))
    assert healthy == reference
    failed = _failure(events)
    assert failed.message.startswith("the request's values cannot be packed: OverflowError: "), failed.message
    assert len([event for event in events if isinstance(event, TokenEvent)]) == 1  # its prefill token only


# -- the packed ranges ---------------------------------------------------------------------------------


def test_sampling_limits_follow_the_declared_destination_types(running: RunningModel) -> None:
    limits = SamplingLimits.of(running.model.contract)
    assert {name: [packed.kind for packed in inputs] for name, inputs in limits.inputs.items()} == {
        "temperature": ["f32"],
        "top_p": ["f32"],
        "top_k": ["i32"],
        "min_p": ["f32"],
        "repetition_penalty": ["f32"],
        "frequency_penalty": ["f32"],
        "presence_penalty": ["f32"],
        "seed": ["u64"],
    }
    assert limits.fits("temperature", 3.4028235e38) and not limits.fits("temperature", 3.5e38)
    assert limits.fits("temperature", 1e-320)  # rounds to zero: greedy, a meaningful temperature
    assert not limits.fits("top_p", 1e-39) and limits.fits("top_p", 1.1754944e-38)  # subnormal in f32
    assert not limits.fits("temperature", float("nan")) and not limits.fits("temperature", float("inf"))
    assert limits.fits("seed", 2**64 - 1) and not limits.fits("seed", 2**64) and not limits.fits("seed", -1)
    assert limits.fits("top_k", 2**31 - 1) and not limits.fits("top_k", 2**31) and not limits.fits("top_k", 1.0)
    assert limits.problem(SamplingParams()) is None


@pytest.mark.parametrize(
    ("dtype", "offset", "value", "fits"),
    [
        (mf.DTYPE_F16, 0, 65504.0, True),
        (mf.DTYPE_F16, 0, 65520.0, False),  # rounds to infinity in float16
        (mf.DTYPE_F16, 0, 6.0e-5, False),  # subnormal in float16
        (mf.DTYPE_BF16, 0, 3.4e38, False),
        (mf.DTYPE_BF16, 0, 3.3e38, True),
        (mf.DTYPE_F64, 0, 1e308, True),
        (mf.DTYPE_I32, 1, 2**31 - 1, False),  # the binding's offset is added before staging
        (mf.DTYPE_U32, 0, 2**32 - 1, True),
        (mf.DTYPE_U32, 0, 2**32, False),
    ],
)
def test_a_packed_input_holds_what_its_type_holds(dtype: int, offset: int, value: float, fits: bool) -> None:
    packed = _packed_input(dtype, offset)
    assert isinstance(packed, PackedInput)
    assert packed.fits(value, nonzero=True) is fits
