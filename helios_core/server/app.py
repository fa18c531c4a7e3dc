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

``helios run`` listens before its core is loaded: :func:`create_pending_app` builds the same routes
with no service yet, and :func:`attach_service` installs the service once the model runs. Until then
every route but ``/health`` answers 503 ``not_ready`` (with ``Retry-After``) from the readiness
state, and ``/health`` answers 200 ``starting`` while the core loads, 503 ``failed`` once loading
failed (:func:`pending_health`).
"""

from __future__ import annotations

import uuid
from typing import Any

from litestar import HttpMethod, Litestar, Request, Response, post, route
from litestar.openapi import OpenAPIConfig

from helios_core.runtime.startup import RunningModel
from helios_core.server.errors import REQUEST_ID_STATE, NotReady, exception_handlers
from helios_core.server.metrics import MEDIA_TYPE
from helios_core.server.openapi import (
    ChatOperation,
    ChatRenderOperation,
    CompletionOperation,
    CompletionRenderOperation,
    ProbeOperation,
    ServerOperation,
)
from helios_core.server.readiness import Phase, Readiness
from helios_core.server.service import CHAT_ID_PREFIX, COMPLETION_ID_PREFIX, ChatService, ServerSettings

__all__ = [
    "MAX_BODY_BYTES",
    "ServerSettings",
    "attach_service",
    "chat_service",
    "create_app",
    "create_pending_app",
    "pending_health",
]

SERVICE_KEY = "chat_service"
READINESS_KEY = "readiness"

MAX_BODY_BYTES = 10_000_000
"""The largest request body read (Litestar's ``request_max_body_size``); a larger one is 413."""


def _service(request: Request[Any, Any, Any], id_prefix: str | None = None) -> ChatService:
    """The app's service; NotReady (503) while the core is still loading. A generating route names its
    response id's prefix: its refusal then carries an ``x-request-id`` too, as every answer it gives does."""
    service: ChatService | None = request.app.state.get(SERVICE_KEY)
    if service is None:
        if id_prefix is not None:
            request.state[REQUEST_ID_STATE] = f"{id_prefix}{uuid.uuid4().hex}"
        readiness: Readiness = request.app.state[READINESS_KEY]
        readiness.check()  # starting, draining or failed: the state's own refusal
        raise NotReady("the server is not ready yet: the core is loading; retry later")
    return service


@post(
    "/v1/chat/completions", status_code=200, operation_class=ChatOperation, summary="Create a chat completion (OpenAI)"
)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    return await _service(request, CHAT_ID_PREFIX).chat(request)


@post(
    "/v1/completions",
    status_code=200,
    operation_class=CompletionOperation,
    summary="Create a completion (OpenAI legacy)",
)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    return await _service(request, COMPLETION_ID_PREFIX).completions(request)


@post(
    "/v1/chat/completions/render",
    status_code=200,
    operation_class=ChatRenderOperation,
    summary="The prompt token ids a chat completion would prefill",
)
async def render_chat(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return await _service(request, CHAT_ID_PREFIX).render_chat(request)


@post(
    "/v1/completions/render",
    status_code=200,
    operation_class=CompletionRenderOperation,
    summary="The prompt token ids a completion would prefill",
)
async def render_completion(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return await _service(request, COMPLETION_ID_PREFIX).render_completion(request)


_READ = [HttpMethod.GET, HttpMethod.HEAD]
"""The methods of the read-only routes: HEAD answers GET's status and headers without the body (uvicorn
drops it), as RFC 9110 asks of a GET resource, for load balancers and uptime checks that probe with HEAD."""


@route("/v1/models", http_method=_READ, operation_class=ProbeOperation, summary="The served model name and its aliases")
async def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _service(request).models()


@route(
    "/v1/models/{model:path}",
    http_method=_READ,
    operation_class=ProbeOperation,
    summary="One served model name or alias (404 otherwise)",
)
async def retrieve_model(request: Request[Any, Any, Any]) -> dict[str, Any]:
    # a path parameter, so a name holding "/" (an "org/model" alias) is one name; its own leading "/" is dropped
    return _service(request).model(str(request.path_params["model"]).removeprefix("/"))


@route(
    "/health", http_method=_READ, operation_class=ServerOperation, summary="Liveness: 200 while the model worker runs"
)
async def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    service: ChatService | None = request.app.state.get(SERVICE_KEY)
    if service is None:
        return pending_health(request.app.state[READINESS_KEY])
    return service.health()


@route(
    "/ready",
    http_method=_READ,
    operation_class=ProbeOperation,
    summary="Readiness: 200 once warmed up, 503 while starting or draining",
)
async def ready(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _service(request).ready()


@route(
    "/metrics", http_method=_READ, operation_class=ServerOperation, summary="Prometheus metrics", media_type=MEDIA_TYPE
)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(_service(request).metrics.exposition(), media_type=MEDIA_TYPE)


def create_app(
    running: RunningModel, settings: ServerSettings | None = None, readiness: Readiness | None = None
) -> Litestar:
    """An app serving ``running``; the caller closes ``running`` after the app shuts down. ``readiness``
    (default: ready at once) gates every inference route and ``/v1/models``."""
    service = ChatService(running, settings or ServerSettings(), readiness)
    app = create_pending_app(service.readiness)
    attach_service(app, service)
    return app


def create_pending_app(readiness: Readiness) -> Litestar:
    """An app whose model is not loaded yet: every route but ``/health`` answers 503 ``not_ready``
    until :func:`attach_service` installs the service (``/health``: :func:`pending_health`). The
    service attached later is closed when the app shuts down."""
    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            render_chat,
            render_completion,
            list_models,
            retrieve_model,
            health,
            ready,
            metrics,
        ],
        exception_handlers=exception_handlers(),
        openapi_config=OpenAPIConfig(title="Helios", version="1"),
        request_max_body_size=MAX_BODY_BYTES,
        logging_config=None,  # the process's logging is its owner's (helios run configures its own lines)
        state=_state(readiness),
        on_shutdown=[_close_service],
    )


def attach_service(app: Litestar, service: ChatService) -> None:
    """Serve ``service`` from now on (any thread: one dictionary store the routes read)."""
    app.state[SERVICE_KEY] = service


def chat_service(app: Litestar) -> ChatService:
    """The chat service of an app made by :func:`create_app` (shutdown drops its responses)."""
    service: ChatService = app.state[SERVICE_KEY]
    return service


def pending_health(readiness: Readiness) -> Response[dict[str, Any]]:
    """``GET /health`` before the model runs: 200 ``starting`` while it loads (the process is alive and
    the loading thread works), 503 ``failed`` once loading failed (the server is stopping)."""
    if readiness.phase is Phase.FAILED:
        return Response({"status": "failed", "reason": readiness.reason}, status_code=503)
    return Response({"status": "starting", "reason": "the core is loading"}, status_code=200)


def _close_service(app: Litestar) -> None:
    service: ChatService | None = app.state.get(SERVICE_KEY)
    if service is not None:
        service.close()


def _state(readiness: Readiness) -> Any:
    from litestar.datastructures import State

    return State({READINESS_KEY: readiness})
