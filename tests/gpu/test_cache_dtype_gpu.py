"""bfloat16 key and value cache planes on the CUDA backend against the reference backend.

A tiny ``llama-synthetic`` core built with ``--cache-dtype bf16`` (bf16 weights, ``reference,sm_90a``):

* the rotary cache write stores into bfloat16 planes the bits the reference writes (both rotate in
  float32 from float64 angles and round to nearest even; a last-place difference of the device's sine
  or cosine may move a key one bfloat16 step), and a ``paged_attention`` node over
  random bfloat16 planes agrees with the reference's (which widens the same bits exactly) to float32
  rounding;
* every decode and prefill program, run once on both backends from identical random state, and
  concurrent greedy requests served with both frames in flight, agree with the reference as the
  float32-cache core does (:mod:`tests.gpu.test_backend`'s checks, run here on this core).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.cuda_driver import Context
from helios_core.loading import TrustSettings, VerifiedCore
from helios_core.wire import manifest_pb2 as mf

from .harness import build_gpu_core, reference_node, relative_error, run_node
from .test_backend import reference_running
from .test_backend import (
    test_concurrent_greedy_requests_give_the_reference_tokens as test_concurrent_greedy_requests_with_bf16_caches,
)
from .test_backend import (
    test_every_decode_and_prefill_program_matches_the_reference as test_every_program_with_bf16_caches,
)

NAMESPACE = "helios-tests/gpu-cache-dtype"

pytestmark = pytest.mark.gpu

__all__ = [
    "reference_running",
    "test_concurrent_greedy_requests_with_bf16_caches",
    "test_every_program_with_bf16_caches",
]


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-cache-dtype", NAMESPACE,
        "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "128", "--page-tokens", "16",
        "--cache-dtype", "bf16",
    )  # fmt: skip


def test_the_core_declares_bf16_planes_and_snapshot_rows(verified: VerifiedCore) -> None:
    planes = [b for b in verified.contract.execution.buffers if b.role == mf.BUFFER_ROLE_CACHE_PLANE]
    rows = [b for b in verified.contract.execution.buffers if b.name.startswith("continuation.")]
    assert planes and rows
    assert {b.dtype for b in planes} == {mf.DTYPE_BF16}
    assert {b.dtype for b in rows} == {mf.DTYPE_BF16}


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rk.float32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))


def test_rope_cache_write_rounds_to_the_reference_bits(cuda_context: Context) -> None:
    rng = np.random.default_rng(7)
    tokens, heads, kv_heads, head_dim, pages, page_tokens = 5, 8, 2, 64, 6, 4
    arrays = {
        "qkv": rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float32),
        "positions": np.array([0, 3, 9, 17, 22], dtype=np.int32),
        "slots": np.array([1, 5, -1, 12, 23], dtype=np.int64),
        "q": np.zeros((tokens, heads, head_dim), dtype=np.float32),
        "k_plane": _bf16(rng, (pages, page_tokens, kv_heads, head_dim)),
        "v_plane": _bf16(rng, (pages, page_tokens, kv_heads, head_dim)),
    }
    attributes = {"theta": 10000.0, "style": "half"}
    got = run_node(cuda_context, "rope_kv_cache_write", arrays, attributes)
    want = reference_node("rope_kv_cache_write", arrays, attributes)
    # values copy through exactly; rotated keys round to the reference's bits unless the device's cosine
    # or sine differed in the last float32 place right at a rounding boundary (then one bf16 step apart)
    np.testing.assert_array_equal(got["v_plane"], want["v_plane"])
    got_k, want_k = rk.bf16_bits_to_float32(got["k_plane"]), rk.bf16_bits_to_float32(want["k_plane"])
    assert np.all(np.abs(got_k - want_k) <= np.abs(want_k) * 2.0**-7 + 1e-30)
    assert np.mean(got["k_plane"] == want["k_plane"]) > 0.99
    assert np.abs(got["q"] - want["q"]).max() < 1e-5
    # the padding token (slot -1) wrote nothing: its neighbours keep their random bits
    assert not np.array_equal(want["k_plane"], arrays["k_plane"])


def _attention_inputs(
    rng: np.random.Generator,
    heads: tuple[int, int, int],
    planes: tuple[int, int],
    table: np.ndarray,
    token_row: np.ndarray,
    token_position: np.ndarray,
) -> dict[str, np.ndarray]:
    """A ``paged_attention`` node's inputs but ``out``: random queries (``heads`` = query heads, KV heads, head
    size) and random bfloat16 planes of ``planes`` = (pages, page tokens), over the given table and tokens."""
    query_heads, kv_heads, head_dim = heads
    pages, page_tokens = planes
    return {
        "q": rng.standard_normal((token_row.size, query_heads, head_dim)).astype(np.float32),
        "k_plane": _bf16(rng, (pages, page_tokens, kv_heads, head_dim)),
        "v_plane": _bf16(rng, (pages, page_tokens, kv_heads, head_dim)),
        "page_table": table,
        "token_row": token_row,
        "token_position": token_position,
    }


@pytest.mark.parametrize("tokens", [3, 96], ids=["decode", "tiles"])
def test_attention_over_bf16_planes_matches_the_reference(cuda_context: Context, tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    heads, kv_heads, head_dim, page_tokens, width = 8, 2, 64, 16, 16
    rows = 1 if tokens > 3 else tokens
    pages = rows * width
    table = rng.permutation(pages).astype(np.int32).reshape(rows, width)
    if tokens > 3:  # one row's prompt chunk: the query tiles
        token_row = np.zeros(tokens, dtype=np.int32)
        token_position = np.arange(40, 40 + tokens, dtype=np.int32)
    else:
        token_row = np.arange(tokens, dtype=np.int32)
        token_position = np.array([5, 70, 200], dtype=np.int32)
    arrays = _attention_inputs(rng, (heads, kv_heads, head_dim), (pages, page_tokens), table, token_row, token_position)
    arrays["out"] = np.zeros((tokens, heads, head_dim), dtype=np.float32)
    attributes = {"scale": 0.125}
    got = run_node(cuda_context, "paged_attention", arrays, attributes)["out"]
    want = reference_node("paged_attention", arrays, attributes)["out"]
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize(("tokens", "head_dim"), [(64, 64), (64, 128), (256, 64), (256, 128)])
def test_wide_decode_attention_over_bf16_planes_matches_the_reference(
    cuda_context: Context, tokens: int, head_dim: int
) -> None:
    """A decode node wide enough for 256-position splits on two warps a program (``split_kernel_config``):
    one token a row, contexts inside one split, across split boundaries (merged) and at the table's end,
    with padding tokens."""
    rng = np.random.default_rng(tokens + head_dim)
    heads, kv_heads, page_tokens, width, pages = 32, 8, 16, 64, 96
    table = rng.integers(0, pages, (tokens, width)).astype(np.int32)  # rows may share pages: reads only
    token_row = np.arange(tokens, dtype=np.int32)
    token_row[[5, tokens - 1]] = -1  # padding
    token_position = rng.integers(0, width * page_tokens, tokens).astype(np.int32)
    token_position[:6] = [0, 96, 255, 256, 600, width * page_tokens - 1]
    arrays = _attention_inputs(rng, (heads, kv_heads, head_dim), (pages, page_tokens), table, token_row, token_position)
    arrays["out"] = np.full((tokens, heads, head_dim), np.nan, dtype=np.float32)
    attributes = {"scale": head_dim**-0.5}
    got = run_node(cuda_context, "paged_attention", arrays, attributes, repeat=2, reset=["out"])["out"]
    want = reference_node("paged_attention", arrays, attributes)["out"]
    assert np.isfinite(got).all()
    assert relative_error(got, want) < 1e-5
    assert (got[token_row < 0] == 0).all()
