"""Speculative round planning: which decode rounds become speculative rounds, and their lanes.

Owns :class:`SpeculativePlanner`, which the round planner asks before it plans a decode round. With
history drafting on (the core's programs verify copied proposals), each eligible decode-ready request
offers the tokens :func:`~helios_core.runtime.drafting.propose` finds in its own prompt and output
(as many as its recent acceptance makes worthwhile, :func:`worthwhile_proposals`, or every one found where
the round's rows are few enough to cost nothing more, :data:`FREE_VERIFIED_ROWS`);
a request with a grammar offers the prefix of them its grammar allows, each position with the mask
the grammar gives after the proposals before it (:meth:`~helios_core.runtime.gates.HostGate.masks_along`,
which leaves the request's grammar state alone: only the emitted tokens advance it).
With programs that draft in-graph and allocate prefixes (``SPECULATIVE_PREFIX_LIMIT``), each lane gets
a ceiling, and a request with a grammar keeps the round a decode round. Either way a request with top
alternatives to read keeps the round a decode round, and speculation never preempts anyone: a proposal
or ceiling that has no free page shrinks.

A history round is planned from columns: the members (the decode-ready requests, oldest first) and their
constant columns are found once per membership of the slot table (:class:`_Members`), every lane's
proposals come from one :class:`~helios_core.runtime.drafting.HistoryIndex` lookup, and, when no member
has a grammar and the free pages hold every proposal, its lanes are a
:class:`~helios_core.runtime.packing.LaneBatch` and its expectations a
:class:`~helios_core.runtime.completion.SpeculativeExpectations`. A round with a grammar, or one whose
proposals need pages that only preemption would free, is planned lane by lane.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedGraph, Selection
from helios_core.runtime.completion import LaneExpectation, SpeculativeExpectations
from helios_core.runtime.drafting import HistoryIndex, propose
from helios_core.runtime.packing import Column, Lane, LaneBatch
from helios_core.runtime.payoff import SpeculationPayoff
from helios_core.runtime.plan import RoundPlan, frozen, slot_array
from helios_core.runtime.slots import Phase, RequestState
from helios_core.wire import contract_pb2 as ct

if TYPE_CHECKING:
    from helios_core.runtime.planner import RoundPlanner


COLUMNS_FROM = 8
"""History rounds of at least this many members are planned as columns; fewer members' rounds are planned
lane by lane, with each one's proposals scanned from its history (fewer operations for a lane or two)."""
_CONSTANT_SOURCES = frozenset(
    {
        ct.VALUE_SOURCE_GRAMMAR_MASK,
        ct.VALUE_SOURCE_PROMPT_HISTOGRAM,
        ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS,
    }
)
"""Sources a batch of history lanes stages alike in every round: padding (no lane has a grammar mask or a
prompt histogram)."""


@dataclass(eq=False, slots=True)
class _Members:
    """The members of history rounds while the slot table's membership count is ``membership``: the
    decode-ready requests, oldest first (at most the widest program's rows), and their constant columns."""

    number: int
    """Unique per members found: the ``staged_as`` of their batches."""
    membership: int
    states: list[RequestState]
    request_ids: tuple[str, ...]
    slots: npt.NDArray[np.int64]
    generations: npt.NDArray[np.int64]
    rows: dict[int, Column]
    """Per-lane columns of a batch that stay the same while the members do, by value source."""
    unchanged: frozenset[int]
    """The sources whose staged values stay the same from one of their batches to the next."""
    top: bool
    """Some member reads top alternatives (its rounds are decode rounds)."""
    constrained: bool
    """Some member has a grammar (its rounds are planned lane by lane, with a mask per position)."""
    cell_base: npt.NDArray[np.int64]
    """Each member's first cell in the flat page-start table (slot x page-table width)."""


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
            (g for g in speculative if g.drafts_in_graph),
            key=lambda g: (g.extents.token_capacity, g.extents.batch_capacity),
        )
        """Programs that draft in-graph and allocate prefixes within ceilings, narrowest first."""
        self.active = self.drafting or bool(self.self_drafting)
        """Decode rounds may become speculative rounds (so each is planned from completed endpoints)."""
        measured = selection.speculation_payoff and self.active
        self.payoff = SpeculationPayoff(planner.stats.speculation_stretches) if measured else None
        """With ``--speculation-payoff``: which kind of round measures faster now."""
        self.index = HistoryIndex(self.table.tokens)
        """Every member's proposals (the table's token rows, as their requests append to them)."""
        self.widest = self.speculative[-1].extents.token_capacity - 1 if self.speculative else 0
        """The most proposals a lane offers (the widest program's W - 1)."""
        self._members: _Members | None = None
        self._numbers = itertools.count(1)
        self._graphs: dict[tuple[int, int], PreparedGraph] = {}
        self._fed: dict[str, tuple[bool, bool]] = {}
        """Per program: whether it binds OUTPUT_LIMIT, and host-fed tokens (PROMPT_TOKENS or PENDING_TOKEN)."""
        packed = max((g.extents.packed_token_capacity for g in self.speculative), default=0)
        rows = max((g.extents.batch_capacity for g in self.speculative), default=0)
        self._positions = np.arange(packed, dtype=np.int64)
        self._lanes = np.arange(rows, dtype=np.int64)

    def plan(self, decode: list[RequestState]) -> RoundPlan | None:
        """A speculative round of the decode-ready requests, or None to plan a decode round."""
        if self.payoff is not None and not self.payoff.speculate(len(decode)):
            return None
        if self.drafting:
            return self._history_round(decode)
        if self.self_drafting:
            return self._self_draft_round(decode)
        return None

    def _free(self, members: int) -> bool:
        """Whether a round of ``members`` lanes at the widest width verifies few enough rows to cost nothing
        more than one (:data:`FREE_VERIFIED_ROWS`): its lanes then offer every proposal they find."""
        return members * (self.widest + 1) <= FREE_VERIFIED_ROWS

    def decodes_ahead(self) -> bool:
        """Whether decode rounds may be launched ahead of completions (no speculation, or a decode stretch)."""
        return not self.active or (self.payoff is not None and self.payoff.decodes_ahead())

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
        members = self._members_of(decode)
        if members.top:
            return None
        if len(members.states) < COLUMNS_FROM:
            return self._few_round(members.states)
        table = self.table
        slots = members.slots
        consumed = table.consumed[slots]
        generated = table.generated[slots]
        limits = np.minimum(table.max_tokens[slots] - generated, self.context - consumed) - 1
        if not self._free(len(slots)):
            limits = np.minimum(limits, worthwhile_counts(table.acceptance[slots], self.widest))
        proposals, counts = self.index.propose(slots, members.generations, consumed + 1, limits, self.widest)
        if not counts.any():
            return None
        if not members.constrained:
            plan = self._batch_round(members, proposals, counts, consumed, generated)
            if plan is not None:
                return plan
        listed = proposals.tolist()
        return self._lane_round(
            members.states, [row[:count] for row, count in zip(listed, counts.tolist(), strict=True)]
        )

    def _few_round(self, members: list[RequestState]) -> RoundPlan | None:
        """The round of a few members, lane by lane: each one's proposals scanned from its history. Where
        every member's widest lane fits in :data:`FREE_VERIFIED_ROWS`, each offers as many proposals as it
        finds (a row costs nothing there); otherwise as many as its acceptance makes worthwhile."""
        table, widest = self.table, self.widest
        free = self._free(len(members))
        proposals: list[list[int]] = []
        for state in members:
            slot = state.slot
            consumed = int(table.consumed[slot])
            limit = min(
                widest,
                int(table.max_tokens[slot]) - int(table.generated[slot]) - 1,
                self.context - 1 - consumed,
                widest if free else worthwhile_proposals(float(table.acceptance[slot]), widest),
            )
            proposals.append(propose(table.tokens[slot, : consumed + 1], limit) if limit > 0 else [])
        if not any(proposals):
            return None
        return self._lane_round(members, proposals)

    def _members_of(self, decode: list[RequestState]) -> _Members:
        """The members of history rounds and their constant columns (found again when the membership changed)."""
        table = self.table
        found = self._members
        if found is not None and found.membership == table.membership:
            return found
        rows = max(g.extents.batch_capacity for g in self.speculative)
        states = sorted(decode, key=lambda s: s.arrival)[:rows]
        slots = slot_array([s.slot for s in states])
        generations = frozen(table.generation[slots])
        columns = self.planner.member_columns(slots, generations)
        columns[ct.VALUE_SOURCE_CANDIDATE_GENERATION] = generations
        columns[ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT] = columns[ct.VALUE_SOURCE_MIXED_PREFILL_ROW]  # zeros
        found = self._members = _Members(
            number=next(self._numbers),
            membership=table.membership,
            states=states,
            request_ids=tuple(s.request_id for s in states),
            slots=slots,
            generations=generations,
            rows=columns,
            unchanged=frozenset(columns) | _CONSTANT_SOURCES,
            top=any(s.top for s in states),
            constrained=any(s.gate is not None and s.gate.constrained for s in states),
            cell_base=frozen(slots * table.page_starts.shape[1]),
        )
        return found

    def _batch_round(
        self,
        members: _Members,
        proposals: npt.NDArray[np.int64],
        counts: npt.NDArray[np.int64],
        consumed: npt.NDArray[np.signedinteger[Any]],
        generated: npt.NDArray[np.signedinteger[Any]],
    ) -> RoundPlan | None:
        """The round of ``members`` (none with a grammar) offering ``proposals`` as one batch, or None when
        the free pages cannot hold the positions of every pending token and proposal (the round is then
        planned lane by lane, which may preempt for a pending token and offers fewer proposals)."""
        table = self.table
        slots = members.slots
        if not self._allocate_positions(slots, consumed + counts):
            return None
        count = slots.shape[0]
        lengths = counts + 1
        lane_of = np.repeat(self._lanes[:count], lengths)
        within = self._positions[: lane_of.shape[0]] - (np.cumsum(lengths) - lengths)[lane_of]
        positions = consumed[lane_of] + within
        page, offset = np.divmod(positions, self.page_tokens)
        rows = dict(members.rows)
        rows[ct.VALUE_SOURCE_QUERY_LENGTH] = lengths
        rows[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT] = consumed
        rows[ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT] = consumed
        rows[ct.VALUE_SOURCE_SAMPLING_STEP] = generated
        rows[ct.VALUE_SOURCE_CANDIDATE_COUNT] = counts
        graph = self._graph_for(1 + int(counts.max()), count)
        fed = self._fed.get(graph.name)
        if fed is None:
            bound = {binding.source for binding in graph.contract.bindings}
            fed = self._fed[graph.name] = (
                ct.VALUE_SOURCE_OUTPUT_LIMIT in bound,
                ct.VALUE_SOURCE_PROMPT_TOKENS in bound or ct.VALUE_SOURCE_PENDING_TOKEN in bound,
            )
        if fed[0]:
            rows[ct.VALUE_SOURCE_OUTPUT_LIMIT] = table.max_tokens[slots] - generated
        tokens: dict[int, Column] = {
            ct.VALUE_SOURCE_PROMPT_POSITIONS: positions,
            ct.VALUE_SOURCE_CACHE_SLOT: table.page_starts.reshape(-1)[members.cell_base[lane_of] + page] + offset,
        }
        if fed[1]:  # host-fed tokens: each lane's pending token, then its proposals
            pending = table.token_cells[slots * table.tokens.shape[1] + consumed]
            ids = np.where(within == 0, pending[lane_of], proposals[lane_of, np.maximum(within - 1, 0)])
            tokens[ct.VALUE_SOURCE_PROMPT_TOKENS] = tokens[ct.VALUE_SOURCE_PENDING_TOKEN] = ids
        batch = LaneBatch(
            count=count,
            rows=rows,
            tokens=tokens,
            page_source=table.page_view,
            page_index=slots,
            page_counts=table.page_count[slots],
            staged_as=members.number,
            unchanged=members.unchanged,
            page_version=table.page_adds,
            candidates=proposals,
        )
        cursor = graph.contract.cursor
        expectations = SpeculativeExpectations(
            members.generations,
            consumed,
            True,
            offers=counts,
            cursor_lag=cursor.lag_tokens if cursor.reports_draft_cursor else -1,
        )
        return RoundPlan(graph, members.request_ids, slots, batch, expectations, False)

    def _graph_for(self, width: int, lanes: int) -> PreparedGraph:
        """The narrowest program, then the one of fewest rows, that holds ``lanes`` lanes of ``width``."""
        graph = self._graphs.get((width, lanes))
        if graph is None:
            graph = self._graphs[(width, lanes)] = next(
                g for g in self.speculative if g.extents.token_capacity >= width and g.extents.batch_capacity >= lanes
            )
        return graph

    def _allocate_positions(self, slots: npt.NDArray[np.int64], last: npt.NDArray[np.int64]) -> bool:
        """Pages for every position up to ``last`` of each of ``slots`` (each lane's pending token and
        proposals), from the free pages alone; False as soon as they run short (the pages taken so far
        stay with their lanes)."""
        table, allocator = self.table, self.residency.allocator
        page_tokens = self.page_tokens
        while True:
            short = np.flatnonzero(last // page_tokens >= table.page_count[slots])
            if not short.shape[0]:
                return True
            pages = allocator.allocate(short.shape[0]) if allocator.available() >= short.shape[0] else None
            if pages is None:
                return False
            table.add_page_each(slots[short], pages)

    def _lane_round(self, members: list[RequestState], proposals: list[list[int]]) -> RoundPlan | None:
        """The round of ``members`` offering ``proposals`` lane by lane: a member with a grammar offers the
        prefix of its proposals the grammar allows, with a mask a position; each lane's pending token takes
        a page (preempting younger requests when none is free) and a proposal without a free page is not
        offered."""
        from helios_core.runtime.planner import GateFault  # the planner imports this module

        table, residency = self.table, self.residency
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
        residency.starved = False  # this round's: set again when a member finds no page
        for state, candidates, along in zip(members, proposals, masks, strict=True):
            slot = state.slot
            if slot < 0 or table.phase_of(slot) != Phase.DECODE:
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
                lane = msgspec.structs.replace(lane, candidate_masks=along[: len(candidates) + 1])
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
            expectations = [msgspec.structs.replace(e, cursor_lag=cursor.lag_tokens) for e in expectations]
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
        residency.starved = False  # this round's: set again when a member finds no page
        for state in members:
            slot = state.slot
            if slot < 0 or table.phase_of(slot) != Phase.DECODE:
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
                msgspec.structs.replace(self.planner.lane(state, range(0), sample=True), prefix_limit=max(ceiling, 1))
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
            expectations = [msgspec.structs.replace(e, cursor_lag=cursor.lag_tokens) for e in expectations]
        return self.planner.lanes_plan(graph, kept, lanes, expectations)


FREE_VERIFIED_ROWS = 8
"""The most rows (lanes times their widths) a round verifies at about the cost of one: a batch-1 round of the
1B synthetic shape on an H200 replays in 1.17 ms at width 2 and 1.21 ms at width 8 (docs/benchmarks.md), as
a decode step streams the weights whatever the rows. A round within it offers every proposal found."""


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


def worthwhile_counts(acceptance: npt.NDArray[np.float64], widest: int) -> npt.NDArray[np.int64]:
    """:func:`worthwhile_proposals` of each of ``acceptance`` (rates in [0, 1]), at once: one more than the
    count of :func:`_worthwhile_thresholds` a rate reaches (they ascend, so a rate reaches a prefix)."""
    return np.searchsorted(_worthwhile_thresholds(widest), acceptance, side="right") + 1  # type: ignore[no-any-return]


@functools.cache
def _worthwhile_thresholds(widest: int) -> npt.NDArray[np.float64]:
    """For k = 2 .. ``widest``: the least rate ``a`` in [0, 1] with ``a ** k >= WORTHWHILE`` as Python
    computes the power (found by bisection over the rates' bit patterns, which order non-negative
    floats; a rate's power grows with the rate)."""
    one = _bits(1.0)
    thresholds = []
    for power in range(2, widest + 1):
        low, high = 0, one  # low fails, high holds
        while high - low > 1:
            middle = (low + high) // 2
            if _rate(middle) ** power >= WORTHWHILE:
                high = middle
            else:
                low = middle
        thresholds.append(_rate(high))
    if thresholds != sorted(thresholds):
        raise ArithmeticError(f"the worthwhile rates of 2 .. {widest} proposals do not ascend: {thresholds}")
    return frozen(np.asarray(thresholds, dtype=np.float64))  # type: ignore[no-any-return]


def _bits(rate: float) -> int:
    return int.from_bytes(struct.pack("<d", rate), "little")


def _rate(bits: int) -> float:
    return float(struct.unpack("<d", bits.to_bytes(8, "little"))[0])


def _copies_proposals(graph: PreparedGraph) -> bool:
    """Whether ``graph`` verifies host-copied proposals (binds CANDIDATE_IDS and an exact QUERY_LENGTH)."""
    sources = {binding.source for binding in graph.contract.bindings}
    return ct.VALUE_SOURCE_CANDIDATE_IDS in sources and ct.VALUE_SOURCE_QUERY_LENGTH in sources
