"""Collectives on the GPU: NCCL calls captured into CUDA graphs, and a ``--tensor-parallel 1`` core served on CUDA.

Two parts:

* The binding alone: a one-rank NCCL communicator on the test's context; ``ncclAllReduce``,
  ``ncclAllGather`` and ``ncclBroadcast`` captured on a stream into a graph, embedded as a child graph node
  of a second graph, instantiated and launched. In place, the all-reduce leaves the buffer unchanged; out of
  place, each collective of one rank copies ``x`` into ``out`` bit for bit.
* A tiny bf16 ``llama-synthetic --tensor-parallel 1`` core with ``reference,sm_90a`` kernels (an
  ``all_reduce`` after every output and down projection, no kernel for it) served on the CUDA backend: each
  program's graph holds every collective node as a captured child graph, and its greedy tokens, like the
  plain core's (built without the flag) on CUDA, equal the same core's on the reference backend up to a step
  the reference decided by a near tie (bf16 arithmetic may then pick the other token); the two CUDA runs
  agree on every first token and on whole sequences for at least half the prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.backends.nccl import NcclCommunicator, load_library, nccl_dtype
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.ops.catalogue import COLLECTIVE_OPERATORS
from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import manifest_pb2 as mf

from .harness import bf16_bits, build_gpu_core

NAMESPACE = "helios-tests/gpu-collectives"
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[(11 * p + 5 * i + 3) % 250 + 3 for i in range(7 + 6 * p)] for p in range(6)]
NEW_TOKENS = 10
NEAR_TIE = 0.05
"""Top-2 log-probability gap below which bf16 GPU arithmetic may legitimately pick the other token."""

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------
# the binding: NCCL calls captured into a graph
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def communicator(cuda_context: Context) -> Iterator[NcclCommunicator]:
    cuda_context.make_current()
    made = NcclCommunicator.one_rank(load_library())
    yield made
    made.close()


def _run_captured(context: Context, issue: Any) -> None:
    """Capture ``issue(stream)`` into a graph, embed it as the child graph node of another, launch that, wait."""
    captured = context.capture(issue)
    builder = context.graph()
    try:
        builder.child(captured, None)
        executable = builder.instantiate()
        try:
            context.launch_graph(executable)
            context.synchronize()
        finally:
            context.destroy_graph(executable)
    finally:
        context.destroy_captured(captured)
        builder.destroy()


def test_a_one_rank_all_reduce_captured_in_a_graph_leaves_its_buffer_unchanged(
    cuda_context: Context, communicator: NcclCommunicator
) -> None:
    assert communicator.library.version() >= 21800
    rng = np.random.default_rng(3)
    values = bf16_bits(rng.standard_normal(4096).astype(np.float32))
    buffer = cuda_context.alloc(values.nbytes)
    try:
        cuda_context.upload(buffer, values)
        bf16 = nccl_dtype(mf.DTYPE_BF16)
        _run_captured(cuda_context, lambda stream: communicator.all_reduce(buffer, buffer, values.size, bf16, stream))
        back = np.empty_like(values)
        cuda_context.download(buffer, back)
        np.testing.assert_array_equal(back, values)
    finally:
        cuda_context.free(buffer)


@pytest.mark.parametrize("operator", sorted(COLLECTIVE_OPERATORS))
def test_each_one_rank_collective_captured_out_of_place_copies_x(
    cuda_context: Context, communicator: NcclCommunicator, operator: str
) -> None:
    values = np.arange(1000, dtype=np.float32) * 0.25 - 7.0
    source, destination = cuda_context.alloc(values.nbytes), cuda_context.alloc(values.nbytes)
    try:
        cuda_context.upload(source, values)
        cuda_context.memset(destination, values.nbytes)
        f32 = nccl_dtype(mf.DTYPE_F32)

        def issue(stream: int) -> None:
            if operator == "all_reduce":
                communicator.all_reduce(source, destination, values.size, f32, stream)
            elif operator == "all_gather":
                communicator.all_gather(source, destination, values.size, f32, stream)
            else:
                communicator.broadcast(source, destination, values.size, f32, 0, stream)

        _run_captured(cuda_context, issue)
        back = np.empty_like(values)
        cuda_context.download(destination, back)
        np.testing.assert_array_equal(back, values)
    finally:
        cuda_context.free(source)
        cuda_context.free(destination)


# ----------------------------------------------------------------------------------------------
# a --tensor-parallel 1 core served on CUDA
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(tmp_path_factory, cuda_context, "gpu-tp1", NAMESPACE, "--tensor-parallel", "1")


@pytest.fixture(scope="module")
def plain_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(tmp_path_factory, cuda_context, "gpu-plain", NAMESPACE)


def _start(core: tuple[Path, TrustSettings], backend: str) -> RunningModel:
    return start(core[0], core[1], LoadOptions(), backend=backend)


def _greedy(running: RunningModel) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy tokens with each step's top-2 log-probability gap."""
    steps = []
    for i, prompt in enumerate(PROMPTS):
        request = PreparedRequest(f"r{i}", prompt, NEW_TOKENS, GREEDY, ignore_eos=True, top_logprobs=2)
        events = [e for e in running.engine.submit(request) if isinstance(e, TokenEvent)]
        steps.append([(e.token_id, e.top[0][1] - e.top[1][1]) for e in events])
    return steps


def _agrees_until_a_near_tie(got: list[int], want: list[tuple[int, float]]) -> bool:
    for token, (expected, gap) in zip(got, want, strict=False):
        if token != expected:
            return gap < NEAR_TIE
    return len(got) == len(want)


def test_a_tensor_parallel_1_core_on_cuda_gives_the_reference_and_plain_core_tokens(
    gpu_core: tuple[Path, TrustSettings], plain_core: tuple[Path, TrustSettings]
) -> None:
    reference = _start(gpu_core, "reference")
    try:
        expected = _greedy(reference)
    finally:
        reference.close()
    running = _start(gpu_core, "cuda")
    try:
        backend = running.model.backend
        assert isinstance(backend, CudaBackend)
        execution = running.model.contract.execution
        for program in list(execution.programs) + list(execution.tuning_programs):
            nodes = sum(node.op.name in COLLECTIVE_OPERATORS for node in program.nodes)
            assert backend.collectives[program.name] == nodes, program.name
        assert backend.collectives["decode_b1"] > 0
        tokens = [[t for t, _ in steps] for steps in _greedy(running)]
    finally:
        running.close()
    plain = _start(plain_core, "cuda")
    try:
        assert isinstance(plain.model.backend, CudaBackend)
        assert set(plain.model.backend.collectives.values()) == {0}
        plain_tokens = [[t for t, _ in steps] for steps in _greedy(plain)]
    finally:
        plain.close()
    assert all(len(t) == NEW_TOKENS for t in tokens)
    for got in (tokens, plain_tokens):
        assert all(_agrees_until_a_near_tie(t, want) for t, want in zip(got, expected, strict=True)), (got, expected)
        exact = sum(t == [token for token, _ in want] for t, want in zip(got, expected, strict=True))
        assert exact >= len(PROMPTS) // 2, (got, expected)
    assert [t[0] for t in tokens] == [p[0] for p in plain_tokens]
    same = sum(t == p for t, p in zip(tokens, plain_tokens, strict=True))
    assert same >= len(PROMPTS) // 2, (tokens, plain_tokens)
