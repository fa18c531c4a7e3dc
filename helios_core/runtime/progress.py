"""Round completion: a validated round's results applied to the slot table, and the events they make.

Owns :class:`RoundCompletion`. :meth:`RoundCompletion.apply` takes the :class:`RoundPlan` that was
launched and its validated results (one :class:`LaneResult` or :class:`CompletionError` per lane) and
writes what the round did: consumed endpoints, appended tokens, phase changes, published pages,
finished, failed and preempted requests, and published prefix checkpoints (a checkpoint's SNAPSHOT
round is published only once its completion validated). It returns the events to publish, in order. A lane whose
request ended before the round's completion was read (a follow-up round's lane of a request that ended
in the round before) is suppressed; a failed lane fails only its request.

A decode plan is applied as columns: every lane advances one position and one token in a few
vectorized writes, and the lanes that complete a page, reach their output limit or sample an EOS id
are found over all lanes at once (for a cohort whose minima say none can, not at all). A decode round
whose every lane presents only its token's text (no failure, no timestamps, no top alternatives, no
host gate beyond a detokenizer) is published as one
:class:`~helios_core.runtime.messages.RoundTokens`; otherwise each lane gets its
:class:`~helios_core.runtime.messages.TokenEvent`.

A speculative plan of copied proposals (its expectations a
:class:`~helios_core.runtime.completion.SpeculativeExpectations`) is applied as columns too when no lane
failed or ended and no request has a host gate or observes time: the emitted tokens are appended up to
the first that ends a request (an EOS id, the output limit) in a few vectorized writes, the consumed
endpoints advance by the tokens kept, the pages they complete are published at the next deferred
publication (as decode's), and the tokens go out as one
:class:`~helios_core.runtime.messages.RoundTokens` per emitted position (the ``k``-th token of every
lane that kept at least ``k``), so each stream reads its tokens in order. Otherwise, and for every
other plan, lanes are applied one by one. Either way a page is hashed only once every token it holds is
in the slot's row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from helios_core.runtime.completion import (
    CompletionError,
    ExpectationBatch,
    LaneExpectation,
    LaneResult,
    LaneResults,
    SpeculativeExpectations,
    SpeculativeResults,
    as_results,
)
from helios_core.runtime.gates import gate_failure
from helios_core.runtime.messages import (
    Event,
    FinishReason,
    Outgoing,
    Piece,
    PromptScores,
    RoundTokens,
    TokenEvent,
)
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.residency import Residency
from helios_core.runtime.slots import Phase, RequestState
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct

_NONE: frozenset[int] = frozenset()
ACCEPTANCE_WEIGHT = 0.5
"""The weight of a request's earlier acceptance rate against its latest round's."""
_PER_LANE = 16
"""Decode rounds of at most this many lanes look EOS ids up lane by lane."""


@dataclass(eq=False, slots=True)
class _DecodeLanes:
    """What completing a decode cohort's rounds needs of its requests (found once per cohort)."""

    cohort: int
    membership: int
    """The table's membership count when found: while unchanged, no lane's request has ended."""
    states: list[RequestState]
    texts: list[Callable[[int], str]]
    """Per lane, the text a token completes (its gate's detokenizer; "" without a gate)."""
    lanes: dict[str, int]
    plain: bool
    gated: bool
    observe: bool
    some_constrained: bool
    all_constrained: bool
    token_base: npt.NDArray[np.int64]
    """Per lane, where its first generated token lies in the flat token matrix (slot row + prompt length)."""
    step: npt.NDArray[Any]
    """Ones in the dtype of the table's progress columns (``column + step`` advances every lane by one)."""
    eos_lanes: list[int]
    """The lanes whose requests end at an EOS id (those that do not ignore it)."""
    left: int = 0
    """Tokens the lane nearest its output limit may still generate (as of ``counted``)."""
    unpublished: int = 0
    """Positions until the first lane completes a page (as of ``counted``)."""
    counted: int = -1


@dataclass(eq=False, slots=True)
class _SpeculativeLanes:
    """What applying a speculative round's lanes as columns needs of its requests (found again when the
    round's slots or the table's membership differ from the last round's)."""

    slots: npt.NDArray[np.int64]
    membership: int
    states: list[RequestState]
    request_ids: list[str]
    lanes: dict[str, int]
    """Every lane's request and its index (the first emitted position's round tokens)."""
    columnar: bool
    """No request has a host gate or observes time."""
    ignore_eos: npt.NDArray[np.bool_] | None
    """Which lanes' requests ignore EOS ids (None: none does)."""
    token_base: npt.NDArray[np.int64]
    """Per lane, where its first generated token lies in the flat token matrix (slot row + prompt length)."""


class RoundCompletion:
    """Applies rounds; one per scheduler."""

    def __init__(
        self, residency: Residency, stats: SchedulerStats, eos_ids: frozenset[int], clock_origin_ns: int
    ) -> None:
        self.residency = residency
        self.table = residency.table
        self.stats = stats
        self.eos = eos_ids
        self._eos_ids = sorted(eos_ids)
        self.clock_origin_ns = clock_origin_ns
        self._operation_names: dict[int, str] = {}
        self._decode: _DecodeLanes | None = None
        self._speculative: _SpeculativeLanes | None = None

    def apply(self, plan: RoundPlan, results: Sequence[LaneResult | CompletionError]) -> list[Outgoing]:
        """Apply a validated round; returns the events to publish, in order."""
        graph = plan.graph
        label = self._operation_names.get(graph.operation)
        if label is None:
            label = self._operation_names[graph.operation] = graph.operation_name
        self.stats.count_round(graph.name, label, len(plan))
        events: list[Outgoing] = []
        if isinstance(plan.expectations, SpeculativeExpectations):
            if not isinstance(results, SpeculativeResults) or not self._apply_speculative_batch(
                plan, plan.expectations, results, events
            ):
                self._apply_lanes(plan, results, events)
        elif isinstance(plan.expectations, ExpectationBatch):
            self._apply_decode(plan, results if isinstance(results, LaneResults) else as_results(results), events)
        else:
            self._apply_lanes(plan, results, events)
        self.table.completions += 1
        return events

    def _state(self, slot: int, generation: int) -> RequestState | None:
        """The request of a plan's lane, unless it has ended (or left the slot) since the plan."""
        table = self.table
        if table.generation[slot] != generation or table.phase_of(slot) == Phase.ENDED:
            return None
        return table.requests[slot]

    def fail_lanes(self, plan: RoundPlan, failures: Mapping[int, str]) -> list[Event]:
        """Fail the requests of ``plan``'s lanes in ``failures`` (lane index: message) only. The round was
        not launched, so nothing of it applies: its other requests are planned again as they are."""
        events: list[Event] = []
        generations = _generations(plan)
        for index, slot in enumerate(plan.slots.tolist()):
            state = self._state(slot, generations[index]) if index in failures else None
            if state is not None:
                events.append(self.residency.fail(state, failures[index]))
        return events

    def fail_round(self, plan: RoundPlan, message: str) -> list[Event]:
        """The whole round failed: fail its requests only; nothing of the round is published."""
        return self.fail_lanes(plan, dict.fromkeys(range(len(plan)), message))

    # -- lane by lane --------------------------------------------------------------------------------
    def _apply_lanes(
        self, plan: RoundPlan, results: Sequence[LaneResult | CompletionError], events: list[Outgoing]
    ) -> None:
        table, residency = self.table, self.residency
        operation = plan.graph.operation
        expectations = plan.expectation_list()
        for slot, expectation, result in zip(plan.slots.tolist(), expectations, results, strict=True):
            state = self._state(slot, expectation.generation)
            if state is None:
                continue  # ended in the previous round: this lane's output is suppressed
            if isinstance(result, CompletionError):
                events.append(residency.fail(state, str(result)))
                continue
            if operation == ct.OPERATION_INITIALIZE:
                if residency.checkpoints is not None and residency.initialized(state):
                    continue  # the checkpoint of a prefix it shares is restored next
                # a prompt whose prefix up to a continued assistant message was reused resumes at once
                resumes = table.consumed[slot] >= table.target[slot]
                table.set_phase(slot, Phase.RESUME if resumes else Phase.PREFILL)
                continue
            if operation == ct.OPERATION_SNAPSHOT:
                if table.phase_of(slot) == Phase.CHECKPOINT:  # validated: published, and it prefills on
                    residency.publish_checkpoint(state)
                else:
                    residency.leave_after_snapshot(state)
                continue
            if operation == ct.OPERATION_RESTORE and state.restoring is not None:
                residency.restored_checkpoint(state)
                continue
            if operation == ct.OPERATION_RESTORE:
                residency.restored_snapshot(state)
                table.consumed[slot] = state.snapshot_endpoint
                table.set_phase(slot, self._after_restore(slot, state.snapshot_endpoint))
                continue
            if operation == ct.OPERATION_SPECULATIVE:
                self._apply_speculative(state, expectation, result, plan.graph.extents.token_capacity, events)
                continue
            table.consumed[slot] = expectation.consumed
            residency.publish_pages(slot)
            if operation == ct.OPERATION_SCORED_PREFILL and not state.scores_sent:
                state.scores.extend(result.scores)
                if expectation.consumed >= state.prompt_len:
                    state.scores_sent = True
                    events.append(PromptScores(state.request_id, state.scores[: state.prompt_len - 1]))
            if not expectation.samples:
                if table.phase_of(slot) == Phase.PREFILL and expectation.consumed >= table.target[slot]:
                    # the snapshot's prefix pages are computed, or prefill reached a continued assistant message
                    table.set_phase(slot, Phase.RESTORE if state.snapshot_row >= 0 else Phase.RESUME)
                elif residency.checkpoints is not None and table.phase_of(slot) == Phase.PREFILL:
                    residency.take_checkpoint(state)  # at a page boundary: its SNAPSHOT round comes next
                continue
            token = result.token_id
            stamp = time.monotonic_ns() - self.clock_origin_ns if state.observe else -1
            table.append(slot, token)
            if table.phase_of(slot) != Phase.DECODE:
                table.set_phase(slot, Phase.DECODE)  # the last prompt chunk sampled: the token is pending
            outcome = None
            if state.gate is not None:
                try:
                    outcome = state.gate.observe(token)
                except Exception as exc:  # the request's own grammar or stops: it fails alone
                    events.append(residency.fail(state, gate_failure(exc)))
                    continue
            pieces = tuple(outcome.pieces) if outcome is not None else ((token, ""),)
            events.append(TokenEvent(state.request_id, token, result.logprob, pieces, stamp, tuple(result.top)))
            if outcome is not None and outcome.stopped:
                residency.end(state)
                events.append(residency.finished(state, "stop", flush=False))
                continue
            if token in self.eos and not state.ignore_eos:
                residency.end(state)
                events.append(residency.finished(state, "stop"))
            elif table.generated[slot] >= state.max_tokens:
                residency.end(state)
                events.append(residency.finished(state, "length"))

    def _after_restore(self, slot: int, endpoint: int) -> Phase:
        """What a request restored at ``endpoint`` does next: decode when only its sampled pending token
        follows (the restore wrote it back), else compute its remaining known tokens with RESUME programs
        (with none selected, with prefill programs: the restored state rows are not initialized again)."""
        table = self.table
        length = table.length(slot)
        if table.generated[slot] > 0 and length == endpoint + 1:
            return Phase.DECODE
        if self.residency.resumable:
            return Phase.RESUME
        table.target[slot] = length
        return Phase.PREFILL

    def _apply_speculative(
        self,
        state: RequestState,
        expectation: LaneExpectation,
        result: LaneResult,
        width: int,
        events: list[Outgoing],
    ) -> None:
        """A speculative lane: each emitted token is appended and published in order until one ends the
        request (an EOS id, a host stop, the output limit) and the tokens after it are dropped; the pending
        token and the appended tokens before the last are committed, then the pages they complete are
        published (every committed position's token is in the row when its page is hashed)."""
        table, residency, slot = self.table, self.residency, state.slot
        tokens = result.tokens
        self.stats.count_speculation(width, result.offers, result.accepted, len(tokens))
        if result.offers:
            table.acceptance[slot] = ACCEPTANCE_WEIGHT * table.acceptance[slot] + (1 - ACCEPTANCE_WEIGHT) * (
                result.accepted / result.offers
            )
        stamp = time.monotonic_ns() - self.clock_origin_ns if state.observe else -1
        appended = 0
        ending: tuple[FinishReason, bool] | None = None
        """Why the request ends after the last appended token, and whether its gate is flushed."""
        failure: Exception | None = None
        for token, logprob in zip(tokens, result.logprobs, strict=True):
            table.append(slot, token)
            appended += 1
            outcome = None
            if state.gate is not None:
                try:
                    outcome = state.gate.observe(token)
                except Exception as exc:  # the request's own grammar or stops: it fails alone
                    failure = exc
                    break
            pieces = tuple(outcome.pieces) if outcome is not None else ((token, ""),)
            events.append(TokenEvent(state.request_id, token, logprob, pieces, stamp))
            if outcome is not None and outcome.stopped:
                ending = ("stop", False)
                break
            if token in self.eos and not state.ignore_eos:
                ending = ("stop", True)
                break
            if table.generated[slot] >= state.max_tokens:
                ending = ("length", True)
                break
        table.consumed[slot] = expectation.consumed + appended
        residency.publish_pages(slot)
        if failure is not None:
            events.append(residency.fail(state, gate_failure(failure)))
        elif ending is not None:
            residency.end(state)
            events.append(residency.finished(state, ending[0], flush=ending[1]))

    # -- speculative rounds as columns ---------------------------------------------------------------
    def _speculative_lanes(self, plan: RoundPlan, expected: SpeculativeExpectations) -> _SpeculativeLanes | None:
        """What applying ``plan``'s lanes as columns needs (kept while its slots and the table's membership
        stay the same: no request of its lanes ended meanwhile); None when some lane's request ended since
        the plan, or has left its slot."""
        found = self._speculative
        table = self.table
        slots = plan.slots
        if found is not None and found.slots is slots and found.membership == table.membership:
            return found
        if (table.generation[slots] != expected.generations).any() or (table.phase[slots] == Phase.ENDED).any():
            return None
        states = [table.requests[slot] for slot in slots.tolist()]
        members = [s for s in states if s is not None]
        if len(members) != len(states):
            return None
        request_ids = [s.request_id for s in members]
        found = self._speculative = _SpeculativeLanes(
            slots=slots,
            membership=table.membership,
            states=members,
            request_ids=request_ids,
            lanes={request_id: index for index, request_id in enumerate(request_ids)},
            columnar=all(s.gate is None and not s.observe for s in members),
            ignore_eos=table.ignore_eos[slots] if bool(table.ignore_eos[slots].any()) else None,
            token_base=slots * table.tokens.shape[1] + table.prompt_len[slots],
        )
        return found

    def _apply_speculative_batch(
        self,
        plan: RoundPlan,
        expectations: SpeculativeExpectations,
        results: SpeculativeResults,
        events: list[Outgoing],
    ) -> bool:
        """Apply a speculative round's lanes as columns, as :meth:`_apply_speculative` applies each; False
        (nothing applied) when some lane failed, its request ended since the plan, or a request has a
        host gate or observes time (the round is then applied lane by lane)."""
        if results.errors:
            return False
        lanes = self._speculative_lanes(plan, expectations)
        if lanes is None or not lanes.columnar:
            return False
        table, slots = self.table, plan.slots
        emitted, accepted, offers = results.emitted, results.accepted, results.offers
        self._count_speculation(plan.graph.extents.token_capacity, offers, accepted, emitted)
        offering = offers != 0
        rated = slots[offering]
        table.acceptance[rated] = ACCEPTANCE_WEIGHT * table.acceptance[rated] + (1 - ACCEPTANCE_WEIGHT) * (
            accepted[offering] / offers[offering]
        )
        # the tokens kept: up to the first that ends its request (the output limit, an EOS id)
        generated = table.generated[slots]
        left = table.max_tokens[slots] - generated
        kept = np.minimum(emitted, left)
        deepest = int(emitted.max())
        ids = results.ids[:, :deepest]
        columns = np.arange(deepest)
        shown = columns < kept[:, None]
        stops: npt.NDArray[np.bool_] | None = None
        if self.eos:
            hits = ids == self._eos_ids[0]
            for eos_id in self._eos_ids[1:]:
                hits |= ids == eos_id
            hits &= shown
            if lanes.ignore_eos is not None:
                hits &= ~lanes.ignore_eos[:, None]
            stopping = np.any(hits, axis=1)
            if stopping.any():
                stops = stopping
                kept = np.where(stops, hits.argmax(axis=1) + 1, kept)
                shown = columns < kept[:, None]
        ends = kept >= left
        if stops is not None:
            ends |= stops
        # committed: the pending token and the kept tokens before the last (all emitted ones but the last
        # when nothing ends), so every committed position's token is in the row when its page is hashed
        consumed = expectations.consumed + kept
        table.consumed[slots] = consumed
        table.token_cells[((lanes.token_base + generated)[:, None] + columns)[shown]] = ids[shown]
        table.generated[slots] = generated + kept
        publishing = (table.published[slots] + 1) * table.page_tokens <= consumed
        if publishing.any():
            for slot in slots[publishing].tolist():
                self.residency.defer_pages(slot)
        self._speculative_events(lanes, results, kept, deepest, events)
        if ends.any():
            residency = self.residency
            for index in np.flatnonzero(ends).tolist():
                state = lanes.states[index]
                residency.end(state)
                events.append(residency.finished(state, "stop" if stops is not None and stops[index] else "length"))
        return True

    def _speculative_events(
        self,
        lanes: _SpeculativeLanes,
        results: SpeculativeResults,
        kept: npt.NDArray[np.integer[Any]],
        deepest: int,
        events: list[Outgoing],
    ) -> None:
        """The kept tokens as one :class:`RoundTokens` per emitted position: the first of every lane (in lane
        order, the lanes' dict shared by the rounds of these lanes), then the ``k``-th of each lane that kept
        at least ``k``, lanes that kept more first."""
        ids, logprobs = results.ids, results.logprobs
        if logprobs is not None and logprobs.shape[1] < deepest:  # a lane emitting more ids reads 0.0 for each
            covered = logprobs.shape[1]
            padded = np.zeros((ids.shape[0], deepest), dtype=np.float64)
            fits = results.emitted <= covered
            padded[fits, :covered] = logprobs[fits]
            logprobs = padded
        firsts = ids[:, 0].tolist()
        events.append(
            RoundTokens(
                lanes.lanes, firsts, logprobs[:, 0].tolist() if logprobs is not None else [0.0] * len(firsts), None
            )
        )
        deep = int(kept.max())
        if deep < 2:
            return
        order = np.argsort(-kept, kind="stable")  # lanes that kept more first: each position's lanes lead
        reaching = np.cumsum(np.bincount(kept)[::-1])[::-1][2:].tolist()  # lanes that kept more than 1, 2, ...
        rows = order[: reaching[0]]
        by_position = ids[rows, 1:deep].T.tolist()
        values = logprobs[rows, 1:deep].T.tolist() if logprobs is not None else None
        named = list(map(lanes.request_ids.__getitem__, rows.tolist()))
        for position, count in enumerate(reaching):
            events.append(
                RoundTokens(
                    dict(zip(named[:count], range(count), strict=False)),
                    by_position[position][:count],
                    values[position][:count] if values is not None else [0.0] * count,
                    None,
                )
            )

    def _count_speculation(
        self,
        width: int,
        offers: npt.NDArray[np.integer[Any]],
        accepted: npt.NDArray[np.integer[Any]],
        emitted: npt.NDArray[np.integer[Any]],
    ) -> None:
        """:meth:`SchedulerStats.count_speculation` of every lane, counted at once."""
        stats = self.stats
        count = offers.shape[0]
        for counts, amount in (
            (stats.speculative_lanes, count),
            (stats.proposals_offered, int(offers.sum())),
            (stats.drafts_accepted, int(accepted.sum())),
            (stats.speculative_emitted, int(emitted.sum())),
        ):
            counts[width] = counts.get(width, 0) + amount
        for counts, reached in ((stats.offered_by_position, offers), (stats.accepted_by_position, accepted)):
            # lanes that reached each position (1 = the first proposal)
            for position, lanes in enumerate(np.cumsum(np.bincount(reached)[::-1])[-2::-1].tolist(), start=1):
                counts[position] = counts.get(position, 0) + lanes

    # -- decode rounds -------------------------------------------------------------------------------
    def _lanes_of(self, plan: RoundPlan) -> _DecodeLanes:
        found = self._decode
        if found is not None and found.cohort == plan.cohort:
            return found
        table = self.table
        states = [table.requests[slot] for slot in plan.slots.tolist()]
        members = [s for s in states if s is not None]
        if len(members) != len(states):
            raise RuntimeError("a decode round names a slot that no request holds")
        gates = [s.gate for s in members]
        constrained = [g is not None and g.constrained for g in gates]
        found = self._decode = _DecodeLanes(
            cohort=plan.cohort,
            membership=table.membership,
            states=members,
            texts=[_no_text if g is None else g.text for g in gates],
            lanes={s.request_id: index for index, s in enumerate(members)},
            plain=all(g is None or g.plain for g in gates),
            gated=any(g is not None for g in gates),
            observe=any(s.observe for s in members),
            some_constrained=any(constrained),
            all_constrained=all(constrained),
            token_base=plan.slots * table.tokens.shape[1] + table.prompt_len[plan.slots],
            step=np.ones(len(members), dtype=table.consumed.dtype),
            eos_lanes=[index for index, s in enumerate(members) if not s.ignore_eos],
        )
        return found

    def _apply_decode(self, plan: RoundPlan, results: LaneResults, events: list[Outgoing]) -> None:
        """Every lane advances by one position and one token; the cohort's minima say whether any lane
        completes a page or reaches its output limit this round, and only then are those lanes found."""
        table, residency = self.table, self.residency
        lanes = self._lanes_of(plan)
        if lanes.some_constrained and not lanes.all_constrained:
            self.stats.mixed_grammar_decode_steps += 1
        slots = plan.slots
        count = slots.shape[0]
        page_tokens = table.page_tokens
        if lanes.counted != table.completions:
            lanes.left = _least(table.max_tokens[slots] - table.generated[slots])
            lanes.unpublished = _least((table.published[slots] + 1) * page_tokens - table.consumed[slots])
            lanes.counted = table.completions
        token_ids, errors, tops = results.token_ids, results.errors, results.tops
        ids = results.ids
        token_column = ids if ids is not None and ids.dtype.kind in "iu" else np.asarray(token_ids, dtype=np.int64)
        # Every lane advances, the failed and suppressed ones too: their requests leave their slots, whose
        # values are written again when the slot is next held.
        generated = table.generated[slots]
        table.token_cells[lanes.token_base + generated] = token_column
        step = lanes.step  # adding an array of ones is cheaper than adding a Python int (same dtype)
        generated = generated + step
        table.generated[slots] = generated
        consumed = table.consumed[slots] + step
        table.consumed[slots] = consumed
        publishing: AbstractSet[int] = _NONE
        if lanes.unpublished <= 1:
            publishing = _where((table.published[slots] + 1) * page_tokens <= consumed)
        eos = self.eos
        ending = generated >= table.max_tokens[slots] if lanes.left <= 1 else None
        eos_per_lane = bool(eos) and (count <= _PER_LANE or ids is None or ids.dtype.kind not in "iu")
        if eos and not eos_per_lane and ids is not None:
            hit = ids == self._eos_ids[0]
            for eos_id in self._eos_ids[1:]:
                hit |= ids == eos_id
            if hit.any():
                hit &= ~table.ignore_eos[slots]
                ending = hit if ending is None else ending | hit
        finishing = _where(ending) if ending is not None else _NONE
        members = lanes.states
        skipped: set[int] = set()
        """Lanes that failed, or whose request ended before (their output is suppressed)."""
        gate_stops: list[int] = []
        check_ended = lanes.membership != table.membership  # else no request of the cohort has ended
        if lanes.plain and not errors and not check_ended and not tops and not lanes.observe:
            self._round_tokens(lanes, results, skipped, events)
        else:
            self._lane_events(lanes, results, check_ended, skipped, gate_stops, events)
        for index in sorted(publishing - skipped) if publishing else ():
            residency.defer_pages(int(slots[index]))
        ends = frozenset(finishing).union(gate_stops) if gate_stops else finishing
        if eos_per_lane and lanes.eos_lanes:
            hits = [index for index in lanes.eos_lanes if token_ids[index] in eos]
            if hits:
                ends = frozenset(ends).union(hits)
        for index in sorted(ends - skipped) if ends else ():
            state = members[index]
            residency.end(state)
            if gate_stops and index in gate_stops:
                events.append(residency.finished(state, "stop", flush=False))
            else:
                token = token_ids[index]
                events.append(residency.finished(state, "stop" if token in eos and not state.ignore_eos else "length"))
        lanes.left -= 1
        lanes.unpublished -= 1
        if publishing:
            lanes.unpublished = _least((table.published[slots] + 1) * page_tokens - consumed)
        lanes.counted = table.completions + 1

    def _round_tokens(
        self, lanes: _DecodeLanes, results: LaneResults, skipped: set[int], events: list[Outgoing]
    ) -> None:
        """The usual round: every lane presents its token's text and nothing else can happen per lane, so
        the round's tokens go out once, for every stream to read its own lane."""
        texts: list[str] | None = None
        broken: list[tuple[RequestState, Exception]] = []
        if lanes.gated:
            texts = []
            text_of = texts.append
            for state, token, text in zip(lanes.states, results.token_ids, lanes.texts, strict=True):
                try:
                    text_of(text(token))
                except Exception as exc:  # its detokenizer: the request fails alone, after this round
                    text_of("")
                    broken.append((state, exc))
        events.append(RoundTokens(lanes.lanes, results.token_ids, results.logprobs, texts))
        for state, error in broken:
            skipped.add(lanes.lanes[state.request_id])
            events.append(self.residency.fail(state, gate_failure(error)))

    def _lane_events(
        self,
        lanes: _DecodeLanes,
        results: LaneResults,
        check_ended: bool,
        skipped: set[int],
        gate_stops: list[int],
        events: list[Outgoing],
    ) -> None:
        """One event per lane, when some lane fails, was ended, observes time, reads top alternatives or
        has a gate that does more than detokenize: failed and suppressed lanes go to ``skipped``, lanes a
        host stop ended to ``gate_stops`` (their requests end after the round's pages are published)."""
        token_ids, logprobs, errors, tops = results.token_ids, results.logprobs, results.errors, results.tops
        origin, plain, observe = self.clock_origin_ns, lanes.plain, lanes.observe
        table = self.table
        for index, (state, text) in enumerate(zip(lanes.states, lanes.texts, strict=True)):
            if check_ended and (state.slot < 0 or table.phase_of(state.slot) == Phase.ENDED):
                skipped.add(index)
                continue
            if errors and index in errors:
                skipped.add(index)
                events.append(self.residency.fail(state, str(errors[index])))
                continue
            token = token_ids[index]
            stamp = time.monotonic_ns() - origin if observe and state.observe else -1
            gate = state.gate
            try:
                if gate is None or plain:
                    pieces: tuple[Piece, ...] = ((token, text(token)),)
                else:
                    outcome = gate.observe(token)
                    pieces = tuple(outcome.pieces)
                    if outcome.stopped:
                        gate_stops.append(index)
            except Exception as exc:  # the request's own grammar, stops or detokenizer: it fails alone
                skipped.add(index)
                events.append(self.residency.fail(state, gate_failure(exc)))
                continue
            events.append(
                TokenEvent(state.request_id, token, logprobs[index], pieces, stamp, tuple(tops.get(index, ())))
            )


def _generations(plan: RoundPlan) -> list[int]:
    expectations = plan.expectations
    if isinstance(expectations, ExpectationBatch):
        return expectations.generations.tolist()  # type: ignore[no-any-return]
    return [e.generation for e in expectations]


def _no_text(token: int) -> str:
    """The text of a token of a request without a gate: none here (its stream, or the client, detokenizes)."""
    return ""


def _where(mask: npt.NDArray[np.bool_]) -> AbstractSet[int]:
    """The lane indices where ``mask`` holds."""
    return frozenset(np.flatnonzero(mask).tolist()) if mask.any() else _NONE


def _least(values: npt.NDArray[np.signedinteger[Any]]) -> int:
    """The smallest of ``values`` (a large number for none)."""
    return int(values.min()) if values.shape[0] else 2**62
