"""Shared packing: host values into a frame's transport staging.

Owns the translation of value bindings into writes. Each graph's bindings are
resolved once at startup into :class:`_BindingWriter` objects (source,
indexing, destination, padding and offset fixed); per round, packing only
copies the lanes' values into the frame's staging arrays. Packing is never
selected by a frontend identifier: it follows the contract's sources and
indexing modes alone.

Indexing modes (``docs/contract.md``): SCALAR writes one value; SUBMISSION_ROW
writes each lane's value in submission order and initializes the remaining
rows of the request capacity with the padding; ACTIVE_ROW writes live rows
only and leaves the inactive tail untouched; PHYSICAL_REQUEST_ROW writes at the
lane's slot; PACKED_TOKEN concatenates each lane's actual token count and pads
the rest. Page tables upload only newly assigned entries: each staging row
remembers the slot, generation and length it holds (one memory shared by all
packers of a model, since all graphs stage into the same frame arrays), and a
different slot or generation (a reused physical slot) invalidates it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedGraph
from helios_core.errors import UnsupportedFeatureError
from helios_core.wire import contract_pb2 as ct

Staging = Mapping[str, npt.NDArray[np.generic]]


@dataclass
class Lane:
    """One request row of a submission, as the scheduler planned it."""

    slot: int
    generation: int
    state_row: int
    positions: Sequence[int]
    """Absolute position of each packed token of this lane (its query length is their count)."""
    cache_slots: Sequence[int]
    """Cache slot (page id x page_tokens + offset) of each packed token."""
    page_table: Sequence[int]
    """The lane's page ids, in position order."""
    tokens: Sequence[int] = ()
    """Host-fed input tokens (prompt chunk, or the completed pending token); empty when device-owned."""
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = 0
    sampling_step: int = 0
    grammar_mask: npt.NDArray[np.int32] | None = None
    score_targets: Sequence[int] = ()
    prompt_histogram: npt.NDArray[np.uint8] | None = None
    consumed: int = 0
    mixed_prefill: bool = False
    snapshot_row: int = -1
    restore_row: int = -1

    @property
    def query_length(self) -> int:
        return len(self.positions)


@dataclass
class Submission:
    """The lanes of one round and its transport-owned sequence number."""

    lanes: Sequence[Lane]
    sequence: int


_ROW_SOURCES: dict[int, Callable[[Lane], float | int]] = {
    ct.VALUE_SOURCE_SLOT: lambda lane: lane.slot,
    ct.VALUE_SOURCE_GENERATION: lambda lane: lane.generation,
    ct.VALUE_SOURCE_QUERY_LENGTH: lambda lane: lane.query_length,
    ct.VALUE_SOURCE_SAMPLING_DECISION: lambda lane: int(lane.sample),
    ct.VALUE_SOURCE_MIXED_PREFILL_ROW: lambda lane: int(lane.mixed_prefill),
    ct.VALUE_SOURCE_LIVE_STATE_ROWS: lambda lane: lane.state_row,
    ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT: lambda lane: lane.consumed,
    ct.VALUE_SOURCE_RESTORE_SOURCE: lambda lane: lane.restore_row,
    ct.VALUE_SOURCE_SNAPSHOT_DESTINATION: lambda lane: lane.snapshot_row,
    ct.VALUE_SOURCE_TEMPERATURE: lambda lane: lane.temperature,
    ct.VALUE_SOURCE_TOP_P: lambda lane: lane.top_p,
    ct.VALUE_SOURCE_TOP_K: lambda lane: lane.top_k,
    ct.VALUE_SOURCE_MIN_P: lambda lane: lane.min_p,
    ct.VALUE_SOURCE_REPETITION_PENALTY: lambda lane: lane.repetition_penalty,
    ct.VALUE_SOURCE_FREQUENCY_PENALTY: lambda lane: lane.frequency_penalty,
    ct.VALUE_SOURCE_PRESENCE_PENALTY: lambda lane: lane.presence_penalty,
    ct.VALUE_SOURCE_SEED_BITS: lambda lane: lane.seed,
    ct.VALUE_SOURCE_SAMPLING_STEP: lambda lane: lane.sampling_step,
    ct.VALUE_SOURCE_CONSTRAINED: lambda lane: int(lane.grammar_mask is not None),
}
"""Sources with one value per lane."""

_TOKEN_SOURCES: dict[int, Callable[[Lane, int], Sequence[int]]] = {
    ct.VALUE_SOURCE_PROMPT_TOKENS: lambda lane, _: lane.tokens,
    ct.VALUE_SOURCE_PROMPT_POSITIONS: lambda lane, _: lane.positions,
    ct.VALUE_SOURCE_CACHE_SLOT: lambda lane, _: lane.cache_slots,
    ct.VALUE_SOURCE_TOKEN_ROW: lambda lane, row: [row] * lane.query_length,
    ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS: lambda lane, _: lane.score_targets,
}
"""Sources with one value per packed token of a lane."""

_VECTOR_SOURCES = frozenset(
    {ct.VALUE_SOURCE_PAGE_TABLE, ct.VALUE_SOURCE_GRAMMAR_MASK, ct.VALUE_SOURCE_PROMPT_HISTOGRAM}
)
"""Sources with one row vector per lane."""

_SUBMISSION_SOURCES = frozenset(
    {ct.VALUE_SOURCE_LIVE_ROW_COUNT, ct.VALUE_SOURCE_CONSTANT, ct.VALUE_SOURCE_INACTIVE_PADDING}
)


_PADDED_ROW = (-1, -1, 0)
"""Memory entry of a staging row that holds only padding."""


@dataclass
class PageTableMemory:
    """What each staged page-table row holds: (slot, generation, pages written).

    One instance is shared by every packer of a model: all graphs write the same staging arrays of a
    frame, so what one graph staged is what the next one finds. Keyed by (frame, destination, row).
    """

    rows: dict[tuple[int, str, int], tuple[int, int, int]] = field(default_factory=dict)


class _BindingWriter:
    """One value binding, resolved against its destination's shape and dtype."""

    def __init__(
        self, binding: ct.ValueBinding, graph: PreparedGraph, staging: Staging, memory: PageTableMemory
    ) -> None:
        source = binding.source
        supplied = source in _ROW_SOURCES or source in _TOKEN_SOURCES or source in _VECTOR_SOURCES
        if not supplied and source not in _SUBMISSION_SOURCES:
            name = ct.ValueSource.Name(source)  # type: ignore[arg-type]
            raise UnsupportedFeatureError(
                f"graph {graph.name!r} binds {name}, which this runtime's packing does not supply yet"
            )
        self.binding = binding
        self.source = source
        self.indexing = binding.indexing
        self.destination = binding.destination
        self.padding = binding.padding
        self.offset = binding.offset
        self.rows = graph.extents.batch_capacity
        self.packed = graph.extents.packed_token_capacity
        self.memory = memory

    def write(self, submission: Submission, frame: int, staging: Staging) -> None:
        dest = staging[self.destination]
        lanes = submission.lanes
        source = self.source
        if source == ct.VALUE_SOURCE_INACTIVE_PADDING:
            dest.reshape(-1)[:] = self.padding
            return
        if source in (ct.VALUE_SOURCE_CONSTANT, ct.VALUE_SOURCE_LIVE_ROW_COUNT):
            value = self.binding.constant if source == ct.VALUE_SOURCE_CONSTANT else len(lanes)
            dest.reshape(-1)[0] = value + self.offset
            return
        if source in _TOKEN_SOURCES:
            self._write_tokens(lanes, dest)
        elif source == ct.VALUE_SOURCE_PAGE_TABLE:
            self._write_page_tables(lanes, dest, frame)
        elif source in _VECTOR_SOURCES:
            self._write_vectors(lanes, dest)
        else:
            self._write_rows(lanes, dest)

    # -- per lane values ------------------------------------------------------------------
    def _write_rows(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic]) -> None:
        extract = _ROW_SOURCES[self.source]
        values = [extract(lane) for lane in lanes]
        if self.offset:
            values = [v + self.offset for v in values]
        if self.indexing == ct.INDEXING_PHYSICAL_REQUEST_ROW:
            for lane, value in zip(lanes, values, strict=True):
                dest[lane.slot] = value
            return
        if self.indexing == ct.INDEXING_SCALAR:
            dest.reshape(-1)[0] = values[0] if values else self.padding
            return
        count = len(values)
        dest[:count] = values
        if self.indexing == ct.INDEXING_SUBMISSION_ROW:
            dest[count : self.rows] = self.padding

    def _write_tokens(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic]) -> None:
        extract = _TOKEN_SOURCES[self.source]
        flat = dest.reshape(-1)
        cursor = 0
        for row, lane in enumerate(lanes):
            values = extract(lane, row)
            if len(values) != lane.query_length:
                raise ValueError(
                    f"lane {row} supplies {len(values)} values for {self.destination!r}, "
                    f"but its query length is {lane.query_length}"
                )
            flat[cursor : cursor + len(values)] = [v + self.offset for v in values] if self.offset else values
            cursor += len(values)
        if cursor > self.packed:
            raise ValueError(f"{cursor} packed tokens exceed the program's capacity {self.packed}")
        if self.indexing != ct.INDEXING_ACTIVE_ROW:
            flat[cursor : self.packed] = self.padding

    def _write_vectors(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic]) -> None:
        for row, lane in enumerate(lanes):
            vector = lane.grammar_mask if self.source == ct.VALUE_SOURCE_GRAMMAR_MASK else lane.prompt_histogram
            if vector is None:
                dest[row] = self.padding
            else:
                dest[row, : len(vector)] = vector
                dest[row, len(vector) :] = self.padding
        if self.indexing == ct.INDEXING_SUBMISSION_ROW:
            dest[len(lanes) : self.rows] = self.padding

    def _write_page_tables(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic], frame: int) -> None:
        held_rows = self.memory.rows
        width = dest.shape[-1]
        for row, lane in enumerate(lanes):
            pages = lane.page_table
            if len(pages) > width:
                raise ValueError(f"lane {row} needs {len(pages)} pages; the page table holds {width}")
            key = (frame, self.destination, row)
            held = held_rows.get(key)
            start = held[2] if held is not None and held[:2] == (lane.slot, lane.generation) else 0
            if start > len(pages):
                start = 0
            if start == 0:
                dest[row, len(pages) :] = self.padding
            dest[row, start : len(pages)] = np.asarray(pages[start:], dtype=dest.dtype) + self.offset
            held_rows[key] = (lane.slot, lane.generation, len(pages))
        if self.indexing == ct.INDEXING_SUBMISSION_ROW:
            for row in range(len(lanes), self.rows):
                key = (frame, self.destination, row)
                if held_rows.get(key) != _PADDED_ROW:
                    dest[row] = self.padding
                    held_rows[key] = _PADDED_ROW


class GraphPacker:
    """The resolved bindings of one graph."""

    def __init__(self, graph: PreparedGraph, staging: Staging, memory: PageTableMemory | None = None) -> None:
        self.graph = graph
        missing = [b.destination for b in graph.contract.bindings if b.destination not in staging]
        if missing:
            raise UnsupportedFeatureError(f"graph {graph.name!r} binds destinations without staging: {missing}")
        shared = memory if memory is not None else PageTableMemory()
        self.writers = [_BindingWriter(b, graph, staging, shared) for b in graph.contract.bindings]

    def pack(self, submission: Submission, frame: int, staging: Staging) -> None:
        """Write every bound value of ``submission`` into ``staging`` (one frame's transport)."""
        if len(submission.lanes) > self.graph.extents.batch_capacity:
            raise ValueError(
                f"{len(submission.lanes)} lanes exceed {self.graph.name!r}'s batch capacity "
                f"{self.graph.extents.batch_capacity}"
            )
        for writer in self.writers:
            writer.write(submission, frame, staging)
