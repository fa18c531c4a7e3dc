"""Per-slot request progress: the one copy of what every running request has done.

Owns :class:`SlotTable`, numpy columns indexed by request slot (the physical request row a running
request holds): its phase, consumed endpoint, generated count, token ids, page table, published pages,
generation and output limit, and its sampling values. Nothing else keeps a running request's progress:
:class:`RequestState` holds what a request is (its id, limits, host gate, arrival) and, only while it
waits for a slot, the tokens it will resume from. The scheduler's planner reads the table to plan a
round; its completion writes the table from a round's results.

Every write that can change which requests a round takes (admission, release, a phase change,
cancellation) goes through a method here that counts :attr:`SlotTable.membership`; a planner's cached
decode cohort is current exactly while that count is unchanged. Page additions are counted in
:attr:`SlotTable.page_adds` (a page table that saw that count is complete).

A request of a core with prefix checkpoints also carries, on its :class:`RequestState`, the checkpoint it
is taking (phase ``CHECKPOINT``) or restoring, and the prompt ids its prompt-presence row marks.

With a sliding-window history a row's leading pages are released while the request runs
(:meth:`SlotTable.release_leading`, counted in :attr:`SlotTable.released`); the row keeps their former
ids, so positions still index it directly.

The token matrix is ``slots x context`` (as an input batch of vLLM keeps it): appending a decode
round's tokens is one vectorized write, and prefill chunks, page hashes and prompt histograms read
slices of a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from helios_core.runtime.checkpoints import Checkpoint
from helios_core.runtime.gates import HostGate
from helios_core.runtime.messages import PreparedRequest
from helios_core.runtime.packing import set_cells
from helios_core.sampling import SAMPLING_PARAMETERS, SamplingParams


class Phase(IntEnum):
    """What a slot's request needs next."""

    FREE = 0
    """No request holds the slot."""
    INITIALIZE = 1
    """Its sampling state rows are initialized next (a newly admitted request)."""
    PREFILL = 2
    """Host-fed tokens up to its prefill target are computed next."""
    RESTORE = 3
    """Its snapshot is restored next (its prefix pages are prefilled)."""
    DECODE = 4
    """It samples one token per round; the pending token is device-owned."""
    SNAPSHOT = 5
    """It is preempted: its committed state is snapshotted next, then it leaves the slot."""
    ENDED = 6
    """It finished or failed while a later round of it was in flight; the slot is released at the fence."""
    RESUME = 7
    """Its known tokens past a restored snapshot, or past the start of a continued assistant message, are
    computed next by RESUME programs (the last chunk samples)."""
    CHECKPOINT = 8
    """It prefilled to a page boundary of its known tokens: its committed state there is copied into a
    snapshot row next, published as a reusable checkpoint; then it prefills on (it keeps its slot)."""


@dataclass(eq=False, slots=True)
class RequestState:
    """What a request is, and what it carries while it has no slot. Written by the scheduler only.

    Progress (consumed endpoint, generated tokens, pages, phase) lives in the :class:`SlotTable` row
    ``slot`` while the request runs; ``tokens`` holds its prompt and generated tokens only while it
    waits (before admission and after preemption).
    """

    request: PreparedRequest
    request_id: str
    prompt_len: int
    arrival: int
    max_tokens: int
    ignore_eos: bool
    observe: bool
    """Stamp each generated token (the request observes timestamps)."""
    top: int
    """Top alternatives to read per sampled token (0 when not asked)."""
    sampling: SamplingParams
    """Its sampling values, exactly as the per-slot columns hold them."""
    tokens: list[int]
    """Prompt followed by every generated token, while the request waits; empty while it holds a slot."""
    generated: int = 0
    """Tokens generated before the request last left a slot (the table counts them while it runs)."""
    slot: int = -1
    gate: HostGate | None = None
    """Detokenizer, stops and grammar of this request (created at admission); None for a request without
    stops or structured output, whose stream detokenizes its tokens."""
    holds_rounds: bool = False
    """Its gate needs each token before the next round is planned (no follow-up rounds)."""
    cancelled: bool = False
    reused_tokens: int = -1
    snapshot_row: int = -1
    """The snapshot row holding this preempted request's committed state, or -1."""
    snapshot_endpoint: int = 0
    """Consumed tokens at the snapshot (an exact token endpoint)."""
    cuts: tuple[int, ...] | None = None
    """Token offsets where reuse of a published prefix may end (the core's prefix-boundary rules applied
    to the prompt's layout), ascending; None when any offset may."""
    continuation: int = -1
    """Where the content of a continued final assistant message starts (its tokens from here are resumed,
    not prefilled as a new turn); -1 for a prompt that opens a new turn."""
    scores: list[float] = field(default_factory=list)
    """Prompt scores collected so far (prompt logprobs), one per prefilled prompt token."""
    scores_sent: bool = False
    """The PromptScores event was published (later prefills, after preemption, need no scoring)."""
    checkpoint_row: int = -1
    """The snapshot row its pending checkpoint is copied into (phase CHECKPOINT), or -1."""
    checkpoint_key: bytes = b""
    """The chain key of that checkpoint's prefix."""
    restoring: Checkpoint | None = None
    """The published checkpoint this admitted request restores after ``initialize`` (pinned meanwhile)."""
    presence: frozenset[int] | None = None
    """The token ids its prompt-presence state row marks, while its sampling state rows hold what a
    prefix checkpoint may copy (initialized in its current slot, or restored from a checkpoint: no
    output counts); None otherwise (it publishes no checkpoint)."""
    acceptance: float = 0.5
    """How often this request's proposals have held lately (an average over its speculative rounds,
    recent ones weighing most); the planner offers as many proposals as it makes worthwhile. The table's
    ``acceptance`` column holds it while the request holds a slot."""

    @property
    def scoring(self) -> bool:
        """This request's prefill must run on scored-prefill programs."""
        return self.request.prompt_logprobs and not self.scores_sent


Ints = npt.NDArray[np.int64]


class SlotTable:
    """The progress of every running request, one row per slot."""

    def __init__(self, slots: int, context: int, page_tokens: int, pages_per_row: int) -> None:
        self.size = slots
        self.page_tokens = page_tokens
        positions = np.int32 if context + 2 < 2**31 else np.int64  # int32 columns stage as they are
        self.phase = np.zeros(slots, dtype=np.int8)
        self.consumed: npt.NDArray[np.signedinteger[Any]] = np.zeros(slots, dtype=positions)
        """Tokens whose cache entries are committed (the consumed endpoint)."""
        self.generated: npt.NDArray[np.signedinteger[Any]] = np.zeros(slots, dtype=positions)
        self.prompt_len = np.zeros(slots, dtype=np.int64)
        self.target = np.zeros(slots, dtype=np.int64)
        """Where prefill stops: the snapshot endpoint while a restore is pending, else every known token."""
        self.generation = np.zeros(slots, dtype=np.int64)
        self.max_tokens = np.zeros(slots, dtype=np.int64)
        self.ignore_eos = np.zeros(slots, dtype=bool)
        self.cancelled = np.zeros(slots, dtype=bool)
        self.acceptance = np.zeros(slots, dtype=np.float64)
        """Each running request's recent acceptance rate (:attr:`RequestState.acceptance` while it waits)."""
        self.tokens = np.zeros((slots, max(context, 1)), dtype=np.int32)
        """Prompt and generated token ids per slot, in position order."""
        self.token_cells = self.tokens.reshape(-1)
        """The token matrix as one flat view (slot x context + position)."""
        width = max(pages_per_row, -(-context // page_tokens), 1)
        self.pages = np.zeros((slots, width), dtype=np.int64)
        self.page_starts = np.zeros((slots, width), dtype=np.int64)
        """Each page's first cache slot (page id x page_tokens)."""
        self.page_count = np.zeros(slots, dtype=np.int64)
        self.released = np.zeros(slots, dtype=np.int64)
        """Leading pages of each row released while the request runs (with a sliding-window history:
        wholly before every window a later round attends). Their entries keep their former page ids, so
        row indices stay positions // page_tokens and packed rows never change; attention never reads them."""
        self.published = np.zeros(slots, dtype=np.int64)
        """Complete pages whose hashes are known (or will be at the next deferred publication)."""
        self.sampling = {p.source: np.zeros(slots, dtype=p.column_dtype) for p in SAMPLING_PARAMETERS}
        """One column per declared sampling parameter, by the value source that packs it."""
        self.hashes: list[list[bytes]] = [[] for _ in range(slots)]
        """Chain hashes of each slot's published pages, in order."""
        self.requests: list[RequestState | None] = [None] * slots
        self.membership = 0
        """Counts every change of which requests hold slots or of a running request's phase."""
        self.page_adds = 0
        """Counts page additions (a page table that saw this many is complete)."""
        self.completions = 0
        """Counts applied rounds (minima of progress counted at this many are current)."""
        self.page_view = self.pages.view()
        """The page tables, read-only: a plan reads each lane's first ``page_count`` entries, which nothing
        changes while the slot is held (a slot's table only grows)."""
        self.page_view.flags.writeable = False

    # -- holding and releasing -----------------------------------------------------------------------
    def hold(
        self,
        slot: int,
        state: RequestState,
        *,
        generation: int,
        pages: list[int],
        hashes: list[bytes],
        consumed: int,
        phase: Phase,
    ) -> None:
        """Give ``slot`` to ``state``: its tokens, pages and limits move into the row."""
        tokens = state.tokens
        self.requests[slot] = state
        self.tokens[slot, : len(tokens)] = tokens
        self.prompt_len[slot] = state.prompt_len
        self.generated[slot] = len(tokens) - state.prompt_len
        self.target[slot] = state.snapshot_endpoint if state.snapshot_row >= 0 else len(tokens)
        self.consumed[slot] = consumed
        self.generation[slot] = generation
        self.max_tokens[slot] = state.max_tokens
        self.ignore_eos[slot] = state.ignore_eos
        self.cancelled[slot] = state.cancelled
        self.acceptance[slot] = state.acceptance
        self.hashes[slot] = hashes
        self.published[slot] = len(hashes)
        self.page_count[slot] = 0
        self.released[slot] = 0
        self.add_pages(slot, pages)
        for parameter in SAMPLING_PARAMETERS:
            self.sampling[parameter.source][slot] = getattr(state.sampling, parameter.name)
        state.tokens = []
        state.slot = slot
        self.phase[slot] = phase
        self.membership += 1

    def release(self, slot: int, *, keep_tokens: bool) -> list[int]:
        """Free ``slot``: its page ids (to release), and its tokens moved back to the request when
        ``keep_tokens`` (it will wait for a slot again)."""
        state = self.requests[slot]
        pages = self.held_pages(slot)
        if state is not None:
            state.generated = int(self.generated[slot])
            state.acceptance = float(self.acceptance[slot])
            if keep_tokens:
                state.tokens = self.token_list(slot)
            state.slot = -1
        self.requests[slot] = None
        self.hashes[slot] = []
        self.page_count[slot] = 0
        self.released[slot] = 0
        self.published[slot] = 0
        self.phase[slot] = Phase.FREE
        self.membership += 1
        return pages

    def phase_of(self, slot: int) -> int:
        """``slot``'s phase as a Python int, to compare with a :class:`Phase` member (comparing the numpy
        scalar itself makes numpy probe the enum class for array protocols first: microseconds a lane)."""
        return int(self.phase[slot])

    def set_phase(self, slot: int, phase: Phase) -> None:
        self.phase[slot] = phase
        self.membership += 1

    def cancel(self, slot: int) -> None:
        self.cancelled[slot] = True
        self.membership += 1

    # -- pages ---------------------------------------------------------------------------------------
    def add_pages(self, slot: int, pages: list[int]) -> None:
        count = int(self.page_count[slot])
        end = count + len(pages)
        self.pages[slot, count:end] = pages
        self.page_starts[slot, count:end] = self.pages[slot, count:end] * self.page_tokens
        self.page_count[slot] = end
        self.page_adds += 1

    def add_page_each(self, slots: Ints, pages: list[int]) -> None:
        """One more page for each of ``slots`` (distinct), in order."""
        ends = self.page_count[slots]
        page_ids = np.asarray(pages, dtype=np.int64)
        set_cells(self.pages, slots, ends, page_ids)
        set_cells(self.page_starts, slots, ends, page_ids * self.page_tokens)
        self.page_count[slots] = ends + 1
        self.page_adds += 1

    def page_list(self, slot: int) -> list[int]:
        """``slot``'s page-table row as packed: every entry up to its page count (released ones included)."""
        return self.pages[slot, : int(self.page_count[slot])].tolist()  # type: ignore[no-any-return]

    def held_pages(self, slot: int) -> list[int]:
        """The pages ``slot`` still references (its row after the released leading pages), in position order."""
        start, end = int(self.released[slot]), int(self.page_count[slot])
        return self.pages[slot, start:end].tolist()  # type: ignore[no-any-return]

    def release_leading(self, slot: int, count: int) -> list[int]:
        """Mark ``slot``'s first ``count`` pages released; the page ids it held among them, to release."""
        start = int(self.released[slot])
        end = min(count, int(self.page_count[slot]))
        if end <= start:
            return []
        self.released[slot] = end
        return self.pages[slot, start:end].tolist()  # type: ignore[no-any-return]

    def cache_slots(self, slot: int, positions: range) -> list[int]:
        """The cache slot (page id x page_tokens + offset) of each of ``positions`` of ``slot``."""
        if not positions:
            return []
        pt = self.page_tokens
        at = np.arange(positions.start, positions.stop, positions.step, dtype=np.int64)
        return (self.page_starts[slot][at // pt] + at % pt).tolist()  # type: ignore[no-any-return]

    # -- tokens --------------------------------------------------------------------------------------
    def length(self, slot: int) -> int:
        """Prompt and generated tokens of ``slot``."""
        return int(self.prompt_len[slot] + self.generated[slot])

    def token_list(self, slot: int, start: int = 0, end: int | None = None) -> list[int]:
        stop = self.length(slot) if end is None else end
        return self.tokens[slot, start:stop].tolist()  # type: ignore[no-any-return]

    def append(self, slot: int, token: int) -> None:
        """Append one generated token to ``slot``."""
        self.tokens[slot, self.length(slot)] = token
        self.generated[slot] += 1
