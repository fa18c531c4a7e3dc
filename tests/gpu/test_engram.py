"""Engram on the GPU: an ``--engram`` core's staged rows reach the device and its tokens match the reference.

Builds a tiny bf16 ``llama-synthetic --engram`` core with ``reference,sm_90a`` kernels. The rows the host
stages for a round travel in the frame's transport copy like every transport entry, so after a round the
device copy of ``engram.rows`` equals the host staging bit for bit; greedy tokens agree with the reference
backend's (the first token of every prompt exactly, whole sequences for at least half the prompts: bf16
projections round differently near ties), and zeroing the table changes what the GPU generates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import PreparedRequest, SamplingParams
from helios_core.runtime.startup import RunningModel, start

from .harness import build_gpu_core

NAMESPACE = "helios-tests/gpu-engram"
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[(13 * p + 7 * i + 5) % 250 + 3 for i in range(9 + 5 * p)] for p in range(4)]
NEW_TOKENS = 8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-engram", NAMESPACE,
        "--engram", "--max-rows", "4", "--prefill-tokens", "16", "--context", "64", "--page-tokens", "4",
    )  # fmt: skip


def _start(gpu_core: tuple[Path, TrustSettings], backend: str) -> RunningModel:
    return start(gpu_core[0], gpu_core[1], LoadOptions(), backend=backend)


def _greedy(running: RunningModel, prompts: list[list[int]]) -> list[list[int]]:
    return [
        running.engine.generate(PreparedRequest(f"r{i}", p, NEW_TOKENS, GREEDY, ignore_eos=True)).token_ids
        for i, p in enumerate(prompts)
    ]


def test_staged_rows_reach_the_device_and_tokens_match_the_reference(gpu_core: tuple[Path, TrustSettings]) -> None:
    reference = _start(gpu_core, "reference")
    try:
        expected = _greedy(reference, PROMPTS)
    finally:
        reference.close()
    running = _start(gpu_core, "cuda")
    try:
        backend = running.model.backend
        assert isinstance(backend, CudaBackend) and running.model.engram is not None
        tokens = _greedy(running, PROMPTS)
        host = np.array(backend.transport(0)["engram.rows"], copy=True)
        assert np.any(host != 0)
        np.testing.assert_array_equal(backend.download("engram.rows", frame=0), host)
        assert [t[0] for t in tokens] == [e[0] for e in expected]
        assert sum(t == e for t, e in zip(tokens, expected, strict=True)) >= len(PROMPTS) // 2, (tokens, expected)
    finally:
        running.close()
    zeroed = _start(gpu_core, "cuda")
    try:
        assert zeroed.model.engram is not None
        zeroed.model.engram.tables[0].rows[:] = 0
        assert _greedy(zeroed, PROMPTS) != tokens
    finally:
        zeroed.close()
