"""The recurrent and latent recipes lower to sm_90a launches, compiled to cubins, on a machine without a GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels import latent as latent_kernels
from ignition.kernels import recurrence
from ignition.kernels.lowering import LOWERINGS, LoweringError
from ignition.recipes.latent import assemble_latent, check_latent_targets, latent_declaration
from ignition.recipes.llama import Capacities
from ignition.recipes.recurrent import assemble_recurrent, check_recurrent_targets, recurrent_declaration

from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import lower

CAPS = Capacities(max_rows=4, prefill_tokens=(16,), decode_rows=(1, 4), cache_pages=32, context=64)

HISTORY_SYMBOLS = {
    "gated_recurrence_scan": "recurrence_scan_kernel",
    "gated_recurrence_step": "recurrence_step_kernel",
    "latent_cache_write": "latent_mean_write_kernel",
    "latent_attention": "latent_attention_kernel",
}


def _check_every_node_launches(manifest: mf.ExecutionManifest, modules: dict[str, bytes]) -> set[str]:
    """Every node has sm_90a launches whose modules are stored as non-empty cubins; returns the
    operators seen."""
    assert list(manifest.targets) == ["sm_90a"]
    declared = {m.name: m.resource_id for m in manifest.modules}
    seen: set[str] = set()
    for program in manifest.programs:
        for node in program.nodes:
            assert node.launches, (program.name, node.name)
            for launch in node.launches:
                assert launch.target == "sm_90a" and launch.programmatic_wait
                assert modules[declared[launch.module]][:4] == b"\x7fELF"
            if node.op.name in HISTORY_SYMBOLS:
                assert [launch.symbol for launch in node.launches] == [HISTORY_SYMBOLS[node.op.name]]
            seen.add(node.op.name)
    return seen


@pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels
def test_recurrent_core_lowers_every_node_for_sm_90a() -> None:
    _, builder, resources = assemble_recurrent(recurrent_declaration("tiny"), CAPS, gpu_targets=["sm_90a"])
    modules = {r.id: r.data for r in resources if r.kind == cb.RESOURCE_KIND_MODULE}
    seen = _check_every_node_launches(builder.manifest, modules)
    assert {"gated_recurrence_scan", "gated_recurrence_step"} <= seen
    scan = next(
        n for p in builder.manifest.programs if p.name == "prefill_p16" for n in p.nodes if n.name == "l0.recurrence"
    )
    assert tuple(scan.launches[0].grid) == (4, 1, 1)  # one program per lane of the 32 state channels


@pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels
def test_latent_core_with_records_and_a_page_offset_lowers_every_node_for_sm_90a() -> None:
    model = latent_declaration("tiny", tokens_per_record=2, page_offset=1)
    serving, builder, resources = assemble_latent(model, dataclasses.replace(CAPS, snapshots=0), gpu_targets=["sm_90a"])
    modules = {r.id: r.data for r in resources if r.kind == cb.RESOURCE_KIND_MODULE}
    seen = _check_every_node_launches(builder.manifest, modules)
    assert {"latent_cache_write", "latent_attention"} <= seen
    region = serving.model.cache.regions[0]
    assert region.kind == ct.HISTORY_KIND_PAGED_LATENT and region.tokens_per_record == 2


def test_the_history_operators_have_lowerings() -> None:
    assert LOWERINGS[("gated_recurrence_scan", 1)] is recurrence.lower_gated_recurrence_scan
    assert LOWERINGS[("latent_attention", 1)] is latent_kernels.lower_latent_attention


def test_one_record_a_token_writes_with_one_program_a_token() -> None:
    arrays = {
        "latent": np.zeros((6, 12), np.float32),
        "slots": np.zeros(6, np.int32),
        "plane": np.zeros((4, 16, 12), np.float32),
    }
    _, launches = lower("latent_cache_write", arrays, {"tokens_per_record": 1})
    assert [(launch.symbol, tuple(launch.grid)) for launch in launches] == [("latent_write_kernel", (6, 1, 1))]


def test_the_targets_without_kernels_are_refused() -> None:
    check_recurrent_targets(["reference", "sm_90a"])
    check_latent_targets(["reference", "sm_90a"])
    with pytest.raises(ValueError, match="recurrent-synthetic is built for the targets reference, sm_90a only"):
        check_recurrent_targets(["sm_80"])
    with pytest.raises(ValueError, match="latent-synthetic is built for the targets reference, sm_90a only"):
        check_latent_targets(["reference", "sm_80"])


def test_lowering_refuses_a_state_of_another_width() -> None:
    arrays = {
        "gate": np.zeros((4, 8), np.float32),
        "x": np.zeros((4, 8), np.float32),
        "rows": np.zeros(4, np.int32),
        "state": np.zeros((4, 16), np.float32),
        "out": np.zeros((4, 8), np.float32),
    }
    with pytest.raises(LoweringError, match=r"state must be \[rows, 8\], got \[4, 16\]"):
        lower("gated_recurrence_step", arrays)


def test_lowering_refuses_up_projections_of_another_shape() -> None:
    arrays = {
        "q": np.zeros((2, 2, 4), np.float32),
        "plane": np.zeros((4, 8, 6), np.float32),
        "w_uk": np.zeros((8, 5), np.float32),
        "w_uv": np.zeros((8, 6), np.float32),
        "page_table": np.zeros((2, 3), np.int32),
        "token_row": np.zeros(2, np.int32),
        "token_position": np.zeros(2, np.int32),
        "out": np.zeros((2, 2, 4), np.float32),
    }
    with pytest.raises(LoweringError, match=r"w_uk must be \[8, 6\], got \[8, 5\]"):
        lower("latent_attention", arrays, {"scale": 0.5, "tokens_per_record": 1})
