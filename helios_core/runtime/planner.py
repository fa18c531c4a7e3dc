"""Round planning: from the slot table and the queues to one immutable :class:`RoundPlan`.

Owns the choice of the next round and its variant, and the decode cohort cache. :meth:`RoundPlanner.plan`
admits waiting requests while slots and pages allow (through the residency), then chooses, from the
phase of every running request:

1. a SNAPSHOT round of a request marked for preemption (its committed state is kept), else one of a
   prefilling request marked for a prefix checkpoint (it keeps its slot);
2. ``initialize`` for newly admitted requests (their sampling state rows);
3. a RESTORE round of a readmitted request whose snapshot's prefix pages are prefilled, or of an
   admitted request that shares a published checkpoint;
4. a RESUME round of the requests whose known tokens continue a restored snapshot (a request preempted
   while it prefilled or resumed) or a continued assistant message (the prompt's tail after the prefix
   prefill computed or reused), chunked FCFS within the largest RESUME extent; the last chunk samples;
5. otherwise chunked prefill within the largest prefill extent, FCFS, joined by every decode-ready
   request when a mixed program fits them (host-fed pending tokens). A request that asked for prompt
   logprobs prefills alone on the scored-prefill variants when it is first in line;
6. otherwise a speculative round when :class:`~helios_core.runtime.speculation.SpeculativePlanner`
   makes one (history proposals or in-graph drafts of the decode-ready requests), else one decode
   round of every decode-ready request (device-owned pending tokens, or host-owned ones fed from the
   slot table's token at each consumed endpoint),

each on the smallest captured variant that holds its lanes and tokens. A prompt's image spans are atomic:
a chunk never ends inside one, and a round carries images only on a variant that binds image sources and
whose patch and feature capacities hold them all (a mixed round whose variants cannot take the next image
gives way to a plain prefill round); a request first in line whose next chunk no prefill variant takes even
alone fails (:class:`RequestFault`) rather than holding up the line. A page shortage preempts the
most recently admitted requests (:meth:`~helios_core.runtime.residency.Residency.ensure_page`).

Decode rounds are planned from the per-slot columns alone: the decode cohort (the decode-ready requests,
oldest first, capped at the largest decode batch) keeps its per-request columns while the slot table's
membership count is unchanged, so a steady decode round gathers only positions, cache slots, sampling
steps and page counts. Its minima (tokens left, positions left in its pages) say without touching the
lanes whether a follow-up may be planned and whether a page is needed; :meth:`RoundPlanner.completed`
advances them when a round of the cohort is applied. :meth:`RoundPlanner.followup` plans the next decode
round of the same cohort before the previous one's completion is read (two frames in flight).

The planner changes residency (admission, pages, preemption marks) but never progress: consumed
endpoints, tokens and phases are written by completion only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedContract, PreparedGraph, Selection
from helios_core.runtime.completion import ExpectationBatch, LaneExpectation
from helios_core.runtime.gates import HostGate, gate_failure
from helios_core.runtime.messages import PromptImage
from helios_core.runtime.packing import Column, Lane, LaneBatch, LaneImage, token_array
from helios_core.runtime.plan import RoundPlan, frozen, slot_array
from helios_core.runtime.residency import Residency
from helios_core.runtime.slots import Phase, RequestState
from helios_core.runtime.speculation import SpeculativePlanner
from helios_core.runtime.stats import SchedulerStats
from helios_core.sampling import SAMPLING_PARAMETERS
from helios_core.wire import contract_pb2 as ct

_CONSTANT_TOKEN_SOURCES = frozenset(
    {
        ct.VALUE_SOURCE_TOKEN_ROW,
        ct.VALUE_SOURCE_PROMPT_TOKENS,
        ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS,
        ct.VALUE_SOURCE_PROMPT_HISTOGRAM,
    }
)
"""Sources a decode cohort's rounds supply alike: lane rows of tokens, no host tokens, no vectors."""


class RequestFault(Exception):
    """One request cannot go on, found while a round was planned: that request fails with ``message``, the
    round is planned again without it."""

    def __init__(self, state: RequestState, message: str) -> None:
        super().__init__(message)
        self.state = state
        self.message = message


class GateFault(RequestFault):
    """A request's host gate raised while a round was planned."""

    def __init__(self, state: RequestState, error: Exception) -> None:
        super().__init__(state, gate_failure(error))
        self.error = error


@dataclass(eq=False, slots=True)
class _Phases:
    """Which running requests are in which phase, as of the table's ``membership`` count."""

    membership: int
    leaving: RequestState | None
    checkpointing: RequestState | None
    fresh: list[RequestState]
    returning: RequestState | None
    resume: list[RequestState]
    prefill: list[RequestState]
    decode: list[RequestState]


@dataclass(eq=False, slots=True)
class _MixedDecode:
    """The decode lanes of a mixed round as columns, in lane order (each one token at its consumed endpoint,
    fed from the host)."""

    members: list[RequestState]
    slots: npt.NDArray[np.int64]
    consumed: npt.NDArray[np.int64]
    cache_slots: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    """The pending token at each consumed endpoint."""
    generations: npt.NDArray[np.int64]
    generated: npt.NDArray[np.int64]
    """Tokens each request has generated (its sampling step)."""
    limits: npt.NDArray[np.int64]
    """Output tokens each request may still generate."""
    masks: list[npt.NDArray[np.int32] | None]

    def expectations(self) -> list[LaneExpectation]:
        return [
            LaneExpectation(generation, at + 1, True, state.top)
            for state, generation, at in zip(
                self.members, self.generations.tolist(), self.consumed.tolist(), strict=True
            )
        ]


@dataclass(eq=False, slots=True)
class _PromptLanes:
    """A prefill or mixed round's lanes within one set of limits: its members in lane order (a mixed round's
    decode lanes first, as columns), the prompt lanes, every lane's expectation, the tokens, patches and
    features taken."""

    members: list[RequestState]
    decoding: _MixedDecode | None
    lanes: list[Lane]
    """The prompt lanes (after the decode lanes)."""
    expectations: list[LaneExpectation]
    used: int
    images: tuple[int, int]

    @property
    def decoding_count(self) -> int:
        return len(self.decoding.members) if self.decoding is not None else 0


@dataclass(eq=False, slots=True)
class _Cohort:
    """The requests of a decode round, oldest first, with their per-request columns (read-only)."""

    number: int
    """Unique per cohort formed: the ``staged_as`` of its plans' lanes."""
    membership: int
    """The table's membership count when formed (the cohort is current while it is unchanged)."""
    members: list[RequestState]
    request_ids: tuple[str, ...]
    slots: npt.NDArray[np.int64]
    graph: PreparedGraph | None
    rows: dict[int, Column]
    """Per-lane columns constant while the cohort lasts, by value source."""
    unchanged: frozenset[int]
    token_rows: npt.NDArray[np.int64]
    generations: npt.NDArray[np.int64]
    top: npt.NDArray[np.int64] | None
    constrained: bool
    blocked: bool
    """Some member cannot be followed up: a host gate that holds rounds, or a cancellation."""
    slot_set: frozenset[int]
    step: npt.NDArray[np.signedinteger[Any]]
    """Ones in the dtype of the table's progress columns: ``column + step`` is one position (or step) ahead."""
    cell_base: npt.NDArray[np.int64]
    """Each member's first cell in the flat page-start table (slot x page-table width)."""
    page_cells: npt.NDArray[np.int64]
    """The table's page starts as one flat view (a page's first cache slot at ``cell_base + page``)."""
    left: int = 0
    """Tokens the member nearest its output limit may still generate (as of ``counted``)."""
    room: int = 0
    """Positions the member nearest the end of its pages has left in them (as of ``pages_seen``)."""
    counted: int = -1
    pages_seen: int = -1
    limits: bool = False
    """Its graph binds ``OUTPUT_LIMIT``: each round stages what every member may still generate."""
    pending: bool = False
    """Its graph binds ``PENDING_TOKEN`` (a host-owned pending token): each round stages the token at
    every member's consumed endpoint, which only a completed round has written."""


class RoundPlanner:
    """Plans rounds; one per scheduler."""

    def __init__(
        self, contract: PreparedContract, selection: Selection, residency: Residency, stats: SchedulerStats
    ) -> None:
        self.residency = residency
        self.table = residency.table
        self.stats = stats
        self.page_tokens = contract.model.cache.page_tokens
        self.histogram_width = contract.histogram_width
        graphs = list(selection.graphs.values())
        self.initialize = _variants(graphs, ct.OPERATION_INITIALIZE)
        self.prefills = _variants(graphs, ct.OPERATION_PREFILL)
        self.mixed = _variants(graphs, ct.OPERATION_MIXED)
        self.decodes = _variants(graphs, ct.OPERATION_DECODE)
        self.scored = _variants(graphs, ct.OPERATION_SCORED_PREFILL)
        self.resumes = _variants(graphs, ct.OPERATION_RESUME)
        snapshots = _variants(graphs, ct.OPERATION_SNAPSHOT)
        restores = _variants(graphs, ct.OPERATION_RESTORE)
        self.snapshot = snapshots[0] if snapshots and restores else None
        self.restore = restores[0] if snapshots and restores else None
        self.context = contract.serving.context_tokens
        self.state_rows_per_request = selection.state_rows_per_request
        """State rows (and snapshot rows) per request: slot ``s`` owns rows ``s x this`` onwards."""
        self.pipelining = True
        """Launch a follow-up decode round before the previous round's completion is read (two frames)."""
        self._phases: _Phases | None = None
        self._cohort: _Cohort | None = None
        self._cohorts = itertools.count(1)
        self.speculation = SpeculativePlanner(self, graphs, selection)
        """Decides which decode rounds become speculative rounds (it reads the attributes above)."""

    # -- choosing the round --------------------------------------------------------------------------
    def plan(self) -> RoundPlan | None:
        """Admit what fits, then plan the next round (None when nothing runs); raises :class:`RequestFault`."""
        phases = self._phases_now()
        leaving = phases.leaving
        if leaving is not None and self.snapshot is not None:
            return self._state_copy(
                self.snapshot, leaving, leaving.snapshot_endpoint, snapshot_row=leaving.snapshot_row
            )
        checkpointing = phases.checkpointing
        if checkpointing is not None and self.snapshot is not None:  # before any round computes past it
            endpoint = int(self.table.consumed[checkpointing.slot])
            return self._state_copy(self.snapshot, checkpointing, endpoint, snapshot_row=checkpointing.checkpoint_row)
        self.residency.admit()
        phases = self._phases_now()
        if phases.fresh:
            return self._initialize_round(phases.fresh)
        returning = phases.returning
        if returning is not None and self.restore is not None:
            checkpoint = returning.restoring
            if checkpoint is not None:  # a shared prefix's checkpoint, into the rows `initialize` just set
                return self._state_copy(self.restore, returning, checkpoint.endpoint, restore_row=checkpoint.row)
            return self._state_copy(
                self.restore, returning, returning.snapshot_endpoint, restore_row=returning.snapshot_row
            )
        if phases.resume and self.resumes:
            return self._resume_round(phases.resume)
        prefill = phases.prefill
        if prefill and prefill[0].scoring:
            return self._scored_round(prefill[0])
        prefill = [s for s in prefill if not s.scoring]
        if prefill:
            return self._prefill_round(prefill, phases.decode)
        if phases.decode:
            speculative = self.speculation.plan(phases.decode)
            if speculative is not None:
                return speculative
            return self._decode_round(phases.decode)
        return None

    def _phases_now(self) -> _Phases:
        """The running requests by phase (found again only when the membership count changed)."""
        phases = self._phases
        membership = self.table.membership
        if phases is None or phases.membership != membership:
            running = self.residency.running
            of = self.table.phase.tolist()
            phases = self._phases = _Phases(
                membership,
                next((s for s in running if of[s.slot] == Phase.SNAPSHOT), None),
                next((s for s in running if of[s.slot] == Phase.CHECKPOINT), None),
                [s for s in running if of[s.slot] == Phase.INITIALIZE],
                next((s for s in running if of[s.slot] == Phase.RESTORE), None),
                [s for s in running if of[s.slot] == Phase.RESUME],
                [s for s in running if of[s.slot] == Phase.PREFILL],
                [s for s in running if of[s.slot] == Phase.DECODE],
            )
        return phases

    # -- lanes of one request -----------------------------------------------------------------------
    def _mask(self, state: RequestState, gate: HostGate) -> npt.NDArray[np.int32] | None:
        """``gate``'s mask for ``state``'s next token; a gate that raises is reported as a :class:`GateFault`."""
        try:
            return gate.mask()
        except Exception as exc:
            raise GateFault(state, exc) from exc

    def lane(
        self,
        state: RequestState,
        positions: range,
        *,
        sample: bool,
        histogram: bool = False,
        mixed_prefill: bool = False,
        score_targets: Sequence[int] = (),
        consumed: int | None = None,
        snapshot_row: int = -1,
        restore_row: int = -1,
        candidates: Sequence[int] = (),
    ) -> Lane:
        """``state``'s lane computing ``positions`` (host-fed: their tokens are the slot's tokens there;
        a speculative lane's are its pending token and ``candidates``)."""
        table, slot = self.table, state.slot
        gate = state.gate
        per_request = self.state_rows_per_request
        images: list[LaneImage] = []
        if candidates:
            tokens = [*table.token_list(slot, positions.start, positions.start + 1), *candidates]
        else:
            tokens = table.token_list(slot, positions.start, positions.stop) if positions else []
            if positions and state.request.images:  # the images whose spans this chunk computes
                images = [
                    LaneImage.of(image, positions.start)
                    for image in state.request.images
                    if positions.start <= image.start and image.end <= positions.stop
                ]
        return Lane(
            slot=slot,
            generation=int(table.generation[slot]),
            state_row=slot * per_request,
            positions=positions,
            cache_slots=table.cache_slots(slot, positions),
            page_table=table.page_list(slot),
            tokens=tokens,
            sample=sample,
            sampling=state.sampling,
            sampling_step=int(table.generated[slot]),
            grammar_mask=self._mask(state, gate) if sample and gate is not None else None,
            score_targets=score_targets,
            prompt_histogram=self._histogram(slot, table.length(slot)) if histogram else None,
            consumed=int(table.consumed[slot]) if consumed is None else consumed,
            output_limit=int(table.max_tokens[slot]) - int(table.generated[slot]),
            mixed_prefill=mixed_prefill,
            snapshot_row=snapshot_row * per_request if snapshot_row >= 0 else -1,
            restore_row=restore_row * per_request if restore_row >= 0 else -1,
            candidates=candidates,
            images=images,
        )

    def _histogram(self, slot: int, known: int) -> npt.NDArray[np.uint8]:
        """The presence histogram ``initialize`` writes: the prompt's ids and, for a request recomputed after
        preemption, the ids it generated before (the repetition penalty reads presence in the prompt or the
        output; the output counts themselves start at zero again)."""
        return prompt_histogram(self.table.tokens[slot, :known], self.histogram_width)

    def _expect(
        self, state: RequestState, consumed: int, samples: bool, scores: tuple[int, int] = (0, 0)
    ) -> LaneExpectation:
        generation = int(self.table.generation[state.slot])
        return LaneExpectation(generation, consumed, samples, state.top if samples else 0, scores)

    def lanes_plan(
        self,
        graph: PreparedGraph,
        members: Sequence[RequestState],
        lanes: list[Lane],
        expectations: list[LaneExpectation],
    ) -> RoundPlan:
        constrained = any(
            lane.sample and state.gate is not None and state.gate.constrained
            for state, lane in zip(members, lanes, strict=True)
        )
        return RoundPlan(
            graph,
            tuple(s.request_id for s in members),
            slot_array([s.slot for s in members]),
            tuple(lanes),
            tuple(expectations),
            constrained,
        )

    # -- round kinds ---------------------------------------------------------------------------------
    def _state_copy(
        self, graph: PreparedGraph, state: RequestState, endpoint: int, *, snapshot_row: int = -1, restore_row: int = -1
    ) -> RoundPlan:
        """A SNAPSHOT or RESTORE round of one request at its exact ``endpoint``."""
        lane = self.lane(
            state, range(0), sample=False, consumed=endpoint, snapshot_row=snapshot_row, restore_row=restore_row
        )
        return self.lanes_plan(graph, [state], [lane], [self._expect(state, endpoint, False)])

    def _initialize_round(self, fresh: list[RequestState]) -> RoundPlan:
        graph = _smallest(self.initialize, rows=1)
        members = fresh[: graph.extents.batch_capacity]
        lanes = [self.lane(s, range(0), sample=False, histogram=True) for s in members]
        expectations = [self._expect(s, int(self.table.consumed[s.slot]), False) for s in members]
        return self.lanes_plan(graph, members, lanes, expectations)

    def _prefill_round(self, prefill: list[RequestState], decode: list[RequestState]) -> RoundPlan:
        mixed = bool(decode) and bool(self.mixed)
        plan, computed = self._prefill_plan(prefill, decode, mixed)
        if mixed and not computed:
            # The mixed programs cannot take the next prefill chunk (an image span they bind no image
            # sources for, or one beyond their capacities): a plain prefill round computes it, and the
            # decode-ready requests join the next mixed round.
            plain, computed = self._prefill_plan(prefill, decode, False)
            if computed:
                return plain
        if not computed:
            self._check_head_progress(prefill)
        return plan

    def _check_head_progress(self, prefill: list[RequestState]) -> None:
        """Raise a :class:`RequestFault` for the first request in line when no prefill variant could take its
        next chunk even alone (nothing left to prefill, or an image span it starts inside or that no variant
        holds): it would wait forever, and every request behind it with it."""
        table = self.table
        head = next((s for s in prefill if s.slot >= 0 and table.phase_of(s.slot) == Phase.PREFILL), None)
        if head is None:
            return
        consumed, target = int(table.consumed[head.slot]), int(table.target[head.slot])
        for limits in _targets(self.prefills):
            chunk = min(target - consumed, limits.tokens)
            if head.request.images:
                chunk, _, _ = _image_chunk(head.request.images, consumed, chunk, limits.patches, limits.features)
            if chunk > 0:
                return
        raise RequestFault(
            head,
            f"the prompt's prefill cannot continue from position {consumed} towards {target}: no captured "
            "prefill variant takes its next chunk",
        )

    def _prefill_plan(
        self, prefill: list[RequestState], decode: list[RequestState], mixed: bool
    ) -> tuple[RoundPlan, bool]:
        """The prefill (``mixed``: mixed) round of ``prefill``'s chunks on the smallest variant that holds its
        rows, tokens and image patches and features, and whether it computes any prompt token. The limits
        tried: the variants' largest extents, then each variant that takes images on its own (a round
        with images needs a single variant holding all of them)."""
        variants = self.mixed if mixed else self.prefills
        fallback: tuple[RoundPlan, bool] | None = None
        for limits in _targets(variants):
            prompt = self._prefill_lanes(prefill, decode, mixed, limits)
            patches, features = prompt.images
            graph = _fitting(variants, rows=len(prompt.members), tokens=prompt.used, patches=patches, features=features)
            if graph is None:
                continue
            computed = prompt.used > prompt.decoding_count
            result = (self._prompt_plan(graph, prompt), computed)
            if computed:
                return result
            fallback = fallback or result
        if fallback is None:
            raise RuntimeError("no captured variant holds the round's rows, tokens and images")
        return fallback

    def _prefill_lanes(
        self, prefill: list[RequestState], decode: list[RequestState], mixed: bool, limits: _Limits
    ) -> _PromptLanes:
        """The lanes of a prefill round within ``limits``: with ``mixed``, every decode-ready request's
        pending token first, then prefill chunks FCFS (each cut before an image span it would split or whose
        image no longer fits); with the tokens, patches and features they take."""
        table, residency = self.table, self.residency
        budget, rows = limits.tokens, limits.rows
        lanes: list[Lane] = []
        taken: set[int] = set()
        decoding = self._mixed_decode(decode[: max(rows - 1, 0)], budget - 1, taken) if mixed else None
        members = list(decoding.members) if decoding is not None else []
        expectations = decoding.expectations() if decoding is not None else []
        used = len(members)
        patches = features = 0
        for state in prefill:
            if state.slot < 0 or table.phase_of(state.slot) != Phase.PREFILL:
                continue  # preempted (or marked for a snapshot) to make room for a decode lane above
            if len(members) >= rows or used >= budget:
                break
            slot = state.slot
            consumed = int(table.consumed[slot])
            chunk = min(int(table.target[slot]) - consumed, budget - used)
            if residency.checkpoints is not None:  # a chunk ends where the prompt's deepest checkpoint goes
                chunk = residency.checkpoint_chunk(state, consumed, chunk)
            images = state.request.images
            if images:
                chunk, more_patches, more_features = _image_chunk(
                    images, consumed, chunk, limits.patches - patches, limits.features - features
                )
                if chunk <= 0:
                    break  # its next image waits for a round with room for it (FCFS)
                patches, features = patches + more_patches, features + more_features
            last = state.snapshot_row < 0 and consumed + chunk == table.length(slot)
            # MIXED_PREFILL_ROW: 1 on the prefill rows of a mixed round
            lanes.append(self.lane(state, range(consumed, consumed + chunk), sample=last, mixed_prefill=mixed))
            members.append(state)
            expectations.append(self._expect(state, consumed + chunk, last))
            used += chunk
        return _PromptLanes(members, decoding, lanes, expectations, used, (patches, features))

    def _prompt_plan(self, graph: PreparedGraph, prompt: _PromptLanes) -> RoundPlan:
        """The round of ``prompt``'s lanes on ``graph``. A mixed round without images is one :class:`LaneBatch`
        (its decode lanes' columns, then its prompt lanes'); with images (which a batch does not carry) or
        without decode lanes, its lanes are :class:`Lane` objects."""
        decoding = prompt.decoding
        if decoding is None or not decoding.members:
            return self.lanes_plan(graph, prompt.members, prompt.lanes, prompt.expectations)
        if any(lane.images for lane in prompt.lanes):
            lanes = [*self._decode_lane_objects(decoding), *prompt.lanes]
            return self.lanes_plan(graph, prompt.members, lanes, prompt.expectations)
        batch = self._mixed_batch(decoding, prompt.lanes)
        samples = [*(True for _ in decoding.members), *(lane.sample for lane in prompt.lanes)]
        constrained = any(
            sample and state.gate is not None and state.gate.constrained
            for state, sample in zip(prompt.members, samples, strict=True)
        )
        return RoundPlan(
            graph,
            tuple(s.request_id for s in prompt.members),
            batch.page_index,
            batch,
            tuple(prompt.expectations),
            constrained,
        )

    def _mixed_batch(self, decoding: _MixedDecode, prompt: list[Lane]) -> LaneBatch:
        """A mixed round's lanes as columns: ``decoding``'s one-token lanes, then the ``prompt`` lanes, with the
        values their :class:`Lane` objects would stage (their sampling values, like a decode cohort's, read
        from the slot table's columns)."""
        table = self.table
        count = len(decoding.members) + len(prompt)

        def joined(column: npt.NDArray[np.int64], values: Iterable[int]) -> npt.NDArray[np.int64]:
            result: npt.NDArray[np.int64] = np.concatenate(
                (column, np.fromiter(values, dtype=np.int64, count=len(prompt)))
            )
            return frozen(result)  # type: ignore[no-any-return]

        slots = joined(decoding.slots, (lane.slot for lane in prompt))
        generations = joined(decoding.generations, (lane.generation for lane in prompt))
        consumed = joined(decoding.consumed, (lane.consumed for lane in prompt))
        masks = [*decoding.masks, *(lane.grammar_mask for lane in prompt)]
        ones, zeros = np.ones(len(decoding.members), dtype=np.int64), np.zeros(len(decoding.members), dtype=np.int64)
        rows = self.member_columns(slots, generations)
        rows[ct.VALUE_SOURCE_QUERY_LENGTH] = joined(ones, (len(lane.positions) for lane in prompt))
        rows[ct.VALUE_SOURCE_SAMPLING_DECISION] = joined(ones, (int(lane.sample) for lane in prompt))
        rows[ct.VALUE_SOURCE_MIXED_PREFILL_ROW] = joined(zeros, (int(lane.mixed_prefill) for lane in prompt))
        rows[ct.VALUE_SOURCE_CONSTRAINED] = frozen(
            np.fromiter((mask is not None for mask in masks), dtype=np.int64, count=count)
        )
        rows[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT] = consumed
        rows[ct.VALUE_SOURCE_SAMPLING_STEP] = joined(decoding.generated, (lane.sampling_step for lane in prompt))
        rows[ct.VALUE_SOURCE_OUTPUT_LIMIT] = joined(decoding.limits, (lane.output_limit for lane in prompt))
        rows[ct.VALUE_SOURCE_CANDIDATE_GENERATION] = generations
        rows[ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT] = consumed
        rows[ct.VALUE_SOURCE_CANDIDATE_COUNT] = rows[ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT] = frozen(
            np.zeros(count, dtype=np.int64)
        )
        pieces = [token_array(lane.positions) for lane in prompt]
        fed = frozen(np.concatenate((decoding.tokens, *(token_array(lane.tokens) for lane in prompt))))
        tokens: dict[int, Column] = {
            ct.VALUE_SOURCE_PROMPT_POSITIONS: frozen(np.concatenate((decoding.consumed, *pieces))),
            ct.VALUE_SOURCE_CACHE_SLOT: frozen(
                np.concatenate((decoding.cache_slots, *(token_array(lane.cache_slots) for lane in prompt)))
            ),
            ct.VALUE_SOURCE_PROMPT_TOKENS: fed,
            ct.VALUE_SOURCE_PENDING_TOKEN: fed,
        }
        return LaneBatch(
            count=count,
            rows=rows,
            tokens=tokens,
            page_source=table.page_view,
            page_index=slots,
            page_counts=frozen(table.page_count[slots]),
            grammar_masks=tuple(masks) if any(mask is not None for mask in masks) else None,
        )

    def _mixed_decode(self, decode: list[RequestState], limit: int, taken: set[int]) -> _MixedDecode:
        """The one-token lanes of the requests of ``decode`` still decoding, in order, up to ``limit`` of them,
        each feeding its completed pending token from the host; a request that cannot have the page of its
        position ends the list (the residency is marked starved). Read from the slot table as columns once
        their pages are held: a mixed round carries every decoding request."""
        table, residency = self.table, self.residency
        members: list[RequestState] = decode[: max(limit, 0)]
        slots = slot_array([s.slot for s in members])
        if slots.shape[0] and (
            int(slots.min()) < 0
            or not bool((table.phase[slots] == Phase.DECODE).all())
            or not bool((table.consumed[slots] // self.page_tokens < table.page_count[slots]).all())
        ):  # some request is no longer decoding, or needs a page first: request by request
            members = []
            for state in decode:
                if len(members) >= limit:
                    break
                slot = state.slot
                if slot < 0 or table.phase_of(slot) != Phase.DECODE:
                    continue  # preempted, or marked for a snapshot, while an earlier lane took a page
                if not residency.ensure_page(state, exclude=taken):
                    residency.starved = True
                    break
                members.append(state)
                taken.add(slot)
            slots = slot_array([s.slot for s in members])
        else:
            taken.update(slots.tolist())
        consumed = frozen(table.consumed[slots].astype(np.int64))
        page, offset = np.divmod(consumed, self.page_tokens)
        generated = table.generated[slots].astype(np.int64)
        return _MixedDecode(
            members=members,
            slots=slots,
            consumed=consumed,
            cache_slots=frozen(table.page_starts[slots, page] + offset),
            tokens=frozen(table.tokens[slots, consumed].astype(np.int64)),
            generations=frozen(table.generation[slots].astype(np.int64)),
            generated=frozen(generated),
            limits=frozen(table.max_tokens[slots].astype(np.int64) - generated),
            masks=[self._mask(s, s.gate) if s.gate is not None else None for s in members],
        )

    def _decode_lane_objects(self, decoding: _MixedDecode) -> list[Lane]:
        """``decoding``'s lanes as :class:`Lane` objects (a mixed round with images, which a batch cannot
        carry): each built by :meth:`lane`, with the grammar mask the columns already hold."""
        return [
            msgspec.structs.replace(self.lane(state, range(at, at + 1), sample=False), sample=True, grammar_mask=mask)
            for state, at, mask in zip(decoding.members, decoding.consumed.tolist(), decoding.masks, strict=True)
        ]

    def _resume_round(self, resume: list[RequestState]) -> RoundPlan:
        """Chunks of the known tokens of resuming requests (FCFS, within the largest RESUME extent): the
        tokens after a restored snapshot, or a continued assistant message. A lane whose chunk ends the
        request's tokens samples; its pages were allocated at admission."""
        table = self.table
        fallback: RoundPlan | None = None
        for limits in _targets(self.resumes):
            members: list[RequestState] = []
            lanes: list[Lane] = []
            expectations: list[LaneExpectation] = []
            used = patches = features = 0
            for state in resume:
                if len(members) >= limits.rows or used >= limits.tokens:
                    break
                slot = state.slot
                consumed, length = int(table.consumed[slot]), table.length(slot)
                chunk = min(length - consumed, limits.tokens - used)
                if state.request.images:
                    chunk, more_patches, more_features = _image_chunk(
                        state.request.images, consumed, chunk, limits.patches - patches, limits.features - features
                    )
                    if chunk <= 0:
                        break
                    patches, features = patches + more_patches, features + more_features
                last = consumed + chunk == length
                lanes.append(self.lane(state, range(consumed, consumed + chunk), sample=last))
                members.append(state)
                expectations.append(self._expect(state, consumed + chunk, last))
                used += chunk
            graph = _fitting(self.resumes, rows=len(lanes), tokens=used, patches=patches, features=features)
            if graph is not None:
                plan = self.lanes_plan(graph, members, lanes, expectations)
                if used:
                    return plan
                fallback = fallback or plan
        if fallback is None:
            raise RuntimeError("no captured resume variant holds the round's rows, tokens and images")
        return fallback

    def _scored_round(self, state: RequestState) -> RoundPlan:
        """One prefill chunk of a prompt-logprobs request, alone, on the smallest scored variant that fits.

        Each packed token's score target is the next prompt token; the last prompt token has none (-1).
        """
        table, slot = self.table, state.slot
        consumed, length = int(table.consumed[slot]), table.length(slot)
        for limits in _targets(self.scored):
            chunk = min(length - consumed, limits.tokens)
            patches = features = 0
            if state.request.images:  # admission made sure each image fits a scored variant that takes images
                chunk, patches, features = _image_chunk(
                    state.request.images, consumed, chunk, limits.patches, limits.features
                )
            graph = _fitting(self.scored, rows=1, tokens=chunk, patches=patches, features=features)
            if chunk > 0 and graph is not None:
                break
        else:
            raise RuntimeError("no captured scored variant holds the request's next chunk and its images")
        last = consumed + chunk == length
        positions = range(consumed, consumed + chunk)
        following = table.token_list(slot, consumed + 1, min(consumed + chunk + 1, state.prompt_len))
        targets = [following[p - consumed] if p + 1 < state.prompt_len else -1 for p in positions]
        lane = self.lane(state, positions, sample=last, score_targets=targets)
        expectation = self._expect(state, consumed + chunk, last, scores=(0, chunk))
        return self.lanes_plan(graph, [state], [lane], [expectation])

    # -- decode rounds -------------------------------------------------------------------------------
    def _decode_round(self, decode: list[RequestState]) -> RoundPlan | None:
        table, residency = self.table, self.residency
        cohort = self._cohort
        if cohort is None or cohort.membership != table.membership:
            rows = max(g.extents.batch_capacity for g in self.decodes)
            cohort = self._cohort = self._make_cohort(sorted(decode, key=lambda s: s.arrival)[:rows])
        if self._count(cohort).room <= 0:
            # A member needs the page of its next position: take pages (or preempt) request by request.
            members: list[RequestState] = []
            taken: set[int] = set()
            page_tokens = self.page_tokens
            served = True
            for state in cohort.members:
                slot = state.slot
                if slot < 0 or table.phase_of(slot) != Phase.DECODE:
                    continue  # preempted while an earlier member took a page
                if table.consumed[slot] // page_tokens < table.page_count[slot] or residency.ensure_page(
                    state, exclude=taken
                ):
                    members.append(state)
                    taken.add(slot)
                else:
                    served = False
            residency.starved = not served
            if len(members) != len(cohort.members) or cohort.membership != table.membership:
                cohort = self._make_cohort(members)  # this round's only: the full cohort is tried again next
        else:
            residency.starved = False
        if not cohort.members:
            return None
        return self._decode_plan(cohort, ahead=0)

    def member_columns(self, slots: npt.NDArray[np.int64], generations: Column) -> dict[int, Column]:
        """The per-request columns that every round of the requests in ``slots`` (lane order) stages alike,
        decode cohorts' and history rounds': slots, state rows, generations, sampling values, and the
        constants of a lane that samples (a decision, no prefill row, no state copy, no grammar)."""
        table = self.table
        count = slots.shape[0]
        zeros = frozen(np.zeros(count, dtype=np.int64))
        unset = frozen(np.full(count, -1, dtype=np.int64))
        per_request = self.state_rows_per_request
        rows: dict[int, Column] = {
            ct.VALUE_SOURCE_SLOT: slots,
            ct.VALUE_SOURCE_LIVE_STATE_ROWS: slots if per_request == 1 else frozen(slots * per_request),
            ct.VALUE_SOURCE_GENERATION: generations,
            ct.VALUE_SOURCE_SAMPLING_DECISION: frozen(np.ones(count, dtype=np.int64)),
            ct.VALUE_SOURCE_MIXED_PREFILL_ROW: zeros,
            ct.VALUE_SOURCE_RESTORE_SOURCE: unset,
            ct.VALUE_SOURCE_SNAPSHOT_DESTINATION: unset,
            ct.VALUE_SOURCE_CONSTRAINED: zeros,
        }
        for parameter in SAMPLING_PARAMETERS:
            rows[parameter.source] = frozen(table.sampling[parameter.source][slots])
        return rows

    def _make_cohort(self, members: list[RequestState]) -> _Cohort:
        """The per-request columns of a decode round's members (``members`` in lane order)."""
        table = self.table
        count = len(members)
        slots = slot_array([s.slot for s in members])
        gates = [s.gate for s in members]
        constrained = any(g is not None and g.constrained for g in gates)
        generations = frozen(table.generation[slots])
        rows = self.member_columns(slots, generations)
        rows[ct.VALUE_SOURCE_QUERY_LENGTH] = rows[ct.VALUE_SOURCE_SAMPLING_DECISION]  # one token each, sampled
        unchanged = frozenset(rows) | _CONSTANT_TOKEN_SOURCES
        if constrained:  # masks (and whether a lane has one) are read each round
            unchanged -= {ct.VALUE_SOURCE_CONSTRAINED}
        else:
            unchanged |= {ct.VALUE_SOURCE_GRAMMAR_MASK}
        tops = [s.top for s in members]
        graph = _smallest(self.decodes, rows=count) if members else None
        bound = {b.source for b in graph.contract.bindings} if graph is not None else set()
        return _Cohort(
            number=next(self._cohorts),
            membership=table.membership,
            members=members,
            request_ids=tuple(s.request_id for s in members),
            slots=slots,
            graph=graph,
            rows=rows,
            unchanged=unchanged,
            token_rows=frozen(np.arange(count, dtype=np.int64)),
            generations=generations,
            top=frozen(np.asarray(tops, dtype=np.int64)) if any(tops) else None,
            constrained=constrained,
            blocked=any(s.cancelled or s.holds_rounds for s in members),
            slot_set=frozenset(s.slot for s in members),
            step=frozen(np.ones(count, dtype=table.consumed.dtype)),
            cell_base=frozen(slots * table.page_starts.shape[1]),
            page_cells=table.page_starts.reshape(-1),
            limits=ct.VALUE_SOURCE_OUTPUT_LIMIT in bound,
            pending=ct.VALUE_SOURCE_PENDING_TOKEN in bound,
        )

    def _count(self, cohort: _Cohort) -> _Cohort:
        """``cohort`` with its minima current: counted again from the slot table when a round that
        :meth:`completed` did not account for was applied since (or, for ``room``, pages were added)."""
        table, slots = self.table, cohort.slots
        if cohort.counted != table.completions:
            cohort.left = _least(table.max_tokens[slots] - table.generated[slots])
            cohort.pages_seen = -1
            cohort.counted = table.completions
        if cohort.pages_seen != table.page_adds:
            cohort.room = _least(table.page_count[slots] * self.page_tokens - table.consumed[slots])
            cohort.pages_seen = table.page_adds
        return cohort

    def completed(self, plan: RoundPlan) -> None:
        """``plan`` was applied: a decode round of the current cohort advanced every member by one."""
        cohort = self._cohort
        if cohort is not None and plan.cohort == cohort.number and cohort.counted == self.table.completions - 1:
            cohort.left -= 1
            cohort.room -= 1
            cohort.counted = self.table.completions

    def _decode_plan(self, cohort: _Cohort, *, ahead: int) -> RoundPlan:
        """A decode round of ``cohort``, one position (and sampling step) past the consumed endpoint when
        ``ahead`` is 1 (a follow-up planned before the previous round's completion is read)."""
        table = self.table
        slots = cohort.slots
        step = cohort.step
        # Fancy indexing makes fresh arrays (the plan's own; the cohort's columns are frozen), so a round
        # at the consumed endpoint adds nothing; adding the cohort's ones array is cheaper than adding a
        # Python int, and keeps the progress columns' dtype.
        positions = table.consumed[slots]
        sampling_steps = table.generated[slots]
        if ahead:
            positions = positions + step
            sampling_steps = sampling_steps + step
        page, offset = np.divmod(positions, self.page_tokens)
        rows = dict(cohort.rows)
        rows[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT] = positions
        rows[ct.VALUE_SOURCE_SAMPLING_STEP] = sampling_steps
        if cohort.limits:
            rows[ct.VALUE_SOURCE_OUTPUT_LIMIT] = table.max_tokens[slots] - sampling_steps
        tokens: dict[int, Column] = {
            ct.VALUE_SOURCE_PROMPT_POSITIONS: positions,
            ct.VALUE_SOURCE_CACHE_SLOT: cohort.page_cells[cohort.cell_base + page] + offset,
            ct.VALUE_SOURCE_TOKEN_ROW: cohort.token_rows,
        }
        if cohort.pending:  # the completed pending token: planned at the consumed endpoint only (never ahead)
            tokens[ct.VALUE_SOURCE_PENDING_TOKEN] = table.token_cells[slots * table.tokens.shape[1] + positions]
        masks = None
        if cohort.constrained:
            masks = tuple(self._mask(s, s.gate) if s.gate is not None else None for s in cohort.members)
            rows[ct.VALUE_SOURCE_CONSTRAINED] = np.fromiter(
                (mask is not None for mask in masks), dtype=np.int64, count=len(masks)
            )
        batch = LaneBatch(
            count=len(slots),
            rows=rows,
            tokens=tokens,
            page_source=table.page_view,
            page_index=slots,
            page_counts=table.page_count[slots],
            grammar_masks=masks,
            staged_as=cohort.number,
            unchanged=cohort.unchanged,
            page_version=table.page_adds,
        )
        expected = ExpectationBatch(cohort.generations, positions + step, True, cohort.top)
        graph = cohort.graph
        if graph is None:
            raise RuntimeError("a decode round was planned for a cohort without members")
        return RoundPlan(
            graph,
            cohort.request_ids,
            slots,
            batch,
            expected,
            cohort.constrained,
            cohort=cohort.number,
            ahead=ahead,
        )

    def followup(self, plan: RoundPlan) -> RoundPlan | None:
        """The next decode round of the same cohort, planned before ``plan``'s completion is read.

        Only when nothing needs completion feedback: a decode round of the current cohort whose requests
        have no host gates that hold rounds, no cancellation, at least two tokens left, no admission
        waiting to change phase, and pages for the next position, whose graph has no completion
        dependencies (a host-owned pending token: the host feeds the token the previous round samples),
        and no speculation (a speculative round is planned from the endpoints the previous round reached).
        """
        residency = self.residency
        if not self.pipelining or plan.cohort < 0 or not self.speculation.decodes_ahead():
            return None  # speculative rounds are planned from each round's completed endpoints
        if residency.waiting and residency.free_slots:
            return None
        cohort = self._cohort
        if cohort is None or cohort.number != plan.cohort or cohort.membership != self.table.membership:
            return None
        if cohort.graph is None or cohort.graph.completion_dependencies:
            return None  # its inputs need the previous round's completion record
        if cohort.blocked or self._count(cohort).left < 2:
            return None
        if cohort.room <= 1:  # a member needs the page of the position after the next
            table, slots = self.table, cohort.slots
            needy = np.flatnonzero(table.page_count[slots] * self.page_tokens - table.consumed[slots] <= 1)
            if needy.shape[0] and not self._allocate_next(slots[needy]):
                return None
        residency.in_flight = cohort.slot_set
        try:
            follow = self._decode_plan(cohort, ahead=1)
        except GateFault:  # no follow-up: the next plan, with nothing in flight, fails that request alone
            residency.in_flight = frozenset()
            return None
        self.stats.pipelined_rounds += 1
        return follow

    def _allocate_next(self, slots: npt.NDArray[np.int64]) -> bool:
        """One more page for each of ``slots``, in order; False (the pages already given kept) as soon as
        one cannot be had."""
        allocator, table = self.residency.allocator, self.table
        if allocator.available() >= slots.shape[0]:
            pages = allocator.allocate(slots.shape[0])
            if pages is not None:
                table.add_page_each(slots, pages)
                return True
        for slot in slots.tolist():
            page = allocator.allocate(1)
            if page is None:
                return False
            table.add_pages(slot, page)
        return True


def prompt_histogram(prompt: npt.NDArray[np.integer[Any]], width: int) -> npt.NDArray[np.uint8]:
    """How often each id below ``width`` occurs in ``prompt`` (at most 255 each; ids outside are not counted).

    The prompt's distinct ids are counted (a sort of the prompt) and scattered into a zeroed row: a count
    over the whole vocabulary would touch eight bytes an id for a prompt of a few hundred tokens."""
    ids, counts = np.unique(prompt, return_counts=True)
    inside = (ids >= 0) & (ids < width)
    histogram = np.zeros(width, dtype=np.uint8)
    histogram[ids[inside]] = np.minimum(counts[inside], 255)
    return histogram


def _least(values: npt.NDArray[np.signedinteger[Any]]) -> int:
    """The smallest of ``values`` (a large number for none)."""
    return int(values.min()) if values.shape[0] else 2**62


def _variants(graphs: Iterable[PreparedGraph], operation: int) -> list[PreparedGraph]:
    return sorted(
        (g for g in graphs if g.operation == operation),
        key=lambda g: (g.extents.packed_token_capacity, g.extents.batch_capacity, g.patch_capacity),
    )  # of two variants of one size, the one that takes no images (or fewer) serves text rounds


@dataclass(frozen=True, slots=True)
class _Limits:
    """What one round may take: lanes, packed tokens, image patches and image features."""

    rows: int
    tokens: int
    patches: int
    features: int


def _targets(variants: Sequence[PreparedGraph]) -> list[_Limits]:
    """The limits a round of ``variants`` is planned within: their largest extents first (a text round
    always fits them), then each variant that takes images, largest first (a round with images fits one
    variant with all of its patches, features and tokens)."""
    largest = _Limits(
        max(g.extents.batch_capacity for g in variants),
        max(g.extents.packed_token_capacity for g in variants),
        max(g.patch_capacity for g in variants),
        max(g.feature_capacity for g in variants),
    )
    own = [
        _Limits(g.extents.batch_capacity, g.extents.packed_token_capacity, g.patch_capacity, g.feature_capacity)
        for g in reversed(variants)
        if g.takes_images
    ]
    return [largest, *(limits for limits in own if limits != largest)]


def _image_chunk(
    images: Sequence[PromptImage], consumed: int, chunk: int, patches: int, features: int
) -> tuple[int, int, int]:
    """A chunk of ``chunk`` tokens from ``consumed`` cut to end before the first image span it would split
    or whose image no longer fits ``patches`` and ``features``; with the patches and features of the
    images it holds. (A chunk never starts inside a span: chunks and prefix-reuse cuts end outside them.)"""
    end = consumed + chunk
    taken_patches = taken_features = 0
    for image in images:
        if image.end <= consumed:
            continue
        if image.start >= end:
            break
        if (
            image.start < consumed
            or image.end > end
            or taken_patches + image.patch_count > patches
            or taken_features + image.feature_count > features
        ):
            end = max(image.start, consumed)
            break
        taken_patches += image.patch_count
        taken_features += image.feature_count
    return end - consumed, taken_patches, taken_features


def _fitting(
    variants: Sequence[PreparedGraph], *, rows: int, tokens: int, patches: int, features: int
) -> PreparedGraph | None:
    """The smallest of ``variants`` that holds the round (a round with images only on one that takes them)."""
    for graph in variants:
        extents = graph.extents
        if (
            extents.batch_capacity >= rows
            and extents.packed_token_capacity >= tokens
            and (not patches or (graph.patch_capacity >= patches and graph.feature_capacity >= features))
        ):
            return graph
    return None


def _smallest(variants: Sequence[PreparedGraph], *, rows: int, tokens: int = 0) -> PreparedGraph:
    for graph in variants:
        if graph.extents.batch_capacity >= rows and graph.extents.packed_token_capacity >= tokens:
            return graph
    raise RuntimeError(f"no captured variant holds {rows} rows and {tokens} tokens")
