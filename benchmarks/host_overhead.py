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

``--speculative history`` measures a core built with ``--speculative history --draft-tokens 7``
(speculative widths 1, 2, 4 and 8) twice per batch: plain decode (history drafting off, so one decode
round stays in flight) and history drafting (every speculative round planned from the previous round's
completion). The null backend then samples ids that repeat every ``CYCLE`` positions except at a fixed
fraction ``NOVELTY`` of positions (:class:`~helios_core.backends.null.NullTokens`), and verifies copied
proposals as a greedy target would (a lane accepts its longest prefix of proposals equal to the ids the
null backend samples there). Request ``i``'s prompt is those ids at positions 0 to ``PROMPT_TOKENS + i
mod SPREAD`` (so the lanes' positions, and their proposals and acceptance, differ), and each asks for
``--steps`` tokens: its history holds a whole cycle after ``CYCLE`` tokens. A speculative round's time
is the interval from the previous round's collection to its own (a round of every request, the one
before a decode or speculative round); the figures are the medians over the later half of such rounds:
``host us`` (the interval less ``run``; its mean in parentheses, which also counts the few rounds in
which the drafting index takes every history's new positions in bulk) against plain decode's, their
ratio, the emitted tokens per lane per speculative round, the acceptance (accepted / offered
proposals), and the speculative and decode rounds of the drafting run (a round in which no lane has a
proposal is a decode round). The target: a speculative round's host time within 2x of a plain decode
round's at batch 64 and 256. Histories of fewer than ``speculation.COLUMNS_FROM`` requests (batch 1) are
planned lane by lane.

``--baseline-tree DIR`` measures an unpacked tree (a directory holding ``helios_core`` and
``contrib/ignition``) as the baseline, in place of a commit.

    python benchmarks/host_overhead.py [--steps 200] [--no-text] [--cpus 0 | --no-pin]
    python benchmarks/host_overhead.py --baseline HEAD [--repeats 3] [--steps 200] [--no-text]
    python benchmarks/host_overhead.py --speculative history [--steps 200] [--baseline REF | --baseline-tree DIR]
    python benchmarks/host_overhead.py --batches 1,64 ...                    # some of the batch sizes
    python benchmarks/host_overhead.py --measure-only --json   # this interpreter's imports, no pinning change
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent

BATCHES = (1, 16, 64, 256)
TARGETS_US = {1: 40.0, 256: 300.0}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PIN_AT_MOST_CPUS = 4  # machines with at most this many CPUs get pinned to one by default
GAUGE_LOOP = 20_000
DOCUMENTED_GAUGE_US = 630  # the loop gauge on the machine of the figures in docs/benchmarks.md (2026-12-01)
SPECULATIVE_KINDS = ("history",)
DRAFT_TOKENS = 7  # speculative widths 1, 2, 4 and 8, as benchmarks/speculative.py builds
SPECULATIVE_TARGET_RATIO = 2.0  # a speculative round's host time against a plain decode round's
CYCLE = 24  # the null backend's ids repeat every CYCLE positions ...
NOVELTY = 0.1  # ... except at this fraction of positions
PROMPT_TOKENS = 4  # request i's prompt: the null backend's ids at positions 0 .. PROMPT_TOKENS + i % SPREAD - 1
SPREAD = 8


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
class SpeculativeRow:
    """One batch size of ``--speculative``: plain decode of the core and its speculative rounds (history
    drafting on), in microseconds; ``tokens_per_lane`` and ``acceptance`` over the drafting run's
    speculative lanes, ``speculative_rounds`` and ``decode_rounds`` the drafting run's launches."""

    batch: int
    plain_median_us: float
    plain_host_us: float
    plain_mean_host_us: float
    plain_run_us: float
    plain_rounds: int
    median_us: float
    cpu_us: float
    run_us: float
    host_us: float
    mean_host_us: float
    speculative_rounds: int
    decode_rounds: int
    tokens_per_lane: float
    acceptance: float

    @property
    def ratio(self) -> float:
        """A speculative round's host time over a plain decode round's."""
        return self.host_us / self.plain_host_us


@dataclass(frozen=True)
class Measurement:
    """One measured tree: the conditions it ran under and its rows."""

    conditions: dict[str, Any]
    rows: list[Row] | list[SpeculativeRow]


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


def build(directory: Path, speculative: str | None = None) -> tuple[Path, Path]:
    """The benchmark's core (with ``speculative``: its speculative programs, ``--draft-tokens 7``) and
    the public key that verifies it."""
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
    if speculative is not None:
        from ignition.recipes.llama import speculative_widths

        caps = dataclasses.replace(
            caps, speculative_widths=speculative_widths(DRAFT_TOKENS), speculation=speculative,
            draft_tokens=DRAFT_TOKENS,
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
    # (wall and CPU end of the collection, decode round, run ns)
    collected = _time_rounds(
        engine,
        backend,
        text,
        lambda round_, wall, cpu, ran: (wall, cpu, round_.graph.operation == ct.OPERATION_DECODE, ran),
    )
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


@dataclass(frozen=True)
class _Collection:
    """One round's collection on the worker thread: when it ended (wall and thread CPU ns), the round's
    operation and lanes, and the ns spent in the backend's ``run`` up to then."""

    wall_ns: int
    cpu_ns: int
    operation: int
    lanes: int
    run_ns: int


def _drive(core: Path, key: Path, batch: int, steps: int, text: bool, drafting: bool) -> tuple[list[_Collection], Any]:
    """Serve ``batch`` requests of the repeating workload (see the module's description) on the null
    backend, history drafting on or off; every round's collection and the engine's final statistics. The
    first round is planned once every request has reached the scheduler, so they are admitted together."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.messages import ExecutionFailed, PreparedRequest, SamplingParams
    from helios_core.runtime.startup import start

    try:
        from helios_core.backends.null import NullTokens
    except ImportError:
        raise BenchmarkError("this tree's null backend runs no speculative programs (no NullTokens)") from None
    options = LoadOptions(max_active=batch, history_drafting=drafting)
    running = start(core, TrustSettings((key,), "bench/null", None), options, backend="null")
    engine = running.engine
    backend = engine.model.backend
    tokens = backend.tokens = NullTokens(cycle=CYCLE, novelty=NOVELTY)
    vocabulary = engine.model.contract.sampled_size
    collected = _time_rounds(
        engine,
        backend,
        text,
        lambda round_, wall, cpu, ran: _Collection(wall, cpu, round_.graph.operation, len(round_), ran),
    )

    all_submitted = threading.Event()
    original_next_round = engine.scheduler.next_round

    def next_round_after_submissions() -> Any:
        if not all_submitted.is_set():  # every request reaches the scheduler before the first round
            all_submitted.wait()
            engine._drain(block=False)
        return original_next_round()

    engine.scheduler.next_round = next_round_after_submissions  # type: ignore[method-assign]
    failures: list[str] = []
    try:
        import numpy as np

        streams = []
        for i in range(batch):
            prompt = tokens.ids(np.arange(PROMPT_TOKENS + i % SPREAD, dtype=np.int64), vocabulary).tolist()
            request = PreparedRequest(f"r{i}", prompt, steps, SamplingParams(), ignore_eos=True)
            streams.append(engine.submit(request))
        all_submitted.set()
        for stream in streams:
            for event in stream:
                if isinstance(event, ExecutionFailed):
                    failures.append(event.message)
        statistics_ = engine.statistics()
    finally:
        all_submitted.set()
        running.close()
    if failures:
        raise BenchmarkError(f"batch {batch}: {len(failures)} requests failed; the first: {failures[0]}")
    return collected, statistics_


Entry = TypeVar("Entry")


def _time_rounds(engine: Any, backend: Any, text: bool, entry: Callable[[Any, int, int, int], Entry]) -> list[Entry]:
    """Time the worker's rounds: without ``text`` the requests get no host gate and no text; the backend's
    ``run`` is timed, and after each round's collection ``entry(round, wall ns, worker CPU ns, run ns so
    far)`` is appended to the returned list."""
    if not text:
        engine.scheduler.make_gate = None
        engine.make_text = None
    collected: list[Entry] = []
    run_ns = [0]
    original_collect = engine._collect
    original_run = backend.run

    def timed_run(program: str, frame: int) -> None:
        begin = time.perf_counter_ns()
        original_run(program, frame)
        run_ns[0] += time.perf_counter_ns() - begin

    def timed_collect(round_: Any, frame: int, launched: Any) -> Any:
        events = original_collect(round_, frame, launched)
        collected.append(entry(round_, time.perf_counter_ns(), time.thread_time_ns(), run_ns[0]))
        return events

    engine._collect = timed_collect
    backend.run = timed_run
    return collected


def _intervals(collected: list[_Collection], batch: int, operation: int) -> list[tuple[float, float, float]]:
    """(wall, CPU, run) microseconds of each round of ``operation`` with every request's lane whose
    previous collection was a decode or speculative round (steady rounds: admission and prefill excluded)."""
    from helios_core.wire import contract_pb2 as ct

    steady = (ct.OPERATION_DECODE, ct.OPERATION_SPECULATIVE)
    return [
        (
            (now.wall_ns - before.wall_ns) / 1000,
            (now.cpu_ns - before.cpu_ns) / 1000,
            (now.run_ns - before.run_ns) / 1000,
        )
        for before, now in itertools.pairwise(collected)
        if before.operation in steady and now.operation == operation and now.lanes == batch
    ]


def measure_speculative(core: Path, key: Path, batch: int, steps: int, text: bool = True) -> SpeculativeRow:
    """Plain decode and history drafting of ``batch`` requests on the speculative core: the medians over
    the later half of each run's steady rounds (decode rounds, speculative rounds)."""
    from helios_core.wire import contract_pb2 as ct

    plain, _ = _drive(core, key, batch, steps, text, drafting=False)
    drafting, found = _drive(core, key, batch, steps, text, drafting=True)
    decode = _intervals(plain, batch, ct.OPERATION_DECODE)
    speculative = _intervals(drafting, batch, ct.OPERATION_SPECULATIVE)
    if len(decode) < 2 or len(speculative) < 2:
        raise BenchmarkError(
            f"batch {batch}: too few steady rounds ({len(decode)} decode rounds without drafting, "
            f"{len(speculative)} speculative rounds with it)"
        )
    decode, speculative = decode[len(decode) // 2 :], speculative[len(speculative) // 2 :]
    lanes = sum(found.speculative_lanes.values())
    offered = sum(found.proposals_offered.values())
    return SpeculativeRow(
        batch,
        plain_median_us=statistics.median(wall for wall, _, _ in decode),
        plain_host_us=statistics.median(wall - ran for wall, _, ran in decode),
        plain_mean_host_us=statistics.fmean(wall - ran for wall, _, ran in decode),
        plain_run_us=statistics.median(ran for _, _, ran in decode),
        plain_rounds=len(decode),
        median_us=statistics.median(wall for wall, _, _ in speculative),
        cpu_us=statistics.median(cpu for _, cpu, _ in speculative),
        run_us=statistics.median(ran for _, _, ran in speculative),
        host_us=statistics.median(wall - ran for wall, _, ran in speculative),
        mean_host_us=statistics.fmean(wall - ran for wall, _, ran in speculative),
        speculative_rounds=sum(1 for c in drafting if c.operation == ct.OPERATION_SPECULATIVE),
        decode_rounds=sum(1 for c in drafting if c.operation == ct.OPERATION_DECODE),
        tokens_per_lane=sum(found.speculative_emitted.values()) / lanes if lanes else 0.0,
        acceptance=sum(found.drafts_accepted.values()) / offered if offered else 0.0,
    )


def measure_here(
    steps: int, text: bool, speculative: str | None = None, batches: tuple[int, ...] = BATCHES
) -> Measurement:
    """Every batch size of ``batches``, measured in this process with the ``helios_core`` and ``ignition``
    it imports."""
    found = conditions()
    with tempfile.TemporaryDirectory() as tmp:
        core, key = build(Path(tmp), speculative)
        if speculative is not None:
            return Measurement(found, [measure_speculative(core, key, batch, steps, text) for batch in batches])
        rows = [measure(core, key, batch, steps, text) for batch in batches]
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


def measure_tree(
    tree: Path, steps: int, text: bool, speculative: str | None = None, batches: tuple[int, ...] = BATCHES
) -> Measurement:
    """Run this file's ``measure`` (``measure_speculative`` with ``speculative``) in a subprocess of this
    interpreter that imports ``helios_core`` and ``ignition`` from ``tree``; the subprocess inherits this
    process's CPU affinity."""
    command = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--json", "--no-pin"]
    command += ["--steps", str(steps), *([] if text else ["--no-text"])]
    command += ["--speculative", speculative] if speculative is not None else []
    command += ["--batches", ",".join(map(str, batches))] if batches != BATCHES else []
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
    kind = SpeculativeRow if speculative is not None else Row
    return Measurement(found["conditions"], [kind(**row) for row in found["rows"]])


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def speculative_title(steps: int, text: bool) -> str:
    gates = "" if text else ", no host gates"
    return (
        f"host time per speculative round (history drafting, --draft-tokens {DRAFT_TOKENS}) beside plain decode "
        f"of the same core, null backend{gates}, ids on a {CYCLE}-position cycle with novelty {NOVELTY}, "
        f"{steps} tokens per request"
    )


def print_speculative(measurement: Measurement, steps: int, text: bool) -> None:
    print(f"{speculative_title(steps, text)}, {date.today()}")
    print(f"conditions: {describe(measurement.conditions)}")
    print(
        "| batch | plain host µs (mean) | plain run µs | spec median µs | spec cpu µs | spec run µs "
        "| spec host µs (mean) | spec / plain host | tokens/lane/round | acceptance | spec rounds | decode rounds |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in measurement.rows:
        if not isinstance(row, SpeculativeRow):
            raise BenchmarkError("a plain measurement has no speculative rows")
        print(
            f"| {row.batch} | {row.plain_host_us:.1f} ({row.plain_mean_host_us:.1f}) | {row.plain_run_us:.1f} "
            f"| {row.median_us:.1f} | {row.cpu_us:.1f} | {row.run_us:.1f} | {row.host_us:.1f} "
            f"({row.mean_host_us:.1f}) | {row.ratio:.2f} | {row.tokens_per_lane:.2f} | {row.acceptance:.2f} "
            f"| {row.speculative_rounds} | {row.decode_rounds} |"
        )


def print_speculative_comparison(
    baseline: list[Measurement], current: list[Measurement], labels: tuple[str, str], steps: int, text: bool
) -> None:
    print(f"{speculative_title(steps, text)}, {len(current)} repeats per tree alternating, {date.today()}")
    print(f"baseline: {labels[0]}; current: {labels[1]}")
    print(f"conditions: {describe(current[0].conditions)}")
    gauges = [m.conditions["gauge_us"] for m in baseline + current]
    print(f"loop gauge over the runs: {min(gauges):.0f}–{max(gauges):.0f} us")
    print(
        "median of the repeats (min–max) of each run's median host µs; mean: the median of the runs' means; "
        "spec / plain: a speculative round's median host time over plain decode's"
    )
    print()
    print(
        "| batch | plain host µs baseline / current | spec host µs baseline | spec host µs current "
        "| current / baseline | spec mean µs baseline / current | spec / plain baseline | spec / plain current "
        "| tokens/lane/round baseline / current |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for index, batch in enumerate(row.batch for row in current[0].rows):
        before = [m.rows[index] for m in baseline]
        after = [m.rows[index] for m in current]
        if not all(isinstance(row, SpeculativeRow) for row in before + after):
            raise BenchmarkError("a plain measurement has no speculative rows")
        typed_before = [row for row in before if isinstance(row, SpeculativeRow)]
        typed_after = [row for row in after if isinstance(row, SpeculativeRow)]
        plain_before = statistics.median(r.plain_host_us for r in typed_before)
        plain_after = statistics.median(r.plain_host_us for r in typed_after)
        host_before = statistics.median(r.host_us for r in typed_before)
        host_after = statistics.median(r.host_us for r in typed_after)
        tokens = (
            f"{statistics.median(r.tokens_per_lane for r in typed_before):.2f} / "
            f"{statistics.median(r.tokens_per_lane for r in typed_after):.2f}"
        )
        means = (
            f"{statistics.median(r.mean_host_us for r in typed_before):.1f} / "
            f"{statistics.median(r.mean_host_us for r in typed_after):.1f}"
        )
        print(
            f"| {batch} | {plain_before:.1f} / {plain_after:.1f} | {spread([r.host_us for r in typed_before])} "
            f"| {spread([r.host_us for r in typed_after])} | {host_after / host_before:.2f} | {means} "
            f"| {host_before / plain_before:.2f} | {host_after / plain_after:.2f} | {tokens} |"
        )


def print_single(measurement: Measurement, steps: int, text: bool) -> None:
    gates = "" if text else ", no host gates"
    print(f"host time per decode round, null backend{gates}, {steps} steps, {date.today()}")
    print(f"conditions: {describe(measurement.conditions)}")
    print(
        f"{'batch':>5} {'median us':>10} {'p99 us':>9} {'us/request':>11} {'cpu us':>7} {'run us':>7} "
        f"{'host us':>8} {'target us':>10} {'rounds':>7}"
    )
    for row in measurement.rows:
        if not isinstance(row, Row):
            raise BenchmarkError("a speculative measurement has no plain rows")
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
    for index, batch in enumerate(row.batch for row in current[0].rows):
        before = [row for m in baseline if isinstance(row := m.rows[index], Row)]
        after = [row for m in current if isinstance(row := m.rows[index], Row)]
        before_host = statistics.median(row.host_us for row in before)
        after_host = statistics.median(row.host_us for row in after)
        target = TARGETS_US.get(batch)
        run = f"{statistics.median(r.run_us for r in before):.1f} / {statistics.median(r.run_us for r in after):.1f}"
        print(
            f"| {batch} | {spread([r.median_us for r in before])} | {spread([r.host_us for r in before])} "
            f"| {spread([r.median_us for r in after])} | {spread([r.host_us for r in after])} "
            f"| {after_host / before_host:.2f} | {run} | {f'{target:.0f}' if target else '-'} |"
        )


def compare(
    ref: str | None,
    repeats: int,
    steps: int,
    text: bool,
    speculative: str | None = None,
    baseline_tree: Path | None = None,
    batches: tuple[int, ...] = BATCHES,
) -> None:
    """Measure ``ref``'s tree (or the unpacked ``baseline_tree``) and the working tree ``repeats`` times
    each, alternating their order."""
    head = git("rev-parse", "--short", "HEAD")
    changed = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    with tempfile.TemporaryDirectory(prefix="host-overhead-baseline-") as tmp:
        if baseline_tree is not None:
            if not (baseline_tree / "helios_core").is_dir() or not (baseline_tree / "contrib" / "ignition").is_dir():
                raise BenchmarkError(f"--baseline-tree {baseline_tree} holds no helios_core and contrib/ignition")
            tree, label = baseline_tree.resolve(), f"tree {baseline_tree}"
        else:
            if ref is None:
                raise BenchmarkError("a comparison needs --baseline REF or --baseline-tree DIR")
            commit = extract_tree(ref, Path(tmp))
            tree, label = Path(tmp), f"{ref} ({commit[:10]})"
        trees = (tree, ROOT)
        results: tuple[list[Measurement], list[Measurement]] = ([], [])
        for repeat in range(repeats):
            for which in (0, 1) if repeat % 2 == 0 else (1, 0):
                results[which].append(measure_tree(trees[which], steps, text, speculative, batches))
    labels = (label, f"working tree at {head}{changed}")
    if speculative is not None:
        print_speculative_comparison(results[0], results[1], labels, steps, text)
    else:
        print_comparison(results[0], results[1], labels, steps, text)


def batch_sizes(value: str) -> tuple[int, ...]:
    """``--batches``: comma-separated batch sizes among :data:`BATCHES`, in that order."""
    try:
        sizes = {int(size) for size in value.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    unknown = sorted(sizes - set(BATCHES))
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]} is not one of {', '.join(map(str, BATCHES))}")
    return tuple(size for size in BATCHES if size in sizes)


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
    baseline = parser.add_mutually_exclusive_group()
    baseline.add_argument("--baseline", metavar="REF", help="also measure this commit's tree, in the same run")
    baseline.add_argument(
        "--baseline-tree", metavar="DIR", type=Path, help="also measure this unpacked tree, in the same run"
    )
    parser.add_argument(
        "--speculative", choices=SPECULATIVE_KINDS, help="host time per speculative round beside plain decode"
    )
    parser.add_argument(
        "--batches", type=batch_sizes, default=BATCHES, help="batch sizes to measure (default: 1,16,64,256)"
    )
    parser.add_argument("--repeats", type=at_least(1), default=3, help="measurements per tree with --baseline")
    parser.add_argument(
        "--measure-only", action="store_true", help="measure the helios_core this interpreter imports (PYTHONPATH)"
    )
    parser.add_argument("--json", action="store_true", help="print the conditions and rows as one JSON line")
    args = parser.parse_args(argv)
    comparing = args.baseline is not None or args.baseline_tree is not None
    if comparing and args.measure_only:
        parser.error("--baseline and --measure-only exclude each other")
    try:
        pin(args.cpus, args.no_pin)  # before numpy starts its threads
    except (ValueError, OSError) as error:
        parser.error(f"--cpus {args.cpus}: {error}")
    if not args.measure_only:
        use_tree(ROOT)
    try:
        if comparing:
            compare(
                args.baseline, args.repeats, args.steps, not args.no_text, args.speculative, args.baseline_tree,
                args.batches,
            )  # fmt: skip
            return 0
        measurement = measure_here(args.steps, not args.no_text, args.speculative, args.batches)
    except BenchmarkError as error:
        print(f"host_overhead: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"conditions": measurement.conditions, "rows": [asdict(row) for row in measurement.rows]}))
    elif args.speculative is not None:
        print_speculative(measurement, args.steps, not args.no_text)
    else:
        print_single(measurement, args.steps, not args.no_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
