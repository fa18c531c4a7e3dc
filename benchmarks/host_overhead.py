"""Host time per decode round with the null backend, at batch 1, 16, 64 and 256.

The null backend writes well-formed completion records without computing, so the worker's time per
round is pure host overhead: planning the round (scheduler), shared packing, the launch call,
completion validation, detokenization and publishing events, and the statistics snapshot. The worker
keeps one decode round in flight while it reads the previous one, so a round's time is the interval
between the ends of two consecutive round collections on the worker thread (each interval holds the
work of exactly one round): ``median us`` and ``p99 us`` in wall time, ``cpu us`` the worker thread's
CPU time over the same intervals (what the host spent on the round, without the time another process
or the client thread held the CPU). ``run us`` is the part spent inside the null backend's ``run`` (it
writes the completion record: a stand-in for the device's work), and ``host us`` the median of each
round's time less its ``run``: scheduling, packing, validation, detokenization and publishing.
The requests have no stops, so they have no host gate in the worker: their streams detokenize their
tokens as the client reads them (on the client thread). ``--no-text`` serves the requests without any
text, so nothing is detokenized anywhere. ``--cpus 0`` pins the process (worker and client thread) to
the listed CPUs. One run prints one table; the targets are 40 us per round at batch 1 and 300 us at
batch 256 on the 2-core CPU machine.

    python benchmarks/host_overhead.py [--steps 200] [--no-text] [--cpus 0]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCHES = (1, 16, 64, 256)
TARGETS_US = {1: 40.0, 256: 300.0}


def build(directory: Path) -> tuple[Path, Path]:
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    keys = generate_keys(directory / "keys")
    core = directory / "bench.core"
    caps = Capacities(
        max_rows=256, prefill_tokens=(256,), decode_rows=(1, 16, 64, 256), page_tokens=16, cache_pages=64,
        context=512, snapshots=0,
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=1), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace="bench/null",
    )  # fmt: skip
    return core, keys["public"]


def measure(
    core: Path, key: Path, batch: int, steps: int, text: bool = True
) -> tuple[float, float, float, float, float, int]:
    """Median and p99 wall microseconds per decode round with ``batch`` active requests, the median
    worker CPU microseconds, the median time inside the backend's ``run`` of those rounds, the median
    of each round's time less its ``run``, and the decode rounds launched."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.messages import PreparedRequest, SamplingParams
    from helios_core.runtime.startup import start
    from helios_core.wire import contract_pb2 as ct

    running = start(core, TrustSettings((key,), "bench/null", None), LoadOptions(max_active=batch), backend="null")
    engine = running.engine
    backend = engine.model.backend
    if not text:
        engine.scheduler.make_gate = None
        engine.make_text = None
    collected: list[tuple[int, int, bool, int]] = []  # (wall and CPU end of the collection, decode round, run ns)
    run_ns = [0]
    original_collect = engine._collect
    original_run = backend.run

    def timed_run(program: str, frame: int) -> None:
        begin = time.perf_counter_ns()
        original_run(program, frame)
        run_ns[0] += time.perf_counter_ns() - begin

    def timed_collect(round_: Any, frame: int, launched: Any) -> Any:
        events = original_collect(round_, frame, launched)
        decode = round_.graph.operation == ct.OPERATION_DECODE
        collected.append((time.perf_counter_ns(), time.thread_time_ns(), decode, run_ns[0]))
        return events

    engine._collect = timed_collect  # type: ignore[method-assign]
    backend.run = timed_run  # type: ignore[method-assign]
    try:
        prompt = [5, 6, 7, 8]
        streams = [
            engine.submit(PreparedRequest(f"r{i}", prompt, steps, SamplingParams(), ignore_eos=True))
            for i in range(batch)
        ]
        for stream in streams:
            for _ in stream:
                pass
        launches = engine.statistics().launches
        decode_rounds = sum(n for name, n in launches.items() if name.startswith("decode"))
    finally:
        running.close()
    # Steady state: the last ``steps // 2`` decode rounds (admission and prefill excluded); each interval
    # runs from the previous decode round's collection to this one's, and holds one round's launch.
    rounds = [
        ((end - before) / 1000, (cpu - cpu_before) / 1000, (ran - ran_before) / 1000)
        for (before, cpu_before, was_decode, ran_before), (end, cpu, decode, ran) in itertools.pairwise(collected)
        if decode and was_decode
    ][-(steps // 2) :]
    tail = sorted(wall for wall, _, _ in rounds)
    return (
        statistics.median(tail),
        tail[int(len(tail) * 0.99) - 1],
        statistics.median(cpu for _, cpu, _ in rounds),
        statistics.median(ran for _, _, ran in rounds),
        statistics.median(wall - ran for wall, _, ran in rounds),
        decode_rounds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps per batch size")
    parser.add_argument("--no-text", action="store_true", help="requests without host gates (no detokenization)")
    parser.add_argument("--cpus", help="pin the process to these CPUs (comma-separated ids)")
    args = parser.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in args.cpus.split(",")})  # threads started later inherit it
    with tempfile.TemporaryDirectory() as tmp:
        core, key = build(Path(tmp))
        rows = [(batch, *measure(core, key, batch, args.steps, not args.no_text)) for batch in BATCHES]
    gates = ", no host gates" if args.no_text else ""
    pinned = f", CPUs {args.cpus}" if args.cpus else ""
    print(f"host time per decode round, null backend{gates}, {args.steps} steps{pinned}, {date.today()}")
    print(
        f"{'batch':>5} {'median us':>10} {'p99 us':>9} {'us/request':>11} {'cpu us':>7} {'run us':>7} "
        f"{'host us':>8} {'target us':>10} {'rounds':>7}"
    )
    for batch, median, p99, cpu, ran, host, rounds in rows:
        target = TARGETS_US.get(batch)
        print(
            f"{batch:>5} {median:>10.1f} {p99:>9.1f} {median / batch:>11.2f} {cpu:>7.1f} {ran:>7.1f} "
            f"{host:>8.1f} {(f'{target:.0f}' if target else '-'):>10} {rounds:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
