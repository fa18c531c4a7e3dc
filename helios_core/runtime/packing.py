"""Shared packing: host values into a frame's transport staging.

Owns the translation of value bindings into writes. Each graph's bindings are
resolved once at startup into :class:`_BindingWriter` objects (source,
indexing, destination, padding and offset fixed); per round, packing only
copies the lanes' values into the frame's staging arrays. Packing is never
selected by a frontend identifier: it follows the contract's sources and
indexing modes alone.

A submission's lanes come in one of two forms with the same staged bytes: a
list of :class:`Lane` objects (any round; each value written as the Python
value it is), or a :class:`LaneBatch`, whose values are numpy columns (the
scheduler builds one per decode round from its per-slot arrays, and one per
speculative round whose lanes have no grammar masks: its copied proposals a
``[lanes, width]`` matrix, ``CANDIDATE_IDS``). A batch is
written with a few vectorized assignments per binding. A batch says which of
its values are unchanged since an earlier batch (``staged_as``: the planner's
number for one decode cohort; ``unchanged``: the sources that stay the same
from one of its rounds to the next). When a packer stages a batch on a frame
whose staging nobody else wrote since the same graph staged a batch of that
number and lane count there, it writes only the other sources (positions,
cache slots, sampling steps, new page-table entries): every other byte it would
write is already staged (when the lanes' query lengths are among what changes, as
in a speculative batch, those writes include the padding past the lanes). A value a column cannot hand
to numpy exactly as the Python value would be (outside the destination's range,
a float into an integer destination) is written from Python values, so both
forms fail alike. Every packer of a frame's staging must share one memory
(:class:`PageTableMemory`); host staging is written by packing alone.

Indexing modes (``docs/contract.md``): SCALAR writes one value; SUBMISSION_ROW
writes each lane's value in submission order and initializes the remaining
rows of the request capacity with the padding; ACTIVE_ROW writes live rows
only and leaves the inactive tail untouched; PHYSICAL_REQUEST_ROW writes at the
lane's slot; PACKED_TOKEN concatenates each lane's actual token count and pads
the rest. ``EOS_IDS`` writes the core's EOS ids (given to :class:`GraphPacker`), then the padding, once
(SCALAR) or as each lane's row. ``PENDING_TOKEN`` is a lane's host-fed token (for a decode lane its
completed pending token) and ``OUTPUT_LIMIT`` the output tokens the lane may still generate; a decode
batch carries either as a column only when its graph binds it. Page tables upload only newly
assigned entries: each staging row remembers the slot, generation and length it holds (one memory shared by all
packers of a model, since all graphs stage into the same frame arrays), and a
different slot or generation (a reused physical slot) invalidates it. After a
pack that raised part way, :meth:`PageTableMemory.forget` drops what is known
of the frame, so the next pack writes it in full.

The image sources pack a round's images (:attr:`Lane.images`, each a :class:`LaneImage`): their tensors
concatenated into the patch capacity (``IMAGE_TENSOR``), each packed token's feature row
(``IMAGE_FEATURE_INDICES``), each feature row's context position (``IMAGE_CONTEXT_INDICES``) and each
lane's first feature row (``IMAGE_FEATURE_SLOT``); a :class:`LaneBatch` carries none.

Which values of each request sampling setting pack as themselves is stated by
:class:`~helios_core.sampling.SamplingLimits` (re-exported here): preparation and
admission check requests against it, so packing never meets a value that would
fail a shared round.

Its size: one resolver per value source and indexing mode, all writing the same staging layout; a
source's resolution, extents and staging write belong together.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedGraph
from helios_core.errors import UnsupportedFeatureError
from helios_core.runtime.messages import PromptImage
from helios_core.sampling import NONZERO_FIELDS as NONZERO_FIELDS  # re-exported for existing callers
from helios_core.sampling import SAMPLING_FIELDS as SAMPLING_FIELDS
from helios_core.sampling import SAMPLING_PARAMETERS, SamplingParameter, SamplingParams, integer_range
from helios_core.sampling import PackedInput as PackedInput
from helios_core.sampling import SamplingLimits as SamplingLimits
from helios_core.sampling import format_bound as format_bound
from helios_core.sampling import packed_input as _packed_input  # noqa: F401
from helios_core.wire import contract_pb2 as ct

Staging = Mapping[str, npt.NDArray[np.generic]]
Column = npt.NDArray[np.generic]
"""One value per lane (or per packed token) of a :class:`LaneBatch`."""


_NEUTRAL_SAMPLING = SamplingParams()
"""The settings of a lane that names none (immutable, so every such lane shares it)."""


@dataclass(frozen=True)
class LaneImage:
    """One image whose span lies in a lane's chunk: its vision tensors and where its features go."""

    tensors: Mapping[str, npt.NDArray[Any]]
    """Each named vision tensor (an ``IMAGE_TENSOR`` ``image_output``), ``patch_count`` leading rows."""
    patch_count: int
    feature_offsets: Sequence[int]
    """Offset into the lane's packed tokens of each token that receives a feature, in feature order."""
    feature_positions: Sequence[int]
    """Absolute position in the request's context of each of those tokens."""

    @property
    def feature_count(self) -> int:
        return len(self.feature_offsets)

    @classmethod
    def of(cls, image: PromptImage, chunk_start: int) -> LaneImage:
        """``image`` in a lane whose chunk starts at position ``chunk_start`` (its span inside the chunk)."""
        positions = [image.start + offset for offset in image.feature_tokens]
        return cls(
            {tensor.name: tensor.array() for tensor in image.tensors},
            image.patch_count,
            [position - chunk_start for position in positions],
            positions,
        )


class Lane(msgspec.Struct, frozen=True):
    """One request row of a submission, as the scheduler planned it (never changed once planned; a frozen
    struct, built in a fraction of a frozen dataclass's time: a round of many lanes builds one each)."""

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
    sampling: SamplingParams = _NEUTRAL_SAMPLING
    """The request's sampling settings (packed through the value sources their declaration names)."""
    sampling_step: int = 0
    grammar_mask: npt.NDArray[np.int32] | None = None
    score_targets: Sequence[int] = ()
    prompt_histogram: npt.NDArray[np.uint8] | None = None
    consumed: int = 0
    output_limit: int = 0
    """Output tokens the request may still generate before this round samples (``OUTPUT_LIMIT``)."""
    mixed_prefill: bool = False
    snapshot_row: int = -1
    restore_row: int = -1
    candidates: Sequence[int] = ()
    """Copied proposals (a speculative lane): the tokens it offers after its pending token."""
    candidate_masks: Sequence[npt.NDArray[np.int32] | None] = ()
    """A constrained speculative lane: one grammar mask a packed position (CANDIDATE_GRAMMAR_MASKS), the
    mask its position samples under (None: every id, the padding); empty for an unconstrained lane."""
    prefix_limit: int = 0
    """A speculative lane of a program that allocates its own prefixes: its ceiling (the most target
    rows it may take, its pending token included)."""
    images: Sequence[LaneImage] = ()
    """The images whose spans lie in this lane's chunk, in prompt order (packed by the image sources)."""

    @property
    def query_length(self) -> int:
        return len(self.positions)

    @property
    def patch_count(self) -> int:
        """Image patches this lane adds to its round."""
        return sum(image.patch_count for image in self.images)


class LaneBatch(msgspec.Struct, frozen=True, eq=False, gc=False):
    """The lanes of one submission as columns.

    ``rows`` holds one value per lane for every per-lane source (``_ROW_SOURCES``); ``tokens`` one value
    per packed token for ``PROMPT_POSITIONS`` and ``CACHE_SLOT`` (and ``TOKEN_ROW``, else derived), and
    optionally ``PROMPT_TOKENS`` and ``SCORED_PREFILL_TARGETS`` (a source missing there supplies no
    values). Lane ``i``'s page table is ``page_source[page_index[i], :page_counts[i]]``; the slot and
    generation columns identify its lanes. ``grammar_masks`` and ``prompt_histograms`` are per-lane
    vectors (``None`` for the lane, or for every lane). Columns agree with what they stand for, as a
    :class:`Lane` derives them: ``QUERY_LENGTH`` is each lane's packed-token count, ``SAMPLING_DECISION``
    and ``MIXED_PREFILL_ROW`` are 0 or 1, ``CONSTRAINED`` is 1 exactly for a lane with a grammar mask.
    A speculative batch's ``candidates`` holds lane ``i``'s copied proposals in the first
    ``rows[CANDIDATE_COUNT][i]`` entries of row ``i`` (what lies past them is never staged); its lanes have
    no per-position grammar masks.

    ``staged_as``, when given, names the values of every source in ``unchanged`` (row, token or vector
    sources) and the lane identities: two batches with the same ``staged_as`` and lane count have the
    same values there, so a packer that staged the one need write only the other sources of the next
    (the planner numbers each decode cohort it forms, and the members of its speculative batches; the
    sources outside ``unchanged`` are what changes from one of its rounds to the next). Columns are never
    modified once handed over.
    """

    count: int
    rows: Mapping[int, Column]
    tokens: Mapping[int, Column]
    page_source: npt.NDArray[np.int64]
    page_index: npt.NDArray[np.int64]
    page_counts: npt.NDArray[np.int64]
    grammar_masks: Sequence[npt.NDArray[np.int32] | None] | None = None
    prompt_histograms: Sequence[npt.NDArray[np.uint8] | None] | None = None
    staged_as: int | None = None
    unchanged: frozenset[int] = frozenset()
    page_version: int | None = None
    """With ``staged_as``: a count of page additions (only growing); a batch of the same ``staged_as`` and
    version has the same page tables."""
    candidates: npt.NDArray[np.int64] | None = None
    """Speculative lanes: ``[count, width]`` copied proposals (``CANDIDATE_IDS``); None for other lanes."""

    def __len__(self) -> int:
        return self.count

    def to_lanes(self) -> list[Lane]:
        """The same lanes as :class:`Lane` objects (exact Python values)."""
        rows = {source: column.tolist() for source, column in self.rows.items()}
        lengths = rows[ct.VALUE_SOURCE_QUERY_LENGTH]
        tokens = {source: column.tolist() for source, column in self.tokens.items()}
        index = self.page_index.tolist()
        counts = self.page_counts.tolist()
        offered = rows.get(ct.VALUE_SOURCE_CANDIDATE_COUNT)
        proposals = self.candidates.tolist() if self.candidates is not None and offered is not None else None
        limits = rows.get(ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT)
        lanes: list[Lane] = []
        start = 0
        for i in range(self.count):
            end = start + int(lengths[i])
            lanes.append(
                Lane(
                    slot=rows[ct.VALUE_SOURCE_SLOT][i],
                    generation=rows[ct.VALUE_SOURCE_GENERATION][i],
                    state_row=rows[ct.VALUE_SOURCE_LIVE_STATE_ROWS][i],
                    positions=tokens[ct.VALUE_SOURCE_PROMPT_POSITIONS][start:end],
                    cache_slots=tokens[ct.VALUE_SOURCE_CACHE_SLOT][start:end],
                    page_table=self.page_source[index[i], : counts[i]].tolist(),
                    tokens=tokens[ct.VALUE_SOURCE_PROMPT_TOKENS][start:end]
                    if ct.VALUE_SOURCE_PROMPT_TOKENS in tokens
                    else tokens[ct.VALUE_SOURCE_PENDING_TOKEN][start:end]
                    if ct.VALUE_SOURCE_PENDING_TOKEN in tokens
                    else [],
                    sample=bool(rows[ct.VALUE_SOURCE_SAMPLING_DECISION][i]),
                    sampling=SamplingParams(**{p.name: rows[p.source][i] for p in SAMPLING_PARAMETERS}),
                    sampling_step=rows[ct.VALUE_SOURCE_SAMPLING_STEP][i],
                    grammar_mask=self.grammar_masks[i] if self.grammar_masks is not None else None,
                    score_targets=tokens[ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS][start:end]
                    if ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS in tokens
                    else (),
                    prompt_histogram=self.prompt_histograms[i] if self.prompt_histograms is not None else None,
                    consumed=rows[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT][i],
                    output_limit=rows[ct.VALUE_SOURCE_OUTPUT_LIMIT][i] if ct.VALUE_SOURCE_OUTPUT_LIMIT in rows else 0,
                    mixed_prefill=bool(rows[ct.VALUE_SOURCE_MIXED_PREFILL_ROW][i]),
                    snapshot_row=rows[ct.VALUE_SOURCE_SNAPSHOT_DESTINATION][i],
                    restore_row=rows[ct.VALUE_SOURCE_RESTORE_SOURCE][i],
                    candidates=proposals[i][: offered[i]] if proposals is not None and offered is not None else (),
                    prefix_limit=limits[i] if limits is not None else 0,
                )
            )
            start = end
        return lanes


@dataclass
class Submission:
    """The lanes of one round and its transport-owned sequence number."""

    lanes: Sequence[Lane] | LaneBatch
    sequence: int


def sampling_row_sources(
    parameters: Iterable[SamplingParameter] = SAMPLING_PARAMETERS,
) -> dict[int, Callable[[Lane], float | int]]:
    """Each sampling parameter's value source, reading the lane's setting of that name."""
    return {parameter.source: operator.attrgetter(f"sampling.{parameter.name}") for parameter in parameters}


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
    **sampling_row_sources(),
    ct.VALUE_SOURCE_SAMPLING_STEP: lambda lane: lane.sampling_step,
    ct.VALUE_SOURCE_CONSTRAINED: lambda lane: int(lane.grammar_mask is not None or bool(lane.candidate_masks)),
    ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: lambda lane: lane.prefix_limit,
    ct.VALUE_SOURCE_CANDIDATE_COUNT: lambda lane: len(lane.candidates),
    ct.VALUE_SOURCE_CANDIDATE_GENERATION: lambda lane: lane.generation,
    ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT: lambda lane: lane.consumed,
    ct.VALUE_SOURCE_OUTPUT_LIMIT: lambda lane: lane.output_limit,
}
"""Sources with one value per lane."""

_TokenValues = Sequence[int] | npt.NDArray[np.int64]
"""A lane's values of a per-token source: a sequence of ints, or an int64 array."""

_TOKEN_SOURCES: dict[int, Callable[[Lane, int], _TokenValues]] = {
    ct.VALUE_SOURCE_PROMPT_TOKENS: lambda lane, _: lane.tokens,
    ct.VALUE_SOURCE_PROMPT_POSITIONS: lambda lane, _: lane.positions,
    ct.VALUE_SOURCE_CACHE_SLOT: lambda lane, _: lane.cache_slots,
    ct.VALUE_SOURCE_TOKEN_ROW: lambda lane, row: np.full(lane.query_length, row, dtype=np.int64),
    ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS: lambda lane, _: lane.score_targets,
    ct.VALUE_SOURCE_PENDING_TOKEN: lambda lane, _: lane.tokens,
}
"""Sources with one value per packed token of a lane."""


def _token_values(values: _TokenValues, offset: int) -> _TokenValues:
    """A lane's per-token values plus ``offset``, in a form numpy writes without a Python loop (a range
    of positions becomes an arange; a list stays a list when there is no offset)."""
    if isinstance(values, range):
        return np.arange(values.start + offset, values.stop + offset, values.step, dtype=np.int64)
    if isinstance(values, np.ndarray):
        return values + offset if offset else values
    return [value + offset for value in values] if offset else values


_SHORT_PIECE = 64
"""Per-token values of up to this many entries are gathered element by element; longer arrays whole."""


def token_array(values: _TokenValues) -> npt.NDArray[np.int64]:
    """A lane's per-token values (a range, a list or an array) as an int64 array."""
    if isinstance(values, range):
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    return np.asarray(values, dtype=np.int64)


def _concatenated(pieces: Sequence[_TokenValues], total: int) -> npt.NDArray[np.int64]:
    """The lanes' per-token values as one int64 array of ``total`` entries: one pass over the values when
    every piece is short or not an array (a decode lane's one value, a chunk's range), else by pieces."""
    if any(isinstance(piece, np.ndarray) and len(piece) > _SHORT_PIECE for piece in pieces):
        return np.concatenate([token_array(piece) for piece in pieces])
    return np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=total)


_VECTOR_SOURCES = frozenset(
    {
        ct.VALUE_SOURCE_PAGE_TABLE,
        ct.VALUE_SOURCE_GRAMMAR_MASK,
        ct.VALUE_SOURCE_PROMPT_HISTOGRAM,
        ct.VALUE_SOURCE_CANDIDATE_IDS,
    }
)
"""Sources with one row vector per lane."""

_PACKED_VECTOR_SOURCES = frozenset({ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS})
"""Sources with one row vector per packed token of a lane (packed-token indexing only)."""

_SUBMISSION_SOURCES = frozenset(
    {
        ct.VALUE_SOURCE_LIVE_ROW_COUNT,
        ct.VALUE_SOURCE_CONSTANT,
        ct.VALUE_SOURCE_INACTIVE_PADDING,
        ct.VALUE_SOURCE_EOS_IDS,
    }
)

_IMAGE_SOURCES = frozenset(
    {
        ct.VALUE_SOURCE_IMAGE_TENSOR,
        ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES,
        ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES,
        ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT,
    }
)
"""Sources fed by the round's images (:attr:`Lane.images`); a :class:`LaneBatch` carries none."""

_EXACT_FLOAT_INT = 2**53
"""Integers of at most this magnitude convert to a float destination alike from Python ints and int64."""


class _HeldRows:
    """What the rows of one (frame, page-table destination) hold: slot, generation, pages written."""

    __slots__ = ("count", "generation", "known", "slot")

    def __init__(self, rows: int) -> None:
        self.slot = np.zeros(rows, dtype=np.int64)
        self.generation = np.zeros(rows, dtype=np.int64)
        self.count = np.zeros(rows, dtype=np.int64)
        self.known = np.zeros(rows, dtype=bool)

    def hold(self, row: int, slot: int, generation: int, count: int) -> None:
        try:
            self.slot[row], self.generation[row], self.count[row] = slot, generation, count
            self.known[row] = True
        except OverflowError:  # an identity outside int64 is never matched: the row is rewritten next time
            self.known[row] = False

    def padded(self, row: int) -> bool:
        return bool(self.known[row] and self.slot[row] == -1 and self.generation[row] == -1 and self.count[row] == 0)

    def pad(self, rows: slice | npt.NDArray[np.intp]) -> None:
        self.slot[rows], self.generation[rows], self.count[rows], self.known[rows] = -1, -1, 0, True

    def padded_at(self, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """:meth:`padded` of each of ``rows``."""
        padded = self.known[rows] & (self.slot[rows] == -1) & (self.generation[rows] == -1) & (self.count[rows] == 0)
        return np.asarray(padded, dtype=np.bool_)

    def unknown(self, rows: int | slice | npt.NDArray[np.intp]) -> None:
        self.known[rows] = False


@dataclass
class PageTableMemory:
    """What each frame's staging holds, as far as packing needs to know.

    ``tables``: per (frame, page-table destination), each row's (slot, generation, pages written), or
    that it holds only padding. ``versions``: per frame, a count that changes whenever a pack writes the
    frame's staging in full. ``batches``: per frame, the graph, the ``staged_as`` number and lane count
    and the version of the last batch staged there (the next batch of the same graph, number and count
    at that version writes only what changes). One instance is shared by every packer of a
    model: all graphs write the same staging arrays of a frame, so what one graph staged is what the
    next one finds.
    """

    tables: dict[tuple[int, str], _HeldRows] = field(default_factory=dict)
    page_versions: dict[tuple[int, str], int] = field(default_factory=dict)
    """Per (frame, page-table destination): the page version of the batch whose tables it holds."""
    versions: dict[int, int] = field(default_factory=dict)
    batches: dict[int, tuple[str, int, int, int]] = field(default_factory=dict)
    vector_padding: dict[tuple[int, str], object] = field(default_factory=dict)
    """Per (frame, grammar-mask or prompt-histogram destination): the padding its padded rows hold (its
    rows are in ``tables`` under the same key)."""

    def held(self, frame: int, destination: str, rows: int) -> _HeldRows:
        key = (frame, destination)
        held = self.tables.get(key)
        if held is None or held.slot.shape[0] < rows:
            grown = _HeldRows(rows)
            if held is not None:
                size = held.slot.shape[0]
                grown.slot[:size], grown.generation[:size] = held.slot, held.generation
                grown.count[:size], grown.known[:size] = held.count, held.known
            held = self.tables[key] = grown
        return held

    def vector_rows(self, frame: int, destination: str, rows: int, padding: object) -> _HeldRows:
        """Which rows of a vector destination of ``frame`` hold ``padding`` (none are known to, where the
        rows last padded held another graph's padding)."""
        key = (frame, destination)
        if key in self.vector_padding and self.vector_padding[key] != padding:
            self.tables.pop(key, None)
        self.vector_padding[key] = padding
        return self.held(frame, destination, rows)

    def forget(self, frame: int) -> None:
        """Nothing is known of what ``frame``'s staging holds (a pack raised part way): the next pack of
        the frame writes every value, every page-table row and every padding row in full."""
        for key in [key for key in self.tables if key[0] == frame]:
            del self.tables[key]
        for key in [key for key in self.page_versions if key[0] == frame]:
            del self.page_versions[key]
        for key in [key for key in self.vector_padding if key[0] == frame]:
            del self.vector_padding[key]
        self.batches.pop(frame, None)
        self.invalidate(frame)

    def invalidate(self, frame: int) -> int:
        """A pack writes the frame's staging in full: what was remembered of batches no longer holds."""
        version = self.versions.get(frame, 0) + 1
        self.versions[frame] = version
        return version


class _BindingWriter:
    """One value binding, resolved against its destination's shape and dtype."""

    def __init__(
        self,
        binding: ct.ValueBinding,
        graph: PreparedGraph,
        staging: Staging,
        memory: PageTableMemory,
        eos_ids: Sequence[int] = (),
    ) -> None:
        source = binding.source
        if source in _PACKED_VECTOR_SOURCES and binding.indexing != ct.INDEXING_PACKED_TOKEN:
            raise UnsupportedFeatureError(
                f"graph {graph.name!r} binds {ct.ValueSource.Name(source)} with "  # type: ignore[arg-type]
                f"{ct.Indexing.Name(binding.indexing)}; packing supplies it per packed token only"  # type: ignore[arg-type]
            )
        supplied = (
            source in _ROW_SOURCES
            or source in _TOKEN_SOURCES
            or source in _VECTOR_SOURCES
            or source in _PACKED_VECTOR_SOURCES
        )
        supplied = supplied or source in _IMAGE_SOURCES
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
        self._cast_dtype: np.dtype[np.generic] | None = None
        self._cast_dest: np.dtype[np.generic] | None = None
        self._cast_mode = _PYTHON
        self.eos_ids: npt.NDArray[np.generic] | None = None
        if source == ct.VALUE_SOURCE_EOS_IDS:
            self.eos_ids = _eos_vector(binding, graph, staging[binding.destination], eos_ids)
        self.bands: tuple[tuple[str, int, int], ...] = ()
        """PAGE_TABLE with shifted or several page-table views: each view's (memory key, first column,
        columns); empty when the lane's pages start at column 0 of the whole row."""
        self.gaps: tuple[slice, ...] = ()
        """Columns of a banded destination row that no view covers (they hold the padding)."""
        if source == ct.VALUE_SOURCE_PAGE_TABLE:
            self._resolve_bands(graph, staging[binding.destination].shape[-1])

    def _resolve_bands(self, graph: PreparedGraph, row_extent: int) -> None:
        """A page-table view with page offset ``k`` and ``n`` pages a row places the lane's page ``j`` at
        column ``k + j`` of the destination row (``j < n``); the columns no view covers hold the padding."""
        views = [view for view in graph.page_table_views if view.buffer == self.destination]
        if not views or (len(views) == 1 and views[0].page_offset == 0):
            return  # the lane's pages from column 0 of the whole row
        self.bands = tuple(
            (f"{self.destination}@{view.page_offset}", view.page_offset, view.pages_per_row) for view in views
        )
        gaps: list[slice] = []
        column = 0
        for _, first, width in self.bands:
            if first > column:
                gaps.append(slice(column, first))
            column = max(column, first + width)
        if column < row_extent:
            gaps.append(slice(column, row_extent))
        self.gaps = tuple(gaps)

    def _page_bands(self, dest: npt.NDArray[np.generic]) -> list[tuple[str, npt.NDArray[np.generic]]]:
        """Each view's memory key and its columns of ``dest`` (the whole row when unbanded)."""
        if not self.bands:
            return [(self.destination, dest)]
        return [(key, dest[:, first : first + width]) for key, first, width in self.bands]

    def _pad_gaps(self, dest: npt.NDArray[np.generic], count: int) -> None:
        """Write the padding into the columns no view covers, on every row this binding writes."""
        rows = max(count, self.rows) if self.indexing == ct.INDEXING_SUBMISSION_ROW else count
        for gap in self.gaps:
            dest[:rows, gap] = self.padding

    def constant_in(self, sources: frozenset[int]) -> bool:
        """Whether what this writer stages for a batch depends only on ``sources`` and the lane count."""
        if self.source == ct.VALUE_SOURCE_PAGE_TABLE:
            return False
        if self.source in _SUBMISSION_SOURCES or self.source in _IMAGE_SOURCES:
            return True  # a batch carries no images: its image values are padding alone
        if self.source in _ROW_SOURCES and self.indexing == ct.INDEXING_PHYSICAL_REQUEST_ROW:
            return self.source in sources and ct.VALUE_SOURCE_SLOT in sources
        return self.source in sources

    def write(self, submission: Submission, frame: int, staging: Staging) -> None:
        lanes = submission.lanes
        if isinstance(lanes, LaneBatch):
            self.write_batch(lanes, frame, staging, tails=True, same_lanes=False)
            return
        dest = staging[self.destination]
        source = self.source
        if source == ct.VALUE_SOURCE_INACTIVE_PADDING:
            dest.reshape(-1)[:] = self.padding
            return
        if source == ct.VALUE_SOURCE_EOS_IDS:
            self._write_eos(dest, len(lanes), [lane.slot for lane in lanes])
            return
        if source in (ct.VALUE_SOURCE_CONSTANT, ct.VALUE_SOURCE_LIVE_ROW_COUNT):
            value = self.binding.constant if source == ct.VALUE_SOURCE_CONSTANT else len(lanes)
            dest.reshape(-1)[0] = value + self.offset
            return
        if source in _IMAGE_SOURCES:
            self._write_images(lanes, dest)
        elif source in _TOKEN_SOURCES:
            self._write_tokens(lanes, dest)
        elif source in _PACKED_VECTOR_SOURCES:
            self._write_packed_vectors([lane.candidate_masks for lane in lanes], lanes, dest)
        elif source == ct.VALUE_SOURCE_PAGE_TABLE:
            tables = [(lane.slot, lane.generation, lane.page_table) for lane in lanes]
            for key, band in self._page_bands(dest):
                self._write_page_tables(tables, band, frame, key)
            self._pad_gaps(dest, len(lanes))
        elif source in _VECTOR_SOURCES:
            self._write_vectors(lanes, dest, frame)
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

    # -- images ---------------------------------------------------------------------------
    def _write_images(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic]) -> None:
        """The round's images (lanes in submission order, images in prompt order): their tensors
        concatenated (IMAGE_TENSOR), the feature row each packed token receives (IMAGE_FEATURE_INDICES),
        the context position each feature row fills (IMAGE_CONTEXT_INDICES), each lane's first feature
        row (IMAGE_FEATURE_SLOT); padding everywhere else."""
        source = self.source
        if source == ct.VALUE_SOURCE_IMAGE_TENSOR:
            self._write_image_tensor(lanes, dest)
            return
        offset = self.offset
        if source == ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES:
            flat = dest.reshape(-1)
            total = sum(lane.query_length for lane in lanes)
            if total > self.packed:
                raise ValueError(f"{total} packed tokens exceed the program's capacity {self.packed}")
            flat[: self.packed] = self.padding
            cursor = row = 0
            for index, lane in enumerate(lanes):
                length = lane.query_length
                for image in lane.images:
                    for feature_offset in image.feature_offsets:
                        if not 0 <= feature_offset < length:
                            raise ValueError(f"lane {index} has an image feature outside its {length} packed tokens")
                        flat[cursor + feature_offset] = row + offset
                        row += 1
                cursor += length
            return
        if source == ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES:
            flat = dest.reshape(-1)
            positions = [p + offset for lane in lanes for image in lane.images for p in image.feature_positions]
            if len(positions) > flat.shape[0]:
                raise ValueError(
                    f"the round's {len(positions)} image features exceed {self.destination!r}'s {flat.shape[0]} entries"
                )
            flat[: len(positions)] = positions
            flat[len(positions) :] = self.padding
            return
        first_rows: list[int] = []  # IMAGE_FEATURE_SLOT
        row = 0
        for lane in lanes:
            first_rows.append(row + offset if lane.images else self.padding)
            row += sum(image.feature_count for image in lane.images)
        count = len(first_rows)
        dest[:count] = np.asarray(first_rows, dtype=np.int64).reshape((count, *([1] * (dest.ndim - 1))))
        if self.indexing == ct.INDEXING_SUBMISSION_ROW:
            dest[count : self.rows] = self.padding

    def _write_image_tensor(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic]) -> None:
        name = self.binding.image_output
        capacity = dest.shape[0]
        cursor = 0
        for lane in lanes:
            for image in lane.images:
                tensor = image.tensors.get(name)
                if tensor is None:
                    raise ValueError(f"an image of the round has no {name!r} tensor for {self.destination!r}")
                rows = image.patch_count
                if tensor.shape[0] != rows or tuple(tensor.shape[1:]) != tuple(dest.shape[1:]):
                    raise ValueError(
                        f"image tensor {name!r} has shape {list(tensor.shape)}; {self.destination!r} takes "
                        f"[{rows}, {', '.join(map(str, dest.shape[1:]))}] for an image of {rows} patches"
                    )
                if cursor + rows > capacity:
                    raise ValueError(
                        f"the round's images hold more than {capacity} patches, the patch capacity of "
                        f"{self.destination!r}"
                    )
                dest[cursor : cursor + rows] = image_values(tensor, dest.dtype, name)
                cursor += rows
        dest[cursor:] = self.padding

    def _write_tokens(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic]) -> None:
        """Every lane's per-token values in packed order, written in one assignment (a mixed round's many
        one-token lanes would otherwise cost a numpy write each)."""
        flat = dest.reshape(-1)
        lengths = [len(lane.positions) for lane in lanes]
        total = sum(lengths)
        if total > self.packed:
            raise ValueError(f"{total} packed tokens exceed the program's capacity {self.packed}")
        if self.source == ct.VALUE_SOURCE_TOKEN_ROW:
            values: npt.NDArray[np.int64] = np.repeat(np.arange(len(lanes), dtype=np.int64), lengths)
        else:
            extract = _TOKEN_SOURCES[self.source]
            pieces = [extract(lane, row) for row, lane in enumerate(lanes)]
            for row, (piece, length) in enumerate(zip(pieces, lengths, strict=True)):
                if len(piece) != length:
                    raise ValueError(
                        f"lane {row} supplies {len(piece)} values for {self.destination!r}, "
                        f"but its query length is {length}"
                    )
            values = _concatenated(pieces, total)
        flat[:total] = self._values(values, flat)  # the offset added, and assigned as the Python values would be
        if self.indexing != ct.INDEXING_ACTIVE_ROW:
            flat[total : self.packed] = self.padding

    def _write_packed_vectors(
        self,
        vectors: Sequence[Sequence[npt.NDArray[np.generic] | None]],
        lanes: Sequence[Lane],
        dest: npt.NDArray[np.generic],
    ) -> None:
        """Each lane's rows (one a packed token, none for a lane without them) in packed order; rows
        without a vector and rows past the lanes' tokens hold the padding."""
        total = sum(lane.query_length for lane in lanes)
        if total > self.packed:
            raise ValueError(f"{total} packed tokens exceed the program's capacity {self.packed}")
        cursor = 0
        for row, (lane, rows) in enumerate(zip(lanes, vectors, strict=True)):
            length = lane.query_length
            if rows and len(rows) != length:
                raise ValueError(
                    f"lane {row} supplies {len(rows)} values for {self.destination!r}, but its query length is {length}"
                )
            for index in range(length):
                vector = rows[index] if rows else None
                if vector is None:
                    dest[cursor + index] = self.padding
                else:
                    dest[cursor + index, : len(vector)] = vector
                    dest[cursor + index, len(vector) :] = self.padding
            cursor += length
        dest[cursor : self.packed] = self.padding

    def _write_vectors(self, lanes: Sequence[Lane], dest: npt.NDArray[np.generic], frame: int) -> None:
        source = self.source
        if source == ct.VALUE_SOURCE_CANDIDATE_IDS:
            width = dest.shape[-1] if dest.ndim > 1 else 0
            for row, lane in enumerate(lanes):
                if len(lane.candidates) > width:
                    raise ValueError(
                        f"lane {row} offers {len(lane.candidates)} candidates; {self.destination!r} holds {width}"
                    )
            candidates = [np.asarray(lane.candidates, dtype=np.int64) if lane.candidates else None for lane in lanes]
            self._write_vector_rows(candidates, dest)
            return
        masks = source == ct.VALUE_SOURCE_GRAMMAR_MASK
        vectors: list[npt.NDArray[np.generic] | None] = [
            lane.grammar_mask if masks else lane.prompt_histogram for lane in lanes
        ]
        self._write_vector_rows(vectors, dest, self._vector_memory(dest, frame))

    def _vector_memory(self, dest: npt.NDArray[np.generic], frame: int) -> _HeldRows:
        """Which rows of this grammar-mask or prompt-histogram destination hold padding already: rows of
        unconstrained lanes (most of them, and every row past the lanes) are then not written again. A
        mask row is as wide as the vocabulary in 32-bit words, a histogram row one byte an id, so
        rewriting every row each round would cost megabytes of host writes (256 rows of a 128256-id
        vocabulary: 4 MB of mask words)."""
        return self.memory.vector_rows(frame, self.destination, max(dest.shape[0], self.rows), self.padding)

    def _write_vector_rows(
        self,
        vectors: Sequence[npt.NDArray[np.generic] | None],
        dest: npt.NDArray[np.generic],
        held: _HeldRows | None = None,
    ) -> None:
        """Each lane's vector (padded to the row) or padding; with ``held``, padding only into the rows it
        does not record as padded, and it records what the rows now hold."""
        absent = []
        for row, vector in enumerate(vectors):
            if vector is None:
                absent.append(row)
            else:
                dest[row, : len(vector)] = vector
                dest[row, len(vector) :] = self.padding
                if held is not None:
                    held.unknown(row)
        self._pad_vector_rows(dest, np.asarray(absent, dtype=np.intp), held)
        if self.indexing == ct.INDEXING_SUBMISSION_ROW:
            self._pad_vector_rows(dest, np.arange(len(vectors), self.rows, dtype=np.intp), held)

    def _pad_vector_rows(
        self, dest: npt.NDArray[np.generic], rows: npt.NDArray[np.intp], held: _HeldRows | None
    ) -> None:
        if held is None:
            dest[rows] = self.padding
            return
        stale = rows[~held.padded_at(rows)]
        if stale.size:
            dest[stale] = self.padding
            held.pad(stale)

    def _write_eos(self, dest: npt.NDArray[np.generic], count: int, slots: Sequence[int]) -> None:
        """The core's EOS ids: once from element 0 (SCALAR), else as the row of every lane (its submission
        row, or its slot with PHYSICAL_REQUEST_ROW); the rest of a row, and with SUBMISSION_ROW every row
        past the lanes, is padding."""
        row = self.eos_ids
        if row is None:
            raise RuntimeError(f"{self.destination!r} binds EOS_IDS without resolved ids")
        if self.indexing == ct.INDEXING_SCALAR:
            dest.reshape(-1)[:] = row
            return
        rows = dest.reshape(dest.shape[0], -1)
        if self.indexing == ct.INDEXING_PHYSICAL_REQUEST_ROW:
            rows[list(slots)] = row
            return
        rows[:count] = row
        if self.indexing == ct.INDEXING_SUBMISSION_ROW:
            rows[count : self.rows] = self.padding

    def _write_page_tables(
        self, tables: Sequence[tuple[int, int, Sequence[int]]], dest: npt.NDArray[np.generic], frame: int, key: str
    ) -> None:
        """Write ``tables`` into ``dest`` (the whole row, or one view's columns), remembered under ``key``."""
        self.memory.page_versions.pop((frame, key), None)
        held = self.memory.held(frame, key, max(dest.shape[0], self.rows))
        width = dest.shape[-1]
        count = len(tables)
        # what each row holds, read once as Python values (a round of many lanes compares them lane by lane)
        known, held_slots = held.known[:count].tolist(), held.slot[:count].tolist()
        held_generations, held_counts = held.generation[:count].tolist(), held.count[:count].tolist()
        for row, (slot, generation, pages) in enumerate(tables):
            length = len(pages)
            if length > width:
                raise ValueError(f"lane {row} needs {length} pages; the page table holds {width}")
            same = known[row] and held_slots[row] == slot and held_generations[row] == generation
            start = held_counts[row] if same else 0  # pages already staged for this lane's request
            if start > length:
                start = 0
            if start == length and start:
                continue  # the row holds exactly this table already
            if start == 0:
                dest[row, length:] = self.padding
            dest[row, start:length] = np.asarray(pages[start:], dtype=dest.dtype) + self.offset
            held.hold(row, slot, generation, length)
        if self.indexing == ct.INDEXING_SUBMISSION_ROW and len(tables) < self.rows:
            rows = np.arange(len(tables), self.rows, dtype=np.intp)
            stale = rows[~held.padded_at(rows)]
            if stale.size:
                dest[stale] = self.padding
                held.pad(stale)

    # -- batches --------------------------------------------------------------------------
    def write_batch(self, batch: LaneBatch, frame: int, staging: Staging, *, tails: bool, same_lanes: bool) -> None:
        """Write this binding's values of ``batch``: the same bytes as its lanes' :meth:`write`.

        ``tails``: also write what lies past the lanes (padding), else it is staged already. ``same_lanes``:
        the page-table rows of the lanes hold their tables as the memory records (the tail is padded).
        """
        dest = staging[self.destination]
        source = self.source
        if source in _IMAGE_SOURCES:  # a batch's lanes carry no images
            self._write_images([], dest)
            if source == ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT:
                dest[: batch.count] = self.padding
        elif source in _ROW_SOURCES:
            self._batch_rows(batch, dest, tails)
        elif source in _TOKEN_SOURCES:
            self._batch_tokens(batch, dest, frame, tails)
        elif source in _PACKED_VECTOR_SOURCES:  # a batch's lanes have no per-position vectors
            dest[: self.packed] = self.padding
        elif source == ct.VALUE_SOURCE_PAGE_TABLE:
            for key, band in self._page_bands(dest):
                self._batch_page_tables(batch, band, frame, same_lanes, key)
            if self.gaps:
                self._pad_gaps(dest, batch.count)
        elif source == ct.VALUE_SOURCE_CANDIDATE_IDS:
            self._batch_candidates(batch, dest, frame, tails)
        elif source in _VECTOR_SOURCES:
            vectors = batch.grammar_masks if source == ct.VALUE_SOURCE_GRAMMAR_MASK else batch.prompt_histograms
            self._write_vector_rows(
                [None] * batch.count if vectors is None else vectors, dest, self._vector_memory(dest, frame)
            )
        elif source == ct.VALUE_SOURCE_INACTIVE_PADDING:
            dest.reshape(-1)[:] = self.padding
        elif source == ct.VALUE_SOURCE_EOS_IDS:
            self._write_eos(dest, batch.count, batch.rows[ct.VALUE_SOURCE_SLOT].tolist())
        else:
            value = self.binding.constant if source == ct.VALUE_SOURCE_CONSTANT else batch.count
            dest.reshape(-1)[0] = value + self.offset

    def _cast(self, column: Column, dest: npt.NDArray[np.generic]) -> Column | list[int] | list[float]:
        """``column`` as numpy may assign it: itself when that equals assigning its Python values, else those."""
        if column.dtype is self._cast_dtype and dest.dtype is self._cast_dest:
            mode = self._cast_mode
        else:
            mode = self._cast_mode = _cast_mode(column.dtype, dest.dtype)
            self._cast_dtype, self._cast_dest = column.dtype, dest.dtype
        if mode == _DIRECT or (mode == _CHECKED and not column.shape[0]):
            return column
        if mode == _CHECKED:
            low, high = integer_range(dest.dtype) if dest.dtype.kind in "iu" else (-_EXACT, _EXACT)
            if low <= column.min() and column.max() <= high:
                return column
        return column.tolist()  # type: ignore[no-any-return]

    def _values(self, column: Column, dest: npt.NDArray[np.generic]) -> Column | list[int] | list[float]:
        """What to assign for ``column`` plus this binding's offset (added to Python values, as lanes add it)."""
        if self.offset:
            offset = self.offset
            return [value + offset for value in column.tolist()]
        return self._cast(column, dest)

    def _batch_rows(self, batch: LaneBatch, dest: npt.NDArray[np.generic], tails: bool) -> None:
        column = batch.rows[self.source]
        count = batch.count
        indexing = self.indexing
        if indexing == ct.INDEXING_PHYSICAL_REQUEST_ROW or indexing == ct.INDEXING_SCALAR:
            offset = self.offset
            values = [value + offset for value in column.tolist()] if offset else column.tolist()
            if indexing == ct.INDEXING_SCALAR:
                dest.reshape(-1)[0] = values[0] if values else self.padding
            else:
                for slot, value in zip(batch.rows[ct.VALUE_SOURCE_SLOT].tolist(), values, strict=True):
                    dest[slot] = value
            return
        dest[:count] = self._values(column, dest)
        if tails and indexing == ct.INDEXING_SUBMISSION_ROW:
            dest[count : self.rows] = self.padding

    def _batch_candidates(self, batch: LaneBatch, dest: npt.NDArray[np.generic], frame: int, tails: bool) -> None:
        """Each lane's copied proposals, then the padding, in its row (a lane without any: padding alone);
        past the lanes, the padding (SUBMISSION_ROW)."""
        count = batch.count
        offered = batch.rows.get(ct.VALUE_SOURCE_CANDIDATE_COUNT)
        width = dest.shape[-1] if dest.ndim > 1 else 0
        proposals = batch.candidates
        if offered is None or proposals is None or (count and int(offered.max()) > min(width, proposals.shape[1])):
            self.write(Submission(batch.to_lanes(), 0), frame, {self.destination: dest})  # fails as lanes fail
            return
        taken = min(width, proposals.shape[1])
        offers = np.arange(taken) < offered[:, None]
        rows = dest[:count]
        rows[:, :taken] = np.where(offers, proposals[:, :taken], self.padding)
        rows[:, taken:] = self.padding
        if tails and self.indexing == ct.INDEXING_SUBMISSION_ROW:
            dest[count : self.rows] = self.padding

    def _batch_tokens(self, batch: LaneBatch, dest: npt.NDArray[np.generic], frame: int, tails: bool) -> None:
        column = batch.tokens.get(self.source)
        if column is None:
            lengths = batch.rows[ct.VALUE_SOURCE_QUERY_LENGTH]
            if self.source == ct.VALUE_SOURCE_TOKEN_ROW:
                column = np.repeat(np.arange(batch.count, dtype=np.int64), lengths.astype(np.int64))
        if column is None:  # the lanes supply no values for this source
            bad = np.flatnonzero(lengths)
            if bad.shape[0]:
                row = int(bad[0])
                raise ValueError(
                    f"lane {row} supplies 0 values for {self.destination!r}, "
                    f"but its query length is {int(lengths[row])}"
                )
            column = np.zeros(0, dtype=np.int64)
        total = column.shape[0]
        flat = dest.reshape(-1)
        if total > flat.shape[0]:  # written lane by lane, as the lanes would fail
            self.write(Submission(batch.to_lanes(), 0), frame, {self.destination: dest})
            return
        flat[:total] = self._values(column, dest)
        if total > self.packed:
            raise ValueError(f"{total} packed tokens exceed the program's capacity {self.packed}")
        if tails and self.indexing != ct.INDEXING_ACTIVE_ROW:
            flat[total : self.packed] = self.padding

    def _batch_page_tables(
        self, batch: LaneBatch, dest: npt.NDArray[np.generic], frame: int, same_lanes: bool, band: str
    ) -> None:
        key = (frame, band)
        versions = self.memory.page_versions
        if same_lanes and batch.page_version is not None and versions.get(key) == batch.page_version:
            return  # no page was added since this frame staged these lanes' tables
        versions.pop(key, None)
        count = batch.count
        counts = batch.page_counts
        width = dest.shape[-1]
        held = self.memory.held(frame, band, max(dest.shape[0], self.rows))
        staged = held.count[:count]
        if same_lanes:  # the usual change: some lanes have one page more than their rows hold
            grown = np.flatnonzero(counts - staged)
            if grown.shape[0] == 0:
                if batch.page_version is not None:
                    versions[key] = batch.page_version
                return
            first = staged[grown]
            if bool(np.all(counts[grown] == first + 1)) and int(first.max()) < min(width, batch.page_source.shape[1]):
                pages = cells(batch.page_source, batch.page_index[grown], first)
                if _fits(pages, dest.dtype):
                    set_cells(dest, grown, first, pages.astype(dest.dtype) + self.offset)
                    held.count[grown] = first + 1
                    if batch.page_version is not None:
                        versions[key] = batch.page_version
                    return
        slots = batch.rows[ct.VALUE_SOURCE_SLOT]
        generations = batch.rows[ct.VALUE_SOURCE_GENERATION]
        if count and int(counts.max()) > width:  # fails at the first such lane, after the lanes before it
            self._batch_page_tables_by_lane(batch, dest, frame, band)
            return
        if same_lanes:  # rows 0..count hold these lanes' tables, each of at least one page; the tail is staged
            changed = counts != staged
            if not changed.any():
                if batch.page_version is not None:
                    versions[key] = batch.page_version
                return
            rewrite = counts < staged
        else:
            same = held.known[:count] & (held.slot[:count] == slots) & (held.generation[:count] == generations)
            rewrite = ~same | (counts < staged) | (staged == 0)
            changed = counts != staged
        rewritten = np.flatnonzero(rewrite)
        grown = np.flatnonzero(changed & ~rewrite)
        touched = np.concatenate((rewritten, grown))
        source_width = min(width, batch.page_source.shape[1])
        tables = batch.page_source[batch.page_index[touched], :source_width]
        filled = np.arange(source_width) < counts[touched, None]
        if not _fits(tables[filled], dest.dtype):
            self._batch_page_tables_by_lane(batch, dest, frame, band)
            return
        values = tables.astype(dest.dtype) + self.offset
        done = rewritten.shape[0]
        if done:
            block = np.empty((done, *dest.shape[1:]), dtype=dest.dtype)
            block[...] = self.padding
            block[:, :source_width][filled[:done]] = values[:done][filled[:done]]
            dest[rewritten] = block
        if grown.shape[0]:
            first = staged[grown]
            last = counts[grown]
            if bool(np.all(last - first == 1)):
                set_cells(dest, grown, first, cells(values, done + np.arange(grown.shape[0]), first))
            else:
                for row, (begin, end) in enumerate(zip(first.tolist(), last.tolist(), strict=True), done):
                    dest[int(touched[row]), begin:end] = values[row, begin:end]
        if batch.page_version is not None:
            versions[key] = batch.page_version
        if same_lanes:
            held.count[:count] = counts
            return
        held.slot[:count], held.generation[:count], held.count[:count] = slots, generations, counts
        held.known[:count] = True
        if self.indexing == ct.INDEXING_SUBMISSION_ROW and count < self.rows:
            tail = slice(count, self.rows)
            padded = held.known[tail] & (held.slot[tail] == -1) & (held.generation[tail] == -1)
            padded &= held.count[tail] == 0
            unpadded = np.flatnonzero(~padded) + count
            if unpadded.shape[0]:
                dest[unpadded] = self.padding
                held.pad(unpadded)

    def _batch_page_tables_by_lane(
        self, batch: LaneBatch, dest: npt.NDArray[np.generic], frame: int, band: str
    ) -> None:
        index = batch.page_index.tolist()
        tables = [
            (slot, generation, batch.page_source[index[row], :pages].tolist())
            for row, (slot, generation, pages) in enumerate(
                zip(
                    batch.rows[ct.VALUE_SOURCE_SLOT].tolist(),
                    batch.rows[ct.VALUE_SOURCE_GENERATION].tolist(),
                    batch.page_counts.tolist(),
                    strict=True,
                )
            )
        ]
        self._write_page_tables(tables, dest, frame, band)


_EXACT = 2**53
"""Integers of at most this magnitude reach a float destination alike from Python ints and from int64."""

_DIRECT, _CHECKED, _PYTHON = 0, 1, 2
"""How a column reaches a destination: assigned as it is, assigned after a range check, or as Python values."""


def image_values(tensor: npt.NDArray[Any], dtype: np.dtype[Any], name: str) -> npt.NDArray[Any]:
    """``tensor``'s values as a destination of ``dtype`` holds them: a safe cast, floats into any float
    width, a float into a ``uint16`` destination as bfloat16 bit patterns (round to nearest even), integers
    into a narrower integer when every value fits; anything else is a ValueError naming the tensor."""
    kind, dest_kind = tensor.dtype.kind, dtype.kind
    if np.can_cast(tensor.dtype, dtype, casting="safe") or (kind == "f" and dest_kind == "f"):
        return tensor.astype(dtype, copy=False)
    if kind == "f" and dtype == np.dtype(np.uint16):
        bits = np.ascontiguousarray(tensor, dtype=np.float32).view(np.uint32).astype(np.uint64)
        return ((bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(
            np.uint16
        )
    if kind in "iu" and dest_kind in "iu":
        low, high = integer_range(dtype)
        if not tensor.size or (low <= int(tensor.min()) and int(tensor.max()) <= high):
            return tensor.astype(dtype)
    if kind in "iu" and dest_kind == "f" and (not tensor.size or int(np.abs(tensor).max()) <= _EXACT):
        return tensor.astype(dtype)
    raise ValueError(f"image tensor {name!r} of dtype {tensor.dtype} does not fit a {dtype} destination")


def _cast_mode(column: np.dtype[np.generic], dest: np.dtype[np.generic]) -> int:
    kind, dest_kind = column.kind, dest.kind
    if dest_kind == "b":
        return _DIRECT if kind in "biuf" else _PYTHON
    if dest_kind == "f":
        if kind in "bf":
            return _DIRECT
        if kind in "iu":
            return _DIRECT if column.itemsize <= 4 else _CHECKED
        return _PYTHON
    if dest_kind in "iu":
        if kind == "b" or (kind in "iu" and np.can_cast(column, dest)):
            return _DIRECT
        return _CHECKED if kind in "iu" else _PYTHON
    return _PYTHON


def cells(table: npt.NDArray[Any], rows: npt.NDArray[np.int64], columns: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``table[rows, columns]`` read through one flat index (numpy releases the GIL while indexing with two
    index arrays, which hands it to other threads in the middle of a round)."""
    if table.ndim != 2 or not table.flags.c_contiguous:
        return cast("npt.NDArray[Any]", table[rows, columns])
    return cast("npt.NDArray[Any]", table.reshape(-1)[rows * table.shape[1] + columns])


def set_cells(
    table: npt.NDArray[Any], rows: npt.NDArray[np.int64], columns: npt.NDArray[Any], values: npt.NDArray[Any]
) -> None:
    """``table[rows, columns] = values`` through one flat index (see :func:`cells`)."""
    if table.ndim != 2 or not table.flags.c_contiguous:
        table[rows, columns] = values
        return
    table.reshape(-1)[rows * table.shape[1] + columns] = values


def _eos_vector(
    binding: ct.ValueBinding, graph: PreparedGraph, dest: npt.NDArray[np.generic], eos_ids: Sequence[int]
) -> npt.NDArray[np.generic]:
    """What an EOS_IDS binding writes per row (or once, SCALAR): the ids, then the binding's padding."""
    where = f"graph {graph.name!r} binds EOS_IDS to {binding.destination!r}"
    if not eos_ids:
        raise ValueError(f"{where}, but its packer was given no EOS ids")
    indexing = binding.indexing
    if indexing == ct.INDEXING_SCALAR:
        width = dest.size
    elif indexing in (ct.INDEXING_SUBMISSION_ROW, ct.INDEXING_ACTIVE_ROW, ct.INDEXING_PHYSICAL_REQUEST_ROW):
        width = dest.size // dest.shape[0] if dest.ndim > 1 else 0
    else:
        name = ct.Indexing.Name(indexing) if indexing in ct.Indexing.values() else str(indexing)
        raise UnsupportedFeatureError(f"{where} with {name} indexing, which packing does not supply")
    if width < len(eos_ids):
        raise UnsupportedFeatureError(
            f"{where}, whose {'entries' if indexing == ct.INDEXING_SCALAR else 'rows'} hold {width} values; "
            f"the core has {len(eos_ids)} EOS ids"
        )
    low, high = integer_range(dest.dtype) if dest.dtype.kind in "iu" else (-_EXACT, _EXACT)
    values = [int(v) for v in eos_ids]
    if not all(low <= v <= high for v in (*values, binding.padding)):
        raise UnsupportedFeatureError(f"{where}, whose dtype {dest.dtype} cannot hold the EOS ids or padding")
    row = np.full(width, binding.padding, dtype=dest.dtype)
    row[: len(values)] = values
    return row


def _fits(values: npt.NDArray[np.int64], dtype: np.dtype[np.generic]) -> bool:
    """Whether int64 page ids convert to ``dtype`` as the same Python ints would (no wrap, no rounding)."""
    if dtype.kind not in "iu":
        return False
    if not values.shape[0] or _holds_int64(dtype):
        return True
    low, high = integer_range(dtype)
    return bool(low <= int(values.min()) and int(values.max()) <= high)


@functools.cache
def _holds_int64(dtype: np.dtype[np.generic]) -> bool:
    return bool(np.can_cast(np.int64, dtype))


class GraphPacker:
    """The resolved bindings of one graph."""

    def __init__(
        self,
        graph: PreparedGraph,
        staging: Staging,
        memory: PageTableMemory | None = None,
        *,
        eos_ids: Sequence[int] = (),
    ) -> None:
        """``eos_ids``: the core's EOS ids, which an ``EOS_IDS`` binding stages."""
        self.graph = graph
        missing = [b.destination for b in graph.contract.bindings if b.destination not in staging]
        if missing:
            raise UnsupportedFeatureError(f"graph {graph.name!r} binds destinations without staging: {missing}")
        shared = memory if memory is not None else PageTableMemory()
        self.memory = shared
        self.writers = [_BindingWriter(b, graph, staging, shared, eos_ids) for b in graph.contract.bindings]
        self._changing: dict[frozenset[int], list[_BindingWriter]] = {}

    def pack(self, submission: Submission, frame: int, staging: Staging) -> None:
        """Write every bound value of ``submission`` into ``staging`` (one frame's transport)."""
        lanes = submission.lanes
        if len(lanes) > self.graph.extents.batch_capacity:
            raise ValueError(
                f"{len(lanes)} lanes exceed {self.graph.name!r}'s batch capacity "
                f"{self.graph.extents.batch_capacity}"
            )
        memory = self.memory
        if not isinstance(lanes, LaneBatch):
            memory.invalidate(frame)
            for writer in self.writers:
                writer.write(submission, frame, staging)
            return
        staged_as = lanes.staged_as
        last = memory.batches.get(frame)
        if staged_as is not None and last == (
            self.graph.name,
            staged_as,
            lanes.count,
            memory.versions.get(frame, 0),
        ):  # this graph staged the same lanes' unchanged values here, and nothing else wrote this frame since
            # lanes whose query lengths change (a speculative batch) leave other padding past their tokens
            tails = ct.VALUE_SOURCE_QUERY_LENGTH not in lanes.unchanged
            try:
                for writer in self._changing_writers(lanes.unchanged):
                    writer.write_batch(lanes, frame, staging, tails=tails, same_lanes=True)
            except BaseException:
                memory.batches.pop(frame, None)
                raise
            return
        version = memory.invalidate(frame)
        memory.batches.pop(frame, None)
        for writer in self.writers:
            writer.write_batch(lanes, frame, staging, tails=True, same_lanes=False)
        if staged_as is not None and lanes.page_counts.all():
            memory.batches[frame] = (self.graph.name, staged_as, lanes.count, version)

    def _changing_writers(self, unchanged: frozenset[int]) -> list[_BindingWriter]:
        writers = self._changing.get(unchanged)
        if writers is None:
            writers = self._changing[unchanged] = [
                w for w in self.writers if not w.constant_in(unchanged)
            ]
        return writers
