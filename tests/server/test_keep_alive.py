"""Keep-alive connections: the timer closes idle connections only, and ``helios run`` serves with it.

Each test serves a tiny ASGI app over a real loopback socket with :class:`KeepAliveHttpProtocol` and
talks raw HTTP/1.1 to it. The keep-alive timer firing at an awkward moment is reproduced exactly by
calling the protocol's timer callback while the loop has not run yet, which is what the event loop
does when the timer is due before it next reads the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import AsyncIterator, Callable, Coroutine
from importlib.util import find_spec
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from helios_core.server.http_protocol import KEEP_ALIVE_TIMEOUT_S, KeepAliveHttpProtocol, unread_bytes
from helios_core.server.serve import RunOptions, uvicorn_config

LONG_TIMEOUT_S = 600.0
"""A keep-alive timeout no test outlives: only the explicit timer calls of a test can close."""

LOOPS = [
    "asyncio",
    pytest.param("uvloop", marks=pytest.mark.skipif(find_spec("uvloop") is None, reason="uvloop is not installed")),
]
"""The event loops the protocol is driven on (``helios run`` uses uvloop where it is installed)."""


class App:
    """Answers ``GET /<name>`` with the body ``/<name>``; ``/slow`` waits for :attr:`release` first."""

    def __init__(self) -> None:
        self.slow_started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            self.slow_started.set()
            await self.release.wait()
        body = scope["path"].encode()
        headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(app: App, keep_alive_s: float) -> AsyncIterator[tuple[int, list[KeepAliveHttpProtocol]]]:
    """``app`` on a loopback port with the Helios protocol; yields the port and every connection's protocol."""
    config = uvicorn.Config(
        app, http=KeepAliveHttpProtocol, timeout_keep_alive=keep_alive_s, lifespan="off", log_level="warning"
    )
    config.load()
    state = ServerState()
    protocols: list[KeepAliveHttpProtocol] = []
    loop = asyncio.get_running_loop()

    def connection() -> KeepAliveHttpProtocol:
        protocol = KeepAliveHttpProtocol(config=config, server_state=state, app_state={}, _loop=loop)
        protocols.append(protocol)
        return protocol

    server = await loop.create_server(connection, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], protocols
    finally:
        for protocol in protocols:
            protocol.transport.close()
        server.close()
        await server.wait_closed()


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(status line, body) of one content-length response."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    return status.encode(), await reader.readexactly(length)


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> bytes:
    writer.write(request(path))
    status, body = await asyncio.wait_for(read_response(reader), 10)
    assert status == b"HTTP/1.1 200 OK"
    return body


async def served_once(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the server on ``port`` that has had one request (``/first``) answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await exchange(reader, writer, "/first") == b"/first"
    return reader, writer


def wait_until_unread(protocol: KeepAliveHttpProtocol, count: int) -> None:
    """Block (the loop does not run) until the server's socket holds ``count`` bytes the loop has not read."""
    descriptor = protocol.transport.get_extra_info("socket").fileno()
    readable, _, _ = select.select([descriptor], [], [], 10)
    assert readable, "the request never reached the server's socket"
    assert unread_bytes(protocol.transport) == count


def run(loop_name: str, test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if loop_name == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(test())
    else:
        asyncio.run(test())


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_request_waiting_unread_when_the_timer_fires_is_served(loop_name: str) -> None:
    """The next request reached the socket, the timer fires before the loop reads it: it is answered.
    (uvicorn's own handler closes the socket with the request unread, and the client sees a reset.)"""

    async def test() -> None:
        app = App()
        async with serving(app, LONG_TIMEOUT_S) as (port, protocols):
            reader, writer = await served_once(port)
            (protocol,) = protocols
            assert protocol.timeout_keep_alive_task is not None  # idle: the timer is armed

            second = request("/second")
            writer.write(second)  # written to the socket at once: the server's loop has not run since
            wait_until_unread(protocol, len(second))
            protocol.timeout_keep_alive_handler()  # the timer is due before the loop reads the socket
            assert not protocol.transport.is_closing()
            assert protocol.timeout_keep_alive_task is not None  # armed again, for when it is idle

            status, body = await asyncio.wait_for(read_response(reader), 10)
            assert (status, body) == (b"HTTP/1.1 200 OK", b"/second")
            assert await exchange(reader, writer, "/third") == b"/third"  # the connection still serves
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_the_timer_never_closes_a_connection_whose_request_is_in_progress(loop_name: str) -> None:
    async def test() -> None:
        app = App()
        async with serving(app, LONG_TIMEOUT_S) as (port, protocols):
            reader, writer = await served_once(port)
            (protocol,) = protocols
            writer.write(request("/slow"))
            await asyncio.wait_for(app.slow_started.wait(), 10)

            protocol.timeout_keep_alive_handler()
            assert not protocol.transport.is_closing()

            app.release.set()
            status, body = await asyncio.wait_for(read_response(reader), 10)
            assert (status, body) == (b"HTTP/1.1 200 OK", b"/slow")
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_an_idle_connection_is_closed_when_the_timer_fires(loop_name: str) -> None:
    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, protocols):
            reader, writer = await served_once(port)
            (protocol,) = protocols
            assert unread_bytes(protocol.transport) == 0

            protocol.timeout_keep_alive_handler()
            assert protocol.transport.is_closing()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # the server closed: end of stream
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_an_idle_connection_still_closes_after_the_keep_alive_timeout(loop_name: str) -> None:
    """The real timer, short: idle after a response, the connection is closed by the server."""

    async def test() -> None:
        async with serving(App(), keep_alive_s=0.05) as (port, _):
            reader, writer = await served_once(port)
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()

    run(loop_name, test)


def test_unread_bytes_is_zero_without_a_socket() -> None:
    class NoSocket(asyncio.BaseTransport):
        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return default

    assert unread_bytes(NoSocket()) == 0


def test_helios_run_serves_with_this_protocol_and_a_keep_alive_longer_than_clients_keep_theirs() -> None:
    """The server must be the side that waits longer: a client (httpx: 5 s) then drops an idle connection
    before the server would close it, and never sends a request into the server's close."""
    config = uvicorn_config(App(), RunOptions())
    assert config.http is KeepAliveHttpProtocol
    assert config.timeout_keep_alive == KEEP_ALIVE_TIMEOUT_S
    assert httpx.Limits().keepalive_expiry is not None
    assert KEEP_ALIVE_TIMEOUT_S > 60 > httpx.Limits().keepalive_expiry
