"""``rmsnorm_swiglu_mlp_add`` lowers to the [gate | up] projection ending in SwiGLU, then the down
projection over its activation, on a machine without a GPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels import linear
from ignition.kernels.linear import Tiles, choose_tiles
from ignition.kernels.lowering import LoweringContext, LoweringError

from helios_core.wire import manifest_pb2 as mf
from tests.ignition.test_lowering_elementwise import _check, _lower, bf16, f32

MLP_WEIGHTS = ("norm_weight", "gate_up_weight", "down_weight")


def _mlp(rows: int, hidden: int, width: int, *, weight: type = np.uint16) -> dict[str, np.ndarray]:
    make = bf16 if weight is np.uint16 else f32
    return {
        "x": f32(rows, hidden),
        "norm_weight": f32(hidden),
        "gate_up_weight": make(2 * width, hidden),
        "down_weight": make(hidden, width),
        "residual": f32(rows, hidden),
        "out": f32(rows, hidden),
    }


def _workspaces(context: LoweringContext) -> dict[str, tuple[int, int]]:
    return {
        decl.name: (int(decl.dtype), int(decl.shape[0].size))
        for decl in context.manifest.buffers
        if decl.name.startswith("workspace.")
    }


@pytest.mark.parametrize(
    ("hidden", "width", "programs"),
    [(2048, 8192, 528), (4096, 14336, 1056), (576, 1000, 500)],  # 4 a multiprocessor, 8 over 4096 inputs
)
def test_one_row_streams_gate_and_up_rows_into_a_float32_activation(hidden: int, width: int, programs: int) -> None:
    """One row: the streaming kernel over the gate and up rows of half as many columns a tile (as many
    programs as the plain projection of both halves), then the down projection over the float32
    activation."""
    context, launches = _lower("rmsnorm_swiglu_mlp_add", _mlp(1, hidden, width), {"eps": 1e-5}, weights=MLP_WEIGHTS)
    gate_up, down = launches
    plain = choose_tiles(1, 2 * width, hidden)
    assert gate_up.symbol == "streaming_projection_kernel"
    assert gate_up.grid[0] == min(-(-width // (plain.block_n // 2)), 132 * plain.per_sm) == programs
    runtime = ["x", "gate_up_weight", "workspace.swiglu_activation", "workspace.swiglu_activation", "norm_weight"]
    _check(context, gate_up, [*runtime, (mf.PARAM_KIND_F32, 1e-5), (mf.PARAM_KIND_I32, 1)])
    assert down.params[0].buffer == "workspace.swiglu_activation"
    assert [p.buffer for p in down.params[1:4]] == ["down_weight", "out", "residual"]
    assert _workspaces(context) == {"workspace.swiglu_activation": (mf.DTYPE_F32, width)}


def test_many_rows_stage_the_norm_then_end_the_gate_up_tiles_in_swiglu_in_bf16(
    launched_constants: list[dict[str, Any]],
) -> None:
    """256 rows: the norm staged in bf16, [gate | up] in 128x128 blocks of each half through tensor
    descriptors (four stages, half the grid of 128x128 tiles over both halves), the activation in bf16,
    then the down projection over it with the tiles chosen for its shape (warp-specialised 64x128 tiles,
    eight stages: one wave of them over 8192 inputs)."""
    context, launches = _lower("rmsnorm_swiglu_mlp_add", _mlp(256, 2048, 8192), {"eps": 1e-5}, weights=MLP_WEIGHTS)
    norm, gate_up, down = launches
    assert [launch.symbol for launch in launches] == [
        "_rmsnorm_kernel", "projection_kernel", "specialised_projection_kernel"
    ]  # fmt: skip
    assert "workspace.projection_input_bf16" in {p.buffer for p in norm.params}
    assert [p.buffer for p in gate_up.params[:3]] == [
        "workspace.projection_input_bf16", "gate_up_weight", "workspace.swiglu_activation_bf16"
    ]  # fmt: skip
    assert list(gate_up.grid) == [2, 64, 1]
    assert (
        launched_constants[1]["BLOCK_N"] == 128
        and launched_constants[1]["SWIGLU"] is True
        and launched_constants[1]["DESCRIPTORS"] is True
    )
    assert launched_constants[1]["N"] == 8192 and launched_constants[1]["BLOCK_M"] == 128
    assert [p.buffer for p in down.params[:4]] == ["workspace.swiglu_activation_bf16", "down_weight", "out", "residual"]
    wanted = choose_tiles(256, 2048, 8192, specialised=True)
    assert wanted == Tiles(64, 128, 64, 4, 8, descriptors=True, specialised=True)
    assert list(down.grid) == [256 // wanted.block_m, 2048 // wanted.block_n, wanted.split] == [4, 16, 1]
    assert launched_constants[2]["SWIGLU"] is False and launched_constants[2]["RESIDUAL"] is True
    assert launched_constants[2]["STAGES"] == 8 and down.block[0] == 32 * (4 + 4)  # a warpgroup holds the copy warp
    assert _workspaces(context)["workspace.swiglu_activation_bf16"] == (mf.DTYPE_BF16, 256 * 8192)


WHOLE_BLOCKS = Tiles(128, 128, 64, 8, 4, descriptors=True)
"""128x128 blocks of each half, four stages, one program a tile."""


@pytest.mark.parametrize(
    ("rows", "hidden", "width", "plain", "wanted"),
    [
        # the 8B prefill chunk (persistent plain tiles) and the 8B decode at batch 256
        (512, 4096, 14336, Tiles(128, 128, 64, 8, 4, descriptors=True, persistent=1), WHOLE_BLOCKS),
        (256, 4096, 14336, Tiles(128, 128, 64, 8, 3, descriptors=True), WHOLE_BLOCKS),
        (256, 2048, 8192, Tiles(128, 128, 64, 8, 3, descriptors=True), WHOLE_BLOCKS),  # 128 blocks: 97 % of a wave
        # a vocabulary-wide [gate | up] (4 waves of 128-column tiles) of 256 rows: 256x128 plain tiles
        (256, 2048, 34000, Tiles(256, 128, 64, 8, 4, descriptors=True), WHOLE_BLOCKS),
        # 48 whole blocks: half as wide (96 programs)
        (512, 576, 1536, Tiles(128, 128, 64, 8, 4, descriptors=True), Tiles(128, 64, 64, 8, 4, descriptors=True)),
        (64, 2048, 8192, Tiles(64, 64, 128, 4, 3), Tiles(64, 32, 128, 4, 3)),  # 64-row tiles: half as wide
        (8, 576, 1536, Tiles(16, 64, 128, 4, 4, split=3), Tiles(16, 32, 128, 4, 4, split=3)),  # a split
    ],
)
def test_swiglu_tiles_take_whole_128_column_blocks_of_each_half_where_the_plain_tile_is_128x128(
    rows: int, hidden: int, width: int, plain: Tiles, wanted: Tiles
) -> None:
    """The [gate | up] projection ending in SwiGLU over the tile the plain projection would take: unsplit
    128x128 or 256x128 descriptor tiles (persistent or not) become 128x128 blocks of each half with four stages, one
    program a tile, where those make three quarters of a wave (99 of 132 programs) or more; every other
    tile keeps its programs with blocks half as wide."""
    assert choose_tiles(rows, 2 * width, hidden) == plain
    assert linear.swiglu_tiles(plain, rows, 2 * width) == wanted


def _halved(plain: Tiles, *_args: Any, **_kwargs: Any) -> Tiles:
    """The plain tile with blocks of each half half as wide: forced tiles keep their kind (persistent or not)."""
    return dataclasses.replace(plain, block_n=plain.block_n // 2)


def test_float32_weights_keep_a_float32_activation() -> None:
    context, launches = _lower(
        "rmsnorm_swiglu_mlp_add", _mlp(64, 256, 512, weight=np.float32), {"eps": 1e-5}, weights=MLP_WEIGHTS
    )
    assert launches[-1].params[0].buffer == "workspace.swiglu_activation"
    assert _workspaces(context)["workspace.swiglu_activation"] == (mf.DTYPE_F32, 64 * 512)


def test_a_split_swiglu_tile_stores_the_gate_and_the_up_partials() -> None:
    """8 rows of the 135M shape: 48 column tiles of 32 a half, the reduction split three ways, each
    split storing two partial tiles."""
    assert choose_tiles(8, 3072, 576) == Tiles(16, 64, 128, 4, 4, split=3)
    context, launches = _lower("rmsnorm_swiglu_mlp_add", _mlp(8, 576, 1536), {"eps": 1e-5}, weights=MLP_WEIGHTS)
    gate_up = launches[1]
    assert list(gate_up.grid) == [1, 48, 3]
    partials = 48 * 3 * 16 * 32 * 2
    assert _workspaces(context)["workspace.projection_partials"][1] >= partials


def test_persistent_swiglu_tiles_launch_as_many_programs_as_the_plain_projection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        linear, "choose_tiles", lambda *_args, **_kwargs: Tiles(128, 128, 64, 8, 4, descriptors=True, persistent=1)
    )
    monkeypatch.setattr(linear, "swiglu_tiles", _halved)
    _, launches = _lower("rmsnorm_swiglu_mlp_add", _mlp(512, 4096, 14336), {"eps": 1e-5}, weights=MLP_WEIGHTS)
    gate_up, down = launches[1], launches[2]
    assert gate_up.symbol == down.symbol == "persistent_projection_kernel"
    assert list(gate_up.grid) == [132, 1, 1] and list(down.grid) == [4 * 32, 1, 1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gate_up_weight": bf16(1001, 64)}, "a \\[gate \\| up\\] weight needs an even number of rows, got 1001"),
        ({"down_weight": bf16(64, 100)}, r"down_weight must be \[N, 96\] for a \[gate \| up\] weight of 192 rows"),
        ({"residual": bf16(4, 64)}, "residual must be float32"),
        ({"x": bf16(4, 64)}, "x must be float32"),
    ],
)
def test_malformed_mlps_are_refused_by_name(change: dict[str, np.ndarray], message: str) -> None:
    arrays = {**_mlp(4, 64, 96), **change}
    with pytest.raises(LoweringError, match=message):
        _lower("rmsnorm_swiglu_mlp_add", arrays, {"eps": 1e-5}, weights=MLP_WEIGHTS)


def test_a_plain_projection_reads_inputs_of_the_weights_type_and_a_normalised_one_does_not() -> None:
    arrays = {"x": bf16(256, 2048), "weight": bf16(2048, 2048), "residual": f32(256, 2048), "out": f32(256, 2048)}
    _, launches = _lower("linear_add", arrays, weights=("weight",))
    assert [launch.symbol for launch in launches] == ["specialised_projection_kernel"]
    assert launches[0].params[0].buffer == "x"
    normalised = {"x": bf16(256, 2048), "weight": bf16(2048, 2048), "norm_weight": f32(2048), "out": f32(256, 2048)}
    with pytest.raises(LoweringError, match="x must be float32"):
        _lower("rmsnorm_linear", normalised, {"eps": 1e-5}, weights=("weight", "norm_weight"))
    with pytest.raises(LoweringError, match="out must be float32 where a residual is added"):
        _lower("linear_add", {**arrays, "out": bf16(256, 2048)}, weights=("weight",))


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles", "split"),
    [
        (256, 4096, 14336, (128, 128, True), 2),  # a long reduction over bf16 rows: 64 tiles, two parts each
        (128, 4096, 4096, (64, 128, False), 2),  # 32 such tiles at 128 rows
        (64, 4096, 4096, (64, 64, False), 4),  # 64 rows keep their 64-row tiles
        # one wave of warp-specialised 64x128 tiles over 2048 to 12287 inputs (eight stages up to 256 rows)
        (256, 4096, 4096, (64, 128, "specialised", 8), 1),  # the 8B output projection over bf16 attention rows
        (256, 2048, 2048, (64, 128, "specialised", 8), 1),  # the 1B one
        (256, 2048, 8192, (64, 128, "specialised", 8), 1),  # the 1B down projection over its bf16 activation
        (512, 2048, 2048, (64, 128, "specialised", 6), 1),  # a 512-row chunk of the 1B shape: six stages
        (512, 3072, 2048, (128, 128, True), 1),  # 192 such tiles at 512 rows: the 128x128 ones
        # a 512-row chunk of the 8B shape over 4096 inputs: warp-specialised 128x128 tiles, five stages
        (512, 4096, 4096, (128, 128, "specialised", 5), 1),
    ],
)
def test_a_narrow_projection_over_unstaged_bf16_rows_takes_the_tiles_measured_fastest_there(
    launched_constants: list[dict[str, Any]], rows: int, n: int, k: int, tiles: tuple[Any, ...], split: int
) -> None:
    """bf16 input rows that no launch staged (attention's, in a bf16 kernel graph) are read through tensor
    descriptors: in warp-specialised 64x128 tiles where one wave of them covers 129 to 512 rows over 2048 to
    12287 inputs; else in 128x128 tiles split within one wave where at most ``UNSTAGED_SPLIT`` parts fill it
    (65 to 256 rows); otherwise they keep the 64x128 tiles on one warpgroup measured faster there."""
    arrays = {"x": bf16(rows, k), "weight": bf16(n, k), "residual": f32(rows, n), "out": f32(rows, n)}
    _, launches = _lower("linear_add", arrays, weights=("weight",))
    constants = launched_constants[-1]
    if tiles[2] == "specialised":
        assert [launch.symbol for launch in launches] == ["specialised_projection_kernel"]
        assert (constants["BLOCK_M"], constants["BLOCK_N"], "specialised", constants["STAGES"]) == tiles
    else:
        assert [launch.symbol for launch in launches] == ["projection_kernel"]
        assert (constants["BLOCK_M"], constants["BLOCK_N"], constants["DESCRIPTORS"]) == tiles
    assert constants["SPLIT"] == split
    assert list(launches[0].grid) == [rows // tiles[0], n // tiles[1], split]
    if rows <= 256:
        # the same projection over float32 rows (staged from 3 to 64 rows and over 256, read as they are
        # above) keeps the per-thread loads of its 64-row tiles
        _lower("linear_add", {**arrays, "x": f32(rows, k)}, weights=("weight",))
        assert (launched_constants[-1]["BLOCK_M"], launched_constants[-1]["DESCRIPTORS"]) == (64, False)


@pytest.mark.parametrize(
    ("rows", "staged"), [(2, False), (8, True), (64, True), (65, False), (256, False), (512, True)]
)
def test_float32_inputs_are_staged_in_bf16_where_it_was_measured_to_pay(rows: int, staged: bool) -> None:
    """The 1B output projection: from three rows on its float32 inputs are rounded into a bf16 workspace
    first, except where 65 to 256 rows take narrow 64x128 tiles (measured slower staged)."""
    arrays = {"x": f32(rows, 2048), "weight": bf16(2048, 2048), "residual": f32(rows, 2048), "out": f32(rows, 2048)}
    _, launches = _lower("linear_add", arrays, weights=("weight",))
    assert (launches[0].symbol == "stage_rows_kernel") is staged
    assert len(launches) == (2 if staged else 1)
    assert launches[-1].params[0].buffer == ("workspace.projection_input_bf16" if staged else "x")
    assert linear.stages_float32_inputs(rows, 2048) is staged


@pytest.mark.parametrize(
    ("rows", "symbols", "waits"),
    [
        # one row: the streaming kernels, the norm inside the first; both wait programmatically
        (1, ["streaming_projection_kernel", "vector_projection_kernel"], [True, True]),
        # 16-row and 64-row tiles keep every wait programmatic (measured: up to 6 % slower steps otherwise)
        (8, ["_rmsnorm_kernel", "projection_kernel", "projection_kernel"], [True, True, True]),
        (64, ["_rmsnorm_kernel", "projection_kernel", "projection_kernel"], [True, True, True]),
        # more rows: the tiles after the staged norm and the down projection after [gate | up] wait the ordinary way
        (65, ["_rmsnorm_kernel", "projection_kernel", "projection_kernel"], [True, False, False]),
        (256, ["_rmsnorm_kernel", "projection_kernel", "specialised_projection_kernel"], [True, False, False]),
    ],
)
def test_projections_of_many_rows_after_a_launch_of_their_own_node_wait_the_ordinary_way(
    monkeypatch: pytest.MonkeyPatch, rows: int, symbols: list[str], waits: list[bool]
) -> None:
    _context, launches = _lower("rmsnorm_swiglu_mlp_add", _mlp(rows, 2048, 8192), {"eps": 1e-5}, weights=MLP_WEIGHTS)
    assert [launch.symbol for launch in launches] == symbols
    assert [launch.programmatic_wait for launch in launches] == waits
    monkeypatch.setattr(linear, "ORDINARY_WAIT_ROWS", None)  # the switch: every launch waits programmatically
    _context, launches = _lower("rmsnorm_swiglu_mlp_add", _mlp(rows, 2048, 8192), {"eps": 1e-5}, weights=MLP_WEIGHTS)
    assert [launch.programmatic_wait for launch in launches] == [True] * len(symbols)


@pytest.mark.parametrize(
    ("op", "rows", "waits"),
    [
        ("rmsnorm_linear", 2, [True]),  # the norm inside the FMA kernel
        ("rmsnorm_linear", 64, [True, True]),  # the staged norm, then 64-row tiles
        ("rmsnorm_linear", 512, [True, False]),  # the staged norm, then the tiles of a prefill chunk
        ("linear", 512, [True, False]),  # float32 rows rounded into bf16 first
        ("linear_bf16", 512, [True]),  # 16-bit rows read as they are: the node's first and only launch
    ],
)
def test_a_projection_waits_the_ordinary_way_only_after_its_own_staged_inputs(
    op: str, rows: int, waits: list[bool]
) -> None:
    arrays: dict[str, np.ndarray] = {"weight": bf16(2048, 2048), "out": f32(rows, 2048)}
    arrays["x"] = bf16(rows, 2048) if op == "linear_bf16" else f32(rows, 2048)
    if op == "rmsnorm_linear":
        arrays["norm_weight"] = f32(2048)
    weights = ("weight", "norm_weight") if op == "rmsnorm_linear" else ("weight",)
    attributes = {"eps": 1e-5} if op == "rmsnorm_linear" else {}
    _context, launches = _lower(op.removesuffix("_bf16"), arrays, attributes, weights=weights)
    assert [launch.programmatic_wait for launch in launches] == waits
