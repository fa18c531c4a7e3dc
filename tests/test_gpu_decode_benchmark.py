"""The GPU decode benchmark's host-side bookkeeping (no GPU): the worker phases its round clock times."""

from __future__ import annotations

import os
import time
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
