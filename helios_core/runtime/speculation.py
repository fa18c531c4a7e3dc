"""Speculative round planning: which decode rounds become speculative rounds, and their lanes.

Owns :class:`SpeculativePlanner`, which the round planner asks before it plans a decode round. With
history drafting on (the core's programs verify copied proposals), each eligible decode-ready request
offers the tokens :func:`~helios_core.runtime.drafting.propose` finds in its own prompt and output
(as many as its recent acceptance makes worthwhile, :func:`worthwhile_proposals`);
a request with a grammar offers the prefix of them its grammar allows, each position with the mask
the grammar gives after the proposals before it (:meth:`~helios_core.runtime.gates.HostGate.masks_along`,
which leaves the request's grammar state alone: only the emitted tokens advance it).
With programs that draft in-graph and allocate prefixes (``SPECULATIVE_PREFIX_LIMIT``), each lane gets
a ceiling, and a request with a grammar keeps the round a decode round. Either way a request with top
alternatives to read keeps the round a decode round, and speculation never preempts anyone: a proposal
or ceiling that has no free page shrinks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedGraph, Selection
from helios_core.runtime.completion import LaneExpectation
from helios_core.runtime.drafting import propose
from helios_core.runtime.packing import Lane
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.slots import Phase, RequestState
from helios_core.wire import contract_pb2 as ct

if TYPE_CHECKING:
    from helios_core.runtime.planner import RoundPlanner


class SpeculativePlanner:
    """Plans speculative rounds for one round planner."""

    def __init__(self, planner: RoundPlanner, graphs: Iterable[PreparedGraph], selection: Selection) -> None:
        self.planner = planner
        self.table = planner.table
        self.residency = planner.residency
        self.page_tokens = planner.page_tokens
        self.context = planner.context
        speculative = [g for g in graphs if g.operation == ct.OPERATION_SPECULATIVE and g.extents.token_capacity > 1]
        self.speculative = sorted(
            (g for g in speculative if _copies_proposals(g)),
            key=lambda g: (g.extents.token_capacity, g.extents.batch_capacity),
        )
        """Programs that verify copied proposals, narrowest first (history drafting uses them)."""
        self.drafting = selection.history_drafting and bool(self.speculative)
        self.self_drafting = sorted(
            (g for g in speculative if _allocates_prefixes(g)),
            key=lambda g: (g.extents.token_capacity, g.extents.batch_capacity),
        )
        """Programs that draft in-graph and allocate prefixes within ceilings, narrowest first."""
        self.active = self.drafting or bool(self.self_drafting)
        """Decode rounds may become speculative rounds (so each is planned from completed endpoints)."""

    def plan(self, decode: list[RequestState]) -> RoundPlan | None:
        """A speculative round of the decode-ready requests, or None to plan a decode round."""
        if self.drafting:
            return self._history_round(decode)
        if self.self_drafting:
            return self._self_draft_round(decode)
        return None

    def _history_round(self, decode: list[RequestState]) -> RoundPlan | None:
        """A round verifying history proposals of the decode-ready requests, or None when plain decode is
        planned instead: some request cannot speculate (top alternatives to read), or no request has a
        proposal.

        Each lane offers what :func:`~helios_core.runtime.drafting.propose` finds after its pending token,
        at most the widest program's W - 1, one less than its tokens left and what its context and the
        free pages hold (proposals are optional: they never preempt). A request with a grammar offers only
        the proposals its grammar allows in turn, and its lane carries one mask a position (the gate's
        :meth:`~helios_core.runtime.gates.HostGate.masks_along`), so each emitted token is the one
        constrained decode would sample. The program is the narrowest width, then the fewest rows, that
        holds every lane.
        """
        from helios_core.runtime.planner import GateFault  # the planner imports this module

        table, residency = self.table, self.residency
        widest = self.speculative[-1].extents
        rows = max(g.extents.batch_capacity for g in self.speculative)
        members = sorted(decode, key=lambda s: s.arrival)[:rows]
        if any(s.top for s in members):
            return None
        proposals: list[list[int]] = []
        for state in members:
            slot = state.slot
            consumed = int(table.consumed[slot])
            limit = min(
                widest.token_capacity - 1,
                state.max_tokens - int(table.generated[slot]) - 1,
                self.context - 1 - consumed,
                worthwhile_proposals(state.acceptance, widest.token_capacity - 1),
            )
            history = table.tokens[slot, : consumed + 1]
            proposals.append(propose(history, limit) if limit > 0 else [])
        if not any(proposals):
            return None
        masks: list[list[npt.NDArray[np.int32]]] = []
        for index, state in enumerate(members):
            gate = state.gate
            if gate is None or not gate.constrained:
                masks.append([])
                continue
            try:
                along = gate.masks_along(proposals[index])
            except Exception as exc:  # the request's own grammar: it fails alone
                raise GateFault(state, exc) from exc
            proposals[index] = proposals[index][: len(along) - 1]  # only what the grammar allows in turn
            masks.append(along)
        if not any(proposals):
            return None
        lanes: list[Lane] = []
        kept: list[RequestState] = []
        expectations: list[LaneExpectation] = []
        taken: set[int] = set()
        page_tokens = self.page_tokens
        for state, candidates, along in zip(members, proposals, masks, strict=True):
            slot = state.slot
            if slot < 0 or table.phase[slot] != Phase.DECODE:
                continue  # preempted while an earlier member took a page
            if not residency.ensure_page(state, exclude=taken):
                residency.starved = True
                continue
            consumed = int(table.consumed[slot])
            while candidates and (consumed + len(candidates)) // page_tokens >= table.page_count[slot]:
                page = residency.allocator.allocate(1)
                if page is None:  # a proposal's position without a page: offer fewer
                    candidates = candidates[: int(table.page_count[slot]) * page_tokens - consumed - 1]
                    break
                table.add_pages(slot, page)
            kept.append(state)
            taken.add(slot)
            lane = self.planner.lane(
                state, range(consumed, consumed + 1 + len(candidates)), sample=True, candidates=candidates
            )
            if along:  # a constrained lane: one mask a position
                lane = dataclasses.replace(lane, candidate_masks=along[: len(candidates) + 1])
            lanes.append(lane)
            expectations.append(LaneExpectation(int(table.generation[slot]), consumed, True, 0, offers=len(candidates)))
        if not lanes or not any(lane.candidates for lane in lanes):
            return None
        width = 1 + max(len(lane.candidates) for lane in lanes)
        graph = next(
            g for g in self.speculative if g.extents.token_capacity >= width and g.extents.batch_capacity >= len(lanes)
        )
        cursor = graph.contract.cursor
        if cursor.reports_draft_cursor:  # the record's cursor must trail each lane's endpoint by the lag
            expectations = [dataclasses.replace(e, cursor_lag=cursor.lag_tokens) for e in expectations]
        return self.planner.lanes_plan(graph, kept, lanes, expectations)

    def _self_draft_round(self, decode: list[RequestState]) -> RoundPlan | None:
        """A round of a program that drafts in-graph and allocates its own prefixes, or None when plain
        decode is planned instead (a request with a grammar or top alternatives to read, or no lane with
        room for a proposal).

        The program is the widest selected one (then the fewest rows) that holds the lanes. Each lane's
        ceiling (its ``SPECULATIVE_PREFIX_LIMIT``) is at most the program's min(D + 1, W), its tokens left
        and what its context holds; pages are reserved for the whole ceiling (the program may take it
        all), and a ceiling shrinks to the pages free rather than preempting anyone.
        """
        table, residency = self.table, self.residency
        rows = max(g.extents.batch_capacity for g in self.self_drafting)
        members = sorted(decode, key=lambda s: s.arrival)[:rows]
        if any(s.top or (s.gate is not None and s.gate.constrained) for s in members):
            return None
        widest = max(g.extents.token_capacity for g in self.self_drafting)
        graph = next(
            g
            for g in sorted(self.self_drafting, key=lambda g: (-g.extents.token_capacity, g.extents.batch_capacity))
            if g.extents.token_capacity == widest and g.extents.batch_capacity >= len(members)
        )
        extents = graph.extents
        reach = min(extents.draft_tokens + 1, extents.token_capacity)
        lanes: list[Lane] = []
        kept: list[RequestState] = []
        expectations: list[LaneExpectation] = []
        taken: set[int] = set()
        page_tokens = self.page_tokens
        for state in members:
            slot = state.slot
            if slot < 0 or table.phase[slot] != Phase.DECODE:
                continue
            if not residency.ensure_page(state, exclude=taken):
                residency.starved = True
                continue
            consumed = int(table.consumed[slot])
            ceiling = min(reach, state.max_tokens - int(table.generated[slot]), self.context - consumed)
            while ceiling > 1 and (consumed + ceiling - 1) // page_tokens >= table.page_count[slot]:
                page = residency.allocator.allocate(1)
                if page is None:  # the rest of the ceiling has no page: take less
                    ceiling = int(table.page_count[slot]) * page_tokens - consumed
                    break
                table.add_pages(slot, page)
            kept.append(state)
            taken.add(slot)
            lanes.append(
                dataclasses.replace(self.planner.lane(state, range(0), sample=True), prefix_limit=max(ceiling, 1))
            )
            expectations.append(
                LaneExpectation(
                    int(table.generation[slot]), consumed, True, 0, offers=max(ceiling, 1) - 1, offers_exact=False
                )
            )
        if not any(lane.prefix_limit > 1 for lane in lanes):
            return None
        cursor = graph.contract.cursor
        if cursor.reports_draft_cursor:
            expectations = [dataclasses.replace(e, cursor_lag=cursor.lag_tokens) for e in expectations]
        return self.planner.lanes_plan(graph, kept, lanes, expectations)


WORTHWHILE = 0.2
"""A proposal is offered while the chance that it and every proposal before it holds is at least this: a
verified row costs a fraction of a decode step, a row that does not hold costs it for nothing."""


def worthwhile_proposals(acceptance: float, widest: int) -> int:
    """How many proposals a request whose proposals hold with probability ``acceptance`` each (its recent
    rate) should offer: the most ``k`` (at most ``widest``) with ``acceptance ** k >= WORTHWHILE``, and at
    least one, so the rate keeps being measured."""
    count = 1
    while count < widest and acceptance ** (count + 1) >= WORTHWHILE:
        count += 1
    return count


def _copies_proposals(graph: PreparedGraph) -> bool:
    """Whether ``graph`` verifies host-copied proposals (binds CANDIDATE_IDS and an exact QUERY_LENGTH)."""
    sources = {binding.source for binding in graph.contract.bindings}
    return ct.VALUE_SOURCE_CANDIDATE_IDS in sources and ct.VALUE_SOURCE_QUERY_LENGTH in sources


def _allocates_prefixes(graph: PreparedGraph) -> bool:
    """Whether ``graph`` takes ceilings (SPECULATIVE_PREFIX_LIMIT) and allocates its prefixes itself."""
    return any(binding.source == ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT for binding in graph.contract.bindings)
