"""``ignition build llama-synthetic --engram``: the declared table, its staging entry, the residual update
after every embedding, host-fed pending tokens in the decode programs, and the options it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from ignition.build import assemble
from ignition.cli import main as ignition_main
from ignition.recipes.engram import ENGRAM_ROWS_ENTRY, ENGRAM_TABLE_RESOURCE
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

CAPS = Capacities(
    max_rows=2, prefill_tokens=(16,), decode_rows=(1, 2), page_tokens=4, cache_pages=32, context=64, engram=True
)


@pytest.mark.parametrize("kernel_graph", [False, True])
def test_an_engram_build_stages_rows_into_every_programs_residual_stream(kernel_graph: bool) -> None:
    serving, builder, resources = assemble(synthetic_declaration("tiny", seed=1), CAPS, kernel_graph=kernel_graph)
    manifest = builder.manifest
    (table,) = manifest.engram_tables
    assert (table.buffer, table.resource_id, table.max_order, table.heads_per_order, table.frames) == (
        ENGRAM_ROWS_ENTRY,
        ENGRAM_TABLE_RESOURCE,
        3,
        2,
        2,
    )
    assert (list(table.primes), table.table_rows, table.row_width) == ([61, 67, 71, 73], 272, 8)
    entry = next(e for e in manifest.transport.entries if e.name == ENGRAM_ROWS_ENTRY)
    assert (entry.dtype, list(entry.shape)) == (mf.DTYPE_F32, [16, 32])
    (stored,) = [r for r in resources if r.id == ENGRAM_TABLE_RESOURCE]
    assert len(stored.data) == 272 * 8 * 4
    embedding_programs = 0
    for program in manifest.programs:
        names = [node.name for node in program.nodes]
        if "embedding" not in names:
            continue
        embedding_programs += 1
        assert names[names.index("embedding") + 1] == "engram", program.name
        engram = program.nodes[names.index("engram")]
        args = {a.name: a.view for a in engram.args}
        assert engram.op.name == "linear_add"
        assert (args["x"].buffer, args["residual"].buffer, args["out"].buffer) == (
            ENGRAM_ROWS_ENTRY,
            "scratch.h",
            "scratch.h",
        )
        assert "load_pending_token" not in names
    assert embedding_programs == 6  # prefill, mixed, scored prefill, resume and the two decodes
    decodes = [g for g in serving.model.graphs if g.operation == ct.OPERATION_DECODE]
    assert len(decodes) == 2
    for graph in decodes:
        assert graph.pending_token.binding_destination == "input_ids"
        assert any(b.destination == "input_ids" and b.source == ct.VALUE_SOURCE_PENDING_TOKEN for b in graph.bindings)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--speculative", "history", "--draft-tokens", "2"],
            "--engram cannot be combined with --speculative: speculative programs read a device-owned pending "
            "token, and the host hashes every input id",
        ),
    ],
)
def test_the_cli_refuses_engram_with_what_it_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "refused.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet", "--engram", *extra]
    assert ignition_main(argv) == 1
    assert capsys.readouterr().err == f"ignition: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_engram_belongs_to_llama_synthetic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["build", "recurrent-synthetic", "--out", str(tmp_path / "r.core"), "--quiet", "--engram"]
    assert ignition_main(argv) == 1
    assert capsys.readouterr().err == "ignition: error: --engram belongs to llama-synthetic\n"
    assert list(tmp_path.iterdir()) == []
