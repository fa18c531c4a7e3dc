"""The reference definition of ``rmsnorm_swiglu_mlp_add``: the composition of the operators it fuses."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from helios_core.backends import reference
from helios_core.backends.reference_kernels import float32_to_bf16_bits
from helios_core.errors import ContractError
from helios_core.ops import catalogue
from helios_core.wire import manifest_pb2 as mf

_WIRE = {np.dtype(np.float32): mf.DTYPE_F32, np.dtype(np.uint16): mf.DTYPE_BF16}


def _run(op: str, arrays: Mapping[str, np.ndarray], attributes: Mapping[str, float]) -> dict[str, np.ndarray]:
    """One node of ``op`` through the reference backend's adapter, over copies of ``arrays``."""
    copies = {name: np.array(array, copy=True) for name, array in arrays.items()}
    bound = {name: reference._Bound(array, _WIRE[array.dtype]) for name, array in copies.items()}
    step = reference._ADAPTERS[(op, 1)](reference._Node(f"node {op}", bound, dict(attributes)))
    step()
    return copies


def _mlp_arrays(rows: int, hidden: int, width: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, hidden)).astype(np.float32),
        "norm_weight": rng.uniform(0.5, 1.5, hidden).astype(np.float32),
        "gate_up_weight": float32_to_bf16_bits(rng.standard_normal((2 * width, hidden)).astype(np.float32) * 0.1),
        "down_weight": float32_to_bf16_bits(rng.standard_normal((hidden, width)).astype(np.float32) * 0.1),
        "residual": rng.standard_normal((rows, hidden)).astype(np.float32),
        "out": np.full((rows, hidden), np.nan, dtype=np.float32),
    }


@pytest.mark.parametrize(("rows", "hidden", "width"), [(1, 64, 96), (5, 48, 40)])
def test_the_mlp_is_the_norm_and_gate_up_projection_then_swiglu_and_the_down_projection(
    rows: int, hidden: int, width: int
) -> None:
    arrays = _mlp_arrays(rows, hidden, width, seed=rows)
    got = _run("rmsnorm_swiglu_mlp_add", arrays, {"eps": 1e-5})["out"]
    gate_up = np.zeros((rows, 2 * width), np.float32)
    first = {"x": arrays["x"], "norm_weight": arrays["norm_weight"], "weight": arrays["gate_up_weight"], "out": gate_up}
    gate_up = _run("rmsnorm_linear", first, {"eps": 1e-5})["out"]
    second = {"gate_up": gate_up, "weight": arrays["down_weight"], "residual": arrays["residual"], "out": arrays["out"]}
    want = _run("silu_mul_linear_add", second, {})["out"]
    assert np.isfinite(got).all()
    assert np.array_equal(got, want)


def test_the_mlp_needs_gate_and_up_rows_for_every_down_input() -> None:
    arrays = _mlp_arrays(2, 32, 24, seed=3)
    arrays["gate_up_weight"] = arrays["gate_up_weight"][:47]
    with pytest.raises(ContractError, match=r"gate_up_weight must hold 2 x 24 rows"):
        _run("rmsnorm_swiglu_mlp_add", arrays, {"eps": 1e-5})


def test_the_catalogue_names_the_mlp_and_its_arguments() -> None:
    spec = catalogue.lookup("rmsnorm_swiglu_mlp_add", 1)
    assert spec is not None
    assert spec.inputs == ("x", "norm_weight", "gate_up_weight", "down_weight", "residual")
    assert spec.outputs == ("out",) and spec.attributes == ("eps",)
