"""The program profile's host-side logic (no GPU): the sustained replay queues its replays back to back; the
ablations time the chain without each group of launches, or with each kind of programmatic edge made ordinary."""

from __future__ import annotations

from typing import Any

import pytest

from helios_core.wire import manifest_pb2 as mf
from tests import benchmark_modules


class Context:
    """Records the order of graph launches and events on the one stream; 'elapsed' is launches between events."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def timing_event(self) -> dict[str, int]:
        return {}

    def record(self, event: dict[str, int]) -> None:
        event["at"] = len(self.log)
        self.log.append("record")

    def wait_event(self, event: dict[str, int]) -> None:
        self.log.append("wait")

    def elapsed_ms(self, start: dict[str, int], end: dict[str, int]) -> float:
        return float(sum(1 for item in self.log[start["at"] : end["at"]] if item == "run") * 10)


class Backend:
    def __init__(self) -> None:
        self.log: list[Any] = []
        self._ctx = Context(self.log)

    def run(self, program: str, frame: int) -> None:
        self.log.append("run")


def test_the_sustained_replay_queues_every_replay_before_it_waits() -> None:
    profile = benchmark_modules.load_benchmark("program_profile")
    backend = Backend()
    per_replay = profile._back_to_back_ms(backend, "decode_b256", 4)
    # one untimed replay, then four queued between the two events with no wait among them
    assert backend.log == ["run", "record", "run", "run", "run", "run", "record", "wait"]
    assert per_replay == 10.0


def test_programmatic_edges_are_grouped_by_the_launch_before_and_the_launch_waiting() -> None:
    profile = benchmark_modules.load_benchmark("program_profile")
    groups = ["norm", "proj", "attn", "proj", "norm", "proj", "proj"]
    waits = [True, True, True, False, True, True, True]
    # the first launch has nothing to wait on; launch 3 waits the ordinary way and is no programmatic edge
    assert profile.programmatic_edges(groups, waits) == {
        "norm -> proj": [1, 5],
        "proj -> attn": [2],
        "proj -> norm": [4],
        "proj -> proj": [6],
    }


def test_ablations_time_the_chain_without_each_group_or_with_each_kind_of_edge_ordinary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profile = benchmark_modules.load_benchmark("program_profile")

    def node(op: str) -> mf.Node:
        made = mf.Node(name=op)
        made.op.name = op
        return made

    chain = [("norm", "a", True), ("proj", "b", True), ("attn", "c", True), ("proj", "b", False), ("proj", "b", True)]
    pairs = [(node(op), mf.KernelLaunch(symbol=symbol, programmatic_wait=wait)) for op, symbol, wait in chain]
    monkeypatch.setattr(profile, "target_launches", lambda program, architecture: pairs)
    timed: list[tuple[list[str], frozenset[int]]] = []

    def replay_ms(
        backend: Any, functions: Any, launches: list[Any], repeats: int, plain: frozenset[int] = frozenset()
    ) -> float:
        timed.append(([launch.symbol for launch in launches], plain))
        return 10.0 * len(launches) + len(plain)  # each launch 10 ms; each ordinary edge 1 ms more

    monkeypatch.setattr(profile, "_chain_replay_ms", replay_ms)
    backend = type("Backend", (), {"architecture": "sm_90a"})()
    full, lost = profile._ablations(backend, {}, mf.ProgramDecl(), 3, False)
    assert full == 50.0
    assert lost == {"norm": (1, 10.0), "proj": (3, 30.0), "attn": (1, 10.0)}
    # without the norm, without the three projections, without attention: each chain with no edge made ordinary
    assert [symbols for symbols, _plain in timed[1:]] == [["b", "c", "b", "b"], ["a", "c"], ["a", "b", "b", "b"]]
    assert all(plain == frozenset() for _symbols, plain in timed)
    timed.clear()
    full, gained = profile._edge_gains(backend, {}, mf.ProgramDecl(), 3, True)
    assert full == 50.0
    # launch 3 waits the ordinary way already: no edge of its kind; the rest, each kind made ordinary in turn
    assert gained == {"norm:a -> proj:b": (1, -1.0), "proj:b -> attn:c": (1, -1.0), "proj:b -> proj:b": (1, -1.0)}
    assert [plain for _symbols, plain in timed[1:]] == [frozenset({1}), frozenset({2}), frozenset({4})]
