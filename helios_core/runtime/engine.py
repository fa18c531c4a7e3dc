"""The engine API and its model worker.

Owns the worker thread that turns prepared requests into program launches, and
the per-request event streams it fills. ``Engine.submit`` hands a
:class:`~helios_core.runtime.messages.PreparedRequest` to the worker and
returns a :class:`RequestStream` of events; ``Engine.cancel`` stops a request
between rounds. This version serves one request at a time: admission checks
the request against the prepared capacities, then the worker runs
``initialize``, chunked prefill with the smallest captured variant that fits
each chunk, and decode rounds until EOS, the output limit or cancellation.
Every completion record is validated before its token is published.

The worker step reads as: plan the round's lanes, pack them into the frame's
staging, run the program, validate the completion, publish.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from helios_core.contract import PreparedGraph
from helios_core.errors import HeliosError
from helios_core.runtime.completion import LaneExpectation, read_lanes
from helios_core.runtime.messages import (
    TERMINAL_EVENTS,
    AdmissionRejected,
    Event,
    ExecutionFailed,
    Finished,
    PreparedRequest,
    TokenEvent,
)
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.packing import Lane, Submission
from helios_core.wire import contract_pb2 as ct

_STOP = object()


class RequestStream:
    """The events of one request, in order; iteration ends after the terminal event."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._events.put(event)

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._events.get()
            yield event
            if isinstance(event, TERMINAL_EVENTS):
                return


@dataclass
class _Active:
    """Worker-side state of the request being served."""

    request: PreparedRequest
    stream: RequestStream
    generation: int
    consumed: int = 0
    generated: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationResult:
    """A finished request collected from its stream."""

    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class Engine:
    """Submit prepared requests, receive their events, cancel them."""

    def __init__(self, model: NativeModel) -> None:
        self.model = model
        contract = model.contract
        self._eos = frozenset(contract.eos_token_ids)
        self._page_tokens = contract.model.cache.page_tokens
        self._sampled_size = contract.sampled_size
        self._histogram_width = contract.histogram_width
        self._context = contract.serving.context_tokens
        graphs = model.selection.graphs.values()
        self._initialize = _smallest(graphs, ct.OPERATION_INITIALIZE, rows=1)
        self._prefills = sorted(
            (g for g in graphs if g.operation == ct.OPERATION_PREFILL),
            key=lambda g: g.extents.packed_token_capacity,
        )
        self._decode = _smallest(graphs, ct.OPERATION_DECODE, rows=1)
        self._pages_per_row = min((v.pages_per_row for v in contract.model.cache.page_table_views), default=0)
        self._inbox: queue.SimpleQueue[PreparedRequest | object] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._generations = itertools.count(1)
        self._sequence = itertools.count(1)
        self._worker = threading.Thread(target=self._run, name="helios-model-worker", daemon=True)
        self._worker.start()

    # -- the engine API ---------------------------------------------------------------
    def submit(self, request: PreparedRequest) -> RequestStream:
        """Queue ``request``; its events arrive on the returned stream."""
        stream = RequestStream(request.request_id)
        with self._lock:
            if request.request_id in self._streams:
                raise HeliosError(f"request id {request.request_id!r} is already active")
            self._streams[request.request_id] = stream
        self._inbox.put(request)
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request before its next round; it finishes with reason ``cancelled``."""
        with self._lock:
            if request_id in self._streams:
                self._cancelled.add(request_id)

    def generate(self, request: PreparedRequest) -> GenerationResult:
        """Submit and wait: the tokens and finish reason, or the rejection/failure as an error."""
        tokens: list[int] = []
        for event in self.submit(request):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            elif isinstance(event, Finished):
                return GenerationResult(tokens, event.reason, event.prompt_tokens)
            elif isinstance(event, AdmissionRejected | ExecutionFailed):
                raise HeliosError(event.message)
        raise HeliosError("the request stream ended without a terminal event")

    def shutdown(self) -> None:
        """Finish the request in progress, stop the worker and release the model."""
        self._inbox.put(_STOP)
        self._worker.join()
        self.model.close()

    # -- the worker --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            if not isinstance(item, PreparedRequest):
                continue
            stream = self._streams[item.request_id]
            try:
                self._serve(item, stream)
            except HeliosError as exc:
                stream.put(ExecutionFailed(item.request_id, str(exc)))
            except Exception as exc:  # a failed execution fails this request only
                stream.put(ExecutionFailed(item.request_id, f"execution failed: {type(exc).__name__}: {exc}"))
            finally:
                with self._lock:
                    self._streams.pop(item.request_id, None)
                    self._cancelled.discard(item.request_id)

    def _admission_problem(self, request: PreparedRequest) -> str | None:
        prompt = len(request.prompt_ids)
        if prompt == 0:
            return "the prompt is empty"
        if request.max_tokens <= 0:
            return "max_tokens must be positive"
        total = prompt + request.max_tokens
        if total > self._context:
            return (
                f"prompt ({prompt} tokens) plus max_tokens ({request.max_tokens}) exceeds the core's context of "
                f"{self._context} tokens"
            )
        pages = -(-total // self._page_tokens)
        if pages > min(self._pages_per_row, self.model.cache_pages):
            return (
                f"the request needs {pages} cache pages; at most {min(self._pages_per_row, self.model.cache_pages)} fit"
            )
        return None

    def _serve(self, request: PreparedRequest, stream: RequestStream) -> None:
        problem = self._admission_problem(request)
        if problem is not None:
            stream.put(AdmissionRejected(request.request_id, problem))
            return
        active = _Active(request, stream, generation=next(self._generations))
        total = len(request.prompt_ids) + request.max_tokens
        pages = list(range(-(-total // self._page_tokens)))
        self._round(self._initialize, active, pages, tokens=[], sample=False, histogram=True)
        prompt = request.prompt_ids
        while active.consumed < len(prompt):
            if self._is_cancelled(request.request_id):
                break
            remaining = len(prompt) - active.consumed
            program = next(
                (g for g in self._prefills if g.extents.packed_token_capacity >= remaining), self._prefills[-1]
            )
            chunk = prompt[active.consumed : active.consumed + program.extents.packed_token_capacity]
            last = active.consumed + len(chunk) == len(prompt)
            token = self._round(program, active, pages, tokens=chunk, sample=last)
            if last and self._publish(active, token):
                return
        while not self._is_cancelled(request.request_id):
            token = self._round(self._decode, active, pages, tokens=None, sample=True)
            if self._publish(active, token):
                return
        stream.put(Finished(request.request_id, "cancelled", len(prompt), len(active.generated)))

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def _publish(self, active: _Active, result: tuple[int, float]) -> bool:
        """Publish one token; True when the request finished."""
        token, logprob = result
        request = active.request
        active.generated.append(token)
        active.stream.put(TokenEvent(request.request_id, token, logprob))
        reason = None
        if token in self._eos and not request.ignore_eos:
            reason = "stop"
        elif len(active.generated) >= request.max_tokens:
            reason = "length"
        if reason is None:
            return False
        active.stream.put(Finished(request.request_id, reason, len(request.prompt_ids), len(active.generated)))  # type: ignore[arg-type]
        return True

    def _round(
        self,
        graph: PreparedGraph,
        active: _Active,
        pages: list[int],
        *,
        tokens: list[int] | None,
        sample: bool,
        histogram: bool = False,
    ) -> tuple[int, float]:
        """Plan, pack, run, validate one single-lane round; returns the sampled id and logprob."""
        request, params = active.request, active.request.sampling
        if graph.operation == ct.OPERATION_DECODE:
            positions = [active.consumed]
        elif tokens is not None:
            positions = list(range(active.consumed, active.consumed + len(tokens)))
        else:
            positions = []
        lane = Lane(
            slot=0,
            generation=active.generation,
            state_row=0,
            positions=positions,
            cache_slots=[pages[p // self._page_tokens] * self._page_tokens + p % self._page_tokens for p in positions],
            page_table=pages,
            tokens=tokens or [],
            sample=sample,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            seed=params.seed,
            sampling_step=len(active.generated),
            prompt_histogram=self._prompt_histogram(request.prompt_ids) if histogram else None,
            consumed=active.consumed,
        )
        sequence = next(self._sequence)
        frame = 0
        backend = self.model.backend
        staging = backend.transport(frame)
        self.model.packers[graph.name].pack(Submission([lane], sequence), frame, staging)
        _write_transport_owned(self.model, staging, frame, sequence)
        backend.run(graph.name, frame)
        if graph.operation == ct.OPERATION_INITIALIZE:
            return (-1, 0.0)
        consumed = active.consumed + len(positions)
        expectation = LaneExpectation(generation=active.generation, consumed=consumed, samples=sample)
        (result,) = read_lanes(backend.completion(frame), sequence, [expectation], self._sampled_size)
        active.consumed = consumed
        return result.token_id, result.logprob

    def _prompt_histogram(self, prompt: list[int]) -> np.ndarray:  # type: ignore[type-arg]
        counts = np.bincount(np.asarray(prompt, dtype=np.int64), minlength=self._histogram_width)
        return np.minimum(counts, 255).astype(np.uint8)


def _write_transport_owned(model: NativeModel, staging: object, frame: int, sequence: int) -> None:
    """Frame index and submission sequence belong to the transport, not to value bindings."""
    transport = model.contract.execution.transport
    arrays = staging  # the frame's staging mapping
    if transport.frame_index_entry:
        arrays[transport.frame_index_entry].reshape(-1)[0] = frame  # type: ignore[index]
    if transport.submission_sequence_entry:
        arrays[transport.submission_sequence_entry].reshape(-1)[0] = sequence  # type: ignore[index]


def _smallest(graphs: Iterable[PreparedGraph], operation: int, *, rows: int) -> PreparedGraph:
    candidates = sorted(
        (g for g in graphs if g.operation == operation and g.extents.batch_capacity >= rows),
        key=lambda g: g.extents.batch_capacity,
    )
    if not candidates:
        raise HeliosError(f"no selected program for operation {operation} holds {rows} rows")
    return candidates[0]
