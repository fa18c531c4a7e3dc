"""The HTTP/1.1 connection protocol and keep-alive timeout ``helios run`` serves with.

Owns how long an idle keep-alive connection stays open and the rule that closes it.
:class:`KeepAliveHttpProtocol` is uvicorn's httptools protocol with one change: when the keep-alive
timer fires, the connection is closed only if it is really idle. uvicorn's own handler closes the
transport unconditionally, and the timer can fire after a client's next request has reached the
socket but before the event loop has read it (the loop runs due timers before it polls the sockets
again). Closing a socket with unread bytes makes the kernel answer with a reset, so the client loses
a request it had already sent, with no response and nothing in the server's log. Here the timer
leaves the connection open (and is armed again) while a request is in progress, while a pipelined
request waits, or while the socket holds bytes not yet read; the loop then reads the request and
serves it.

The other half of that race cannot be closed by the server: a request the client writes while the
server's close is already on its way is lost whatever the server does. Only the side that closes an
idle connection knows it is doing so, so the server must be the side that waits longer:
:data:`KEEP_ALIVE_TIMEOUT_S` is above the idle expiry of common HTTP clients and proxies (httpx 5 s,
aiohttp 15 s, a cloud load balancer's usual 60 s), which close their idle connections first. The
server's timer also starts earlier than the client's (when the server wrote the response's last
byte, not when a client that lags behind read it), one more reason for the margin.
"""

from __future__ import annotations

import asyncio
import struct

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

try:  # FIONREAD through ioctl: Linux, macOS and the other Unix systems
    import fcntl
    import termios

    _FIONREAD: int | None = termios.FIONREAD
except ImportError:  # pragma: no cover - platforms without fcntl (Windows) keep uvicorn's behaviour
    _FIONREAD = None

__all__ = ["KEEP_ALIVE_TIMEOUT_S", "KeepAliveHttpProtocol", "unread_bytes"]

KEEP_ALIVE_TIMEOUT_S = 75
"""Seconds an idle keep-alive connection stays open after its last response (uvicorn's default is 5,
the same as httpx's client-side expiry, which races; see the module docstring)."""


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
    """uvicorn's httptools protocol whose keep-alive timeout closes only an idle connection."""

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
