"""The null backend (benchmarks only): programs that write well-formed completion records, computing nothing.

Owns per-frame staging and completion arrays shaped exactly as the core declares them, and for each
program the handful of transport entries its completion depends on, found through the graph's own
value bindings (generation, sampling decision, query length, positions, and a speculative program's
copied proposals). ``run`` echoes the submission sequence and generations, reports one emitted token per
sampling lane, the consumed endpoint after the round, -1 cursors and reserved fields, and a
deterministic sampled id. Host cost (scheduling, packing, validation) can then be measured without a
model. Page copies to and from the host tier copy nothing (there are no cache planes) but check their
host slot.

The ids it "samples" are a function of the context position alone (:class:`NullTokens`): the id at
position ``q`` is ``(7q + 3) mod V`` by default, or, with a cycle, ids that repeat every ``cycle``
positions except at a fixed pseudo-random fraction of positions (``novelty``) that get another id. A
request's output is therefore the same whichever programs compute it. A speculative program that
verifies copied proposals (history drafting: it binds ``CANDIDATE_IDS``) accepts each lane's longest
prefix of proposals equal to the ids of the positions they propose, and emits those ids and the next one,
exactly as a greedy target would: offers are the lane's proposal count, accepted at most the offers,
emitted accepted + 1, the consumed endpoint the lane's endpoint plus the emitted ids. With a cycle in
the prompts and outputs, history drafting proposes, and the novelty sets how often a proposal fails.
Programs that draft in-graph (``SPECULATIVE_PREFIX_LIMIT``) are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedContract
from helios_core.contract.prepared import PreparedGraph
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

AnyArray = npt.NDArray[np.generic]

_HASH_MULTIPLIER = 2654435761
"""Knuth's multiplicative hash constant: which positions are off the cycle (a fixed, evenly spread set)."""
_OTHER_MULTIPLIER = 2246822519
"""A second multiplier: which other id an off-cycle position gets."""
_HASH_RANGE = 2**32


@dataclass(frozen=True)
class NullTokens:
    """The ids the null backend samples: the id at context position ``q`` as a function of ``q`` alone.

    With ``cycle`` 0 the id is ``(7q + 3) mod V``. Otherwise the on-cycle id is ``(7 (q mod cycle) + 3)
    mod V``, and a position whose hash ``(q x 2654435761) mod 2**32`` lies below ``novelty x 2**32`` is off
    the cycle: its id is ``(on-cycle id + 1 + ((q x 2246822519) mod 2**32) mod (V - 1)) mod V``, never the
    on-cycle id. ``V`` is the sampled vocabulary (a vocabulary of one id has no other id: no position is
    off the cycle).
    """

    cycle: int = 0
    novelty: float = 0.0

    def __post_init__(self) -> None:
        if self.cycle < 0:
            raise ValueError(f"the null backend's token cycle is a count of positions (0: none); got {self.cycle}")
        if not 0.0 <= self.novelty <= 1.0:
            raise ValueError(f"the null backend's novelty is a fraction of positions in [0, 1]; got {self.novelty}")
        if self.novelty and not self.cycle:
            raise ValueError("the null backend's novelty needs a cycle (positions off a cycle)")

    def ids(self, positions: npt.NDArray[np.int64], vocabulary: int) -> npt.NDArray[np.int64]:
        """The id at each of ``positions`` (non-negative int64), in ``[0, vocabulary)``."""
        if not self.cycle:
            return (positions * 7 + 3) % vocabulary
        ids = ((positions % self.cycle) * 7 + 3) % vocabulary
        if self.novelty and vocabulary > 1:
            off = (positions * _HASH_MULTIPLIER) % _HASH_RANGE < int(self.novelty * _HASH_RANGE)
            other = (positions * _OTHER_MULTIPLIER) % _HASH_RANGE % (vocabulary - 1)
            ids = np.where(off, (ids + 1 + other) % vocabulary, ids)
        return ids  # type: ignore[no-any-return]


class NullBackend:
    """Completion records without computation."""

    def __init__(
        self, contract: PreparedContract, *, frames: int = 2, ranks: int = 1, tokens: NullTokens | None = None
    ) -> None:
        self._frames = frames
        self.tokens = tokens if tokens is not None else NullTokens()
        """The ids programs sample (:class:`NullTokens`); may be replaced before a round is launched."""
        self.ranks = ranks
        """The tensor-parallel ranks the model was loaded with (nothing is computed, so one record serves)."""
        self._host_page_count = 0
        self._host_snapshot_count = 0
        execution = contract.execution
        self._transport = [
            {e.name: np.zeros(tuple(e.shape), dtype=NUMPY_DTYPES[e.dtype]) for e in execution.transport.entries}
            for _ in range(frames)
        ]
        completion_buffers = {c.buffer for c in execution.completion}
        self._completion_buffers = [
            {
                b.name: np.zeros(tuple(int(d.size) for d in b.shape), dtype=NUMPY_DTYPES[b.dtype])
                for b in execution.buffers
                if b.name in completion_buffers
            }
            for _ in range(frames)
        ]
        self._fields = {int(c.field): c.buffer for c in execution.completion}
        self._completion = [
            {field: buffers[name] for field, name in self._fields.items()} for buffers in self._completion_buffers
        ]
        self._sampled_size = contract.sampled_size
        self._views = {
            (name, frame): _ProgramViews.find(graph, self._transport[frame], self._completion[frame], execution)
            for name, graph in contract.graphs.items()
            for frame in range(frames)
        }

    def transport(self, frame: int) -> Mapping[str, AnyArray]:
        return self._transport[frame]

    def completion(self, frame: int) -> Mapping[int, AnyArray]:
        return self._completion[frame]

    def run(self, program: str, frame: int) -> None:
        views = self._views[(program, frame)]
        if views is None:
            return  # a program without per-token lanes (state initialization) reports nothing
        if views.speculative is not None:
            self._run_speculative(views, views.speculative)
            return
        sampling = views.sampling != 0
        if views.one_token_per_row:  # decode: row i's token (if any) is packed token i
            consumed = (views.positions[: views.rows].astype(np.int64) + 1) * (views.lengths != 0)
        else:
            lengths: npt.NDArray[np.int64] = views.lengths.astype(np.int64, copy=False)
            ends = np.cumsum(lengths, dtype=np.int64)
            consumed = np.where(lengths > 0, views.positions[np.maximum(ends - 1, 0)].astype(np.int64) + 1, 0)
        views.generation_out[:] = views.generations
        views.emitted_out[:] = sampling
        views.consumed_out[:] = consumed
        views.sampled_out[:] = np.where(sampling, self.tokens.ids(consumed, self._sampled_size), -1)
        views.sequence_out[0] = views.sequence[0]

    def _run_speculative(self, views: _ProgramViews, speculative: _SpeculativeViews) -> None:
        """A program verifying copied proposals: each live lane (a nonzero query length) accepts its longest
        prefix of proposals equal to the ids of the positions after its endpoint, and emits those ids and
        the next; rows past the lanes report nothing."""
        width = speculative.width
        steps = np.arange(width, dtype=np.int64)
        live = views.lengths != 0
        endpoint = speculative.endpoint.astype(np.int64)
        offered = np.where(live, speculative.count.astype(np.int64), 0)
        model = self.tokens.ids(np.maximum(endpoint, 0)[:, None] + 1 + steps, self._sampled_size)
        if speculative.candidates is not None and width > 1:
            proposals = speculative.candidates[:, : width - 1]
            holds = (proposals == model[:, : width - 1]) & (steps[: width - 1] < offered[:, None])
            accepted = np.cumprod(holds, axis=1, dtype=np.int64).sum(axis=1)
        else:
            accepted = np.zeros(views.rows, dtype=np.int64)
        emitted = np.where(live, accepted + 1, 0)
        views.generation_out[:] = views.generations
        speculative.offers_out[:] = offered
        speculative.accepted_out[:] = accepted
        views.emitted_out[:] = emitted
        views.consumed_out[:] = np.where(live, endpoint + emitted, 0)
        speculative.ids_out[:, :width] = np.where(steps < emitted[:, None], model, -1)
        speculative.ids_out[:, width:] = -1
        views.sequence_out[0] = views.sequence[0]

    # -- the host tier of cache pages (no cache planes here: only the slot bookkeeping is checked) --------
    def reserve_host_pages(self, count: int) -> None:
        if count <= 0:
            raise ValueError(f"host pages are reserved in a positive count; got {count}")
        self._host_page_count = count

    def copy_page_to_host(self, page: int, slot: int) -> None:
        self._check_slot(slot)

    def copy_page_to_device(self, slot: int, page: int) -> None:
        self._check_slot(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._host_page_count:
            raise ValueError(f"host slot {slot} is outside the reserved host pages")

    # -- the host tier of checkpoints (no snapshot buffers here: only the slot bookkeeping is checked) ----
    def reserve_host_snapshots(self, count: int, rows: int) -> None:
        if count <= 0 or rows <= 0:
            raise ValueError(f"host checkpoint slots are reserved in a positive count; got {count}, {rows}")
        self._host_snapshot_count = count

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        self._check_snapshot_slot(slot)

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        self._check_snapshot_slot(slot)

    def _check_snapshot_slot(self, slot: int) -> None:
        if not 0 <= slot < self._host_snapshot_count:
            raise ValueError(f"host slot {slot} is outside the reserved host checkpoint slots")

    def close(self) -> None:
        self._transport.clear()
        self._completion_buffers.clear()


@dataclass(frozen=True)
class _SpeculativeViews:
    """What a program verifying copied proposals reads and writes besides a decode program's fields."""

    width: int
    """The program's W: each lane's pending token and at most W - 1 proposals."""
    candidates: AnyArray | None
    """[rows, W - 1] proposals (None for W = 1)."""
    count: AnyArray
    endpoint: AnyArray
    """Each lane's consumed endpoint before the round (its pending token's position)."""
    offers_out: AnyArray
    accepted_out: AnyArray
    ids_out: AnyArray
    """[rows, record width] emitted ids."""


@dataclass(frozen=True)
class _ProgramViews:
    """The staging entries one program's completion depends on and the completion fields it writes,
    as flat views of one frame's arrays (found once; ``run`` only reads and writes through them)."""

    rows: int
    one_token_per_row: bool
    """A decode program: each row has at most one token, packed at the row's own index."""
    generations: AnyArray
    lengths: AnyArray
    sampling: AnyArray
    positions: AnyArray
    sequence: AnyArray
    generation_out: AnyArray
    emitted_out: AnyArray
    consumed_out: AnyArray
    sampled_out: AnyArray
    sequence_out: AnyArray
    speculative: _SpeculativeViews | None = None
    """A program verifying copied proposals (history drafting); None for every other program."""

    @classmethod
    def find(
        cls,
        graph: PreparedGraph,
        staging: Mapping[str, AnyArray],
        out: Mapping[int, AnyArray],
        execution: mf.ExecutionManifest,
    ) -> _ProgramViews | None:
        contract = graph.contract
        rows = int(graph.extents.batch_capacity)
        sources = {b.source: b.destination for b in contract.bindings}
        generation_entry = sources.get(ct.VALUE_SOURCE_GENERATION)
        positions_entry = sources.get(ct.VALUE_SOURCE_PROMPT_POSITIONS)
        if generation_entry is None or positions_entry is None or mf.COMPLETION_FIELD_GENERATION not in out:
            return None

        def entry(source: ct.ValueSource) -> AnyArray:
            name = sources.get(source)
            return np.zeros(rows, dtype=np.int64) if name is None else staging[name].reshape(-1)[:rows]

        positions = staging[positions_entry].reshape(-1)
        ids = out[mf.COMPLETION_FIELD_SAMPLED_IDS]
        out[mf.COMPLETION_FIELD_DRAFT_CURSOR].reshape(-1)[:rows] = -1
        out[mf.COMPLETION_FIELD_RESERVED].reshape(-1)[:rows] = -1
        speculative = None
        if (
            graph.operation == ct.OPERATION_SPECULATIVE
            and ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT in sources
            and mf.COMPLETION_FIELD_OFFERS in out
            and mf.COMPLETION_FIELD_ACCEPTED_DRAFTS in out
        ):
            candidates_entry = sources.get(ct.VALUE_SOURCE_CANDIDATE_IDS)
            candidates = None
            if candidates_entry is not None:
                proposals = staging[candidates_entry]
                candidates = proposals.reshape(proposals.shape[0], -1)[:rows]
            speculative = _SpeculativeViews(
                width=int(graph.extents.token_capacity),
                candidates=candidates,
                count=entry(ct.VALUE_SOURCE_CANDIDATE_COUNT),
                endpoint=entry(ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT),
                offers_out=out[mf.COMPLETION_FIELD_OFFERS].reshape(-1)[:rows],
                accepted_out=out[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS].reshape(-1)[:rows],
                ids_out=ids.reshape(ids.shape[0], -1)[:rows],
            )
        return cls(
            rows=rows,
            one_token_per_row=graph.operation == ct.OPERATION_DECODE
            and int(graph.extents.packed_token_capacity) == rows,
            generations=staging[generation_entry].reshape(-1)[:rows],
            lengths=entry(ct.VALUE_SOURCE_QUERY_LENGTH),
            sampling=entry(ct.VALUE_SOURCE_SAMPLING_DECISION),
            positions=positions,
            sequence=staging[execution.transport.submission_sequence_entry].reshape(-1),
            generation_out=out[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[:rows],
            emitted_out=out[mf.COMPLETION_FIELD_EMITTED_TOKENS].reshape(-1)[:rows],
            consumed_out=out[mf.COMPLETION_FIELD_CONSUMED_TOKENS].reshape(-1)[:rows],
            sampled_out=ids.reshape(ids.shape[0], -1)[:rows, 0],
            sequence_out=out[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1),
            speculative=speculative,
        )


def transport_nbytes(contract: PreparedContract) -> int:
    """Staging bytes of one frame (for reports)."""
    return sum(math.prod(e.shape) * NUMPY_DTYPES[e.dtype].itemsize for e in contract.execution.transport.entries)
