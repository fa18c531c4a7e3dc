"""Readiness: whether the server takes inference requests now.

Owns the one state object every route consults. A served model is ``starting`` until it is ready
(under ``helios run`` the port opens first; then the core is verified, its programs built and cache
storage backed on a loading thread, then one warm-up generation runs through the engine), then
``ready``, then ``draining`` once shutdown began; a start that failed (loading or warm-up raised) is
``failed`` until the process exits. A state never goes back, and ``failed`` is final. Each state
carries a reason a refusal names. :meth:`Readiness.check` raises
:class:`~helios_core.server.errors.NotReady` (503 with ``Retry-After``; while draining or failed also
``Connection: close``) in every state but ``ready``.

Liveness (``GET /health``) is separate: it reads the model worker thread once the core is loaded,
and while it loads it is 200 unless this state says the start failed. Neither flips under
overload: a full ingress is a 429 and a worker rejection a 503 for that request only. State
changes come from any thread (the loading thread, a signal handler's loop callback); reads are
plain attribute reads of one immutable pair.
"""

from __future__ import annotations

import enum
import threading

from helios_core.server.errors import NotReady

__all__ = ["Phase", "Readiness"]


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Readiness:
    """The server's phase and the reason of a refusal in that phase (see the module docstring)."""

    def __init__(self, phase: Phase = Phase.STARTING, reason: str = "the model is starting") -> None:
        self._lock = threading.Lock()
        self._state = (phase, reason)

    @classmethod
    def ready(cls) -> Readiness:
        """A state that is ready already (an app whose caller warmed nothing up)."""
        return cls(Phase.READY, "ready")

    @property
    def phase(self) -> Phase:
        return self._state[0]

    @property
    def reason(self) -> str:
        return self._state[1]

    def starting(self, reason: str) -> None:
        """Still starting, now for ``reason`` (e.g. the warm-up); ignored once ready or draining."""
        with self._lock:
            if self._state[0] is Phase.STARTING:
                self._state = (Phase.STARTING, reason)

    def mark_ready(self) -> None:
        """Ready to serve; ignored once draining (shutdown began during the warm-up)."""
        with self._lock:
            if self._state[0] is Phase.STARTING:
                self._state = (Phase.READY, "ready")

    def drain(self, reason: str) -> None:
        """Shutdown began: refuse new requests from now on (idempotent; the first reason stays; ignored
        once failed)."""
        with self._lock:
            if self._state[0] not in (Phase.DRAINING, Phase.FAILED):
                self._state = (Phase.DRAINING, reason)

    def fail(self, reason: str) -> None:
        """The start failed for ``reason`` (loading or the warm-up raised): final, the server stops."""
        with self._lock:
            if self._state[0] is not Phase.FAILED:
                self._state = (Phase.FAILED, reason)

    def check(self) -> None:
        """Raise NotReady unless ready."""
        phase, reason = self._state
        if phase is Phase.STARTING:
            raise NotReady(f"the server is not ready yet: {reason}; retry later")
        if phase is Phase.DRAINING:
            raise NotReady(f"the server is shutting down: {reason}; retry on another replica", closing=True)
        if phase is Phase.FAILED:
            raise NotReady(f"the server failed to start: {reason}; retry on another replica", closing=True)
