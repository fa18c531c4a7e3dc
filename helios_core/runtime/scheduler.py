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

Ownership: queues, slots and generations live here; pages live in the PageAllocator; per-request
progress lives on RequestState (written only by this module).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedContract, PreparedGraph, Selection
from helios_core.runtime.completion import CompletionError, LaneExpectation, LaneResult
from helios_core.runtime.gates import HostGate
from helios_core.runtime.messages import (
    AdmissionRejected,
    Event,
    ExecutionFailed,
    Finished,
    FinishReason,
    PreparedRequest,
    PromptScores,
    TokenEvent,
)
from helios_core.runtime.packing import Lane
from helios_core.runtime.pages import PageAllocator, PrefixMatch
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct


@dataclass(eq=False)
class RequestState:
    """One request's progress. Written by the scheduler only."""

    request: PreparedRequest
    tokens: list[int]
    """Prompt followed by every generated token, in position order."""
    prompt_len: int
    arrival: int
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
    """Detokenizer, stops and grammar of this request (created at admission)."""
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

    @property
    def request_id(self) -> str:
        return self.request.request_id

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


@dataclass
class Round:
    """One planned program launch."""

    graph: PreparedGraph
    members: list[RequestState]
    lanes: list[Lane]
    expectations: list[LaneExpectation]


class Scheduler:
    """Turns requests into rounds and completed rounds into events."""

    def __init__(
        self,
        contract: PreparedContract,
        selection: Selection,
        allocator: PageAllocator,
        stats: SchedulerStats,
        *,
        make_gate: Callable[[PreparedRequest], HostGate] | None = None,
        clock_origin_ns: int = 0,
    ) -> None:
        self.contract = contract
        self.make_gate = make_gate
        self.clock_origin_ns = clock_origin_ns
        self.allocator = allocator
        self.stats = stats
        self.page_tokens = contract.model.cache.page_tokens
        self.context = contract.serving.context_tokens
        self.eos = frozenset(contract.eos_token_ids)
        self.histogram_width = contract.histogram_width
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
        self.pages_per_row = min((v.pages_per_row for v in contract.model.cache.page_table_views), default=0)
        self.waiting: deque[RequestState] = deque()
        self.pipelining = True
        """Launch a follow-up decode round before the previous round's completion is read (two frames)."""
        self.in_flight: set[int] = set()
        """ids of requests with a follow-up round already launched."""
        self._fenced: list[RequestState] = []
        self.starved = False
        """A running request lacked a page in the last round: admit nobody until every running request is served."""
        self.running: list[RequestState] = []
        self.free_slots: list[int] = list(range(self.max_active - 1, -1, -1))
        self._generations = itertools.count(1)
        self._arrivals = itertools.count()

    # -- requests --------------------------------------------------------------------------------
    def add(self, request: PreparedRequest) -> AdmissionRejected | None:
        """Queue a request, or reject it when it lies outside the prepared capacities."""
        problem = self._capacity_problem(request)
        if problem is not None:
            self.stats.rejected += 1
            return AdmissionRejected(request.request_id, problem)
        state = RequestState(request, list(request.prompt_ids), len(request.prompt_ids), next(self._arrivals))
        if self.make_gate is not None:
            try:
                state.gate = self.make_gate(request)
            except Exception as exc:  # a format preparation accepted but the worker cannot compile
                self.stats.rejected += 1
                return AdmissionRejected(request.request_id, f"cannot prepare the request's gates: {exc}")
        self.waiting.append(state)
        self.stats.received += 1
        return None

    def _capacity_problem(self, request: PreparedRequest) -> str | None:
        prompt = len(request.prompt_ids)
        if prompt == 0:
            return "the prompt is empty"
        if request.max_tokens <= 0:
            return "max_tokens must be positive"
        if request.prompt_logprobs and not self.scored:
            return "prompt logprobs are not supported by this core (no scored prefill programs)"
        total = prompt + request.max_tokens
        if total > self.context:
            return (
                f"prompt ({prompt} tokens) plus max_tokens ({request.max_tokens}) exceeds the core's context of "
                f"{self.context} tokens"
            )
        limit = min(self.pages_per_row, self.allocator.total_pages)
        if self._pages_for(total) > limit:
            return f"the request needs {self._pages_for(total)} cache pages; at most {limit} fit"
        return None

    def cancel(self, request_id: str) -> None:
        for state in itertools.chain(self.waiting, self.running):
            if state.request_id == request_id:
                state.cancelled = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- planning ----------------------------------------------------------------------------------
    def take_cancelled(self) -> list[Event]:
        """Finish every cancelled request (nothing is in flight between rounds)."""
        events: list[Event] = []
        for state in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(state)
            events.append(self._finished(state, "cancelled"))
        for state in [s for s in self.running if s.cancelled]:
            self._retire(state)
            events.append(self._finished(state, "cancelled"))
        return events

    def next_round(self) -> Round | None:
        """Admit what fits, then plan the next round (None when there is nothing to run)."""
        leaving = next((s for s in self.running if s.preempting), None)
        if leaving is not None and self.snapshot is not None:
            return self._state_copy_round(self.snapshot, leaving, snapshot_row=leaving.snapshot_row)
        self._admit()
        fresh = [s for s in self.running if s.needs_init]
        if fresh:
            return self._initialize_round(fresh)
        returning = next((s for s in self.running if s.restore_ready), None)
        if returning is not None and self.restore is not None:
            return self._state_copy_round(self.restore, returning, restore_row=returning.snapshot_row)
        prefill = [s for s in self.running if s.in_prefill]
        decode = [s for s in self.running if s.decode_ready]
        if prefill and prefill[0].scoring:
            return self._scored_round(prefill[0])
        prefill = [s for s in prefill if not s.scoring]
        if prefill:
            return self._prefill_round(prefill, decode)
        if decode:
            return self._decode_round(decode)
        return None

    def _admit(self) -> None:
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
            self.stats.admitted += 1

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
            lanes.append(self._lane(state, positions, state.tokens[state.consumed : state.consumed + chunk], last))
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
        top = max(state.request.top_logprobs, 0) if samples else 0
        return LaneExpectation(state.generation, consumed, samples, top, scores)

    def _decode_round(self, decode: list[RequestState]) -> Round:
        rows = max(g.extents.batch_capacity for g in self.decodes)
        members: list[RequestState] = []
        page_tokens = self.page_tokens
        served = True
        for state in sorted(decode, key=lambda s: s.arrival)[:rows]:
            if state.slot < 0 or state.preempting:
                continue  # preempted while an earlier member took a page
            if state.consumed // page_tokens < len(state.pages) or self._ensure_page(state, exclude=members):
                members.append(state)
            else:
                served = False
        self.starved = not served
        lanes = [self._lane(s, [s.consumed], [], sample=True) for s in members]
        expectations = [self._expect(s, s.consumed + 1, True) for s in members]
        return Round(_smallest(self.decodes, rows=len(lanes)), members, lanes, expectations)

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
        for state in members:
            if state.cancelled or state.preempting or state.ended:
                return None
            if state.gate is not None and state.gate.holds_rounds:
                return None
            if state.generated + 2 > state.request.max_tokens:
                return None
        for state in members:
            if (state.consumed + 1) // self.page_tokens >= len(state.pages):
                page = self.allocator.allocate(1)
                if page is None:
                    return None
                state.pages.extend(page)
        lanes = [self._lane(state, [state.consumed + 1], [], sample=True, ahead=1) for state in members]
        expectations = [self._expect(state, state.consumed + 2, True) for state in members]
        self.in_flight = {id(state) for state in members}
        self.stats.pipelined_rounds += 1
        return Round(round_.graph, list(members), lanes, expectations)

    def release_fenced(self) -> None:
        """The follow-up round's fence has passed: release what ended while it was in flight."""
        self.in_flight = set()
        for state in self._fenced:
            self._retire(state)
        self._fenced = []

    def _end(self, state: RequestState) -> None:
        """Release a finished or failed request now, or after the fence of its in-flight follow-up round."""
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
                state.pages.extend(page)
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
            grammar_mask=state.gate.mask() if sample and state.gate is not None else None,
            prompt_histogram=self._histogram(state.tokens[: state.prompt_len]) if histogram else None,
            consumed=state.consumed + ahead,
        )

    def _histogram(self, prompt: list[int]) -> npt.NDArray[np.uint8]:
        counts = np.bincount(np.asarray(prompt, dtype=np.int64), minlength=self.histogram_width)
        return np.minimum(counts, 255).astype(np.uint8)

    # -- completion -------------------------------------------------------------------------------
    def complete(self, round_: Round, results: Sequence[LaneResult | CompletionError]) -> list[Event]:
        """Apply a validated round; returns the events to publish, in order."""
        events: list[Event] = []
        self.stats.count_round(round_.graph.name, round_.graph.operation_name, len(round_.members))
        constrained = [
            s.gate is not None and s.gate.constrained
            for s, lane in zip(round_.members, round_.lanes, strict=True)
            if lane.sample
        ]
        if any(constrained):
            self.stats.constrained_max_inflight = max(self.stats.constrained_max_inflight, 1)
            if round_.graph.operation == ct.OPERATION_DECODE and not all(constrained):
                self.stats.mixed_grammar_decode_steps += 1
        for state, lane, result in zip(round_.members, round_.lanes, results, strict=True):
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
                state.pending_on_device = True
                self.stats.restores += 1
                continue
            state.consumed += lane.query_length
            self._publish_pages(state)
            if operation == ct.OPERATION_SCORED_PREFILL and not state.scores_sent:
                state.scores.extend(result.scores)
                if state.consumed >= state.prompt_len:
                    state.scores_sent = True
                    events.append(PromptScores(state.request_id, state.scores[: state.prompt_len - 1]))
            if not lane.sample:
                continue
            token = result.token_id
            stamp = time.monotonic_ns() - self.clock_origin_ns if state.request.observe_timestamps else -1
            state.tokens.append(token)
            state.pending_on_device = True
            outcome = state.gate.observe(token) if state.gate is not None else None
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

    def fail_round(self, round_: Round, message: str) -> list[Event]:
        """The whole round failed: fail its requests only; nothing of the round is published."""
        return [self._fail(state, message) for state in round_.members if not state.ended]

    def cancel_all(self) -> list[Event]:
        """Finish every queued and running request as cancelled (shutdown; nothing is in flight)."""
        for state in itertools.chain(self.waiting, self.running):
            state.cancelled = True
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
        if token in self.eos and not state.request.ignore_eos:
            return "stop"
        if state.generated >= state.request.max_tokens:
            return "length"
        return None

    def _finished(self, state: RequestState, reason: FinishReason, *, flush: bool = True) -> Finished:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        pieces = state.gate.finish() if flush and state.gate is not None and reason != "cancelled" else []
        return Finished(
            state.request_id, reason, state.prompt_len, state.generated, max(state.reused_tokens, 0), pieces
        )

    def _publish_pages(self, state: RequestState) -> None:
        pt = self.page_tokens
        while (len(state.hashes) + 1) * pt <= state.consumed:
            index = len(state.hashes)
            previous = state.hashes[-1] if state.hashes else None
            key = self.allocator.chain_hash(previous, state.tokens[index * pt : (index + 1) * pt])
            self.allocator.publish(state.pages[index], key)
            state.hashes.append(key)

    def _retire(self, state: RequestState, *, keep_snapshot: bool = False) -> None:
        """Release a request's pages, slot and (unless kept) snapshot row; no round of it is in flight."""
        if not keep_snapshot and state.snapshot_row >= 0:
            self.free_snapshot_rows.append(state.snapshot_row)
            state.snapshot_row = -1
            state.preempting = False
        if state in self.running:
            self.running.remove(state)
        if state.pages:
            self.allocator.release(state.pages)
            state.pages = []
        if state.slot >= 0:
            self.free_slots.append(state.slot)
            state.slot = -1

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)


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
