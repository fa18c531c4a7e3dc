"""The gated recurrence kernels and a recurrent core with GPU kernels against the reference backend.

Node level: ``gated_recurrence_scan`` over lanes whose tokens are interleaved in the packed block, with
padding tokens and a skipped lane, and ``gated_recurrence_step`` with a skipped lane, give the reference's
outputs and state rows within float32 rounding (the device ``exp``). Core level: a tiny
``recurrent-synthetic`` core built for ``reference,sm_90a`` with 16-token prefill programs serves prompts
of several prefill chunks on the CUDA backend with the reference's greedy tokens (up to a step the
reference itself decided by a near tie) and the reference's log-probabilities within 2e-2. Host tier:
with one snapshot row and one pinned host checkpoint slot (``offload_checkpoints=1``), a shared prefix's
checkpoint evicted by another prompt's moves to host memory and a later prompt sharing the prefix
restores it, with the tokens of a run that reused nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.cuda_driver import Context
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import Finished
from helios_core.runtime.startup import RunningModel, start
from tests.runtime.engine_harness import prompt_of, request, tokens_and_end

from .harness import assert_cuda_matches_reference, build_gpu_core, reference_node, run_node

NAMESPACE = "helios-tests/gpu-recurrent"

pytestmark = pytest.mark.gpu


def test_scan_matches_the_reference_with_interleaved_lanes_padding_and_a_skipped_lane(
    cuda_context: Context,
) -> None:
    rng = np.random.default_rng(1)
    tokens, width, state_rows = 24, 72, 6
    arrays = {
        "gate": (rng.normal(size=(tokens, width)) * 4).astype(np.float32),
        "x": rng.normal(size=(tokens, width)).astype(np.float32),
        "token_row": np.array([0, 0, 2, 2, -1, 0, 2, 1, 1, 0, 3, 3] * 2, dtype=np.int32),
        "rows": np.array([4, 1, 0, -1], dtype=np.int32),
        "state": rng.normal(size=(state_rows, width)).astype(np.float32),
        "out": np.full((tokens, width), 9.0, dtype=np.float32),
    }
    got = run_node(cuda_context, "gated_recurrence_scan", arrays)
    want = reference_node("gated_recurrence_scan", arrays)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["state"], want["state"], rtol=1e-5, atol=1e-6)
    assert not got["out"][arrays["token_row"] == 3].any() and not got["out"][arrays["token_row"] < 0].any()
    np.testing.assert_array_equal(got["state"][[2, 3, 5]], arrays["state"][[2, 3, 5]])


def test_step_matches_the_reference_and_one_scan_token(cuda_context: Context) -> None:
    rng = np.random.default_rng(2)
    lanes, width = 4, 40
    arrays = {
        "gate": (rng.normal(size=(lanes, width)) * 4).astype(np.float32),
        "x": rng.normal(size=(lanes, width)).astype(np.float32),
        "rows": np.array([3, -1, 0, 2], dtype=np.int32),
        "state": rng.normal(size=(5, width)).astype(np.float32),
        "out": np.full((lanes, width), 9.0, dtype=np.float32),
    }
    got = run_node(cuda_context, "gated_recurrence_step", arrays)
    want = reference_node("gated_recurrence_step", arrays)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["state"], want["state"], rtol=1e-5, atol=1e-6)
    assert not got["out"][1].any()
    scan = run_node(
        cuda_context,
        "gated_recurrence_scan",
        {**{k: arrays[k] for k in ("gate", "x", "rows", "state", "out")}, "token_row": np.arange(4, dtype=np.int32)},
    )
    np.testing.assert_array_equal(scan["state"], got["state"])  # one scan token, bit for bit


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-recurrent", NAMESPACE,
        "--max-rows", "4", "--prefill-tokens", "16", "--context", "128", "--page-tokens", "16",
        "--cache-pages", "64",
        core_name="recurrent.core", recipe="recurrent-synthetic", dtype=None,
    )  # fmt: skip


def test_recurrent_core_on_cuda_gives_the_reference_tokens_and_logprobs(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    assert_cuda_matches_reference(gpu_core, reference_running)


def _served(engine: Engine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    tokens, end = tokens_and_end(engine, request(request_id, prompt, 4))
    assert isinstance(end, Finished) and end.reason == "length", end
    return tokens, end.reused_prompt_tokens


def test_an_evicted_checkpoint_comes_back_from_pinned_host_memory(gpu_core: tuple[Path, TrustSettings]) -> None:
    prefix = prompt_of(1, 96)  # six 16-token prefill chunks; the context (128) leaves room for the rest
    later = [*prefix, 7, 8]
    alone = start(gpu_core[0], gpu_core[1], LoadOptions(max_active=1), backend="cuda")
    try:
        expected, reused = _served(alone.engine, "alone", later)
        assert reused == 0
    finally:
        alone.close()
    running = start(gpu_core[0], gpu_core[1], LoadOptions(max_active=1, offload_checkpoints=1), backend="cuda")
    try:
        engine = running.engine
        residency = engine.scheduler.residency
        residency.free_snapshot_rows[:] = residency.free_snapshot_rows[:1]  # one snapshot row
        index = residency.checkpoints
        assert index is not None
        _served(engine, "first", [*prefix, 5])
        (endpoint,) = index.endpoints()
        assert index.on_host() == []
        _served(engine, "unrelated", [*prompt_of(2, 96), 6])  # takes the row: the prefix's checkpoint moves out
        assert index.on_host() == [endpoint]
        tokens, reused = _served(engine, "later", later)
        assert (tokens, reused) == (expected, endpoint)
        assert engine.statistics().restored_checkpoints == 1
    finally:
        running.close()
