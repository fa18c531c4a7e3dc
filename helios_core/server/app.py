"""The Litestar app factory and its thin controllers.

Owns the routes and nothing else: ``POST /v1/chat/completions``, ``POST /v1/completions`` (the
legacy completions API: a raw prompt, no chat template), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` and the OpenAPI document at Litestar's default path
(``/schema``, JSON at ``/schema/openapi.json``), which lists every error status with the OpenAI
error object (:mod:`helios_core.server.openapi`). Each controller calls one method of
:class:`~helios_core.server.service.ChatService`; errors reach HTTP only through
:mod:`helios_core.server.errors`. There is no module-level app: ``create_app`` builds one per
running model, and the caller keeps ownership of that model (``helios run`` closes it).
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.openapi import OpenAPIConfig

from helios_core.runtime.startup import RunningModel
from helios_core.server.errors import exception_handlers
from helios_core.server.metrics import CONTENT_TYPE
from helios_core.server.openapi import ChatOperation, CompletionOperation, ServerOperation
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


@get("/v1/models", operation_class=ServerOperation, summary="The served model name and its aliases")
async def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _service(request).models()


@get("/health", operation_class=ServerOperation, summary="Liveness of the server and its model")
async def health(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _service(request).health()


@get("/metrics", operation_class=ServerOperation, summary="Prometheus metrics", media_type=CONTENT_TYPE)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(_service(request).metrics.exposition(), media_type=CONTENT_TYPE)


def create_app(running: RunningModel, settings: ServerSettings | None = None) -> Litestar:
    """An app serving ``running``; the caller closes ``running`` after the app shuts down."""
    service = ChatService(running, settings or ServerSettings())
    return Litestar(
        route_handlers=[chat_completions, completions, list_models, health, metrics],
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
