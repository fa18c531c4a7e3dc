"""The one place where errors become HTTP statuses and SSE error events.

Owns the server's error classes (all in the Helios error tree) and the mapping from every error
class the server can see to an HTTP status and an OpenAI-shaped error body:

=============================================  ======  ===========================
error                                           status  ``error.type``
=============================================  ======  ===========================
``InvalidRequest``, ``PromptError``             400     ``invalid_request_error``
``ClientDisconnected`` (body cut off)           400     ``invalid_request_error``
``UnknownModel``                                404     ``not_found_error``
body over the size limit (Litestar)             413     ``invalid_request_error``
``UnsupportedMediaType``                        415     ``invalid_request_error``
``IngressFull``                                 429     ``rate_limit_error``
``AdmissionRefused`` (native rejection event)   503     ``admission_rejected``
``NotReady`` (starting or draining)             503     ``not_ready``
``RequestCancelled``                            503     ``cancelled``
``ExecutionError`` and any other error          500     ``execution_error``
=============================================  ======  ===========================

After SSE headers are sent the status is already 200: the same classes become one terminal
``error`` event (no ``[DONE]``) whose ``error.type`` keeps the distinction. Statuses are chosen by
class only, never from error text. Changed by the server owners.

Retry headers (:func:`retry_headers`): every 429 and every 503 a later attempt may pass carries
``Retry-After`` (whole seconds) and ``retry-after-ms``, both from the error's ``retry_after_ms``
(the admission estimate, :meth:`~helios_core.server.admission.Admission.retry_after_ms`; one second
where none was given), clamped to 1..60 s; a permanent refusal carries ``x-should-retry: false``
instead, and a draining server's refusal also ``Connection: close``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from helios_core.errors import HeliosError, PromptError

__all__ = [
    "REQUEST_ID_STATE",
    "AdmissionRefused",
    "ClientDisconnected",
    "ExecutionError",
    "IngressFull",
    "InvalidRequest",
    "NotReady",
    "RequestCancelled",
    "UnknownModel",
    "UnsupportedMediaType",
    "error_body",
    "exception_handlers",
    "log_failure",
    "status_for",
]

_LOG = logging.getLogger(__name__)

REQUEST_ID_STATE = "helios_request_id"
"""Key of a request's response id (``chatcmpl-...``, ``cmpl-...``) on ``request.state``, set on arrival."""


class InvalidRequest(HeliosError):
    """The request body is malformed, ill-typed or asks for something unsupported (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownModel(HeliosError):
    """The request names a model this server does not serve (404)."""


class UnsupportedMediaType(HeliosError):
    """The request body is declared as something other than JSON (415)."""


class IngressFull(HeliosError):
    """Every admission permit is taken (queue_capacity + max_active requests are in the server).

    ``retry_after_ms`` is the admission's estimate of when a permit frees (None: the default)."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class NotReady(HeliosError):
    """The server is not serving: still starting (warm-up) or draining for shutdown (503).

    ``closing`` (draining) asks the client to close the connection (``Connection: close``)."""

    def __init__(self, message: str, *, closing: bool = False) -> None:
        super().__init__(message)
        self.closing = closing
        self.retry_after_ms: int | None = None


class AdmissionRefused(HeliosError):
    """The model worker rejected the request: it lies outside the prepared capacities (503).

    ``param`` names the request field a client changes to fit (``max_tokens``, ``messages``);
    ``permanent`` says resending the same request can never succeed, which the response tells
    clients with ``x-should-retry: false`` (the official OpenAI SDKs honour it) instead of
    ``Retry-After``.
    """

    def __init__(self, message: str, param: str | None = None, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.permanent = permanent
        self.retry_after_ms: int | None = None
        """When a transient refusal may pass (set by the server from its admission estimate)."""


class ClientDisconnected(HeliosError):
    """The client closed its connection before its request body arrived whole: nothing reaches the model,
    and the response has no one to reach (a client error, never logged as a failure)."""


class RequestCancelled(HeliosError):
    """The model worker cancelled the request before it finished (server shutdown)."""


class ExecutionError(HeliosError):
    """Model execution, device or output handling failed for this request."""


_TABLE: tuple[tuple[type[BaseException], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (PromptError, 400, "invalid_request_error"),
    (ClientDisconnected, 400, "invalid_request_error"),
    (UnknownModel, 404, "not_found_error"),
    (UnsupportedMediaType, 415, "invalid_request_error"),
    (IngressFull, 429, "rate_limit_error"),
    (AdmissionRefused, 503, "admission_rejected"),
    (NotReady, 503, "not_ready"),
    (RequestCancelled, 503, "cancelled"),
    (ExecutionError, 500, "execution_error"),
)


def _classify(exc: BaseException) -> tuple[int, str]:
    for cls, status, kind in _TABLE:
        if isinstance(exc, cls):
            return status, kind
    return 500, "execution_error"


def status_for(exc: BaseException) -> int:
    """The HTTP status of ``exc`` (by class)."""
    return _classify(exc)[0]


def error_body(exc: BaseException) -> dict[str, Any]:
    """The OpenAI-shaped error object of ``exc``: ``{"error": {message, type, param, code}}``."""
    status, kind = _classify(exc)
    message = str(exc) if isinstance(exc, HeliosError) else f"internal error ({type(exc).__name__})"
    param = exc.param if isinstance(exc, InvalidRequest | AdmissionRefused) else None
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_error(exc: msgspec.DecodeError) -> InvalidRequest:
    """An InvalidRequest naming the field msgspec complained about.

    msgspec says ``... - at `$.field...``` for an ill-typed field, ``Object contains unknown
    field `name``` for an unknown one and ``Object missing required field `name``` for a missing
    one; ``param`` is that top-level field.
    """
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return InvalidRequest(f"the request body is not valid JSON: {text}")
    param = None
    if "`$." in text:
        param = re.split(r"[.\[`]", text.rsplit("`$.", 1)[1], maxsplit=1)[0]
    elif "unknown field `" in text:
        param = text.split("unknown field `", 1)[1].split("`", 1)[0]
    elif "missing required field `" in text:
        param = text.split("missing required field `", 1)[1].split("`", 1)[0]
    return InvalidRequest(f"invalid request: {text}", param)


MIN_RETRY_AFTER_MS = 1_000
"""The shortest retry delay a refusal names (``Retry-After`` is whole seconds, at least 1)."""

MAX_RETRY_AFTER_MS = 60_000
"""The longest retry delay a refusal names (the official OpenAI clients ignore longer ones)."""


def clamp_retry_after_ms(value: float) -> int:
    """``value`` milliseconds as a retry delay: whole milliseconds within 1..60 s."""
    if value != value:  # NaN: no estimate
        return MIN_RETRY_AFTER_MS
    return int(min(max(value, MIN_RETRY_AFTER_MS), MAX_RETRY_AFTER_MS))


def retry_headers(exc: BaseException) -> dict[str, str]:
    """Headers telling a client whether and when to retry ``exc``'s response (module docstring)."""
    status = status_for(exc)
    if isinstance(exc, AdmissionRefused) and exc.permanent:
        return {"x-should-retry": "false"}
    if status not in (429, 503):
        return {}
    estimate = getattr(exc, "retry_after_ms", None)
    milliseconds = clamp_retry_after_ms(estimate if isinstance(estimate, int | float) else MIN_RETRY_AFTER_MS)
    headers = {"Retry-After": str(-(-milliseconds // 1000)), "retry-after-ms": str(milliseconds)}
    if isinstance(exc, NotReady) and exc.closing:
        headers["Connection"] = "close"
    return headers


def log_failure(request_id: str | None, exc: BaseException) -> None:
    """The one log line of a request that failed with a 500 or an ``execution_error`` event: its id,
    the error class and the message on one line (the traceback only at debug level)."""
    message = " ".join(str(exc).split())
    if len(message) > 500:
        message = message[:500] + "..."
    _LOG.error("request %s failed: %s: %s", request_id or "-", type(exc).__name__, message)
    _LOG.debug("request %s traceback", request_id or "-", exc_info=exc)


def _request_id(request: Request[Any, Any, Any]) -> str | None:
    value = request.state.get(REQUEST_ID_STATE)
    return value if isinstance(value, str) else None


def _id_header(request_id: str | None) -> dict[str, str]:
    return {"x-request-id": request_id} if request_id is not None else {}


def _helios_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    request_id = _request_id(request)
    status = status_for(exc)
    if status == 500:
        log_failure(request_id, exc)
    return Response(error_body(exc), status_code=status, headers={**retry_headers(exc), **_id_header(request_id)})


def _http_handler(request: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, Any]]:
    request_id = _request_id(request)
    kind = "invalid_request_error" if exc.status_code < 500 else "execution_error"
    if exc.status_code >= 500:
        log_failure(request_id, exc)
    message = exc.detail
    limit = getattr(request.app, "request_max_body_size", None)
    if exc.status_code == 413 and limit:
        message = f"the request body is larger than this server's limit of {limit} bytes"
    body = {"error": {"message": message, "type": kind, "param": None, "code": exc.status_code}}
    return Response(body, status_code=exc.status_code, headers={**(exc.headers or {}), **_id_header(request_id)})


def _internal_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    request_id = _request_id(request)
    log_failure(request_id, exc)
    return Response(error_body(exc), status_code=500, headers=_id_header(request_id))


def exception_handlers() -> dict[int | type[Exception], Any]:
    """The Litestar exception handlers of the app (one per error family)."""
    return {HeliosError: _helios_handler, HTTPException: _http_handler, Exception: _internal_handler}
