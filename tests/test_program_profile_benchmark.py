"""The program profile's host-side timing (no GPU): the sustained replay queues its replays back to back."""

from __future__ import annotations

from typing import Any

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
