"""The host tier of the prefix cache on the CUDA backend: pinned host slots and copies on the graphs' stream.

A tiny synthetic core with ``sm_90a`` kernels is built once per module. Then: pages moved to pinned
host slots and back, all enqueued before one drain, arrive exactly (a swap through the host only works
when each copy runs in the order it was issued); a copy issued between two graph launches sees the
first launch's cache writes and precedes the second's; and serving with a device cache of one request
at full context restores an offloaded shared prefix and produces exactly the tokens of the same core
served without offload.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings, VerifiedCore
from helios_core.runtime.offload import HOST_RESIDENT
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import manifest_pb2 as mf
from tests.runtime.engine_harness import chain_keys, tokens_and_reuse

from .harness import build_gpu_core

NAMESPACE = "helios-tests/gpu-offload"
PAGE_TOKENS = 16
CONTEXT = 256
DEVICE_PAGES = CONTEXT // PAGE_TOKENS
PREFIX = [(37 * i + 11) % 200 + 20 for i in range(208)]  # 13 complete pages

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-offload", NAMESPACE,
        "--max-rows", "2", "--prefill-tokens", "16,64", "--context", str(CONTEXT), "--page-tokens", str(PAGE_TOKENS),
    )  # fmt: skip


def _planes(verified: VerifiedCore) -> list[str]:
    return [b.name for b in verified.contract.execution.buffers if b.role == mf.BUFFER_ROLE_CACHE_PLANE]


def test_pages_swapped_through_pinned_host_slots_arrive_exactly(verified: VerifiedCore) -> None:
    backend = CudaBackend(verified.contract, verified.core, cache_pages=32, state_rows=4, frames=2)
    try:
        backend.reserve_host_pages(4)
        rng = np.random.default_rng(3)
        before = {}
        for name in _planes(verified):
            values = backend.download(name)
            values = rng.integers(0, 2**16, values.shape).astype(values.dtype)
            backend.upload(name, values)
            before[name] = values
        backend.copy_page_to_host(5, 2)  # all enqueued before one drain: only stream order makes this a swap
        backend.copy_page_to_host(9, 3)
        backend.copy_page_to_device(2, 9)
        backend.copy_page_to_device(3, 5)
        backend.copy_page_to_host(9, 2)  # overwrites slot 2 after the copy that read it
        backend.copy_page_to_device(2, 11)
        backend.drain()
        for name, want in before.items():
            got = backend.download(name)
            expected = want.copy()
            expected[5], expected[9], expected[11] = want[9], want[5], want[5]
            np.testing.assert_array_equal(got, expected)
        with pytest.raises(ValueError, match="outside"):
            backend.copy_page_to_host(32, 0)
        with pytest.raises(ValueError, match="outside"):
            backend.copy_page_to_device(4, 0)
    finally:
        backend.close()


def _serve(gpu_core: tuple[Path, TrustSettings], offload_pages: int) -> RunningModel:
    return start(
        gpu_core[0],
        gpu_core[1],
        LoadOptions(max_active=1, cache_pages=DEVICE_PAGES, offload_pages=offload_pages),
        backend="cuda",
    )


def _tokens(running: RunningModel, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    return tokens_and_reuse(running.engine, request_id, prompt, 12)


FIRST = [*PREFIX, 3, 4, 5, 6, 7, 8, 9, 10]
LATER = [*PREFIX, 90, 91, 92, 93, 94, 95, 96, 97]
UNRELATED = [(11 * i + 5) % 150 + 60 for i in range(230)]


def test_serving_restores_an_offloaded_prefix_with_the_tokens_of_a_run_without_offload(
    gpu_core: tuple[Path, TrustSettings],
) -> None:
    plain = _serve(gpu_core, 0)
    try:
        expected, reused = _tokens(plain, "solo", LATER)
        assert reused == 0
    finally:
        plain.close()
    running = _serve(gpu_core, 32)
    try:
        allocator = running.engine.allocator
        _tokens(running, "first", FIRST)
        _tokens(running, "unrelated", UNRELATED)  # evicts the prefix into pinned host memory
        on_host = sum(allocator.location(key) == HOST_RESIDENT for key in chain_keys(allocator, PREFIX))
        assert on_host >= 10
        before = running.engine.statistics().restored_pages
        tokens, reused = _tokens(running, "later", LATER)
        assert tokens == expected
        assert reused == len(PREFIX)
        assert running.engine.statistics().restored_pages - before == on_host
        allocator.check()
    finally:
        running.close()
