"""The bridge from the engine's blocking event streams to the event loop.

Owns the pump threads. ``Engine.submit`` returns a blocking :class:`RequestStream`; one pump per
response iterates it on a dedicated thread pool and hands every event to the loop with
``loop.call_soon_threadsafe`` into that response's own unbounded ``asyncio.Queue``. The worker
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


class EventBridge:
    """Pumps request streams into per-response asyncio queues."""

    def __init__(self, pumps: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=pumps, thread_name_prefix="helios-event-pump")

    def attach(
        self,
        stream: RequestStream,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[], None] | None = None,
    ) -> EventQueue:
        """Start pumping ``stream``; its events arrive, in order, on the returned queue. ``on_end`` runs on
        the pump thread when the terminal event arrives, before the event is handed to the loop."""
        events: EventQueue = asyncio.Queue()
        self._executor.submit(_pump, stream, loop, events, on_end)
        return events

    def close(self) -> None:
        """Stop accepting streams; running pumps end with their terminal events."""
        self._executor.shutdown(wait=False, cancel_futures=False)


def _pump(
    stream: RequestStream,
    loop: asyncio.AbstractEventLoop,
    events: EventQueue,
    on_end: Callable[[], None] | None,
) -> None:
    for event in stream:
        if on_end is not None and isinstance(event, TERMINAL_EVENTS):
            on_end()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to read
            loop.call_soon_threadsafe(events.put_nowait, event)
