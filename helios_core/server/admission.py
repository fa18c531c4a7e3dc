"""HTTP admission: the bound on requests inside the server.

Owns the ingress permits and the preparation slots, both on the event loop (no other thread
touches them but the ended mark below, under its lock). At most ``queue_capacity + max_active``
requests hold a permit at once, counting CPU
preparation, queued generation and responses awaiting delivery; when none is left a request fails
immediately with :class:`~helios_core.server.errors.IngressFull` (429). A permit is released when
the reader releases the response (after the last byte was sent), not when generation ends, which
bounds retained output by admitted requests and their limits; for a dropped connection, once the
model worker ended the request the drop cancels (the service waits for its terminal event). Admitted
requests then wait asynchronously for one of ``frontend_workers`` preparation slots.

A permit also records when its request's model work ended (the terminal event reached the server's
event pump, on a pump thread): :attr:`Admission.ended` counts permits whose generation ended but whose
response is still being delivered. The load gauges (:mod:`helios_core.server.metrics`) read it to
tell responses awaiting delivery from requests waiting for a model slot.

Each refusal names when to retry (:meth:`Admission.retry_after_ms`, sent as ``Retry-After`` and
``retry-after-ms``): the requests waiting beyond the model slots (at least one) times the mean time a
permit was held over the last :data:`SERVICE_SAMPLES` released permits (arrival to last byte), divided
by ``max_active``, clamped to 1..60 s; before any permit was released the mean is one second.

With several HTTP processes (``--http-processes N``) the bound is the whole server's: after
:meth:`Admission.share` a permit is taken from the processes' shared table
(:class:`~helios_core.server.server_tally.ServerTally`), so exactly ``queue_capacity + max_active``
requests hold one over all the processes, whichever process each arrived at; ``in_use`` and ``ended`` are
then the server's figures, ``held_here`` this process's permits (what its drain waits for). The hold
times of the retry estimate and the preparation slots stay each process's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from helios_core.server.errors import IngressFull, clamp_retry_after_ms
from helios_core.server.server_tally import ServerTally

__all__ = ["SERVICE_SAMPLES", "Admission", "Permit"]

SERVICE_SAMPLES = 32
"""How many of the latest released permits' hold times the retry estimate averages."""

_DEFAULT_SERVICE_S = 1.0
"""The mean hold time assumed before any permit was released."""


class Permit:
    """One admitted request's hold on the ingress bound; ``release`` is idempotent."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True
        self._ended = False
        self._admitted_s = time.monotonic()

    def generation_ended(self) -> None:
        """The request's model work ended (any thread; idempotent): its response only awaits delivery now."""
        admission = self._admission
        with admission._ended_lock:
            if self._held and not self._ended:
                self._ended = True
                admission._ended_here += 1
                if admission._shared is not None:
                    admission._shared.add_ended(1)

    def release(self) -> None:
        admission = self._admission
        with admission._ended_lock:
            if not self._held:
                return
            self._held = False
            if self._ended:
                admission._ended_here -= 1
                if admission._shared is not None:
                    admission._shared.add_ended(-1)
        admission._release(time.monotonic() - self._admitted_s)


class Admission:
    """Ingress permits (``capacity``) and preparation slots (``preparation_slots``)."""

    def __init__(self, capacity: int, preparation_slots: int, max_active: int | None = None) -> None:
        if capacity <= 0 or preparation_slots <= 0 or (max_active is not None and max_active <= 0):
            raise ValueError("admission capacity, preparation slots and max_active must be positive")
        self.capacity = capacity
        self.max_active = max_active if max_active is not None else capacity
        """The model slots: permits beyond them wait for one (the retry estimate's divisor)."""
        self._service_s: deque[float] = deque(maxlen=SERVICE_SAMPLES)
        """Hold times (seconds) of the latest released permits."""
        self.held_here = 0
        """Permits this process holds (the server's ``in_use`` unless the bound is shared)."""
        self._refused_here = 0
        self._ended_here = 0
        self._ended_lock = threading.Lock()
        self._shared: ServerTally | None = None
        self._preparation = asyncio.Semaphore(preparation_slots)

    def share(self, tally: ServerTally) -> None:
        """Count permits in ``tally``, the table every HTTP process of the server shares, from now on (before
        the first permit): the bound then holds over all of them."""
        if self.held_here:
            raise RuntimeError("admission can only be shared before the first permit is taken")
        self._shared = tally

    @property
    def in_use(self) -> int:
        """Permits held over the whole server."""
        return self.held_here if self._shared is None else self._shared.held()

    @property
    def ended(self) -> int:
        """Permits (over the whole server) whose request's model work ended while the response is still
        delivered."""
        return self._ended_here if self._shared is None else self._shared.ended()

    @property
    def refused(self) -> int:
        """Requests refused (over the whole server) before they reach the model: the 429s (every permit
        was held) and the permanent 503s of preparation (:meth:`count_refusal`)."""
        return self._refused_here if self._shared is None else self._shared.refused()

    def count_refusal(self) -> None:
        """Count one request refused before it reaches the model in :attr:`refused`."""
        self._refused_here += 1
        if self._shared is not None:
            self._shared.add_refused()

    def admit(self) -> Permit:
        """Take a permit now, or raise IngressFull (counted in :attr:`refused`)."""
        shared = self._shared
        full = self.held_here >= self.capacity if shared is None else not shared.take_permit(self.capacity)
        if full:
            self.count_refusal()
            raise IngressFull(
                f"the server holds its limit of {self.capacity} requests (queue_capacity + max_active); retry later",
                self.retry_after_ms(),
            )
        self.held_here += 1
        return Permit(self)

    @asynccontextmanager
    async def preparation_slot(self) -> AsyncIterator[None]:
        """Wait for one of the frontend workers' preparation slots."""
        async with self._preparation:
            yield

    def retry_after_ms(self) -> int:
        """When a refused request may try again (milliseconds, 1..60 s; see the module docstring)."""
        samples = list(self._service_s)
        mean_s = sum(samples) / len(samples) if samples else _DEFAULT_SERVICE_S
        waiting = max(1, self.in_use - self.max_active)
        return clamp_retry_after_ms(1000.0 * waiting * mean_s / self.max_active)

    def _release(self, held_s: float) -> None:
        self.held_here -= 1
        if self._shared is not None:
            self._shared.return_permit()
        self._service_s.append(held_s)
