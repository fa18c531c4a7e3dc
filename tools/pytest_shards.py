"""Run a pytest selection as several pytest processes side by side, and report them as one run.

The GPU suite's time goes mostly to the reference backend's numpy on the host, one test after another,
while the GPU waits. On a machine with many cores, shards of the same selection run side by side against
the one GPU finish in a fraction of the time (the kernel cache is shared; its entries are published
atomically). Tests are dealt out round-robin in collection order, so the parametrised cases of one test
spread over every shard; each ``--serial`` names paths (the whole-core modules that build and serve cores,
whose fixtures are built once a module) whose tests run in one more shard of their own, in order.

    tools/gpu_run.sh python3 tools/pytest_shards.py --shards 4 --logs $OUT/shards \\
        tests/gpu/test_kernels_fused.py tests/gpu/test_kernels_elementwise.py \\
        --serial tests/gpu/test_serve.py tests/gpu/test_vision.py --serial tests/gpu/test_speculative.py

Each shard's numpy gets its share of the host's cores (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and
``MKL_NUM_THREADS``, unless set): with a thread a core in every shard, a run on the 16-core GPU machine went
many times slower. Each shard's whole output goes to ``<logs>/shard-N.log``; what is printed here is each
shard's failures and summary line, then one line with the totals. The exit status is 0 when every shard
passed (or skipped), else the first failing shard's status.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
_PROBLEM = re.compile(r"^(FAILED|ERROR) ")
_OUTCOME = re.compile(r"::\S.* (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_WORDS = {
    "PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors", "XFAIL": "xfailed",
    "XPASS": "xpassed",
}  # fmt: skip


def collect(paths: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The node ids pytest collects from ``paths`` (with ``extra`` options such as ``-k``), in order."""
    if not paths:
        return []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra, *paths],
        capture_output=True,
        text=True,
        check=False,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode not in (0, 5) or (not ids and done.returncode != 5):
        output = done.stdout[-4000:] + done.stderr[-4000:]
        raise SystemExit(f"pytest_shards: collecting {' '.join(paths)} failed:\n{output}")
    return ids


def deal(ids: Sequence[str], shards: int) -> list[list[str]]:
    """``ids`` dealt round-robin into ``shards`` lists (empty lists dropped)."""
    hands: list[list[str]] = [[] for _ in range(max(shards, 1))]
    for index, node in enumerate(ids):
        hands[index % len(hands)].append(node)
    return [hand for hand in hands if hand]


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""The thread counts of numpy's BLAS libraries, which otherwise start a thread a core in every process."""


def shard_environment(environment: Mapping[str, str], shards: int, cores: int) -> dict[str, str]:
    """``environment`` with each BLAS thread count not already set to the shards' share of the cores (at
    least one): shards that each start a thread a core leave the host's cores oversubscribed many times."""
    shared = dict(environment)
    for name in THREAD_VARIABLES:
        shared.setdefault(name, str(max(1, cores // max(shards, 1))))
    return shared


def tally(text: str) -> tuple[Counter[str], bool]:
    """The counts of pytest's last summary line in ``text`` (``error`` and ``errors`` counted together) and
    True; where a shard was cut before its summary, the outcomes of its verbose lines and False."""
    counts: Counter[str] = Counter()
    lines = [line for line in text.splitlines() if _SUMMARY.search(line) and (" in " in line or "no tests ran" in line)]
    if lines:
        for number, word in _SUMMARY.findall(lines[-1]):
            counts["errors" if word.startswith("error") else word] += int(number)
        return counts, True
    for match in _OUTCOME.finditer(text):
        counts[_WORDS[match.group(1)]] += 1
    return counts, False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="test paths dealt out over the shards")
    parser.add_argument(
        "--serial", nargs="+", action="append", default=[],
        help="test paths run in order in one shard of their own (each --serial another such shard)",
    )  # fmt: skip
    parser.add_argument("--shards", type=int, default=4, help="shards for the dealt paths (default 4)")
    parser.add_argument("--logs", type=Path, default=Path("build/pytest-shards"), help="folder of the shards' logs")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression applied to every shard")
    parser.add_argument("--pytest-args", default="", help="more pytest options for every shard, space-separated")
    parser.add_argument("--timeout", type=float, help="seconds after which shards still running are stopped")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    extra = ["-k", args.keyword] if args.keyword else []
    options = ["-p", "no:cacheprovider", "-v", "-rfE", "-o", "console_output_style=classic", *args.pytest_args.split()]
    hands = deal(collect(args.paths, extra), args.shards)
    for paths in args.serial:
        if serial := collect(paths, extra):
            hands.append(serial)
    if not hands:
        print("pytest_shards: nothing collected")
        return 5
    args.logs.mkdir(parents=True, exist_ok=True)
    environment = shard_environment(os.environ, len(hands), os.cpu_count() or 1)
    started = time.perf_counter()
    running = []
    for number, hand in enumerate(hands):
        log = (args.logs / f"shard-{number}.log").open("w")
        command = [sys.executable, "-m", "pytest", *options, *hand]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        running.append((number, len(hand), log, process))
    print(f"pytest_shards: {sum(len(hand) for hand in hands)} tests in {len(hands)} shards", flush=True)
    deadline = started + args.timeout if args.timeout else None
    status, totals = 0, Counter[str]()
    for number, size, log, process in running:
        try:
            code = process.wait(None if deadline is None else max(deadline - time.perf_counter(), 0.0))
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            code = 124
        log.close()
        text = (args.logs / f"shard-{number}.log").read_text(errors="replace")
        counts, whole = tally(text)
        totals.update(counts)
        for line in text.splitlines():
            if _PROBLEM.match(line) or (not whole and _OUTCOME.search(line) and " FAILED" in line):
                print(f"  shard {number}: {line}")
        summary = ", ".join(f"{value} {key}" for key, value in sorted(counts.items())) or "nothing ran"
        cut = "" if whole else f" (stopped before its summary: {size - sum(counts.values())} not reached)"
        print(f"shard {number}: {size} tests, exit {code}: {summary}{cut}", flush=True)
        if code not in (0, 5) and status == 0:
            status = code
    elapsed = time.perf_counter() - started
    overall = ", ".join(f"{value} {key}" for key, value in sorted(totals.items()))
    print(f"pytest_shards: {overall} in {elapsed:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
