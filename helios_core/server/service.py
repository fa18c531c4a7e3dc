"""The chat service: one request's path from decoded body to delivered response.

Owns the order of the request lifecycle on the server side (ARCHITECTURE.md §5) and the objects
that live as long as the app: admission, the preparation thread pool, the event bridge, the shared
frontend and the metrics exporter. Per request it decodes the body strictly (``ingress_ns``), takes
an admission permit (429 when none is left), waits for a preparation slot, prepares on a frontend
worker thread (400 on an invalid request), submits to the engine (``enqueue_ns``) and then either
collects a JSON response or streams SSE. The permit is released when the reader releases the
response; a dropped connection cancels the request (``Engine.cancel``). The controllers in
:mod:`helios_core.server.app` only call into this class.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from helios_core.runtime.messages import AdmissionRejected, Event, ExecutionFailed, Finished, PromptScores, TokenEvent
from helios_core.runtime.startup import RunningModel
from helios_core.server.admission import Admission, Permit
from helios_core.server.bridge import EventBridge
from helios_core.server.errors import (
    AdmissionRefused,
    ExecutionError,
    RequestCancelled,
    UnknownModel,
    error_body,
    validation_error,
)
from helios_core.server.metrics import MetricsExporter
from helios_core.server.preparation import Frontend, Prepared, prepare
from helios_core.server.presentation import Presenter, sse_error
from helios_core.server.schemas import ChatCompletionRequest, decode_request

__all__ = ["ChatService", "ServerSettings"]


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings of an app (capacities come from the running model's selection)."""

    served_name: str | None = None
    """Overrides the core's served name."""
    aliases: tuple[str, ...] = field(default=())
    """Added to the core's aliases."""


class ChatService:
    """Everything the HTTP controllers call (see the module docstring)."""

    def __init__(self, running: RunningModel, settings: ServerSettings) -> None:
        self.running = running
        serving = running.verified.contract.serving
        self.served_name = settings.served_name or serving.served_name
        self.aliases = tuple(dict.fromkeys(a for a in (*serving.aliases, *settings.aliases) if a != self.served_name))
        self.names = frozenset((self.served_name, *self.aliases))
        selection = running.model.selection
        capacity = selection.queue_capacity + selection.max_active
        self.admission = Admission(capacity, selection.frontend_workers)
        self.frontend = Frontend(running)
        self._preparation = ThreadPoolExecutor(selection.frontend_workers, thread_name_prefix="helios-frontend")
        self._bridge = EventBridge(capacity + selection.frontend_workers)
        self.metrics = MetricsExporter(running.engine.statistics, lambda: self.admission.in_use)
        self._origin_ns = running.model.clock_origin_ns

    def close(self) -> None:
        self._preparation.shutdown(wait=False, cancel_futures=True)
        self._bridge.close()

    def _now_ns(self) -> int:
        return time.monotonic_ns() - self._origin_ns

    # -- endpoints --------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "helios", "root": self.served_name}
                for name in (self.served_name, *self.aliases)
            ],
        }

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.served_name}

    async def chat(self, request: Request[Any, Any, Any]) -> Response[Any]:
        body = await request.body()
        try:
            chat = decode_request(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise validation_error(exc) from exc
        ingress_ns = self._now_ns()
        if chat.model is not None and chat.model not in self.names:
            raise UnknownModel(f"model {chat.model!r} is not served here; GET /v1/models lists the served names")
        permit = self.admission.admit()
        try:
            return await self._admitted(request, chat, permit, ingress_ns)
        except BaseException:
            permit.release()
            raise

    # -- one admitted request ---------------------------------------------------------------------
    async def _admitted(
        self, request: Request[Any, Any, Any], chat: ChatCompletionRequest, permit: Permit, ingress_ns: int
    ) -> Response[Any]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        async with self.admission.preparation_slot():
            prepared = await loop.run_in_executor(self._preparation, prepare, self.frontend, chat, request_id)
        enqueue_ns = self._now_ns()
        events = self._bridge.attach(self.running.engine.submit(prepared.request), loop)
        presenter = Presenter(
            prepared,
            self.frontend,
            response_id=request_id,
            created=int(time.time()),
            model=chat.model or self.served_name,
            ingress_ns=ingress_ns,
            enqueue_ns=enqueue_ns,
        )
        if prepared.stream:
            return Stream(
                self._sse(prepared, presenter, events, permit),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        body = await self._collect(request, prepared, presenter, events)
        return Response(body, background=BackgroundTask(_release, permit))

    async def _collect(
        self,
        request: Request[Any, Any, Any],
        prepared: Prepared,
        presenter: Presenter,
        events: asyncio.Queue[Event],
    ) -> dict[str, Any]:
        request_id = prepared.request.request_id
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, request_id))
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, TokenEvent):
                    presenter.collect(event)
                    continue
                if isinstance(event, PromptScores):
                    presenter.prompt_scores(event)
                    continue
                finished = True
                if isinstance(event, Finished):
                    if event.reason == "cancelled":
                        raise RequestCancelled("the request was cancelled before it finished")
                    return presenter.completion(event)
                if isinstance(event, AdmissionRejected):
                    raise AdmissionRefused.of(event)
                raise ExecutionError(event.message)
        finally:
            watcher.cancel()
            if not finished:
                self.running.engine.cancel(request_id)

    async def _cancel_on_disconnect(self, request: Request[Any, Any, Any], request_id: str) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.running.engine.cancel(request_id)
                return

    async def _sse(
        self, prepared: Prepared, presenter: Presenter, events: asyncio.Queue[Event], permit: Permit
    ) -> AsyncIterator[bytes]:
        request_id = prepared.request.request_id
        finished = False
        try:
            pending: Event | None = None
            if prepared.prompt_logprobs:  # the first chunk carries the prompt's scores: wait for them
                pending = await events.get()
                if isinstance(pending, PromptScores):
                    presenter.prompt_scores(pending)
                    pending = None
            yield presenter.first_chunk()
            while not finished:
                event = pending if pending is not None else await events.get()
                pending = None
                try:
                    chunk, finished = self._sse_event(presenter, event)
                except Exception as exc:  # presentation failed: the request's output error, as its own event
                    chunk, finished = sse_error(error_body(ExecutionError(f"output handling failed: {exc}"))), False
                    yield chunk
                    return
                if chunk:
                    yield chunk
        finally:
            if not finished:
                self.running.engine.cancel(request_id)
            permit.release()

    @staticmethod
    def _sse_event(presenter: Presenter, event: Event) -> tuple[bytes, bool]:
        """The bytes one event sends, and whether it was terminal."""
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
            return sse_error(error_body(AdmissionRefused.of(event))), True
        if isinstance(event, ExecutionFailed):
            return sse_error(error_body(ExecutionError(event.message))), True
        return sse_error(error_body(ExecutionError(f"unexpected event {type(event).__name__}"))), True


def _release(permit: Permit) -> None:
    permit.release()
