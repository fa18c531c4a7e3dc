"""Host time per decode round with the null backend, at batch 1, 16, 64 and 256, of this tree or of this
tree beside an earlier commit.

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
text, so nothing is detokenized anywhere.

Conditions. On a machine with at most four CPUs the process (worker and client thread) is pinned to
its lowest allowed CPU unless ``--no-pin`` is given (``--cpus`` picks the CPUs). Every table starts
with the conditions it was measured under: Python, numpy, msgspec and protobuf versions, the CPU, the
pinning, the BLAS/OpenMP thread variables, the garbage collector, the load average, and a speed gauge
(the time of a fixed pure-Python loop, best of five) that tells a slow machine, or a slow spell of a
shared one, from a slow tree. The targets are 40 us per round at batch 1 and 300 us at batch 256 on
the 2-core CPU machine.

``--baseline REF`` measures the commit ``REF`` beside the working tree in one run: ``REF``'s tree is
extracted with ``git archive`` into a temporary directory (git's state is left alone), and each
measurement runs this file's ``measure`` in its own subprocess of the same interpreter, with
``PYTHONPATH`` naming the measured tree's root and its ``contrib/ignition``, so ``helios_core`` and
``ignition`` import from that tree (each subprocess builds its core with its own tree's ignition, and
checks where its imports came from). The trees alternate for ``--repeats`` rounds, and one markdown
table gives, per batch, the median of the repeats with their range for each tree, the ratio of the
host times and the target.

    python benchmarks/host_overhead.py [--steps 200] [--no-text] [--cpus 0 | --no-pin]
    python benchmarks/host_overhead.py --baseline HEAD [--repeats 3] [--steps 200] [--no-text]
    python benchmarks/host_overhead.py --measure-only --json   # this interpreter's imports, no pinning change
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

BATCHES = (1, 16, 64, 256)
TARGETS_US = {1: 40.0, 256: 300.0}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PIN_AT_MOST_CPUS = 4  # machines with at most this many CPUs get pinned to one by default
GAUGE_LOOP = 20_000
DOCUMENTED_GAUGE_US = 630  # the loop gauge on the machine of the figures in docs/benchmarks.md (2026-12-01)


class BenchmarkError(Exception):
    """A measurement or a tree to measure could not be had; the message says which and why."""


@dataclass(frozen=True)
class Row:
    """One batch size's figures in microseconds (``rounds``: the decode rounds launched)."""

    batch: int
    median_us: float
    p99_us: float
    cpu_us: float
    run_us: float
    host_us: float
    rounds: int


@dataclass(frozen=True)
class Measurement:
    """One measured tree: the conditions it ran under and its rows."""

    conditions: dict[str, Any]
    rows: list[Row]


def use_tree(tree: Path) -> None:
    """Import ``helios_core`` and ``ignition`` from ``tree`` (ahead of any installed copy)."""
    sys.path[:0] = [str(tree), str(tree / "contrib" / "ignition")]


def pin(cpus: str | None, no_pin: bool) -> None:
    """Pin the process to ``cpus`` (comma-separated ids), or by default to its lowest allowed CPU on a
    machine with at most ``PIN_AT_MOST_CPUS``; threads started afterwards inherit the affinity."""
    if no_pin:
        return
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
        return
    allowed = os.sched_getaffinity(0)
    if len(allowed) <= PIN_AT_MOST_CPUS:
        os.sched_setaffinity(0, {min(allowed)})


def speed_gauge_us() -> float:
    """Microseconds of a fixed pure-Python loop, best of five."""
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter_ns()
        total = 0
        for i in range(GAUGE_LOOP):
            total += i & 7
        best = min(best, (time.perf_counter_ns() - begin) / 1000)
    return best


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def conditions() -> dict[str, Any]:
    """What the figures depend on besides the code: versions, CPU, pinning, thread variables, load."""
    import ignition
    import msgspec
    import numpy
    from google.protobuf.internal import api_implementation

    import helios_core

    return {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "msgspec": msgspec.__version__,
        "protobuf": api_implementation.Type(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "threads": {name: os.environ.get(name) for name in THREAD_VARIABLES},
        "gc": gc.isenabled(),
        "load": os.getloadavg()[0],
        "gauge_us": speed_gauge_us(),
        "helios_core": str(Path(helios_core.__file__).resolve().parent),
        "ignition": str(Path(ignition.__file__).resolve().parent),
    }


def describe(found: dict[str, Any]) -> str:
    affinity = found["affinity"]
    pinned = f"pinned to CPU {','.join(map(str, affinity))}" if len(affinity) < (found["cpus"] or 0) else "not pinned"
    threads = " ".join(f"{name}={value or 'unset'}" for name, value in found["threads"].items())
    return (
        f"Python {found['python']}, numpy {found['numpy']}, msgspec {found['msgspec']}, protobuf "
        f"{found['protobuf']}; {found['cpu']}, {found['cpus']} CPUs, {pinned}; {threads}; "
        f"gc {'on' if found['gc'] else 'off'}; load {found['load']:.2f}; "
        f"loop gauge {found['gauge_us']:.0f} us (documented machine: {DOCUMENTED_GAUGE_US} us)"
    )


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


def measure(core: Path, key: Path, batch: int, steps: int, text: bool = True) -> Row:
    """Median and p99 wall microseconds per decode round with ``batch`` active requests, the median
    worker CPU microseconds, the median time inside the backend's ``run`` of those rounds, the median
    of each round's time less its ``run``, and the decode rounds launched.

    Relies only on ``start``, ``engine._collect(round_, frame, launched)``, ``round_.graph.operation``,
    ``engine.model.backend.run``, ``engine.statistics().launches``, ``engine.scheduler.make_gate`` and
    ``engine.make_text``, so that it measures earlier trees as well."""
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
    if not rounds:
        raise BenchmarkError(
            f"batch {batch}: no two consecutive decode rounds were collected ({len(collected)} collections, "
            f"{decode_rounds} decode launches counted)"
        )
    tail = sorted(wall for wall, _, _ in rounds)
    return Row(
        batch,
        statistics.median(tail),
        tail[max(int(len(tail) * 0.99) - 1, 0)],
        statistics.median(cpu for _, cpu, _ in rounds),
        statistics.median(ran for _, _, ran in rounds),
        statistics.median(wall - ran for wall, _, ran in rounds),
        decode_rounds,
    )


def measure_here(steps: int, text: bool) -> Measurement:
    """Every batch size, measured in this process with the ``helios_core`` and ``ignition`` it imports."""
    found = conditions()
    with tempfile.TemporaryDirectory() as tmp:
        core, key = build(Path(tmp))
        rows = [measure(core, key, batch, steps, text) for batch in BATCHES]
    return Measurement(found, rows)


def git(*arguments: str) -> str:
    result = subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchmarkError(f"git {' '.join(arguments)} failed: {result.stderr.strip() or result.returncode}")
    return result.stdout.strip()


def extract_tree(ref: str, into: Path) -> str:
    """Write the tree of commit ``ref`` into the directory ``into`` with ``git archive`` (no change to
    the checkout, its index or its refs); returns the full commit id."""
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except BenchmarkError:
        raise BenchmarkError(f"--baseline {ref!r} does not name a commit of {ROOT}") from None
    with subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit], stdout=subprocess.PIPE
    ) as archive:
        unpacked = subprocess.run(
            ["tar", "-x", "-C", str(into)], stdin=archive.stdout, capture_output=True, check=False
        )
    if archive.returncode != 0 or unpacked.returncode != 0:
        raise BenchmarkError(f"extracting {commit} failed: {unpacked.stderr.decode(errors='replace').strip()}")
    return commit


def measure_tree(tree: Path, steps: int, text: bool) -> Measurement:
    """Run this file's ``measure`` in a subprocess of this interpreter that imports ``helios_core`` and
    ``ignition`` from ``tree``; the subprocess inherits this process's CPU affinity."""
    command = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--json", "--no-pin"]
    command += ["--steps", str(steps), *([] if text else ["--no-text"])]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "contrib" / "ignition")]))
    result = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        detail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or [f"exit {result.returncode}"]
        raise BenchmarkError(f"measuring {tree} failed: {detail[0]}")
    found = json.loads(lines[-1])
    for package in ("helios_core", "ignition"):
        if not Path(found["conditions"][package]).is_relative_to(tree.resolve()):
            raise BenchmarkError(f"measuring {tree}: {package} was imported from {found['conditions'][package]}")
    return Measurement(found["conditions"], [Row(**row) for row in found["rows"]])


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def print_single(measurement: Measurement, steps: int, text: bool) -> None:
    gates = "" if text else ", no host gates"
    print(f"host time per decode round, null backend{gates}, {steps} steps, {date.today()}")
    print(f"conditions: {describe(measurement.conditions)}")
    print(
        f"{'batch':>5} {'median us':>10} {'p99 us':>9} {'us/request':>11} {'cpu us':>7} {'run us':>7} "
        f"{'host us':>8} {'target us':>10} {'rounds':>7}"
    )
    for row in measurement.rows:
        target = TARGETS_US.get(row.batch)
        print(
            f"{row.batch:>5} {row.median_us:>10.1f} {row.p99_us:>9.1f} {row.median_us / row.batch:>11.2f} "
            f"{row.cpu_us:>7.1f} {row.run_us:>7.1f} {row.host_us:>8.1f} "
            f"{(f'{target:.0f}' if target else '-'):>10} {row.rounds:>7}"
        )


def print_comparison(
    baseline: list[Measurement], current: list[Measurement], labels: tuple[str, str], steps: int, text: bool
) -> None:
    gates = "" if text else ", no host gates"
    print(
        f"host time per decode round, null backend{gates}, {steps} steps, {len(current)} repeats per tree "
        f"alternating, {date.today()}"
    )
    print(f"baseline: {labels[0]}; current: {labels[1]}")
    print(f"conditions: {describe(current[0].conditions)}")
    gauges = [m.conditions["gauge_us"] for m in baseline + current]
    print(f"loop gauge over the runs: {min(gauges):.0f}–{max(gauges):.0f} us")
    print("median of the repeats (min–max); ratio: current host / baseline host")
    print()
    print(
        "| batch | baseline median µs | baseline host µs | current median µs | current host µs | host ratio "
        "| run µs baseline / current | target µs |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for index, batch in enumerate(BATCHES):
        before = [m.rows[index] for m in baseline]
        after = [m.rows[index] for m in current]
        before_host = statistics.median(row.host_us for row in before)
        after_host = statistics.median(row.host_us for row in after)
        target = TARGETS_US.get(batch)
        run = f"{statistics.median(r.run_us for r in before):.1f} / {statistics.median(r.run_us for r in after):.1f}"
        print(
            f"| {batch} | {spread([r.median_us for r in before])} | {spread([r.host_us for r in before])} "
            f"| {spread([r.median_us for r in after])} | {spread([r.host_us for r in after])} "
            f"| {after_host / before_host:.2f} | {run} | {f'{target:.0f}' if target else '-'} |"
        )


def compare(ref: str, repeats: int, steps: int, text: bool) -> None:
    """Measure ``ref``'s tree and the working tree ``repeats`` times each, alternating their order."""
    head = git("rev-parse", "--short", "HEAD")
    changed = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    with tempfile.TemporaryDirectory(prefix="host-overhead-baseline-") as tmp:
        commit = extract_tree(ref, Path(tmp))
        trees = (Path(tmp), ROOT)
        results: tuple[list[Measurement], list[Measurement]] = ([], [])
        for repeat in range(repeats):
            for which in (0, 1) if repeat % 2 == 0 else (1, 0):
                results[which].append(measure_tree(trees[which], steps, text))
    labels = (f"{ref} ({commit[:10]})", f"working tree at {head}{changed}")
    print_comparison(results[0], results[1], labels, steps, text)


def at_least(minimum: int) -> Any:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        return number

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=at_least(4), default=200, help="decode steps per batch size (at least 4)")
    parser.add_argument("--no-text", action="store_true", help="requests without host gates (no detokenization)")
    pinning = parser.add_mutually_exclusive_group()
    pinning.add_argument("--cpus", help="pin the process to these CPUs (comma-separated ids)")
    pinning.add_argument("--no-pin", action="store_true", help="leave the CPU affinity as it is")
    parser.add_argument("--baseline", metavar="REF", help="also measure this commit's tree, in the same run")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="measurements per tree with --baseline")
    parser.add_argument(
        "--measure-only", action="store_true", help="measure the helios_core this interpreter imports (PYTHONPATH)"
    )
    parser.add_argument("--json", action="store_true", help="print the conditions and rows as one JSON line")
    args = parser.parse_args(argv)
    if args.baseline and args.measure_only:
        parser.error("--baseline and --measure-only exclude each other")
    try:
        pin(args.cpus, args.no_pin)  # before numpy starts its threads
    except (ValueError, OSError) as error:
        parser.error(f"--cpus {args.cpus}: {error}")
    if not args.measure_only:
        use_tree(ROOT)
    try:
        if args.baseline:
            compare(args.baseline, args.repeats, args.steps, not args.no_text)
            return 0
        measurement = measure_here(args.steps, not args.no_text)
    except BenchmarkError as error:
        print(f"host_overhead: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"conditions": measurement.conditions, "rows": [asdict(row) for row in measurement.rows]}))
    else:
        print_single(measurement, args.steps, not args.no_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
