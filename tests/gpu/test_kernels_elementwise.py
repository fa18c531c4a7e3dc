"""The elementwise and row kernels on the GPU match the reference adapters.

Every case draws fresh random inputs and poisons its outputs beforehand (NaN for floats, -7 for
integers) so an element a kernel fails to write shows up. Float outputs must match within a
relative error of 1e-5 (rope: 2e-4), integer outputs and row copies exactly.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from helios_core.backends.cuda_driver import Context
from tests.gpu.harness import bf16_bits, reference_node, relative_error, run_node

pytestmark = pytest.mark.gpu

POISON = -7
Arrays = dict[str, np.ndarray]


def _rng(*key: Any) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _nan(*shape: int) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def _poison(*shape: int, dtype: Any = np.int32) -> np.ndarray:
    return np.full(shape, POISON, np.int64).astype(dtype)  # uint8: 249


def _assert_close(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name}: NaN where the reference has none")
    error = relative_error(np.nan_to_num(got), np.nan_to_num(want))
    assert error <= tol, f"{name}: relative error {error:.3g} > {tol}"


def _compare(
    got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], outputs: Sequence[str], tol: float = 1e-5
) -> None:
    for name in outputs:
        if got[name].dtype == np.float32:
            _assert_close(name, got[name], want[name], tol)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _check(
    cuda: Context,
    op: str,
    arrays: Arrays,
    outputs: Sequence[str],
    attributes: Mapping[str, Any] | None = None,
    *,
    weights: Sequence[str] = (),
    tol: float = 1e-5,
) -> None:
    got = run_node(cuda, op, arrays, attributes, weights=weights)
    want = reference_node(op, arrays, attributes)
    _compare(got, want, outputs, tol)


def _run_aliased(
    cuda: Context, op: str, arrays: Arrays, attributes: Mapping[str, Any] | None, alias: Mapping[str, str]
) -> dict[str, np.ndarray]:
    """As :func:`harness.run_node`, with the arguments in ``alias`` bound to another argument's buffer."""
    return run_node(cuda, op, arrays, attributes, alias=alias)


# -- embedding, normalisation, elementwise --------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab", "hidden", "tokens", "bf16"), [(500, 576, 1, False), (97, 4096, 19, True), (1000, 1000, 7, False)]
)
def test_embedding(cuda_context: Context, vocab: int, hidden: int, tokens: int, bf16: bool) -> None:
    rng = _rng("embedding", vocab, hidden, tokens)
    table = _f32(rng, vocab, hidden)
    arrays = {
        "table": bf16_bits(table) if bf16 else table,
        "ids": rng.integers(0, vocab, size=tokens).astype(np.int32),
        "out": _nan(tokens, hidden),
    }
    arrays["ids"][0] = vocab - 1
    _check(cuda_context, "embedding", arrays, ["out"], weights=["table"])


@pytest.mark.parametrize(
    ("rows", "hidden", "weight_role", "bf16"),
    [(1, 576, True, False), (5, 1000, False, False), (3, 4096, True, True), (2, 16384, True, False)],
)
def test_rmsnorm(cuda_context: Context, rows: int, hidden: int, weight_role: bool, bf16: bool) -> None:
    rng = _rng("rmsnorm", rows, hidden)
    weight = _f32(rng, hidden)
    arrays = {
        "x": _f32(rng, rows, hidden, scale=3.0),
        "weight": bf16_bits(weight) if bf16 else weight,
        "out": _nan(rows, hidden),
    }
    _check(cuda_context, "rmsnorm", arrays, ["out"], {"eps": 1e-5}, weights=["weight"] if weight_role else ())


def test_rmsnorm_in_place(cuda_context: Context) -> None:
    rng = _rng("rmsnorm_in_place")
    arrays = {"x": _f32(rng, 4, 576), "weight": _f32(rng, 576), "out": _nan(4, 576)}
    got = _run_aliased(cuda_context, "rmsnorm", arrays, {"eps": 1e-6}, {"out": "x"})
    want = reference_node("rmsnorm", arrays, {"eps": 1e-6})
    _assert_close("x", got["x"], want["out"], 1e-5)


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 1536), (3, 5000)])
def test_silu_mul(cuda_context: Context, rows: int, width: int) -> None:
    rng = _rng("silu_mul", rows, width)
    gate = _f32(rng, rows, width, scale=4.0)
    gate[0, :4] = [-100.0, 100.0, 0.0, -20.0]
    arrays = {"gate": gate, "up": _f32(rng, rows, width), "out": _nan(rows, width)}
    _check(cuda_context, "silu_mul", arrays, ["out"])


@pytest.mark.parametrize(
    ("a", "b"),
    [((1, 576), (1, 576)), ((9, 1000), (9, 1000)), ((5, 576), (576,)), ((4, 3, 8), (4, 1, 1)), ((3, 7, 5), (7, 1))],
)
def test_add(cuda_context: Context, a: tuple[int, ...], b: tuple[int, ...]) -> None:
    rng = _rng("add", a, b)
    arrays = {"a": _f32(rng, *a), "b": _f32(rng, *b), "out": _nan(*a)}
    _check(cuda_context, "add", arrays, ["out"])


def test_add_in_place(cuda_context: Context) -> None:
    rng = _rng("add_in_place")
    arrays = {"a": _f32(rng, 6, 576), "b": _f32(rng, 6, 576), "out": _nan(6, 576)}
    got = _run_aliased(cuda_context, "add", arrays, None, {"out": "a"})
    np.testing.assert_array_equal(got["a"], arrays["a"] + arrays["b"])


# -- row selection ------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "width", "count"), [(1, 576, 1), (10, 1000, 6), (37, 64, 9)])
def test_gather_rows_float(cuda_context: Context, tokens: int, width: int, count: int) -> None:
    rng = _rng("gather_rows", tokens, width, count)
    index = rng.integers(-1, tokens, size=count).astype(np.int32)
    if count > 1:
        index[0] = -1
        index[1] = tokens - 1
    arrays = {"x": _f32(rng, tokens, width), "index": index, "out": _nan(count, width)}
    _check(cuda_context, "gather_rows", arrays, ["out"])


def test_gather_rows_three_dimensional(cuda_context: Context) -> None:
    rng = _rng("gather_rows_3d")
    arrays = {"x": _f32(rng, 6, 4, 24), "index": np.array([5, -3, 0, 2], np.int32), "out": _nan(4, 4, 24)}
    _check(cuda_context, "gather_rows", arrays, ["out"])


@pytest.mark.parametrize(("state_rows", "lanes"), [(8, 1), (16, 4), (300, 37)])
def test_gather_rows_pending_tokens(cuda_context: Context, state_rows: int, lanes: int) -> None:
    rng = _rng("gather_rows_int", state_rows, lanes)
    index = rng.permutation(state_rows)[:lanes].astype(np.int32)
    if lanes > 2:
        index[1] = -1
    arrays = {
        "x": rng.integers(0, 50000, size=(state_rows, 1)).astype(np.int32),
        "index": index,
        "out": _poison(lanes, 1),
    }
    _check(cuda_context, "gather_rows", arrays, ["out"])


@pytest.mark.parametrize("lanes", [1, 8, 37, 2500])
def test_lane_last_index(cuda_context: Context, lanes: int) -> None:
    rng = _rng("lane_last_index", lanes)
    arrays = {"query_length": rng.integers(-2, 9, size=lanes).astype(np.int32), "out": _poison(lanes)}
    _check(cuda_context, "lane_last_index", arrays, ["out"])


# -- row copies -----------------------------------------------------------------------------------


def _copy(cuda: Context, arrays: Arrays) -> None:
    """Copies are exact: rows left alone keep their poison, moved rows their bits."""
    got = run_node(cuda, "copy_rows", arrays)
    want = reference_node("copy_rows", arrays)
    np.testing.assert_array_equal(got["dst"], want["dst"])


@pytest.mark.parametrize(("src_row", "dst_row"), [(7, 2), (7, -1), (-1, 0)])
def test_copy_rows_page_into_continuation(cuda_context: Context, src_row: int, dst_row: int) -> None:
    rng = _rng("copy_pages", src_row, dst_row)
    arrays = {
        "src": _f32(rng, 12, 16, 2, 64),
        "src_rows": np.array([src_row], np.int32),
        "dst_rows": np.array([dst_row], np.int32),
        "dst": _nan(4, 16, 2, 64),
    }
    _copy(cuda_context, arrays)


def test_copy_rows_continuation_into_plane(cuda_context: Context) -> None:
    rng = _rng("copy_restore")
    arrays = {
        "src": _f32(rng, 4, 16, 3, 64),
        "src_rows": np.array([1, 3, -1], np.int32),
        "dst_rows": np.array([5, 0, 2], np.int32),
        "dst": _f32(rng, 9, 16, 3, 64),
    }
    _copy(cuda_context, arrays)


@pytest.mark.parametrize(("width", "dtype"), [(1003, np.uint8), (576, np.uint8), (1000, np.int32)])
def test_copy_rows_state(cuda_context: Context, width: int, dtype: Any) -> None:
    rng = _rng("copy_state", width, np.dtype(dtype).name)
    arrays = {
        "src": rng.integers(0, 100, size=(6, width)).astype(dtype),
        "src_rows": np.array([4, 0], np.int32),
        "dst_rows": np.array([1, 2], np.int32),
        "dst": _poison(3, width, dtype=dtype),
    }
    _copy(cuda_context, arrays)


@pytest.mark.parametrize(("lanes", "state_rows"), [(1, 4), (5, 9), (8, 300)])
def test_copy_rows_pending_token_store(cuda_context: Context, lanes: int, state_rows: int) -> None:
    rng = _rng("copy_pending", lanes, state_rows)
    rows = rng.permutation(state_rows)[:lanes].astype(np.int32)
    if lanes > 2:
        rows[-1] = -1
    arrays = {
        "src": rng.integers(0, 1000, size=(lanes, 1)).astype(np.int32),
        "dst_rows": rows,
        "when": rng.integers(0, 2, size=lanes).astype(np.uint8),
        "dst": _poison(state_rows, 1),
    }
    arrays["when"][0] = 1
    _copy(cuda_context, arrays)


def test_copy_rows_longer_flags_and_int64_rows(cuda_context: Context) -> None:
    rng = _rng("copy_flags")
    arrays = {
        "src": rng.integers(0, 1000, size=(3, 2)).astype(np.int64),
        "dst_rows": np.array([4, 0, 2], np.int32),
        "when": np.array([1, 0, 1, 1], np.uint8),
        "dst": _poison(5, 2, dtype=np.int64),
    }
    _copy(cuda_context, arrays)


def test_copy_rows_bf16_odd_width(cuda_context: Context) -> None:
    rng = _rng("copy_bf16")
    arrays = {
        "src": bf16_bits(_f32(rng, 5, 7)),
        "src_rows": np.array([4, 2], np.int32),
        "dst_rows": np.array([3, 0], np.int32),
        "dst": bf16_bits(_f32(rng, 4, 7)),
    }
    _copy(cuda_context, arrays)


def test_copy_rows_within_one_buffer_reads_every_source_first(cuda_context: Context) -> None:
    rng = _rng("copy_overlap")
    plane = _f32(rng, 6, 16, 2, 64)
    arrays = {
        "src": plane,
        "src_rows": np.array([0, 1, 2, 3], np.int32),
        "dst_rows": np.array([1, 2, 0, -1], np.int32),
        "dst": plane,
    }
    got = _run_aliased(cuda_context, "copy_rows", arrays, None, {"dst": "src"})
    want = plane.copy()
    want[[1, 2, 0]] = plane[[0, 1, 2]]
    np.testing.assert_array_equal(got["src"], want)


# -- sampling state and completion records --------------------------------------------------------


@pytest.mark.parametrize(("lanes", "state_rows", "vocab"), [(1, 4, 576), (4, 9, 1000), (8, 16, 49152)])
def test_init_sampling_state(cuda_context: Context, lanes: int, state_rows: int, vocab: int) -> None:
    rng = _rng("init_sampling_state", lanes, state_rows, vocab)
    rows = rng.permutation(state_rows)[:lanes].astype(np.int32)
    if lanes > 2:
        rows[1] = -1
    arrays = {
        "prompt_histogram": rng.integers(0, 3, size=(lanes, vocab)).astype(np.uint8),
        "rows": rows,
        "prompt_presence": rng.integers(5, 9, size=(state_rows, vocab)).astype(np.uint8),
        "output_counts": rng.integers(1, 9, size=(state_rows, vocab)).astype(np.int32),
    }
    _check(cuda_context, "init_sampling_state", arrays, ["prompt_presence", "output_counts"])


RECORD = ("out_generation", "out_emitted", "out_consumed", "out_draft_cursor", "out_reserved")


def _record(rng: np.random.Generator, lanes: int) -> Arrays:
    arrays = {name: _poison(lanes) for name in RECORD}
    arrays["generation"] = rng.integers(-1, 100, size=lanes).astype(np.int32)
    arrays["submission_sequence"] = np.array([rng.integers(0, 2**40)], np.int64)
    arrays["out_sequence"] = _poison(1, dtype=np.int64)
    return arrays


@pytest.mark.parametrize(("lanes", "tokens"), [(1, 1), (8, 64), (5, 5)])
def test_completion_lanes(cuda_context: Context, lanes: int, tokens: int) -> None:
    rng = _rng("completion_lanes", lanes, tokens)
    arrays = _record(rng, lanes)
    arrays["sample_active"] = rng.integers(0, 2, size=lanes).astype(np.uint8)
    arrays["last_index"] = rng.integers(-1, tokens, size=lanes).astype(np.int32)
    arrays["positions"] = rng.integers(0, 4000, size=tokens).astype(np.int32)
    _check(cuda_context, "completion_lanes", arrays, [*RECORD, "out_sequence"])


@pytest.mark.parametrize("lanes", [1, 6])
def test_completion_copy_lanes(cuda_context: Context, lanes: int) -> None:
    rng = _rng("completion_copy_lanes", lanes)
    arrays = _record(rng, lanes)
    arrays["consumed"] = rng.integers(0, 4000, size=lanes).astype(np.int32)
    _check(cuda_context, "completion_copy_lanes", arrays, [*RECORD, "out_sequence"])


@pytest.mark.parametrize(("rows", "pages", "page_tokens"), [(1, 4, 16), (6, 9, 16), (5, 3, 7)])
def test_tail_page(cuda_context: Context, rows: int, pages: int, page_tokens: int) -> None:
    rng = _rng("tail_page", rows, pages, page_tokens)
    consumed = rng.integers(-3, pages * page_tokens, size=rows).astype(np.int32)
    consumed[0] = 2 * page_tokens if rows > 1 else 5
    arrays = {
        "page_table": rng.integers(0, 500, size=(rows, pages)).astype(np.int32),
        "consumed": consumed,
        "out": _poison(rows),
    }
    _check(cuda_context, "tail_page", arrays, ["out"], {"page_tokens": page_tokens})


# -- rotary embedding and cache writes ------------------------------------------------------------

ROPE_CASES = [
    (1, 9, 64, "half", None, 4096),
    (5, 4, 128, "interleaved", None, 4096),
    (7, 3, 96, "half", (8.0, 1.0, 4.0, 8192.0), 100000),
    (3, 2, 80, "interleaved", (32.0, 1.0, 4.0, 8192.0), 4096),
    (4, 64, 128, "half", None, 131072),
]


@pytest.mark.parametrize(("tokens", "heads", "head_dim", "style", "band", "max_position"), ROPE_CASES)
def test_rope(
    cuda_context: Context,
    tokens: int,
    heads: int,
    head_dim: int,
    style: str,
    band: tuple[float, ...] | None,
    max_position: int,
) -> None:
    rng = _rng("rope", tokens, heads, head_dim, style)
    attributes: dict[str, Any] = {"theta": 500000.0 if band else 10000.0, "style": style}
    if band is not None:
        attributes["frequency_band_scaling"] = band
    arrays = {
        "x": _f32(rng, tokens, heads, head_dim),
        "positions": rng.integers(0, max_position, size=tokens).astype(np.int32),
        "out": _nan(tokens, heads, head_dim),
    }
    _check(cuda_context, "rope", arrays, ["out"], attributes, tol=2e-4)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_in_place(cuda_context: Context, style: str) -> None:
    rng = _rng("rope_in_place", style)
    attributes = {"theta": 10000.0, "style": style}
    arrays = {
        "x": _f32(rng, 3, 8, 64),
        "positions": np.array([0, 17, 4095], np.int32),
        "out": _nan(3, 8, 64),
    }
    got = _run_aliased(cuda_context, "rope", arrays, attributes, {"out": "x"})
    want = reference_node("rope", arrays, attributes)
    _assert_close("x", got["x"], want["out"], 2e-4)


@pytest.mark.parametrize(
    ("tokens", "pages", "page_tokens", "kv_heads", "head_dim"),
    [(1, 4, 16, 2, 64), (9, 6, 16, 3, 32), (5, 3, 4, 1, 576)],
)
def test_kv_cache_write(
    cuda_context: Context, tokens: int, pages: int, page_tokens: int, kv_heads: int, head_dim: int
) -> None:
    rng = _rng("kv_cache_write", tokens, pages, page_tokens, kv_heads, head_dim)
    slots = rng.permutation(pages * page_tokens)[:tokens].astype(np.int64)
    if tokens > 2:
        slots[1] = -1
    arrays = {
        "k": _f32(rng, tokens, kv_heads, head_dim),
        "v": _f32(rng, tokens, kv_heads, head_dim),
        "slots": slots,
        "k_plane": _nan(pages, page_tokens, kv_heads, head_dim),
        "v_plane": _nan(pages, page_tokens, kv_heads, head_dim),
    }
    got = run_node(cuda_context, "kv_cache_write", arrays)
    want = reference_node("kv_cache_write", arrays)
    for name in ("k_plane", "v_plane"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
