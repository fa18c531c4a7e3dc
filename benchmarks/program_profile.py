"""Where a captured program's GPU time goes: each launch timed alone, beside the whole graph's replay.

Loads a core with the CUDA backend, stages one plausible round for each named program (every row
active, greedy, a history of ``--position`` tokens per row, and for a program of copied proposals all
W - 1 of them, so the verification samples every position), then prints per operator the median
time of its launches run one at a time (each between two events, so a few microseconds of launch
latency are included), their sum, and the median replay time of the program's CUDA graph with and
without programmatic dependent launch (each replay timed alone, the device idle before it), and the time a
replay takes with ``--back-to-back`` of them queued one after another, as a served decode queues its rounds.
With ``--ablate`` it also prints, per operator, what the
graph loses when that operator's launches are left out (a graph of the other launches, chained as
the program chains them): the operator's share of the replay inside the graph, launch gaps
included (``--by-kernel``: per operator and kernel). With ``--edges`` it prints, for each kind of
programmatic edge (the operator and kernel of the launch before, and of the launch that waits on it
programmatically), what the replay gains when those edges wait the ordinary way instead (the launch
starts after the one before has finished): a positive figure means programmatic launch costs there, as
when the waiting programs take room on the multiprocessors that the launch before still needs. The
outputs of an ablated graph are meaningless; only its time is read. Needs an NVIDIA GPU:

    python benchmarks/program_profile.py CORE --trust-key PUB --accept NS [--programs decode_b1,decode_b64] [--ablate]
        [--lanes 1 --position 0 --programs prefill_p512] [--edges]
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
        # a speculative program verifies every copied proposal a lane has room for
        "candidate_count": np.full(rows, per_row - 1),
        "candidate_generation": np.ones(rows),
        "candidate_consumed": position + np.zeros(rows),
        f"candidate_ids_w{per_row}": (np.arange(rows * max(per_row - 1, 1)) * 104729) % 200,
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


def _back_to_back_ms(backend: CudaBackend, program: str, replays: int) -> float:
    """Milliseconds a replay of ``program``'s graph when ``replays`` of them are queued one after another, as a
    served decode queues its rounds (the device never idle between them, unlike :func:`_median_ms`'s)."""

    def queue_all() -> None:
        for _ in range(replays):
            backend.run(program, 0)

    backend.run(program, 0)  # one untimed replay first
    return _median_ms(backend, queue_all, 1) / replays


def _replay(backend: CudaBackend, program: str) -> Callable[[], None]:
    return lambda: backend.run(program, 0)


def _group(node: mf.Node, launch: mf.KernelLaunch, by_kernel: bool) -> str:
    """The row a launch is counted in: its operator, or its operator and kernel (``--by-kernel``)."""
    return f"{node.op.name}:{launch.symbol}" if by_kernel else node.op.name


def _single_launches(
    backend: CudaBackend,
    functions: Mapping[tuple[str, str], Any],
    program: mf.ProgramDecl,
    repeats: int,
    by_kernel: bool,
) -> dict[str, list[float]]:
    """Median milliseconds of each launch run alone, grouped by operator (or operator and kernel)."""
    addresses = backend._frames[0].addresses
    ctx = backend._ctx
    by_op: dict[str, list[float]] = defaultdict(list)
    for node, launch in target_launches(program, backend.architecture):
        function = functions[(launch.module, launch.symbol)]
        params = pack_params(launch.params, addresses)

        def one(function: Any = function, launch: mf.KernelLaunch = launch, params: Any = params) -> None:
            ctx.launch(function, launch.grid, launch.block, launch.shared_bytes, params)

        by_op[_group(node, launch, by_kernel)].append(_median_ms(backend, one, repeats))
    return by_op


def _chain(
    backend: CudaBackend,
    functions: Mapping[tuple[str, str], Any],
    launches: list[mf.KernelLaunch],
    plain: frozenset[int] = frozenset(),
) -> tuple[Any, Any]:
    """(the builder, the instantiated graph) of ``launches`` on frame 0, each after the one before
    (programmatic edges where the launch waits programmatically, except the launches whose indices are in
    ``plain``), without the program's copies."""
    addresses = backend._frames[0].addresses
    builder = backend._ctx.graph()
    previous: Any = None
    for index, launch in enumerate(launches):
        previous = builder.kernel(
            functions[(launch.module, launch.symbol)],
            launch.grid,
            launch.block,
            int(launch.shared_bytes),
            pack_params(launch.params, addresses),
            previous,
            programmatic=launch.programmatic_wait and previous is not None and index not in plain,
        )
    return builder, builder.instantiate()


def programmatic_edges(groups: list[str], waits: list[bool]) -> dict[str, list[int]]:
    """The programmatic edges of a chain of launches by kind: ``"<group before> -> <group>"`` to the indices
    of the launches that wait programmatically on a launch of the first group (``groups[i]`` the group of
    launch ``i``, ``waits[i]`` whether it waits programmatically; the first launch waits on nothing)."""
    edges: dict[str, list[int]] = defaultdict(list)
    for index in range(1, len(groups)):
        if waits[index]:
            edges[f"{groups[index - 1]} -> {groups[index]}"].append(index)
    return dict(edges)


def _timed_chain(
    backend: CudaBackend,
    functions: Mapping[tuple[str, str], Any],
    program: mf.ProgramDecl,
    repeats: int,
    by_kernel: bool,
) -> tuple[list[mf.KernelLaunch], list[str], float]:
    """(the program's launches for the backend's target, the group of each (:func:`_group`), the replay ms of
    them all chained)."""
    pairs = target_launches(program, backend.architecture)
    launches = [launch for _node, launch in pairs]
    groups = [_group(node, launch, by_kernel) for node, launch in pairs]
    return launches, groups, _chain_replay_ms(backend, functions, launches, repeats)


def _ablations(
    backend: CudaBackend,
    functions: Mapping[tuple[str, str], Any],
    program: mf.ProgramDecl,
    repeats: int,
    by_kernel: bool,
) -> tuple[float, dict[str, tuple[int, float]]]:
    """(replay ms of every launch chained, {operator (or operator and kernel): (launches, ms lost without
    them)})."""
    launches, groups, full = _timed_chain(backend, functions, program, repeats, by_kernel)
    lost: dict[str, tuple[int, float]] = {}
    for op in dict.fromkeys(groups):
        kept = [launch for launch, group in zip(launches, groups, strict=True) if group != op]
        count = len(launches) - len(kept)
        lost[op] = (count, full - _chain_replay_ms(backend, functions, kept, repeats) if kept else full)
    return full, lost


def _edge_gains(
    backend: CudaBackend,
    functions: Mapping[tuple[str, str], Any],
    program: mf.ProgramDecl,
    repeats: int,
    by_kernel: bool,
) -> tuple[float, dict[str, tuple[int, float]]]:
    """(replay ms of every launch chained, {kind of programmatic edge (:func:`programmatic_edges`): (edges, ms
    gained when those edges wait the ordinary way)})."""
    launches, groups, full = _timed_chain(backend, functions, program, repeats, by_kernel)
    gained: dict[str, tuple[int, float]] = {}
    for kind, indices in programmatic_edges(groups, [launch.programmatic_wait for launch in launches]).items():
        plain = frozenset(indices)
        gained[kind] = (len(indices), full - _chain_replay_ms(backend, functions, launches, repeats, plain))
    return full, gained


def _chain_replay_ms(
    backend: CudaBackend,
    functions: Mapping[tuple[str, str], Any],
    launches: list[mf.KernelLaunch],
    repeats: int,
    plain: frozenset[int] = frozenset(),
) -> float:
    """Median replay milliseconds of ``launches`` chained (:func:`_chain`)."""
    ctx = backend._ctx
    builder, executable = _chain(backend, functions, launches, plain)
    try:
        return _median_ms(backend, lambda: ctx.launch_graph(executable), repeats)
    finally:
        ctx.destroy_graph(executable)
        builder.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("core", type=Path)
    parser.add_argument("--trust-key", type=Path, required=True)
    parser.add_argument("--accept", required=True)
    parser.add_argument("--programs", default="decode_b1")
    parser.add_argument("--position", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--back-to-back", type=int, default=100,
        help="replays queued one after another for the sustained figure (the device never idle between them)",
    )  # fmt: skip
    parser.add_argument(
        "--lanes", type=int, default=0,
        help="lanes to stage (default: the graph's batch capacity); 1: one prompt of all a prompt program's tokens",
    )  # fmt: skip
    parser.add_argument("--ablate", action="store_true", help="time the graph without each operator in turn")
    parser.add_argument("--by-kernel", action="store_true", help="one row per operator and kernel, not per operator")
    parser.add_argument(
        "--edges", action="store_true",
        help="time the graph with each kind of programmatic edge waiting the ordinary way in turn",
    )  # fmt: skip
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
            rows = min(args.lanes, rows) if args.lanes > 0 else rows
            for each in backends.values():
                _stage(each, rows, tokens, args.position, page_tokens, width)
            by_op = _single_launches(backend, functions, programs[name], args.repeats, args.by_kernel)
            replay = {flag: _median_ms(each, _replay(each, name), args.repeats) for flag, each in backends.items()}
            total = sum(sum(times) for times in by_op.values())
            launches = sum(len(t) for t in by_op.values())
            with_pdl, without = replay[True] * 1000, replay[False] * 1000
            sustained = _back_to_back_ms(backend, name, args.back_to_back) * 1000
            print(f"\n{name}: {launches} launches, sum of single launches {total * 1000:.1f} us; graph replay "
                  f"{with_pdl:.1f} us with programmatic launch, {without:.1f} us without; {sustained:.1f} us a "
                  f"replay with {args.back_to_back} queued back to back")  # fmt: skip
            print(f"{'operator':<60} {'launches':>8} {'total us':>10} {'mean us':>9}")
            for op, times in sorted(by_op.items(), key=lambda item: -sum(item[1])):
                print(f"{op:<60} {len(times):>8} {sum(times) * 1000:>10.1f} {statistics.mean(times) * 1000:>9.1f}")
            if args.ablate:
                full, lost = _ablations(backend, functions, programs[name], args.repeats, args.by_kernel)
                print(f"\n{name}: the launches chained alone replay in {full * 1000:.1f} us; without each operator:")
                print(f"{'operator':<60} {'launches':>8} {'us lost':>9} {'us a launch':>11}")
                for op, (count, ms) in sorted(lost.items(), key=lambda item: -item[1][1]):
                    print(f"{op:<60} {count:>8} {ms * 1000:>9.1f} {ms * 1000 / count:>11.2f}")
            if args.edges:
                full, gained = _edge_gains(backend, functions, programs[name], args.repeats, args.by_kernel)
                print(f"\n{name}: the launches chained alone replay in {full * 1000:.1f} us; with each kind of "
                      "programmatic edge waiting the ordinary way:")  # fmt: skip
                print(f"{'edge (launch before -> launch waiting)':<110} {'edges':>6} {'us gained':>10}")
                for kind, (count, ms) in sorted(gained.items(), key=lambda item: -item[1][1]):
                    print(f"{kind:<110} {count:>6} {ms * 1000:>10.1f}")
    finally:
        for each in backends.values():
            each.close()
        verified.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
