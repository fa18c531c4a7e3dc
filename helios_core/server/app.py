"""The Litestar app factory and its thin controllers.

Owns the routes and nothing else: ``POST /v1/chat/completions``, ``POST /v1/completions`` (the
legacy completions API: a raw prompt, no chat template), their render endpoints
``POST /v1/chat/completions/render`` and ``POST /v1/completions/render`` (the prompt token ids,
no generation), ``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (readiness),
``GET /metrics`` and the OpenAPI document at Litestar's default path
(``/schema``, JSON at ``/schema/openapi.json``), which lists every error status with the OpenAI
error object (:mod:`helios_core.server.openapi`). Each controller calls one method of
:class:`~helios_core.server.service.ChatService`; errors reach HTTP only through
:mod:`helios_core.server.errors`. There is no module-level app: ``create_app`` builds one per
running model, and the caller keeps ownership of that model (``helios run`` closes it). Without a
:class:`~helios_core.server.readiness.Readiness` the app is ready at once; ``helios run`` passes
one that turns ready after its warm-up.
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.openapi import OpenAPIConfig

from helios_core.runtime.startup import RunningModel
from helios_core.server.errors import exception_handlers
from helios_core.server.metrics import CONTENT_TYPE
from helios_core.server.openapi import (
    ChatOperation,
    ChatRenderOperation,
    CompletionOperation,
    CompletionRenderOperation,
    ProbeOperation,
    ServerOperation,
)
from helios_core.server.readiness import Readiness
from helios_core.server.service import ChatService, ServerSettings

__all__ = ["MAX_BODY_BYTES", "ServerSettings", "chat_service", "create_app"]

SERVICE_KEY = "chat_service"

MAX_BODY_BYTES = 10_000_000
"""The largest request body read (Litestar's ``request_max_body_size``); a larger one is 413."""


def _service(request: Request[Any, Any, Any]) -> ChatService:
    service: ChatService = request.app.state[SERVICE_KEY]
    return service


@post(
    "/v1/chat/completions", status_code=200, operation_class=ChatOperation, summary="Create a chat completion (OpenAI)"
)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    return await _service(request).chat(request)


@post(
    "/v1/completions",
    status_code=200,
    operation_class=CompletionOperation,
    summary="Create a completion (OpenAI legacy)",
)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    return await _service(request).completions(request)


@post(
    "/v1/chat/completions/render",
    status_code=200,
    operation_class=ChatRenderOperation,
    summary="The prompt token ids a chat completion would prefill",
)
async def render_chat(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return await _service(request).render_chat(request)


@post(
    "/v1/completions/render",
    status_code=200,
    operation_class=CompletionRenderOperation,
    summary="The prompt token ids a completion would prefill",
)
async def render_completion(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return await _service(request).render_completion(request)


@get("/v1/models", operation_class=ProbeOperation, summary="The served model name and its aliases")
async def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _service(request).models()


@get("/health", operation_class=ServerOperation, summary="Liveness: 200 while the model worker runs")
async def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    return _service(request).health()


@get("/ready", operation_class=ProbeOperation, summary="Readiness: 200 once warmed up, 503 while starting or draining")
async def ready(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _service(request).ready()


@get("/metrics", operation_class=ServerOperation, summary="Prometheus metrics", media_type=CONTENT_TYPE)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(_service(request).metrics.exposition(), media_type=CONTENT_TYPE)


def create_app(
    running: RunningModel, settings: ServerSettings | None = None, readiness: Readiness | None = None
) -> Litestar:
    """An app serving ``running``; the caller closes ``running`` after the app shuts down. ``readiness``
    (default: ready at once) gates every inference route and ``/v1/models``."""
    service = ChatService(running, settings or ServerSettings(), readiness)
    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            render_chat,
            render_completion,
            list_models,
            health,
            ready,
            metrics,
        ],
        exception_handlers=exception_handlers(),
        openapi_config=OpenAPIConfig(title="Helios", version="1"),
        request_max_body_size=MAX_BODY_BYTES,
        logging_config=None,  # the process's logging is its owner's (helios run configures its own lines)
        state=_state(service),
        on_shutdown=[service.close],
    )


def chat_service(app: Litestar) -> ChatService:
    """The chat service of an app made by :func:`create_app` (shutdown drops its responses)."""
    service: ChatService = app.state[SERVICE_KEY]
    return service


def _state(service: ChatService) -> Any:
    from litestar.datastructures import State

    return State({SERVICE_KEY: service})
