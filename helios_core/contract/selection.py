"""Load-time selection: which captured programs and capacities a runtime uses.

Owns the rules by which startup options reduce what a core captured:
concurrency and speculative width may only shrink; explicit options win over
core defaults, which fill settings the operator leaves unset; history
drafting needs learned speculation and concrete copied-token inputs in every
selected wider graph. Export records no history preference, so drafting is
only ever a startup option. The selection also carries the operator's
process-rank settings (:class:`ProcessRankSettings`: where rank processes join,
their shared secret and deadlines) to ``NativeModel.load``. A prefill chunk
(``--prefill-chunk N``) keeps only the prompt-computing programs (prefill, mixed,
resume and scored prefill) of at most N tokens, so that no round computes more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from helios_core.contract.prepared import PreparedContract, PreparedGraph
from helios_core.errors import HeliosError, StartupError
from helios_core.wire import contract_pb2 as ct

DEFAULT_QUEUE_CAPACITY = 64
DEFAULT_FRONTEND_WORKERS = 2
DEFAULT_EVENT_CAPACITY = 256


DEFAULT_RANK_JOIN_TIMEOUT_S = 60.0
"""``--rank-join-timeout``: how long the leader waits for every rank process to join."""


class JoinStopped(StartupError):
    """The server was asked to stop while its leader waited for rank processes to join (not a failure)."""


@dataclass(frozen=True)
class ProcessRankSettings:
    """Where a leader listens for its rank processes (``helios run --rank-listen``), the secret they share, and
    its deadlines (:mod:`helios_core.backends.rank_processes` runs them)."""

    host: str
    port: int
    secret: bytes
    join_timeout_s: float = DEFAULT_RANK_JOIN_TIMEOUT_S
    deadline_s: float = 120.0
    """A round's (and one collective's) deadline for every peer (the thread ranks' deadline)."""
    on_lost: Callable[[HeliosError], None] | None = None
    """Called once, on a thread of its own, when a peer disconnects or misses a deadline: serving must end."""
    stop_joining: threading.Event | None = None
    """Set when the server stops before every rank joined: the leader stops waiting at once
    (:class:`JoinStopped`)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:  # never print the secret
        return f"ProcessRankSettings(address={self.address!r}, join_timeout_s={self.join_timeout_s:g})"


@dataclass(frozen=True)
class LoadOptions:
    """Explicit startup options; None means "use the core default"."""

    max_active: int | None = None
    queue_capacity: int | None = None
    frontend_workers: int | None = None
    event_capacity: int | None = None
    speculative_width: int | None = None
    history_drafting: bool = False
    speculation_payoff: bool = False
    """Speculate only while measured speculative rounds emit more tokens per second than decode rounds
    (:mod:`helios_core.runtime.payoff`); off: every round that can speculate does."""
    cache_pages: int | None = None
    offload_pages: int = 0
    """Host-memory pages of the prefix cache's host tier (0: off); read by ``NativeModel.load``, not by selection."""
    offload_checkpoints: int = 0
    """Host-memory slots of the checkpoint host tier (0: off); read by ``NativeModel.load``, not by selection."""
    ranks: int | None = None
    """Tensor-parallel thread ranks (None: the core's rank count; any other count than the core's is a
    StartupError); read by ``NativeModel.load``, not by selection."""
    rank_peers: ProcessRankSettings | None = None
    """Run ranks 1..N-1 as rank processes that join this one over TCP (None: thread ranks); carried by the
    selection to ``NativeModel.load``."""
    prefill_chunk: int | None = None
    """The most tokens one prompt-computing round (prefill, mixed, resume, scored prefill) computes: only
    those programs of at most this many tokens are selected (None: every captured one)."""


@dataclass(frozen=True)
class Selection:
    """The programs and capacities a runtime serves with."""

    max_active: int
    queue_capacity: int
    frontend_workers: int
    event_capacity: int
    speculative_width: int
    history_drafting: bool
    graphs: Mapping[str, PreparedGraph]
    state_rows_per_request: int
    """Maximum state_rows_per_request among the selected graphs."""
    rank_peers: ProcessRankSettings | None = None
    """Where rank processes join (``LoadOptions.rank_peers``); None: ranks run as threads of this process."""
    speculation_payoff: bool = False
    """``LoadOptions.speculation_payoff``: speculate only while it measures faster than decode."""


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise StartupError(f"--{name.replace('_', '-')} must be positive, not {value}")
    return value


def _core_default(name: str, value: int) -> int:
    if value <= 0:
        raise StartupError(f"the core's default {name} is {value}; pass --{name.replace('_', '-')} explicitly")
    return value


_PROMPT_OPERATIONS: dict[int, str] = {
    ct.OPERATION_PREFILL: "prefill",
    ct.OPERATION_MIXED: "mixed",
    ct.OPERATION_RESUME: "resume",
    ct.OPERATION_SCORED_PREFILL: "scored prefill",
}
"""The operations whose rounds compute prompt (or known) tokens in chunks, as a prefill chunk names them."""


def _within_chunk(graphs: Mapping[str, PreparedGraph], chunk: int) -> dict[str, PreparedGraph]:
    """``graphs`` less the prompt-computing programs of more than ``chunk`` tokens; a StartupError when that
    leaves none of a kind the core has (an operation, with or without images)."""
    kinds: dict[tuple[int, bool], list[PreparedGraph]] = {}
    for graph in graphs.values():
        if graph.operation in _PROMPT_OPERATIONS:
            kinds.setdefault((graph.operation, graph.takes_images), []).append(graph)
    for (operation, images), of_kind in sorted(kinds.items()):
        smallest = min(graph.extents.token_capacity for graph in of_kind)
        if smallest > chunk:
            what = _PROMPT_OPERATIONS[operation] + (" program that takes images" if images else " program")
            raise StartupError(
                f"--prefill-chunk {chunk} leaves no {what}: the core's smallest computes {smallest} tokens"
            )
    return {
        name: graph
        for name, graph in graphs.items()
        if graph.operation not in _PROMPT_OPERATIONS or graph.extents.token_capacity <= chunk
    }


def select(contract: PreparedContract, options: LoadOptions) -> Selection:
    """Choose capacities and programs; raise StartupError on an impossible choice."""
    defaults = contract.serving.defaults
    captured = contract.serving.max_concurrency
    requested_active = _positive("max_active", options.max_active)
    if requested_active is None:
        requested_active = (
            _core_default("max_active", defaults.max_active) if defaults.HasField("max_active") else captured
        )
    if requested_active > captured:
        raise StartupError(
            f"max_active {requested_active} exceeds the core's captured concurrency {captured}; "
            "load-time selection can only reduce it"
        )
    queue_capacity = _positive("queue_capacity", options.queue_capacity)
    if queue_capacity is None:
        queue_capacity = (
            _core_default("queue_capacity", defaults.queue_capacity)
            if defaults.HasField("queue_capacity")
            else DEFAULT_QUEUE_CAPACITY
        )
    workers = _positive("frontend_workers", options.frontend_workers)
    if workers is None:
        workers = (
            _core_default("frontend_workers", defaults.frontend_workers)
            if defaults.HasField("frontend_workers")
            else DEFAULT_FRONTEND_WORKERS
        )
    event_capacity = _positive("event_capacity", options.event_capacity)
    if event_capacity is None:
        event_capacity = (
            _core_default("event_capacity", defaults.event_capacity)
            if defaults.HasField("event_capacity")
            else DEFAULT_EVENT_CAPACITY
        )

    declared_widths = sorted(contract.serving.speculative_widths)
    width = _positive("speculative_width", options.speculative_width)
    if width is None:
        width = declared_widths[-1] if declared_widths else 1
    elif width > 1 and (not declared_widths or width > declared_widths[-1]):
        widest = declared_widths[-1] if declared_widths else 1
        raise StartupError(
            f"speculative width {width} exceeds the widest captured width {widest}; "
            "load-time selection can only reduce it"
        )

    if width > 1 and declared_widths:  # the rounds use the widest captured width within the request
        width = max((declared for declared in declared_widths if declared <= width), default=1)

    selected: dict[str, PreparedGraph] = {}
    for name, graph in contract.graphs.items():
        if graph.operation == ct.OPERATION_SPECULATIVE and graph.extents.token_capacity > max(width, 1):
            continue
        selected[name] = graph
    chunk = _positive("prefill_chunk", options.prefill_chunk)
    if chunk is not None:
        selected = _within_chunk(selected, chunk)

    if options.history_drafting:
        if not contract.serving.learned_speculation:
            raise StartupError("history drafting needs a core with learned speculation enabled")
        if width <= 1:
            raise StartupError("history drafting needs a speculative width above one")
        for graph in selected.values():
            if graph.operation != ct.OPERATION_SPECULATIVE or graph.extents.token_capacity <= 1:
                continue
            sources = {b.source for b in graph.contract.bindings}
            if ct.VALUE_SOURCE_CANDIDATE_IDS not in sources:
                raise StartupError(
                    f"history drafting needs copied-token inputs (CANDIDATE_IDS) in selected graph {graph.name!r}"
                )

    wide = [g for g in selected.values() if g.operation == ct.OPERATION_SPECULATIVE and g.extents.token_capacity > 1]
    if options.speculation_payoff and not wide:
        raise StartupError(
            "the speculation payoff measure needs speculative programs wider than one: a core that speculates "
            "and a speculative width above one"
        )
    if options.speculation_payoff and not (any(g.drafts_in_graph for g in wide) or options.history_drafting):
        raise StartupError(
            "the speculation payoff measure needs rounds that speculate: this core's speculative programs verify "
            "copied proposals, which only --history-drafting makes"
        )
    state_rows = max((g.contract.state_rows_per_request for g in selected.values()), default=0)
    return Selection(
        max_active=requested_active,
        queue_capacity=queue_capacity,
        frontend_workers=workers,
        event_capacity=event_capacity,
        speculative_width=width,
        history_drafting=options.history_drafting,
        graphs=MappingProxyType(selected),
        state_rows_per_request=max(state_rows, 1),
        rank_peers=options.rank_peers,
        speculation_payoff=options.speculation_payoff,
    )
