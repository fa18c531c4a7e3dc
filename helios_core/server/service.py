"""The chat service: one request's path from decoded body to delivered response.

It serves both generating endpoints, chat completions and legacy completions: the two differ only in
their request struct and decoder, their preparation function and their presenter (an
:class:`_Endpoint`); admission, the preparation pool, submission, cancellation on disconnect,
metrics and errors are one path.

Owns the order of the request lifecycle on the server side (docs/index.md, "A request's path") and the objects
that live as long as the app: admission, the preparation thread pool, the event bridge, the shared
frontend and the metrics exporter. Per request it decodes the body strictly (``ingress_ns``), takes
an admission permit (429 when none is left; one a choice when ``n`` > 1), waits for a preparation slot,
prepares on a frontend worker thread (400 on an invalid request), submits to the engine (``enqueue_ns``;
one engine request a choice) and then either collects a JSON response or streams SSE (several choices:
collected at once and merged, or their streams interleaved and ended once). The permit is released
when the reader releases the response; a dropped connection cancels the request (``Engine.cancel``). The controllers in
:mod:`helios_core.server.app` only call into this class.

The response id (``chatcmpl-...``, ``cmpl-...`` for legacy completions) is made on arrival, set on
``request.state`` and sent as ``x-request-id``, so every log line of a request names it. A body
declared as anything but JSON is 415. An output failure (presentation raising) ends the response
with ``execution_error`` and is counted as failed (:class:`~helios_core.server.metrics.OutputFailures`).
At shutdown :meth:`ChatService.drop_responses` ends every running response with its terminal
``cancelled`` error.

Every inference route (and ``GET /v1/models``) first asks the app's
:class:`~helios_core.server.readiness.Readiness` (503 ``not_ready`` while starting or draining);
``GET /health`` reports the model worker thread's liveness. :meth:`ChatService.warm_up` is the
startup generation ``helios run`` makes through the engine before it reports ready, and
:meth:`ChatService.render` serves the render endpoints: the exact prompt token ids the request's
own preparation produces (the same function as generation, the same errors), without generating.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import InternalServerException
from litestar.response import Stream

from helios_core.errors import StartupError
from helios_core.runtime.messages import (
    TERMINAL_EVENTS,
    AdmissionRejected,
    Event,
    ExecutionFailed,
    Finished,
    PromptScores,
    TokenEvent,
)
from helios_core.runtime.startup import RunningModel
from helios_core.server.admission import Admission, Permit
from helios_core.server.bridge import EventBridge, EventQueue, Interrupt
from helios_core.server.errors import (
    REQUEST_ID_STATE,
    AdmissionRefused,
    ClientDisconnected,
    ExecutionError,
    InvalidRequest,
    NotReady,
    RequestCancelled,
    UnknownModel,
    UnsupportedMediaType,
    clamp_retry_after_ms,
    error_body,
    log_failure,
    validation_error,
)
from helios_core.server.image_input import ImageLimits
from helios_core.server.metrics import LoadReading, MetricsExporter
from helios_core.server.preparation import Frontend, Prepared, prepare, prepare_completion
from helios_core.server.presentation import (
    CompletionPresenter,
    Presenter,
    ResponsePresenter,
    merge_choices,
    sse_error,
)
from helios_core.server.readiness import Phase, Readiness
from helios_core.server.schemas import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    decode_completion_request,
    decode_request,
)
from helios_core.server.worker_process import WorkerProcessEngine

__all__ = ["CHAT_ID_PREFIX", "COMPLETION_ID_PREFIX", "ChatService", "ServerSettings"]

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings of an app (capacities come from the running model's selection)."""

    served_name: str | None = None
    """Overrides the core's served name."""
    aliases: tuple[str, ...] = field(default=())
    """Added to the core's aliases."""
    vllm_metrics: bool = False
    """Also export the gateway load gauges under vLLM's metric names (docs/metrics.md)."""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    """What one chat request's images may cost (the ``--image-*`` run options)."""


GenerationRequest = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class _Endpoint:
    """What distinguishes one generating endpoint: id prefix, decoding, preparation, presentation."""

    id_prefix: str
    decode: Callable[[bytes], GenerationRequest]
    prepare: Callable[[Frontend, Any, str], Prepared]
    presenter: type[Presenter] | type[CompletionPresenter]


CHAT_ID_PREFIX = "chatcmpl-"
"""The prefix of a chat completion's response id (and ``x-request-id``)."""
COMPLETION_ID_PREFIX = "cmpl-"
"""The prefix of a legacy completion's response id."""

_CHAT = _Endpoint(CHAT_ID_PREFIX, decode_request, prepare, Presenter)
_COMPLETIONS = _Endpoint(COMPLETION_ID_PREFIX, decode_completion_request, prepare_completion, CompletionPresenter)

WARM_UP_PROMPT = "Hello"
"""The text whose first token is the warm-up generation's one-token prompt (a prompt shorter than a
cache page leaves no reusable prefix behind)."""


class ChatService:
    """Everything the HTTP controllers call (see the module docstring)."""

    def __init__(self, running: RunningModel, settings: ServerSettings, readiness: Readiness | None = None) -> None:
        self.running = running
        self.readiness = readiness if readiness is not None else Readiness.ready()
        serving = running.verified.contract.serving
        self.served_name = settings.served_name or serving.served_name
        self.aliases = tuple(dict.fromkeys(a for a in (*serving.aliases, *settings.aliases) if a != self.served_name))
        self.names = frozenset((self.served_name, *self.aliases))
        selection = running.model.selection
        capacity = selection.queue_capacity + selection.max_active
        self.admission = Admission(capacity, selection.frontend_workers, selection.max_active)
        self.frontend = Frontend(running, image_limits=settings.image_limits)
        self._preparation = ThreadPoolExecutor(selection.frontend_workers, thread_name_prefix="helios-frontend")
        self._bridge = EventBridge(capacity + selection.frontend_workers)
        self.metrics = MetricsExporter(
            running.engine.statistics,
            lambda: self.admission.in_use,
            self.load,
            vllm_metrics=settings.vllm_metrics,
            refused=lambda: self.admission.refused,
        )
        self._origin_ns = running.model.clock_origin_ns
        self._created = int(time.time())
        """``created`` of the served models: when this server started."""
        self._responses: dict[str, EventQueue] = {}
        """The event queues of the responses being generated or delivered, by request id."""
        self._drop_message: str | None = None
        """Set once shutdown drops the responses still running (:meth:`drop_responses`)."""
        self._settling: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        self._preparation.shutdown(wait=False, cancel_futures=True)
        self._bridge.close()

    def _now_ns(self) -> int:
        return time.monotonic_ns() - self._origin_ns

    def load(self) -> LoadReading:
        """The gateway's load values now (event loop thread). Read live, never from the worker's
        snapshot: list sizes and counters only, no lock the worker holds. A request between the two
        reads (leaving its slot as its terminal event is on the way) may count once as waiting."""
        engine = self.running.engine
        if isinstance(engine, WorkerProcessEngine):  # the worker process's newest gauges (at most 20 ms old)
            live = engine.live_load()
            running, free, evictable = live.running, live.free_pages, live.evictable_pages
            total, page_tokens = live.total_pages, live.page_tokens
        else:
            pages = engine.allocator
            running = len(engine.scheduler.running)
            free, evictable = pages.free_pages, pages.evictable_pages
            total, page_tokens = pages.total_pages, pages.page_tokens
        undelivered = self.admission.ended
        waiting = max(0, self.admission.in_use - running - undelivered)
        usage = min(1.0, max(0.0, 1.0 - (free + evictable) / total))
        return LoadReading(waiting, running, undelivered, usage, page_tokens, total)

    # -- endpoints --------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the served name and every alias."""
        self.readiness.check()
        return {"object": "list", "data": [self._model(name) for name in (self.served_name, *self.aliases)]}

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``: one served name or alias, else 404 naming it."""
        self.readiness.check()
        self._check_served(name)
        return self._model(name)

    def _check_served(self, name: str) -> None:
        """404 (UnknownModel) unless ``name`` is the served name or an alias."""
        if name not in self.names:
            raise UnknownModel(f"model {name!r} is not served here; GET /v1/models lists the served names")

    def _model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "helios", "root": self.served_name}

    def health(self) -> Response[dict[str, Any]]:
        """``GET /health``: liveness. 200 while the model worker thread runs, 503 once it stopped or the
        start failed (the warm-up raised: the server is stopping)."""
        if self.readiness.phase is Phase.FAILED:
            body = {"status": "failed", "model": self.served_name, "reason": self.readiness.reason}
            return Response(body, status_code=503)
        if self.running.engine.worker_alive():
            return Response({"status": "ok", "model": self.served_name}, status_code=200)
        body = {"status": "dead", "model": self.served_name, "reason": "the model worker stopped"}
        return Response(body, status_code=503)

    def ready(self) -> dict[str, Any]:
        """``GET /ready``: 200 once warmed up and while the worker runs; else 503 ``not_ready``."""
        self.readiness.check()
        if not self.running.engine.worker_alive():
            raise NotReady("the model worker stopped")
        return {"status": "ready", "model": self.served_name}

    def warm_up(self) -> None:
        """One real one-token generation through the engine (blocking; helios run calls it once on a
        thread before it reports ready). Raises StartupError when it does not finish normally."""
        tokenizer = self.running.bootstrap.tokenizer
        first: list[int | str | list[int]] = [*tokenizer.encode(WARM_UP_PROMPT, add_special_tokens=False).ids[:1]]
        request = CompletionRequest(prompt=first or [0], max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            prepared = prepare_completion(self.frontend, request, f"warmup-{uuid.uuid4().hex}")
            result = self.running.engine.generate(prepared.request)
        except Exception as exc:
            raise StartupError(f"the warm-up generation failed: {type(exc).__name__}: {exc}") from exc
        if result.finish_reason not in ("length", "stop") or len(result.token_ids) != 1:
            raise StartupError(
                f"the warm-up generation ended with {result.finish_reason!r} after {len(result.token_ids)} tokens"
            )

    async def chat(self, request: Request[Any, Any, Any]) -> Response[Any]:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, _CHAT)

    async def completions(self, request: Request[Any, Any, Any]) -> Response[Any]:
        """``POST /v1/completions`` (legacy completions: a raw prompt, no chat template)."""
        return await self._generate(request, _COMPLETIONS)

    async def render_chat(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """``POST /v1/chat/completions/render``."""
        return await self.render(request, _CHAT)

    async def render_completion(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """``POST /v1/completions/render``."""
        return await self.render(request, _COMPLETIONS)

    async def render(self, request: Request[Any, Any, Any], endpoint: _Endpoint) -> dict[str, Any]:
        """The prompt token ids generation would prefill for this body: the endpoint's own decoding and
        preparation run (the same errors as generating), under an admission permit and a preparation
        slot, and nothing is submitted. A request refused there (outside the capacities: the permanent 503)
        counts as rejected, as generation's does, and as a 429 of :meth:`_admit` does on either."""
        decoded, _, permit, request_id = await self._admit(request, endpoint)
        try:
            self._choice_count(decoded)  # the same refusal as generating
            loop = asyncio.get_running_loop()
            async with self.admission.preparation_slot():
                try:
                    prepared = await loop.run_in_executor(
                        self._preparation, endpoint.prepare, self.frontend, decoded, request_id
                    )
                except AdmissionRefused:
                    self.admission.count_refusal()
                    raise
        finally:
            permit.release()
        prompt_ids = list(prepared.request.prompt_ids)
        return {
            "id": request_id,
            "object": "render",
            "model": decoded.model or self.served_name,
            "prompt_token_ids": prompt_ids,
            "num_prompt_tokens": len(prompt_ids),
        }

    async def _admit(
        self, request: Request[Any, Any, Any], endpoint: _Endpoint
    ) -> tuple[GenerationRequest, int, Permit, str]:
        """Readiness, the response id, strict decoding, the model name and an admission permit, in that
        order: (decoded request, ingress time, permit, request id)."""
        request_id = f"{endpoint.id_prefix}{uuid.uuid4().hex}"
        request.state[REQUEST_ID_STATE] = request_id
        self.readiness.check()
        _check_content_type(request.headers.get("content-type"))
        try:
            body = await request.body()
        except InternalServerException as exc:  # Litestar's answer to a disconnect while the body is read
            raise ClientDisconnected(f"the client disconnected before its request body arrived: {exc.detail}") from exc
        try:
            decoded = endpoint.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise validation_error(exc) from exc
        ingress_ns = self._now_ns()
        if decoded.model is not None:
            self._check_served(decoded.model)
        return decoded, ingress_ns, self.admission.admit(), request_id

    async def _generate(self, request: Request[Any, Any, Any], endpoint: _Endpoint) -> Response[Any]:
        decoded, ingress_ns, permit, request_id = await self._admit(request, endpoint)
        permits = [permit]
        try:
            self._admit_choices(decoded, permits)
            return await self._admitted(request, endpoint, decoded, permits, ingress_ns, request_id)
        except BaseException:
            for held in permits:
                held.release()
            raise

    def _admit_choices(self, decoded: GenerationRequest, permits: list[Permit]) -> None:
        """One more permit into ``permits`` for each choice past the first (``n`` > 1): each choice is a
        request of the model's. 429 when the bound has too few left, 400 when ``n`` exceeds the bound itself
        (an ``n`` outside its range is preparation's 400)."""
        count = self._choice_count(decoded)
        for _ in range(count - 1):
            permits.append(self.admission.admit())

    def _choice_count(self, decoded: GenerationRequest) -> int:
        """The choices ``decoded`` asks for (1 when ``n`` lies outside its range: preparation refuses that);
        400 when they are more than this server admits at once."""
        count = decoded.n or 1
        if not 1 < count <= MAX_CHOICES:
            return 1
        if count > self.admission.capacity:
            raise InvalidRequest(
                f"n ({count}) is more than the {self.admission.capacity} requests this server admits at once", "n"
            )
        return count

    def drop_responses(self, message: str) -> int:
        """End every response still running, now: a stream with one terminal ``cancelled`` error event, a
        JSON response with a 503 ``cancelled`` body; each logs one line. Later requests end the same way
        before reaching the model. Shutdown calls this after its drain period; returns how many ended."""
        self._drop_message = message
        for events in self._responses.values():
            events.put_nowait(Interrupt(message))
        return len(self._responses)

    # -- one admitted request ---------------------------------------------------------------------
    async def _admitted(
        self,
        request: Request[Any, Any, Any],
        endpoint: _Endpoint,
        decoded: GenerationRequest,
        permits: list[Permit],
        ingress_ns: int,
        request_id: str,
    ) -> Response[Any]:
        loop = asyncio.get_running_loop()
        async with self.admission.preparation_slot():
            try:
                prepared = await loop.run_in_executor(
                    self._preparation, endpoint.prepare, self.frontend, decoded, request_id
                )
            except AdmissionRefused:  # outside the capacities, found before the model: a rejection all the same
                self.admission.count_refusal()
                raise
        if self._drop_message is not None:
            _LOG.warning("request %s dropped before generation: %s", request_id, self._drop_message)
            raise RequestCancelled(self._drop_message)
        enqueue_ns = self._now_ns()
        requests = prepared.choice_requests()
        several = len(requests) > 1
        created = int(time.time())
        # the presenters (and the output parsers they build) first: one that fails submits nothing
        presenters = [
            endpoint.presenter(
                prepared,
                self.frontend,
                response_id=request_id,
                created=created,
                model=decoded.model or self.served_name,
                ingress_ns=ingress_ns,
                enqueue_ns=enqueue_ns,
                choice_index=index,
                closes=not several,
            )
            for index in range(len(requests))
        ]
        choices = [
            _Choice(
                dataclasses.replace(prepared, request=choice, choices=()) if several else prepared,
                presenter,
                self._bridge.attach(self.running.engine.submit(choice), loop, permit.generation_ended),
                permit,
            )
            for choice, presenter, permit in zip(requests, presenters, permits, strict=True)
        ]
        headers = {"x-request-id": request_id}
        if prepared.stream:
            first = choices[0]
            return Stream(
                self._sse_choices(choices)
                if several
                else self._sse(first.prepared, first.presenter, first.events, first.permit),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )
        body = await self._collect(request, choices)
        return Response(body, headers=headers, background=BackgroundTask(_release, permits))

    async def _collect(self, request: Request[Any, Any, Any], choices: list[_Choice]) -> dict[str, Any]:
        """A JSON response: every choice collected at once (the first failure ends the others), merged."""
        watcher = asyncio.create_task(
            self._cancel_on_disconnect(request, [choice.prepared.request.request_id for choice in choices])
        )
        try:
            if len(choices) == 1:
                (only,) = choices
                return await self._collect_choice(only.prepared, only.presenter, only.events)
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(self._collect_choice(choice.prepared, choice.presenter, choice.events))
                        for choice in choices
                    ]
            except BaseExceptionGroup as failed:  # the first choice's failure is the response's
                raise failed.exceptions[0] from None
            return merge_choices([task.result() for task in tasks], [choice.presenter for choice in choices])
        finally:
            watcher.cancel()

    async def _collect_choice(
        self, prepared: Prepared, presenter: ResponsePresenter, events: EventQueue
    ) -> dict[str, Any]:
        request_id = prepared.request.request_id
        self._responses[request_id] = events
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, Interrupt):
                    _LOG.warning("request %s dropped before it finished: %s", request_id, event.message)
                    raise RequestCancelled(event.message)
                terminal = event if isinstance(event, TERMINAL_EVENTS) else None
                finished = terminal is not None
                try:
                    if isinstance(event, TokenEvent):
                        presenter.collect(event)
                        continue
                    if isinstance(event, PromptScores):
                        presenter.prompt_scores(event)
                        continue
                    if isinstance(event, Finished) and event.reason != "cancelled":
                        return presenter.completion(event)
                except Exception as exc:  # presentation failed: the request's output error
                    self._output_failed(events, terminal)
                    raise ExecutionError(f"output handling failed: {type(exc).__name__}: {exc}") from exc
                if isinstance(event, Finished):
                    raise RequestCancelled("the request was cancelled before it finished")
                if isinstance(event, AdmissionRejected):
                    raise _refusal(event, prepared, self.admission.retry_after_ms())
                if isinstance(event, ExecutionFailed):
                    raise ExecutionError(event.message)
                raise ExecutionError(f"unexpected event {type(event).__name__}")
        finally:
            self._responses.pop(request_id, None)
            if not finished:
                self.running.engine.cancel(request_id)

    async def _cancel_on_disconnect(self, request: Request[Any, Any, Any], request_ids: list[str]) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for request_id in request_ids:
                    self.running.engine.cancel(request_id)
                return

    async def _sse_choices(self, choices: list[_Choice]) -> AsyncIterator[bytes]:
        """The stream of a response of several choices: each choice's own stream (:meth:`_sse`, whose
        presenter does not close it), their chunks sent as they come; once every choice finished, the usage
        chunk of them all and ``[DONE]``. A choice that ends with an error event ends the response there
        (the others are cancelled), as a dropped connection ends them all."""
        merged: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[bytes]) -> None:
            try:
                async for chunk in stream:
                    merged.put_nowait((index, chunk))
            finally:
                merged.put_nowait((index, None))

        pumps = [
            asyncio.create_task(pump(index, self._sse(choice.prepared, choice.presenter, choice.events, choice.permit)))
            for index, choice in enumerate(choices)
        ]
        try:
            running = len(pumps)
            while running:
                index, chunk = await merged.get()
                if chunk is not None:
                    yield chunk
                    continue
                running -= 1
                if choices[index].presenter.finished is None:  # it ended with an error event: so does the response
                    return
            yield b"".join(choices[0].presenter.stream_close([choice.presenter for choice in choices]))
        finally:
            for task in pumps:
                task.cancel()

    async def _sse(
        self,
        prepared: Prepared,
        presenter: ResponsePresenter,
        events: EventQueue,
        permit: Permit,
    ) -> AsyncIterator[bytes]:
        request_id = prepared.request.request_id
        self._responses[request_id] = events  # from here on a drop puts an Interrupt on the queue
        finished = False
        reported = False
        """Whether the response already said why it ends early (drop or output failure)."""
        uncounted_failure = False
        """An output failure whose terminal event has not arrived yet (counted when it does)."""
        try:
            pending: Event | Interrupt | None = None
            if prepared.prompt_logprobs:  # the first chunk carries the prompt's scores: wait for them
                pending = await events.get()
                if isinstance(pending, PromptScores):
                    presenter.prompt_scores(pending)
                    pending = None
            first = presenter.first_chunk() if self._drop_message is None else b""
            if first:  # a completion without echo has no opening chunk
                yield first
            while not finished:
                if self._drop_message is None or pending is not None:
                    event = pending if pending is not None else await events.get()
                else:  # dropped before this response registered, or while its reader was behind
                    event = Interrupt(self._drop_message)
                pending = None
                # the events already queued behind this one go out in the same write, in order: none waits
                # for another, and a reader that fell behind catches up with one write, not one per event
                chunks: list[bytes] = []
                while True:
                    if isinstance(event, Interrupt):
                        reported = True
                        _LOG.warning("request %s dropped before it finished: %s", request_id, event.message)
                        chunks.append(sse_error(error_body(RequestCancelled(event.message))))
                        yield b"".join(chunks)
                        return
                    terminal = event if isinstance(event, TERMINAL_EVENTS) else None
                    try:
                        chunk, finished = self._sse_event(presenter, event, prepared)
                    except Exception as exc:  # presentation failed: the request's output error, as its own event
                        reported = True
                        if terminal is not None:
                            self._count_output_failure(terminal)
                        else:
                            uncounted_failure = True
                        failure = ExecutionError(f"output handling failed: {type(exc).__name__}: {exc}")
                        log_failure(request_id, failure)
                        chunks.append(sse_error(error_body(failure)))
                        yield b"".join(chunks)
                        return
                    if chunk:
                        chunks.append(chunk)
                    if finished or events.empty() or self._drop_message is not None:
                        break
                    event = events.get_nowait()
                if chunks:
                    yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            self._responses.pop(request_id, None)
            if finished:
                permit.release()
            else:
                self.running.engine.cancel(request_id)
                if self._drop_message is not None and not reported:  # cut while a chunk was being sent
                    _LOG.warning("request %s dropped before it finished: %s", request_id, self._drop_message)
                # the permit holds until the model worker ended the request (the round in flight), as a
                # JSON response's does: a dropped stream's work still counts against the bound till then
                self._settle(events, count_failure=uncounted_failure, release=permit.release)

    def _output_failed(self, events: EventQueue, terminal: Event | None) -> None:
        """Count an output failure as failed, not as the end the worker counted: at once when its
        terminal event is known, else when that event arrives (the caller stops the request)."""
        if terminal is not None:
            self._count_output_failure(terminal)
            return
        self._settle(events, count_failure=True)

    def _settle(self, events: EventQueue, *, count_failure: bool, release: Callable[[], None] | None = None) -> None:
        """Once the terminal event of a request the response stopped reading arrives: count it as an output
        failure (``count_failure``), then ``release`` (also if the server stops first)."""
        task = asyncio.get_running_loop().create_task(self._settle_after_end(events, count_failure, release))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_after_end(
        self, events: EventQueue, count_failure: bool, release: Callable[[], None] | None
    ) -> None:
        try:
            while True:
                event = await events.get()
                if isinstance(event, TERMINAL_EVENTS):
                    if count_failure:
                        self._count_output_failure(event)
                    return
        finally:
            if release is not None:
                release()

    def _count_output_failure(self, terminal: Event) -> None:
        if isinstance(terminal, Finished):  # an ExecutionFailed end is already counted as failed
            self.metrics.output_failures.record(terminal.reason)

    @staticmethod
    def _sse_event(presenter: ResponsePresenter, event: Event, prepared: Prepared) -> tuple[bytes, bool]:
        """The bytes one event sends, and whether it was terminal (an execution error is logged)."""
        request_id = prepared.request.request_id
        if isinstance(event, TokenEvent):
            return b"".join(presenter.stream_token(event)), False
        if isinstance(event, PromptScores):  # only ever before the first chunk, which took it
            presenter.prompt_scores(event)
            return b"", False
        if isinstance(event, Finished):
            if event.reason == "cancelled":
                return sse_error(error_body(RequestCancelled("the request was cancelled before it finished"))), True
            return b"".join(presenter.stream_finish(event)), True
        if isinstance(event, AdmissionRejected):
            return sse_error(error_body(_refusal(event, prepared))), True
        failure = ExecutionError(event.message if isinstance(event, ExecutionFailed) else f"unexpected event {event!r}")
        log_failure(request_id, failure)
        return sse_error(error_body(failure)), True


def _check_content_type(value: str | None) -> None:
    """Refuse a body declared as anything but JSON (415). A missing Content-Type is read as JSON;
    ``application/json`` may carry ``charset=utf-8`` (JSON is UTF-8), and no other charset."""
    if not value:
        return
    media_type, _, parameters = value.partition(";")
    if media_type.strip().lower() != "application/json":
        raise UnsupportedMediaType(f"the request body must be application/json, not {media_type.strip()[:100]!r}")
    for parameter in parameters.split(";"):
        name, _, setting = parameter.partition("=")
        if name.strip().lower() == "charset" and setting.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise UnsupportedMediaType(f"the request body must be UTF-8 JSON, not charset {setting.strip()[:40]!r}")


def _refusal(event: AdmissionRejected, prepared: Prepared, retry_after_ms: int | None = None) -> AdmissionRefused:
    """The error of the model worker's rejection, naming the request's own prompt and output limit fields
    (the worker names them ``messages`` and ``max_tokens``; a completion's prompt is ``prompt``, a chat
    request's limit may be ``max_completion_tokens``), with when a transient one may pass."""
    message, param = event.message, event.param
    if param == "messages":
        param = prepared.prompt_field
    elif param == "max_tokens" and prepared.output_limit_field != "max_tokens":
        param = prepared.output_limit_field
        message = message.replace("plus max_tokens (", f"plus {param} (")
    refusal = AdmissionRefused(message, param, permanent=event.permanent)
    refusal.retry_after_ms = None if retry_after_ms is None else clamp_retry_after_ms(retry_after_ms)
    return refusal


@dataclass(frozen=True)
class _Choice:
    """One choice of a response: its prepared request, presenter, event queue and admission permit."""

    prepared: Prepared
    presenter: ResponsePresenter
    events: EventQueue
    permit: Permit


def _release(permits: list[Permit]) -> None:
    for permit in permits:
        permit.release()
