"""The warp-specialised projection kernel compiles for sm_90a on the CPU: a warpgroup beside the product warps
holds its copy warp, its stages fill the shared memory the tile asks for, its tensor descriptors live in
global scratch, and its warp count keys the kernel cache; the lowering refuses the tiles it cannot take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ignition.kernels import compiler, linear
from ignition.kernels.compiler import compile_triton
from ignition.kernels.linear import Tiles
from ignition.kernels.lowering import LoweringError
from ignition.kernels.specialised import specialised_projection_kernel

from tests.ignition.test_lowering_elementwise import _lower, bf16, f32

SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "residual_ptr": "*fp32", "partial_ptr": "*fp32",
    "counter_ptr": "*i32", "rows": "i32",
}  # fmt: skip


def _constants(block_m: int, block_n: int, stages: int, *, swiglu: bool = False, split: int = 1) -> dict[str, Any]:
    return {
        "N": 2048, "K": 2048, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64, "SPLIT": split,
        "K_SPLIT": 2048 // split, "STAGES": stages, "RESIDUAL": not swiglu, "SWIGLU": swiglu, "USE_PDL": True,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("block_m", "block_n", "num_warps", "stages", "swiglu", "stage_bytes"),
    [
        (64, 128, 4, 8, False, (64 + 128) * 64 * 2),
        (128, 128, 8, 4, False, (128 + 128) * 64 * 2),
        (128, 64, 8, 4, True, (128 + 2 * 64) * 64 * 2),  # the gate's and the up's weight blocks a stage
    ],
)
def test_the_kernel_adds_a_copy_warpgroup_and_fills_its_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_m: int, block_n: int, num_warps: int, stages: int,
    swiglu: bool, stage_bytes: int,
) -> None:  # fmt: skip
    monkeypatch.setenv("IGNITION_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(compiler, "_MEMORY", {})
    constants = _constants(block_m, block_n, stages, swiglu=swiglu)
    kernel = compile_triton(specialised_projection_kernel, SIGNATURE, constants, num_warps=num_warps, num_stages=stages)
    assert kernel.symbol == "specialised_projection_kernel"
    assert kernel.num_warps == num_warps + 4  # the launch's threads: the product warps and the copy warp's group
    assert stages * stage_bytes <= kernel.shared_bytes < stages * stage_bytes + 4096
    assert kernel.global_scratch_bytes > 0 and kernel.scratch_params == 2  # the two tensor descriptors
    assert kernel.cubin.startswith(b"\x7fELF")
    monkeypatch.setattr(compiler, "_MEMORY", {})
    again = compile_triton(specialised_projection_kernel, SIGNATURE, constants, num_warps=num_warps, num_stages=stages)
    assert again == kernel  # read back from the disk cache
    keys = {
        compiler._request_key(
            specialised_projection_kernel, SIGNATURE, {**constants, "USE_PDL": True}, aligned=frozenset(),
            target="sm_90a", num_warps=warps, num_stages=stages,
        )[0]
        for warps in (4, 8)
    }  # fmt: skip
    assert len(keys) == 2


def test_the_lowering_refuses_specialised_tiles_it_cannot_feed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warp-specialised tiles read 16-bit rows through tensor descriptors, 64 inputs a step: float32 rows no
    launch stages (256 rows) and 128-input steps are refused by name."""
    arrays = {"x": bf16(256, 2048), "weight": bf16(2048, 2048), "residual": f32(256, 2048), "out": f32(256, 2048)}
    long_steps = Tiles(64, 128, 128, 4, 4, descriptors=True, specialised=True)
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: long_steps)
    with pytest.raises(LoweringError, match="warp-specialised tiles step 64 inputs"):
        _lower("linear_add", arrays, weights=("weight",))
    tiles = Tiles(64, 128, 64, 4, 8, descriptors=True, specialised=True)
    monkeypatch.setattr(linear, "choose_tiles", lambda *_args, **_kwargs: tiles)
    with pytest.raises(LoweringError, match="warp-specialised tiles need tensor descriptors"):
        _lower("linear_add", {**arrays, "x": f32(256, 2048)}, weights=("weight",))
    _, launches = _lower("linear_add", arrays, weights=("weight",))
    assert [launch.symbol for launch in launches] == ["specialised_projection_kernel"]
    assert list(launches[0].grid) == [4, 16, 1] and launches[0].block[0] == 32 * 8
    assert launches[0].params[-2].buffer == "workspace.kernel_scratch"
