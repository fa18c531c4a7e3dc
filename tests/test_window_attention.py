"""The reference ``paged_attention`` kernel with a sliding window (the ``window`` attribute)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from helios_core.backends import reference_kernels as rk

PAGE_TOKENS, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 4, 8
F32 = npt.NDArray[np.float32]


def _cache(rng: np.random.Generator, pages: int) -> tuple[F32, F32]:
    shape = (pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def _expected(q: F32, keys: F32, values: F32, position: int, window: int) -> F32:
    """One token at ``position`` over contiguous ``keys/values [positions, kvh, hd]``."""
    first = max(position - window + 1, 0) if window else 0
    out = np.zeros((HEADS, HEAD_DIM), dtype=np.float32)
    for head in range(HEADS):
        kv = head // (HEADS // KV_HEADS)
        scores = keys[first : position + 1, kv] @ q[head] * np.float32(HEAD_DIM**-0.5)
        weights = np.exp(scores - scores.max())
        out[head] = (weights / weights.sum()) @ values[first : position + 1, kv]
    return out


@pytest.mark.parametrize("window", [1, 5, 8, 64])
def test_each_token_attends_the_last_window_positions(window: int) -> None:
    rng = np.random.default_rng(3)
    k_plane, v_plane = _cache(rng, 12)
    order = np.array([7, 2, 9, 0, 4, 11], dtype=np.int64)  # a row's pages, scattered
    table = order[None, :]
    positions = np.array([0, 3, 4, 9, 17, 22, 23], dtype=np.int64)
    q = rng.standard_normal((positions.size, HEADS, HEAD_DIM), dtype=np.float32)
    got = rk.paged_attention(
        q, k_plane, v_plane, table, np.zeros(positions.size, dtype=np.int64), positions, HEAD_DIM**-0.5, window=window
    )
    keys = k_plane[order].reshape(-1, KV_HEADS, HEAD_DIM)
    values = v_plane[order].reshape(-1, KV_HEADS, HEAD_DIM)
    for t, position in enumerate(positions.tolist()):
        np.testing.assert_allclose(got[t], _expected(q[t], keys, values, position, window), rtol=1e-5, atol=1e-6)


def test_page_entries_before_every_window_are_never_read() -> None:
    rng = np.random.default_rng(4)
    k_plane, v_plane = _cache(rng, 8)
    table = np.array([[-1, -1, -1, 5, 6, 1]], dtype=np.int64)  # pages 0..2 released: positions 0..11
    positions = np.array([17, 18, 23], dtype=np.int64)  # window 6: the earliest attended position is 12
    q = rng.standard_normal((3, HEADS, HEAD_DIM), dtype=np.float32)
    rows = np.zeros(3, dtype=np.int64)
    windowed = rk.paged_attention(q, k_plane, v_plane, table, rows, positions, 0.5, window=6)
    assert np.isfinite(windowed).all()
    with pytest.raises(ValueError, match=r"page_table: row 0 names a page outside \[0, 8\)"):
        rk.paged_attention(q, k_plane, v_plane, table, rows, positions, 0.5)  # unlimited attention reads them


def test_window_zero_is_unlimited_bit_for_bit() -> None:
    rng = np.random.default_rng(5)
    k_plane, v_plane = _cache(rng, 6)
    table = np.array([[3, 1, 0, 5, 2, 4]], dtype=np.int64)
    positions = np.arange(24, dtype=np.int64)
    q = rng.standard_normal((24, HEADS, HEAD_DIM), dtype=np.float32)
    rows = np.zeros(24, dtype=np.int64)
    unlimited = rk.paged_attention(q, k_plane, v_plane, table, rows, positions, 0.3)
    assert np.array_equal(rk.paged_attention(q, k_plane, v_plane, table, rows, positions, 0.3, window=0), unlimited)
    assert np.array_equal(rk.paged_attention(q, k_plane, v_plane, table, rows, positions, 0.3, window=24), unlimited)


def test_a_negative_window_is_refused() -> None:
    k_plane, v_plane = _cache(np.random.default_rng(6), 2)
    q = np.zeros((1, HEADS, HEAD_DIM), dtype=np.float32)
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match=r"window: must be 0 \(unlimited\) or positive, got -2"):
        rk.paged_attention(q, k_plane, v_plane, np.array([[0]]), one, one, 1.0, window=-2)
