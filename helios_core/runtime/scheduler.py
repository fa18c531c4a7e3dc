"""The scheduler: the model worker's one entry to admission, round planning and round completion.

Data flow: the engine hands each prepared request to :meth:`Scheduler.add` (capacity checks; a
request outside the prepared capacities is an admission rejection; the prompt's layout, when the
caller has one, carries its message boundaries and a continued assistant message).
:meth:`Scheduler.next_round` returns the next :class:`~helios_core.runtime.plan.RoundPlan` (an immutable value:
graph, request ids, slots, lanes, expectations); the engine packs, launches and validates it, and
:meth:`Scheduler.complete` applies the plan with its validated results and returns the events to
publish. :meth:`Scheduler.followup` plans the next decode round of the same requests before the
previous one's completion is read.

Three parts, each the one owner of its state:

* :class:`~helios_core.runtime.slots.SlotTable`: per-slot columns, the only copy of every running
  request's progress (phase, consumed endpoint, tokens, pages, published pages, sampling values);
* :class:`~helios_core.runtime.residency.Residency`: the queues, slots, pages and snapshot rows
  requests hold, and their transitions (admission, preemption, finishing, cancellation);
* :class:`~helios_core.runtime.planner.RoundPlanner` (reads the table, plans) and
  :class:`~helios_core.runtime.progress.RoundCompletion` (writes progress from results).

Faults of one request stay with it: a request whose prompt ids or sampling values do not fit the core
is rejected at admission, and a host gate that raises while a round is planned (its mask), while a
token is applied or while the request's end is flushed fails that request alone (planning then plans
the round again without it; :meth:`Scheduler.take_faults`). :meth:`Scheduler.fail_lanes` fails the
requests of chosen lanes of a round that was not launched (values that did not pack).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from helios_core.contract import PreparedContract, Selection
from helios_core.contract.boundaries import PrefixBoundaries, PromptLayout
from helios_core.runtime.completion import CompletionError, LaneResult
from helios_core.runtime.gates import HostGate
from helios_core.runtime.messages import AdmissionRejected, Event, Outgoing, PreparedRequest
from helios_core.runtime.offload import HostCheckpointStore
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.planner import RequestFault, RoundPlanner
from helios_core.runtime.progress import RoundCompletion
from helios_core.runtime.residency import Residency
from helios_core.runtime.slots import RequestState, SlotTable
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct

__all__ = ["RequestState", "RoundPlan", "Scheduler"]


class Scheduler:
    """Turns requests into round plans and applied rounds into events."""

    def __init__(
        self,
        contract: PreparedContract,
        selection: Selection,
        allocator: PageAllocator,
        stats: SchedulerStats,
        *,
        make_gate: Callable[[PreparedRequest], HostGate | None] | None = None,
        clock_origin_ns: int = 0,
        checkpoint_host: HostCheckpointStore | None = None,
    ) -> None:
        self.contract = contract
        self.stats = stats
        operations = {graph.operation for graph in selection.graphs.values()}
        copies = ct.OPERATION_SNAPSHOT in operations and ct.OPERATION_RESTORE in operations
        self.residency = Residency(
            contract,
            allocator,
            stats,
            max_active=selection.max_active,
            queue_capacity=selection.queue_capacity,
            snapshot_rows=contract.serving.snapshot_capacity if copies else 0,
            scored_prefill=ct.OPERATION_SCORED_PREFILL in operations,
            make_gate=make_gate,
            graphs=selection.graphs.values(),
            checkpoint_host=checkpoint_host,
        )
        self.residency.resumable = ct.OPERATION_RESUME in operations
        self.table: SlotTable = self.residency.table
        self.boundaries = PrefixBoundaries.of(contract.model.frontend)
        """The core's prefix-boundary rules: where reuse of a laid-out prompt's published prefix may end."""
        self.planner = RoundPlanner(contract, selection, self.residency, stats)
        self.completion = RoundCompletion(self.residency, stats, frozenset(contract.eos_token_ids), clock_origin_ns)
        self.max_active = selection.max_active
        self.queue_capacity = selection.queue_capacity
        self._faults: list[Event] = []
        """Failures of single requests found while planning (a host gate that raised), to publish."""

    # -- what it holds -------------------------------------------------------------------------------
    @property
    def allocator(self) -> PageAllocator:
        return self.residency.allocator

    @property
    def waiting(self) -> deque[RequestState]:
        return self.residency.waiting

    @property
    def running(self) -> list[RequestState]:
        return self.residency.running

    @property
    def free_slots(self) -> list[int]:
        return self.residency.free_slots

    @property
    def free_snapshot_rows(self) -> list[int]:
        return self.residency.free_snapshot_rows

    @property
    def starved(self) -> bool:
        return self.residency.starved

    @property
    def in_flight(self) -> AbstractSet[int]:
        """Slots of requests with a follow-up round launched."""
        return self.residency.in_flight

    @property
    def make_gate(self) -> Callable[[PreparedRequest], HostGate | None] | None:
        return self.residency.make_gate

    @make_gate.setter
    def make_gate(self, make_gate: Callable[[PreparedRequest], HostGate | None] | None) -> None:
        self.residency.make_gate = make_gate

    @property
    def pipelining(self) -> bool:
        """Launch a follow-up decode round before the previous round's completion is read (two frames)."""
        return self.planner.pipelining

    @pipelining.setter
    def pipelining(self, value: bool) -> None:
        self.planner.pipelining = value

    @property
    def has_room(self) -> bool:
        return self.residency.has_room

    @property
    def idle(self) -> bool:
        return not self.residency.waiting and not self.residency.running

    # -- requests ------------------------------------------------------------------------------------
    def add(self, request: PreparedRequest, layout: PromptLayout | None = None) -> AdmissionRejected | None:
        """Queue ``request`` (or reject it). ``layout``, the rendered prompt's message structure, decides
        where prefix reuse may cut (the core's prefix-boundary rules) and which tail of the prompt
        continues an assistant message (computed by RESUME programs when the core has them); a layout
        that does not fit the prompt is a permanent rejection naming ``messages``."""
        if layout is None:
            return self.residency.add(request)
        problem = layout.problem(len(request.prompt_ids))
        if problem is not None:
            self.stats.rejected += 1
            return AdmissionRejected(
                request.request_id, f"the prompt layout does not fit the prompt: {problem}", "messages", True
            )
        return self.residency.add(request, cuts=self.boundaries.cuts(layout), continuation=layout.continuation)

    def cancel(self, request_id: str) -> None:
        self.residency.cancel(request_id)

    def take_cancelled(self) -> list[Event]:
        return self.residency.take_cancelled()

    def cancel_all(self) -> list[Event]:
        return self.residency.cancel_all()

    def fail_all(self, message: str) -> list[Event]:
        return self.residency.fail_all(message)

    # -- rounds --------------------------------------------------------------------------------------
    def next_round(self) -> RoundPlan | None:
        """Admit what fits, then plan the next round (None when there is nothing to run).

        A request whose host gate raises while the round is planned (its grammar mask), or whose prefill
        cannot continue, fails alone, and the round is planned again without it; its failure waits in
        :meth:`take_faults`.
        """
        while True:
            try:
                return self.planner.plan()
            except RequestFault as fault:
                self._faults.append(self.residency.fail(fault.state, fault.message))

    def take_faults(self) -> list[Event]:
        """The failures of single requests found while planning, to publish (each once)."""
        if not self._faults:
            return []
        faults, self._faults = self._faults, []
        return faults

    def followup(self, plan: RoundPlan) -> RoundPlan | None:
        return self.planner.followup(plan)

    def release_fenced(self) -> None:
        self.residency.release_fenced()

    def complete(self, plan: RoundPlan, results: Sequence[LaneResult | CompletionError]) -> list[Outgoing]:
        """Apply a validated round; returns the events to publish, in order (a steady decode round's
        tokens as one :class:`~helios_core.runtime.messages.RoundTokens`)."""
        payoff = self.planner.speculation.payoff
        if payoff is None:
            events = self.completion.apply(plan, results)
        else:
            speculative = plan.operation == ct.OPERATION_SPECULATIVE
            before = sum(self.stats.speculative_emitted.values()) if speculative else 0
            events = self.completion.apply(plan, results)
            payoff.completed(plan, sum(self.stats.speculative_emitted.values()) - before if speculative else len(plan))
        self.planner.completed(plan)
        if self.residency.window:
            self.residency.release_outside_window()
        return events

    def fail_lanes(self, plan: RoundPlan, failures: Mapping[int, str]) -> list[Event]:
        return self.completion.fail_lanes(plan, failures)

    def fail_round(self, plan: RoundPlan, message: str) -> list[Event]:
        return self.completion.fail_round(plan, message)
