"""The CUDA backend against the reference backend on a tiny synthetic core with GPU kernels.

The core is built once per module by Ignition (``llama-synthetic --shape tiny``, bf16 weights,
``--targets reference,sm_90a``). Then: every decode and prefill program run once on both backends
from identical state and staging gives the same greedy ids and logits within 2e-2 relative; the
worker loop with both frames in flight gives exactly the reference tokens; shutdown with requests in
flight returns and releases the device; a failed execution while both frames are in flight fails
only the affected requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import LoadOptions, PreparedContract
from helios_core.errors import HeliosError
from helios_core.loading import TrustSettings, VerifiedCore
from helios_core.runtime.messages import (
    TERMINAL_EVENTS,
    ExecutionFailed,
    Finished,
    PreparedRequest,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.packing import GraphPacker, Lane, Submission
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .harness import build_gpu_core, relative_error, skip_when_compiling_only

NAMESPACE = "helios-tests/gpu-backend"
GREEDY = SamplingParams(temperature=0.0)
CACHE_PAGES = 64
STATE_ROWS = 8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-backend", NAMESPACE,
        "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "128", "--page-tokens", "16",
    )  # fmt: skip


def _start(gpu_core: tuple[Path, TrustSettings], backend: str, max_active: int = 8) -> RunningModel:
    return start(gpu_core[0], gpu_core[1], LoadOptions(max_active=max_active), backend=backend)


@pytest.fixture(scope="module")
def reference_running(gpu_core: tuple[Path, TrustSettings]) -> Iterator[RunningModel]:
    running = _start(gpu_core, "reference")
    yield running
    running.close()


def _prompts(running: RunningModel, count: int) -> list[list[int]]:
    return [
        running.bootstrap.encode_prompt([{"role": "user", "content": f"Question number {i}: what next?"}])
        for i in range(count)
    ]


def _tokens(events: list[Any]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


NEAR_TIE = 0.05
"""Top-2 log-probability gap below which bf16 GPU arithmetic may legitimately pick the other token."""


def _reference_steps(running: RunningModel, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[int, float]]]:
    """Each request's greedy tokens on the reference backend, with each step's top-2 logprob gap."""
    steps = []
    for i, prompt in enumerate(prompts):
        request = PreparedRequest(f"gap{i}", prompt, max_tokens, GREEDY, ignore_eos=True, top_logprobs=2)
        events = [e for e in running.engine.submit(request) if isinstance(e, TokenEvent)]
        steps.append([(e.token_id, e.top[0][1] - e.top[1][1]) for e in events])
    return steps


def _agrees_until_a_near_tie(got: list[int], want: list[tuple[int, float]]) -> bool:
    """``got`` equals the reference's greedy tokens up to the end or up to a step the reference
    itself decided by less than :data:`NEAR_TIE` (after which the continuations may differ)."""
    for token, (expected, gap) in zip(got, want, strict=False):
        if token != expected:
            return gap < NEAR_TIE
    return len(got) == len(want)


# ----------------------------------------------------------------------------------------------
# (a) each program once, from identical state and staging
# ----------------------------------------------------------------------------------------------


def _lanes(contract: PreparedContract, graph_name: str, rng: np.random.Generator) -> list[Lane]:
    graph = contract.graphs[graph_name]
    ext = graph.extents
    page_tokens = contract.model.cache.page_tokens
    decode = graph.operation == ct.OPERATION_DECODE
    rows = ext.batch_capacity if decode else max(1, min(ext.batch_capacity, ext.packed_token_capacity // 8))
    tokens = 1 if decode else min(ext.packed_token_capacity // rows, ext.token_capacity)
    lanes = []
    for row in range(rows):
        start = 5 + 3 * row if decode else 0
        positions = list(range(start, start + tokens))
        pages = [row * 8 + j for j in range(positions[-1] // page_tokens + 1)]
        lanes.append(
            Lane(
                slot=row,
                generation=row + 1,
                state_row=row,
                positions=positions,
                cache_slots=[pages[p // page_tokens] * page_tokens + p % page_tokens for p in positions],
                page_table=pages,
                tokens=[] if decode else [int(t) for t in rng.integers(0, contract.sampled_size, tokens)],
                sample=True,
                sampling=SamplingParams(temperature=0.0, seed=row),
                consumed=positions[0],
            )
        )
    return lanes


def _randomize_state(
    contract: PreparedContract, ref: ReferenceBackend, gpu: CudaBackend, rng: np.random.Generator
) -> None:
    """The same random cache and state on both backends (values any program may meet)."""
    for decl in contract.execution.buffers:
        if decl.role not in (mf.BUFFER_ROLE_CACHE_PLANE, mf.BUFFER_ROLE_PERSISTENT_STATE):
            continue
        target = ref.buffers[decl.name]
        if target.dtype.kind == "f":
            values = (rng.standard_normal(target.shape) * 0.5).astype(target.dtype)
        elif decl.dtype == mf.DTYPE_BF16:
            values = (rng.standard_normal(target.shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        else:
            values = rng.integers(0, min(contract.sampled_size, 200), target.shape).astype(target.dtype)
        target[...] = values
        gpu.upload(decl.name, values)


def _stage(contract: PreparedContract, graph_name: str, staging: Any, lanes: list[Lane], sequence: int) -> None:
    GraphPacker(contract.graphs[graph_name], staging).pack(Submission(lanes, sequence), 0, staging)
    transport = contract.execution.transport
    staging[transport.frame_index_entry].reshape(-1)[0] = 0
    staging[transport.submission_sequence_entry].reshape(-1)[0] = sequence


def test_every_decode_and_prefill_program_matches_the_reference(verified: VerifiedCore) -> None:
    contract = verified.contract
    ref = ReferenceBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    gpu = CudaBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, frames=2)
    try:
        names = [
            name
            for name, graph in contract.graphs.items()
            if graph.operation in (ct.OPERATION_DECODE, ct.OPERATION_PREFILL)
        ]
        assert any(contract.graphs[n].operation == ct.OPERATION_DECODE for n in names)
        assert any(contract.graphs[n].operation == ct.OPERATION_PREFILL for n in names)
        for sequence, name in enumerate(names, 1):
            rng = np.random.default_rng(sequence)
            _randomize_state(contract, ref, gpu, rng)
            lanes = _lanes(contract, name, rng)
            _stage(contract, name, ref.transport(0), lanes, sequence)
            _stage(contract, name, gpu.transport(0), lanes, sequence)
            ref.run(name, 0)
            gpu.run(name, 0)
            rows = len(lanes)
            want, got = ref.completion(0), gpu.completion(0)
            want_ids = want[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(want[mf.COMPLETION_FIELD_SAMPLED_IDS].shape[0], -1)
            got_ids = got[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(want_ids.shape)
            assert int(got[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1)[0]) == sequence
            np.testing.assert_array_equal(
                got[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[:rows], [lane.generation for lane in lanes]
            )
            logits = gpu.download("scratch.logits")[:rows]
            expected = ref.buffers["scratch.logits"][:rows]
            assert relative_error(logits, expected) < 2e-2, name
            # Greedy ids must agree wherever the reference's top-2 margin exceeds the logits' difference.
            sampled = contract.sampled_size
            deviation = np.abs(logits[:, :sampled] - expected[:, :sampled]).max(axis=1)
            top_two = np.sort(expected[:, :sampled], axis=1)[:, -2:]
            decided = (top_two[:, 1] - top_two[:, 0]) > 2 * deviation
            np.testing.assert_array_equal(got_ids[:rows, 0][decided], want_ids[:rows, 0][decided], err_msg=name)
            assert decided.mean() >= 0.5, name
    finally:
        gpu.close()
        ref.close()


# ----------------------------------------------------------------------------------------------
# (b) the worker loop with both frames in flight
# ----------------------------------------------------------------------------------------------


def test_concurrent_greedy_requests_give_the_reference_tokens(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    prompts = _prompts(reference_running, 12)
    expected = _reference_steps(reference_running, prompts, 12)
    running = _start(gpu_core, "cuda")
    try:
        assert running.model.backend_name == "cuda" and isinstance(running.model.backend, CudaBackend)
        streams = [
            running.engine.submit(PreparedRequest(f"r{i}", p, 12, GREEDY, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        outcomes = [list(stream) for stream in streams]
        assert all(isinstance(events[-1], Finished) for events in outcomes), [o[-1] for o in outcomes]
        tokens = [_tokens(events) for events in outcomes]
        assert all(len(t) == 12 for t in tokens)
        assert all(_agrees_until_a_near_tie(t, want) for t, want in zip(tokens, expected, strict=True)), (
            tokens,
            expected,
        )
        exact = sum(t == [token for token, _ in want] for t, want in zip(tokens, expected, strict=True))
        assert exact >= len(prompts) // 2
        stats = running.engine.statistics()
        assert stats.pipelined_rounds > 0
        assert stats.finished == {"length": 12}
    finally:
        running.close()


def test_auto_selects_the_gpu_for_a_core_with_its_kernels(gpu_core: tuple[Path, TrustSettings]) -> None:
    skip_when_compiling_only("choosing the backend")
    running = _start(gpu_core, "auto", max_active=1)
    try:
        assert running.model.manifests().backend == "cuda"
    finally:
        running.close()


# ----------------------------------------------------------------------------------------------
# (c) shutdown with requests in flight
# ----------------------------------------------------------------------------------------------


def test_shutdown_with_requests_in_flight_releases_the_device(
    gpu_core: tuple[Path, TrustSettings], cuda_context: Context
) -> None:
    free_before = cuda_context.free_memory()
    running = _start(gpu_core, "cuda")
    prompts = _prompts(running, 8)
    streams = [
        running.engine.submit(PreparedRequest(f"s{i}", p, 60, GREEDY, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    deadline = time.monotonic() + 30
    while running.engine.statistics().rounds == {} and time.monotonic() < deadline:
        time.sleep(0.001)
    started = time.monotonic()
    running.close()
    assert time.monotonic() - started < 30
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], TERMINAL_EVENTS)
    assert cuda_context.free_memory() >= free_before - (64 << 20)  # device memory came back
    again = _start(gpu_core, "cuda", max_active=1)
    try:
        result = again.engine.generate(PreparedRequest("after", prompts[0], 4, GREEDY, ignore_eos=True))
        assert len(result.token_ids) == 4
    finally:
        again.close()


# ----------------------------------------------------------------------------------------------
# (d) a failed execution while both frames are in flight
# ----------------------------------------------------------------------------------------------


def test_a_corrupt_record_read_while_the_other_frame_runs_fails_only_its_request(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    prompts = _prompts(reference_running, 4)
    expected = _reference_steps(reference_running, prompts, 10)
    running = _start(gpu_core, "cuda")
    backend = running.model.backend
    original = backend.completion
    corrupted: list[int] = []

    def corrupting_completion(frame: int) -> Any:
        records = original(frame)  # after the frame's fence, the other frame still in flight
        scheduler = running.engine.scheduler
        if frame == 0 and scheduler.in_flight and not corrupted and len(scheduler.running) == 4:
            records[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[1] += 100
            corrupted.append(frame)
        return records

    backend.completion = corrupting_completion  # type: ignore[method-assign]
    try:
        streams = [
            running.engine.submit(PreparedRequest(f"c{i}", p, 10, GREEDY, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        outcomes = [list(stream) for stream in streams]
        assert corrupted
        failures = [events for events in outcomes if isinstance(events[-1], ExecutionFailed)]
        assert len(failures) == 1 and "is stale" in failures[0][-1].message
        for events, want in zip(outcomes, expected, strict=True):
            published = _tokens(events)
            if isinstance(events[-1], Finished):
                assert _agrees_until_a_near_tie(published, want)
            else:
                assert _agrees_until_a_near_tie(published, want[: len(published)]) and len(published) < 10
        assert running.engine.statistics().pipelined_rounds > 0
    finally:
        backend.completion = original  # type: ignore[method-assign]
        running.close()


def test_a_launch_failing_on_one_frame_fails_only_that_round(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    prompts = _prompts(reference_running, 3)
    expected = _reference_steps(reference_running, prompts, 8)
    running = _start(gpu_core, "cuda", max_active=1)  # one request at a time: the round is one request's
    backend = running.model.backend
    original = backend.run
    failed: list[str] = []

    def failing_run(program: str, frame: int) -> None:
        if frame == 1 and not failed:
            failed.append(program)
            raise HeliosError("injected launch failure")
        original(program, frame)

    backend.run = failing_run  # type: ignore[method-assign]
    try:
        streams = [
            running.engine.submit(PreparedRequest(f"f{i}", p, 8, GREEDY, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        outcomes = [list(stream) for stream in streams]
        assert failed
        first = outcomes[0][-1]
        assert isinstance(first, ExecutionFailed) and "injected launch failure" in first.message
        for events, want in zip(outcomes[1:], expected[1:], strict=True):
            assert isinstance(events[-1], Finished) and _agrees_until_a_near_tie(_tokens(events), want)
    finally:
        backend.run = original  # type: ignore[method-assign]
        running.close()
    backend.close()  # closed already: idempotent
