"""Request limits of the ``helios run`` protocol: a head over the size limit is answered 431, a request
not sent in time 408, and neither ever touches a response in progress or an idle keep-alive connection.

Each test serves a tiny ASGI app over a real loopback socket with :class:`KeepAliveHttpProtocol` (the
harness of ``test_keep_alive``) and talks raw HTTP/1.1 to it; the time limits are shortened.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from helios_core.server import http_protocol
from helios_core.server.http_protocol import MAX_REQUEST_HEAD_BYTES
from tests.server.test_keep_alive import LONG_TIMEOUT_S, LOOPS, App, exchange, read_response, request, run, serving

LIMIT_S = 0.5
"""The head and body time limits of these tests."""


@pytest.fixture(autouse=True)
def short_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_protocol, "REQUEST_HEAD_TIMEOUT_S", LIMIT_S)
    monkeypatch.setattr(http_protocol, "REQUEST_BODY_TIMEOUT_S", LIMIT_S)


class StreamingApp(App):
    """:class:`App`, and ``GET /stream`` answers ten chunks 0.1 s apart (a second in all)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("path") != "/stream":
            await super().__call__(scope, receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        self.slow_started.set()
        for index in range(10):
            await asyncio.sleep(0.1)
            await send({"type": "http.response.body", "body": b"chunk%d;" % index, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_stream(reader: asyncio.StreamReader) -> bytes:
    """The body of one chunked 200 response."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    assert await reader.readexactly(2) == b"\r\n"
    return body


async def read_refusal(reader: asyncio.StreamReader, status: bytes) -> dict[str, Any]:
    """The JSON error of a refusal with ``status``; the server then closes the connection."""
    line, body = await asyncio.wait_for(read_response(reader), 5)
    assert line == b"HTTP/1.1 " + status
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing after the refusal
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert error["code"] == int(status.split()[0])
    return error


def oversized(path: str, head_bytes: int) -> bytes:
    """A request for ``path`` whose head is ``head_bytes`` long, most of it one ``X-Big`` header."""
    start, end = f"GET {path} HTTP/1.1\r\nHost: test\r\nX-Big: ".encode(), b"\r\n\r\n"
    return start + b"a" * (head_bytes - len(start) - len(end)) + end


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_head_over_the_limit_is_answered_431_at_once_and_others_are_served(loop_name: str) -> None:
    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(oversized("/big", 1024 * 1024 + 17))  # 1 MiB of header, then its end
            error = await read_refusal(reader, b"431 Request Header Fields Too Large")
            assert time.monotonic() - started < 1.0
            assert str(MAX_REQUEST_HEAD_BYTES) in error["message"]
            writer.close()

            other_reader, other_writer = await asyncio.open_connection("127.0.0.1", port)
            assert await exchange(other_reader, other_writer, "/other") == b"/other"
            other_writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_head_of_exactly_the_limit_is_served_and_one_byte_more_is_not(loop_name: str) -> None:
    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(oversized("/edge", MAX_REQUEST_HEAD_BYTES))
            assert await asyncio.wait_for(read_response(reader), 5) == (b"HTTP/1.1 200 OK", b"/edge")
            assert await exchange(reader, writer, "/next") == b"/next"  # the connection goes on
            writer.write(oversized("/over", MAX_REQUEST_HEAD_BYTES + 1))
            await read_refusal(reader, b"431 Request Header Fields Too Large")
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_stalled_head_or_body_is_answered_408(loop_name: str) -> None:
    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, _):
            for partial in (
                b"GET /stalled HTTP/1.1\r\nHost: test\r\n",  # half a head
                b"POST /stalled HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nabc",  # 3 of 10 body bytes
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                started = time.monotonic()
                writer.write(partial)
                error = await read_refusal(reader, b"408 Request Timeout")
                assert LIMIT_S - 0.05 < time.monotonic() - started < LIMIT_S + 1.5
                assert (
                    "not complete within 0.5 s" in error["message"] or "no byte arrived for 0.5 s" in error["message"]
                )
                writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_body_that_keeps_arriving_is_served_however_long_it_takes(loop_name: str) -> None:
    """Ten body bytes 0.2 s apart: two seconds in all, four times the limit, never 0.5 s without a byte."""

    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /trickle HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\n")
            for byte in b"0123456789":
                await asyncio.sleep(0.2)
                writer.write(bytes([byte]))
            assert await asyncio.wait_for(read_response(reader), 5) == (b"HTTP/1.1 200 OK", b"/trickle")
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_slow_but_timely_request_is_served_and_idle_time_is_not_timed(loop_name: str) -> None:
    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            parts = [
                b"POST /slow-",
                b"ly HTTP/1.1\r\nHost: te",
                b"st\r\nContent-Length: 6\r\n\r\n",
                b"ab",
                b"cd",
                b"ef",
            ]
            for part in parts:  # head in 0.2 s, body in 0.2 s after it: each under the limit
                writer.write(part)
                await asyncio.sleep(0.1)
            assert await asyncio.wait_for(read_response(reader), 5) == (b"HTTP/1.1 200 OK", b"/slow-ly")
            await asyncio.sleep(LIMIT_S * 2)  # idle between requests: the keep-alive rule, not these limits
            assert await exchange(reader, writer, "/again") == b"/again"
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
@pytest.mark.parametrize(
    ("next_request", "status"),
    [
        (b"GET /next HTTP/1.1\r\nHost:", b"408 Request Timeout"),
        (oversized("/next", 1024 * 1024), b"431 Request Header Fields Too Large"),
    ],
    ids=["stalled-head", "oversized-head"],
)
def test_a_stream_is_never_cut_and_a_refusal_behind_it_waits_for_its_end(
    loop_name: str, next_request: bytes, status: bytes
) -> None:
    """The stream outlives both time limits, and the next request (pipelined behind it) is refused
    only after the stream's last byte."""

    async def test() -> None:
        app = StreamingApp()
        async with serving(app, LONG_TIMEOUT_S) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request("/stream"))
            await asyncio.wait_for(app.slow_started.wait(), 5)
            writer.write(next_request)
            body = await asyncio.wait_for(read_stream(reader), 5)
            assert body == b"".join(b"chunk%d;" % index for index in range(10))
            await read_refusal(reader, status)
            writer.close()

    run(loop_name, test)


@pytest.mark.parametrize("loop_name", LOOPS)
@pytest.mark.parametrize(
    "malformed",
    [
        b"NOT AN HTTP REQUEST\r\n\r\n",
        b"POST /x HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc",
        b"GET /x HTTP/1.1\r\nHost: test\r\nBad Header\r\n\r\n",
    ],
    ids=["request-line", "conflicting-framing", "header-line"],
)
def test_a_request_the_parser_cannot_read_is_answered_400_in_json(loop_name: str, malformed: bytes) -> None:
    async def test() -> None:
        async with serving(App(), LONG_TIMEOUT_S) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(malformed)
            error = await read_refusal(reader, b"400 Bad Request")
            assert error["message"].startswith("the HTTP request could not be parsed")
            writer.close()
            other_reader, other_writer = await asyncio.open_connection("127.0.0.1", port)
            assert await exchange(other_reader, other_writer, "/fine") == b"/fine"
            other_writer.close()

    run(loop_name, test)
