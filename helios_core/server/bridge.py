"""The bridge from the engine's blocking event streams to the event loop.

Owns the pump threads. ``Engine.submit`` returns a blocking :class:`RequestStream`; one pump per
response iterates it on a dedicated thread pool and hands every event to its loop's inbox; the loop
moves what the inbox holds into each response's own unbounded ``asyncio.Queue``, in arrival order. An
inbox wakes its loop (``loop.call_soon_threadsafe``) once per batch, not per event: a pump that finds
a hand-over already scheduled only appends, so the events of a round that arrive while the loop is busy
reach their queues together (and a response's reader sends them in one write). The worker
never waits for a reader: a paused reader only lets its queue grow, and the queue's size is bounded
by the request's validated output budget (its output limit, one observation per token when asked,
and the terminal event), which admission bounds in turn. A pump ends with the terminal event,
which every request gets (cancellation and shutdown included). The server itself may put one
:class:`Interrupt` on a response's queue (never the worker): the response then ends at once with the
interrupt's error, as when shutdown drops the responses still running after the drain period.
A pump calls its ``on_end`` callback as soon as it sees the terminal event, before handing it on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from helios_core.runtime.engine import RequestStream
from helios_core.runtime.messages import TERMINAL_EVENTS, Event

__all__ = ["EventBridge", "EventQueue", "Interrupt"]


@dataclass(frozen=True)
class Interrupt:
    """Put on a response's queue by the server: end the response now with ``message`` (a ``cancelled`` error)."""

    message: str


EventQueue = asyncio.Queue[Event | Interrupt]
"""One response's queue: the worker's events in order, and at most one server interrupt."""


class _Inbox:
    """One loop's hand-over: pumps append (queue, event) pairs from their threads; one callback on the
    loop moves every pair to its queue. Lock-free: ``deque`` appends and pops are atomic, and the loop
    clears :attr:`scheduled` before it drains, so a pump that sees it set appended before the drain."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pairs: deque[tuple[EventQueue, Event]] = deque()
        self.scheduled = False
        """Whether a drain is scheduled on the loop and has not started yet."""

    def put(self, events: EventQueue, event: Event) -> None:
        """Hand ``event`` to ``events`` on the loop (any thread); wakes the loop unless a drain is due."""
        self._pairs.append((events, event))
        if not self.scheduled:
            self.scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to read
                self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.scheduled = False
        pairs = self._pairs
        while pairs:
            events, event = pairs.popleft()
            events.put_nowait(event)


class EventBridge:
    """Pumps request streams into per-response asyncio queues."""

    def __init__(self, pumps: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=pumps, thread_name_prefix="helios-event-pump")
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}

    def attach(
        self,
        stream: RequestStream,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[], None] | None = None,
    ) -> EventQueue:
        """Start pumping ``stream``; its events arrive, in order, on the returned queue. ``on_end`` runs on
        the pump thread when the terminal event arrives, before the event is handed to the loop."""
        events: EventQueue = asyncio.Queue()
        inbox = self._inboxes.get(loop)
        if inbox is None:
            for closed in [known for known in self._inboxes if known.is_closed()]:
                del self._inboxes[closed]
            inbox = self._inboxes[loop] = _Inbox(loop)
        self._executor.submit(_pump, stream, inbox, events, on_end)
        return events

    def close(self) -> None:
        """Stop accepting streams; running pumps end with their terminal events."""
        self._executor.shutdown(wait=False, cancel_futures=False)


def _pump(stream: RequestStream, inbox: _Inbox, events: EventQueue, on_end: Callable[[], None] | None) -> None:
    put = inbox.put
    for event in stream:
        if on_end is not None and isinstance(event, TERMINAL_EVENTS):
            on_end()
        put(events, event)
