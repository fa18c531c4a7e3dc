"""A request whose replica's Helios cannot be reached is resent to another replica.

The ingress and the router run here without a Ray cluster: a stand-in deployment handle plays the
replicas, each a real :meth:`HeliosServer.forward` against a real HTTP server on loopback or against
a port nothing listens on (connection refused), so the unreached head is the one a dead Helios gives.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from helios_ray.deployment import REPLICA_HEADER, HeliosIngress, HeliosServer
from helios_ray.process import free_loopback_port
from helios_ray.router import PrefixAffinityRouter
from starlette.requests import Request

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class _Helios(BaseHTTPRequestHandler):
    """A live Helios stand-in: every POST gets one chat completion."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        port = self.server.server_address[1]  # type: ignore[index]
        payload = json.dumps({"object": "chat.completion", "served_by": port}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def live_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Helios)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def _replica(name: str, port: int) -> HeliosServer:
    """A :class:`HeliosServer` that forwards to ``port`` (no process of its own)."""
    server = HeliosServer.__new__(HeliosServer)
    server._client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(10.0))
    server._replica = name
    return server


@dataclass
class _Handle:
    """A deployment handle whose router is :class:`PrefixAffinityRouter` over named replicas."""

    replicas: dict[str, HeliosServer]
    calls: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    def options(self, **_: Any) -> _Handle:
        return self

    @property
    def forward(self) -> SimpleNamespace:
        return SimpleNamespace(remote=self._remote)

    def _remote(self, *args: Any, affinity_key: str | None = None, excluded_replicas: tuple[str, ...] = ()) -> Any:
        candidates = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in self.replicas]
        pending = SimpleNamespace(kwargs={"affinity_key": affinity_key, "excluded_replicas": excluded_replicas})
        return self._route(candidates, pending, args, affinity_key, excluded_replicas)

    def _route(
        self, candidates: list[Any], pending: Any, args: tuple[Any, ...], key: str | None, excluded: tuple[str, ...]
    ) -> AsyncIterator[Any]:
        async def chunks() -> AsyncIterator[Any]:
            router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
            ranks = await router.choose_replicas(candidates, pending)
            chosen = ranks[0][0].replica_id.unique_id  # the most preferred replica
            self.calls.append((chosen, excluded))
            method, path, headers, body = args
            replica = self.replicas[chosen]
            async for chunk in replica.forward(
                method, path, headers, body, affinity_key=key, excluded_replicas=excluded
            ):
                yield chunk

        return chunks()


def _request(body: dict[str, Any]) -> Request:
    data = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
    }
    return Request(scope, receive)


async def _send(ingress: HeliosIngress) -> tuple[int, dict[str, str], bytes]:
    response = await ingress(_request(BODY))
    body = b""
    async for chunk in response.body_iterator:  # type: ignore[attr-defined]
        body += chunk if isinstance(chunk, bytes) else chunk.encode()
    return response.status_code, dict(response.headers), body


def _dead_first(live_port: int) -> dict[str, HeliosServer]:
    """Two dead replicas and a live one, ordered so that the router prefers a dead one first: with no
    affinity key the router keeps the candidates' order, and the stand-in takes the first."""
    return {
        "dead-a": _replica("dead-a", free_loopback_port()),
        "dead-b": _replica("dead-b", free_loopback_port()),
        "live": _replica("live", live_port),
    }


def test_a_request_whose_helios_is_down_is_served_by_another_replica(live_port: int) -> None:
    handle = _Handle(_dead_first(live_port))
    ingress = HeliosIngress(handle, affinity_chars=0, retries=2)  # type: ignore[arg-type]
    status, headers, body = asyncio.run(_send(ingress))
    assert status == 200
    assert headers[REPLICA_HEADER] == "live"
    assert json.loads(body) == {"object": "chat.completion", "served_by": live_port}
    assert handle.calls == [("dead-a", ()), ("dead-b", ("dead-a",)), ("live", ("dead-a", "dead-b"))]


def test_retries_are_bounded_once_per_other_replica(live_port: int) -> None:
    handle = _Handle(_dead_first(live_port))
    ingress = HeliosIngress(handle, affinity_chars=0, retries=1)  # type: ignore[arg-type]
    status, headers, body = asyncio.run(_send(ingress))
    assert status == 503 and headers["retry-after"] == "1" and headers[REPLICA_HEADER] == "dead-b"
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("replica_unavailable", 503)
    assert error["message"] == "the replica's Helios process is not reachable (ConnectError)"
    assert handle.calls == [("dead-a", ()), ("dead-b", ("dead-a",))]


def test_without_retries_the_unreached_replica_answers_503(live_port: int) -> None:
    handle = _Handle(_dead_first(live_port))
    status, _, _ = asyncio.run(_send(HeliosIngress(handle, affinity_chars=0)))  # type: ignore[arg-type]
    assert status == 503 and handle.calls == [("dead-a", ())]


def test_the_router_leaves_out_tried_replicas_while_another_remains() -> None:
    names = ["a", "b", "c"]
    candidates: list[Any] = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in names]
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)

    def choose(**kwargs: Any) -> list[list[str]]:
        pending: Any = SimpleNamespace(kwargs=kwargs)
        ranks = asyncio.run(router.choose_replicas(candidates, pending))
        return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]

    assert choose(excluded_replicas=("a",)) == [["b", "c"]]
    assert choose(excluded_replicas=("a", "b", "c")) == [names]  # none left: every candidate stays
    keyed = choose(affinity_key="prefix", excluded_replicas=("b",))
    assert sorted(name for rank in keyed for name in rank) == ["a", "c"] and len(keyed[0]) == 1
