"""Projection, attention and rope + cache-write kernels against the reference backend, on the GPU.

Fresh random inputs at several shapes (decode rows, prefill rows, the 135M/1B/8B projection
widths, odd widths), outputs poisoned with NaN first so an unwritten element fails. Projections
round activations to bf16 for the tensor cores: relative error bounded by 1e-2 against the float32
reference; attention and the rope/cache kernels compute in float32 (float64 angles) like the
reference: 1e-5.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("triton", reason="the fused kernels are Triton kernels")

from ignition.kernels import attention, linear
from ignition.kernels.linear import Tiles
from ignition.kernels.lowering import LoweringError

from helios_core.backends.cuda_driver import Context
from tests.gpu.harness import bf16_bits, bf16_values, lower, reference_node, relative_error, run_node

PROJECTIONS = [
    # rows, N, K
    (1, 1728, 576),
    (1, 3072, 2048),
    (1, 16384, 2048),
    (2, 2048, 8192),
    (1, 6144, 4096),  # rows of 4096 inputs stream two weight rows a tile
    (2, 4096, 4096),
    (8, 2048, 8192),
    (16, 49152, 576),
    (64, 16384, 2048),
    (64, 2048, 8192),  # 64-row tiles, eight splits: two programs a multiprocessor
    (64, 576, 1536),  # the 135M down projection at 64 rows: three parts of 512 inputs
    (64, 576, 576),  # over 576 inputs: not split, the last step partial
    (128, 576, 1536),  # 64x128 tiles in three parts
    (130, 1000, 200),
    (256, 6144, 4096),
]


def _projection_case(
    rng: np.random.Generator, op: str, rows: int, n: int, k: int
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Random arrays (the output poisoned) and attributes of one projection node."""
    x_width = 2 * k if op == "silu_mul_linear_add" else k
    arrays: dict[str, np.ndarray] = {
        ("gate_up" if op == "silu_mul_linear_add" else "x"): rng.standard_normal((rows, x_width)).astype(np.float32),
        "weight": bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * k**-0.5),
        "out": np.full((rows, n), np.nan, dtype=np.float32),
    }
    attributes: dict[str, float] = {}
    if op == "rmsnorm_linear":
        arrays["norm_weight"] = rng.uniform(0.5, 1.5, k).astype(np.float32)
        attributes["eps"] = 1e-5
    if op in ("linear_add", "silu_mul_linear_add"):
        arrays["residual"] = rng.standard_normal((rows, n)).astype(np.float32)
    return arrays, attributes


@pytest.mark.parametrize(("rows", "n", "k"), PROJECTIONS)
@pytest.mark.parametrize("op", ["linear", "rmsnorm_linear", "linear_add", "silu_mul_linear_add"])
def test_projection(cuda_context: Context, op: str, rows: int, n: int, k: int) -> None:
    arrays, attributes = _projection_case(np.random.default_rng(rows * 7919 + n + k), op, rows, n, k)
    got = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"))
    want = reference_node(op, arrays, attributes)
    assert np.isfinite(got["out"]).all()
    assert relative_error(got["out"], want["out"]) < 1e-2


STREAMING = [
    # rows, N, K, tiles
    (1, 16384, 2048, Tiles(1, 4, 0, 4, 1, per_sm=4)),
    (2, 3072, 2048, Tiles(1, 2, 0, 4, 1, per_sm=8)),
    (1, 1000, 576, Tiles(1, 4, 0, 4, 1, per_sm=2)),  # K not a power of two; fewer tiles than programs * 4
    (1, 2048, 8192, Tiles(1, 1, 0, 4, 1, per_sm=8)),
]


@pytest.mark.parametrize(("rows", "n", "k", "tiles"), STREAMING)
@pytest.mark.parametrize("op", ["rmsnorm_linear", "linear_add", "silu_mul_linear_add"])
def test_streaming_projection(
    cuda_context: Context, monkeypatch: pytest.MonkeyPatch, op: str, rows: int, n: int, k: int, tiles: Tiles
) -> None:
    """The streaming kernel (a fixed grid, each program over several column tiles of whole rows)."""
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: tiles)
    arrays, attributes = _projection_case(np.random.default_rng(rows * 131 + n + k), op, rows, n, k)
    launches = lower(op, arrays, attributes, weights=("weight", "norm_weight"))[1]
    assert [launch.symbol for launch in launches] == ["streaming_projection_kernel"]
    assert launches[0].grid[0] == min(-(-n // tiles.block_n), 132 * tiles.per_sm)
    got = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"))
    want = reference_node(op, arrays, attributes)
    assert np.isfinite(got["out"]).all()
    assert relative_error(got["out"], want["out"]) < 1e-2


PERSISTENT_SPECIALISED = Tiles(128, 128, 64, 8, 4, descriptors=True, persistent=1, specialised=True)

DESCRIBED = [
    # rows, N, K, tiles
    (256, 16384, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),
    (130, 1000, 200, Tiles(128, 128, 64, 8, 4, descriptors=True)),  # partial row, column and K tiles
    (512, 4096, 4096, Tiles(128, 256, 64, 8, 3, descriptors=True)),
    (64, 2048, 8192, Tiles(64, 128, 64, 4, 4, split=4, descriptors=True)),
    (200, 3072, 2048, Tiles(128, 128, 128, 8, 3, split=3, descriptors=True)),  # a short last split
    # 256-row tiles (the LM head of a large decode batch): whole, and partial row, column and K tiles
    (256, 16384, 2048, Tiles(256, 128, 64, 8, 4, descriptors=True)),
    (200, 1000, 200, Tiles(256, 128, 64, 8, 4, descriptors=True)),
    # persistent programs: more tiles than programs (each program over several), partial tiles
    (256, 16384, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True, persistent=1)),
    (130, 1000, 200, Tiles(128, 128, 64, 8, 4, descriptors=True, persistent=1)),
    (512, 3000, 1024, Tiles(128, 64, 64, 4, 3, descriptors=True, persistent=2)),
    # warp-specialised tiles (a copy warp feeding the stages): whole; partial row, column and K tiles; a
    # short last split; 256 columns; 64-row tiles split in four
    pytest.param(256, 16384, 2048, Tiles(128, 128, 64, 8, 4, descriptors=True, specialised=True), id="specialised"),
    pytest.param(
        130, 1000, 200, Tiles(128, 128, 64, 8, 4, descriptors=True, specialised=True), id="specialised-partial"
    ),
    pytest.param(
        200, 3072, 2048, Tiles(128, 128, 64, 8, 3, split=3, descriptors=True, specialised=True), id="specialised-split"
    ),
    pytest.param(512, 4096, 4096, Tiles(128, 256, 64, 8, 3, descriptors=True, specialised=True), id="specialised-wide"),
    pytest.param(
        64, 2048, 8192, Tiles(64, 128, 64, 4, 6, split=4, descriptors=True, specialised=True), id="specialised-64"
    ),
    # persistent warp-specialised programs: 320 partial tiles (160 of 128x256) over 132 programs
    pytest.param(1000, 5120, 1000, PERSISTENT_SPECIALISED, id="specialised-persistent"),
    # 128x256 warp-specialised tiles: split in two over partial rows and a partial last step; persistent
    pytest.param(
        300,
        4096,
        3000,
        Tiles(128, 256, 64, 8, 4, split=2, descriptors=True, specialised=True),
        id="specialised-wide-split",
    ),
    pytest.param(
        1000, 5120, 1000, dataclasses.replace(PERSISTENT_SPECIALISED, block_n=256), id="specialised-wide-persistent"
    ),
    # 256-row persistent warp-specialised tiles (the LM head of a decode batch of 256): 313 partial tiles
    pytest.param(
        200, 40000, 520, dataclasses.replace(PERSISTENT_SPECIALISED, block_m=256), id="specialised-tall-persistent"
    ),
]


def _matrix_kernel(tiles: Tiles) -> str:
    """The kernel a matrix tile launches: warp-specialised (one program a tile or persistent), persistent, or
    one program a tile."""
    if tiles.specialised:
        return "specialised_projection_kernel"
    return "persistent_projection_kernel" if tiles.persistent else "projection_kernel"


@pytest.mark.parametrize(("rows", "n", "k", "tiles"), DESCRIBED)
@pytest.mark.parametrize("op", ["linear", "rmsnorm_linear", "linear_add", "silu_mul_linear_add"])
def test_projection_through_tensor_descriptors(
    cuda_context: Context, monkeypatch: pytest.MonkeyPatch, op: str, rows: int, n: int, k: int, tiles: Tiles
) -> None:
    """Matrix tiles fed by the copy engine over staged 16-bit inputs (the norm, the SwiGLU, or the float32
    rows themselves rounded to bf16; float32 inputs the lowering does not stage fall back to per-thread
    loads), partial tiles, split reductions; three launches over the same scratch (the descriptors
    rewritten) give the bits of one."""
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: tiles)
    arrays, attributes = _projection_case(np.random.default_rng(rows * 31 + n + k), op, rows, n, k)
    described = op in ("rmsnorm_linear", "silu_mul_linear_add") or linear.stages_float32_inputs(rows, n)
    pointer_tile = tiles.block_n <= linear.POINTER_TILE_COLUMNS and tiles.block_m <= linear.POINTER_TILE_ROWS
    if not described and not pointer_tile:  # float32 inputs: per-thread loads
        with pytest.raises(LoweringError, match=f"{tiles.block_m}x{tiles.block_n} tile needs tensor descriptors"):
            lower(op, arrays, attributes, weights=("weight", "norm_weight"))
        return
    if not described and (tiles.persistent or tiles.specialised):
        refusal = "persistent tiles" if tiles.persistent else "warp-specialised tiles"
        with pytest.raises(LoweringError, match=f"{refusal} need tensor descriptors"):
            lower(op, arrays, attributes, weights=("weight", "norm_weight"))
        return
    launches = lower(op, arrays, attributes, weights=("weight", "norm_weight"))[1]
    if described:
        assert launches[0].symbol == ("_rmsnorm_kernel" if op == "rmsnorm_linear" else "stage_rows_kernel")
    if tiles.persistent:
        tiles_count = -(-rows // tiles.block_m) * -(-n // tiles.block_n)
        assert launches[-1].symbol == _matrix_kernel(tiles)
        assert list(launches[-1].grid) == [min(tiles_count, 132 * tiles.persistent), 1, 1]
    else:
        assert launches[-1].symbol == _matrix_kernel(tiles)
        assert list(launches[-1].grid) == [-(-rows // tiles.block_m), -(-n // tiles.block_n), tiles.split]
    assert (launches[-1].params[-2].buffer == "workspace.kernel_scratch") == described
    once = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"))["out"]
    again = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"), repeat=3, reset=("out",))
    assert np.isfinite(once).all()
    assert np.array_equal(once, again["out"])
    assert relative_error(once, reference_node(op, arrays, attributes)["out"]) < 1e-2


MLP_WEIGHTS = ("norm_weight", "gate_up_weight", "down_weight")

SWIGLU_MLPS = [
    # rows, hidden, feed-forward width
    (1, 2048, 8192),  # streaming: two columns of each half a tile
    (2, 4096, 1024),  # streaming over 4096 inputs: one column of each half a tile
    (1, 8192, 512),  # one program per column block over rows of more than 4096 inputs
    (2, 576, 1536),
    (8, 576, 1536),  # 16-row tiles, the reduction split three ways: gate and up partials
    (64, 576, 1536),  # 64-row tiles: the SwiGLU projection over 576 inputs unsplit, the down one in three parts
    (64, 2048, 8192),
    (130, 200, 500),  # partial row, column and reduction tiles; a gate block past the width reads up rows
    (256, 2048, 8192),  # 128x128 blocks of each half through tensor descriptors, a bf16 activation
    (512, 4096, 8448),  # the same where the plain [gate | up] projection would take persistent programs
]


def _mlp_case(rng: np.random.Generator, rows: int, hidden: int, width: int) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((rows, hidden)).astype(np.float32),
        "norm_weight": rng.uniform(0.5, 1.5, hidden).astype(np.float32),
        "gate_up_weight": bf16_bits(rng.standard_normal((2 * width, hidden)).astype(np.float32) * hidden**-0.5),
        "down_weight": bf16_bits(rng.standard_normal((hidden, width)).astype(np.float32) * width**-0.5),
        "residual": rng.standard_normal((rows, hidden)).astype(np.float32),
        "out": np.full((rows, hidden), np.nan, dtype=np.float32),
    }


@pytest.mark.parametrize(("rows", "hidden", "width"), SWIGLU_MLPS)
def test_swiglu_mlp(cuda_context: Context, rows: int, hidden: int, width: int) -> None:
    """``rmsnorm_swiglu_mlp_add``: the [gate | up] projection ending in SwiGLU, then the down projection
    with the residual; also in place on one buffer (x, residual and out: the residual stream)."""
    arrays = _mlp_case(np.random.default_rng(rows * 977 + hidden + width), rows, hidden, width)
    attributes = {"eps": 1e-5}
    want = reference_node("rmsnorm_swiglu_mlp_add", arrays, attributes)["out"]
    got = run_node(cuda_context, "rmsnorm_swiglu_mlp_add", arrays, attributes, weights=MLP_WEIGHTS)["out"]
    assert np.isfinite(got).all()
    assert relative_error(got, want) < 1e-2
    stream = {**arrays, "residual": arrays["x"]}
    in_place = run_node(
        cuda_context, "rmsnorm_swiglu_mlp_add", stream, attributes, weights=MLP_WEIGHTS,
        alias={"residual": "x", "out": "x"},
    )["x"]  # fmt: skip
    assert relative_error(in_place, reference_node("rmsnorm_swiglu_mlp_add", stream, attributes)["out"]) < 1e-2


@pytest.mark.parametrize(("rows", "n", "k", "tiles"), DESCRIBED)
def test_swiglu_mlp_through_forced_tiles(
    cuda_context: Context, monkeypatch: pytest.MonkeyPatch, rows: int, n: int, k: int, tiles: Tiles
) -> None:
    """Each forced tile for both projections of the MLP (``n`` the [gate | up] rows; the [gate | up] blocks of
    each half half as wide): tensor descriptors over the staged norm and the bf16 activation, splits storing
    gate and up partials, persistent programs; three launches give the bits of one."""
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: tiles)
    monkeypatch.setattr(
        linear, "swiglu_tiles", lambda plain, *_, **__: dataclasses.replace(plain, block_n=plain.block_n // 2)
    )
    arrays = _mlp_case(np.random.default_rng(rows * 37 + n + k), rows, k, n // 2)
    attributes = {"eps": 1e-5}
    if n % 16 and (tiles.persistent or tiles.specialised or tiles.block_m > linear.POINTER_TILE_ROWS):
        # activation rows of n / 2 bf16 values: no tensor descriptor serves them, and these tiles need one
        refusal = f"a {tiles.block_m}x{tiles.block_n} tile"
        if tiles.persistent or tiles.specialised:
            refusal = "persistent tiles" if tiles.persistent else "warp-specialised tiles"
        with pytest.raises(LoweringError, match=f"{refusal} needs? tensor descriptors"):
            lower("rmsnorm_swiglu_mlp_add", arrays, attributes, weights=MLP_WEIGHTS)
        return
    launches = lower("rmsnorm_swiglu_mlp_add", arrays, attributes, weights=MLP_WEIGHTS)[1]
    kernel = _matrix_kernel(tiles)
    assert [launch.symbol for launch in launches] == ["_rmsnorm_kernel", kernel, kernel]
    once = run_node(cuda_context, "rmsnorm_swiglu_mlp_add", arrays, attributes, weights=MLP_WEIGHTS)["out"]
    again = run_node(
        cuda_context, "rmsnorm_swiglu_mlp_add", arrays, attributes, weights=MLP_WEIGHTS, repeat=3, reset=("out",)
    )["out"]
    assert np.isfinite(once).all()
    assert np.array_equal(once, again)
    assert relative_error(once, reference_node("rmsnorm_swiglu_mlp_add", arrays, attributes)["out"]) < 1e-2


def test_projection_in_place_residual(cuda_context: Context) -> None:
    """out and residual are one buffer: the residual stream updated in place."""
    rng = np.random.default_rng(5)
    rows, n, k = 4, 2048, 2048
    arrays = {
        "x": rng.standard_normal((rows, k)).astype(np.float32),
        "weight": bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * k**-0.5),
        "residual": rng.standard_normal((rows, n)).astype(np.float32),
        "out": np.full((rows, n), np.nan, dtype=np.float32),
    }
    got = run_node(cuda_context, "linear_add", arrays, weights=("weight",), alias={"out": "residual"})["residual"]
    want = reference_node("linear_add", arrays)["out"]
    assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize(("rows", "splits"), [(8, 5), (64, 8)])
def test_split_projection_launches_again_with_the_same_bits(cuda_context: Context, rows: int, splits: int) -> None:
    """A split reduction (8 rows of 8192 inputs: 5 splits of 16-row tiles; 64 rows: 8 splits of 64-row tiles)
    resets its counts for the next launch, and adds the partials in split order whichever split finishes
    last: three launches over the same buffers (the output poisoned before each) give the bits of one."""
    n, k = 2048, 8192
    assert linear.choose_tiles(rows, n, k).split == splits
    arrays, attributes = _projection_case(np.random.default_rng(23), "linear_add", rows, n, k)
    once = run_node(cuda_context, "linear_add", arrays, attributes, weights=("weight",))["out"]
    again = run_node(cuda_context, "linear_add", arrays, attributes, weights=("weight",), repeat=3, reset=("out",))
    assert np.array_equal(once, again["out"])
    assert relative_error(once, reference_node("linear_add", arrays, attributes)["out"]) < 1e-2


ATTENTION = [
    # tokens, heads, kv heads, head dim, page tokens, table width, rows
    (1, 32, 8, 64, 16, 64, 1),
    (8, 9, 3, 64, 16, 32, 8),
    (64, 32, 8, 128, 16, 8, 2),
    (37, 4, 2, 8, 4, 16, 3),
]


def _attention_arrays(rng: np.random.Generator, shape: tuple[int, ...], *, bf16: bool) -> dict[str, np.ndarray]:
    """One ``paged_attention`` case of an ``ATTENTION`` shape: random queries, planes and rows (token 0 at the
    longest history a row holds, so its context is split), the output poisoned with NaN; with ``bf16`` the
    planes and the output are bf16 bit patterns."""
    tokens, heads, kv_heads, head_dim, page_tokens, width, rows = shape

    def stored(values: np.ndarray) -> np.ndarray:
        return bf16_bits(values) if bf16 else values

    pages = rows * width + 3
    table = rng.permutation(pages)[: rows * width].reshape(rows, width).astype(np.int32)
    arrays = {
        "q": rng.standard_normal((tokens, heads, head_dim)).astype(np.float32),
        "k_plane": stored(rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32)),
        "v_plane": stored(rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32)),
        "page_table": table,
        "token_row": rng.integers(-1, rows, tokens).astype(np.int32),
        "token_position": rng.integers(0, width * page_tokens, tokens).astype(np.int32),
        "out": stored(np.full((tokens, heads, head_dim), np.nan, dtype=np.float32)),
    }
    arrays["token_row"][0] = 0
    arrays["token_position"][0] = width * page_tokens - 1  # the longest history a row can hold
    return arrays


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "written-earlier"])
@pytest.mark.parametrize("shape", ATTENTION)
def test_paged_attention(cuda_context: Context, settled: bool, shape: tuple[int, ...]) -> None:
    tokens, heads, head_dim = shape[0], shape[1], shape[3]
    arrays = _attention_arrays(np.random.default_rng(tokens * 31 + heads), shape, bf16=False)
    attributes = {"scale": head_dim**-0.5}
    # three launches over the same workspaces, the output poisoned before each: the last split to
    # finish merges, and leaves the finished-split counters at zero for the next launch
    # settled: the rows, positions and page table are read before the wait; else after it
    written = () if settled else ("page_table", "token_row", "token_position")
    got = run_node(cuda_context, "paged_attention", arrays, attributes, repeat=3, reset=["out"], written=written)["out"]
    want = reference_node("paged_attention", arrays, attributes)["out"]
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-5 * max(1.0, float(np.abs(want).max()))
    assert (got[arrays["token_row"] < 0] == 0).all()


@pytest.mark.parametrize("shape", ATTENTION)
def test_paged_attention_rounds_bf16_output_rows_at_the_store(cuda_context: Context, shape: tuple[int, ...]) -> None:
    """bf16 output rows (a bf16 kernel graph's attention): the float32 result rounded to nearest even, as the
    reference rounds it, from one launch, a merge of splits and query tiles alike; padding rows are zero."""
    tokens, heads, head_dim = shape[0], shape[1], shape[3]
    arrays = _attention_arrays(np.random.default_rng(tokens * 7 + heads), shape, bf16=True)
    attributes = {"scale": head_dim**-0.5}
    got = bf16_values(run_node(cuda_context, "paged_attention", arrays, attributes, repeat=3, reset=["out"])["out"])
    want = bf16_values(reference_node("paged_attention", arrays, attributes)["out"])
    assert np.isfinite(got).all()
    # the float32 results agree to 1e-5 of the largest (as test_paged_attention checks); rounded to bf16, one
    # unit (2**-7 of the value) more
    unit = 2.0**-7 * np.maximum(np.abs(got), np.abs(want))
    assert (np.abs(got - want) <= unit + 1e-5 * max(1.0, float(np.abs(want).max()))).all()
    assert (got[arrays["token_row"] < 0] == 0).all()


@pytest.mark.parametrize("short", [64, 192])
def test_paged_attention_short_and_split_contexts(
    cuda_context: Context, monkeypatch: pytest.MonkeyPatch, short: int
) -> None:
    """Contexts on both sides of the short limit and of split boundaries, with padding tokens: one
    program attends a short context whole, longer ones merge exactly their active splits."""
    monkeypatch.setattr(attention, "SHORT_POSITIONS", short)
    heads, kv_heads, head_dim, page_tokens, width, rows = 32, 8, 64, 16, 64, 4
    positions = [0, 1, 62, 63, 64, 65, 127, 128, 191, 192, 193, 300, 1023, 5, 700]
    tokens = len(positions)
    rng = np.random.default_rng(short)
    pages = rows * width + 3
    table = rng.permutation(pages)[: rows * width].reshape(rows, width).astype(np.int32)
    token_row = (np.arange(tokens) % rows).astype(np.int32)
    token_row[[3, 13]] = -1  # padding
    arrays = {
        "q": rng.standard_normal((tokens, heads, head_dim)).astype(np.float32),
        "k_plane": rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32),
        "v_plane": rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32),
        "page_table": table,
        "token_row": token_row,
        "token_position": np.array(positions, np.int32),
        "out": np.full((tokens, heads, head_dim), np.nan, dtype=np.float32),
    }
    attributes = {"scale": head_dim**-0.5}
    got = run_node(cuda_context, "paged_attention", arrays, attributes, repeat=3, reset=["out"])["out"]
    want = reference_node("paged_attention", arrays, attributes)["out"]
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-5 * max(1.0, float(np.abs(want).max()))
    assert (got[token_row < 0] == 0).all()
    assert np.abs(got[token_row >= 0]).max() > 0.0


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "scaled"),
    # one token; 64 tokens of 12 heads, four a program; 5 and 37 tokens of 40 rotated heads of 128, two a
    # program, the last program's second token past the end
    [(1, 32, 8, 64, True), (64, 9, 3, 64, False), (5, 32, 8, 128, True), (37, 32, 8, 128, False)],
)
def test_rope_kv_cache_write(
    cuda_context: Context, style: str, tokens: int, heads: int, kv_heads: int, head_dim: int, scaled: bool
) -> None:
    rng = np.random.default_rng(tokens + heads + head_dim)
    pages, page_tokens = 64, 16
    slots = rng.permutation(pages * page_tokens)[:tokens].astype(np.int64)
    slots[tokens // 2] = -1
    arrays = {
        "qkv": rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float32),
        "positions": rng.integers(0, 8192, tokens).astype(np.int32),
        "slots": slots,
        "q": np.full((tokens, heads, head_dim), np.nan, dtype=np.float32),
        "k_plane": rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32),
        "v_plane": rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32),
    }
    attributes: dict[str, object] = {"theta": 500000.0, "style": style}
    if scaled:
        attributes["frequency_band_scaling"] = [32.0, 1.0, 4.0, 8192.0]
    got = run_node(cuda_context, "rope_kv_cache_write", arrays, attributes)
    want = reference_node("rope_kv_cache_write", arrays, attributes)
    for name in ("q", "k_plane", "v_plane"):
        assert np.abs(got[name] - want[name]).max() < 1e-5, name


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "k", "scaled"),
    [
        (1, 32, 8, 64, 2048, True),  # the 1B shape at decode: one fused launch
        (2, 9, 3, 64, 576, False),  # the 135M shape, two tokens: one fused launch
        (1, 16, 4, 128, 2048, True),  # 768 tiles over 512 programs (a multiple of a head's 32 tiles)
        (1, 32, 8, 128, 4096, False),  # the 8B shape: rows of 4096 inputs, the two launches
        (7, 32, 8, 64, 2048, True),  # more tokens: 16-row tiles rotating in the projection, split reduction
        (64, 32, 8, 64, 2048, False),  # the 1B shape at batch 64: 64-row tiles, two splits (one wave)
        (40, 16, 4, 64, 2304, True),  # 24 column tiles, 18 steps in four splits, the last of three steps
        (64, 9, 3, 64, 576, False),  # the 135M shape at batch 64: 64-row tiles over 576 inputs, not split
        (200, 9, 3, 64, 576, True),  # 64x128 tiles over four row tiles, the last partly past the rows
        (64, 32, 8, 128, 4096, True),  # the 8B shape at batch 64: 64 pairs of a head of 128 in two tiles
        (512, 32, 8, 64, 2048, False),  # a prefill chunk: projection through descriptors, then the rotation
        (7, 3, 1, 8, 32, False),  # heads of 8: 20 column pairs of one tile's 32, the rest masked
        (130, 4, 2, 16, 128, True),  # 64x128 tiles over three row tiles, a reduction of one partial step
    ],
)
@pytest.mark.parametrize("settled", [True, False], ids=["settled", "written-earlier"])
def test_rmsnorm_linear_rope_kv_cache_write(
    cuda_context: Context,
    settled: bool,
    style: str,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    k: int,
    scaled: bool,
) -> None:
    rng = np.random.default_rng(tokens * 31 + heads + head_dim + k)
    arrays = _attention_input_case(rng, (tokens, heads, kv_heads, head_dim, k), tokens // 2 if tokens > 1 else None)
    attributes: dict[str, object] = {"eps": 1e-5, "theta": 500000.0, "style": style}
    if scaled:
        attributes["frequency_band_scaling"] = [32.0, 1.0, 4.0, 8192.0]
    op = "rmsnorm_linear_rope_kv_cache_write"
    written = () if settled else ("positions", "slots")
    got = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"), written=written)
    _check_attention_input(got, reference_node(op, arrays, attributes), arrays)


def _attention_input_case(
    rng: np.random.Generator, geometry: tuple[int, int, int, int, int], uncached: int | None
) -> dict[str, np.ndarray]:
    """Random arrays of one attention input node of (tokens, heads, kv heads, head dim, K), the queries
    poisoned, 64 pages of 16 slots; token ``uncached``'s slot is -1 (no cache write)."""
    tokens, heads, kv_heads, head_dim, k = geometry
    pages, page_tokens = 64, 16
    slots = rng.permutation(pages * page_tokens)[:tokens].astype(np.int64)
    if uncached is not None:
        slots[uncached] = -1
    n = (heads + 2 * kv_heads) * head_dim
    return {
        "x": rng.standard_normal((tokens, k)).astype(np.float32),
        "norm_weight": rng.uniform(0.5, 1.5, k).astype(np.float32),
        "weight": bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * k**-0.5),
        "positions": rng.integers(0, 8192, tokens).astype(np.int32),
        "slots": slots,
        "q": np.full((tokens, heads, head_dim), np.nan, dtype=np.float32),
        "k_plane": rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32),
        "v_plane": rng.standard_normal((pages, page_tokens, kv_heads, head_dim)).astype(np.float32),
    }


def _check_attention_input(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], arrays: dict[str, np.ndarray]
) -> None:
    """The queries and the written cache slots within 1e-2 of the reference; the slots not written keep
    their bytes exactly."""
    for name in ("q", "k_plane", "v_plane"):
        assert np.isfinite(got[name]).all(), name
        assert relative_error(got[name], want[name]) < 1e-2, name
    slots = arrays["slots"]
    untouched = np.ones(arrays["k_plane"].shape[0] * arrays["k_plane"].shape[1], dtype=bool)
    untouched[slots[slots >= 0]] = False
    for name in ("k_plane", "v_plane"):
        plane = got[name].reshape(untouched.size, -1)
        assert np.array_equal(plane[untouched], arrays[name].reshape(untouched.size, -1)[untouched]), name


ROTARY_DESCRIBED = [
    # style, (tokens, heads, kv heads, head dim, K), tiles
    ("half", (256, 32, 8, 128, 4096), Tiles(128, 128, 64, 8, 4, descriptors=True)),  # the 8B shape at batch 256
    ("half", (256, 32, 8, 64, 2048), Tiles(128, 128, 64, 8, 4, split=2, descriptors=True)),  # two heads a tile, split
    ("interleaved", (256, 32, 8, 64, 2048), Tiles(128, 128, 64, 8, 4, descriptors=True)),
    ("half", (512, 32, 8, 128, 4096), Tiles(128, 128, 64, 8, 4, descriptors=True)),  # a prefill chunk
    # the 135M shape: 480 pairs, the last of 8 tiles half past them; a partial row tile; 9 steps in 2 splits
    ("interleaved", (130, 9, 3, 64, 576), Tiles(128, 128, 64, 8, 3, split=2, descriptors=True)),
    ("half", (200, 4, 2, 16, 128), Tiles(128, 128, 64, 8, 4, descriptors=True)),  # eight heads of 16 a tile
    ("interleaved", (64, 32, 8, 128, 4096), Tiles(64, 128, 64, 4, 4, split=2, descriptors=True)),  # 64-row tiles
]


@pytest.mark.parametrize(("style", "geometry", "tiles"), ROTARY_DESCRIBED)
def test_rotating_projection_through_tensor_descriptors(
    cuda_context: Context,
    monkeypatch: pytest.MonkeyPatch,
    style: str,
    geometry: tuple[int, int, int, int, int],
    tiles: Tiles,
) -> None:
    """Forced descriptor tiles: each tile's consecutive weight rows through the copy engine, the pairs taken
    out of the accumulator as the layout orders them, rotated and stored (value rows as they are)."""
    monkeypatch.setattr(attention, "rotary_tiles", lambda *_args, **_kwargs: tiles)
    tokens, heads, _, head_dim, k = geometry
    arrays = _attention_input_case(np.random.default_rng(tokens * 17 + heads + head_dim + k), geometry, tokens // 3)
    attributes: dict[str, object] = {"eps": 1e-5, "theta": 500000.0, "style": style}
    op = "rmsnorm_linear_rope_kv_cache_write"
    launches = lower(op, arrays, attributes, weights=("weight", "norm_weight"))[1]
    assert [launch.symbol for launch in launches] == ["rotary_input_kernel", "rotary_projection_kernel"]
    got = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"))
    _check_attention_input(got, reference_node(op, arrays, attributes), arrays)
    again = run_node(cuda_context, op, arrays, attributes, weights=("weight", "norm_weight"))
    for name in ("q", "k_plane", "v_plane"):  # the same bits from one launch to the next, splits or not
        assert np.array_equal(again[name], got[name]), name
