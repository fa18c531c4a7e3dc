"""The engine API and its model worker.

Owns the worker thread and the per-request event streams. ``Engine.submit`` hands a
:class:`~helios_core.runtime.messages.PreparedRequest` to the worker over the message channel and
returns a :class:`RequestStream`; ``Engine.cancel`` stops a request before its next round;
``Engine.statistics`` reads the native counters. The worker step reads as prose:

    round = scheduler.next_round()      # admit, choose program and cohort
    pack(round); run(round)             # shared packing into the frame's staging, one launch
    results = read_lanes(completion)    # validate every lane before any retires
    publish(scheduler.complete(round, results))

Every round is planned from completed observations. In steady decoding the worker keeps one round
in flight on the other execution frame while it validates and publishes the previous one (two
frames); anything that needs completion feedback keeps one outstanding round. A round that raises
(launching, or waiting for its frame's fence) fails only its own requests.

A fault that belongs to one request ends that request alone, and every other request goes on as if it
had never been there: a host gate that raises (its grammar's mask or matcher, its stops, its
detokenizer) fails its request in the scheduler, and a round whose packing raises is packed again lane
by lane to find the requests whose values do not pack; those fail, and the round is planned again
without them (values that do not fit the packed types are refused at preparation and at admission,
so this is a last resort that costs nothing while packing succeeds). Only a fault of the worker
itself fails every request.

A steady decode round's tokens are put on its requests' streams as one shared
:class:`~helios_core.runtime.messages.RoundTokens`, and an ungated request's stream detokenizes its
tokens itself (:class:`~helios_core.runtime.gates.StreamText`): each stream builds its reader's events
on the reader's thread, the same events, in the same order, as one per lane built by the worker.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from helios_core.errors import HeliosError
from helios_core.frontend.detokenizer import TokenBytes
from helios_core.frontend.structured import GrammarCompiler
from helios_core.runtime.checkpoints import CheckpointIndex
from helios_core.runtime.completion import (
    CompletionError,
    LaneResult,
    RecordViews,
    agree_across_ranks,
    read_lanes,
)
from helios_core.runtime.gates import HostGate, StreamText, TextlessIds, format_param, needs_gate
from helios_core.runtime.messages import (
    TERMINAL_EVENTS,
    AdmissionRejected,
    Cancel,
    Event,
    ExecutionFailed,
    Finished,
    Outgoing,
    PreparedRequest,
    RoundTokens,
    Stop,
    Submit,
    TokenEvent,
    WorkerMessage,
)
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.offload import HostCheckpointStore, HostPageStore
from helios_core.runtime.packing import Submission
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.stats import SchedulerStats, StatsSnapshot

_STOP = object()
_SNAPSHOT_INTERVAL_NS = 1_000_000
"""While rounds follow each other, the statistics snapshot is renewed at most this often."""
_Flat = npt.NDArray[np.generic]


@dataclass(frozen=True)
class _PackFault:
    """A round's packing raised ``error``: nothing of the round was launched."""

    error: Exception


class RequestStream:
    """The events of one request, in order; iteration ends after the terminal event.

    A decode round's tokens arrive as one :class:`RoundTokens` shared by the round's streams; the
    stream yields its own lane of it as a :class:`TokenEvent`, so iteration yields events only. The
    stream of a request without a host gate adds its tokens' text as it yields them (``text``).
    """

    def __init__(self, request_id: str, text: StreamText | None = None) -> None:
        self.request_id = request_id
        self._text = text
        self._events: queue.SimpleQueue[Outgoing] = queue.SimpleQueue()
        self.put: Callable[[Outgoing], None] = self._events.put
        """Append an event or a round's tokens (the queue's own method: no call of ours per event)."""

    def _redirect(self, put: Callable[[Outgoing], None]) -> None:
        """Hand the events queued so far to ``put``, in order, and every later one (the engine calls
        this under its publishing lock: :meth:`Engine.redirect`)."""
        events = self._events
        while not events.empty():
            put(events.get_nowait())
        self.put = put

    def __iter__(self) -> Iterator[Event]:
        request_id = self.request_id
        get = self._events.get
        text = self._text
        push = text.push if text is not None else None
        while True:
            event = get()
            if isinstance(event, RoundTokens):
                yield event.event(request_id, push)
                continue
            if text is not None:
                if isinstance(event, TokenEvent):
                    event = text.token(event)
                elif isinstance(event, Finished):
                    event = text.finished(event)
            yield event
            if isinstance(event, TERMINAL_EVENTS):
                return


@dataclass(frozen=True)
class GenerationResult:
    """A finished request collected from its stream."""

    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    reused_prompt_tokens: int


def collect_generation(events: Iterable[Event]) -> GenerationResult:
    """Read a request's stream to its end: the tokens and finish reason, or the rejection or failure
    as a :class:`HeliosError`."""
    tokens: list[int] = []
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, Finished):
            return GenerationResult(tokens, event.reason, event.prompt_tokens, event.reused_prompt_tokens)
        elif isinstance(event, AdmissionRejected | ExecutionFailed):
            raise HeliosError(event.message)
    raise HeliosError("the request stream ended without a terminal event")


def compile_format(
    request: PreparedRequest, text: str, compiler: GrammarCompiler
) -> PreparedRequest | AdmissionRejected:
    """``request`` with its ``response_format`` (``text``) compiled, or without it when the format
    constrains nothing; or why it cannot be compiled (for a request that did not come through the
    server's preparation, which compiles formats itself)."""
    try:
        grammar = compiler.compile_prepared(text)
    except Exception as exc:  # the request's own format: it alone is refused
        return AdmissionRejected(
            request.request_id,
            f"cannot prepare the request's output constraints: {type(exc).__name__}: {exc}",
            param=format_param(request),
            permanent=True,
        )
    if grammar is None:
        return msgspec.structs.replace(request, response_format=None)
    return msgspec.structs.replace(request, grammar=grammar)


class Engine:
    """Submit prepared requests, receive their events, cancel them."""

    def __init__(
        self, model: NativeModel, tokenizer: Tokenizer | None = None, grammar_compiler: GrammarCompiler | None = None
    ) -> None:
        self.model = model
        contract = model.contract
        self._sampled_size = contract.sampled_size
        self.allocator = PageAllocator(
            model.cache_pages,
            contract.model.cache.page_tokens,
            contract.serving.cache_identity,
            host=HostPageStore(model.offload_pages, model.backend) if model.offload_pages else None,
        )
        self._stats = SchedulerStats()
        make_gate = None
        self.grammar_compiler = grammar_compiler
        """Compiles a submitted request's ``response_format`` that comes without its grammar (on the
        submitting thread, never the worker's)."""
        self.make_text: Callable[[PreparedRequest], StreamText] | None = None
        """The text of a new ungated request's stream (None: events carry no text, as without a tokenizer)."""
        if tokenizer is not None:
            tok = tokenizer
            token_bytes = TokenBytes.from_tokenizer(tokenizer)

            textless = TextlessIds.of_core(tokenizer, contract.eos_token_ids, contract.model.frontend)

            def make_gate(request: PreparedRequest) -> HostGate | None:
                if not needs_gate(request):
                    return None
                ends, silent = textless.of(request)
                return HostGate(request, tok, grammar_compiler, token_bytes, ends, silent)

            def make_text(request: PreparedRequest) -> StreamText:
                return StreamText(tok, token_bytes, textless.of(request)[1])

            self.make_text = make_text

        self.scheduler = Scheduler(
            contract,
            model.selection,
            self.allocator,
            self._stats,
            make_gate=make_gate,
            clock_origin_ns=model.clock_origin_ns,
            checkpoint_host=(
                HostCheckpointStore(model.offload_checkpoints, model.backend) if model.offload_checkpoints else None
            ),
        )
        self._inbox: queue.SimpleQueue[WorkerMessage] = queue.SimpleQueue()
        self.queue_capacity = model.selection.queue_capacity
        self.capacity = self.queue_capacity + model.selection.max_active
        """The most requests the engine holds at once (submitted, not ended, not cancelled): at most
        ``max_active`` run and the rest wait; :meth:`submit` refuses one more at once."""
        self._released: set[str] = set()
        """Ids of cancelled requests whose terminal event is not published yet (they count no more)."""
        self._refused = 0
        """Submissions :meth:`submit` refused at the bound (counted as rejected in the statistics)."""
        self._submitted_ns: dict[str, int] = {}
        """When each registered request was submitted (monotonic ns), until its terminal event: its latency."""
        self._awaiting_first: set[str] = set()
        """Registered requests whose first token is not published yet (their time to first token)."""
        self._backlog: deque[PreparedRequest] = deque()
        """Submissions taken from the inbox that wait for room in the scheduler's pending deque (the
        ingress channel's tail: the deque never holds more than ``queue_capacity``)."""
        self._outstanding = 0
        """Launched rounds whose frames are not collected yet (the executor frames in flight)."""
        self._owned_entries: dict[int, tuple[object, _Flat | None, _Flat | None]] = {}
        """Per frame: the staging mapping last seen and its frame-index and sequence views."""
        self._records: dict[int, RecordViews] = {}
        """Per frame: the views of the completion record last read."""
        self._streams: dict[str, RequestStream] = {}
        self._round_lanes: dict[str, int] | None = None
        self._round_puts: list[Callable[[Outgoing], None]] = []
        """The stream puts of the requests of ``_round_lanes`` (a cohort's lanes), in lane order."""
        self._lock = threading.Lock()
        self._sequence = 0
        self._stopping = False
        self._shut_down = False
        self._reports_completion = _programs_writing_completion(model)
        self._rank_completions: Callable[[int], Sequence[Mapping[int, npt.NDArray[np.generic]]]] | None = getattr(
            model.backend, "rank_completions", None
        )
        """Every rank's completion record of a frame (a backend of several tensor-parallel ranks), else None."""
        self._snapshot: StatsSnapshot = self._take_snapshot()
        self._snapshot_ns = 0
        self._worker = threading.Thread(target=self._run, name="helios-model-worker", daemon=True)
        self._worker.start()

    # -- the engine API ---------------------------------------------------------------------------
    def submit(self, request: PreparedRequest) -> RequestStream:
        """Queue ``request``; its events arrive on the returned stream.

        When the engine already holds :attr:`capacity` requests (``queue_capacity + max_active``: submitted,
        not ended and not cancelled), the stream's only event is an :class:`AdmissionRejected` that is not
        permanent (a later attempt may pass), put there at once; nothing is queued.

        A request with a ``response_format`` and no compiled ``grammar`` (one that did not come through
        preparation) is compiled here, on the caller's thread, so the worker never compiles; a format
        that does not compile makes the stream's only event a permanent :class:`AdmissionRejected`.
        """
        format_text, compiler = request.response_format, self.grammar_compiler
        if format_text is not None and request.grammar is None and compiler is not None:
            compiled = compile_format(request, format_text, compiler)
            if isinstance(compiled, AdmissionRejected):
                refused = RequestStream(request.request_id)
                refused.put(compiled)
                return refused
            request = compiled
        make_text = self.make_text
        text = make_text(request) if make_text is not None and not needs_gate(request) else None
        stream = RequestStream(request.request_id, text)
        with self._lock:
            if request.request_id in self._streams:
                raise HeliosError(f"request id {request.request_id!r} is already active")
            if len(self._streams) - len(self._released) >= self.capacity:
                self._refused += 1
                stream.put(
                    AdmissionRejected(
                        request.request_id,
                        f"the engine holds its limit of {self.capacity} requests (queue_capacity "
                        f"{self.queue_capacity} + max_active {self.capacity - self.queue_capacity}); retry later",
                    )
                )
                return stream
            self._streams[request.request_id] = stream
            self._submitted_ns[request.request_id] = time.monotonic_ns()
            self._awaiting_first.add(request.request_id)
        self._inbox.put(Submit(request))
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request before its next round; it finishes with reason ``cancelled``. From now on it no
        longer counts against :attr:`capacity`."""
        with self._lock:
            if request_id in self._streams:
                self._released.add(request_id)
        self._inbox.put(Cancel(request_id))

    def generate(self, request: PreparedRequest) -> GenerationResult:
        """Submit and wait: the tokens and finish reason, or the rejection/failure as an error."""
        return collect_generation(self.submit(request))

    def worker_alive(self) -> bool:
        """Whether the model worker thread still runs (False once it stopped or died)."""
        return self._worker.is_alive()

    def statistics(self) -> StatsSnapshot:
        """The native statistics as of a completed round: the last one whenever the worker has no round in
        flight, and at most a millisecond old while it chains decode rounds."""
        with self._lock:
            return self._snapshot

    def shutdown(self) -> None:
        """Stop the worker after the round in progress (its frames collected), cancel what remains, then
        release the model, whose backend drains the device before it frees anything. Idempotent."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._inbox.put(Stop())
        self._worker.join()
        self.model.close()

    # -- the worker -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._stopping or not self._drain(block=self.scheduler.idle and not self._backlog):
                self._drain(block=False)  # requests submitted before the stop still get their final event
                self._publish(self.scheduler.cancel_all())
                self._publish([self._cancelled_before_admission(request) for request in self._backlog])
                self._backlog.clear()
                with self._lock:  # the last statistics count what the stop cancelled
                    self._snapshot = self._take_snapshot()
                return
            try:
                self._step()
            except Exception as exc:  # a scheduler bug must not hang clients: fail what is queued
                self._publish(self.scheduler.fail_all(f"internal scheduler error: {type(exc).__name__}: {exc}"))
            with self._lock:
                self._snapshot = self._take_snapshot()

    def _step(self) -> None:
        """One worker step: finish cancelled requests, plan a round, launch it, then validate and publish.

        While nothing needs a round's completion first (steady decoding), the next decode round is
        planned and launched on the other frame before the running one is read, and this repeats: one
        round is always in flight while the host validates and publishes the previous one. The loop
        ends when a round has no follow-up (a request ends, needs host feedback, or new work waits).
        """
        scheduler = self.scheduler
        self._publish(scheduler.take_cancelled())
        round_ = scheduler.next_round()
        self._publish(scheduler.take_faults())
        if round_ is None or not len(round_):
            return
        frame = 0
        launched = self._launch(round_, frame=frame)
        if isinstance(launched, _PackFault):  # nothing is in flight: find the requests that do not pack
            self._publish(self._unpackable(round_, frame, launched.error))
            return
        while True:
            follow = None
            if isinstance(launched, int) and not self._stopping:
                follow = scheduler.followup(round_)
            follow_launch = self._launch(follow, frame=1 - frame) if follow is not None else None
            if isinstance(follow_launch, _PackFault):
                follow_launch = None  # not launched: the next step plans that round again, nothing in flight
            events = self._collect(round_, frame, launched)
            if follow is None or follow_launch is None:
                scheduler.release_fenced()  # nothing is in flight any more
                self._publish(events)
                return
            self._publish(events)
            now = time.monotonic_ns()
            if now - self._snapshot_ns >= _SNAPSHOT_INTERVAL_NS:
                self._snapshot_ns = now
                with self._lock:
                    self._snapshot = self._take_snapshot()
            self._drain(block=False)  # cancellations and new requests end the chain at the next plan
            round_, frame, launched = follow, 1 - frame, follow_launch

    def _launch(self, round_: RoundPlan, *, frame: int) -> int | Exception | _PackFault:
        """Pack and launch a round on ``frame``; its submission sequence, the exception its launch raised,
        or the packing fault that kept it from being launched."""
        self._sequence += 1
        sequence = self._sequence
        backend = self.model.backend
        try:
            staging = backend.transport(frame)  # waits for the frame's previous fence on a GPU
        except Exception as exc:  # a failed execution fails this round's requests only
            return exc
        try:
            self.model.packers[round_.graph.name].pack(Submission(round_.lanes, sequence), frame, staging)
        except Exception as exc:  # some lane's values do not pack: see _unpackable
            self.model.page_table_memory.forget(frame)
            return _PackFault(exc)
        try:
            owned = self._owned_entries.get(frame)
            if owned is None or owned[0] is not staging:
                owned = self._owned_entries[frame] = (staging, *_transport_owned(self.model, staging))
            if owned[1] is not None:
                owned[1][0] = frame
            if owned[2] is not None:
                owned[2][0] = sequence
            if self.model.engram is not None:  # the round's Engram rows into the frame it runs on
                self.model.engram.stage(frame, sequence, staging, round_.lanes, self.scheduler.table.tokens)
            backend.run(round_.graph.name, frame)
        except Exception as exc:  # a failed execution fails this round's requests only
            if self.model.engram is not None and self.model.engram.held_by(frame) == sequence:
                self.model.engram.release(frame)  # never launched: nothing reads its rows
            return exc
        self._outstanding += 1
        if round_.constrained:  # the frames in flight right after a successful constrained submission
            stats = self._stats
            stats.constrained_max_inflight = max(stats.constrained_max_inflight, self._outstanding)
        return sequence

    def _collect(self, round_: RoundPlan, frame: int, launched: int | Exception) -> Sequence[Outgoing]:
        """Validate a launched round's completion record and apply it."""
        if isinstance(launched, Exception):
            return self.scheduler.fail_round(round_, f"execution failed: {type(launched).__name__}: {launched}")
        self._outstanding -= 1  # its frame is waited for below: no longer in flight once this returns
        backend = self.model.backend
        try:
            records = backend.completion(frame)  # waits for the frame's fence: execution errors surface here
            self._retire_engram(frame)
        except Exception as exc:  # a failed execution fails this round's requests only
            if self.model.engram is not None:
                self.model.engram.release(frame)  # the failed round reads its rows no more
            return self.scheduler.fail_round(round_, f"execution failed: {type(exc).__name__}: {exc}")
        try:
            if round_.graph.name in self._reports_completion:
                views = self._records.get(frame)
                if views is None or views.record is not records:
                    views = self._records[frame] = RecordViews.of(records)
                results = read_lanes(
                    views,
                    launched,
                    round_.expectations,
                    self._sampled_size,
                    packed_capacity=round_.graph.extents.packed_token_capacity,
                )
                if self._rank_completions is not None:  # a lane any rank rejects is committed by none
                    rank_records = self._rank_completions(frame)
                    if len(rank_records) > 1:
                        results = agree_across_ranks(
                            results,
                            rank_records,
                            launched,
                            round_.expectations,
                            self._sampled_size,
                            packed_capacity=round_.graph.extents.packed_token_capacity,
                        )
            else:  # a program without a completion record (state initialization) reports nothing to check
                results = [LaneResult(-1, 0.0) for _ in range(len(round_))]
        except CompletionError as exc:
            return self.scheduler.fail_round(round_, f"execution failed: {exc}")
        try:
            return self.scheduler.complete(round_, results)
        except Exception as exc:  # applying this round went wrong: its requests fail, no others
            return self.scheduler.fail_round(round_, f"internal error completing a round: {type(exc).__name__}: {exc}")

    def _retire_engram(self, frame: int) -> None:
        """The round on ``frame`` completed: each rank retires its read of the frame's Engram rows (every
        rank's completion record, with ranks; the one record, else), which frees the frame for a refill."""
        engram = self.model.engram
        if engram is None:
            return
        rank_completions = getattr(self.model.backend, "rank_completions", None)
        ranks = range(len(rank_completions(frame))) if rank_completions is not None else range(engram.participants)
        for rank in ranks:
            engram.retire(frame, rank)

    def _unpackable(self, round_: RoundPlan, frame: int, error: Exception) -> Sequence[Outgoing]:
        """A round whose packing raised ``error``: pack each lane alone to find the requests whose values do
        not pack, and fail those only; the round's other requests are planned again. When every lane packs
        alone, the fault is the round's (its lanes together), and its requests fail."""
        packer = self.model.packers[round_.graph.name]
        lanes = round_.lane_list()
        failures: dict[int, str] = {}
        try:
            staging = self.model.backend.transport(frame)
            for index, lane in enumerate(lanes):
                try:
                    packer.pack(Submission([lane], self._sequence), frame, staging)
                except Exception as exc:
                    failures[index] = f"the request's values cannot be packed: {type(exc).__name__}: {exc}"
        finally:
            self.model.page_table_memory.forget(frame)  # the probes wrote the frame's staging
        if not failures:
            return self.scheduler.fail_round(round_, f"execution failed: {type(error).__name__}: {error}")
        return self.scheduler.fail_lanes(round_, failures)

    def _drain(self, *, block: bool) -> bool:
        """Apply queued messages; False when the worker must stop. Submissions reach the scheduler in
        order, while its pending deque has room; the rest wait in the backlog."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                self._hand_over()
                return True
            block = False
            if isinstance(message, Stop):
                self._stopping = True
                return False
            if isinstance(message, Cancel):
                waiting = next((r for r in self._backlog if r.request_id == message.request_id), None)
                if waiting is not None:
                    self._backlog.remove(waiting)
                    self._publish([self._cancelled_before_admission(waiting)])
                else:
                    self.scheduler.cancel(message.request_id)
            else:
                self._backlog.append(message.request)
                self._hand_over()

    def _hand_over(self) -> None:
        """Give backlog requests to the scheduler, oldest first, while its pending deque has room."""
        backlog, scheduler = self._backlog, self.scheduler
        while backlog and scheduler.has_room:
            request = backlog.popleft()
            rejection = scheduler.add(request, request.layout)
            if rejection is not None:
                self._publish([rejection])

    def _cancelled_before_admission(self, request: PreparedRequest) -> Finished:
        """The end of a request cancelled before the scheduler took it (nothing was generated): received and
        finished cancelled, as one the scheduler had queued (every request the worker ends was received)."""
        self._stats.received += 1
        finished = self._stats.finished
        finished["cancelled"] = finished.get("cancelled", 0) + 1
        return Finished(request.request_id, "cancelled", len(request.prompt_ids), 0)

    def _publish(self, events: Sequence[Outgoing]) -> None:
        if not events:
            return
        streams, awaiting = self._streams, self._awaiting_first
        with self._lock:  # once for the round's events (a stream's put never blocks)
            now_ns = time.monotonic_ns()
            for event in events:
                if isinstance(event, RoundTokens):
                    if awaiting:
                        self._first_tokens(awaiting.intersection(event.lanes), now_ns)
                    self._put_round(event)
                    continue
                request_id = event.request_id
                terminal = type(event) is not TokenEvent and isinstance(event, TERMINAL_EVENTS)
                if terminal:
                    self._ended(event, now_ns)
                elif request_id in awaiting and type(event) is TokenEvent:
                    self._first_tokens((request_id,), now_ns)
                stream = streams.get(request_id)
                if stream is not None:
                    if terminal:
                        del streams[request_id]
                        self._released.discard(request_id)
                    stream.put(event)

    def _first_tokens(self, request_ids: Iterable[str], now_ns: int) -> None:
        """Record the time to first token of ``request_ids``, whose first token is published now."""
        histogram, submitted, awaiting = self._stats.time_to_first_token, self._submitted_ns, self._awaiting_first
        for request_id in request_ids:
            awaiting.discard(request_id)
            started = submitted.get(request_id)
            if started is not None:
                histogram.observe((now_ns - started) / 1e9)

    def _ended(self, event: Event, now_ns: int) -> None:
        """A request's terminal event is published now: its token counts and, finished, its latency."""
        request_id = event.request_id
        self._awaiting_first.discard(request_id)
        started = self._submitted_ns.pop(request_id, None)
        if isinstance(event, Finished):
            stats = self._stats
            stats.prompt_tokens += event.prompt_tokens
            stats.generation_tokens += event.completion_tokens
            if started is not None and event.reason != "cancelled":
                stats.request_latency.observe((now_ns - started) / 1e9)

    def redirect(self, stream: RequestStream, put: Callable[[Outgoing], None]) -> None:
        """Deliver ``stream``'s events to ``put`` from now on (a consumer in another process, say),
        starting with the events already queued, in order: under the publishing lock, so no event is
        put in between. A decode cohort's cached puts are renewed to include the new one."""
        with self._lock:
            stream._redirect(put)
            self._round_lanes = None

    def _put_round(self, tokens: RoundTokens) -> None:
        """Put a round's tokens on the stream of each of its requests. The puts are found once per cohort:
        its requests are running (not ended) for as long as its rounds are delivered this way, so their
        streams stay registered."""
        if tokens.lanes is not self._round_lanes:
            streams = self._streams
            self._round_lanes = tokens.lanes
            self._round_puts = [
                stream.put for request_id in tokens.lanes if (stream := streams.get(request_id)) is not None
            ]
        for put in self._round_puts:
            put(tokens)

    def _take_snapshot(self) -> StatsSnapshot:
        stats, pages, scheduler = self._stats, self.allocator, self.scheduler
        return StatsSnapshot(
            received=stats.received,
            admitted=stats.admitted,
            rejected=stats.rejected + self._refused,
            failed=stats.failed,
            preemptions=stats.preemptions,
            snapshots=stats.snapshots,
            restores=stats.restores,
            snapshots_discarded=stats.snapshots_discarded,
            pipelined_rounds=stats.pipelined_rounds,
            finished=dict(stats.finished),
            rounds=dict(stats.rounds),
            launches=dict(stats.launches),
            lanes=stats.lanes,
            mixed_grammar_decode_steps=stats.mixed_grammar_decode_steps,
            constrained_max_inflight=stats.constrained_max_inflight,
            pages_total=pages.total_pages,
            pages_free=pages.free_pages,
            pages_referenced=pages.referenced_pages,
            pages_evictable=pages.evictable_pages,
            pages_published=pages.stats.published,
            pages_evicted=pages.stats.evicted,
            prefix_queries=pages.stats.prefix_queries,
            prefix_hit_pages=pages.stats.prefix_hit_pages,
            reused_tokens=pages.stats.reused_tokens,
            active_requests=len(scheduler.running),
            waiting_requests=len(scheduler.waiting) + len(self._backlog),
            max_active=scheduler.max_active,
            speculative_lanes=dict(stats.speculative_lanes),
            proposals_offered=dict(stats.proposals_offered),
            drafts_accepted=dict(stats.drafts_accepted),
            speculative_emitted=dict(stats.speculative_emitted),
            offered_by_position=dict(stats.offered_by_position),
            accepted_by_position=dict(stats.accepted_by_position),
            speculation_stretches=dict(stats.speculation_stretches),
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            time_to_first_token_counts=list(stats.time_to_first_token.counts),
            time_to_first_token_sum_s=stats.time_to_first_token.sum_s,
            request_latency_counts=list(stats.request_latency.counts),
            request_latency_sum_s=stats.request_latency.sum_s,
            **_host_tier_statistics(pages.host),
            **_checkpoint_statistics(scheduler.residency.checkpoints),
        )


def _host_tier_statistics(host: HostPageStore | None) -> dict[str, int]:
    """The snapshot's host-tier fields (their defaults, 0, without a host tier)."""
    if host is None:
        return {}
    return {
        "offload_capacity_pages": host.capacity,
        "offload_pages_used": host.used_pages,
        "offload_pages_free": host.free_pages,
        "offloaded_pages": host.stats.offloaded,
        "restored_pages": host.stats.restored,
        "offload_evicted_pages": host.stats.evicted,
    }


def _checkpoint_statistics(checkpoints: CheckpointIndex | None) -> dict[str, int]:
    """The snapshot's checkpoint fields (their defaults, 0, for a core that takes no checkpoints)."""
    if checkpoints is None:
        return {}
    stats = checkpoints.stats
    return {
        "checkpoints_held": len(checkpoints),
        "checkpoints_published": stats.published,
        "checkpoint_hits": stats.hits,
        "checkpoint_reused_tokens": stats.reused_tokens,
        "checkpoints_evicted": stats.evicted,
        "checkpoints_abandoned": stats.abandoned,
        **_checkpoint_host_statistics(checkpoints.host),
    }


def _checkpoint_host_statistics(host: HostCheckpointStore | None) -> dict[str, int]:
    """The snapshot's checkpoint host-tier fields (their defaults, 0, without one)."""
    if host is None:
        return {}
    return {
        "offload_capacity_checkpoints": host.capacity,
        "offload_checkpoints": len(host),
        "offloaded_checkpoints": host.stats.stored,
        "restored_checkpoints": host.stats.restored,
        "offload_evicted_checkpoints": host.stats.evicted,
    }


def _transport_owned(model: NativeModel, staging: Mapping[str, _Flat]) -> tuple[_Flat | None, _Flat | None]:
    """Flat views of the frame-index and submission-sequence entries of ``staging`` (``None`` where the
    core has none): they belong to the transport, not to value bindings."""
    transport = model.contract.execution.transport
    frame_entry, sequence_entry = transport.frame_index_entry, transport.submission_sequence_entry
    return (
        staging[frame_entry].reshape(-1) if frame_entry else None,
        staging[sequence_entry].reshape(-1) if sequence_entry else None,
    )


def _programs_writing_completion(model: NativeModel) -> frozenset[str]:
    """Selected programs with a node that writes a completion buffer (their records are validated)."""
    completion_buffers = {record.buffer for record in model.contract.execution.completion}
    writers = set()
    for program in model.contract.execution.programs:
        if program.name in model.selection.graphs and any(
            arg.view.buffer in completion_buffers for node in program.nodes for arg in node.args
        ):
            writers.add(program.name)
    return frozenset(writers)
