"""Smoke tests of ``benchmarks/host_overhead.py``: its one-tree measurement, its JSON output, the
baseline tree extracted with ``git archive`` (or given as a directory) and measured in a subprocess that
imports that tree, its speculative rounds beside plain decode, and its refusals of bad options. Few
steps, no assertions on the timings themselves."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests import benchmark_modules

ROOT = Path(__file__).resolve().parent.parent
IN_GIT_CHECKOUT = (ROOT / ".git").exists()


def load_benchmark() -> ModuleType:
    return benchmark_modules.load_benchmark("host_overhead")


def test_measure_only_prints_conditions_and_one_row_per_batch_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    assert benchmark.main(["--measure-only", "--json", "--no-pin", "--steps", "4"]) == 0
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["batch"] for row in found["rows"]] == [1, 16, 64, 256]
    assert all(row["rounds"] >= 2 and row["host_us"] > 0 for row in found["rows"])
    assert set(found["conditions"]["threads"]) == {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert Path(found["conditions"]["helios_core"]) == ROOT / "helios_core"


@pytest.mark.skipif(not IN_GIT_CHECKOUT, reason="needs the git checkout")
def test_a_baseline_tree_is_extracted_and_measured_with_its_own_imports(tmp_path: Path) -> None:
    benchmark = load_benchmark()
    commit = benchmark.extract_tree("HEAD", tmp_path)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert commit == head.stdout.strip()
    assert (tmp_path / "helios_core" / "runtime" / "engine.py").is_file()
    measurement = benchmark.measure_tree(tmp_path, steps=4, text=False)
    assert measurement.conditions["helios_core"] == str(tmp_path.resolve() / "helios_core")
    assert measurement.conditions["ignition"] == str(tmp_path.resolve() / "contrib" / "ignition" / "ignition")
    assert [row.batch for row in measurement.rows] == [1, 16, 64, 256]


@pytest.mark.skipif(not IN_GIT_CHECKOUT, reason="needs the git checkout")
def test_baseline_run_prints_one_table_with_both_trees(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    assert benchmark.main(["--baseline", "HEAD", "--repeats", "1", "--steps", "4", "--no-pin"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("baseline: HEAD (")
    header = lines.index(next(line for line in lines if line.startswith("| batch |")))
    assert [line.split("|")[1].strip() for line in lines[header + 2 :]] == ["1", "16", "64", "256"]


def test_an_unknown_baseline_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    assert benchmark.main(["--baseline", "no-such-ref-for-the-benchmark", "--steps", "4", "--no-pin"]) == 1
    error = capsys.readouterr().err
    assert error == f"host_overhead: --baseline 'no-such-ref-for-the-benchmark' does not name a commit of {ROOT}\n"


SPECULATIVE = ["--speculative", "history", "--batches", "1,16", "--steps", "60", "--no-pin"]
"""Enough tokens per request for a history of a whole cycle, then speculative rounds."""


def test_speculative_rounds_are_measured_beside_plain_decode_of_the_same_core(
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark = load_benchmark()
    assert benchmark.main([*SPECULATIVE, "--measure-only", "--json"]) == 0
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["batch"] for row in found["rows"]] == [1, 16]
    for row in found["rows"]:
        assert row["speculative_rounds"] > 0 and row["plain_rounds"] > 0
        assert row["host_us"] > 0 and row["plain_host_us"] > 0
        assert 1.0 < row["tokens_per_lane"] <= 8.0  # proposals hold: more than one token a lane a round
        assert 0.0 < row["acceptance"] < 1.0  # and some fail (the ids leave their cycle now and then)


def test_speculative_rounds_print_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    assert benchmark.main(SPECULATIVE) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("host time per speculative round (history drafting, --draft-tokens 7)")
    header = lines.index(next(line for line in lines if line.startswith("| batch |")))
    assert "spec / plain host" in lines[header] and "tokens/lane/round" in lines[header]
    assert [line.split("|")[1].strip() for line in lines[header + 2 :]] == ["1", "16"]


def test_a_baseline_tree_directory_is_measured_beside_the_working_tree(capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    assert benchmark.main([*SPECULATIVE, "--batches", "1", "--baseline-tree", str(ROOT), "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"baseline: tree {ROOT}; current: working tree at ")
    header = lines.index(next(line for line in lines if line.startswith("| batch |")))
    assert [line.split("|")[1].strip() for line in lines[header + 2 :]] == ["1"]


def test_a_baseline_tree_without_the_packages_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    assert benchmark.main(["--baseline-tree", str(tmp_path), "--steps", "4", "--no-pin"]) == 1
    error = capsys.readouterr().err
    assert error == f"host_overhead: --baseline-tree {tmp_path} holds no helios_core and contrib/ignition\n"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--steps", "2"], "argument --steps: must be at least 4, got 2"),
        (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        (["--cpus", "0", "--no-pin"], "argument --no-pin: not allowed with argument --cpus"),
        (["--baseline", "HEAD", "--measure-only"], "--baseline and --measure-only exclude each other"),
        (
            ["--baseline", "HEAD", "--baseline-tree", "."],
            "argument --baseline-tree: not allowed with argument --baseline",
        ),
        (["--batches", "1,3"], "argument --batches: 3 is not one of 1, 16, 64, 256"),
        (["--batches", "1,x"], "argument --batches: expected comma-separated integers, got '1,x'"),
        (
            ["--speculative", "self-draft"],
            "argument --speculative: invalid choice: 'self-draft' (choose from 'history')",
        ),
    ],
)
def test_bad_options_are_refused_with_the_reason(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(arguments)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")
