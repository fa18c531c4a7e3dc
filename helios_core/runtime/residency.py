"""Request residency: the queues, slots, pages and snapshot rows requests hold, and their lifecycle.

Owns the pending admission deque (:attr:`Residency.waiting`), the running list, free slots and free
snapshot rows, and every transition of a request between them: queueing with capacity checks
(:meth:`Residency.add`, including the images a request carries: :class:`ImagePrograms`), admission
with prefix reuse (:meth:`Residency.admit`; at a first admission only up to the last cut the core's
prefix-boundary rules allow, never inside an image span; page keys carry image digests), page
reservation with
preemption of younger requests (:meth:`Residency.ensure_page`), a snapshot mark, preemption,
finishing and failing (:meth:`Residency.end`, fenced while a follow-up round of the request is in
flight), cancellation (every way a request leaves, running or waiting, goes through
:meth:`Residency.retire`, which releases each thing it holds once: a preempted request waiting for
readmission gives its snapshot row back), page publication into the prefix index, and, with a sliding-window history,
the release of pages no later round attends (:meth:`Residency.release_outside_window`), and, for a core
whose recurrent history no page holds, published prefix checkpoints: taken at page boundaries of a
prefilling request (:meth:`Residency.take_checkpoint`), published once their snapshot round validated
(:meth:`Residency.publish_checkpoint`), restored at admission from the deepest one a prompt shares (one
the host tier holds is first copied back into a snapshot row), and evicted (to the host tier, with
``--offload-checkpoints``) when a snapshot row is needed. Progress
itself lives in the :class:`~helios_core.runtime.slots.SlotTable`; both the planner and the completion
of the scheduler use this object for the transitions they cause.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from helios_core.contract import PreparedContract, PreparedGraph
from helios_core.contract.boundaries import last_cut
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.runtime.checkpoints import ON_HOST, Checkpoint, CheckpointIndex
from helios_core.runtime.gates import HostGate, format_param, gate_failure, masks_rounds
from helios_core.runtime.messages import (
    AdmissionRejected,
    Event,
    ExecutionFailed,
    Finished,
    FinishReason,
    PreparedRequest,
    PromptImage,
)
from helios_core.runtime.offload import HostCheckpointStore
from helios_core.runtime.packing import image_values
from helios_core.runtime.pages import PageAllocator, PrefixMatch, inside_span, page_images
from helios_core.runtime.slots import Phase, RequestState, SlotTable
from helios_core.runtime.stats import SchedulerStats
from helios_core.sampling import SAMPLING_PARAMETERS, SamplingLimits, SamplingParams
from helios_core.wire import contract_pb2 as ct

_NOTHING: frozenset[int] = frozenset()
_NO_MATCH = PrefixMatch((), (), 0)
_LEAVING = (Phase.SNAPSHOT, Phase.ENDED)
"""Phases of running requests that are leaving already (never chosen to make room)."""


class Residency:
    """Where every queued and running request is, and what it holds."""

    def __init__(
        self,
        contract: PreparedContract,
        allocator: PageAllocator,
        stats: SchedulerStats,
        *,
        max_active: int,
        queue_capacity: int,
        snapshot_rows: int,
        scored_prefill: bool,
        make_gate: Callable[[PreparedRequest], HostGate | None] | None,
        graphs: Iterable[PreparedGraph] | None = None,
        checkpoint_host: HostCheckpointStore | None = None,
    ) -> None:
        """``graphs``: the selected programs (the core's, by default); their image capacities bound what
        images a request may carry. ``checkpoint_host``: the host tier evicted checkpoints move to (None:
        they are dropped)."""
        self.allocator = allocator
        self.image_programs = ImagePrograms.of(contract, contract.graphs.values() if graphs is None else graphs)
        """The selected programs that take images, by operation (admission checks a request's images)."""
        self.stats = stats
        self.make_gate = make_gate
        self.sampling_limits = SamplingLimits.of(contract)
        """What the core's sampling inputs hold: a request whose values do not fit is rejected at admission."""
        self.page_tokens = contract.model.cache.page_tokens
        self.context = contract.serving.context_tokens
        self.input_vocabulary = contract.model.input_vocabulary.size
        self.scored_prefill = scored_prefill
        self.max_active = max_active
        self.queue_capacity = queue_capacity
        """The most requests :attr:`waiting` takes from outside (:meth:`add`); see :attr:`has_room`."""
        self.pages_per_row = min(
            (v.pages_per_row for v in contract.model.cache.page_table_views),
            default=-(-self.context // self.page_tokens),  # no page tables: pages only count a request's tokens
        )
        self.paged_prefixes = not any(r.kind == ct.HISTORY_KIND_RECURRENT for r in contract.model.cache.regions)
        """Published complete pages hold a prefix's whole history, so a prefix match may skip its tokens. Not
        with a recurrent history: its state rows are not in pages, and a snapshot alone restores them."""
        self.window = history_window(contract.model.cache)
        """The sliding-window extent in tokens every page-table view's history declares; 0 for unlimited."""
        self.checkpoints = (
            CheckpointIndex(self.page_tokens, allocator.chain_hash, host=checkpoint_host)
            if not self.paged_prefixes and snapshot_rows > 0
            else None
        )
        """Published prefix checkpoints (snapshot rows at exact page-boundary endpoints): how a core whose
        recurrent history no page holds reuses a shared prefix; None for other cores (pages serve) and
        for a selection without snapshot and restore programs."""
        self.paged_history = bool(contract.model.cache.page_table_views)
        """Some history is in pages too: a checkpoint is restored with the complete pages up to it."""
        self.table = SlotTable(max(max_active, 0), self.context, self.page_tokens, self.pages_per_row)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        """Requests holding a slot, in admission order."""
        self.free_slots: list[int] = list(range(max_active - 1, -1, -1))
        self.free_snapshot_rows: list[int] = list(range(snapshot_rows - 1, -1, -1))
        self.in_flight: AbstractSet[int] = _NOTHING
        """Slots of requests with a follow-up round launched."""
        self.fenced: list[RequestState] = []
        """Requests that ended while a round of theirs was in flight (released at its fence)."""
        self.starved = False
        """A running request lacked a page in the last round: admit nobody until every running request is served."""
        self.resumable = False
        """The selection has RESUME programs (set by the scheduler): known tokens after a restored snapshot or
        the start of a continued assistant message are computed by them, so prefilling requests are
        preempted by snapshot too."""
        self.deferred: set[int] = set()
        """Slots whose complete pages were counted as published but not hashed yet."""
        self.cancels = False
        """A cancellation mark may be set on a queued or running request."""
        self._generations = itertools.count(1)
        self._arrivals = itertools.count()

    # -- queueing ------------------------------------------------------------------------------------
    @property
    def has_room(self) -> bool:
        """The pending admission deque takes another request: it holds fewer than ``queue_capacity``.
        (Preempted requests return to its front whatever it holds: they were admitted already.)"""
        return len(self.waiting) < self.queue_capacity

    def add(
        self, request: PreparedRequest, *, cuts: tuple[int, ...] | None = None, continuation: int = -1
    ) -> AdmissionRejected | None:
        """Queue a request, or reject it when it lies outside the prepared capacities (permanently) or the
        pending admission deque is full (transiently: the engine hands requests over only while
        :attr:`has_room`, so this answers a caller that does not). ``cuts`` and ``continuation`` become the
        request's :attr:`RequestState.cuts` and :attr:`RequestState.continuation`."""
        if not self.has_room:
            self.stats.rejected += 1
            return AdmissionRejected(
                request.request_id,
                f"the pending admission queue holds its limit of {self.queue_capacity} requests; retry later",
            )
        problem = self._capacity_problem(request)
        sampling = request.sampling
        if problem is None:
            unpackable = self.sampling_limits.problem(sampling)
            if unpackable is not None:  # preparation refuses these; a request from elsewhere may still hold one
                problem = unpackable[1], unpackable[0]
        if problem is None and self.make_gate is None and masks_rounds(request):
            # a round mask needs a gate, which an engine without a tokenizer never makes
            problem = ("an engine without a tokenizer masks no tokens", format_param(request))
        if problem is None:
            exact = _exact_sampling(sampling)
            if isinstance(exact, tuple):
                problem = exact
            else:
                sampling = exact
        if problem is not None:
            self.stats.rejected += 1
            message, param = problem
            return AdmissionRejected(request.request_id, message, param=param, permanent=True)
        state = RequestState(
            request,
            request.request_id,
            len(request.prompt_ids),
            next(self._arrivals),
            request.max_tokens,
            request.ignore_eos,
            request.observe_timestamps,
            max(request.top_logprobs, 0),
            sampling,
            list(request.prompt_ids),
            cuts=cuts,
            continuation=continuation,
        )
        if self.make_gate is not None:
            try:
                state.gate = self.make_gate(request)
            except Exception as exc:  # a format preparation accepted but the worker cannot compile
                self.stats.rejected += 1
                return AdmissionRejected(
                    request.request_id,
                    f"cannot prepare the request's output constraints: {type(exc).__name__}: {exc}",
                    param=format_param(request),
                    permanent=True,
                )
            state.holds_rounds = state.gate is not None and state.gate.holds_rounds
        self.waiting.append(state)
        self.stats.received += 1
        return None

    def _capacity_problem(self, request: PreparedRequest) -> tuple[str, str | None] | None:
        """Why ``request`` can never fit the prepared capacities, and the field to change; None if it fits."""
        prompt = len(request.prompt_ids)
        if prompt == 0:
            return "the prompt is empty", "messages"
        vocabulary = self.input_vocabulary
        if not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocabulary:
            outside = next(i for i in request.prompt_ids if not 0 <= i < vocabulary)
            return f"prompt token id {outside} lies outside the input vocabulary [0, {vocabulary})", "messages"
        if request.max_tokens <= 0:
            return "max_tokens must be positive", "max_tokens"
        if request.prompt_logprobs and not self.scored_prefill:
            return "prompt logprobs are not supported by this core (no scored prefill programs)", "prompt_logprobs"
        if prompt >= self.context:  # a smaller output limit cannot fix this one
            return (
                f"prompt ({_tokens(prompt)}) does not fit the core's context of {self.context} tokens: it leaves no "
                "room for an output token",
                "messages",
            )
        total = prompt + request.max_tokens
        if total > self.context:
            return (
                f"prompt ({_tokens(prompt)}) plus max_tokens ({request.max_tokens}) exceeds the core's context of "
                f"{self.context} tokens; at most {self.context - prompt} output tokens fit this prompt",
                "max_tokens",
            )
        limit = min(self.pages_per_row, self.allocator.total_pages)
        if self.pages_for(total) > limit:
            return f"the request needs {self.pages_for(total)} cache pages; at most {limit} fit", "max_tokens"
        if request.images:
            return self.image_programs.problem(request, self.resumable)
        return None

    def requests(self) -> Iterator[RequestState]:
        return itertools.chain(self.waiting, self.running)

    def cancel(self, request_id: str) -> None:
        for state in self.requests():
            if state.request_id == request_id:
                state.cancelled = True
                self.cancels = True
                if state.slot >= 0:
                    self.table.cancel(state.slot)

    # -- admission -----------------------------------------------------------------------------------
    def admit(self) -> None:
        """Give slots and pages to waiting requests, oldest first, while both last (and no running
        request lacked a page in the last round)."""
        if not self.running:
            self.starved = False  # no request runs: none lacks a page, and only admission can free the wait
        if self.deferred and self.waiting and self.free_slots and not self.starved:
            self.publish_deferred()  # every complete page can be matched as a prefix
        while self.waiting and self.free_slots and not self.starved:
            state = self.waiting[0]
            tokens = state.tokens
            restoring: Checkpoint | None = None
            keys: list[bytes] = []
            if state.snapshot_row >= 0:  # reuse complete pages up to the snapshot, restore the rest
                full = state.snapshot_endpoint - state.snapshot_endpoint % self.page_tokens
                images = state.request.images
                match = self._outside_spans(
                    self.allocator.match_prefix(tokens, full if self.paged_prefixes else 0, images), images
                )
                needed = self.pages_for(_restored_extent(state)) - len(match.pages)
            elif state.scoring:  # every prompt token must be computed to be scored: no prefix reuse
                match = PrefixMatch((), (), 0)
                needed = self.pages_for(len(tokens))
            elif self.checkpoints is not None:  # the deepest shared checkpoint, restored after `initialize`
                restoring, match, keys = self._checkpoint_match(state)
                needed = self.pages_for(len(tokens)) - len(match.pages)
            else:
                match = self._prefix_match(state) if self.paged_prefixes else self.allocator.match_prefix(tokens, 0)
                needed = self.pages_for(len(tokens)) - len(match.pages)
            claimed = self.allocator.claim(match)  # restores matched pages the host tier holds
            fresh = self.allocator.allocate(needed) if claimed is not None else None
            if claimed is None or fresh is None:
                if claimed is not None:
                    self.allocator.release(claimed.pages)
                if not self.running:
                    # Nothing will free pages: this request cannot run until pages are evicted or freed,
                    # and capacity checks guarantee it fits an empty cache.
                    raise RuntimeError("an empty cache cannot hold an admitted request")
                return
            self.waiting.popleft()
            reused = match.tokens
            if restoring is not None and self.checkpoints is not None:
                self.checkpoints.claim(restoring)  # pinned until its restore round copied it
                state.restoring = restoring
                reused = restoring.endpoint
            if not state.scoring:
                self.allocator.count_reuse(claimed, reused)
            if state.reused_tokens < 0:
                state.reused_tokens = reused
            if state.snapshot_row < 0:
                phase = Phase.INITIALIZE
            else:  # a snapshotted request gets its state rows back from RESTORE, not from initialization
                unrestored = match.tokens < state.snapshot_endpoint and self.paged_prefixes
                phase = Phase.PREFILL if unrestored else Phase.RESTORE
            self.table.hold(
                self.free_slots.pop(),
                state,
                generation=next(self._generations),
                pages=[*claimed.pages, *fresh],
                hashes=keys if restoring is not None else list(match.hashes),
                consumed=reused,
                phase=phase,
            )
            continues = 0 <= state.continuation < len(tokens) and not state.scoring
            if self.resumable and continues and state.snapshot_row < 0:
                # prefill stops where the continued assistant message starts (past an image span it would
                # cut: a span is computed whole); RESUME computes the rest. A snapshotted request prefills
                # to its snapshot's endpoint instead: the restore, then RESUME, take it on from there
                target = max(state.continuation, reused)
                cut = inside_span(state.request.images, target)
                self.table.target[state.slot] = cut.end if cut is not None else target
            self.running.append(state)
            self.stats.admitted += 1
            if self.window:  # matched pages before the first window are not attended
                self._release_window(state.slot)

    def _prefix_match(self, state: RequestState) -> PrefixMatch:
        """The published pages ``state`` reuses: the longest run equal to its tokens' prefix (its last token
        is always computed), at its first admission cut back to the pages wholly before the last cut the
        core's prefix-boundary rules allow within that run. A readmitted request matches its own history
        freely."""
        tokens = state.tokens
        images = state.request.images
        match = self._outside_spans(self.allocator.match_prefix(tokens, len(tokens) - 1, images), images)
        if state.cuts is None or state.reused_tokens >= 0:
            return match
        keep = last_cut(state.cuts, match.tokens) // self.page_tokens
        if keep == len(match.pages):
            return match
        return self._outside_spans(
            PrefixMatch(match.pages[:keep], match.hashes[:keep], keep * self.page_tokens), images
        )

    def _outside_spans(self, match: PrefixMatch, images: Sequence[PromptImage]) -> PrefixMatch:
        """``match`` cut back to the pages wholly before every image span its end would cut (a span is
        computed whole, its image packed, in one round). A cut to a page boundary can land inside an
        earlier span (two images on one page), which is cut back again in turn."""
        while (cut := inside_span(images, match.tokens)) is not None:
            keep = cut.start // self.page_tokens
            match = PrefixMatch(match.pages[:keep], match.hashes[:keep], keep * self.page_tokens)
        return match

    def _checkpoint_match(self, state: RequestState) -> tuple[Checkpoint | None, PrefixMatch, list[bytes]]:
        """The deepest published checkpoint ``state``'s tokens share (its last token is always computed; at
        a first admission only up to the last cut the prefix-boundary rules allow) whose copied sampling
        state is exact for it; the complete pages claimed with it (none unless some history is in pages
        too); and the chain keys of its prefix."""
        checkpoints, tokens = self.checkpoints, state.tokens
        if checkpoints is None:
            return None, _NO_MATCH, []
        if self.paged_history:  # the checkpoint needs its prefix's pages as well: within their match
            match = self._prefix_match(state)
            keys = list(match.hashes)
        else:
            limit = len(tokens) - 1
            if state.cuts is not None and state.reused_tokens < 0:
                limit = last_cut(state.cuts, limit)
            cut = inside_span(state.request.images, limit)
            if cut is not None:
                limit = cut.start
            match, keys = _NO_MATCH, self._prompt_keys(tokens, limit, state.request.images)
        any_presence = state.sampling.repetition_penalty == 1.0  # prompt presence is read by that penalty only
        known = state.prompt_len + state.generated  # a recomputed request's presence holds its output too
        presence = frozenset(tokens[:known]) if keys and not any_presence else frozenset()

        def usable(checkpoint: Checkpoint) -> bool:
            return any_presence or checkpoint.presence == presence

        found = checkpoints.deepest(keys, usable)
        if found is not None and found.row == ON_HOST and not self._bring_back(found):
            found = checkpoints.deepest(keys, lambda checkpoint: checkpoint.row != ON_HOST and usable(checkpoint))
        if found is None:
            return None, _NO_MATCH, []
        pages = found.endpoint // self.page_tokens
        if self.paged_history:
            match = PrefixMatch(match.pages[:pages], match.hashes[:pages], found.endpoint)
        return found, match, keys[:pages]

    def _bring_back(self, checkpoint: Checkpoint) -> bool:
        """Copy the host tier's ``checkpoint`` into a snapshot row (a free one, else that of the least
        recently used unpinned checkpoint, which moves to the host); False when no row can be had."""
        checkpoints = self.checkpoints
        if checkpoints is None:
            return False
        checkpoints.pin_on_host(checkpoint)  # the eviction that frees a row must not drop it from the host
        try:
            if not self._free_snapshot_row():
                return False
        finally:
            checkpoints.unpin_on_host(checkpoint)
        checkpoints.bring_back(checkpoint, self.free_snapshot_rows.pop())
        return True

    def _prompt_keys(self, tokens: Sequence[int], limit: int, images: Sequence[PromptImage]) -> list[bytes]:
        """The chain key of each complete page of ``tokens[:limit]`` (image digests included), in order."""
        keys: list[bytes] = []
        step, chain_hash = self.page_tokens, self.allocator.chain_hash
        previous: bytes | None = None
        for start in range(0, min(limit, len(tokens)) - step + 1, step):
            previous = chain_hash(previous, tokens[start : start + step], page_images(images, start, step))
            keys.append(previous)
        return keys

    def slot_images(self, slot: int) -> Sequence[PromptImage]:
        """The prompt images of the request in ``slot``."""
        state = self.table.requests[slot]
        return state.request.images if state is not None else ()

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_chunk(self, state: RequestState, consumed: int, chunk: int) -> int:
        """A prefill chunk of ``chunk`` tokens of ``state`` from ``consumed``, cut to end at the last page
        boundary before its last known token when it would pass it and no checkpoint is published or
        being taken there (so one can be: that is the deepest endpoint a later prompt can share)."""
        if self.checkpoints is None or state.presence is None:
            return chunk
        slot = state.slot
        last = (self.table.length(slot) - 1) // self.page_tokens * self.page_tokens
        if inside_span(state.request.images, last) is not None:
            return chunk  # a chunk never ends inside an image span: no checkpoint there
        if consumed < last < consumed + chunk and self.checkpoints.wanted(self._chain_key(slot, last)):
            return last - consumed
        return chunk

    def take_checkpoint(self, state: RequestState) -> None:
        """``state``'s prefill chunk was applied: when it ended at a page boundary before its last known token
        and its sampling state rows hold what a checkpoint may copy, mark it for a checkpoint there (its
        SNAPSHOT round comes next; it keeps its slot). The snapshot row is a free one or, with none free,
        that of the least recently used checkpoint of the same chain (a shorter prefix of its tokens,
        dropped), or else that of the least recently used checkpoint of any chain (moved to the host tier
        when there is one, else dropped: a cache that the first prefixes filled keeps taking new ones); with
        every checkpoint pinned, no checkpoint is taken."""
        checkpoints, table, slot = self.checkpoints, self.table, state.slot
        if checkpoints is None or state.presence is None or state.snapshot_row >= 0:
            return
        endpoint = int(table.consumed[slot])
        if endpoint <= 0 or endpoint % self.page_tokens or endpoint >= table.length(slot):
            return
        key = self._chain_key(slot, endpoint)
        if not checkpoints.wanted(key):
            return
        if not self.free_snapshot_rows:
            chain = frozenset(table.hashes[slot][: endpoint // self.page_tokens])
            row = checkpoints.evict(lambda checkpoint: checkpoint.key in chain, offload=False)
            if row is None:
                row = checkpoints.evict()  # another prefix's: to the host tier when there is one
            if row is None:
                return
            self.free_snapshot_rows.append(row)
        state.checkpoint_row = self.free_snapshot_rows.pop()
        state.checkpoint_key = key
        checkpoints.reserve(key, state.checkpoint_row)
        table.set_phase(slot, Phase.CHECKPOINT)

    def publish_checkpoint(self, state: RequestState) -> None:
        """The checkpoint SNAPSHOT round of ``state`` validated: publish it; the request prefills on."""
        checkpoints, slot = self.checkpoints, state.slot
        if checkpoints is None or state.presence is None:
            raise RuntimeError("a checkpoint was taken by a request that may not publish one")
        checkpoints.publish(state.checkpoint_key, int(self.table.consumed[slot]), state.presence)
        state.checkpoint_row, state.checkpoint_key = -1, b""
        self.table.set_phase(slot, Phase.PREFILL)

    def initialized(self, state: RequestState) -> bool:
        """``state``'s sampling state rows were initialized from its prompt (a core with checkpoints): they
        hold its prompt's presence (and that of the tokens it generated before, when it is recomputed after
        preemption) and no output counts. True when a checkpoint is restored next."""
        state.presence = frozenset(self.table.token_list(state.slot, 0, self.table.length(state.slot)))
        if state.restoring is None:
            return False
        self.table.set_phase(state.slot, Phase.RESTORE)
        return True

    def restored_checkpoint(self, state: RequestState) -> None:
        """The RESTORE round copied ``state``'s checkpoint: it computes its tokens from the endpoint on."""
        checkpoint, slot = state.restoring, state.slot
        if checkpoint is None or self.checkpoints is None:
            raise RuntimeError("a checkpoint restore was applied to a request without one")
        self.checkpoints.unpin(checkpoint)
        state.restoring = None
        state.presence = checkpoint.presence  # what the restore copied into its prompt-presence row
        table = self.table
        table.set_phase(slot, Phase.RESUME if table.consumed[slot] >= table.target[slot] else Phase.PREFILL)

    def _chain_key(self, slot: int, endpoint: int) -> bytes:
        """The chain key of ``slot``'s first ``endpoint`` tokens (a positive page boundary), from its known
        page hashes on."""
        hashes = self.table.hashes[slot]
        known = min(len(hashes), endpoint // self.page_tokens)
        key = hashes[known - 1] if known else None
        for _, computed, _ in self._page_keys(slot, key, known, endpoint // self.page_tokens):
            key = computed
        if key is None:
            raise RuntimeError("a checkpoint endpoint must be a positive page boundary")
        return key

    def _page_keys(
        self, slot: int, parent: bytes | None, first: int, end: int
    ) -> Iterator[tuple[int, bytes, npt.NDArray[np.int64]]]:
        """(page index, chain key, its token ids) of ``slot``'s pages ``first`` to ``end`` (exclusive), the
        first one after the prefix keyed ``parent``: each hashed from an int64 view of the slot's token row
        (the same bytes, so the same key, as the ids a prefix match hashes)."""
        pt = self.page_tokens
        if end <= first:
            return
        block = self.table.tokens[slot, first * pt : end * pt].astype(np.int64).reshape(end - first, pt)
        images = self.slot_images(slot)
        chain_hash = self.allocator.chain_hash
        for index, page_tokens in enumerate(block, start=first):
            parent = chain_hash(parent, page_tokens, page_images(images, index * pt, pt))
            yield index, parent, page_tokens

    def _free_snapshot_row(self) -> bool:
        """A snapshot row is free, if need be by evicting the least recently used unpinned checkpoint."""
        if self.free_snapshot_rows:
            return True
        row = self.checkpoints.evict() if self.checkpoints is not None else None
        if row is None:
            return False
        self.free_snapshot_rows.append(row)
        return True

    # -- pages ---------------------------------------------------------------------------------------
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def ensure_page(self, state: RequestState, exclude: AbstractSet[int]) -> bool:
        """Make sure the page for ``state``'s next position exists, preempting younger requests (not in
        ``exclude``, slots of requests already in the round) if needed."""
        table = self.table
        while table.consumed[state.slot] // self.page_tokens >= table.page_count[state.slot]:
            page = self.allocator.allocate(1)
            if page is not None:
                table.add_pages(state.slot, page)
                continue
            others = [s for s in self.running if s is not state and s.slot not in exclude]
            victims = [s for s in others if s.arrival > state.arrival] or others
            victims = [s for s in victims if table.phase_of(s.slot) not in _LEAVING]
            if not victims:
                return False
            victim = max(victims, key=lambda s: s.arrival)
            if self._snapshots(victim) and self._free_snapshot_row():
                # Keep the victim's exact committed state: snapshot it in the next round, then release it.
                victim.snapshot_row = self.free_snapshot_rows.pop()
                victim.snapshot_endpoint = int(table.consumed[victim.slot])
                table.set_phase(victim.slot, Phase.SNAPSHOT)
                return False
            self.preempt(victim)
            if state.slot < 0:
                return False
        return True

    def _snapshots(self, victim: RequestState) -> bool:
        """``victim`` is preempted by a snapshot of its committed state: it decodes, or (with RESUME
        programs, which compute its remaining known tokens after the restore) it prefills or resumes
        with its sampling state initialized, no snapshot of its own pending and no prompt to score."""
        phase = self.table.phase[victim.slot]
        if phase == Phase.DECODE:
            return True
        resumable = phase in (Phase.PREFILL, Phase.RESUME) and victim.snapshot_row < 0 and not victim.scoring
        if resumable and not self.image_programs.resume:  # its remaining images need a RESUME that takes them
            consumed = int(self.table.consumed[victim.slot])
            resumable = all(image.end <= consumed for image in victim.request.images)
        return self.resumable and resumable

    def release_outside_window(self) -> None:
        """With a sliding-window history, release every running request's pages that no later round
        attends (after a round's completion; rounds in flight compute positions past the committed
        endpoint, so they attend no released page)."""
        if not self.window:
            return
        table = self.table
        slots = np.array([state.slot for state in self.running], dtype=np.int64)
        if not slots.shape[0]:
            return
        first_needed = np.maximum(table.consumed[slots].astype(np.int64) - (self.window - 1), 0) // self.page_tokens
        for slot in slots[first_needed > table.released[slots]].tolist():
            self._release_window(slot)

    def _release_window(self, slot: int) -> None:
        """Release ``slot``'s pages wholly before the window of its next position.

        The next position ``c`` (the consumed endpoint) attends positions ``c - window + 1 .. c``, and every
        later position attends a window that starts later still, so page ``i`` is released once
        ``(i + 1) * page_tokens <= c - window + 1``. Complete pages are published first, while still held
        (a later request may reuse them as an exact prefix: their content depends only on the tokens of
        the prefix their chain hash covers); the row's hashes then cover every released page."""
        table = self.table
        first_needed = max(int(table.consumed[slot]) - (self.window - 1), 0) // self.page_tokens
        if first_needed <= int(table.released[slot]):
            return
        self.publish_pages(slot)
        pages = table.release_leading(slot, first_needed)
        if pages:
            self.allocator.release(pages)

    def defer_pages(self, slot: int) -> None:
        """Count ``slot``'s complete pages as published; they are hashed and published in the allocator
        when another request could first reuse them: before admission matches prefixes, or when the
        request releases its pages (a decode round completes about one page in every ``page_tokens``
        lanes, and hashing them in the round costs more than the rest of the lane's work)."""
        self.table.published[slot] = int(self.table.consumed[slot]) // self.page_tokens
        self.deferred.add(slot)

    def publish_deferred(self) -> None:
        for slot in self.deferred:
            self.publish_pages(slot)
        self.deferred.clear()

    def publish_pages(self, slot: int) -> None:
        """Hash and publish every complete page of ``slot`` not published yet."""
        table, pt = self.table, self.page_tokens
        hashes = table.hashes[slot]
        consumed = int(table.consumed[slot])
        if (len(hashes) + 1) * pt <= consumed:
            allocator = self.allocator
            first, end = len(hashes), consumed // pt
            pages = table.pages[slot, first:end].tolist()
            announces = allocator.announces
            for index, key, page_tokens in self._page_keys(slot, hashes[-1] if hashes else None, first, end):
                ids = page_tokens.tolist() if announces else None  # a listener hears the page's ids
                allocator.publish(pages[index - first], key, parent=hashes[-1] if hashes else None, tokens=ids)
                hashes.append(key)
        table.published[slot] = len(hashes)

    # -- leaving -------------------------------------------------------------------------------------
    def retire(self, state: RequestState, *, requeue: bool = False, keep_snapshot: bool = False) -> None:
        """Release what a request holds: its pages, slot and (unless kept) snapshot row, with its place in the
        queue when it waits (a preempted request that leaves before its readmission); no round of it is in
        flight. With ``requeue`` its tokens move back to it and it waits at the front of the queue. Each
        holding is released once (its field is reset), so retiring a request again releases nothing."""
        if not keep_snapshot:
            self._drop_snapshot(state)
        if self.checkpoints is not None:
            if state.checkpoint_row >= 0:  # its checkpoint's snapshot round failed or never ran: not published
                self.free_snapshot_rows.append(self.checkpoints.abandon(state.checkpoint_key))
                state.checkpoint_row, state.checkpoint_key = -1, b""
            if state.restoring is not None:
                self.checkpoints.unpin(state.restoring)
                state.restoring = None
            state.presence = None  # its next slot's sampling state rows are initialized or restored again
        if state in self.running:
            self.running.remove(state)
        elif not requeue and state in self.waiting:
            self.waiting.remove(state)
        slot = state.slot
        if slot >= 0:
            if slot in self.deferred:
                self.deferred.discard(slot)
                self.publish_pages(slot)  # before its pages are released: they stay reusable
            pages = self.table.release(slot, keep_tokens=requeue)
            if pages:
                self.allocator.release(pages)
            self.free_slots.append(slot)
        if requeue:
            self.waiting.appendleft(state)

    def end(self, state: RequestState) -> None:
        """Release a finished or failed request now, or after the fence of its in-flight follow-up round (a
        waiting request leaves the queue now, with the snapshot row it holds)."""
        slot = state.slot
        if slot < 0:
            self.retire(state)
            return
        if slot in self.in_flight:
            if self.table.phase_of(slot) != Phase.ENDED:
                self.table.set_phase(slot, Phase.ENDED)
                self.fenced.append(state)
        else:
            self.retire(state)

    def release_fenced(self) -> None:
        """The follow-up round's fence has passed: release what ended while it was in flight."""
        self.in_flight = _NOTHING
        for state in self.fenced:
            self.retire(state)
        self.fenced = []

    def preempt(self, state: RequestState) -> None:
        """Return a running request to the front of the queue; its published pages stay reusable. A
        snapshot it was readmitted with and has not restored yet stays its own (nothing of its state
        changed since): the next readmission restores it."""
        self.retire(state, requeue=True, keep_snapshot=state.snapshot_row >= 0)
        if not state.scores_sent:
            state.scores = []  # scoring restarts with the prompt's recomputation
        self.stats.preemptions += 1

    def leave_after_snapshot(self, state: RequestState) -> None:
        """The snapshot committed: release slot and pages; the request waits at the front of the queue."""
        self.retire(state, requeue=True, keep_snapshot=True)
        self.stats.preemptions += 1
        self.stats.snapshots += 1

    def restored_snapshot(self, state: RequestState) -> None:
        """The RESTORE round copied ``state``'s snapshot back: its snapshot row is free again."""
        if state.snapshot_row < 0:
            raise RuntimeError("a snapshot restore was applied to a request without a snapshot")
        self.free_snapshot_rows.append(state.snapshot_row)
        state.snapshot_row = -1
        self.stats.restores += 1

    def _drop_snapshot(self, state: RequestState) -> None:
        """Free ``state``'s snapshot row without restoring it (the request leaves: cancelled, failed, ended at
        shutdown; or its snapshot round never committed). A committed snapshot dropped this way is counted
        as discarded."""
        row = state.snapshot_row
        if row < 0:
            return
        if state.slot < 0 or self.table.phase_of(state.slot) != Phase.SNAPSHOT:
            self.stats.snapshots_discarded += 1  # committed (only a SNAPSHOT-phase mark is not yet)
        self.free_snapshot_rows.append(row)
        state.snapshot_row = -1

    # -- outcomes ------------------------------------------------------------------------------------
    def generated(self, state: RequestState) -> int:
        return int(self.table.generated[state.slot]) if state.slot >= 0 else state.generated

    def fail(self, state: RequestState, message: str) -> Event:
        self.end(state)
        self.stats.failed += 1
        return ExecutionFailed(state.request_id, message)

    def finished(self, state: RequestState, reason: FinishReason, *, flush: bool = True) -> Finished | ExecutionFailed:
        """The request's normal end, with what its gate still holds (flushed when ``flush``); a gate that
        raises while flushing fails the request instead (it has already ended)."""
        pieces: list[tuple[int, str]] = []
        if flush and state.gate is not None and reason != "cancelled":
            try:
                pieces = state.gate.finish()
            except Exception as exc:
                self.stats.failed += 1
                return ExecutionFailed(state.request_id, gate_failure(exc))
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        return Finished(
            state.request_id, reason, state.prompt_len, self.generated(state), max(state.reused_tokens, 0), pieces
        )

    def take_cancelled(self) -> list[Event]:
        """Finish every cancelled request, waiting or running, releasing what it holds (a preempted request
        waiting for readmission its snapshot row; nothing is in flight between rounds)."""
        if not self.cancels:
            return []
        self.cancels = False
        events: list[Event] = []
        for state in [s for s in self.requests() if s.cancelled]:
            self.retire(state)
            events.append(self.finished(state, "cancelled"))
        return events

    def cancel_all(self) -> list[Event]:
        """Finish every queued and running request as cancelled (shutdown; nothing is in flight)."""
        for state in self.requests():
            state.cancelled = True
        self.cancels = True
        return self.take_cancelled()

    def fail_all(self, message: str) -> list[Event]:
        """Fail every queued and running request (after an internal error), releasing what each holds (a
        running request's after the fence of its in-flight round); a running request that already ended
        (waiting for that fence) is not failed again."""
        leaving = [state for state in self.running if self.table.phase_of(state.slot) != Phase.ENDED]
        return [self.fail(state, message) for state in [*leaving, *self.waiting]]


@dataclass(frozen=True)
class ImagePrograms:
    """The selected programs that take images, and what a request's images must be to fit them."""

    prefill: tuple[PreparedGraph, ...]
    scored: tuple[PreparedGraph, ...]
    resume: tuple[PreparedGraph, ...]
    feature_slots: int
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """Each ``image_output`` the programs bind: the trailing shape and numpy dtype of its destination."""

    @classmethod
    def of(cls, contract: PreparedContract, graphs: Iterable[PreparedGraph]) -> ImagePrograms:
        taking = [graph for graph in graphs if graph.takes_images]
        tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        for graph in taking:
            for binding in graph.contract.bindings:
                if binding.source == ct.VALUE_SOURCE_IMAGE_TENSOR:
                    entry = contract.transport[binding.destination]
                    tensors[binding.image_output] = (tuple(entry.shape[1:]), NUMPY_DTYPES[entry.dtype].name)

        def of_operation(operation: int) -> tuple[PreparedGraph, ...]:
            return tuple(graph for graph in taking if graph.operation == operation)

        return cls(
            of_operation(ct.OPERATION_PREFILL),
            of_operation(ct.OPERATION_SCORED_PREFILL),
            of_operation(ct.OPERATION_RESUME),
            contract.model.vision.feature_slots,
            tensors,
        )

    def problem(self, request: PreparedRequest, resumable: bool) -> tuple[str, str | None] | None:
        """Why ``request``'s images can never be served by these programs, and the field to change."""
        if not self.prefill:
            return "this core's programs take no images", "messages"
        prompt = len(request.prompt_ids)
        end = 0
        features = 0
        for index, image in enumerate(request.images):
            where = f"image {index}"
            if image.length <= 0 or image.start < end or image.end > prompt:
                return (
                    f"{where}'s span [{image.start}, {image.end}) is empty, overlaps an earlier image's or lies "
                    f"outside the prompt's {prompt} tokens",
                    "messages",
                )
            end = image.end
            if any(not 0 <= offset < image.length for offset in image.feature_tokens):
                return f"{where} places a feature outside its span of {image.length} tokens", "messages"
            features += image.feature_count
            tensor_problem = self._tensor_problem(where, image)
            if tensor_problem is not None:
                return tensor_problem, "messages"
            fit_problem = _fit_problem(where, image, self.prefill, "prefill")
            if fit_problem is not None:
                return fit_problem, "messages"
            if request.prompt_logprobs:
                fit_problem = _fit_problem(where, image, self.scored, "scored prefill")
                if fit_problem is not None:
                    return f"prompt logprobs: {fit_problem}", "prompt_logprobs"
        if features > self.feature_slots:
            return (
                f"the prompt's images have {features} features; the core holds {self.feature_slots} image "
                "feature slots per request",
                "messages",
            )
        continuation = request.layout.continuation if request.layout is not None else -1
        if resumable and continuation >= 0 and any(image.end > continuation for image in request.images):
            for index, image in enumerate(request.images):
                if image.end > continuation:
                    fit_problem = _fit_problem(f"image {index}", image, self.resume, "resume")
                    if fit_problem is not None:
                        return f"the continued assistant message: {fit_problem}", "messages"
        return None

    def _tensor_problem(self, where: str, image: PromptImage) -> str | None:
        tensors = {tensor.name: tensor for tensor in image.tensors}
        for name, (trailing, dtype) in self.tensors.items():
            tensor = tensors.get(name)
            if tensor is None:
                return f"{where} has no {name!r} tensor, which the core's programs take"
            expected = [image.patch_count, *trailing]
            if list(tensor.shape) != expected:
                return f"{where}'s {name!r} tensor has shape {list(tensor.shape)}; the core's programs take {expected}"
            try:
                if len(tensor.data) != math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize:
                    return f"{where}'s {name!r} tensor holds {len(tensor.data)} bytes, not its shape's"
                image_values(np.zeros(0, dtype=np.dtype(tensor.dtype)), np.dtype(dtype), name)
            except (TypeError, ValueError) as exc:
                return f"{where}: {exc}"
        return None


def _fit_problem(where: str, image: PromptImage, graphs: Sequence[PreparedGraph], kind: str) -> str | None:
    """Why no one of ``graphs`` (``kind`` programs) holds ``image`` alone: its patches, features and span."""
    if not graphs:
        return f"{where} needs a {kind} program that takes images; this core has none"
    patches = max(graph.patch_capacity for graph in graphs)
    if image.patch_count > patches:
        return (
            f"{where} has {image.patch_count} patches; the largest patch capacity of the {kind} programs is {patches}"
        )
    tokens = max(graph.extents.packed_token_capacity for graph in graphs)
    if image.length > tokens:
        return f"{where}'s span of {image.length} tokens exceeds the {tokens} tokens a {kind} round computes"
    if not any(
        graph.patch_capacity >= image.patch_count
        and graph.feature_capacity >= image.feature_count
        and graph.extents.packed_token_capacity >= image.length
        for graph in graphs
    ):
        return (
            f"{where} ({image.patch_count} patches, {image.feature_count} features, a span of {image.length} "
            f"tokens) fits no single {kind} program"
        )
    return None


def _restored_extent(state: RequestState) -> int:
    """The tokens a snapshotted request's pages cover at readmission: its snapshot endpoint when only its
    pending token follows (a decode round computes it, taking that page then), else every known token
    (RESUME rounds compute them right after the restore)."""
    endpoint = state.snapshot_endpoint
    if state.generated > 0 and len(state.tokens) == endpoint + 1:
        return endpoint
    return len(state.tokens)


def history_window(cache: ct.CacheContract) -> int:
    """The sliding-window extent of the histories ``cache``'s page-table views address: the largest
    ``window_tokens`` when every addressed region is a sliding window, else 0 (no page is released early)."""
    regions = {region.name: region for region in cache.regions}
    viewed = [regions[view.region] for view in cache.page_table_views if view.region in regions]
    if not viewed or any(region.kind != ct.HISTORY_KIND_SLIDING_WINDOW for region in viewed):
        return 0
    return max(region.window_tokens for region in viewed)


def _exact_sampling(params: SamplingParams) -> SamplingParams | tuple[str, str]:
    """``params`` with every value as its per-slot column holds it (the column's type converts it exactly,
    so every round packs the same value), or why a value has no exact column value and its field."""
    values = {}
    for parameter in SAMPLING_PARAMETERS:
        value = getattr(params, parameter.name)
        try:
            exact = parameter.column_dtype.type(value).item()
        except (OverflowError, TypeError, ValueError):
            exact = None
        if exact is None or (parameter.kind != "float" and exact != value):
            column = parameter.column_dtype.name
            return f"{parameter.name} {value!r} does not fit the per-request {column} sampling column", parameter.name
        values[parameter.name] = exact
    return SamplingParams(**values)


def _tokens(count: int) -> str:
    """``1 token``, ``5 tokens``."""
    return f"{count} token" if count == 1 else f"{count} tokens"
