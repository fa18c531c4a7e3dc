"""The Ray Serve application: an HTTP ingress and replicas that each own one ``helios run`` process.

* :class:`HeliosServer` (one per replica) starts ``helios run`` on a free loopback port, waits for
  ``GET /ready`` to answer 200, forwards requests to it and streams the responses back
  (status and headers first, then the body as it comes, SSE included). Ray Serve's
  ``check_health`` passes only while the process runs and ``/ready`` answers 200, so a replica
  whose Helios died, or is draining, is replaced.
* :class:`HeliosIngress` receives the OpenAI requests from Ray Serve's HTTP proxy, computes the
  prefix-affinity key (:func:`affinity_key`) and calls a replica through a deployment handle, so
  Ray Serve's request router (:class:`helios_ray.router.PrefixAffinityRouter`) picks the replica.
* :func:`build_app` binds both with their options.

A replica whose Helios process cannot be reached before any response byte (connection refused, or
reset before the response head) says so in the head it yields (``unreached``); the ingress then sends
the request again to another replica, at most once per other replica (``retries``, by default the
number of replicas less one), naming the replicas already tried so the router avoids them. Only when
every try was unreached does the client get the last replica's 503 with an OpenAI error body and
``Retry-After``. A stream that breaks after its first bytes is never resent: it ends with one
``event: error`` (type ``replica_unavailable``). Responses carry ``x-helios-replica``, the id of the
replica that served them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import httpx
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from helios_ray.process import HeliosProcess
from helios_ray.router import PrefixAffinityRouter

__all__ = ["HeliosIngress", "HeliosServer", "affinity_key", "build_app"]

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
     "upgrade", "host", "content-length"}
)  # fmt: skip
REPLICA_HEADER = "x-helios-replica"
REQUEST_ID_HEADER = "x-helios-request-id"
"""Helios's ``x-request-id`` (the response's id) as the ingress returns it: Ray Serve's proxy writes its own
``x-request-id`` (its request id: the client's, when the request carried one) on every response."""
_PROXY_WRITTEN = frozenset({"date", "server", "x-request-id"})
"""Response headers the HTTP proxy in front of the ingress writes itself: forwarding Helios's would send two."""
_NOT_FORWARDED = _HOP_BY_HOP | _PROXY_WRITTEN
"""Response headers of Helios the ingress does not pass on."""


def _unavailable_body(message: str) -> bytes:
    error = {"error": {"message": message, "type": "replica_unavailable", "param": None, "code": 503}}
    return json.dumps(error).encode()


UNREACHED = "unreached"
"""Head key: the replica's Helios was not reached before any response byte (the request may go elsewhere)."""


def _unavailable_head(replica: str) -> dict[str, Any]:
    headers = [("content-type", "application/json"), ("retry-after", "1"), (REPLICA_HEADER, replica)]
    return {"status": 503, "headers": headers, UNREACHED: True}


def _stream_error_event(message: str) -> bytes:
    return b"event: error\ndata: " + _unavailable_body(message) + b"\n\n"


def affinity_key(body: bytes, length: int) -> str | None:
    """The first ``length`` characters of a request's prompt (legacy completions) or of its
    conversation (chat: ``role:content`` per message); None when the body has neither."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    parts: list[str] = []
    size = 0
    messages = document.get("messages")
    prompt = document.get("prompt")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
            if isinstance(content, str):
                parts.append(f"{message.get('role', '')}:{content}\n")
                size += len(parts[-1])
            if size >= length:
                break
    elif prompt is not None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        parts.append(prompt if isinstance(prompt, str) else json.dumps(prompt))
    text = "".join(parts)[:length]
    return text or None


class HeliosServer:
    """One replica: a supervised ``helios run`` process and a forwarder to it."""

    def __init__(
        self,
        run_args: Sequence[str],
        *,
        ready_path: str = "/ready",
        startup_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        self._shutdown_timeout_s = shutdown_timeout_s
        self._ready_path = ready_path
        self._process = HeliosProcess(run_args, ready_path=ready_path, startup_timeout_s=startup_timeout_s)
        self._process.start()
        self._client = httpx.AsyncClient(base_url=self._process.base_url, timeout=httpx.Timeout(None, connect=5.0))
        try:
            self._replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (direct construction)
            self._replica = f"local-{self._process.port}"

    async def forward(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        affinity_key: str | None = None,
        excluded_replicas: tuple[str, ...] = (),
    ) -> AsyncIterator[Any]:
        """Yield ``{"status", "headers"}`` first (with ``unreached: True`` when Helios could not be
        reached before any response byte), then the response body in chunks.

        ``affinity_key`` and ``excluded_replicas`` are only read by the request router."""
        request = self._client.build_request(
            method, path, headers=[(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP], content=body
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            yield _unavailable_head(self._replica)
            yield _unavailable_body(f"the replica's Helios process is not reachable ({type(exc).__name__})")
            return
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        try:
            head = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _NOT_FORWARDED]
            head += [(REQUEST_ID_HEADER, v) for v in response.headers.get_list("x-request-id")]
            yield {"status": response.status_code, "headers": [*head, (REPLICA_HEADER, self._replica)]}
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            if streaming:
                yield _stream_error_event(f"the replica's Helios process stopped mid-response ({type(exc).__name__})")
        finally:
            await response.aclose()

    async def check_health(self) -> None:
        """Ray Serve's health check: the process runs and ``GET /ready`` answers 200."""
        code = self._process.exit_code()
        if code is not None:
            raise RuntimeError(f"helios run exited with status {code}")
        try:
            response = await self._client.get(self._ready_path, timeout=5.0)
        except httpx.TransportError as exc:
            raise RuntimeError(f"helios run does not answer {self._ready_path}: {exc}") from exc
        if response.status_code != 200:
            raise RuntimeError(f"helios run answers {self._ready_path} with {response.status_code}")

    def describe(self) -> dict[str, Any]:
        """The replica id, and the pid and port of its Helios process (for operators and tests)."""
        return {"replica": self._replica, "pid": self._process.pid, "port": self._process.port}

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None:
            process.stop(grace_s=self._shutdown_timeout_s)


class HeliosIngress:
    """The HTTP entry point behind Ray Serve's proxy: every path goes to a :class:`HeliosServer`."""

    def __init__(self, server: DeploymentHandle[Any], *, affinity_chars: int = 256, retries: int = 0) -> None:
        if retries < 0:
            raise ValueError(f"retries must not be negative, not {retries}")
        self._server = server.options(stream=True)
        self._affinity_chars = affinity_chars
        self._retries = retries

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = list(request.headers.items())
        key = affinity_key(body, self._affinity_chars) if self._affinity_chars > 0 else None
        tried: tuple[str, ...] = ()
        while True:
            chunks = cast(
                DeploymentResponseGenerator[Any],
                self._server.forward.remote(
                    request.method, path, headers, body, affinity_key=key, excluded_replicas=tried
                ),
            )
            try:
                head = await chunks.__anext__()
            except Exception as exc:
                return Response(_unavailable_body(f"no replica could serve the request ({type(exc).__name__})"),
                                503, headers={"retry-after": "1"}, media_type="application/json")  # fmt: skip
            if not head.get(UNREACHED) or len(tried) >= self._retries:
                break
            async for _ in chunks:  # the unreached replica's error body: nothing was sent to the client yet
                pass
            tried = (*tried, _replica_of(head))
        streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as exc:
                if streaming:
                    yield _stream_error_event(f"the replica stopped mid-response ({type(exc).__name__})")

        response = StreamingResponse(rest(), status_code=head["status"])
        for name, value in head["headers"]:
            response.headers.append(name, value)
        return response


def _replica_of(head: dict[str, Any]) -> str:
    return next((value for name, value in head["headers"] if name == REPLICA_HEADER), "")


def build_app(
    run_args: Sequence[str],
    *,
    num_replicas: int = 1,
    prefix_affinity: bool = True,
    affinity_chars: int = 256,
    max_ongoing_requests: int = 32,
    ready_path: str = "/ready",
    startup_timeout_s: float = 300.0,
    shutdown_timeout_s: float = 5.0,
    health_check_period_s: float = 5.0,
    health_check_timeout_s: float = 10.0,
    replica_actor_options: dict[str, Any] | None = None,
    ingress_replicas: int = 1,
) -> Application:
    """The Ray Serve application serving ``helios run RUN_ARGS`` on ``num_replicas`` replicas.

    ``max_ongoing_requests`` bounds the requests Ray Serve sends one replica at once: keep it at
    most Helios's ``max_active + queue_capacity`` so Helios answers 429 only when Ray Serve's own
    queue is full. ``shutdown_timeout_s`` should match ``--shutdown-timeout`` in ``run_args``. A
    request whose replica's Helios cannot be reached is resent to another replica, at most
    ``num_replicas - 1`` times. The :class:`~helios_ray.router.PrefixAffinityRouter` always routes
    (it avoids the replicas a resent request already tried); ``prefix_affinity=False`` only turns its
    affinity keys off.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
    if affinity_chars < 0:
        raise ValueError(f"affinity_chars must not be negative, not {affinity_chars}")
    options: dict[str, Any] = {
        "name": "HeliosServer",
        "num_replicas": num_replicas,
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": health_check_period_s,
        "health_check_timeout_s": health_check_timeout_s,
        "graceful_shutdown_timeout_s": shutdown_timeout_s + 5.0,
        "ray_actor_options": replica_actor_options or {"num_cpus": 1},
    }
    options["request_router_config"] = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter  # type: ignore[arg-type]  # a class is accepted too
    )
    server = serve.deployment(**options)(HeliosServer)
    ingress = serve.deployment(
        name="HeliosIngress", num_replicas=ingress_replicas, max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0},
    )(HeliosIngress)  # fmt: skip
    return ingress.bind(
        server.bind(
            list(run_args), ready_path=ready_path, startup_timeout_s=startup_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
        ),
        affinity_chars=affinity_chars if prefix_affinity else 0,
        retries=num_replicas - 1,
    )  # fmt: skip
