"""Prometheus metrics of one app, read from the engine's native statistics at scrape time.

Owns the app's ``CollectorRegistry`` (one per app, never the global one) and the collector that
turns one ``Engine.statistics()`` snapshot into metric families. The worker owns every counter
but one correction: an output failure (the request's output pipeline or presentation raised) is
found by the server after the worker ended the request as finished (``stop``, ``length``) or, once
the server stopped it, ``cancelled``. :class:`OutputFailures` records those ends and the collector
moves each from ``helios_requests_finished_total`` to ``helios_requests_failed_total``; a moved
count never makes an exported counter go down (each exported finished count is at least the last
one). Labels are program names,
operations and finish reasons only — never request ids, prompt contents or token ids. The list of
metrics and their meaning is docs/metrics.md.

The load gauges an inference gateway scrapes (``helios_num_requests_waiting``,
``helios_num_requests_running``, ``helios_kv_cache_usage_ratio``, ``helios_cache_config_info``, and
with ``vllm_metrics`` the same values under vLLM's names) are not read from the snapshot, which is only
taken between rounds and so is as old as the longest round: a :class:`LoadReading` is read live at
scrape time (sizes of the worker's lists and the server's permit counts, no lock the worker holds),
so these values are never older than the scrape.

With several HTTP processes (``--http-processes N``) every process exports the whole server's figures:
the engine's come from the worker process's load updates, which reach every process alike, and what an
HTTP process counts itself (its permits, the permits whose generation ended, :class:`OutputFailures`) is
kept in the table the processes share (:class:`~helios_core.server.server_tally.ServerTally`) and summed
over it at scrape time; :class:`HttpProcessCounters` adds the requests each process admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from helios_core.runtime.stats import E2E_BUCKETS_S, TTFT_BUCKETS_S, StatsSnapshot
from helios_core.server.server_tally import ServerTally

__all__ = [
    "CONTENT_TYPE",
    "HELIOS_LOAD_NAMES",
    "MEDIA_TYPE",
    "VLLM_LOAD_NAMES",
    "EngineCollector",
    "HttpProcessCounters",
    "KvEventCounters",
    "LoadReading",
    "MetricsExporter",
    "OutputFailures",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The exposition's content type, as served."""

MEDIA_TYPE = "text/plain; version=0.0.4"
"""What the route declares: Litestar appends ``; charset=utf-8`` to a ``text/`` media type itself."""


def _counter(name: str, documentation: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: int) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _histogram(
    name: str, documentation: str, bounds: Sequence[float], counts: Sequence[int], sum_s: float
) -> HistogramMetricFamily:
    """A histogram family from per-bucket ``counts`` over ``bounds`` (and one above them): Prometheus's
    buckets are cumulative, ``+Inf`` the total."""
    counts = list(counts) or [0] * (len(bounds) + 1)
    cumulative, buckets = 0, []
    for bound, count in zip([*(format(b, "g") for b in bounds), "+Inf"], counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=sum_s)


LabelKey = TypeVar("LabelKey", str, int)


def _labelled_counter(name: str, documentation: str, label: str, counts: Mapping[LabelKey, int]) -> CounterMetricFamily:
    """A counter family with one sample a key of ``counts``, in key order, the key as the ``label`` value."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, count in sorted(counts.items()):
        family.add_metric([str(key)], count)
    return family


HELIOS_LOAD_NAMES = (
    "helios_num_requests_waiting",
    "helios_num_requests_running",
    "helios_kv_cache_usage_ratio",
    "helios_cache_config_info",
)
"""The gateway gauges' names: waiting, running, cache usage, cache configuration."""

VLLM_LOAD_NAMES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)
"""The same gauges under vLLM's names (the defaults of the gateway's metric flags), when enabled."""


@dataclass(frozen=True)
class LoadReading:
    """The gateway's load values at one scrape."""

    waiting: int
    """Requests admitted over HTTP that hold no model slot (preparing, queued, preempted)."""
    running: int
    """Requests holding a model slot (prefill or decode)."""
    undelivered: int
    """Requests whose model work ended while their response is still delivered."""
    kv_cache_usage: float
    """``1 - (free + evictable) / total`` pages, in [0, 1]: idle cached pages count as free."""
    page_tokens: int
    pages_total: int


def _load_families(reading: LoadReading, vllm_metrics: bool) -> Iterator[GaugeMetricFamily]:
    """The gateway gauges, one series each; with ``vllm_metrics`` also under vLLM's names."""
    names = [HELIOS_LOAD_NAMES, VLLM_LOAD_NAMES] if vllm_metrics else [HELIOS_LOAD_NAMES]
    for waiting, running, usage, info in names:
        yield GaugeMetricFamily(
            waiting, "Requests admitted over HTTP without a model slot (preparing, queued, preempted).", reading.waiting
        )
        yield GaugeMetricFamily(running, "Requests holding a model slot.", reading.running)
        yield GaugeMetricFamily(
            usage, "Fraction of cache pages in use (0..1); idle cached pages count as free.", reading.kv_cache_usage
        )
        config = GaugeMetricFamily(
            info, "Cache configuration: tokens per page and physical pages.", labels=["block_size", "num_gpu_blocks"]
        )
        config.add_metric([str(reading.page_tokens), str(reading.pages_total)], 1)
        yield config


@dataclass
class OutputFailures:
    """Requests whose output failed after the worker ended them without failure (event loop only)."""

    moved: dict[str, int] = field(default_factory=dict)
    """Per finish reason the worker counted (``stop``, ``length``, ``cancelled``), how many were output failures
    (of this process)."""
    shared: ServerTally | None = None
    """The table of every HTTP process of the server (``--http-processes``), where each failure is counted too."""

    def record(self, reason: str) -> None:
        """One output failure of a request the worker finished with ``reason``."""
        self.moved[reason] = self.moved.get(reason, 0) + 1
        if self.shared is not None:
            self.shared.record_output_failure(reason)

    def counts(self) -> dict[str, int]:
        """Output failures by finish reason over the whole server."""
        return self.moved if self.shared is None else self.shared.output_failures()

    @property
    def total(self) -> int:
        return sum(self.counts().values())


def _none() -> int:
    return 0


class EngineCollector(Collector):
    """Collects every metric family from one statistics snapshot per scrape."""

    def __init__(
        self,
        statistics: Callable[[], StatsSnapshot],
        admitted: Callable[[], int],
        output_failures: OutputFailures | None = None,
        load: Callable[[], LoadReading] | None = None,
        vllm_metrics: bool = False,
        refused: Callable[[], int] | None = None,
    ) -> None:
        self._statistics = statistics
        self._admitted = admitted
        self._refused = refused if refused is not None else _none
        self._load = load
        self._vllm_metrics = vllm_metrics
        self._output_failures = output_failures if output_failures is not None else OutputFailures()
        self._finished_exported: dict[str, int] = {}

    def _finished(self, snapshot: StatsSnapshot) -> dict[str, int]:
        """Finished counts less the output failures. The server records a failure once it has seen the
        request's terminal event, which can precede the snapshot that counts that end: such a count is
        held at its last exported value until the snapshot catches up."""
        finished: dict[str, int] = {}
        moved = self._output_failures.counts()
        for reason in sorted({*snapshot.finished, *moved}):
            value = snapshot.finished.get(reason, 0) - moved.get(reason, 0)
            finished[reason] = max(value, self._finished_exported.get(reason, 0))
        self._finished_exported = finished
        return finished

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the snapshot; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        if self._load is not None:
            yield from _load_families(self._load(), self._vllm_metrics)
        s = self._statistics()
        yield _counter("helios_requests_received", "Requests the model worker queued.", s.received)
        yield _counter("helios_requests_admitted", "Requests admitted to a model slot.", s.admitted)
        yield _counter(
            "helios_requests_rejected",
            "Requests rejected at admission: outside the capacities, or refused with 429 at the server's bound.",
            s.rejected + self._refused(),
        )
        yield _counter(
            "helios_requests_failed",
            "Requests failed by execution or output errors.",
            s.failed + self._output_failures.total,
        )
        yield _counter("helios_preemptions", "Requests preempted to free cache pages.", s.preemptions)
        yield _counter("helios_snapshots_published", "Snapshots committed at exact token endpoints.", s.snapshots)
        yield _counter("helios_snapshots_restored", "Snapshots restored into private writable pages.", s.restores)
        yield _counter(
            "helios_snapshots_discarded",
            "Committed snapshots freed unrestored because their request left first.",
            s.snapshots_discarded,
        )
        yield _counter(
            "helios_pipelined_rounds",
            "Decode rounds launched on the second frame before the first was read.",
            s.pipelined_rounds,
        )
        yield _labelled_counter(
            "helios_requests_finished", "Requests finished normally, by reason.", "reason", self._finished(s)
        )
        yield from self._request_families(s, "helios_")
        if self._vllm_metrics:
            yield from self._request_families(s, "vllm:")
        yield _labelled_counter("helios_rounds", "Scheduling rounds, by operation.", "operation", s.rounds)
        yield _labelled_counter("helios_graph_launches", "Captured program launches.", "program", s.launches)
        yield _counter("helios_round_lanes", "Request lanes over all rounds.", s.lanes)
        yield _counter("helios_prefix_queries", "Prefix-cache lookups.", s.prefix_queries)
        yield _counter("helios_prefix_hit_pages", "Cache pages reused by prefix lookups.", s.prefix_hit_pages)
        yield _counter("helios_prefix_reused_tokens", "Prompt tokens reused from the prefix cache.", s.reused_tokens)
        yield _counter("helios_pages_published", "Cache pages published for prefix reuse.", s.pages_published)
        yield _counter("helios_pages_evicted", "Published cache pages evicted.", s.pages_evicted)
        yield _gauge("helios_pages_total", "Physical cache pages.", s.pages_total)
        yield _gauge("helios_pages_free", "Cache pages neither referenced nor cached.", s.pages_free)
        yield _gauge("helios_pages_referenced", "Cache pages referenced by requests.", s.pages_referenced)
        yield _gauge("helios_pages_evictable", "Cached pages no request references.", s.pages_evictable)
        yield _gauge(
            "helios_offload_capacity_pages",
            "Host-memory pages of the cache's host tier (0: off).",
            s.offload_capacity_pages,
        )
        yield _gauge("helios_offload_pages", "Host-tier pages holding offloaded cache pages.", s.offload_pages_used)
        yield _gauge("helios_offload_pages_free", "Host-tier pages holding nothing.", s.offload_pages_free)
        yield _counter(
            "helios_offloaded_pages", "Published cache pages copied to the host tier on eviction.", s.offloaded_pages
        )
        yield _counter(
            "helios_restored_pages", "Host-tier pages copied back to the device for a prefix match.", s.restored_pages
        )
        yield _counter(
            "helios_offload_evicted_pages",
            "Pages that left the host tier's prefix index to make room (least recently used first).",
            s.offload_evicted_pages,
        )
        yield _gauge(
            "helios_checkpoints", "Published prefix checkpoints (state at exact token endpoints).", s.checkpoints_held
        )
        yield _counter("helios_checkpoints_published", "Prefix checkpoints published.", s.checkpoints_published)
        yield _counter("helios_checkpoint_hits", "Admissions that restored a prefix checkpoint.", s.checkpoint_hits)
        yield _counter(
            "helios_checkpoint_reused_tokens",
            "Prompt tokens restored from prefix checkpoints instead of computed.",
            s.checkpoint_reused_tokens,
        )
        yield _counter(
            "helios_checkpoints_evicted", "Prefix checkpoints evicted for snapshot rows.", s.checkpoints_evicted
        )
        yield _counter(
            "helios_checkpoints_abandoned",
            "Prefix checkpoint snapshots never published (failed round, or the request left first).",
            s.checkpoints_abandoned,
        )
        yield _gauge(
            "helios_offload_capacity_checkpoints",
            "Host-memory slots of the checkpoint host tier (0: off).",
            s.offload_capacity_checkpoints,
        )
        yield _gauge(
            "helios_offload_checkpoints", "Host-tier slots holding evicted prefix checkpoints.", s.offload_checkpoints
        )
        yield _counter(
            "helios_offloaded_checkpoints",
            "Prefix checkpoints copied to the host tier when evicted from their snapshot rows.",
            s.offloaded_checkpoints,
        )
        yield _counter(
            "helios_restored_checkpoints",
            "Host-tier prefix checkpoints copied back into a snapshot row for a prompt sharing their prefix.",
            s.restored_checkpoints,
        )
        yield _counter(
            "helios_offload_evicted_checkpoints",
            "Prefix checkpoints that left the host tier to make room (least recently used first).",
            s.offload_evicted_checkpoints,
        )
        yield _gauge("helios_requests_active", "Requests holding a model slot.", s.active_requests)
        yield _gauge("helios_requests_waiting", "Requests queued for a model slot.", s.waiting_requests)
        yield _gauge("helios_max_active", "Selected model slots (max_active).", s.max_active)
        yield _gauge("helios_http_admitted", "Requests holding an HTTP admission permit.", self._admitted())
        for name, help_text, values in (
            ("helios_speculative_lanes", "Speculative lanes, by program width.", s.speculative_lanes),
            ("helios_speculative_proposals_offered", "Proposals offered to the target, by width.", s.proposals_offered),
            ("helios_speculative_drafts_accepted", "Proposals the target accepted, by width.", s.drafts_accepted),
            ("helios_speculative_tokens_emitted", "Tokens speculative lanes emitted, by width.", s.speculative_emitted),
        ):
            yield _labelled_counter(name, help_text, "width", values)
        yield _labelled_counter(
            "helios_speculative_offered_by_position",
            "Proposals offered at each draft position (1 is the first after the pending token).",
            "position",
            s.offered_by_position,
        )
        yield _labelled_counter(
            "helios_speculative_accepted_by_position",
            "Proposals accepted at each draft position.",
            "position",
            s.accepted_by_position,
        )
        yield _labelled_counter(
            "helios_speculation_stretches",
            "With --speculation-payoff: stretches of rounds chosen by measuring both kinds, by kind.",
            "kind",
            s.speculation_stretches,
        )
        yield _counter(
            "flare_mixed_grammar_decode_steps",
            "Successful decode submissions whose lanes include constrained and unconstrained requests.",
            s.mixed_grammar_decode_steps,
        )
        yield _gauge(
            "flare_constrained_max_inflight",
            "Maximum outstanding executor frames right after a successful constrained submission.",
            s.constrained_max_inflight,
        )

    @staticmethod
    def _request_families(s: StatsSnapshot, prefix: str) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """Token counts and request latencies (``prefix``: ``helios_``, or ``vllm:`` for vLLM's names)."""
        yield _counter(f"{prefix}prompt_tokens", "Prompt tokens of requests that ended.", s.prompt_tokens)
        yield _counter(f"{prefix}generation_tokens", "Tokens generated by requests that ended.", s.generation_tokens)
        yield _histogram(
            f"{prefix}time_to_first_token_seconds",
            "Seconds from a request's submission to the model worker to its first token.",
            TTFT_BUCKETS_S,
            s.time_to_first_token_counts,
            s.time_to_first_token_sum_s,
        )
        yield _histogram(
            f"{prefix}e2e_request_latency_seconds",
            "Seconds from a request's submission to the model worker to its end, for finished requests.",
            E2E_BUCKETS_S,
            s.request_latency_counts,
            s.request_latency_sum_s,
        )


class KvEventCounters(Collector):
    """The KV-cache event publisher's counters (registered by ``helios run`` when events are enabled).

    Read at scrape time from the publisher itself, or with ``--worker-process`` from the copy the worker
    process's latest load update carried (at most 20 ms old): the same counters with the same meaning."""

    def __init__(self, dropped: Callable[[], int], published: Callable[[], int]) -> None:
        self._dropped = dropped
        self._published = published

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield _counter(
            "helios_kv_events_dropped",
            "KV-cache events dropped because the publisher's queue was full.",
            self._dropped(),
        )
        yield _counter("helios_kv_events_published", "KV-cache events sent on the ZeroMQ socket.", self._published())


class HttpProcessCounters(Collector):
    """Requests each HTTP process admitted (registered by ``helios run`` with ``--http-processes`` N > 1): how
    the kernel spread the connections over the processes, read from the table they share."""

    def __init__(self, admitted: Callable[[], list[int]]) -> None:
        self._admitted = admitted

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield _labelled_counter(
            "helios_http_process_admitted",
            "Requests admitted by each HTTP process (index 0 is the helios run process).",
            "process",
            dict(enumerate(self._admitted())),
        )


class MetricsExporter:
    """The app's registry and its text exposition."""

    def __init__(
        self,
        statistics: Callable[[], StatsSnapshot],
        admitted: Callable[[], int],
        load: Callable[[], LoadReading] | None = None,
        *,
        vllm_metrics: bool = False,
        refused: Callable[[], int] | None = None,
    ) -> None:
        self.output_failures = OutputFailures()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            EngineCollector(
                statistics, admitted, self.output_failures, load=load, vllm_metrics=vllm_metrics, refused=refused
            )
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
