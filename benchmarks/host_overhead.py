"""Host time per scheduling round with the null backend, at batch 1, 16, 64 and 256.

The null backend writes well-formed completion records without computing, so the time of a worker
step is pure host overhead: planning the round (scheduler), shared packing, the launch call,
completion validation and publishing events. One run prints one table; the targets are 40 us per
step at batch 1 and 300 us at batch 256 on the 2-core CPU machine.

    python benchmarks/host_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

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


def measure(core: Path, key: Path, batch: int, steps: int) -> tuple[float, float, int]:
    """Median and p99 microseconds of decode steps with ``batch`` active requests."""
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.messages import PreparedRequest, SamplingParams
    from helios_core.runtime.startup import start

    running = start(core, TrustSettings((key,), "bench/null", None), LoadOptions(max_active=batch), backend="null")
    engine = running.engine
    durations: list[float] = []
    original = engine._step

    rounds = engine.scheduler.stats.rounds

    def timed_step() -> None:
        before = sum(rounds.values())
        begin = time.perf_counter_ns()
        original()
        elapsed = (time.perf_counter_ns() - begin) / 1000
        launched = sum(rounds.values()) - before
        # A step may launch two decode rounds (two frames): report host time per round.
        durations.extend([elapsed / launched] * launched if launched else [])

    engine._step = timed_step  # type: ignore[method-assign]
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
    # Steady state: the last ``steps // 2`` decode rounds (admission and prefill excluded).
    tail = sorted(durations[-(steps // 2) :])
    return statistics.median(tail), tail[int(len(tail) * 0.99) - 1], decode_rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps per batch size")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        core, key = build(Path(tmp))
        rows = [(batch, *measure(core, key, batch, args.steps)) for batch in BATCHES]
    print(f"host time per decode round, null backend, {args.steps} steps, {date.today()}")
    print(f"{'batch':>5} {'median us':>10} {'p99 us':>9} {'us/request':>11} {'target us':>10} {'rounds':>7}")
    for batch, median, p99, rounds in rows:
        target = TARGETS_US.get(batch)
        print(
            f"{batch:>5} {median:>10.1f} {p99:>9.1f} {median / batch:>11.2f} "
            f"{(f'{target:.0f}' if target else '-'):>10} {rounds:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
