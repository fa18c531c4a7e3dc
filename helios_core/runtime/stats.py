"""Native statistics of the model worker, as plain objects the server exports as metrics.

Owns the counters the scheduler and engine increment (request lifecycle, token counts and the
time-to-first-token and request-latency histograms, rounds and graph launches, mixed grammar steps,
constrained in-flight frames) and the snapshot type that joins them
with the page allocator's counters (and its host tier's) and the current gauges (a frozen msgspec
struct: the worker takes one after every round). Labels are program names, operations and finish
reasons only: never request identifiers, prompt text or token ids.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

CountKey = TypeVar("CountKey", str, int)


def _add(counts: dict[CountKey, int], key: CountKey, amount: int = 1) -> None:
    """Add ``amount`` to the count of ``key`` (a key not counted yet starts at 0)."""
    counts[key] = counts.get(key, 0) + amount


TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Upper bounds (seconds) of the time-to-first-token histogram's buckets (vLLM's, so dashboards line up)."""

E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Upper bounds (seconds) of the request-latency histogram's buckets (vLLM's)."""


@dataclass
class LatencyHistogram:
    """Observed durations in fixed buckets: ``counts[i]`` holds the observations of at most ``bounds[i]``
    seconds and more than the bound before it; the last count the ones above every bound."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds


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
    snapshots_discarded: int = 0
    """Committed snapshots whose rows were freed unrestored: their request left (cancelled, failed, stopped)
    while it waited for readmission or for its restore."""
    pipelined_rounds: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)
    lanes: int = 0
    mixed_grammar_decode_steps: int = 0
    constrained_max_inflight: int = 0

    speculative_lanes: dict[int, int] = field(default_factory=dict)
    """Speculative lanes by their program's width W (this and the next three are keyed alike)."""
    proposals_offered: dict[int, int] = field(default_factory=dict)
    drafts_accepted: dict[int, int] = field(default_factory=dict)
    speculative_emitted: dict[int, int] = field(default_factory=dict)
    offered_by_position: dict[int, int] = field(default_factory=dict)
    """Proposals offered at each draft position (1 = the first proposal after the pending token)."""
    accepted_by_position: dict[int, int] = field(default_factory=dict)
    speculation_stretches: dict[str, int] = field(default_factory=dict)
    """With ``--speculation-payoff``: stretches of rounds chosen after a measurement, by kind ("speculate",
    "decode")."""
    prompt_tokens: int = 0
    """Prompt tokens of the requests that ended (finished or cancelled; counted at their end)."""
    generation_tokens: int = 0
    """Tokens those requests generated (their ``completion_tokens``)."""
    time_to_first_token: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(TTFT_BUCKETS_S))
    """From a request's submission to the engine to its first token's publication."""
    request_latency: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(E2E_BUCKETS_S))
    """From a request's submission to its end, for requests that finished (not cancelled or failed)."""

    def count_speculation(self, width: int, offered: int, accepted: int, emitted: int) -> None:
        """One speculative lane of a program of width ``width``: ``offered`` proposals, ``accepted`` of them (a prefix),
        ``emitted`` tokens."""
        _add(self.speculative_lanes, width)
        _add(self.proposals_offered, width, offered)
        _add(self.drafts_accepted, width, accepted)
        _add(self.speculative_emitted, width, emitted)
        for position in range(1, offered + 1):
            _add(self.offered_by_position, position)
            if position <= accepted:
                _add(self.accepted_by_position, position)

    def count_round(self, graph: str, operation: str, lanes: int) -> None:
        _add(self.rounds, operation)
        _add(self.launches, graph)
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
    speculative_lanes: dict[int, int] = {}
    proposals_offered: dict[int, int] = {}
    drafts_accepted: dict[int, int] = {}
    speculative_emitted: dict[int, int] = {}
    offered_by_position: dict[int, int] = {}
    accepted_by_position: dict[int, int] = {}
    speculation_stretches: dict[str, int] = {}
    offload_capacity_pages: int = 0
    """Host-tier slots (``--offload-pages``; 0: no host tier); the next five are 0 without one."""
    offload_pages_used: int = 0
    offload_pages_free: int = 0
    offloaded_pages: int = 0
    """Published device pages copied into the host tier on eviction."""
    restored_pages: int = 0
    """Host-tier pages copied back into device pages for a prefix match."""
    offload_evicted_pages: int = 0
    """Pages that left the host tier's index to make room (least recently used first)."""
    checkpoints_held: int = 0
    """Published prefix checkpoints (snapshot rows at exact endpoints); this and the next five are 0 for a
    core that takes none."""
    checkpoints_published: int = 0
    checkpoint_hits: int = 0
    """Admissions that restored a checkpoint."""
    checkpoint_reused_tokens: int = 0
    """Prompt tokens those admissions did not compute."""
    checkpoints_evicted: int = 0
    checkpoints_abandoned: int = 0
    """Checkpoint snapshots never published (their round failed, or their request left first)."""
    offload_capacity_checkpoints: int = 0
    """Checkpoint host-tier slots (``--offload-checkpoints``; 0: no host tier); the next four are 0 without one."""
    offload_checkpoints: int = 0
    """Host slots holding an evicted checkpoint."""
    offloaded_checkpoints: int = 0
    """Checkpoints copied from their snapshot row into a host slot when evicted."""
    restored_checkpoints: int = 0
    """Host checkpoints copied back into a snapshot row for a prompt sharing their prefix."""
    offload_evicted_checkpoints: int = 0
    """Checkpoints that left the host tier to make room (least recently used first)."""
    snapshots_discarded: int = 0
    """Committed snapshots freed without a restore (their request left while it waited for readmission or for
    its restore): ``snapshots − restores − snapshots_discarded`` requests hold a snapshot now."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token_counts: list[int] = []
    """Per bucket of :data:`TTFT_BUCKETS_S` (and one above the last), not cumulative."""
    time_to_first_token_sum_s: float = 0.0
    request_latency_counts: list[int] = []
    """Per bucket of :data:`E2E_BUCKETS_S` (and one above the last), not cumulative."""
    request_latency_sum_s: float = 0.0
