"""Native statistics of the model worker, as plain objects the server exports as metrics.

Owns the counters the scheduler and engine increment (request lifecycle, rounds and graph
launches, mixed grammar steps, constrained in-flight frames) and the snapshot type that joins them
with the page allocator's counters and the current gauges (a frozen msgspec struct: the worker takes
one after every round). Labels are program names, operations and finish reasons only: never request
identifiers, prompt text or token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass
class SchedulerStats:
    """Counters written by the worker thread only."""

    received: int = 0
    admitted: int = 0
    rejected: int = 0
    failed: int = 0
    preemptions: int = 0
    snapshots: int = 0
    restores: int = 0
    pipelined_rounds: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)
    lanes: int = 0
    mixed_grammar_decode_steps: int = 0
    constrained_max_inflight: int = 0

    def count_round(self, graph: str, operation: str, lanes: int) -> None:
        self.rounds[operation] = self.rounds.get(operation, 0) + 1
        self.launches[graph] = self.launches.get(graph, 0) + 1
        self.lanes += lanes


class StatsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A consistent copy of every statistic at one moment."""

    received: int
    admitted: int
    rejected: int
    failed: int
    preemptions: int
    snapshots: int
    restores: int
    pipelined_rounds: int
    finished: dict[str, int]
    rounds: dict[str, int]
    launches: dict[str, int]
    lanes: int
    mixed_grammar_decode_steps: int
    constrained_max_inflight: int
    pages_total: int
    pages_free: int
    pages_referenced: int
    pages_evictable: int
    pages_published: int
    pages_evicted: int
    prefix_queries: int
    prefix_hit_pages: int
    reused_tokens: int
    active_requests: int
    waiting_requests: int
    max_active: int
