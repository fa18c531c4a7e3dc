"""The GPU decode benchmark's host-side bookkeeping (no GPU): the worker phases its round clock times."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests import benchmark_modules


def load_benchmark() -> ModuleType:
    return benchmark_modules.load_benchmark("gpu_decode")


class Backend:
    def transport(self, frame: int) -> str:
        return f"staging {frame}"

    def run(self, program: str, frame: int) -> None:
        if program == "broken":
            raise RuntimeError("launch failed")

    def completion(self, frame: int) -> str:
        return f"record {frame}"


class Scheduler:
    def next_round(self) -> str:
        time.sleep(0.002)
        return "round"

    def complete(self, plan: str, results: Any) -> list[str]:
        return [f"event of {plan}"]


class Engine:
    def __init__(self) -> None:
        self.scheduler = Scheduler()
        self.published: list[Any] = []

    def _publish(self, events: Any) -> None:
        self.published.append(events)


class Packer:
    def pack(self, submission: Any, frame: int, staging: Any) -> None:
        return None


def test_the_round_clock_times_every_worker_phase_and_passes_calls_through() -> None:
    benchmark = load_benchmark()
    running = SimpleNamespace(
        model=SimpleNamespace(clock_origin_ns=0, backend=Backend(), packers={"a": Packer(), "b": Packer()}),
        engine=Engine(),
    )
    clock = benchmark.RoundClock(running)
    submitted = clock.now_ns()
    engine, model = running.engine, running.model
    assert engine.scheduler.next_round() == "round"
    assert model.backend.transport(1) == "staging 1"
    model.packers["b"].pack("lanes", 1, "staging 1")
    model.backend.run("decode", 1)
    assert model.backend.completion(1) == "record 1"
    assert engine.scheduler.complete("round", []) == ["event of round"]
    engine._publish(["event of round"])
    with pytest.raises(RuntimeError, match="launch failed"):
        model.backend.run("broken", 0)
    first = clock.now_ns()
    assert engine.published == [["event of round"]]
    phases = ["plan", "transport", "pack", "run", "completion", "complete", "publish", "run"]
    assert [span.phase for span in clock.spans] == phases
    assert clock.spans[0].duration_ns >= 2_000_000  # the planning call's sleep
    begins = [span.begin_ns for span in clock.spans]
    assert begins == sorted(begins) and begins[0] >= submitted
    kept = benchmark.host_phases(clock.spans, submitted, first)
    assert [phase["phase"] for phase in kept] == phases
    assert kept[0]["ms"] >= 2.0 and kept[0]["begin_ms"] >= 0.0
    assert benchmark.host_phases(clock.spans, first + 1, first + 2) == []
    (record,) = clock.records  # the completion of the launched round
    assert record.program == "decode"


def test_the_ranks_table_puts_each_batch_beside_one_rank_the_graph_and_the_all_reduce_share() -> None:
    benchmark = load_benchmark()
    report = SimpleNamespace(
        data={
            "plan": {"ranks": 2, "batches": [1, 8]},
            "shapes": {
                "8b": {
                    "helios": {"decode": {"1": {"ms_per_step": 4.0}, "8": {"ms_per_step": 5.0}}},
                    "baseline": {"graph": {"1": {"ms_per_step": 6.0}}},
                    "tp2": {
                        "decode": {"1": {"ms_per_step": 2.5}, "8": {"ms_per_step": 4.0}},
                        "collectives_per_decode": 64,
                        "all_reduce_us": {"1": 12.5},
                        "errors": {"batch 8": "TimeoutError: wave"},
                    },
                }
            },
        }
    )
    assert benchmark.rank_rows(report) == [
        ["8b", "1", "4.000", "2.500", "0.62", "6.000", "2.40x", "12.5", "64", "32%"],
        ["8b", "8", "5.000", "4.000", "0.80", "-", "-", "-", "64", "-"],
    ]


def test_clock_samples_summarise_the_clocks_and_power_nvidia_smi_printed(tmp_path: Any, monkeypatch: Any) -> None:
    benchmark = load_benchmark()
    fake = tmp_path / "nvidia-smi"
    arguments = tmp_path / "arguments"
    fake.write_text(
        f"#!/bin/sh\necho \"$@\" > {arguments}\nprintf '1980, 650.50\\n1755, 690.25\\n1770, [N/A]\\nnot a sample\\n'\n"
        "exec sleep 30\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with benchmark.ClockSamples("cuda", interval_ms=10) as clocks:
        time.sleep(0.3)
    assert arguments.read_text().split() == [
        "-i", "0", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "10"
    ]  # fmt: skip
    summary = clocks.summary()
    # the line without a power reading counts for the clock alone; the line that is no sample not at all
    expected = {"samples": 3, "sm_clock_mhz_median": 1770.0, "sm_clock_mhz_min": 1755.0, "power_w_median": 670.375}
    assert summary == expected
    entry = {
        "helios": {"decode": {"256": {"clock": summary}, "64": {}}},
        "baseline": {"graph": {"256": {"clock": {"sm_clock_mhz_median": 1980.0}}, "64": {"clock": summary}}},
    }
    assert benchmark.clock_note(entry, [64, 256]) == "SM MHz (W) b256 Helios 1770 (670), graph 1980"


def test_clock_samples_take_nothing_off_the_gpu_or_without_nvidia_smi(tmp_path: Any, monkeypatch: Any) -> None:
    benchmark = load_benchmark()
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    with benchmark.ClockSamples("cuda") as missing:
        pass
    with benchmark.ClockSamples("cpu") as off_the_gpu:
        pass
    assert missing.summary() is None
    assert off_the_gpu.summary() is None
    assert benchmark.clock_note({"helios": {}, "baseline": {}}, [1]) == ""


def _tree(root: Path, text: str) -> Path:
    """A source tree holding only an Ignition CLI module of ``text``."""
    package = root / "contrib" / "ignition" / "ignition"
    package.mkdir(parents=True, exist_ok=True)
    (package / "cli.py").write_text(text)
    return root


def test_a_compared_tree_builds_its_own_core_with_its_own_ignition_and_rebuilds_when_edited(tmp_path: Path) -> None:
    benchmark = load_benchmark()
    tree = _tree(tmp_path / "before", "def main(argv): return 0\n")
    args = benchmark.parse_args(["--device", "cpu", "--shapes", "tiny", "--compare-tree", str(tree)])
    plan = benchmark.make_plan(args)
    cores = tmp_path / "cores"
    cores.mkdir()
    plain, compared = benchmark.core_specs(plan, cores, cores / "signing.pem")
    assert (plain.tree, compared.tree) == ("", str(tree.resolve()))
    assert compared.arguments == plain.arguments and compared.path.endswith("-compared.core")
    command, environment, folder = benchmark.build_command(compared)
    assert folder == tree.resolve() and command[-3:] == ["--out", compared.path, "--quiet"]
    first, second = environment["PYTHONPATH"].split(os.pathsep)[:2]
    assert (first, second) == (str(tree.resolve()), str(tree.resolve() / "contrib" / "ignition"))
    assert benchmark.build_command(plain)[1] is None  # this tree's build child: the script itself
    # a built core is reused while the tree's Ignition sources are the ones it was built from
    Path(compared.path).write_bytes(b"core")
    compared.record.write_text(benchmark.json.dumps(compared.recorded()))
    assert compared.reusable()
    _tree(tree, "def main(argv): return 1\n")
    assert not compared.reusable()
    with pytest.raises(SystemExit, match=r"no contrib/ignition/ignition/cli\.py"):
        benchmark.make_plan(benchmark.parse_args(["--device", "cpu", "--compare-tree", str(tmp_path / "cores")]))


def test_this_trees_core_is_built_again_once_its_ignition_sources_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core built by this tree is reused while this tree's Ignition sources are the ones that built it: a
    changed lowering (here, a changed module) builds it again instead of measuring the earlier build."""
    benchmark = load_benchmark()
    tree = _tree(tmp_path / "this", "def main(argv): return 0\n")
    monkeypatch.setattr(benchmark, "ROOT", tree)
    plan = benchmark.make_plan(benchmark.parse_args(["--device", "cpu", "--shapes", "tiny"]))
    cores = tmp_path / "cores"
    cores.mkdir()
    (plain,) = benchmark.core_specs(plan, cores, cores / "signing.pem")
    assert plain.recorded() == [*plain.arguments, f"ignition sources {benchmark.ignition_digest(tree)}"]
    Path(plain.path).write_bytes(b"core")
    plain.record.write_text(benchmark.json.dumps(plain.recorded()))
    assert plain.reusable()
    (tree / "contrib" / "ignition" / "ignition" / "lowering.py").write_text("ROWS = 64\n")
    assert not plain.reusable()
    plain.record.write_text(benchmark.json.dumps(list(plain.arguments)))  # a record of arguments alone
    assert not plain.reusable()


def test_the_compared_tree_has_rows_beside_the_shared_baselines_and_a_ratio_per_batch() -> None:
    benchmark = load_benchmark()
    report = SimpleNamespace(
        data={
            "plan": {"batches": [1, 8], "prompt": 16, "tokens": 24, "prefill": 64, "compare_tree": "/src/before"},
            "hardware": {},
            "shapes": {
                "tiny": {
                    "helios": {
                        "decode": {"1": {"ms_per_step": 1.5}, "8": {"ms_per_step": 2.0}},
                        "prefill": {"ms": 4.0, "tokens_per_s": 16000.0},
                    },
                    "baseline": {"graph": {"8": {"ms_per_step": 3.0}}, "prefill": {"ms": 8.0}},
                    "compared": {
                        "tree": "/src/before",
                        "helios": {
                            "decode": {"1": {"ms_per_step": 2.0}, "8": {"ms_per_step": 2.5}},
                            "prefill": {"ms": 5.0},
                        },
                    },
                }
            },
        }
    )
    rows = benchmark.table_rows(report)
    assert [row[:3] for row in rows] == [
        ["tiny", "1", "1.500"],
        ["tiny", "8", "2.000"],
        ["tiny", "prefill 64", "4.000"],
        ["tiny compared", "1", "2.000"],
        ["tiny compared", "8", "2.500"],
        ["tiny compared", "prefill 64", "5.000"],
    ]
    assert rows[1][9] == "1.50x" and rows[4][9] == "1.20x"  # both against the one graph baseline
    assert rows[2][9] == "2.00x vs eager" and rows[5][9] == "1.60x vs eager"
    note = benchmark.compared_note(report.data["shapes"]["tiny"], report.data["plan"])
    assert note == "ms of this tree / the compared tree's (/src/before): b1 0.750, b8 0.800, prefill 0.800"


def test_the_kernel_count_reads_the_cache_as_the_compiler_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    from ignition.kernels import compiler

    @triton.jit  # type: ignore[misc, untyped-decorator]
    def _copy(x_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, N)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))

    gpu_decode = load_benchmark()
    monkeypatch.setenv("IGNITION_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiler, "_MEMORY", {})
    assert gpu_decode.cached_kernels(tmp_path / "cache") == 0  # no folder yet
    for width in (16, 32):
        compiler.compile_triton(_copy, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"N": width})
    assert gpu_decode.cached_kernels(tmp_path / "cache") == 2
