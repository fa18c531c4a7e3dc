"""Ignition's sliding-window builds: the declared history region, the attention window, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from ignition.build import assemble, check_window
from ignition.cli import main as ignition_main
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

CAPS = Capacities(max_rows=2, prefill_tokens=(16,), decode_rows=(1, 2), page_tokens=4, cache_pages=32, context=64)


def _attention_windows(manifest: mf.ExecutionManifest) -> set[int | None]:
    windows: set[int | None] = set()
    for program in manifest.programs:
        for node in program.nodes:
            if node.op.name == "paged_attention":
                windows.add(next((a.int_value for a in node.attributes if a.name == "window"), None))
    return windows


@pytest.mark.parametrize("kernel_graph", [False, True])
def test_a_windowed_build_declares_its_window_on_the_history_and_every_attention(kernel_graph: bool) -> None:
    windowed = Capacities(**{**CAPS.__dict__, "window": 6})
    serving, builder, _ = assemble(synthetic_declaration("tiny", seed=1), windowed, kernel_graph=kernel_graph)
    paged, paged_builder, _ = assemble(synthetic_declaration("tiny", seed=1), CAPS, kernel_graph=kernel_graph)
    (region,) = [r for r in serving.model.cache.regions if r.name == "kv"]
    (unlimited,) = [r for r in paged.model.cache.regions if r.name == "kv"]
    assert (region.kind, region.window_tokens, region.tokens_per_record) == (ct.HISTORY_KIND_SLIDING_WINDOW, 6, 1)
    assert (unlimited.kind, unlimited.window_tokens) == (ct.HISTORY_KIND_PAGED_KV, 0)
    assert list(region.planes) == list(unlimited.planes)
    assert [v.region for v in serving.model.cache.page_table_views] == ["kv"]
    assert _attention_windows(builder.manifest) == {6}
    assert _attention_windows(paged_builder.manifest) == {None}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--window", "8", "--targets", "reference,sm_80"],
            "sliding-window attention (--window) is built for the targets reference, sm_90a only; build without "
            "--window for sm_80",
        ),
        (["--window", "-1"], "--window must be 0 (unlimited) or positive, got -1"),
        (
            ["--window", "8", "--speculative", "self-draft", "--draft-tokens", "2"],
            "sliding-window attention (--window) cannot be combined with --speculative self-draft",
        ),
    ],
)
def test_the_cli_refuses_a_window_it_cannot_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "refused.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet", *extra]
    assert ignition_main(argv) == 1
    assert capsys.readouterr().err == f"ignition: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_build_core_callers_get_the_same_refusal() -> None:
    with pytest.raises(ValueError, match=r"built for the targets reference, sm_90a only"):
        check_window(Capacities(window=8), ("sm_80",))
    check_window(Capacities(window=8), ("reference", "sm_90a"))
    check_window(Capacities(), ("sm_90a",))


@pytest.mark.parametrize(
    "targets", ["reference", pytest.param("reference,sm_90a", marks=pytest.mark.kernels)]  # sm_90a: tox -e kernels
)
def test_the_cli_builds_a_windowed_core(tmp_path: Path, capsys: pytest.CaptureFixture[str], targets: str) -> None:
    out = tmp_path / "windowed.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet", "--window", "8"]
    argv += ["--targets", targets]
    argv += ["--max-rows", "2", "--page-tokens", "4", "--cache-pages", "32", "--context", "64"]
    assert ignition_main(argv) == 0
    assert out.exists()
    capsys.readouterr()
