"""The HTTP/1.1 connection protocol ``helios run`` serves with: keep-alive, request-head and time limits.

Owns how long an idle keep-alive connection stays open and the rule that closes it, the most bytes a
request's head (request line and headers) may take, and how long a client may take to send a request.
:class:`KeepAliveHttpProtocol` is uvicorn's httptools protocol with these changes.

Idle close only when idle. When the keep-alive timer fires, the connection is closed only if it is
really idle. uvicorn's own handler closes the transport unconditionally, and the timer can fire after a
client's next request has reached the socket but before the event loop has read it (the loop runs due
timers before it polls the sockets again). Closing a socket with unread bytes makes the kernel answer
with a reset, so the client loses a request it had already sent, with no response and nothing in the
server's log. Here the timer leaves the connection open (and is armed again) while a request is in
progress, while a pipelined request waits, or while the socket holds bytes not yet read; the loop then
reads the request and serves it. A new connection is idle until its first byte, under the same timer.

The other half of that race cannot be closed by the server: a request the client writes while the
server's close is already on its way is lost whatever the server does. Only the side that closes an
idle connection knows it is doing so, so the server must be the side that waits longer:
:data:`KEEP_ALIVE_TIMEOUT_S` is above the idle expiry of common HTTP clients and proxies (httpx 5 s,
aiohttp 15 s, a cloud load balancer's usual 60 s), which close their idle connections first. The
server's timer also starts earlier than the client's (when the server wrote the response's last
byte, not when a client that lags behind read it), one more reason for the margin.

Request limits (uvicorn's httptools protocol has none: a header of any size is buffered, and a request
that stops arriving holds its connection forever). A request whose head grows past
:data:`MAX_REQUEST_HEAD_BYTES` is answered ``431`` at once, its head is not parsed further and the rest
of what the client sends is read and dropped, not buffered. A request whose head is not complete
:data:`REQUEST_HEAD_TIMEOUT_S` after its first byte, or whose body stalls (no byte for
:data:`REQUEST_BODY_TIMEOUT_S` after its head or after the last read), is answered ``408``. Both answers
are an OpenAI-shaped JSON error (``type`` ``invalid_request_error``, ``code`` the status, as
:mod:`helios_core.server.errors` shapes them) with ``Connection: close``; the server then shuts its
sending side and drops what still arrives for at most :data:`_LINGER_S` before closing, so that the
client reads the answer instead of a reset. Neither limit ever touches a response in progress: a request
being answered (a stream of any length) is not timed, a body timer stops once the response has started,
and a refusal due while an earlier request on the connection is still being answered waits (reading
paused) until that answer has been written. A time limit is also not enforced while the server itself is
not reading the connection (flow control, a pipelined request waiting) or while the socket holds bytes
not yet read. A request the HTTP parser cannot read (a malformed request line or header, conflicting
framing) is refused the same way, with ``400`` and the same JSON error, where uvicorn answers plain
text.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

try:  # FIONREAD through ioctl: Linux, macOS and the other Unix systems
    import fcntl
    import termios

    _FIONREAD: int | None = termios.FIONREAD
except ImportError:  # pragma: no cover - platforms without fcntl (Windows) keep uvicorn's behaviour
    _FIONREAD = None

__all__ = [
    "KEEP_ALIVE_TIMEOUT_S",
    "MAX_REQUEST_HEAD_BYTES",
    "REQUEST_BODY_TIMEOUT_S",
    "REQUEST_HEAD_TIMEOUT_S",
    "KeepAliveHttpProtocol",
    "unread_bytes",
]

KEEP_ALIVE_TIMEOUT_S = 75
"""Seconds an idle keep-alive connection stays open after its last response (uvicorn's default is 5,
the same as httpx's client-side expiry, which races; see the module docstring)."""

MAX_REQUEST_HEAD_BYTES = 64 * 1024
"""Most bytes a request's head (request line and headers) may take; a longer one is answered 431 (h11's
default is 16 KiB, nginx's 8 KiB per header line and 32 KiB in all; Helios requests carry a few small
headers, the prompt is in the body)."""

REQUEST_HEAD_TIMEOUT_S = 30.0
"""Seconds from a request's first byte within which its head must be complete, else 408."""

REQUEST_BODY_TIMEOUT_S = 60.0
"""Seconds a request's body may go without a byte arriving (counted from the end of its head, then from
each read), else 408: a large body may take as long as it needs while it keeps arriving."""

_LINGER_S = 2.0
"""After a 431 or 408 (sending side shut), how long the server drops what the client still sends before
it closes; closing with unread bytes would send a reset that can destroy the answer at the client."""

_HEAD_SLICE = 8 * 1024
"""Bytes fed to the parser at a time while a head is being read, so that a head is measured exactly
within one slice; what follows a complete head is fed at once."""


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the peer sent that the transport's socket holds and the event loop has not read yet.

    0 when the socket is gone or closed, or where the platform cannot say (no ``FIONREAD``); a peer
    that only closed its side (FIN) has no unread bytes either.
    """
    sock = transport.get_extra_info("socket")
    if sock is None or _FIONREAD is None:
        return 0
    try:
        descriptor = sock.fileno()
        if descriptor < 0:
            return 0
        answer = fcntl.ioctl(descriptor, _FIONREAD, struct.pack("i", 0))
    except (OSError, ValueError):  # closed under us, or not a socket the kernel can answer for
        return 0
    count: int = struct.unpack("i", answer)[0]
    return count


class KeepAliveHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose keep-alive timeout closes only an idle connection and which
    refuses a request whose head is too large (431), that is not sent in time (408) or that cannot be parsed
    (400), each with a JSON error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The limits, read when the connection is made (tests shorten them).
        self.max_head_bytes = MAX_REQUEST_HEAD_BYTES
        self.head_timeout = REQUEST_HEAD_TIMEOUT_S
        self.body_timeout = REQUEST_BODY_TIMEOUT_S
        self._head_in_progress = False  # a request's first byte has been parsed, its head not complete
        self._head_bytes = 0  # bytes of that head so far
        self._heads_completed = 0  # heads parsed on this connection
        self._in_body = False  # a head is complete, its body not
        self._request_timer: asyncio.TimerHandle | None = None  # the head or body time limit
        self._refusal: tuple[int, str] | None = None  # (status, message) once a request is refused
        self._refusal_sent = False
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Idle until the first byte: the keep-alive rule applies (uvicorn arms nothing here).
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_request_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        """The keep-alive timer fired: close the connection if it is idle, else arm the timer again."""
        self.timeout_keep_alive_task = None
        if self.transport.is_closing():
            return
        if self._busy() or unread_bytes(self.transport) > 0:
            # The loop reads the waiting bytes next (data_received cancels this timer), or the response
            # in progress ends (on_response_complete arms a fresh one).
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        self.transport.close()

    def _busy(self) -> bool:
        """Whether a request on this connection is still being answered or waits behind one."""
        cycle = self.cycle
        return (cycle is not None and not cycle.response_complete) or bool(self.pipeline)

    # What arrives: measured while a head is read, dropped once a request is refused.

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: what still arrives is dropped, never parsed or kept
        while data:
            if self._in_body:
                piece, data = data, b""
            else:  # between requests or in a head: a slice at a time, never past the limit
                size = min(self.max_head_bytes - self._head_bytes, _HEAD_SLICE)
                piece, data = data[:size], data[size:]
            in_head, heads = not self._in_body, self._heads_completed
            super().data_received(piece)
            if self._refusal is not None or self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # refused (a request the parser cannot read: 400), or upgraded
            if self._head_in_progress and in_head and heads == self._heads_completed:
                # The whole slice is head (a head that began after another ended within the same slice
                # or read is counted from the next one: the limit may be passed by that much, never
                # enforced early).
                self._head_bytes += len(piece)
                if self._head_bytes >= self.max_head_bytes:  # and it is not complete: it is longer
                    self._refuse_head_too_large()
                    return
        if self._head_in_progress:
            if self._request_timer is None:
                self._arm_request_timer(self.head_timeout, self._head_timed_out)
        elif self._in_body:  # armed again by every read: a body may arrive slowly, never stall
            self._arm_request_timer(self.body_timeout, self._body_timed_out)

    def on_message_begin(self) -> None:
        self._head_in_progress = True
        self._head_bytes = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_in_progress = False
        self._heads_completed += 1
        self._cancel_request_timer()
        super().on_headers_complete()
        self._in_body = not (self.parser.should_upgrade() and self._should_upgrade())

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_request_timer()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._refusal is None or self._refusal_sent:
            super().on_response_complete()
            return
        if self.pipeline:  # requests complete before the refused one are answered first
            super().on_response_complete()
            self.flow.pause_reading()
            return
        self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self._send_refusal()

    def shutdown(self) -> None:
        if self._refusal_sent:
            self.transport.close()
            return
        super().shutdown()

    # The limits.

    def _arm_request_timer(self, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_request_timer()
        self._request_timer = self.loop.call_later(delay, callback)

    def _cancel_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _server_holds_back(self) -> bool:
        """Whether the delay may be the server's: it is not reading this connection (flow control, a
        pipelined request waiting), or bytes have arrived that the loop has not read yet."""
        return self.flow.read_paused or bool(self.pipeline) or unread_bytes(self.transport) > 0

    def _head_timed_out(self) -> None:
        self._request_timer = None
        if self.transport.is_closing() or not self._head_in_progress:
            return
        if self._busy() or self._server_holds_back():  # an earlier request is still being answered
            self._arm_request_timer(self.head_timeout, self._head_timed_out)
            return
        self.logger.warning("Request head not complete within %s s: answered 408.", self.head_timeout)
        self._refusal = (408, f"the request head was not complete within {self.head_timeout:g} s")
        self._send_refusal()

    def _body_timed_out(self) -> None:
        self._request_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or not self._in_body or cycle is None or cycle.response_started:
            return  # being answered: never cut; once answered, the keep-alive rule applies
        if self._server_holds_back():
            self._arm_request_timer(self.body_timeout, self._body_timed_out)
            return
        self.logger.warning("Request body not complete within %s s: answered 408.", self.body_timeout)
        cycle.disconnected = True  # the app's receive() answers http.disconnect, its send() is dropped
        cycle.message_event.set()
        self._refusal = (408, f"the request body stalled: no byte arrived for {self.body_timeout:g} s")
        self._send_refusal()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes the HTTP parser cannot read (``msg``: its plain-text reason): the JSON
        error every other refusal has, after any response still in progress on the connection."""
        self._cancel_request_timer()
        self._refusal = (400, "the HTTP request could not be parsed (malformed request line, headers or framing)")
        if self._busy():
            self.flow.pause_reading()
            return
        self._send_refusal()

    def _refuse_head_too_large(self) -> None:
        self.logger.warning("Request head over %d bytes: answered 431.", self.max_head_bytes)
        self._cancel_request_timer()
        self._refusal = (431, f"the request line and headers are over {self.max_head_bytes} bytes")
        if self._busy():  # an earlier request is being answered: after it, reading nothing meanwhile
            self.flow.pause_reading()
            return
        self._send_refusal()

    def _send_refusal(self) -> None:
        """Write the refusal, shut the sending side, drop what arrives for a while, then close."""
        if self._refusal is None:  # pragma: no cover - every caller sets it first
            return
        status, message = self._refusal
        self._refusal_sent = True
        self._cancel_request_timer()
        self._unset_keepalive_if_required()
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
        ).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()  # read (and drop) until the client closes or the linger ends
        self._linger_timer = self.loop.call_later(_LINGER_S, self.transport.close)
