"""Tests of the numpy reference kernels against independent straightforward computations."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_core.backends import reference_kernels as rk


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# embedding, rmsnorm, elementwise
# ------------------------------------------------------------------------------------------------


def test_embedding_dtypes() -> None:
    rng = _rng(0)
    table = _randn(rng, 10, 6)
    ids = np.array([3, 0, 9, 3], dtype=np.int32)
    out = rk.embedding(table, ids)
    assert out.dtype == np.float32 and out.shape == (4, 6)
    assert np.array_equal(out, table[ids])
    half = table.astype(np.float16)
    assert np.array_equal(rk.embedding(half, ids), half[ids].astype(np.float32))
    bf16 = (table.view(np.uint32) >> 16).astype(np.uint16)  # truncation to bfloat16
    expected = (bf16.astype(np.uint32) << 16).view(np.float32)[ids]
    got = rk.embedding(bf16, ids)
    assert np.array_equal(got, expected)
    assert np.allclose(got, table[ids], rtol=1e-2)


def test_embedding_rejects_bad_ids() -> None:
    table = np.zeros((5, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="ids"):
        rk.embedding(table, np.array([5], dtype=np.int32))
    with pytest.raises(ValueError, match="ids"):
        rk.embedding(table, np.array([-1], dtype=np.int32))
    with pytest.raises(ValueError, match="table"):
        rk.embedding(np.zeros((5, 2), dtype=np.int32), np.array([0], dtype=np.int32))


def test_rmsnorm_matches_float64_and_is_row_independent() -> None:
    rng = _rng(1)
    x = _randn(rng, 37, 5001, scale=3.0)
    w = _randn(rng, 5001)
    out = rk.rmsnorm(x, w, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6)
    for t in (0, 5, 36):
        assert np.array_equal(rk.rmsnorm(x[t : t + 1], w, 1e-5)[0], out[t])
    with pytest.raises(ValueError, match="weight"):
        rk.rmsnorm(x, w[:-1], 1e-5)


def test_silu_mul_add_gather() -> None:
    rng = _rng(2)
    g = _randn(rng, 4, 9, scale=10.0)
    g[0, 0] = -200.0  # exp overflow path
    u = _randn(rng, 4, 9)
    g64 = g.astype(np.float64)
    ref = g64 / (1.0 + np.exp(-g64)) * u
    np.testing.assert_allclose(rk.silu_mul(g, u), ref, rtol=1e-6, atol=1e-30)
    assert rk.silu_mul(g, u)[0, 0] == 0.0
    with pytest.raises(ValueError):
        rk.silu_mul(g, u[:, :3])
    bias = _randn(rng, 9)
    assert np.array_equal(rk.add(g, bias), g + bias)
    with pytest.raises(ValueError):
        rk.add(bias, g)
    got = rk.gather_rows(g, np.array([3, -1, 0]))
    assert np.array_equal(got, np.stack([g[3], np.zeros(9, np.float32), g[0]]))


# ------------------------------------------------------------------------------------------------
# linear
# ------------------------------------------------------------------------------------------------

LINEAR_SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]  # (K, N)
BATCH_SIZES = [1, 2, 3, 7, 16, 64, 256]


def test_linear_matches_float64() -> None:
    rng = _rng(3)
    x = _randn(rng, 5, 300)
    w = _randn(rng, 200, 300, scale=0.05)
    out = rk.linear(x, w)
    assert out.shape == (5, 200) and out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-4, atol=1e-5)
    assert rk.linear(x[:0], w).shape == (0, 200)
    with pytest.raises(ValueError, match="weight"):
        rk.linear(x, w[:, :-1])


@pytest.mark.parametrize(("k", "n"), LINEAR_SHAPES)
def test_linear_rows_are_bit_identical_across_batch_sizes(k: int, n: int) -> None:
    rng = _rng(k + n)
    w = _randn(rng, n, k, scale=0.05)
    probe = _randn(rng, k)
    alone = rk.linear(probe[None, :], w)[0]
    # one sgemv per row: equal to numpy's own matrix-vector product as well
    assert np.array_equal(alone, w @ probe)
    for t in BATCH_SIZES:
        batch = _randn(rng, t, k, scale=3.0)
        where = sorted({0, t // 2, t - 1})
        batch[where] = probe
        out = rk.linear(batch, w)
        for i in where:
            assert np.array_equal(out[i], alone), f"T={t}, row {i} differs from T=1"
    # a misaligned input buffer gives the same bits
    buffer = np.empty(k + 3, dtype=np.float32)[3:]
    buffer[:] = probe
    assert np.array_equal(rk.linear(buffer[None, :], w)[0], alone)


# ------------------------------------------------------------------------------------------------
# rope
# ------------------------------------------------------------------------------------------------


def _meta_llama3_scaling(freqs: list[float], sc: rk.FrequencyBandScaling) -> list[float]:
    """Meta's Llama 3.1 ``apply_scaling``, transcribed literally (scalar Python floats)."""
    low_freq_wavelen = sc.original_max_position / sc.low_freq_factor
    high_freq_wavelen = sc.original_max_position / sc.high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / sc.factor)
        else:
            smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (
                sc.high_freq_factor - sc.low_freq_factor
            )
            new_freqs.append((1 - smooth) * freq / sc.factor + smooth * freq)
    return new_freqs


LLAMA31 = rk.FrequencyBandScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


def test_rope_inv_freq_llama3_hand_computed() -> None:
    base = [1.0 / (500000.0 ** (2 * i / 128)) for i in range(64)]
    plain = rk.rope_inv_freq(128, 500000.0)
    np.testing.assert_allclose(plain, base, rtol=1e-15)
    scaled = rk.rope_inv_freq(128, 500000.0, LLAMA31)
    np.testing.assert_allclose(scaled, _meta_llama3_scaling(base, LLAMA31), rtol=1e-15)
    # all three regimes occur: unchanged high frequencies, /factor low ones, smoothed in between
    assert scaled[0] == plain[0]
    assert scaled[63] == plain[63] / 8.0
    medium = [i for i in range(64) if scaled[i] != plain[i] and scaled[i] != plain[i] / 8.0]
    assert medium, "expected smoothed frequencies"
    wavelen = 2 * math.pi / plain[medium[0]]
    smooth = (8192 / wavelen - 1.0) / 3.0
    assert scaled[medium[0]] == pytest.approx((1 - smooth) * plain[medium[0]] / 8 + smooth * plain[medium[0]])
    with pytest.raises(ValueError):
        rk.rope_inv_freq(128, 500000.0, rk.FrequencyBandScaling(8.0, 4.0, 1.0, 8192))


def test_rope_matches_rotation_loop() -> None:
    rng = _rng(4)
    x = _randn(rng, 5, 3, 8)
    pos = np.array([0, 1, 7, 100, 4095], dtype=np.int32)
    out = rk.rope(x, pos, 10000.0, "interleaved")
    ref = np.empty_like(x, dtype=np.float64)
    for t in range(5):
        for i in range(4):
            a = pos[t] * 10000.0 ** (-2 * i / 8)
            c, s = math.cos(a), math.sin(a)
            x0, x1 = x[t, :, 2 * i].astype(np.float64), x[t, :, 2 * i + 1].astype(np.float64)
            ref[t, :, 2 * i] = x0 * c - x1 * s
            ref[t, :, 2 * i + 1] = x0 * s + x1 * c
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert np.array_equal(out[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize("scaling", [None, LLAMA31])
def test_rope_interleaved_equals_half_under_permutation(scaling: rk.FrequencyBandScaling | None) -> None:
    rng = _rng(5)
    hd = 64
    x = _randn(rng, 9, 4, hd)
    pos = rng.integers(0, 20000, size=9).astype(np.int32)
    # half layout index j <-> interleaved 2j, j + hd/2 <-> 2j + 1
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    inter = rk.rope(x, pos, 500000.0, "interleaved", scaling)
    half = rk.rope(x[..., perm], pos, 500000.0, "half", scaling)
    assert np.array_equal(half, inter[..., perm])


def test_rope_partial_dims_and_row_independence() -> None:
    rng = _rng(6)
    x = _randn(rng, 13, 2, 10)
    pos = rng.integers(0, 5000, size=13).astype(np.int32)
    out = rk.rope(x, pos, 10000.0, "half", rotary_dim=6)
    assert np.array_equal(out[..., 6:], x[..., 6:])
    full = rk.rope(x[..., :6], pos, 10000.0, "half")
    assert np.array_equal(out[..., :6], full)
    for t in (0, 6, 12):
        assert np.array_equal(rk.rope(x[t : t + 1], pos[t : t + 1], 10000.0, "half", rotary_dim=6)[0], out[t])
    with pytest.raises(ValueError, match="positions"):
        rk.rope(x, pos[:-1], 10000.0)
    with pytest.raises(ValueError, match="style"):
        rk.rope(x, pos, 10000.0, "bogus")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# KV cache and paged attention
# ------------------------------------------------------------------------------------------------

PAGES, PAGE_TOKENS, KVH, HEADS, HD = 24, 4, 2, 6, 16


def _planes() -> tuple[np.ndarray, np.ndarray]:
    shape = (PAGES, PAGE_TOKENS, KVH, HD)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def _fill(k_plane: np.ndarray, v_plane: np.ndarray, pages: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    n = keys.shape[0]
    p = np.arange(n)
    slots = pages[p // PAGE_TOKENS].astype(np.int64) * PAGE_TOKENS + p % PAGE_TOKENS
    rk.kv_cache_write(k_plane, v_plane, keys, values, slots)


def _loop_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """One token: q [h, hd], keys/values [n, kvh, hd] -> [h, hd], float64 loops."""
    h = q.shape[0]
    group = h // keys.shape[1]
    out = np.zeros((h, q.shape[1]))
    for j in range(h):
        kv = j // group
        scores = [scale * float(np.dot(q[j].astype(np.float64), keys[p, kv])) for p in range(keys.shape[0])]
        m = max(scores)
        e = [math.exp(s - m) for s in scores]
        total = sum(e)
        for p in range(keys.shape[0]):
            out[j] += e[p] / total * values[p, kv].astype(np.float64)
    return out


def test_kv_cache_write() -> None:
    k_plane, v_plane = _planes()
    rng = _rng(7)
    k = _randn(rng, 3, KVH, HD)
    v = _randn(rng, 3, KVH, HD)
    rk.kv_cache_write(k_plane, v_plane, k, v, np.array([5, -1, 2 * PAGE_TOKENS + 3], dtype=np.int64))
    assert np.array_equal(k_plane[1, 1], k[0]) and np.array_equal(v_plane[1, 1], v[0])
    assert np.array_equal(k_plane[2, 3], k[2]) and np.array_equal(v_plane[2, 3], v[2])
    assert np.count_nonzero(k_plane) == 2 * KVH * HD
    with pytest.raises(ValueError, match="same slot"):
        rk.kv_cache_write(k_plane, v_plane, k, v, np.array([1, 1, 2]))
    with pytest.raises(ValueError, match="out of range"):
        rk.kv_cache_write(k_plane, v_plane, k, v, np.array([0, 1, PAGES * PAGE_TOKENS]))
    with pytest.raises(ValueError, match="k/v"):
        rk.kv_cache_write(k_plane, v_plane, k[:, :1], v[:, :1], np.array([0, 1, 2]))


def test_paged_attention_shuffled_pages_equal_contiguous_and_loop_reference() -> None:
    rng = _rng(8)
    n = 21
    keys, values = _randn(rng, n, KVH, HD), _randn(rng, n, KVH, HD)
    q = _randn(rng, n, HEADS, HD)
    pos = np.arange(n, dtype=np.int32)
    rows = np.zeros(n, dtype=np.int32)
    scale = 1.0 / math.sqrt(HD)
    results = []
    for pages in (np.arange(6), rng.permutation(PAGES)[:6]):
        k_plane, v_plane = _planes()
        _fill(k_plane, v_plane, pages, keys, values)
        table = np.full((1, 8), -1, dtype=np.int32)
        table[0, :6] = pages
        results.append(rk.paged_attention(q, k_plane, v_plane, table, rows, pos, scale))
    assert np.array_equal(results[0], results[1])
    for t in range(n):
        ref = _loop_attention(q[t], keys[: t + 1], values[: t + 1], scale)
        np.testing.assert_allclose(results[0][t], ref, rtol=1e-5, atol=1e-6)


def test_paged_attention_mixed_batch_equals_separate_runs() -> None:
    rng = _rng(9)
    k_plane, v_plane = _planes()
    lengths = [6, 10, 8]
    order = rng.permutation(PAGES)
    table = np.full((3, 4), -1, dtype=np.int32)
    table[0, :2], table[1, :3], table[2, :2] = order[:2], order[2:5], order[5:7]
    for r, length in enumerate(lengths):
        _fill(k_plane, v_plane, table[r], _randn(rng, length, KVH, HD), _randn(rng, length, KVH, HD))
    # row 0: prefill of positions 0..5, row 1: decode at 9, row 2: chunked prefill 3..7, one pad
    token_row = np.array([0, 0, 0, 0, 0, 0, 1, -1, 2, 2, 2, 2, 2], dtype=np.int32)
    token_pos = np.array([0, 1, 2, 3, 4, 5, 9, 0, 3, 4, 5, 6, 7], dtype=np.int32)
    q = _randn(rng, token_row.size, HEADS, HD)
    scale = 0.25
    mixed = rk.paged_attention(q, k_plane, v_plane, table, token_row, token_pos, scale)
    assert np.array_equal(mixed[7], np.zeros((HEADS, HD), np.float32))
    for t in range(token_row.size):
        alone = rk.paged_attention(
            q[t : t + 1], k_plane, v_plane, table, token_row[t : t + 1], token_pos[t : t + 1], scale
        )
        assert np.array_equal(alone[0], mixed[t]), f"token {t}"
    for r in range(3):
        sel = token_row == r
        per_request = rk.paged_attention(q[sel], k_plane, v_plane, table, token_row[sel], token_pos[sel], scale)
        assert np.array_equal(per_request, mixed[sel])
    # and the values are right
    seq_k = k_plane[table[1, :3]].reshape(-1, KVH, HD)[:10]
    seq_v = v_plane[table[1, :3]].reshape(-1, KVH, HD)[:10]
    np.testing.assert_allclose(mixed[6], _loop_attention(q[6], seq_k, seq_v, scale), rtol=1e-5, atol=1e-6)


def test_paged_attention_validation() -> None:
    k_plane, v_plane = _planes()
    q = np.zeros((1, HEADS, HD), np.float32)
    table = np.array([[0, -1]], dtype=np.int32)
    one = np.array([0], dtype=np.int32)
    with pytest.raises(ValueError, match="page_table"):
        rk.paged_attention(q, k_plane, v_plane, table, one, np.array([PAGE_TOKENS], np.int32), 1.0)
    with pytest.raises(ValueError, match="token_position"):
        rk.paged_attention(q, k_plane, v_plane, table, one, np.array([2 * PAGE_TOKENS], np.int32), 1.0)
    with pytest.raises(ValueError, match="token_row"):
        rk.paged_attention(q, k_plane, v_plane, table, np.array([1], np.int32), one, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        rk.paged_attention(np.zeros((1, 5, HD), np.float32), k_plane, v_plane, table, one, one, 1.0)


# ------------------------------------------------------------------------------------------------
# row copies
# ------------------------------------------------------------------------------------------------


def test_copy_pages_and_state_rows() -> None:
    plane = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
    before = plane.copy()
    rk.copy_pages(plane, np.array([0, 1, 4]), np.array([1, 0, -1]))  # swap reads before writes
    assert np.array_equal(plane[0], before[1]) and np.array_equal(plane[1], before[0])
    assert np.array_equal(plane[2:], before[2:])
    state = np.arange(8, dtype=np.int64).reshape(4, 2)
    rk.copy_state_rows(state, np.array([3]), np.array([0]))
    assert state[0].tolist() == [6, 7]
    with pytest.raises(ValueError, match="twice"):
        rk.copy_state_rows(state, np.array([1, 2]), np.array([0, 0]))
    with pytest.raises(ValueError, match="out of range"):
        rk.copy_pages(plane, np.array([5]), np.array([0]))
    dst = np.zeros((3, 2), np.float32)
    rk.copy_rows(dst, np.array([2, 0]), src=np.ones((2, 2), np.float32))
    assert dst.tolist() == [[1, 1], [0, 0], [1, 1]]


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------


def _params(rows: int, vocab: int, **overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "temperature": np.ones(rows, np.float32),
        "top_k": np.zeros(rows, np.int32),
        "top_p": np.ones(rows, np.float32),
        "min_p": np.zeros(rows, np.float32),
        "repetition_penalty": np.ones(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32),
        "presence_penalty": np.zeros(rows, np.float32),
        "prompt_presence": np.zeros((rows, vocab), np.uint8),
        "output_counts": np.zeros((rows, vocab), np.int32),
        "seed": np.arange(rows, dtype=np.uint64),
        "step": np.zeros(rows, np.int64),
        "vocab_limit": vocab,
    }
    for key, value in overrides.items():
        params[key] = value if key == "vocab_limit" or np.ndim(value) else np.full(rows, value)
    return params


def _take_rows(params: dict[str, Any], index: np.ndarray) -> dict[str, Any]:
    return {k: (v if k in ("vocab_limit", "top_n") else np.asarray(v)[index]) for k, v in params.items()}


def test_splitmix64_reference_vector() -> None:
    # SplitMix64 seeded with 1234567: the published first outputs of Vigna's splitmix64.c
    got = rk.splitmix64(np.full(5, 1234567, dtype=np.uint64), np.arange(5, dtype=np.int64))
    assert got.tolist() == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    u = rk.counter_uniform(np.array([1, 1, 2], np.uint64), np.array([0, 1, 0], np.int64))
    assert np.all((u >= 0) & (u < 1)) and len(set(u.tolist())) == 3


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    rng = _rng(10)
    logits = _randn(rng, 6, 50)
    logits[2, [7, 30]] = 10.0  # a tie
    res = rk.sample(logits, **_params(6, 50, temperature=0.0))
    assert res.ids.dtype == np.int32
    assert res.ids.tolist() == np.argmax(logits, axis=1).tolist()
    assert res.ids[2] == 7
    assert np.array_equal(rk.argmax_rows(logits), res.ids)
    top1 = rk.sample(logits, **_params(6, 50, top_k=1, temperature=1.0))
    assert np.array_equal(top1.ids, res.ids)


def test_seeded_sampling_independent_of_batch_and_order() -> None:
    rng = _rng(11)
    rows, vocab = 12, 300
    logits = _randn(rng, rows, vocab, scale=2.0)
    params = _params(
        rows,
        vocab,
        temperature=rng.uniform(0.3, 1.5, rows).astype(np.float32),
        top_k=rng.choice([0, 5, 50], rows).astype(np.int32),
        top_p=rng.choice([1.0, 0.9, 0.5], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.05], rows).astype(np.float32),
        seed=rng.integers(0, 2**63, rows).astype(np.uint64),
        step=rng.integers(0, 1000, rows).astype(np.int64),
    )
    full = rk.sample(logits, top_n=3, **params)
    perm = rng.permutation(rows)
    shuffled = rk.sample(logits[perm], top_n=3, **_take_rows(params, perm))
    assert np.array_equal(shuffled.ids, full.ids[perm])
    assert np.array_equal(shuffled.logprobs, full.logprobs[perm])
    for r in (0, 5, 11):
        alone = rk.sample(logits[r : r + 1], top_n=3, **_take_rows(params, np.array([r])))
        assert alone.ids[0] == full.ids[r]
        assert np.array_equal(alone.top_ids[0], full.top_ids[r])
    # a different step changes draws for at least some rows
    moved = dict(params, step=params["step"] + 1)
    assert not np.array_equal(rk.sample(logits, **moved).ids, full.ids)


def test_sampling_path_independent_of_sort_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = _rng(12)
    rows, vocab = 16, 4000
    logits = _randn(rng, rows, vocab, scale=1.0)
    params = _params(
        rows,
        vocab,
        temperature=rng.uniform(0.5, 3.0, rows).astype(np.float32),
        top_k=rng.choice([0, 3, 100, 3000], rows).astype(np.int32),
        top_p=rng.choice([1.0, 0.95, 0.3], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.001, 0.5], rows).astype(np.float32),
        seed=np.arange(rows, dtype=np.uint64) * 7919,
    )
    default = rk.sample(logits, **params).ids
    for prefix in (1, 10**9):
        monkeypatch.setattr(rk, "_SAMPLE_PREFIX", prefix)
        assert np.array_equal(rk.sample(logits, **params).ids, default)


def _naive_draw(row: np.ndarray, t: float, k: int, p: float, m: float, u: float) -> int:
    """The documented algorithm, written plainly with a full sort."""
    w = np.exp((row.astype(np.float64) - row.max()) / t)
    order = np.lexsort((np.arange(w.size), -w))
    order = order[w[order] > 0]
    keep = order.size
    if 0 < k < keep:
        keep = k
    top_k_mass = np.where(np.isin(np.arange(w.size), order[:keep]), w, 0.0).sum()
    cumulative = np.cumsum(w[order])
    if p < 1.0:
        for i in range(order.size):
            if cumulative[i] >= p * top_k_mass:
                keep = min(keep, i + 1)
                break
    if m > 0.0:
        keep = min(keep, int(np.count_nonzero(w[order] >= m)))
    total = np.where(np.isin(np.arange(w.size), order[:keep]), w, 0.0).sum()
    for i in range(keep):
        if cumulative[i] > u * total:
            return int(order[i])
    return int(order[keep - 1])


def test_sampling_matches_plain_full_sort_algorithm() -> None:
    rng = _rng(14)
    rows, vocab = 40, 700
    logits = _randn(rng, rows, vocab, scale=2.0)
    logits[:, ::7] = -np.inf
    params = _params(
        rows,
        vocab,
        temperature=rng.uniform(0.2, 2.0, rows).astype(np.float32),
        top_k=rng.choice([0, 1, 4, 200], rows).astype(np.int32),
        top_p=rng.choice([1.0, 0.9, 0.4], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.01, 0.2], rows).astype(np.float32),
        seed=rng.integers(0, 2**63, rows).astype(np.uint64),
        step=rng.integers(0, 99, rows).astype(np.int64),
    )
    ids = rk.sample(logits, **params).ids
    uniforms = rk.counter_uniform(params["seed"], params["step"])
    for r in range(rows):
        expected = _naive_draw(
            logits[r],
            float(params["temperature"][r]),
            int(params["top_k"][r]),
            float(params["top_p"][r]),
            float(params["min_p"][r]),
            float(uniforms[r]),
        )
        assert ids[r] == expected, r


def test_temperature_one_sampling_matches_distribution() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    draws = 5000
    logits = np.tile(np.log(probs).astype(np.float32), (draws, 1))
    res = rk.sample(logits, **_params(draws, 4, seed=np.full(draws, 42, np.uint64), step=np.arange(draws)))
    counts = np.bincount(res.ids, minlength=4)
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, chi2)  # 3 degrees of freedom, p = 0.001
    np.testing.assert_allclose(np.exp(res.logprobs), probs[res.ids], rtol=1e-6)


def test_top_p_and_min_p_semantics() -> None:
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    draws = 400
    logits = np.tile(np.log(probs).astype(np.float32), (draws, 1))
    steps = np.arange(draws)
    kept = {
        "top_p": (0.75, {1, 3}),  # 0.5 < 0.75 <= 0.5 + 0.3
        "min_p": (0.35, {1, 3}),  # p >= 0.35 * 0.5
    }
    for name, (value, allowed) in kept.items():
        res = rk.sample(logits, **_params(draws, 4, step=steps, **{name: value}))
        assert set(res.ids.tolist()) == allowed, name
    res = rk.sample(logits, **_params(draws, 4, step=steps, top_p=0.45))
    assert set(res.ids.tolist()) == {1}
    res = rk.sample(logits, **_params(draws, 4, step=steps, top_k=3, top_p=0.9))
    # top-3 mass 0.95; 0.5 + 0.3 = 0.8 < 0.9 * 0.95 -> the third (id 2) is kept too
    assert set(res.ids.tolist()) == {1, 2, 3}


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 130),
    data=st.data(),
)
def test_masked_ids_are_never_sampled(vocab: int, data: st.DataObject) -> None:
    seed = data.draw(st.integers(0, 2**64 - 1))
    rng = _rng(seed % 2**32)
    rows = 3
    words = -(-vocab // 32)
    mask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    allowed = rk.unpack_allowed_mask(mask, vocab)
    for r in range(rows):
        if not allowed[r].any():
            allowed_id = int(rng.integers(0, vocab))
            mask[r, allowed_id // 32] |= (
                np.int32(1 << (allowed_id % 32)) if allowed_id % 32 < 31 else np.int32(-(2**31))
            )
    allowed = rk.unpack_allowed_mask(mask, vocab)
    constrained = np.array([1, 1, 0], np.uint8)
    logits = _randn(rng, rows, vocab, scale=data.draw(st.sampled_from([0.1, 3.0, 30.0])))
    params = _params(
        rows,
        vocab,
        temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0, 4.0])),
        top_k=data.draw(st.sampled_from([0, 1, 5])),
        top_p=data.draw(st.sampled_from([1.0, 0.9, 0.1])),
        min_p=data.draw(st.sampled_from([0.0, 0.2])),
        seed=np.full(rows, seed, dtype=np.uint64),
        step=np.arange(rows),
    )
    res = rk.sample(logits, allowed_mask=mask, constrained=constrained, top_n=min(2, vocab), **params)
    for r in range(2):
        assert allowed[r, res.ids[r]]
    assert 0 <= res.ids[2] < vocab
    assert np.all(np.isfinite(res.logprobs))


def test_grammar_mask_bit_order() -> None:
    logits = np.zeros((2, 40), np.float32)
    mask = np.zeros((2, 2), np.int32)
    mask[0, 0] = 0b101  # ids 0 and 2
    mask[0, 1] = 1 << 3  # id 35
    mask[1, 0] = np.int32(-(2**31))  # bit 31: id 31 (row 1 is unconstrained anyway)
    out = rk.apply_grammar_mask(logits, mask, np.array([1, 0], np.uint8))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [0, 2, 35]
    assert np.all(np.isfinite(out[1]))
    assert rk.unpack_allowed_mask(mask, 40)[1].nonzero()[0].tolist() == [31]
    with pytest.raises(ValueError, match="allowed_mask"):
        rk.apply_grammar_mask(logits, mask[:, :1], np.array([1, 0], np.uint8))


def test_penalties_hand_example() -> None:
    logits = np.array([[2.0, -2.0, 1.0, -1.0, 0.5]], np.float32)
    prompt = np.array([[1, 1, 0, 0, 0]], np.uint8)
    counts = np.array([[0, 0, 2, 1, 0]], np.int32)
    out = rk.apply_penalties(logits, np.array([2.0]), np.array([0.0]), np.array([0.0]), prompt, counts)
    assert out.tolist() == [[1.0, -4.0, 0.5, -2.0, 0.5]]
    out = rk.apply_penalties(logits, np.array([1.0]), np.array([0.25]), np.array([1.0]), prompt, counts)
    assert out.tolist() == [[2.0, -2.0, -0.5, -2.25, 0.5]]
    # sample applies them before the argmax and reports logprobs of the penalised distribution
    params = _params(1, 5, temperature=0.0, repetition_penalty=4.0)
    params.update(prompt_presence=prompt, output_counts=counts)
    res = rk.sample(logits, top_n=5, **params)
    penalised = np.array([0.5, -8.0, 0.25, -4.0, 0.5])
    assert res.ids[0] == 0  # tie 0.5 at ids 0 and 4: lowest id
    expected = penalised - np.log(np.exp(penalised).sum())
    np.testing.assert_allclose(res.logprobs[0], expected[0], rtol=1e-6)
    assert res.top_ids[0].tolist() == [0, 4, 2, 3, 1]  # desc, ties by id asc
    np.testing.assert_allclose(res.top_logprobs[0], expected[[0, 4, 2, 3, 1]], rtol=1e-6)


def test_vocab_limit_and_logprobs() -> None:
    rng = _rng(13)
    rows, vocab, limit = 64, 40, 32
    logits = _randn(rng, rows, vocab)
    logits[:, limit:] = 50.0  # padding ids look most likely but must never come out
    for temperature in (0.0, 1.0, 5.0):
        res = rk.sample(logits, top_n=4, **_params(rows, vocab, temperature=temperature, vocab_limit=limit))
        assert res.ids.max() < limit
        assert res.top_ids.max() < limit
    lp = rk.log_softmax(logits, limit)
    assert np.all(np.isneginf(lp[:, limit:]))
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(res.logprobs, lp[np.arange(rows), res.ids])
    assert np.all(np.diff(res.top_logprobs, axis=1) <= 0)
    np.testing.assert_allclose(rk.log_softmax_gather(logits, res.ids, limit), res.logprobs)


def test_sample_rejects_bad_input() -> None:
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="top_p"):
        rk.sample(logits, **_params(2, 8, top_p=0.0))
    with pytest.raises(ValueError, match="vocab_limit"):
        rk.sample(logits, **_params(2, 8, vocab_limit=9))
    with pytest.raises(ValueError, match="NaN"):
        rk.sample(np.full((2, 8), np.nan, np.float32), **_params(2, 8))
    mask = np.zeros((2, 1), np.int32)
    with pytest.raises(ValueError, match="row 1 has no sampleable id after masking"):
        rk.sample(logits, allowed_mask=mask, constrained=np.array([0, 1], np.uint8), **_params(2, 8))


def test_a_row_its_mask_leaves_nothing_samples_no_id_and_the_others_sample_as_alone() -> None:
    rng = _rng(29)
    logits = _randn(rng, 3, 40)
    mask = np.zeros((3, 2), np.int32)
    mask[0, 0] = 0b1010  # row 0 may take ids 1 and 3; row 1 nothing; row 2 is unconstrained
    constrained = np.array([1, 1, 0], np.uint8)
    for temperature in (0.0, 0.8):
        params = _params(3, 40, temperature=temperature)
        res = rk.sample(logits, top_n=3, allowed_mask=mask, constrained=constrained, allow_empty_rows=True, **params)
        assert res.ids[1] == -1 and res.logprobs[1] == 0.0
        assert res.top_ids[1].tolist() == [-1, -1, -1] and res.top_logprobs[1].tolist() == [0.0, 0.0, 0.0]
        for row in (0, 2):
            alone = _params(1, 40, temperature=temperature)
            alone.update(seed=params["seed"][row : row + 1], step=params["step"][row : row + 1])
            single = rk.sample(
                logits[row : row + 1], top_n=3, allowed_mask=mask[row : row + 1],
                constrained=constrained[row : row + 1], **alone,
            )  # fmt: skip
            assert res.ids[row] == single.ids[0] and res.logprobs[row] == single.logprobs[0]
            assert res.top_ids[row].tolist() == single.top_ids[0].tolist()
        assert res.ids[0] in (1, 3)


def test_an_extreme_repetition_penalty_saturates_instead_of_overflowing() -> None:
    logits = np.array([[5.0, -5.0, 1.0, -np.inf]], np.float32)
    present = np.array([[1, 1, 0, 1]], np.uint8)
    counts = np.zeros((1, 4), np.int32)
    largest = float(np.finfo(np.float32).max)
    low, high = np.float32(1.1754944e-38), np.float32(3.4e38)
    tiny = rk.apply_penalties(logits, np.array([low]), np.array([0.0]), np.array([0.0]), present, counts)
    assert tiny.tolist() == [[largest, float(np.float32(-5.0) * low), 1.0, -np.inf]]  # 5 / low overflows
    huge = rk.apply_penalties(logits, np.array([high]), np.array([0.0]), np.array([0.0]), present, counts)
    assert huge.tolist() == [[float(np.float32(5.0) / high), -largest, 1.0, -np.inf]]  # -5 * high overflows
    params = _params(1, 4, temperature=0.7, repetition_penalty=1.1754944e-38)
    params.update(prompt_presence=present, output_counts=counts)
    assert rk.sample(logits, **params).ids.tolist() == [0]  # the saturated logit dominates; no failure


def test_update_output_counts() -> None:
    counts = np.zeros((3, 5), np.int32)
    rk.update_output_counts(counts, np.array([4, 0, 2], np.int32), np.array([1, 0, 1], np.uint8))
    rk.update_output_counts(counts, np.array([4, 9, 1], np.int32), np.array([1, 0, 1], np.uint8))
    assert counts.tolist() == [[0, 0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="ids"):
        rk.update_output_counts(counts, np.array([5, 0, 0], np.int32), np.array([1, 0, 0], np.uint8))
