"""The scheduler: admission, slots, cohorts, page reservations, preemption and request progress.

Data flow: the engine hands each prepared request to :meth:`Scheduler.add` (capacity checks; a
request outside the prepared capacities is an admission rejection). :meth:`Scheduler.next_round`
admits waiting requests while slots and pages allow (claiming reusable prefix pages first), then
chooses one round from the completed state of every request:

1. ``initialize`` for newly admitted requests (their sampling state rows);
2. otherwise chunked prefill within the largest prefill extent, FCFS, joined by every decode-ready
   request when a mixed program fits them (host-fed pending tokens). A request that asked for
   prompt logprobs prefills alone on the scored-prefill variants when it is first in line (its chunks
   carry score targets; it reuses no prefix pages, every prompt token must be computed to be scored);
3. otherwise one decode round of every decode-ready request (device-owned pending tokens),

each on the smallest captured variant that holds its lanes and tokens. A page shortage is resolved
by preempting the most recently admitted requests (their published pages stay reusable, so
readmission recomputes only what was evicted). :meth:`Scheduler.complete` applies a validated
round: it appends tokens, publishes complete pages, finishes requests and releases their slots and
pages, and returns the events to publish. A failed lane fails only its request and publishes nothing.

Faults of one request stay with it: a request whose prompt ids or sampling values do not fit the core
(its input vocabulary, the packed types of :class:`~helios_core.runtime.packing.SamplingLimits`) is
rejected at admission, and a host gate that raises while a round is planned (its mask), while a token
is applied or while the request's end is flushed fails that request alone (planning then plans the
round again without it; :meth:`Scheduler.take_faults`). :meth:`Scheduler.fail_lanes` fails the
requests of chosen lanes of a round that was not launched (values that did not pack).

Ownership: queues, slots and generations live here; pages live in the PageAllocator; per-request
progress lives on RequestState (written only by this module).

Per-slot state: beside each RequestState, the scheduler keeps numpy arrays indexed by request slot
(consumed endpoint, tokens generated, complete pages published, page table, page starts and page
count, slot generation, output limit, ignore_eos and sampling parameters), written wherever the
RequestState fields they mirror are written. Decode rounds are planned from them: the decode cohort
(the decode-ready requests a decode round takes, oldest first) is kept with its per-request columns
until the scheduler's epoch changes (any admission, retirement, phase change, cancellation or
preemption mark), so a steady decode round gathers only positions, cache slots, sampling steps and
page counts (a :class:`~helios_core.runtime.packing.LaneBatch`) and its expectations
(:class:`~helios_core.runtime.completion.ExpectationBatch`). The cohort's minima (tokens left,
positions left in its pages, positions before a page completes) decide without touching the lanes
whether a follow-up may be planned, a page is needed or published, or an output limit is reached;
its completion then touches each request once, for the token it appends, and returns the round's
tokens as one :class:`~helios_core.runtime.messages.RoundTokens` that every member's stream reads.
Every other round (and a decode round of a request whose sampling values the columns cannot hold
exactly) is planned as one :class:`~helios_core.runtime.packing.Lane` per request.

Its size: planning and completion of every round kind share the per-slot state and the request
queues; splitting planning from completion behind an immutable round plan is the next structural
change to this module.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedContract, PreparedGraph, Selection
from helios_core.runtime.completion import (
    CompletionError,
    ExpectationBatch,
    LaneExpectation,
    LaneResult,
    LaneResults,
)
from helios_core.runtime.gates import HostGate, format_param, gate_failure
from helios_core.runtime.messages import (
    AdmissionRejected,
    Event,
    ExecutionFailed,
    Finished,
    FinishReason,
    Outgoing,
    PreparedRequest,
    PromptScores,
    RoundTokens,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.packing import Column, Lane, LaneBatch, SamplingLimits, cells, set_cells
from helios_core.runtime.pages import PageAllocator, PrefixMatch
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct


@dataclass(eq=False, slots=True)
class RequestState:
    """One request's progress. Written by the scheduler only."""

    request: PreparedRequest
    tokens: list[int]
    """Prompt followed by every generated token, in position order."""
    prompt_len: int
    arrival: int
    request_id: str
    max_tokens: int
    ignore_eos: bool
    observe: bool
    """Stamp each generated token (the request observes timestamps)."""
    top: int
    """Top alternatives to read per sampled token (0 when not asked)."""
    slot: int = -1
    generation: int = 0
    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of this request's complete pages, in order."""
    consumed: int = 0
    pending_on_device: bool = False
    needs_init: bool = False
    reused_tokens: int = -1
    cancelled: bool = False
    gate: HostGate | None = None
    """Detokenizer, stops and grammar of this request (created at admission); None for a request without
    stops or structured output, whose stream detokenizes its tokens."""
    ended: bool = False
    """Finished or failed while a later round of it was in flight; released after that round's fence."""
    preempting: bool = False
    """A snapshot of this request is the next round; then it leaves the running set."""
    snapshot_row: int = -1
    """The snapshot row holding this preempted request's committed state, or -1."""
    snapshot_endpoint: int = 0
    """Consumed tokens at the snapshot (an exact token endpoint)."""
    scores: list[float] = field(default_factory=list)
    """Prompt scores collected so far (prompt logprobs), one per prefilled prompt token."""
    scores_sent: bool = False
    """The PromptScores event was published (later prefills, after preemption, need no scoring)."""
    columnar: bool = True
    """Its sampling values fit the per-slot columns exactly (else its decode rounds are planned lane by lane)."""

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefill_target(self) -> int:
        """Where prefill stops: the snapshot's complete pages while a restore is pending, else every token."""
        return self.snapshot_endpoint if self.snapshot_row >= 0 else len(self.tokens)

    @property
    def scoring(self) -> bool:
        """This request's prefill must run on scored-prefill programs."""
        return self.request.prompt_logprobs and not self.scores_sent

    @property
    def in_prefill(self) -> bool:
        return (
            not self.needs_init
            and not self.pending_on_device
            and not self.preempting
            and self.consumed < self.prefill_target
        )

    @property
    def restore_ready(self) -> bool:
        return self.snapshot_row >= 0 and self.slot >= 0 and self.consumed >= self.prefill_target

    @property
    def decode_ready(self) -> bool:
        return not self.needs_init and self.pending_on_device and not self.preempting


@dataclass(eq=False, slots=True)
class _Cohort:
    """The requests of a decode round, oldest first, with their per-request columns (read-only).

    Valid while the scheduler's epoch is ``epoch``: nothing that decides membership, a member's phase or
    whether it may be followed up has changed since.
    """

    epoch: int
    members: list[RequestState]
    slots: npt.NDArray[np.int64]
    graph: PreparedGraph | None
    columnar: bool
    """Every member's sampling values are in the per-slot columns (the round can be a LaneBatch)."""
    rows: dict[int, Column]
    """Per-lane columns constant while the cohort lasts, by value source."""
    constant_sources: frozenset[int]
    """The value sources whose values stay the same for every round of the cohort."""
    token_rows: npt.NDArray[np.int64]
    generations: npt.NDArray[np.int64]
    top: npt.NDArray[np.int64] | None
    constrained: bool
    """Some member has a grammar (its mask is read each round)."""
    all_constrained: bool
    blocked: bool
    """Some member cannot be followed up: host gates, cancellation, preemption, or it ended."""
    plain: bool
    """Every member's gate is absent or plain (the token's text is all it presents)."""
    texts: list[Callable[[int], str]]
    """Per member, the text a token completes (its gate's detokenizer; "" without a gate)."""
    gated: bool
    """Some member has a gate (else no token's text is found in the worker: their streams find it)."""
    lanes: dict[str, int]
    """Each member's lane index by request id (read-only; the streams' key to a round's tokens)."""
    observe: bool
    """Some member observes timestamps."""
    ids: frozenset[int]
    left: int
    """Tokens the member nearest its output limit may still generate (committed state)."""
    room: int
    """Positions the member nearest the end of its pages has left in them (as of ``pages_seen``)."""
    unpublished: int
    """Positions until the first member completes a page (committed state)."""
    pages_seen: int
    """The scheduler's page additions when ``room`` was counted."""
    counted: int
    """The scheduler's completions when ``left``, ``room`` and ``unpublished`` were counted."""


@dataclass(eq=False, slots=True)
class _Phases:
    """Which running requests are in which phase, as of ``epoch``."""

    epoch: int
    leaving: RequestState | None
    fresh: list[RequestState]
    returning: RequestState | None
    prefill: list[RequestState]
    decode: list[RequestState]


@dataclass(eq=False)
class Round:
    """One planned program launch: lanes as a list, or as a LaneBatch (decode rounds)."""

    graph: PreparedGraph
    members: list[RequestState]
    lanes: list[Lane] | LaneBatch
    expectations: list[LaneExpectation] | ExpectationBatch
    cohort: _Cohort | None = None
    """The decode cohort this round was planned from."""

    @property
    def constrained(self) -> bool:
        """Some lane of this round samples under a grammar (a constrained submission)."""
        cohort = self.cohort
        if cohort is not None and isinstance(self.lanes, LaneBatch):
            return cohort.constrained  # every lane of a decode round samples
        lanes = self.lanes.to_lanes() if isinstance(self.lanes, LaneBatch) else self.lanes
        return any(
            lane.sample and state.gate is not None and state.gate.constrained
            for state, lane in zip(self.members, lanes, strict=True)
        )


class _GateFault(Exception):
    """A request's host gate raised while a round was planned: that request fails, the round is replanned."""

    def __init__(self, state: RequestState, error: Exception) -> None:
        super().__init__(str(error))
        self.state = state
        self.error = error


_FLOAT_PARAMS = (
    ct.VALUE_SOURCE_TEMPERATURE,
    ct.VALUE_SOURCE_TOP_P,
    ct.VALUE_SOURCE_MIN_P,
    ct.VALUE_SOURCE_REPETITION_PENALTY,
    ct.VALUE_SOURCE_FREQUENCY_PENALTY,
    ct.VALUE_SOURCE_PRESENCE_PENALTY,
)
_CONSTANT_TOKEN_SOURCES = frozenset(
    {
        ct.VALUE_SOURCE_TOKEN_ROW,
        ct.VALUE_SOURCE_PROMPT_TOKENS,
        ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS,
        ct.VALUE_SOURCE_PROMPT_HISTOGRAM,
    }
)
"""Sources a decode cohort's rounds supply alike: lane rows of tokens, no host tokens, no vectors."""
_EXACT_FLOAT_INT = 2**53
_NOT_IN_FLIGHT: frozenset[int] = frozenset()
_NONE: frozenset[int] = frozenset()
_PER_LANE = 16
"""Decode rounds of at most this many lanes look EOS ids up lane by lane."""
_Array = TypeVar("_Array", bound="npt.NDArray[Any]")
_Ints = npt.NDArray[np.signedinteger[Any]]


class Scheduler:
    """Turns requests into rounds and completed rounds into events."""

    def __init__(
        self,
        contract: PreparedContract,
        selection: Selection,
        allocator: PageAllocator,
        stats: SchedulerStats,
        *,
        make_gate: Callable[[PreparedRequest], HostGate | None] | None = None,
        clock_origin_ns: int = 0,
    ) -> None:
        self.contract = contract
        self.make_gate = make_gate
        self.sampling_limits = SamplingLimits.of(contract)
        """What the core's sampling inputs hold: a request whose values do not fit is rejected at admission."""
        self.clock_origin_ns = clock_origin_ns
        self.allocator = allocator
        self.stats = stats
        self.page_tokens = contract.model.cache.page_tokens
        self.context = contract.serving.context_tokens
        self.eos = frozenset(contract.eos_token_ids)
        self.histogram_width = contract.histogram_width
        self.input_vocabulary = contract.model.input_vocabulary.size
        graphs = list(selection.graphs.values())
        self.initialize = _variants(graphs, ct.OPERATION_INITIALIZE)
        self.prefills = _variants(graphs, ct.OPERATION_PREFILL)
        self.mixed = _variants(graphs, ct.OPERATION_MIXED)
        self.decodes = _variants(graphs, ct.OPERATION_DECODE)
        self.scored = _variants(graphs, ct.OPERATION_SCORED_PREFILL)
        snapshots = _variants(graphs, ct.OPERATION_SNAPSHOT)
        restores = _variants(graphs, ct.OPERATION_RESTORE)
        self.snapshot = snapshots[0] if snapshots and restores else None
        self.restore = restores[0] if snapshots and restores else None
        self.free_snapshot_rows: list[int] = (
            list(range(contract.serving.snapshot_capacity - 1, -1, -1)) if self.snapshot is not None else []
        )
        self.max_active = selection.max_active
        self.queue_capacity = selection.queue_capacity
        """The most requests :attr:`waiting` takes from outside (:meth:`add`); see :attr:`has_room`."""
        self.pages_per_row = min((v.pages_per_row for v in contract.model.cache.page_table_views), default=0)
        self.waiting: deque[RequestState] = deque()
        self.pipelining = True
        """Launch a follow-up decode round before the previous round's completion is read (two frames)."""
        self.in_flight: AbstractSet[int] = _NOT_IN_FLIGHT
        """ids of requests with a follow-up round already launched."""
        self._fenced: list[RequestState] = []
        self.starved = False
        """A running request lacked a page in the last round: admit nobody until every running request is served."""
        self.running: list[RequestState] = []
        self.free_slots: list[int] = list(range(self.max_active - 1, -1, -1))
        self._generations = itertools.count(1)
        self._arrivals = itertools.count()
        self._cancels = False
        """A cancellation mark may be set on a queued or running request."""
        # Per-slot state (see the module docstring), indexed by request slot.
        slots = max(self.max_active, 0)
        positions = np.int32 if self.context + 2 < 2**31 else np.int64  # int32 columns stage as they are
        self._consumed: _Ints = np.zeros(slots, dtype=positions)
        self._generated: _Ints = np.zeros(slots, dtype=positions)
        self._published = np.zeros(slots, dtype=np.int64)
        """Complete pages per slot that are published, or will be at the next :meth:`_publish_deferred`."""
        self._deferred: dict[int, RequestState] = {}
        """Running requests (by id) whose complete pages a decode round counted but did not hash yet."""
        width = max(self.pages_per_row, self._pages_for(self.context), 1)
        self._page_rows = np.zeros((slots, width), dtype=np.int64)
        self._page_count = np.zeros(slots, dtype=np.int64)
        self._page_starts = np.zeros((slots, width), dtype=np.int64)
        """Each page's first cache slot (page id x page_tokens)."""
        self._page_adds = 0
        """Pages added to running requests so far (a page table that saw this many is complete)."""
        self._completions = 0
        """Rounds completed so far (a cohort's minima counted at this many are current)."""
        self._slot_generation = np.zeros(slots, dtype=np.int64)
        self._max_tokens = np.zeros(slots, dtype=np.int64)
        self._ignore_eos = np.zeros(slots, dtype=bool)
        self._eos_ids = sorted(self.eos)
        self._float_params = {source: np.zeros(slots, dtype=np.float64) for source in _FLOAT_PARAMS}
        self._top_k = np.zeros(slots, dtype=np.int64)
        self._seed = np.zeros(slots, dtype=np.uint64)
        self._operation_names: dict[int, str] = {}
        self._epoch = 0
        """Changes whenever membership, a running request's phase or a follow-up condition may have changed."""
        self._phases: _Phases | None = None
        self._cohort: _Cohort | None = None
        self._faults: list[Event] = []
        """Failures of single requests found while planning (a host gate that raised), to publish."""

    # -- requests --------------------------------------------------------------------------------
    @property
    def has_room(self) -> bool:
        """The pending admission deque takes another request: it holds fewer than ``queue_capacity``.
        (Preempted requests return to its front whatever it holds: they were admitted already.)"""
        return len(self.waiting) < self.queue_capacity

    def add(self, request: PreparedRequest) -> AdmissionRejected | None:
        """Queue a request, or reject it when it lies outside the prepared capacities (permanently) or the
        pending admission deque is full (transiently: the engine hands requests over only while
        :attr:`has_room`, so this answers a caller that does not)."""
        if not self.has_room:
            self.stats.rejected += 1
            return AdmissionRejected(
                request.request_id,
                f"the pending admission queue holds its limit of {self.queue_capacity} requests; retry later",
            )
        problem = self._capacity_problem(request)
        if problem is None:
            unpackable = self.sampling_limits.problem(request.sampling)
            if unpackable is not None:  # preparation refuses these; a request from elsewhere may still hold one
                problem = unpackable[1], unpackable[0]
        if problem is not None:
            self.stats.rejected += 1
            message, param = problem
            return AdmissionRejected(request.request_id, message, param=param, permanent=True)
        state = RequestState(
            request,
            list(request.prompt_ids),
            len(request.prompt_ids),
            next(self._arrivals),
            request.request_id,
            request.max_tokens,
            request.ignore_eos,
            request.observe_timestamps,
            max(request.top_logprobs, 0),
        )
        if self.make_gate is not None:
            try:
                state.gate = self.make_gate(request)
            except Exception as exc:  # a format preparation accepted but the worker cannot compile
                self.stats.rejected += 1
                return AdmissionRejected(
                    request.request_id,
                    f"cannot prepare the request's output constraints: {type(exc).__name__}: {exc}",
                    param=format_param(request),
                    permanent=True,
                )
        self.waiting.append(state)
        self.stats.received += 1
        return None

    def _capacity_problem(self, request: PreparedRequest) -> tuple[str, str | None] | None:
        """Why ``request`` can never fit the prepared capacities, and the field to change; None if it fits."""
        prompt = len(request.prompt_ids)
        if prompt == 0:
            return "the prompt is empty", "messages"
        vocabulary = self.input_vocabulary
        if not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocabulary:
            outside = next(i for i in request.prompt_ids if not 0 <= i < vocabulary)
            return f"prompt token id {outside} lies outside the input vocabulary [0, {vocabulary})", "messages"
        if request.max_tokens <= 0:
            return "max_tokens must be positive", "max_tokens"
        if request.prompt_logprobs and not self.scored:
            return "prompt logprobs are not supported by this core (no scored prefill programs)", "prompt_logprobs"
        # a prompt that alone fills the context cannot be fixed by a smaller output limit
        field = "messages" if prompt >= self.context else "max_tokens"
        total = prompt + request.max_tokens
        if total > self.context:
            return (
                f"prompt ({prompt} tokens) plus max_tokens ({request.max_tokens}) exceeds the core's context of "
                f"{self.context} tokens; at most {max(self.context - prompt, 0)} output tokens fit this prompt",
                field,
            )
        limit = min(self.pages_per_row, self.allocator.total_pages)
        if self._pages_for(total) > limit:
            return f"the request needs {self._pages_for(total)} cache pages; at most {limit} fit", field
        return None

    def cancel(self, request_id: str) -> None:
        for state in itertools.chain(self.waiting, self.running):
            if state.request_id == request_id:
                state.cancelled = True
                self._cancels = True
                self._epoch += 1

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- planning ----------------------------------------------------------------------------------
    def take_cancelled(self) -> list[Event]:
        """Finish every cancelled request (nothing is in flight between rounds)."""
        if not self._cancels:
            return []
        self._cancels = False
        events: list[Event] = []
        for state in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(state)
            events.append(self._finished(state, "cancelled"))
        for state in [s for s in self.running if s.cancelled]:
            self._retire(state)
            events.append(self._finished(state, "cancelled"))
        return events

    def next_round(self) -> Round | None:
        """Admit what fits, then plan the next round (None when there is nothing to run).

        A request whose host gate raises while the round is planned (its grammar mask) fails alone, and
        the round is planned again without it; its failure waits in :meth:`take_faults`.
        """
        while True:
            try:
                return self._plan()
            except _GateFault as fault:
                self._faults.append(self._fail(fault.state, gate_failure(fault.error)))

    def take_faults(self) -> list[Event]:
        """The failures of single requests found while planning, to publish (each once)."""
        if not self._faults:
            return []
        faults, self._faults = self._faults, []
        return faults

    def _mask(self, state: RequestState, gate: HostGate) -> npt.NDArray[np.int32] | None:
        """``gate``'s mask for ``state``'s next token; a gate that raises is reported as a :class:`_GateFault`."""
        try:
            return gate.mask()
        except Exception as exc:
            raise _GateFault(state, exc) from exc

    def _plan(self) -> Round | None:
        leaving = self._phases_now().leaving
        if leaving is not None and self.snapshot is not None:
            return self._state_copy_round(self.snapshot, leaving, snapshot_row=leaving.snapshot_row)
        self._admit()
        phases = self._phases_now()
        if phases.fresh:
            return self._initialize_round(phases.fresh)
        returning = phases.returning
        if returning is not None and self.restore is not None:
            return self._state_copy_round(self.restore, returning, restore_row=returning.snapshot_row)
        prefill = phases.prefill
        decode = phases.decode
        if prefill and prefill[0].scoring:
            return self._scored_round(prefill[0])
        prefill = [s for s in prefill if not s.scoring]
        if prefill:
            return self._prefill_round(prefill, decode)
        if decode:
            return self._decode_round(decode)
        return None

    def _phases_now(self) -> _Phases:
        """The running requests by phase (recomputed only when the epoch has changed)."""
        phases = self._phases
        if phases is None or phases.epoch != self._epoch:
            running = self.running
            phases = self._phases = _Phases(
                self._epoch,
                next((s for s in running if s.preempting), None),
                [s for s in running if s.needs_init],
                next((s for s in running if s.restore_ready), None),
                [s for s in running if s.in_prefill],
                [s for s in running if s.decode_ready],
            )
        return phases

    def _admit(self) -> None:
        if self._deferred and self.waiting and self.free_slots and not self.starved:
            self._publish_deferred()  # every complete page can be matched as a prefix
        while self.waiting and self.free_slots and not self.starved:
            state = self.waiting[0]
            if state.snapshot_row >= 0:  # reuse complete pages up to the snapshot, restore the rest
                full = state.snapshot_endpoint - state.snapshot_endpoint % self.page_tokens
                match = self.allocator.match_prefix(state.tokens, full)
                needed = self._pages_for(state.snapshot_endpoint) - len(match.pages)
            elif state.scoring:  # every prompt token must be computed to be scored: no prefix reuse
                match = PrefixMatch((), (), 0)
                needed = self._pages_for(len(state.tokens))
            else:
                match = self.allocator.match_prefix(state.tokens, len(state.tokens) - 1)
                needed = self._pages_for(len(state.tokens)) - len(match.pages)
            self.allocator.claim(match)
            fresh = self.allocator.allocate(needed)
            if fresh is None:
                self.allocator.release(match.pages)
                if not self.running:
                    # Nothing will free pages: this request cannot run until pages are evicted or freed,
                    # and capacity checks guarantee it fits an empty cache.
                    raise RuntimeError("an empty cache cannot hold an admitted request")
                return
            self.waiting.popleft()
            state.pages = [*match.pages, *fresh]
            state.hashes = list(match.hashes)
            state.consumed = match.tokens
            state.slot = self.free_slots.pop()
            state.generation = next(self._generations)
            # A snapshotted request gets its state rows back from RESTORE, not from initialization.
            state.needs_init = state.snapshot_row < 0
            state.pending_on_device = False
            if state.reused_tokens < 0:
                state.reused_tokens = match.tokens
            self.running.append(state)
            self._hold_slot(state)
            self.stats.admitted += 1
            self._epoch += 1

    def _hold_slot(self, state: RequestState) -> None:
        """Write a newly admitted request's per-slot state."""
        slot = state.slot
        self._consumed[slot] = state.consumed
        self._generated[slot] = state.generated
        self._published[slot] = len(state.hashes)
        self._page_rows[slot, : len(state.pages)] = state.pages
        self._page_starts[slot, : len(state.pages)] = self._page_rows[slot, : len(state.pages)] * self.page_tokens
        self._page_count[slot] = len(state.pages)
        self._page_adds += 1
        self._slot_generation[slot] = state.generation
        self._max_tokens[slot] = state.max_tokens
        self._ignore_eos[slot] = state.ignore_eos
        state.columnar = self._hold_sampling(slot, state.request.sampling)

    def _hold_sampling(self, slot: int, params: SamplingParams) -> bool:
        """Store a request's sampling values in the slot's columns; False when a column cannot hold one
        exactly as the Python value packs (then its decode rounds are planned lane by lane)."""
        values = (
            params.temperature,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        for value in values:
            if type(value) is not float and not (type(value) in (int, bool) and abs(value) <= _EXACT_FLOAT_INT):
                return False
        if type(params.top_k) is not int or not -(2**63) <= params.top_k < 2**63:
            return False
        if type(params.seed) is not int or not 0 <= params.seed < 2**64:
            return False
        for source, value in zip(_FLOAT_PARAMS, values, strict=True):
            self._float_params[source][slot] = value
        self._top_k[slot] = params.top_k
        self._seed[slot] = params.seed
        return True

    def _add_pages(self, state: RequestState, pages: Sequence[int]) -> None:
        count = len(state.pages)
        state.pages.extend(pages)
        slot, end = state.slot, count + len(pages)
        self._page_rows[slot, count:end] = pages
        self._page_starts[slot, count:end] = [page * self.page_tokens for page in pages]
        self._page_count[slot] = end
        self._page_adds += 1

    def _count(self, cohort: _Cohort) -> _Cohort:
        """``cohort`` with its minima current: counted again from the per-slot arrays when a round other
        than the cohort's own completed since they were (or, for ``room``, when pages were added)."""
        slots, page_tokens = cohort.slots, self.page_tokens
        if cohort.counted != self._completions:
            cohort.left = _least(self._max_tokens[slots] - self._generated[slots])
            cohort.unpublished = _least((self._published[slots] + 1) * page_tokens - self._consumed[slots])
            cohort.pages_seen = -1
            cohort.counted = self._completions
        if cohort.pages_seen != self._page_adds:
            cohort.room = _least(self._page_count[slots] * page_tokens - self._consumed[slots])
            cohort.pages_seen = self._page_adds
        return cohort

    def _initialize_round(self, fresh: list[RequestState]) -> Round:
        graph = _smallest(self.initialize, rows=1)
        members = fresh[: graph.extents.batch_capacity]
        lanes = [self._lane(s, positions=[], tokens=[], sample=False, histogram=True) for s in members]
        return Round(graph, members, lanes, [LaneExpectation(s.generation, s.consumed, False) for s in members])

    def _prefill_round(self, prefill: list[RequestState], decode: list[RequestState]) -> Round:
        mixed = bool(decode) and bool(self.mixed)
        variants = self.mixed if mixed else self.prefills
        budget = max(g.extents.packed_token_capacity for g in variants)
        rows = max(g.extents.batch_capacity for g in variants)
        members: list[RequestState] = []
        lanes: list[Lane] = []
        expectations: list[LaneExpectation] = []
        if mixed:
            for state in decode[: max(rows - 1, 0)]:
                if budget - len(lanes) <= 1:
                    break
                if not self._ensure_page(state, exclude=members):
                    self.starved = True
                    break
                # A decode lane of a mixed round feeds its completed pending token from the host.
                lanes.append(self._lane(state, [state.consumed], [state.tokens[-1]], sample=True))
                members.append(state)
                expectations.append(self._expect(state, state.consumed + 1, True))
        used = len(lanes)
        for state in prefill:
            if state not in self.running:
                continue  # preempted to make room for a decode lane above
            if len(members) >= rows or used >= budget:
                break
            chunk = min(state.prefill_target - state.consumed, budget - used)
            last = state.snapshot_row < 0 and state.consumed + chunk == len(state.tokens)
            positions = list(range(state.consumed, state.consumed + chunk))
            lane = self._lane(state, positions, state.tokens[state.consumed : state.consumed + chunk], last)
            lane.mixed_prefill = mixed  # MIXED_PREFILL_ROW: 1 on the prefill rows of a mixed round
            lanes.append(lane)
            members.append(state)
            expectations.append(self._expect(state, state.consumed + chunk, last))
            used += chunk
        graph = _smallest(variants, rows=len(lanes), tokens=used)
        return Round(graph, members, lanes, expectations)

    def _scored_round(self, state: RequestState) -> Round:
        """One prefill chunk of a prompt-logprobs request, alone, on the smallest scored variant that fits.

        Each packed token's score target is the next prompt token; the last prompt token has none (-1).
        """
        budget = max(g.extents.packed_token_capacity for g in self.scored)
        chunk = min(len(state.tokens) - state.consumed, budget)
        last = state.consumed + chunk == len(state.tokens)
        positions = list(range(state.consumed, state.consumed + chunk))
        lane = self._lane(state, positions, state.tokens[state.consumed : state.consumed + chunk], last)
        prompt = state.prompt_len
        lane.score_targets = [state.tokens[p + 1] if p + 1 < prompt else -1 for p in positions]
        expectation = self._expect(state, state.consumed + chunk, last, scores=(0, chunk))
        return Round(_smallest(self.scored, rows=1, tokens=chunk), [state], [lane], [expectation])

    def _expect(
        self, state: RequestState, consumed: int, samples: bool, *, scores: tuple[int, int] = (0, 0)
    ) -> LaneExpectation:
        top = state.top if samples else 0
        return LaneExpectation(state.generation, consumed, samples, top, scores)

    def _decode_round(self, decode: list[RequestState]) -> Round:
        cohort = self._cohort
        if cohort is None or cohort.epoch != self._epoch:
            rows = max(g.extents.batch_capacity for g in self.decodes)
            cohort = self._cohort = self._make_cohort(sorted(decode, key=lambda s: s.arrival)[:rows])
        if self._count(cohort).room <= 0:
            # A member needs the page of its next position: take pages (or preempt) request by request.
            members: list[RequestState] = []
            page_tokens = self.page_tokens
            served = True
            for state in cohort.members:
                if state.slot < 0 or state.preempting:
                    continue  # preempted while an earlier member took a page
                if state.consumed // page_tokens < len(state.pages) or self._ensure_page(state, exclude=members):
                    members.append(state)
                else:
                    served = False
            self.starved = not served
            if len(members) != len(cohort.members) or cohort.epoch != self._epoch:
                cohort = self._make_cohort(members)
        else:
            self.starved = False
        return self._decode_plan(cohort, ahead=0)

    def _make_cohort(self, members: list[RequestState]) -> _Cohort:
        """The per-request columns of a decode round's members (``members`` in lane order)."""
        count = len(members)
        slots = _frozen(np.fromiter((s.slot for s in members), dtype=np.int64, count=count))
        gates = [s.gate for s in members]
        constrained = [g is not None and g.constrained for g in gates]
        columnar = all(s.columnar for s in members)
        generations = _frozen(self._slot_generation[slots])
        ones = _frozen(np.ones(count, dtype=np.int64))
        zeros = _frozen(np.zeros(count, dtype=np.int64))
        unset = _frozen(np.full(count, -1, dtype=np.int64))
        rows: dict[int, Column] = {
            ct.VALUE_SOURCE_SLOT: slots,
            ct.VALUE_SOURCE_LIVE_STATE_ROWS: slots,
            ct.VALUE_SOURCE_GENERATION: generations,
            ct.VALUE_SOURCE_QUERY_LENGTH: ones,
            ct.VALUE_SOURCE_SAMPLING_DECISION: ones,
            ct.VALUE_SOURCE_MIXED_PREFILL_ROW: zeros,
            ct.VALUE_SOURCE_RESTORE_SOURCE: unset,
            ct.VALUE_SOURCE_SNAPSHOT_DESTINATION: unset,
            ct.VALUE_SOURCE_TOP_K: _frozen(self._top_k[slots]),
            ct.VALUE_SOURCE_SEED_BITS: _frozen(self._seed[slots]),
            ct.VALUE_SOURCE_CONSTRAINED: zeros,
        }
        for source, column in self._float_params.items():
            rows[source] = _frozen(column[slots])
        tops = [s.top for s in members]
        constant_sources = frozenset(rows) | _CONSTANT_TOKEN_SOURCES
        if any(constrained):  # masks (and whether a lane has one) are read each round
            constant_sources -= {ct.VALUE_SOURCE_CONSTRAINED}
        else:
            constant_sources |= {ct.VALUE_SOURCE_GRAMMAR_MASK}
        return _Cohort(
            epoch=self._epoch,
            members=members,
            slots=slots,
            graph=_smallest(self.decodes, rows=count) if members else None,
            columnar=columnar,
            rows=rows,
            constant_sources=constant_sources,
            token_rows=_frozen(np.arange(count, dtype=np.int64)),
            generations=generations,
            top=_frozen(np.asarray(tops, dtype=np.int64)) if any(tops) else None,
            constrained=any(constrained),
            all_constrained=all(constrained),
            blocked=any(
                s.cancelled or s.preempting or s.ended or (s.gate is not None and s.gate.holds_rounds)
                for s in members
            ),
            plain=all(g is None or g.plain for g in gates),
            texts=[_no_text if g is None else g.text for g in gates],
            gated=any(g is not None for g in gates),
            lanes={s.request_id: index for index, s in enumerate(members)},
            observe=any(s.observe for s in members),
            ids=frozenset(id(s) for s in members),
            left=0,
            room=0,
            unpublished=0,
            pages_seen=-1,
            counted=-1,
        )

    def _decode_plan(self, cohort: _Cohort, *, ahead: int) -> Round:
        """A decode round of ``cohort``, one position (and sampling step) past the consumed endpoint when
        ``ahead`` is 1 (a follow-up planned before the previous round's completion is read)."""
        members = cohort.members
        if cohort.graph is None:
            return Round(_smallest(self.decodes, rows=0), [], [], [], cohort)
        if not cohort.columnar:
            lanes = [self._lane(s, [s.consumed + ahead], [], sample=True, ahead=ahead) for s in members]
            expectations = [self._expect(s, s.consumed + ahead + 1, True) for s in members]
            return Round(cohort.graph, members, lanes, expectations, cohort)
        slots = cohort.slots
        page_tokens = self.page_tokens
        # ``array + n`` rather than ``array += n``: numpy's in-place operation with a Python int is slower.
        positions = self._consumed[slots] + ahead
        steps = self._generated[slots] + ahead
        page, offset = np.divmod(positions, page_tokens)
        cache_slots = cells(self._page_starts, slots, page) + offset
        rows = dict(cohort.rows)
        rows[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT] = positions
        rows[ct.VALUE_SOURCE_SAMPLING_STEP] = steps
        masks = None
        if cohort.constrained:
            masks = [self._mask(s, s.gate) if s.gate is not None else None for s in members]
            rows[ct.VALUE_SOURCE_CONSTRAINED] = np.fromiter(
                (mask is not None for mask in masks), dtype=np.int64, count=len(masks)
            )
        batch = LaneBatch(
            count=len(members),
            rows=rows,
            tokens={
                ct.VALUE_SOURCE_PROMPT_POSITIONS: positions,
                ct.VALUE_SOURCE_CACHE_SLOT: cache_slots,
                ct.VALUE_SOURCE_TOKEN_ROW: cohort.token_rows,
            },
            page_source=self._page_rows,
            page_index=slots,
            page_counts=self._page_count[slots],
            grammar_masks=masks,
            constants=cohort,
            constant_sources=cohort.constant_sources,
            page_version=self._page_adds,
        )
        expected = ExpectationBatch(cohort.generations, positions + 1, True, cohort.top)
        return Round(cohort.graph, members, batch, expected, cohort)

    def followup(self, round_: Round) -> Round | None:
        """The next decode round of the same requests, planned before ``round_``'s completion is read.

        Only when nothing needs completion feedback: a decode round whose requests have device-owned
        pending tokens, no host gates (grammar, stops), no cancellation or preemption in progress, at
        least two tokens left, no admission waiting to change phase, and pages for the next position.
        """
        if not self.pipelining or round_.graph.operation != ct.OPERATION_DECODE:
            return None
        if self.waiting and self.free_slots:
            return None
        members = round_.members
        cohort = round_.cohort
        if cohort is not None and cohort.epoch == self._epoch and cohort.members is members:
            if cohort.blocked:
                return None
            if self._count(cohort).left < 2:  # a member has fewer than two tokens left
                return None
            if self._count(cohort).room <= 1:  # a member needs the page of the position after the next
                slots = cohort.slots
                needy = np.flatnonzero(self._page_count[slots] * self.page_tokens - self._consumed[slots] <= 1)
                if needy.shape[0] and not self._allocate_next(members, needy.tolist(), slots[needy]):
                    return None
            self.in_flight = cohort.ids
        else:
            for state in members:
                if state.cancelled or state.preempting or state.ended:
                    return None
                if state.gate is not None and state.gate.holds_rounds:
                    return None
                if state.generated + 2 > state.max_tokens:
                    return None
            for state in members:
                if (state.consumed + 1) // self.page_tokens >= len(state.pages):
                    page = self.allocator.allocate(1)
                    if page is None:
                        return None
                    self._add_pages(state, page)
            cohort = self._make_cohort(list(members))
            self.in_flight = cohort.ids
        try:
            follow = self._decode_plan(cohort, ahead=1)
        except _GateFault:  # no follow-up: the next plan, with nothing in flight, fails that request alone
            return None
        self.stats.pipelined_rounds += 1
        follow.graph = round_.graph
        return follow

    def _allocate_next(self, members: list[RequestState], needy: list[int], slots: npt.NDArray[np.int64]) -> bool:
        """The page of the position after the next for each needy member (``slots`` are theirs), in member
        order; False (the pages already given kept) as soon as one cannot be had."""
        if self.allocator.available() >= len(needy):
            pages = self.allocator.allocate(len(needy))
            if pages is not None:
                for index, page in zip(needy, pages, strict=True):
                    members[index].pages.append(page)
                ends = self._page_count[slots]
                page_ids = np.asarray(pages, dtype=np.int64)
                set_cells(self._page_rows, slots, ends, page_ids)
                set_cells(self._page_starts, slots, ends, page_ids * self.page_tokens)
                self._page_count[slots] = ends + 1
                self._page_adds += 1
                return True
        for index in needy:
            page_list = self.allocator.allocate(1)
            if page_list is None:
                return False
            self._add_pages(members[index], page_list)
        return True

    def release_fenced(self) -> None:
        """The follow-up round's fence has passed: release what ended while it was in flight."""
        self.in_flight = _NOT_IN_FLIGHT
        for state in self._fenced:
            self._retire(state)
        self._fenced = []

    def _end(self, state: RequestState) -> None:
        """Release a finished or failed request now, or after the fence of its in-flight follow-up round."""
        self._epoch += 1
        if id(state) in self.in_flight:
            state.ended = True
            self._fenced.append(state)
        else:
            self._retire(state)

    def _ensure_page(self, state: RequestState, exclude: Sequence[RequestState]) -> bool:
        """Make sure the page for ``state``'s next position exists, preempting younger requests if needed."""
        while state.consumed // self.page_tokens >= len(state.pages):
            page = self.allocator.allocate(1)
            if page is not None:
                self._add_pages(state, page)
                continue
            victims = [s for s in self.running if s is not state and s not in exclude and s.arrival > state.arrival]
            if not victims:
                victims = [s for s in self.running if s is not state and s not in exclude]
            victims = [s for s in victims if not s.preempting]
            if not victims:
                return False
            victim = max(victims, key=lambda s: s.arrival)
            if victim.pending_on_device and self.free_snapshot_rows:
                # Keep the victim's exact committed state: snapshot it in the next round, then release it.
                victim.preempting = True
                victim.snapshot_row = self.free_snapshot_rows.pop()
                victim.snapshot_endpoint = victim.consumed
                self._epoch += 1
                return False
            self._preempt(victim)
            if state not in self.running:
                return False
        return True

    def _leave_after_snapshot(self, state: RequestState) -> None:
        """The snapshot committed: release slot and pages; the request waits at the front of the queue."""
        self._retire(state, keep_snapshot=True)
        state.preempting = False
        state.consumed = 0
        state.hashes = []
        state.pending_on_device = False
        self.waiting.appendleft(state)
        self.stats.preemptions += 1
        self.stats.snapshots += 1

    def _preempt(self, state: RequestState) -> None:
        """Return a running request to the front of the queue; its published pages stay reusable."""
        self._retire(state)
        state.consumed = 0
        state.hashes = []
        state.pending_on_device = False
        if not state.scores_sent:
            state.scores = []  # scoring restarts with the prompt's recomputation
        self.waiting.appendleft(state)
        self.stats.preemptions += 1

    def _state_copy_round(
        self, graph: PreparedGraph, state: RequestState, *, snapshot_row: int = -1, restore_row: int = -1
    ) -> Round:
        """A SNAPSHOT or RESTORE round of one request at its exact endpoint."""
        lane = self._lane(state, [], [], sample=False)
        lane.consumed = state.snapshot_endpoint
        lane.snapshot_row = snapshot_row
        lane.restore_row = restore_row
        return Round(graph, [state], [lane], [LaneExpectation(state.generation, state.snapshot_endpoint, False)])

    def _lane(
        self,
        state: RequestState,
        positions: list[int],
        tokens: list[int],
        sample: bool,
        *,
        histogram: bool = False,
        ahead: int = 0,
    ) -> Lane:
        params = state.request.sampling
        pt = self.page_tokens
        return Lane(
            slot=state.slot,
            generation=state.generation,
            state_row=state.slot,
            positions=positions,
            cache_slots=[state.pages[p // pt] * pt + p % pt for p in positions],
            page_table=state.pages,
            tokens=tokens,
            sample=sample,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            seed=params.seed,
            sampling_step=state.generated + ahead,
            grammar_mask=self._mask(state, state.gate) if sample and state.gate is not None else None,
            prompt_histogram=self._histogram(state.tokens[: state.prompt_len]) if histogram else None,
            consumed=state.consumed + ahead,
        )

    def _histogram(self, prompt: list[int]) -> npt.NDArray[np.uint8]:
        counts = np.bincount(np.asarray(prompt, dtype=np.int64), minlength=self.histogram_width)
        return np.minimum(counts, 255).astype(np.uint8)

    # -- completion -------------------------------------------------------------------------------
    def complete(self, round_: Round, results: Sequence[LaneResult | CompletionError]) -> list[Outgoing]:
        """Apply a validated round; returns the events to publish, in order (a steady decode round's
        tokens as one :class:`~helios_core.runtime.messages.RoundTokens`)."""
        events: list[Outgoing] = []
        graph = round_.graph
        label = self._operation_names.get(graph.operation)
        if label is None:
            label = self._operation_names[graph.operation] = graph.operation_name
        self.stats.count_round(graph.name, label, len(round_.members))
        cohort = round_.cohort
        if (
            cohort is not None
            and isinstance(round_.lanes, LaneBatch)
            and isinstance(results, LaneResults)
            and cohort.members is round_.members
        ):
            self._complete_decode(cohort, results, events)
            return events
        self._epoch += 1
        self._completions += 1
        lanes = round_.lanes.to_lanes() if isinstance(round_.lanes, LaneBatch) else round_.lanes
        constrained = [
            s.gate is not None and s.gate.constrained
            for s, lane in zip(round_.members, lanes, strict=True)
            if lane.sample
        ]
        if any(constrained) and round_.graph.operation == ct.OPERATION_DECODE and not all(constrained):
            self.stats.mixed_grammar_decode_steps += 1
        for state, lane, result in zip(round_.members, lanes, results, strict=True):
            if state.ended:
                continue  # ended in the previous round: this lane's output is suppressed
            if isinstance(result, CompletionError):
                events.append(self._fail(state, str(result)))
                continue
            operation = round_.graph.operation
            if operation == ct.OPERATION_INITIALIZE:
                state.needs_init = False
                continue
            if operation == ct.OPERATION_SNAPSHOT:
                self._leave_after_snapshot(state)
                continue
            if operation == ct.OPERATION_RESTORE:
                self.free_snapshot_rows.append(state.snapshot_row)
                state.snapshot_row = -1
                state.consumed = state.snapshot_endpoint
                self._consumed[state.slot] = state.consumed
                state.pending_on_device = True
                self.stats.restores += 1
                continue
            state.consumed += lane.query_length
            self._consumed[state.slot] = state.consumed
            self._publish_pages(state)
            if operation == ct.OPERATION_SCORED_PREFILL and not state.scores_sent:
                state.scores.extend(result.scores)
                if state.consumed >= state.prompt_len:
                    state.scores_sent = True
                    events.append(PromptScores(state.request_id, state.scores[: state.prompt_len - 1]))
            if not lane.sample:
                continue
            token = result.token_id
            stamp = time.monotonic_ns() - self.clock_origin_ns if state.observe else -1
            state.tokens.append(token)
            self._generated[state.slot] = state.generated
            state.pending_on_device = True
            outcome = None
            if state.gate is not None:
                try:
                    outcome = state.gate.observe(token)
                except Exception as exc:  # the request's own grammar or stops: it fails alone
                    events.append(self._fail(state, gate_failure(exc)))
                    continue
            pieces = outcome.pieces if outcome is not None else [(token, "")]
            events.append(TokenEvent(state.request_id, token, result.logprob, pieces, stamp, result.top))
            if outcome is not None and outcome.stopped:
                self._end(state)
                events.append(self._finished(state, "stop", flush=False))
                continue
            reason = self._finish_reason(state, token)
            if reason is not None:
                self._end(state)
                events.append(self._finished(state, reason))
        return events

    def _complete_decode(self, cohort: _Cohort, results: LaneResults, events: list[Outgoing]) -> None:
        """:meth:`complete` of a decode round planned as a LaneBatch: the same effects, lane by lane.

        Every member advances by one position and one token, so the cohort's minima say whether any lane
        completes a page or reaches its output limit this round; only then are those lanes found (over all
        lanes at once). EOS ids are looked up per lane in small rounds, over all lanes in large ones.
        """
        if cohort.constrained and not cohort.all_constrained:
            self.stats.mixed_grammar_decode_steps += 1
        self._count(cohort)
        slots = cohort.slots
        count = len(cohort.members)
        consumed = self._consumed[slots] + 1
        generated = self._generated[slots] + 1
        page_tokens = self.page_tokens
        token_ids, logprobs, errors, tops = results.token_ids, results.logprobs, results.errors, results.tops
        publishing: AbstractSet[int] = _NONE
        if cohort.unpublished <= 1:
            publishing = _where((self._published[slots] + 1) * page_tokens <= consumed)
        eos = self.eos
        ending = generated >= self._max_tokens[slots] if cohort.left <= 1 else None
        ids = results.ids
        eos_per_lane = bool(eos) and (count <= _PER_LANE or ids is None or ids.dtype.kind not in "iu")
        if eos and not eos_per_lane and ids is not None:
            hit = ids == self._eos_ids[0]
            for eos_id in self._eos_ids[1:]:
                hit |= ids == eos_id
            if hit.any():
                hit &= ~self._ignore_eos[slots]
                ending = hit if ending is None else ending | hit
        finishing = _where(ending) if ending is not None else _NONE
        members = cohort.members
        append = events.append
        check_ended = cohort.epoch != self._epoch  # else nothing ended since the cohort was formed
        skipped: set[int] = set()
        """Lanes that failed, or whose request ended in the previous round (their output is suppressed)."""
        gate_stops: list[int] = []
        if cohort.plain and not errors and not check_ended and not tops and not cohort.observe:
            # The usual round: every lane presents its token's text and nothing else can happen per lane, so
            # the round's tokens go out once, for every stream to read its own lane.
            texts: list[str] | None = None
            broken: list[tuple[RequestState, Exception]] = []
            if cohort.gated:
                texts = []
                text_of = texts.append
                for state, token, text in zip(members, token_ids, cohort.texts, strict=True):
                    state.consumed += 1
                    state.tokens.append(token)
                    try:
                        text_of(text(token))
                    except Exception as exc:  # its detokenizer: the request fails alone, after this round
                        text_of("")
                        broken.append((state, exc))
            else:  # no member has a gate: every token's text is found by its stream
                for state, token in zip(members, token_ids, strict=True):
                    state.consumed += 1
                    state.tokens.append(token)
            append(RoundTokens(cohort.lanes, token_ids, logprobs, texts))
            for state, error in broken:
                skipped.add(cohort.lanes[state.request_id])
                append(self._fail(state, gate_failure(error)))
        else:
            self._apply_lanes(cohort, results, check_ended, skipped, gate_stops, append)
        for index in sorted(publishing - skipped) if publishing else ():
            self._defer_pages(members[index])
        ends = frozenset(finishing).union(gate_stops)
        if eos_per_lane:
            ends = ends.union(
                index
                for index, (state, token) in enumerate(zip(members, token_ids, strict=True))
                if token in eos and not state.ignore_eos
            )
        for index in sorted(ends - skipped) if ends else ():
            state = members[index]
            self._end(state)
            if gate_stops and index in gate_stops:
                append(self._finished(state, "stop", flush=False))
            else:
                token = token_ids[index]
                append(self._finished(state, "stop" if token in eos and not state.ignore_eos else "length"))
        # Lanes that failed or ended are retired (or fenced, then retired): their slots' values are rewritten
        # when the slot is next admitted, so every lane's may advance.
        self._consumed[slots] = consumed
        self._generated[slots] = generated
        cohort.left -= 1
        cohort.room -= 1
        cohort.unpublished -= 1
        if publishing:
            cohort.unpublished = _least((self._published[slots] + 1) * page_tokens - consumed)
        self._completions += 1
        cohort.counted = self._completions

    def _apply_lanes(
        self,
        cohort: _Cohort,
        results: LaneResults,
        check_ended: bool,
        skipped: set[int],
        gate_stops: list[int],
        append: Callable[[Outgoing], None],
    ) -> None:
        """The per-lane part of :meth:`_complete_decode` when some lane fails, was ended, observes time,
        reads top alternatives or has a gate that does more than detokenize: the token appended and its
        event published; failed and suppressed lanes go to ``skipped``, lanes a host stop ended to
        ``gate_stops`` (their requests end after the round's pages are published)."""
        token_ids, logprobs, errors, tops = results.token_ids, results.logprobs, results.errors, results.tops
        origin, plain, observe = self.clock_origin_ns, cohort.plain, cohort.observe
        for index, (state, text) in enumerate(zip(cohort.members, cohort.texts, strict=True)):
            if check_ended and state.ended:
                skipped.add(index)
                continue
            if errors and index in errors:
                skipped.add(index)
                append(self._fail(state, str(errors[index])))
                continue
            state.consumed += 1
            token = token_ids[index]
            stamp = time.monotonic_ns() - origin if observe and state.observe else -1
            state.tokens.append(token)
            gate = state.gate
            try:
                if gate is None or plain:
                    pieces = [(token, text(token))]
                else:
                    outcome = gate.observe(token)
                    pieces = outcome.pieces
                    if outcome.stopped:
                        gate_stops.append(index)
            except Exception as exc:  # the request's own grammar, stops or detokenizer: it fails alone
                skipped.add(index)
                append(self._fail(state, gate_failure(exc)))
                continue
            append(TokenEvent(state.request_id, token, logprobs[index], pieces, stamp, tops.get(index, [])))

    def fail_lanes(self, round_: Round, failures: Mapping[int, str]) -> list[Event]:
        """Fail the requests of ``round_``'s lanes in ``failures`` (lane index: message) only. The round was
        not launched, so nothing of it applies: its other requests are planned again as they are."""
        return [
            self._fail(state, failures[index])
            for index, state in enumerate(round_.members)
            if index in failures and not state.ended
        ]

    def fail_round(self, round_: Round, message: str) -> list[Event]:
        """The whole round failed: fail its requests only; nothing of the round is published."""
        return [self._fail(state, message) for state in round_.members if not state.ended]

    def cancel_all(self) -> list[Event]:
        """Finish every queued and running request as cancelled (shutdown; nothing is in flight)."""
        for state in itertools.chain(self.waiting, self.running):
            state.cancelled = True
        self._cancels = True
        self._epoch += 1
        return self.take_cancelled()

    def fail_all(self, message: str) -> list[Event]:
        """Fail every queued and running request (after an internal error)."""
        events = [self._fail(state, message) for state in list(self.running)]
        while self.waiting:
            state = self.waiting.popleft()
            self.stats.failed += 1
            events.append(ExecutionFailed(state.request_id, message))
        return events

    def _fail(self, state: RequestState, message: str) -> Event:
        self._end(state)
        self.stats.failed += 1
        return ExecutionFailed(state.request_id, message)

    def _finish_reason(self, state: RequestState, token: int) -> FinishReason | None:
        if token in self.eos and not state.ignore_eos:
            return "stop"
        if state.generated >= state.max_tokens:
            return "length"
        return None

    def _finished(
        self, state: RequestState, reason: FinishReason, *, flush: bool = True
    ) -> Finished | ExecutionFailed:
        """The request's normal end, with what its gate still holds (flushed when ``flush``); a gate that
        raises while flushing fails the request instead (it has already ended)."""
        pieces: list[tuple[int, str]] = []
        if flush and state.gate is not None and reason != "cancelled":
            try:
                pieces = state.gate.finish()
            except Exception as exc:
                self.stats.failed += 1
                return ExecutionFailed(state.request_id, gate_failure(exc))
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        return Finished(
            state.request_id, reason, state.prompt_len, state.generated, max(state.reused_tokens, 0), pieces
        )

    def _defer_pages(self, state: RequestState) -> None:
        """Count ``state``'s complete pages as published; they are hashed and published in the allocator
        when another request could first reuse them: before admission matches prefixes, or when ``state``
        releases its pages (a decode round completes about one page in every ``page_tokens`` lanes, and
        hashing them in the round costs more than the rest of the lane's work)."""
        self._published[state.slot] = state.consumed // self.page_tokens
        self._deferred[id(state)] = state

    def _publish_deferred(self) -> None:
        for state in self._deferred.values():
            self._publish_pages(state)
        self._deferred.clear()

    def _publish_pages(self, state: RequestState) -> None:
        pt = self.page_tokens
        while (len(state.hashes) + 1) * pt <= state.consumed:
            index = len(state.hashes)
            previous = state.hashes[-1] if state.hashes else None
            key = self.allocator.chain_hash(previous, state.tokens[index * pt : (index + 1) * pt])
            self.allocator.publish(state.pages[index], key)
            state.hashes.append(key)
        if state.slot >= 0:
            self._published[state.slot] = len(state.hashes)

    def _retire(self, state: RequestState, *, keep_snapshot: bool = False) -> None:
        """Release a request's pages, slot and (unless kept) snapshot row; no round of it is in flight."""
        self._epoch += 1
        if not keep_snapshot and state.snapshot_row >= 0:
            self.free_snapshot_rows.append(state.snapshot_row)
            state.snapshot_row = -1
            state.preempting = False
        if state in self.running:
            self.running.remove(state)
        if self._deferred.pop(id(state), None) is not None:
            self._publish_pages(state)  # before its pages are released: they stay reusable
        if state.pages:
            self.allocator.release(state.pages)
            state.pages = []
        if state.slot >= 0:
            self.free_slots.append(state.slot)
            state.slot = -1

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)


def _no_text(token: int) -> str:
    """The text of a token of a request without a gate: none here (its stream, or the client, detokenizes)."""
    return ""


def _where(mask: npt.NDArray[np.bool_]) -> AbstractSet[int]:
    """The lane indices where ``mask`` holds."""
    return frozenset(np.flatnonzero(mask).tolist()) if mask.any() else _NONE


def _least(values: npt.NDArray[np.signedinteger[Any]]) -> int:
    """The smallest of ``values`` (a large number for none)."""
    return int(values.min()) if values.shape[0] else 2**62


def _frozen(array: _Array) -> _Array:
    """``array``, made read-only (a cohort column is never modified once shared with the packers)."""
    array.flags.writeable = False
    return array


def _variants(graphs: Iterable[PreparedGraph], operation: int) -> list[PreparedGraph]:
    return sorted(
        (g for g in graphs if g.operation == operation),
        key=lambda g: (g.extents.packed_token_capacity, g.extents.batch_capacity),
    )


def _smallest(variants: Sequence[PreparedGraph], *, rows: int, tokens: int = 0) -> PreparedGraph:
    for graph in variants:
        if graph.extents.batch_capacity >= rows and graph.extents.packed_token_capacity >= tokens:
            return graph
    raise RuntimeError(f"no captured variant holds {rows} rows and {tokens} tokens")
