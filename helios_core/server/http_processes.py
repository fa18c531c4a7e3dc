"""Several HTTP processes in front of one model worker process (``helios run --worker-process --http-processes N``).

One HTTP process caps how many tokens a second the server can present and stream (SSE encoding,
detokenizing, presenting every event share its interpreter lock), well below what a fast engine makes.
With ``--http-processes N`` the ``helios run`` process (HTTP process 0, :func:`helios_core.server.serve.serve`)
binds the listening socket once, starts the model worker process with N pipes, and starts N − 1 more HTTP
processes (``spawn``, never ``fork``: this process already runs threads), each given a duplicate of the
listening socket, its own pipe to the worker, a control pipe to ``helios run`` and the table of shared
counts (:class:`~helios_core.server.server_tally.ServerTally`). Every process then runs the same app and
the same uvicorn configuration on the one socket, and the kernel hands each new connection to one of them.

Owns both sides of that: :class:`HttpProcesses`, the ``helios run`` process's supervisor of the others
(started at once, so that they load while the worker does; told to turn ready, drain or force the close;
watched until they exit), :class:`HttpRole` (what one process's loader shares with the others) and
:func:`serve_http_process`, the entry point of each other process. Over a control pipe the supervisor
sends :class:`Ready`, :class:`Drain`, :class:`Force` and :class:`WorkerExited`; a process answers
:class:`Loaded` once it warmed up through its own pipe to the worker (or :class:`LoadFailed`),
:class:`Serving` once it turned ready, and :class:`Draining` once it refuses new work after :class:`Drain`.

Startup: each other process verifies the core for its frontend, waits for the worker's ``WorkerReady`` on
its own pipe and makes a one-token warm-up generation through it; until ``helios run`` says :class:`Ready`
(after its own warm-up and every other process's :class:`Loaded`) it answers like a loading server
(``/health`` 200 ``starting``, every other route 503 ``not_ready``). ``helios run`` turns ready itself and
prints its readiness line only once every other process answered :class:`Serving`: from the line on, every
process serves. A process that fails to load fails the start with ``HTTP process K could not start:
REASON``; one that exits first, with its exit.

Shutdown: the other processes ignore SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process
group); ``helios run`` passes its own signals on as :class:`Drain` (each process turns draining at once,
answers :class:`Draining` and drains its own admitted requests, as ``helios run`` does; ``helios run``
turns draining itself only once every serving process answered, so no process accepts new work after
another refused it) and :class:`Force` (a second signal), waits for every process to exit,
then stops the worker. A process whose control pipe ends (``helios run`` died) closes every connection at
once and exits. Failures: a process that exits while serving makes ``helios run`` stop as on SIGTERM and
fail with ``HTTP process K (pid P) exited unexpectedly (...)``; the worker cancels that process's requests
and its permits are cleared from the table. A worker that dies is seen by every process on its own pipe;
``helios run``, whose child it is, relays the exit status (:class:`WorkerExited`) so that every process
ends its open requests with the same message.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, cast

import msgspec

from helios_core.errors import HeliosError, StartupError
from helios_core.server.server_tally import ServerTally, TallyShare

if TYPE_CHECKING:
    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.server.readiness import Readiness
    from helios_core.server.serve import RunOptions
    from helios_core.server.service import ChatService
    from helios_core.server.worker_process import WorkerPeer

__all__ = [
    "Drain",
    "Draining",
    "Force",
    "HttpProcessSpec",
    "HttpProcesses",
    "HttpRole",
    "LoadFailed",
    "Loaded",
    "Ready",
    "Serving",
    "WorkerExited",
    "serve_http_process",
]

_LOG = logging.getLogger("helios_core.server")

STARTUP_GRACE_SECONDS = 5.0
"""How long stopping waits for the other processes to exit when serving never began (then they are killed)."""
_EXIT_GRACE_SECONDS = 5.0
"""Beyond a process's drain and flush periods, how long stopping waits for it to exit before killing it."""
_DRAIN_ACK_SECONDS = 2.0
"""How long ``helios run`` waits, when shutdown begins, for the other serving processes to say they refuse
new work before it turns draining itself."""


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Every HTTP process warmed up: serve from now on."""


class Drain(msgspec.Struct, frozen=True, tag="drain"):
    """Shutdown began: drain as on SIGTERM."""


class Force(msgspec.Struct, frozen=True, tag="force"):
    """A second signal: close every connection now."""


class WorkerExited(msgspec.Struct, frozen=True, tag="worker_exited"):
    """The model worker process exited unexpectedly; ``message`` is what its open requests end with."""

    message: str


class Loaded(msgspec.Struct, frozen=True, tag="loaded"):
    """This process loaded its frontend and warmed up through its own pipe to the worker."""


class LoadFailed(msgspec.Struct, frozen=True, tag="load_failed"):
    """This process could not load or warm up; ``message`` says why."""

    message: str


class Serving(msgspec.Struct, frozen=True, tag="serving"):
    """This process turned ready after :class:`Ready`."""


class Draining(msgspec.Struct, frozen=True, tag="draining"):
    """This process refuses new work after :class:`Drain` (its readiness is draining)."""


ToHttpProcess = Ready | Drain | Force | WorkerExited
FromHttpProcess = Loaded | LoadFailed | Serving | Draining


@dataclass
class HttpRole:
    """One HTTP process's place among several: its index, the shared table and, in ``helios run``, the
    supervisor of the others, or elsewhere its own way to the worker."""

    index: int
    tally: ServerTally
    processes: HttpProcesses | None = None
    """In the ``helios run`` process (index 0): the other processes."""
    peer: WorkerPeer | None = None
    """In another process: its pipe to the worker process ``helios run`` owns."""

    def share_counts(self, service: ChatService) -> None:
        """Count ``service``'s permits and output failures in the shared table, and export every process's
        admitted requests (before the service takes its first request)."""
        from helios_core.server.metrics import HttpProcessCounters

        service.admission.share(self.tally)
        service.metrics.output_failures.shared = self.tally
        service.metrics.registry.register(HttpProcessCounters(self.tally.admitted))


@dataclass(frozen=True)
class HttpProcessSpec:
    """What another HTTP process is started with (pickled once to the spawned process)."""

    index: int
    options: RunOptions
    trust: TrustSettings
    load: LoadOptions
    listener: socket.socket
    worker: Connection
    """Its pipe to the model worker process."""
    control: Connection
    """Its control pipe to ``helios run``."""
    tally: TallyShare


@dataclass
class _Child:
    index: int
    process: BaseProcess
    control: Connection
    loaded: bool = False
    serving: bool = False
    draining: bool = False
    failure: str | None = None
    """Why it could not load, or how it exited before it was ready."""
    exited: bool = False


class HttpProcesses:
    """The ``helios run`` process's supervisor of its other HTTP processes (see the module docstring)."""

    def __init__(
        self,
        options: RunOptions,
        trust: TrustSettings,
        load: LoadOptions,
        listener: socket.socket,
        peers: list[Connection],
        *,
        on_lost: Callable[[HeliosError], None],
    ) -> None:
        """Start one process per pipe of ``peers`` (the worker's pipes but the first) at once; this process
        keeps the listening socket and closes its copies of the pipes it handed over."""
        self.count = len(peers) + 1
        """HTTP processes in all, this one included."""
        self._drain_seconds = options.shutdown_timeout
        self._on_lost = on_lost
        self._changed = threading.Condition()
        self._send_lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode
        self._stopping = False
        """Set once shutdown began: an exit is then expected (and a wait for loading ends)."""
        self._ready = False
        self._forced = False
        self._reaping = threading.Lock()
        """Held while a child process is joined (one thread reaps each)."""
        self.startup_failure: StartupError | None = None
        """Why another process could not start (it failed to load, or exited before it was ready)."""
        self._children: list[_Child] = []
        self._watcher: threading.Thread | None = None
        self.tally = ServerTally.create(self.count)
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        self._started = time.monotonic()
        try:
            for index, worker in enumerate(peers, start=1):
                control, remote_control = context.Pipe(duplex=True)
                spec = HttpProcessSpec(
                    index, options, trust, load, listener, worker, remote_control, self.tally.share()
                )
                process = context.Process(
                    target=serve_http_process, args=(spec,), name=f"helios-http-{index}", daemon=True
                )
                try:
                    process.start()
                except BaseException:
                    control.close()
                    raise
                finally:
                    remote_control.close()
                    worker.close()
                self._children.append(_Child(index, process, control))
        except BaseException:
            for worker in peers:
                worker.close()
            self.close()
            raise
        watcher = threading.Thread(target=self._watch, name="helios-http-processes", daemon=True)
        watcher.start()
        self._watcher = watcher

    def role(self) -> HttpRole:
        """The ``helios run`` process's own role (HTTP process 0)."""
        return HttpRole(0, self.tally, processes=self)

    # -- startup ----------------------------------------------------------------------------------
    def wait_ready(self) -> float:
        """Block until every other process warmed up through its own pipe, then tell them to serve and block
        until each turned ready (or shutdown began); the seconds since they were started. A StartupError
        names a process that could not load or exited first."""
        if not self._wait(lambda child: child.loaded):
            return time.monotonic() - self._started
        self._ready = True
        self._tell(Ready())
        self._wait(lambda child: child.serving)
        return time.monotonic() - self._started

    def _wait(self, done: Callable[[_Child], bool]) -> bool:
        """Until ``done`` holds for every other process: True, or False once shutdown began."""
        with self._changed:
            while not self._stopping:
                for child in self._children:
                    if child.failure is not None:
                        raise StartupError(f"HTTP process {child.index} could not start: {child.failure}")
                if all(done(child) for child in self._children):
                    return True
                self._changed.wait()
        return False

    # -- shutdown ---------------------------------------------------------------------------------
    def drain(self) -> None:
        """Shutdown began here: every other process drains too (idempotent). The first call returns once each
        serving process said it refuses new work (or :data:`_DRAIN_ACK_SECONDS` passed), so that this process,
        which turns draining after it, never refuses while another still accepts."""
        with self._changed:
            first = not self._stopping
            self._stopping = True
            self._changed.notify_all()
        if not first:
            return
        self._tell(Drain())
        deadline = time.monotonic() + _DRAIN_ACK_SECONDS
        with self._changed:
            while any(c.serving and not (c.draining or c.exited) for c in self._children):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)

    def force(self) -> None:
        """A second signal: every other process closes its connections now (idempotent)."""
        self.drain()
        if not self._forced:
            self._forced = True
            self._tell(Force())

    def relay_worker_exit(self, message: str) -> None:
        """The model worker process exited unexpectedly: every other process ends its requests with ``message``."""
        self._tell(WorkerExited(message))

    def stop(self) -> None:
        """Drain every other process, wait for each to exit (its drain and flush periods and a few seconds
        more once serving began, else :data:`STARTUP_GRACE_SECONDS`), kill any still running. Idempotent."""
        from helios_core.server.serve import FLUSH_SECONDS

        self.drain()
        grace = self._drain_seconds + FLUSH_SECONDS + _EXIT_GRACE_SECONDS if self._ready else STARTUP_GRACE_SECONDS
        deadline = time.monotonic() + grace
        running = {child.process.sentinel: child for child in self._children}
        while running and time.monotonic() < deadline:
            for ended in wait(list(running), max(deadline - time.monotonic(), 0.0)):
                del running[cast(int, ended)]
        for child in running.values():
            _LOG.error(
                "HTTP process %d (pid %s) did not stop within %.0f s; killed it", child.index, child.process.pid, grace
            )
            child.process.kill()
        for child in self._children:
            with self._reaping:
                child.process.join()
        if self._watcher is not None:
            self._watcher.join()

    def close(self) -> None:
        """Stop the other processes, then close the control pipes and the shared table (idempotent)."""
        try:
            self.stop()
        finally:
            for child in self._children:
                child.control.close()
            self.tally.close()

    # -- the control pipes ------------------------------------------------------------------------
    def _tell(self, message: ToHttpProcess) -> None:
        data = self._encode(message)
        with self._send_lock:
            for child in self._children:
                with contextlib.suppress(OSError):  # a process that is gone reads nothing more
                    child.control.send_bytes(data)

    def _watch(self) -> None:
        """Read every process's word and notice its exit until all exited."""
        decode = msgspec.msgpack.Decoder(FromHttpProcess).decode  # type: ignore[arg-type]
        controls = {child.control: child for child in self._children}
        sentinels = {child.process.sentinel: child for child in self._children}
        while sentinels:
            for ready in wait([*controls, *sentinels]):
                if isinstance(ready, Connection):
                    child = controls[ready]
                    try:
                        message = decode(ready.recv_bytes())
                    except (EOFError, OSError, msgspec.DecodeError):
                        del controls[ready]
                        continue
                    with self._changed:
                        if isinstance(message, Loaded):
                            child.loaded = True
                        elif isinstance(message, Serving):
                            child.serving = True
                        elif isinstance(message, Draining):
                            child.draining = True
                        else:
                            child.failure = message.message
                        self._changed.notify_all()
                else:
                    self._exited(sentinels.pop(cast(int, ready)))

    def _exited(self, child: _Child) -> None:
        process = child.process
        with self._reaping:
            process.join()
            code = process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        with self._changed:
            child.exited = True
            expected = self._stopping
            if not child.loaded and child.failure is None:
                child.failure = f"it exited ({how}) before it was ready"
            self._changed.notify_all()
        if expected:
            return
        self.tally.forget(child.index)  # its permits went with it; the worker cancelled its requests
        if not child.loaded:
            self.startup_failure = StartupError(f"HTTP process {child.index} could not start: {child.failure}")
            self._on_lost(self.startup_failure)
            return
        error = StartupError(f"HTTP process {child.index} (pid {process.pid}) exited unexpectedly ({how})")
        _LOG.error("%s; the server stops", error)
        self._on_lost(error)


# -------------------------------------------------------------------------- another HTTP process


def serve_http_process(spec: HttpProcessSpec) -> None:
    """The entry point of HTTP process ``spec.index`` (spawned by :class:`HttpProcesses`): load, say so,
    serve the shared socket once told ready, drain when told, leave the worker, exit (status 1 when it
    could not load). Never prints a traceback: what failed goes to ``helios run`` as :class:`LoadFailed`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # helios run passes its signals on as Drain and Force
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        failed = _serve_http_process(spec)
    except BaseException as exc:  # reported, never a traceback
        with contextlib.suppress(OSError):
            spec.control.send_bytes(msgspec.msgpack.encode(LoadFailed(_describe(exc))))
        failed = True
    sys.exit(1 if failed else 0)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, HeliosError) else f"{type(exc).__name__}: {exc}"


def _serve_http_process(spec: HttpProcessSpec) -> bool:
    """Serve until told to stop; True when loading failed (``helios run`` was told why)."""
    from helios_core.server import serve as serving
    from helios_core.server.app import create_pending_app
    from helios_core.server.kv_events import parse_kv_events_config
    from helios_core.server.readiness import Readiness
    from helios_core.server.worker_process import WorkerPeer

    options = spec.options
    tally = ServerTally.attach(spec.tally, spec.index)
    control = spec.control
    send_lock = threading.Lock()

    def tell(message: FromHttpProcess) -> None:
        with send_lock, contextlib.suppress(OSError):
            control.send_bytes(msgspec.msgpack.encode(message))

    peer = WorkerPeer(spec.worker)
    try:
        readiness = Readiness()
        readiness.starting("the core is loading")
        app = create_pending_app(readiness)
        kv_config = parse_kv_events_config(options.kv_events_config) if options.kv_events_config else None
        loader = serving._Loader(
            options,
            spec.trust,
            spec.load,
            kv_config,
            readiness,
            app,
            began=time.monotonic(),
            role=HttpRole(spec.index, tally, peer=peer),
        )

        def load_and_warm_up() -> None:
            try:
                loader.load_and_warm_up()
            except BaseException as exc:
                tell(LoadFailed(_describe(exc)))
                raise

        server = serving.draining_server(
            serving.uvicorn_config(app, options),
            loader.drop_responses,
            drain_seconds=options.shutdown_timeout,
            on_started=lambda: tell(Loaded()),
            warm_up=load_and_warm_up,
            in_flight=loader.in_flight,
            readiness=readiness,
            signals=False,
        )
        listening = threading.Thread(
            target=_follow, args=(control, server, readiness, peer, tell), name="helios-http-control", daemon=True
        )
        listening.start()
        try:
            with serving._server_log():
                server.run(sockets=[spec.listener])
            if server.started:
                loader.finished.wait()
        finally:
            loader.close()  # leaves the worker: it cancels what this process still had
        return loader.failure is not None or server.startup_failure is not None
    finally:
        spec.listener.close()
        tally.close()


def _follow(
    control: Connection, server: Any, readiness: Readiness, peer: WorkerPeer, tell: Callable[[FromHttpProcess], None]
) -> None:
    """Apply ``helios run``'s word until the control pipe ends; its end (``helios run`` died) closes
    everything now."""
    decode = msgspec.msgpack.Decoder(ToHttpProcess).decode  # type: ignore[arg-type]
    while True:
        try:
            message = decode(control.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            server.should_exit = True
            server.force_exit = True
            return
        if isinstance(message, Ready):
            readiness.mark_ready()
            tell(Serving())
        elif isinstance(message, Drain):
            readiness.drain("shutdown began")  # before helios run turns draining itself (HttpProcesses.drain)
            tell(Draining())
            if not server.should_exit:
                server.handle_exit(signal.SIGTERM, None)
        elif isinstance(message, Force):
            server.should_exit = True
            server.force_exit = True
        else:
            peer.exits.put(message.message)
