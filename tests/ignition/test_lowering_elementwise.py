"""The elementwise and row operators lower to sm_90a launches on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels import attention, compiler, elementwise, linear, load_kernel_modules, rotary
from ignition.kernels.linear import Tiles, choose_tiles
from ignition.kernels.lowering import LOWERINGS, LoweringContext, LoweringError

from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import one_node_manifest


def _lower(
    op: str,
    arrays: Mapping[str, np.ndarray],
    attributes: Mapping[str, Any] | None = None,
    **options: Any,
) -> tuple[LoweringContext, list[mf.KernelLaunch]]:
    load_kernel_modules()
    manifest, node = one_node_manifest(op, arrays, attributes or {}, **options)
    context = LoweringContext(manifest, "sm_90a", program="test", node=op)
    return context, LOWERINGS[(op, 1)](context, node)


def _compiled(launch: mf.KernelLaunch) -> compiler.CompiledKernel:
    digest = launch.module.rsplit(".", 1)[1]
    for kernel in compiler._MEMORY.values():
        if kernel.symbol == launch.symbol and kernel.digest.startswith(digest):
            return kernel
    raise AssertionError(f"no compiled kernel behind module {launch.module}")


def _check(
    context: LoweringContext,
    launch: mf.KernelLaunch,
    runtime: Sequence[str | tuple[int, Any]],
    grid: Sequence[int] | None = None,
    *,
    programmatic: bool = True,
) -> None:
    """``runtime`` names each address parameter's buffer, or gives a scalar's (kind, value), in order;
    ``programmatic``: whether the launch waits on the one before programmatically."""
    assert launch.target == "sm_90a"
    assert launch.programmatic_wait is programmatic
    assert len(launch.grid) == 3 and all(g >= 1 for g in launch.grid)
    assert launch.grid[1] <= 65535 and launch.grid[2] <= 65535
    if grid is not None:
        assert list(launch.grid) == [*grid, *[1] * (3 - len(grid))]
    assert launch.block[0] % 32 == 0 and 32 <= launch.block[0] <= 1024 and list(launch.block[1:]) == [1, 1]
    assert launch.shared_bytes >= 0
    kernel = _compiled(launch)
    assert len(launch.params) == len(runtime) + kernel.scratch_params
    for param, want in zip(launch.params, runtime, strict=False):
        if isinstance(want, str):
            assert param.kind == mf.PARAM_KIND_ADDRESS and param.buffer == want
        else:
            kind, value = want
            assert param.kind == kind
            got = param.float_value if kind == mf.PARAM_KIND_F32 else param.int_value
            assert got == pytest.approx(value)
    scratch = list(launch.params[len(runtime) :])
    if kernel.global_scratch_bytes:
        # the compiler's global scratch: every program's bytes in the one kernel-scratch workspace
        first = scratch.pop(0)
        assert first.kind == mf.PARAM_KIND_ADDRESS and first.buffer == "workspace.kernel_scratch"
        assert first.byte_offset == 0
        sizes = [int(d.shape[0].size) for d in context.manifest.buffers if d.name == first.buffer]
        assert sizes[0] >= math.prod(launch.grid) * kernel.global_scratch_bytes
    for param in scratch:
        assert param.kind == mf.PARAM_KIND_ADDRESS and not param.buffer
    module = context.modules[launch.module]
    assert module.decl.format == mf.MODULE_FORMAT_CUBIN
    assert module.data[:4] == b"\x7fELF"


def f32(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


def i32(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.int32)


def u8(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.uint8)


def bf16(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.uint16)


@pytest.mark.parametrize(("vocab", "hidden", "tokens", "table"), [(500, 576, 1, f32), (97, 4096, 19, bf16)])
def test_embedding(vocab: int, hidden: int, tokens: int, table: Any) -> None:
    arrays = {"table": table(vocab, hidden), "ids": i32(tokens), "out": f32(tokens, hidden)}
    context, launches = _lower("embedding", arrays, weights=["table"])
    assert len(launches) == 1
    _check(context, launches[0], ["table", "ids", "out"])


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (64, 4096), (3, 16384)])
def test_rmsnorm(rows: int, hidden: int) -> None:
    arrays = {"x": f32(rows, hidden), "weight": f32(hidden), "out": f32(rows, hidden)}
    context, launches = _lower("rmsnorm", arrays, {"eps": 1e-5}, weights=["weight"])
    _check(context, launches[0], ["x", "weight", "out", (mf.PARAM_KIND_F32, 1e-5)], grid=[rows])


def test_rmsnorm_in_place_reads_and_writes_one_buffer() -> None:
    arrays = {"x": f32(4, 576), "weight": f32(576), "out": f32(4, 576)}
    context, launches = _lower("rmsnorm", arrays, {"eps": 1e-6}, alias={"out": "x"})
    _check(context, launches[0], ["x", "weight", "x", (mf.PARAM_KIND_F32, 1e-6)], grid=[4])


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 1536)])
def test_silu_mul(rows: int, width: int) -> None:
    arrays = {"gate": f32(rows, width), "up": f32(rows, width), "out": f32(rows, width)}
    context, launches = _lower("silu_mul", arrays)
    _check(context, launches[0], ["gate", "up", "out"])


@pytest.mark.parametrize(("a", "b"), [((1, 576), (1, 576)), ((64, 576), (576,)), ((4, 3, 8), (4, 1, 1))])
def test_add(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    context, launches = _lower("add", {"a": f32(*a), "b": f32(*b), "out": f32(*a)})
    _check(context, launches[0], ["a", "b", "out"])


def test_add_rejects_a_shape_that_does_not_broadcast() -> None:
    with pytest.raises(LoweringError, match="broadcast"):
        _lower("add", {"a": f32(4, 6), "b": f32(5), "out": f32(4, 6)})


@pytest.mark.parametrize(
    ("x", "index", "out"),
    [(f32(64, 576), i32(8), f32(8, 576)), (f32(1, 576), i32(1), f32(1, 576)), (i32(32, 1), i32(4), i32(4, 1))],
)
def test_gather_rows(x: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    context, launches = _lower("gather_rows", {"x": x, "index": index, "out": out})
    _check(context, launches[0], ["x", "index", "out"])


def test_gather_rows_rejects_float_rows_into_integers() -> None:
    with pytest.raises(LoweringError, match="float or integer"):
        _lower("gather_rows", {"x": f32(4, 2), "index": i32(2), "out": i32(2, 2)})


def test_gather_rows_compiles_no_state_row_count() -> None:
    """Pending tokens of any state-row count share one kernel: the leading extent is not compiled in."""
    modules = set()
    for state_rows in (8, 40):
        arrays = {"x": i32(state_rows, 1), "index": i32(4), "out": i32(4, 1)}
        _, launches = _lower("gather_rows", arrays, symbolic={"x": mf.DIM_SYMBOL_STATE_ROWS})
        modules.add(launches[0].module)
    assert len(modules) == 1


@pytest.mark.parametrize("lanes", [1, 8, 2500])
def test_lane_last_index(lanes: int) -> None:
    context, launches = _lower("lane_last_index", {"query_length": i32(lanes), "out": i32(lanes)})
    _check(context, launches[0], ["query_length", "out"], grid=[1])


@pytest.mark.parametrize(
    ("arrays", "runtime"),
    [
        (
            {"src": f32(256, 16, 3, 64), "src_rows": i32(1), "dst_rows": i32(1), "dst": f32(8, 16, 3, 64)},
            ["src", "dst_rows", "src_rows", "dst"],
        ),
        (
            {"src": u8(8, 1003), "src_rows": i32(1), "dst_rows": i32(1), "dst": u8(8, 1003)},
            ["src", "dst_rows", "src_rows", "dst"],
        ),
        (
            {"src": i32(4, 1), "dst_rows": i32(4), "when": u8(4), "dst": i32(16, 1)},
            ["src", "dst_rows", "when", "dst"],
        ),
        ({"src": bf16(5, 7), "dst_rows": i32(2), "dst": bf16(4, 7)}, ["src", "dst_rows", "dst"]),
    ],
)
def test_copy_rows(arrays: dict[str, np.ndarray], runtime: list[str]) -> None:
    context, launches = _lower("copy_rows", arrays)
    assert len(launches) == 1
    _check(context, launches[0], runtime)


def test_copy_rows_within_one_buffer_stages_through_a_workspace() -> None:
    arrays = {"src": f32(32, 16, 3, 64), "src_rows": i32(2), "dst_rows": i32(2), "dst": f32(32, 16, 3, 64)}
    context, launches = _lower("copy_rows", arrays, alias={"dst": "src"})
    assert len(launches) == 2
    _check(context, launches[0], ["src", "dst_rows", "src_rows", "workspace.copy_rows"])
    _check(context, launches[1], ["workspace.copy_rows", "dst_rows", "src_rows", "src"])
    staging = next(b for b in context.manifest.buffers if b.name == "workspace.copy_rows")
    assert staging.role == mf.BUFFER_ROLE_SCRATCH and staging.shape[0].size >= 2 * 16 * 3 * 64 * 4


def test_copy_rows_compiles_no_cache_page_count() -> None:
    modules = set()
    for pages in (64, 200):
        arrays = {"src": f32(pages, 16, 2, 64), "src_rows": i32(1), "dst_rows": i32(1), "dst": f32(4, 16, 2, 64)}
        _, launches = _lower(
            "copy_rows", arrays, symbolic={"src": mf.DIM_SYMBOL_CACHE_PAGES, "dst": mf.DIM_SYMBOL_SNAPSHOT_ROWS}
        )
        modules.add(launches[0].module)
    assert len(modules) == 1


def test_copy_rows_rejects_mixed_dtypes() -> None:
    with pytest.raises(LoweringError, match="differs"):
        _lower("copy_rows", {"src": f32(4, 2), "dst_rows": i32(2), "dst": i32(4, 2)})


@pytest.mark.parametrize(("lanes", "vocab"), [(1, 576), (8, 49152)])
def test_init_sampling_state(lanes: int, vocab: int) -> None:
    arrays = {
        "prompt_histogram": u8(lanes, vocab),
        "rows": i32(lanes),
        "prompt_presence": u8(16, vocab),
        "output_counts": i32(16, vocab),
    }
    context, launches = _lower(
        "init_sampling_state",
        arrays,
        symbolic={"prompt_presence": mf.DIM_SYMBOL_STATE_ROWS, "output_counts": mf.DIM_SYMBOL_STATE_ROWS},
    )
    _check(context, launches[0], ["prompt_histogram", "rows", "prompt_presence", "output_counts"])


RECORD = ["out_generation", "out_emitted", "out_consumed", "out_draft_cursor", "out_reserved", "out_sequence"]


def _record(lanes: int) -> dict[str, np.ndarray]:
    arrays = {name: i32(lanes) for name in RECORD[:-1]}
    arrays["out_sequence"] = np.zeros(1, np.int64)
    return arrays


@pytest.mark.parametrize(("lanes", "tokens"), [(1, 1), (8, 64)])
def test_completion_lanes(lanes: int, tokens: int) -> None:
    arrays = {
        "generation": i32(lanes),
        "sample_active": u8(lanes),
        "last_index": i32(lanes),
        "positions": i32(tokens),
        "submission_sequence": np.zeros(1, np.int64),
        **_record(lanes),
    }
    context, launches = _lower("completion_lanes", arrays)
    inputs = ["generation", "sample_active", "last_index", "positions", "submission_sequence"]
    _check(context, launches[0], inputs + RECORD, grid=[1])


def test_completion_copy_lanes() -> None:
    arrays = {"generation": i32(1), "consumed": i32(1), "submission_sequence": np.zeros(1, np.int64), **_record(1)}
    context, launches = _lower("completion_copy_lanes", arrays)
    _check(context, launches[0], ["generation", "consumed", "submission_sequence", *RECORD], grid=[1])


def test_completion_lanes_rejects_a_short_output() -> None:
    arrays = {"generation": i32(4), "consumed": i32(4), "submission_sequence": np.zeros(1, np.int64), **_record(4)}
    arrays["out_reserved"] = i32(3)
    with pytest.raises(LoweringError, match="out_reserved"):
        _lower("completion_copy_lanes", arrays)


def test_tail_page() -> None:
    arrays = {"page_table": i32(1, 32), "consumed": i32(1), "out": i32(1)}
    context, launches = _lower("tail_page", arrays, {"page_tokens": 16})
    _check(context, launches[0], ["page_table", "consumed", "out"], grid=[1])


@pytest.mark.parametrize(
    ("shape", "attributes"),
    [
        ((1, 9, 64), {"theta": 10000.0, "style": "half"}),
        ((64, 32, 128), {"theta": 500000.0, "style": "interleaved", "frequency_band_scaling": (8.0, 1.0, 4.0, 8192.0)}),
        ((3, 2, 80), {"theta": 10000.0, "style": "interleaved"}),
    ],
)
def test_rope(shape: tuple[int, int, int], attributes: dict[str, Any]) -> None:
    arrays = {"x": f32(*shape), "positions": i32(shape[0]), "out": f32(*shape)}
    context, launches = _lower("rope", arrays, attributes, alias={"out": "x"})
    theta_bits = rotary.float_bits(math.log2(attributes["theta"]))
    band = attributes.get("frequency_band_scaling", (0.0, 0.0, 0.0, 0.0))
    scalars = [(mf.PARAM_KIND_I64, theta_bits), *((mf.PARAM_KIND_I64, rotary.float_bits(v)) for v in band)]
    _check(context, launches[0], ["x", "positions", "x", *scalars])
    assert launches[0].grid[0] == shape[0]


def test_rope_rejects_an_unknown_style() -> None:
    with pytest.raises(LoweringError, match="style"):
        _lower("rope", {"x": f32(1, 2, 8), "positions": i32(1), "out": f32(1, 2, 8)}, {"theta": 1e4, "style": "odd"})


@pytest.mark.parametrize(("tokens", "kv_heads", "head_dim"), [(1, 2, 64), (16, 8, 128)])
def test_kv_cache_write(tokens: int, kv_heads: int, head_dim: int) -> None:
    arrays = {
        "k": f32(tokens, kv_heads, head_dim),
        "v": f32(tokens, kv_heads, head_dim),
        "slots": np.zeros(tokens, np.int64),
        "k_plane": f32(32, 16, kv_heads, head_dim),
        "v_plane": f32(32, 16, kv_heads, head_dim),
    }
    symbolic = {"k_plane": mf.DIM_SYMBOL_CACHE_PAGES, "v_plane": mf.DIM_SYMBOL_CACHE_PAGES}
    context, launches = _lower("kv_cache_write", arrays, symbolic=symbolic)
    _check(context, launches[0], ["k", "v", "slots", "k_plane", "v_plane"])


def _attention_input_arrays(tokens: int, heads: int, kv_heads: int, head_dim: int, k: int) -> dict[str, np.ndarray]:
    return {
        "x": f32(tokens, k),
        "norm_weight": f32(k),
        "weight": bf16((heads + 2 * kv_heads) * head_dim, k),
        "positions": i32(tokens),
        "slots": np.zeros(tokens, np.int64),
        "q": f32(tokens, heads, head_dim),
        "k_plane": f32(32, 16, kv_heads, head_dim),
        "v_plane": f32(32, 16, kv_heads, head_dim),
    }


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "k", "programs"),
    [
        # 4-row tiles: (heads + kv heads) * head_dim / 2 rotation pairs, 2 a tile, and kv heads * head_dim
        # value rows, 4 a tile; 768 tiles over 4 programs on each of 132 multiprocessors
        (1, 32, 8, 64, 2048, min(40 * 32 // 2 + 8 * 64 // 4, 4 * 132)),
        (2, 9, 3, 64, 576, 12 * 32 // 2 + 3 * 64 // 4),  # 240 tiles: a program each
        (1, 16, 4, 128, 2048, 512),  # 768 tiles; 528 programs rounded down to a multiple of a head's 32 tiles
    ],
)
def test_attention_input_is_one_launch_at_decode(
    tokens: int, heads: int, kv_heads: int, head_dim: int, k: int, programs: int
) -> None:
    arrays = _attention_input_arrays(tokens, heads, kv_heads, head_dim, k)
    attributes = {"eps": 1e-5, "theta": 10000.0, "style": "half"}
    context, launches = _lower("rmsnorm_linear_rope_kv_cache_write", arrays, attributes)
    scalars = [(mf.PARAM_KIND_I64, rotary.float_bits(math.log2(10000.0))), *[(mf.PARAM_KIND_I64, 0)] * 4]
    runtime = ["x", "weight", "norm_weight", "positions", "slots", "q", "k_plane", "v_plane"]
    runtime += [(mf.PARAM_KIND_F32, 1e-5), (mf.PARAM_KIND_I32, tokens), *scalars]
    assert len(launches) == 1
    _check(context, launches[0], runtime, grid=[programs])


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "k", "grid", "block_m", "pairs"),
    [
        # 7 rows: 16-row tiles of 64 columns, 32 column pairs each: the 1536 pairs (1280 rotating, 256 of
        # value rows) in 48 column tiles; 16 reduction steps in 3 splits
        (7, 32, 8, 64, 2048, [1, 48, 3], 16, 32),
        # the 1B shape at 64 rows: 64x64 tiles, 48 column tiles, 16 steps in the 2 splits one wave holds
        # (96 programs; the plain projection's 3 would make 144)
        (64, 32, 8, 64, 2048, [1, 48, 2], 64, 32),
        # 40 rows, 16 heads of 64 over 2304 inputs: 24 column tiles; one wave holds 5 splits, but a part keeps
        # 512 inputs or more: 18 steps in 4 splits (96 programs; the plain projection's 6 would make 144)
        (40, 16, 4, 64, 2304, [1, 24, 4], 64, 32),
        # 256 rows: the narrow 64x128 tiles, 64 pairs (two heads' rotation pairs) a tile: 4 x 24, no split
        (256, 32, 8, 64, 2048, [4, 24, 1], 64, 64),
        # the 8B shape at 64 rows: 64x64 tiles, 32 pairs (half a head of 128), 96 column tiles, 2 splits
        (64, 32, 8, 128, 4096, [1, 96, 2], 64, 32),
        # the 135M shape at 5 rows: 480 pairs in 15 tiles, 5 steps of 128 inputs in 5 splits
        (5, 9, 3, 64, 576, [1, 15, 5], 16, 32),
        # heads of 8: 16 rotation pairs (four heads) and 4 value pairs fill 20 of one tile's 32 pairs
        (7, 3, 1, 8, 32, [1, 1, 1], 16, 32),
    ],
)
def test_attention_input_of_many_tokens_rotates_in_the_projection(
    launched_constants: list[dict[str, Any]],
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    k: int,
    grid: list[int],
    block_m: int,
    pairs: int,
) -> None:
    arrays = _attention_input_arrays(tokens, heads, kv_heads, head_dim, k)
    attributes = {"eps": 1e-5, "theta": 10000.0, "style": "interleaved"}
    context, launches = _lower("rmsnorm_linear_rope_kv_cache_write", arrays, attributes)
    assert [launch.symbol for launch in launches] == ["rotary_input_kernel", "rotary_projection_kernel"]
    staged, factors = "workspace.projection_input_bf16", "workspace.rotary_factors"
    scalars = [(mf.PARAM_KIND_I64, rotary.float_bits(math.log2(10000.0))), *[(mf.PARAM_KIND_I64, 0)] * 4]
    runtime = ["x", "norm_weight", staged, "positions", factors, (mf.PARAM_KIND_F32, 1e-5), *scalars]
    _check(context, launches[0], runtime, grid=[tokens])  # a program a row: its norm and rotation factors
    assert launched_constants[0] == {
        "HIDDEN": k, "BLOCK": 1 << (k - 1).bit_length(), "SINGLE": True, "WEIGHT_EARLY": False,
        "D": head_dim, "SCALED": False,
    }  # fmt: skip
    split = grid[2] > 1
    partials = ["workspace.projection_partials", "workspace.projection_splits_done"] if split else [staged] * 2
    runtime = [staged, "weight", "slots", "q", "k_plane", "v_plane", *partials, factors, (mf.PARAM_KIND_I32, tokens)]
    # more than 64 rows wait on their norm the ordinary way (linear.ORDINARY_WAIT_ROWS)
    _check(context, launches[1], runtime, grid=grid, programmatic=tokens <= 64)
    constants = launched_constants[-1]
    assert (constants["BLOCK_M"], constants["PAIRS"], constants["SPLIT"]) == (block_m, pairs, grid[2])
    assert (constants["HEADS"], constants["KV_HEADS"], constants["D"], constants["K"]) == (heads, kv_heads, head_dim, k)
    assert constants["HALF_PAIRS"] is False and constants["DESCRIPTORS"] is False
    assert grid[1] == -(-(heads + 2 * kv_heads) * head_dim // 2 // pairs)  # every column pair in a tile
    sizes = {decl.name: int(decl.shape[0].size) for decl in context.manifest.buffers}
    assert "workspace.packed_qkv" not in sizes
    assert sizes[staged] == tokens * k and sizes[factors] == tokens * head_dim  # cos, then sin, of each pair
    if split:
        assert sizes["workspace.projection_partials"] == grid[0] * grid[1] * grid[2] * 2 * block_m * pairs
        assert sizes["workspace.projection_splits_done"] == grid[0] * grid[1]


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize(
    "geometry",  # tokens, heads, kv heads, head dim, K: each a 2 x 48 grid
    [
        (256, 32, 8, 128, 4096),  # the 8B shape at batch 256: 96 tiles of 128x128, one a head
        (200, 32, 8, 128, 4096),  # a partial row tile
        (160, 32, 32, 64, 2048),  # as many kv heads as heads, of 64: 96 tiles, two heads a tile
    ],
)
def test_attention_input_rotates_in_a_projection_through_descriptors(
    launched_constants: list[dict[str, Any]], style: str, geometry: tuple[int, int, int, int, int]
) -> None:
    tokens, grid = geometry[0], [2, 48, 1]
    arrays = _attention_input_arrays(*geometry)
    attributes = {"eps": 1e-5, "theta": 10000.0, "style": style}
    context, launches = _lower("rmsnorm_linear_rope_kv_cache_write", arrays, attributes)
    assert [launch.symbol for launch in launches] == ["rotary_input_kernel", "rotary_projection_kernel"]
    staged, factors = "workspace.projection_input_bf16", "workspace.rotary_factors"
    runtime = [staged, "weight", "slots", "q", "k_plane", "v_plane", staged, staged, factors]
    _check(context, launches[1], [*runtime, (mf.PARAM_KIND_I32, tokens)], grid=grid, programmatic=False)
    constants = launched_constants[-1]
    assert constants["DESCRIPTORS"] is True and constants["HALF_PAIRS"] is (style == "half")
    assert (constants["BLOCK_M"], constants["PAIRS"], constants["BLOCK_K"], constants["SPLIT"]) == (128, 64, 64, 1)
    assert launches[1].block[0] == 8 * 32  # eight warps
    assert "workspace.packed_qkv" not in {decl.name for decl in context.manifest.buffers}


@pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels
@pytest.mark.parametrize(
    "geometry",  # tokens, heads, kv heads, head dim, K
    [
        (256, 32, 8, 128, 4096),  # 128x128 tiles through tensor descriptors
        (256, 32, 8, 64, 2048),  # 64x128 tiles fed by per-thread loads
        (64, 32, 8, 128, 4096),  # 64x64 tiles, the reduction split
    ],
)
def test_the_interleaved_rotating_projection_stores_runs_of_columns_as_the_half_layout_does(
    monkeypatch: pytest.MonkeyPatch, geometry: tuple[int, int, int, int, int]
) -> None:
    """Pairs of adjacent columns stored apart (column ``2 * pair``, then ``2 * pair + 1``) compile to one
    scalar store a value; the interleaved epilogue must store a row's columns in vectors as the half
    layout's does (PTX of the same tile in both layouts)."""
    import triton

    ptx: dict[str, str] = {}
    original = triton.compile

    def compile_and_keep(src: Any, target: Any = None, options: Any = None) -> Any:
        compiled = original(src, target=target, options=options)
        if src.fn.__name__ == "rotary_projection_kernel":
            ptx[style] = compiled.asm["ptx"]
        return compiled

    monkeypatch.setattr(triton, "compile", compile_and_keep)
    monkeypatch.setattr(compiler, "_MEMORY", {})
    monkeypatch.delenv("IGNITION_KERNEL_CACHE", raising=False)
    for style in ("half", "interleaved"):
        attributes = {"eps": 1e-5, "theta": 10000.0, "style": style}
        _, launches = _lower("rmsnorm_linear_rope_kv_cache_write", _attention_input_arrays(*geometry), attributes)
        assert launches[-1].symbol == "rotary_projection_kernel"
    forms = {style: re.findall(r"st\.global[.\w]*", code) for style, code in ptx.items()}  # st.global.v4.b32, ...
    stores = {style: len(found) for style, found in forms.items()}
    scalar = {style: sum(".v" not in form for form in found) for style, found in forms.items()}
    assert stores["interleaved"] <= stores["half"], (stores, scalar)
    assert scalar["interleaved"] <= scalar["half"], (stores, scalar)


@pytest.mark.parametrize(
    ("geometry", "style", "forced", "projection"),  # (tokens, heads, kv heads, head dim, K)
    [
        # a prefill chunk: 96 of 132 tiles of 128x128 through descriptors
        ((512, 32, 8, 64, 2048), "half", None, "projection_kernel"),
        # the 8B shape's chunk over 4096 inputs: 96 warp-specialised tiles of 128x256
        ((512, 32, 8, 128, 4096), "interleaved", None, "specialised_projection_kernel"),
        # a long chunk's persistent tiles (768 of 128x128)
        ((2048, 32, 8, 128, 4096), "interleaved", None, "persistent_projection_kernel"),
        # heads of 256 values in the half layout: a 128-column tile is half a head, not consecutive pairs
        ((256, 8, 2, 256, 2048), "half", Tiles(128, 128, 64, 8, 4, descriptors=True), "projection_kernel"),
    ],
)
def test_attention_input_projects_into_a_workspace_then_rotates_where_its_tiles_do_not_rotate(
    monkeypatch: pytest.MonkeyPatch,
    launched_constants: list[dict[str, Any]],
    geometry: tuple[int, int, int, int, int],
    style: str,
    forced: Tiles | None,
    projection: str,
) -> None:
    if forced is not None:
        monkeypatch.setattr(attention, "rotary_tiles", lambda *_args, **_kwargs: forced)
    tokens, heads, kv_heads, head_dim, _ = geometry
    arrays = _attention_input_arrays(*geometry)
    attributes = {"eps": 1e-5, "theta": 1e4, "style": style}
    context, launches = _lower("rmsnorm_linear_rope_kv_cache_write", arrays, attributes)
    if forced is None:
        assert [launch.symbol for launch in launches] == ["_rmsnorm_kernel", projection, "rope_cache_kernel"]
        assert launched_constants[1].get("DESCRIPTORS", True) is True  # (persistent tiles always take them)
    else:  # these rows' narrow tiles fed by per-thread loads: the plain projection, then the rotation
        assert [launch.symbol for launch in launches][-2:] == [projection, "rope_cache_kernel"]
        assert launched_constants[-2]["DESCRIPTORS"] is False
    packed = launches[-1].params[0]
    assert packed.buffer == "workspace.packed_qkv" and launches[-2].params[2].buffer == packed.buffer
    n = (heads + 2 * kv_heads) * head_dim
    assert [decl.shape[0].size for decl in context.manifest.buffers if decl.name == packed.buffer] == [tokens * n]


def test_the_rotating_projection_refuses_descriptor_tiles_of_part_of_a_head() -> None:
    arrays = _attention_input_arrays(256, 8, 2, 256, 2048)
    manifest, node = one_node_manifest(
        "rmsnorm_linear_rope_kv_cache_write", arrays, {"eps": 1e-5, "theta": 1e4, "style": "half"}, ("weight",)
    )
    context = LoweringContext(manifest, "sm_90a", program="test", node="node")
    forced = Tiles(128, 128, 64, 8, 4, descriptors=True)
    with pytest.raises(LoweringError, match="whole heads of 256 rows a tile"):
        attention.rotary_projection(context, node, forced, (256, 12 * 256, 2048), (8, 2, 256))
    with pytest.raises(LoweringError, match="matrix tiles of at least 32 columns, one program a tile"):
        attention.rotary_projection(
            context, node, dataclasses.replace(forced, persistent=1), (256, 3072, 2048), (8, 2, 256)
        )


@pytest.mark.parametrize(
    ("geometry", "tensors", "block_t"),  # (tokens, heads, kv heads, head dim, K); (query, key/value) heads a tensor
    [
        ((512, 32, 8, 128, 4096), (32, 8), 2),  # the 8B prefill chunk: 40 rotated heads, two tokens a program
        ((512, 32, 8, 64, 2048), (32, 8), 4),
        ((1, 32, 8, 128, 4096), (32, 8), 1),  # the 8B shape at one row: the streaming projection, then the rope
        ((2048, 9, 3, 64, 576), (16, 4), 16),  # the 135M shape: 12 rotated heads padded to 16, sixteen tokens
    ],
)
def test_the_rope_and_cache_write_gives_each_kind_of_head_a_tensor_of_its_own_count(
    launched_constants: list[dict[str, Any]], geometry: tuple[int, int, int, int, int], tensors: tuple[int, int],
    block_t: int,
) -> None:  # fmt: skip
    """Query, key and value heads each in a tensor of their own count padded to a power of two (not the rotated
    heads' sum padded: 64 rows of which 40, or 8, were used); the tokens a program keep to the rotated heads'
    budget as before."""
    tokens, heads, kv_heads, head_dim, _ = geometry
    attributes = {"eps": 1e-5, "theta": 1e4, "style": "half"}
    _, launches = _lower("rmsnorm_linear_rope_kv_cache_write", _attention_input_arrays(*geometry), attributes)
    assert launches[-1].symbol == "rope_cache_kernel"
    constants = launched_constants[-1]
    assert (constants["HEADS_P2"], constants["KV_HEADS_P2"]) == tensors
    assert "ROTATED_P2" not in constants
    assert constants["BLOCK_T"] == block_t == attention.rope_tokens(tokens, heads + kv_heads, head_dim)
    assert list(launches[-1].grid) == [-(-tokens // block_t), 1, 1]


def test_attention_input_of_4096_inputs_streams_the_projection_then_rotates() -> None:
    arrays = _attention_input_arrays(1, 32, 8, 128, 4096)
    attributes = {"eps": 1e-5, "theta": 1e4, "style": "half"}
    _, launches = _lower("rmsnorm_linear_rope_kv_cache_write", arrays, attributes)
    assert [launch.symbol for launch in launches] == ["streaming_projection_kernel", "rope_cache_kernel"]
    assert list(launches[0].grid) == [min(48 * 128 // 2, 8 * 132), 1, 1]  # two rows a tile, 8 programs an SM
    assert launches[0].params[2].buffer == launches[1].params[0].buffer == "workspace.packed_qkv"
    assert list(launches[1].grid) == [1, 1, 1]  # the one token in one program


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (1, 16384, 2048, Tiles(1, 4, 0, 4, 1, per_sm=4)),
        (2, 1000, 576, Tiles(1, 4, 0, 4, 1, per_sm=4)),
        (1, 28672, 4096, Tiles(1, 2, 0, 4, 1, per_sm=8)),
        (2, 6144, 3000, Tiles(1, 2, 0, 4, 1, per_sm=8)),
        (1, 4096, 14336, Tiles(1, 8, 1024, 8, 1)),
        (1, 2048, 8192, Tiles(1, 8, 1024, 8, 1)),
    ],
)
def test_one_or_two_rows_stream_whole_rows_of_up_to_4096_inputs(rows: int, n: int, k: int, tiles: Tiles) -> None:
    assert choose_tiles(rows, n, k) == tiles


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (8, 2048, 8192, Tiles(16, 64, 128, 4, 4, split=5)),  # 32 tiles, 64 steps: four splits of 13, one of 12
        (8, 3072, 2048, Tiles(16, 64, 128, 4, 4, split=3)),  # 48 tiles, 16 steps: two of 6, one of 4
        (8, 16384, 2048, Tiles(16, 64, 128, 4, 4)),  # 256 tiles fill the machine: no split
        (8, 128256, 2048, Tiles(16, 128, 128, 4, 4)),
        (64, 2048, 2048, Tiles(64, 64, 128, 4, 3, split=4)),
        # 64-row tiles split on to two programs a multiprocessor while each part keeps four steps
        (64, 2048, 8192, Tiles(64, 64, 128, 4, 3, split=8)),  # 32 tiles, 64 steps: 256 programs
        (48, 4096, 14336, Tiles(64, 64, 128, 4, 3, split=4)),  # 64 tiles, 112 steps: 256 programs
        (64, 4096, 4096, Tiles(64, 64, 128, 4, 3, split=4)),  # 64 tiles, 32 steps: 256 programs
        # a 64-row tile's part keeps 512 inputs or more: the 135M shape's short reductions split less or not at all
        (64, 576, 1536, Tiles(64, 64, 128, 4, 3, split=3)),  # 9 tiles of 12 steps: three parts of four
        (64, 576, 576, Tiles(64, 64, 128, 4, 3)),  # 5 steps: not split (five parts of one step before)
        (40, 3072, 576, Tiles(64, 64, 128, 4, 3)),  # 48 tiles: not split (three parts before)
        (64, 576, 1024, Tiles(64, 64, 128, 4, 3, split=2)),
        (64, 16384, 2048, Tiles(64, 64, 128, 4, 3)),  # 256 tiles: no split
        (130, 1000, 200, Tiles(64, 128, 64, 4, 4)),  # under 512 inputs: not split
        (130, 1000, 2048, Tiles(64, 128, 64, 4, 4, split=4)),  # 32 steps: four parts within one wave
        (256, 576, 1536, Tiles(64, 128, 64, 4, 4, split=3)),  # 20 tiles: three parts of 512 inputs
        (8, 576, 1536, Tiles(16, 64, 128, 4, 4, split=12)),  # 16-row tiles keep parts of one step
        (512, 16384, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),
        (512, 2048, 8192, Tiles(128, 64, 64, 8, 3, split=2)),  # prefill chunks keep 128-row tiles
        (512, 3072, 2048, Tiles(128, 128, 64, 8, 4, descriptors=True)),  # 96 square tiles: at least 2/3 of 132
        (512, 4096, 14336, Tiles(128, 128, 64, 8, 4, descriptors=True)),
        (512, 28672, 4096, Tiles(128, 128, 64, 8, 4, descriptors=True, persistent=1)),  # 896 tiles over 4096
        (512, 16384, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # 512 tiles over 2048 inputs: not persistent
        (512, 6144, 4096, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # 192 tiles: not persistent
        # vocabulary-wide outputs of 129 to 256 rows: 256-row tiles read each weight tile once
        (256, 128256, 4096, Tiles(256, 128, 64, 8, 4, descriptors=True)),
        (256, 128256, 2048, Tiles(256, 128, 64, 8, 4, descriptors=True)),
        (200, 128256, 2048, Tiles(256, 128, 64, 8, 4, descriptors=True)),
        (128, 128256, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # one 128-row tile: read once already
        (512, 128256, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # prefill chunks keep 128-row tiles
        (256, 49152, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # 384 column tiles: under four waves
        (256, 16384, 2048, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # 256 tiles of 128x128: wide, no split
        (256, 4096, 14336, Tiles(128, 128, 64, 8, 4, split=2, descriptors=True)),  # a long reduction: 64 tiles
        (256, 3072, 2048, Tiles(64, 128, 64, 4, 4)),  # 96 narrow tiles: a split would need a second wave
        (256, 2048, 2048, Tiles(64, 128, 64, 4, 4, split=2)),  # 64 tiles: two parts each, one wave
        (256, 2048, 8192, Tiles(64, 128, 64, 4, 4, split=2)),
        (128, 2048, 8192, Tiles(64, 128, 64, 4, 4, split=4)),  # 32 tiles: four parts of 32 steps
    ],
)
def test_matrix_tiles_split_the_reduction_where_the_tiles_leave_multiprocessors_idle(
    rows: int, n: int, k: int, tiles: Tiles
) -> None:
    """About one program a multiprocessor: ``cdiv(132, tiles)`` splits, at most one per reduction step,
    every split but the last the same number of steps (64-row tiles: up to two programs a multiprocessor
    while each split keeps four steps, and never a part of fewer than 512 inputs); the narrow outputs of 65
    to 256 rows (64x128 tiles, 128x128 ones over 12288 inputs or more) split only within one wave:
    ``132 // tiles`` parts, each of 512 inputs or more. Wide
    outputs and prefill chunks whose 128x128 tiles reach two thirds of the multiprocessors take those
    tiles through tensor descriptors; the widest projections of a prefill chunk (four tiles a
    multiprocessor and more) over 4096 inputs or more take persistent ones, and vocabulary-wide outputs
    of 129 to 256 rows (four waves of 128-column tiles) 256x128 tiles."""
    assert choose_tiles(rows, n, k) == tiles


SPECIALISED_64x128 = Tiles(64, 128, 64, 4, 8, descriptors=True, specialised=True)
"""One unsplit 64x128 tile a program, a copy warp feeding eight stages."""


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (256, 4096, 4096, SPECIALISED_64x128),  # the 8B output projection of a decode batch of 256: 128 tiles
        (256, 2048, 2048, SPECIALISED_64x128),  # the 1B one: 64 tiles
        (256, 2048, 8192, SPECIALISED_64x128),  # the 1B down projection
        (129, 2048, 2048, SPECIALISED_64x128),
        (512, 2048, 8192, dataclasses.replace(SPECIALISED_64x128, num_stages=6)),  # prefill chunks: six stages
        (256, 4096, 14336, Tiles(128, 128, 64, 8, 4, split=2, descriptors=True)),  # a long reduction: as before
        (512, 3072, 2048, Tiles(128, 128, 64, 8, 4, descriptors=True)),  # 192 narrow tiles: more than a wave
        (256, 6144, 4096, Tiles(64, 128, 64, 4, 4)),  # 192 narrow tiles
        (256, 576, 576, Tiles(64, 128, 64, 4, 4)),  # 9 steps a tile: too short a reduction, not split
        (128, 2048, 2048, Tiles(64, 128, 64, 4, 4, split=4)),  # up to 128 rows: as before
        (1024, 2048, 2048, Tiles(128, 128, 64, 8, 4, descriptors=True)),  # more than 512 rows: as before
    ],
)
def test_plain_projections_of_129_to_512_rows_take_warp_specialised_tiles_in_one_wave(
    rows: int, n: int, k: int, tiles: Tiles
) -> None:
    """With ``specialised`` (the plain projection's lowering), 129 to 512 rows whose 64x128 tiles make at most
    one wave, over 2048 to 12287 inputs, take warp-specialised 64x128 tiles (eight stages up to 256 rows,
    six above); every other shape keeps the tiles it takes without, and no shape takes them without
    ``specialised`` or where tensor descriptors cannot serve."""
    assert choose_tiles(rows, n, k, specialised=True) == tiles
    if tiles.specialised:
        assert not choose_tiles(rows, n, k).specialised
        assert not choose_tiles(rows, n, k, specialised=True, describable=False).specialised


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        # the 8B shape's 512-row chunk: [q|k|v] (192 square tiles), output (128) and down (128) projections
        (512, 6144, 4096, Tiles(128, 256, 64, 8, 4, descriptors=True, specialised=True)),
        (512, 4096, 4096, Tiles(128, 128, 64, 8, 5, descriptors=True, specialised=True)),
        (512, 4096, 14336, Tiles(128, 128, 64, 8, 5, descriptors=True, specialised=True)),
        (384, 4096, 4096, Tiles(128, 128, 64, 8, 5, descriptors=True, specialised=True)),  # 96 square tiles
        (512, 8448, 4096, Tiles(128, 256, 64, 8, 4, descriptors=True, specialised=True)),  # 264: two waves
        (512, 2816, 4096, Tiles(128, 128, 64, 8, 5, descriptors=True, specialised=True)),  # 88: two thirds
        (512, 2688, 4096, Tiles(128, 64, 64, 8, 3)),  # 84 square tiles: short of two thirds, as before
        (512, 8704, 4096, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # 272 square tiles: over two waves
        (512, 3072, 2048, Tiles(128, 128, 64, 8, 4, descriptors=True)),  # 2048 inputs: as before
        (256, 6144, 4096, Tiles(64, 128, 64, 4, 4)),  # a decode batch: as before
        (1024, 4096, 4096, Tiles(128, 128, 64, 8, 3, descriptors=True)),  # more than 512 rows: as before
    ],
)
def test_prefill_chunks_over_long_reductions_take_warp_specialised_128x128_or_128x256_tiles(
    rows: int, n: int, k: int, tiles: Tiles
) -> None:
    """With ``specialised``, 257 to 512 rows over 4096 or more inputs whose 128x128 tiles make two thirds of a
    wave to one take warp-specialised 128x128 tiles on five stages, one to two waves 128x256 tiles on four;
    nothing changes without ``specialised`` or tensor descriptors, or outside those bounds."""
    assert choose_tiles(rows, n, k, specialised=True) == tiles
    if tiles.specialised:
        assert not choose_tiles(rows, n, k).specialised
        assert not choose_tiles(rows, n, k, specialised=True, describable=False).specialised


@pytest.mark.parametrize(("rows", "k"), [(256, 4096), (256, 2048), (129, 2048)])
def test_a_vocabulary_wide_projection_of_a_large_batch_takes_persistent_warp_specialised_256_row_tiles(
    rows: int, k: int
) -> None:
    """The LM head of 129 to 256 rows: with ``specialised`` its 256x128 tiles run on one persistent
    warp-specialised program a multiprocessor; without, or without tensor descriptors, as before."""
    tall = Tiles(256, 128, 64, 8, 4, descriptors=True)
    assert choose_tiles(rows, 128256, k, specialised=True) == dataclasses.replace(tall, persistent=1, specialised=True)
    assert choose_tiles(rows, 128256, k) == tall
    assert not choose_tiles(rows, 128256, k, specialised=True, describable=False).specialised


def test_a_tile_wider_than_per_thread_loads_take_is_refused_without_tensor_descriptors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 weights cannot go through tensor descriptors: a 128x256 tile on them is refused by name, and
    the same tile over bf16 weights is launched through descriptors, over the float32 inputs staged in bf16
    (or their staged norm)."""
    wide = Tiles(128, 256, 64, 8, 3, descriptors=True)
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: wide)
    with pytest.raises(
        LoweringError, match=r"a 128x256 tile needs tensor descriptors .* at most 128 rows and 128 columns"
    ):
        _lower("linear", {"x": f32(512, 256), "weight": f32(512, 256), "out": f32(512, 512)}, weights=("weight",))
    arrays = {"x": f32(512, 256), "weight": bf16(512, 256), "out": f32(512, 512)}
    _context, launches = _lower("linear", arrays, weights=("weight",))
    assert [launch.symbol for launch in launches] == ["stage_rows_kernel", "projection_kernel"]
    assert [p.buffer for p in launches[0].params[:2]] == ["x", "workspace.projection_input_bf16"]
    assert launches[1].params[0].buffer == "workspace.projection_input_bf16" and list(launches[1].grid) == [4, 2, 1]
    arrays["norm_weight"] = f32(256)
    _, launches = _lower("rmsnorm_linear", arrays, {"eps": 1e-5}, weights=("weight", "norm_weight"))
    assert launches[-1].symbol == "projection_kernel" and list(launches[-1].grid) == [4, 2, 1]


def test_persistent_tiles_launch_a_program_a_multiprocessor_over_every_so_many_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A persistent tile takes ``persistent`` programs a multiprocessor (fewer when there are fewer tiles),
    with its tensor descriptors in the kernel's scratch; float32 inputs and a split are refused."""
    arrays = {"x": f32(256, 2048), "weight": bf16(16384, 2048), "norm_weight": f32(2048), "out": f32(256, 16384)}
    persistent = Tiles(128, 128, 64, 8, 3, descriptors=True, persistent=1)
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: persistent)
    context, launches = _lower("rmsnorm_linear", arrays, {"eps": 1e-5}, weights=("weight", "norm_weight"))
    launch = launches[-1]
    runtime = ["workspace.projection_input_bf16", "weight", "out", "out", (mf.PARAM_KIND_I32, 256)]
    _check(context, launch, runtime, grid=[132], programmatic=False)  # 256 tiles over 132 programs
    assert launch.symbol == "persistent_projection_kernel"
    small = {"x": f32(130, 256), "weight": bf16(1000, 256), "norm_weight": f32(256), "out": f32(130, 1000)}
    _, launches = _lower("rmsnorm_linear", small, {"eps": 1e-5}, weights=("weight", "norm_weight"))
    assert list(launches[-1].grid) == [16, 1, 1]  # 2 x 8 tiles: one program each
    with pytest.raises(LoweringError, match="persistent tiles need tensor descriptors"):
        _lower("linear", {"x": f32(256, 2048), "weight": f32(4096, 2048), "out": f32(256, 4096)}, weights=("weight",))
    split = Tiles(128, 128, 64, 8, 3, split=2, descriptors=True, persistent=1)
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: split)
    with pytest.raises(LoweringError, match="and no split"):
        _lower("rmsnorm_linear", arrays, {"eps": 1e-5}, weights=("weight", "norm_weight"))


def test_a_split_projection_is_one_launch_over_partials_and_counts() -> None:
    arrays = {"x": f32(8, 8192), "weight": bf16(2048, 8192), "residual": f32(8, 2048), "out": f32(8, 2048)}
    context, launches = _lower("linear_add", arrays, weights=("weight",))
    stage, launch = launches  # the float32 rows staged in bf16 first
    _check(context, stage, ["x", "workspace.projection_input_bf16"], grid=[8, 8])
    runtime = ["workspace.projection_input_bf16", "weight", "out", "residual", "workspace.projection_partials"]
    runtime += ["workspace.projection_splits_done", (mf.PARAM_KIND_I32, 8)]
    _check(context, launch, runtime, grid=[1, 32, 5])  # row tiles, column tiles, splits
    sizes = {decl.name: decl.shape[0].size for decl in context.manifest.buffers if decl.name.startswith("workspace.")}
    assert sizes == {
        "workspace.projection_input_bf16": 8 * 8192,
        "workspace.projection_partials": 32 * 5 * 16 * 64,
        "workspace.projection_splits_done": 32,
    }


@pytest.mark.parametrize(
    ("rows", "n", "grid"), [(512, 128256, [4, 1002, 1]), (512, 16384, [4, 128, 1]), (256, 128256, [132, 1, 1])]
)
def test_the_row_tiles_of_a_column_block_are_the_grids_fastest_dimension(rows: int, n: int, grid: list[int]) -> None:
    """The row tiles sharing a weight block are scheduled side by side (the grid's first dimension), so
    a weight larger than L2 (the 1B LM head of a 512-token chunk) streams from HBM once, not once per row
    tile; at 256 rows that LM head is one 256-row tile a weight block, 1002 tiles over 132 persistent
    programs that number them the same way (row tile fastest)."""
    arrays = {"x": f32(rows, 2048), "weight": bf16(n, 2048), "out": f32(rows, n)}
    context, launches = _lower("linear", arrays, weights=("weight",))
    _stage, launch = launches
    runtime = ["workspace.projection_input_bf16", "weight", "out", "out", "out", "out", (mf.PARAM_KIND_I32, rows)]
    _check(context, launch, runtime, grid=grid, programmatic=False)


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "page_tokens", "width", "splits"),
    [(1, 32, 8, 64, 16, 64, 16), (3, 4, 2, 8, 4, 16, 1), (2, 9, 3, 128, 16, 32, 8)],
)
def test_paged_attention_is_one_launch_of_a_program_per_split(
    tokens: int, heads: int, kv_heads: int, head_dim: int, page_tokens: int, width: int, splits: int
) -> None:
    """64-position splits of the page table's span (one split where the span is shorter), for every
    (token, KV head); head sizes under 16 pad to the matrix products' tile."""
    arrays = {
        "q": f32(tokens, heads, head_dim),
        "k_plane": f32(40, page_tokens, kv_heads, head_dim),
        "v_plane": f32(40, page_tokens, kv_heads, head_dim),
        "page_table": i32(4, width),
        "token_row": i32(tokens),
        "token_position": i32(tokens),
        "out": f32(tokens, heads, head_dim),
    }
    symbolic = {"k_plane": mf.DIM_SYMBOL_CACHE_PAGES, "v_plane": mf.DIM_SYMBOL_CACHE_PAGES}
    context, launches = _lower("paged_attention", arrays, {"scale": 0.125}, symbolic=symbolic)
    (launch,) = launches
    workspaces = ["workspace.attention_max", "workspace.attention_sum", "workspace.attention_acc"]
    runtime = ["q", "k_plane", "v_plane", "page_table", "token_row", "token_position", *workspaces]
    runtime += ["workspace.attention_splits_done", "out", (mf.PARAM_KIND_F32, 0.125)]
    _check(context, launch, runtime, grid=[tokens, kv_heads, splits])
    sizes = {decl.name: decl.shape[0].size for decl in context.manifest.buffers if decl.name.startswith("workspace.")}
    assert sizes["workspace.attention_acc"] == tokens * heads * splits * head_dim
    assert sizes["workspace.attention_splits_done"] == tokens * kv_heads


def test_attention_input_rejects_a_projection_of_the_wrong_width() -> None:
    arrays = _attention_input_arrays(1, 32, 8, 64, 2048)
    arrays["weight"] = bf16(3000, 2048)
    with pytest.raises(LoweringError, match="packed rows hold 3000 values, not 3072"):
        _lower("rmsnorm_linear_rope_kv_cache_write", arrays, {"eps": 1e-5, "theta": 1e4, "style": "half"})


def test_every_operator_is_registered() -> None:
    for op in elementwise.KERNELS:
        assert (op, 1) in LOWERINGS


def test_a_buffer_is_settled_until_a_node_of_its_program_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs, updated inputs (sample's output_counts) and optional outputs end a buffer's settled state
    for the later nodes of the same program; the next program starts with every buffer settled."""
    from ignition.kernels import lowering

    seen: list[tuple[str, str, dict[str, bool]]] = []

    def recorder(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
        names = ("x", "y", "z", "counts", "ids", "logprob")
        seen.append((ctx.program, node.name, {n: ctx.settled(mf.BufferView(buffer=n)) for n in names}))
        return [mf.KernelLaunch(target="sm_90a")]

    monkeypatch.setitem(LOWERINGS, ("add", 1), recorder)
    monkeypatch.setitem(LOWERINGS, ("sample", 1), recorder)
    manifest = mf.ExecutionManifest()
    for program_name in ("first", "second"):
        program = manifest.programs.add(name=program_name)
        steps = [
            ("add", "z_from_xy", {"a": "x", "b": "y", "out": "z"}),
            ("sample", "sample", {"logits": "z", "output_counts": "counts", "ids": "ids", "logprob": "logprob"}),
            ("add", "last", {"a": "z", "b": "y", "out": "z"}),
        ]
        for op, name, args in steps:
            node = program.nodes.add(name=name)
            node.op.name, node.op.version = op, 1
            for arg, buffer in args.items():
                node.args.add(name=arg, view=mf.BufferView(buffer=buffer))
    lowering._lower_programs(LoweringContext(manifest, "sm_90a"), manifest, "sm_90a")
    everything = dict.fromkeys(("x", "y", "z", "counts", "ids", "logprob"), True)
    after_add = {**everything, "z": False}
    after_sample = {**after_add, "counts": False, "ids": False, "logprob": False}
    assert seen == [
        ("first", "z_from_xy", everything),
        ("first", "sample", after_add),
        ("first", "last", after_sample),
        ("second", "z_from_xy", everything),
        ("second", "sample", after_add),
        ("second", "last", after_sample),
    ]


def test_descriptor_tiles_pass_every_program_its_scratch_in_one_workspace() -> None:
    """A wide projection over staged 16-bit rows reads through tensor descriptors, which Triton writes to
    global scratch: the launch passes the kernel-scratch workspace, ``programs x bytes`` of it, as its
    first scratch parameter."""
    arrays = {"x": f32(256, 2048), "weight": bf16(16384, 2048), "norm_weight": f32(2048), "out": f32(256, 16384)}
    context, launches = _lower("rmsnorm_linear", arrays, {"eps": 1e-5}, weights=("weight", "norm_weight"))
    staged, launch = launches
    kernel = _compiled(launch)
    assert kernel.global_scratch_bytes > 0 and kernel.scratch_params == 2
    runtime = ["workspace.projection_input_bf16", "weight", "out", "out", "out", "out", (mf.PARAM_KIND_I32, 256)]
    _check(context, launch, runtime, grid=[2, 128], programmatic=False)
    sizes = [int(d.shape[0].size) for d in context.manifest.buffers if d.name == "workspace.kernel_scratch"]
    assert sizes == [2 * 128 * kernel.global_scratch_bytes]
    assert "workspace.projection_input_bf16" in {param.buffer for param in staged.params}


@pytest.mark.parametrize(
    ("op", "k", "weight_dtype"),
    [
        ("linear", 1020, mf.DTYPE_BF16),  # float32 inputs staged in rows of 2040 bytes
        ("linear", 2048, mf.DTYPE_F32),  # float32 weights read float32 inputs as they are
        ("rmsnorm_linear", 1020, mf.DTYPE_BF16),  # rows of 2040 bytes
        ("rmsnorm_linear", 2048, mf.DTYPE_F32),  # float32 weights stage float32 rows
    ],
)
def test_inputs_tensor_descriptors_cannot_serve_take_per_thread_loads(op: str, k: int, weight_dtype: int) -> None:
    """Float32 weights, and rows whose bytes are not a multiple of 16, keep per-thread loads, with
    the tiles measured for them (128x128 on eight warps, three stages) and no global scratch."""
    weight = bf16(16384, k) if weight_dtype == mf.DTYPE_BF16 else f32(16384, k)
    arrays = {"x": f32(256, k), "weight": weight, "out": f32(256, 16384)}
    attributes: dict[str, float] = {}
    if op == "rmsnorm_linear":
        arrays["norm_weight"], attributes["eps"] = f32(k), 1e-5
    context, launches = _lower(op, arrays, attributes, weights=("weight", "norm_weight"))
    launch = launches[-1]
    assert _compiled(launch).global_scratch_bytes == 0
    assert launch.block[0] == 8 * 32 and list(launch.grid) == [2, 128, 1]
    assert all(d.name != "workspace.kernel_scratch" for d in context.manifest.buffers)


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (256, 16384, 2048, Tiles(128, 128, 64, 8, 3)),
        (256, 4096, 14336, Tiles(64, 128, 64, 4, 4)),
        (512, 3072, 2048, Tiles(128, 64, 64, 8, 3)),
    ],
)
def test_tiles_without_descriptors_are_those_measured_with_per_thread_loads(
    rows: int, n: int, k: int, tiles: Tiles
) -> None:
    assert choose_tiles(rows, n, k, describable=False) == tiles


@pytest.mark.parametrize(
    ("rows", "n", "k", "describable", "tiles"),
    [
        # the 8B projection at 256 rows: 96 tiles of 128x128 through descriptors, else its 64x128 tiles
        (256, 6144, 4096, True, Tiles(128, 128, 64, 8, 4, descriptors=True)),
        (256, 6144, 4096, False, Tiles(64, 128, 64, 4, 4)),
        (129, 6144, 4096, True, Tiles(128, 128, 64, 8, 4, descriptors=True)),
        (256, 3072, 2048, True, Tiles(64, 128, 64, 4, 4)),  # the 1B one: 48 square tiles, under half a wave
        (64, 3072, 2048, True, Tiles(64, 64, 128, 4, 3, split=2)),  # 64 rows: split within one wave
        (64, 960, 576, True, Tiles(64, 64, 128, 4, 3)),  # the 135M one: 576 inputs, not split (five parts before)
        (128, 960, 576, True, Tiles(64, 128, 64, 4, 4)),  # and at 128 rows
        (512, 3072, 2048, True, None),  # a prefill chunk's descriptor tiles: projected, then rotated
        (1, 3072, 2048, True, None),  # streaming rows
    ],
)
def test_rotary_tiles(rows: int, n: int, k: int, describable: bool, tiles: Tiles | None) -> None:
    plain = choose_tiles(rows, n, k, describable=describable)
    assert linear.rotary_tiles(plain, rows, n, k, describable=describable) == tiles


def test_a_prefill_chunks_attention_input_projects_after_its_norm_the_ordinary_way() -> None:
    """512 tokens of the 8B shape: the staged norm, the projection into a workspace (waiting on the norm the
    ordinary way, see ``linear.ORDINARY_WAIT_ROWS``), then the rotation and cache write, which waits on the
    projection programmatically."""
    arrays = _attention_input_arrays(512, 32, 8, 128, 4096)
    attributes = {"eps": 1e-5, "theta": 10000.0, "style": "half"}
    _context, launches = _lower("rmsnorm_linear_rope_kv_cache_write", arrays, attributes)
    assert [launch.symbol for launch in launches] == [
        "_rmsnorm_kernel", "specialised_projection_kernel", "rope_cache_kernel"
    ]  # fmt: skip
    assert [launch.programmatic_wait for launch in launches] == [True, False, True]
