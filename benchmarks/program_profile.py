"""Where a captured program's GPU time goes: each launch timed alone, beside the whole graph's replay.

Loads a core with the CUDA backend, stages one plausible round for each named program (every row
active, greedy, a history of ``--position`` tokens per row), then prints per operator the median
time of its launches run one at a time (each between two events, so a few microseconds of launch
latency are included), their sum, and the median replay time of the program's CUDA graph with and
without programmatic dependent launch. Needs an NVIDIA GPU:

    python benchmarks/program_profile.py CORE --trust-key PUB --accept NS [--programs decode_b1,decode_b64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "contrib" / "ignition")]

import numpy as np  # noqa: E402

from helios_core.backends.cuda import CudaBackend, target_launches  # noqa: E402
from helios_core.backends.cuda_driver import pack_params  # noqa: E402
from helios_core.loading import TrustSettings, open_core  # noqa: E402
from helios_core.wire import manifest_pb2 as mf  # noqa: E402


def _stage(backend: CudaBackend, rows: int, tokens: int, position: int, page_tokens: int, width: int) -> None:
    staging = backend.transport(0)
    per_row = tokens // rows
    lanes = np.repeat(np.arange(rows), per_row)
    offsets = np.tile(np.arange(per_row), rows)
    positions = position + offsets
    pages = np.arange(rows * width).reshape(rows, width) % 4096
    values = {
        "query_length": np.full(rows, per_row),
        "positions": positions,
        "token_rows": lanes,
        "cache_slots": pages[lanes, positions // page_tokens] * page_tokens + positions % page_tokens,
        "input_ids": (np.arange(tokens) * 7919) % 200,
        "page_table": pages,
        "state_rows": np.arange(rows),
        "sample_active": np.ones(rows),
        "generation": np.ones(rows),
        "temperature": np.zeros(rows),
        "top_p": np.ones(rows),
        "top_k": np.zeros(rows),
        "min_p": np.zeros(rows),
        "repetition_penalty": np.ones(rows),
        "frequency_penalty": np.zeros(rows),
        "presence_penalty": np.zeros(rows),
        "seed": np.arange(rows),
        "sampling_step": np.zeros(rows),
    }
    for name, value in values.items():
        if name in staging:
            target = staging[name].reshape(-1)
            target[: value.size] = value.reshape(-1)[: target.size].astype(target.dtype)


def _median_ms(backend: CudaBackend, action: Callable[[], None], repeats: int) -> float:
    ctx = backend._ctx
    start, end = ctx.timing_event(), ctx.timing_event()
    times = []
    for _ in range(repeats):
        ctx.record(start)
        action()
        ctx.record(end)
        ctx.wait_event(end)
        times.append(ctx.elapsed_ms(start, end))
    return statistics.median(times)


def _replay(backend: CudaBackend, program: str) -> Callable[[], None]:
    return lambda: backend.run(program, 0)


def _single_launches(
    backend: CudaBackend, functions: Mapping[tuple[str, str], Any], program: mf.ProgramDecl, repeats: int
) -> dict[str, list[float]]:
    """Median milliseconds of each launch run alone, grouped by operator."""
    addresses = backend._frames[0].addresses
    ctx = backend._ctx
    by_op: dict[str, list[float]] = defaultdict(list)
    for node, launch in target_launches(program, backend.architecture):
        function = functions[(launch.module, launch.symbol)]
        params = pack_params(launch.params, addresses)

        def one(function: Any = function, launch: mf.KernelLaunch = launch, params: Any = params) -> None:
            ctx.launch(function, launch.grid, launch.block, launch.shared_bytes, params)

        by_op[node.op.name].append(_median_ms(backend, one, repeats))
    return by_op


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("core", type=Path)
    parser.add_argument("--trust-key", type=Path, required=True)
    parser.add_argument("--accept", required=True)
    parser.add_argument("--programs", default="decode_b1")
    parser.add_argument("--position", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    verified = open_core(args.core, TrustSettings((args.trust_key,), args.accept, None), check_resources=False)
    contract = verified.contract
    page_tokens = contract.model.cache.page_tokens
    width = -(-contract.serving.context_tokens // page_tokens)
    rows_total = contract.serving.max_concurrency
    backends = {
        flag: CudaBackend(contract, verified.core, cache_pages=4096, state_rows=rows_total, frames=2, programmatic=flag)
        for flag in (True, False)
    }
    try:
        backend = backends[True]
        functions = backend._load_code(contract.execution, verified.core, backend.architecture)
        programs = {p.name: p for p in contract.execution.programs}
        for name in args.programs.split(","):
            graph = contract.graphs[name]
            rows, tokens = graph.extents.batch_capacity, graph.extents.packed_token_capacity
            for each in backends.values():
                _stage(each, rows, tokens, args.position, page_tokens, width)
            by_op = _single_launches(backend, functions, programs[name], args.repeats)
            replay = {flag: _median_ms(each, _replay(each, name), args.repeats) for flag, each in backends.items()}
            total = sum(sum(times) for times in by_op.values())
            launches = sum(len(t) for t in by_op.values())
            with_pdl, without = replay[True] * 1000, replay[False] * 1000
            print(f"\n{name}: {launches} launches, sum of single launches {total * 1000:.1f} us; graph replay "
                  f"{with_pdl:.1f} us with programmatic launch, {without:.1f} us without")  # fmt: skip
            print(f"{'operator':<22} {'launches':>8} {'total us':>10} {'mean us':>9}")
            for op, times in sorted(by_op.items(), key=lambda item: -sum(item[1])):
                print(f"{op:<22} {len(times):>8} {sum(times) * 1000:>10.1f} {statistics.mean(times) * 1000:>9.1f}")
    finally:
        for each in backends.values():
            each.close()
        verified.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
