"""The model worker in its own process: the messages that cross the process boundary and the process's loop.

Owns the wire between a server process and a model worker process (``helios run --worker-process``) and
everything that runs in the worker process. The two processes talk over one duplex pipe
(``multiprocessing.Pipe``); each message is one msgpack frame of typed msgspec structs:

* server → worker: one :data:`ToWorker` per frame, the engine's own inbox messages
  (:class:`~helios_core.runtime.messages.Submit`, ``Cancel``, ``Stop``) and, at startup before the
  first ``Submit``, :class:`StartKvEvents` with the typed ``--kv-events-config``. A submitted
  :class:`~helios_core.runtime.messages.PreparedRequest` crosses without its compiled ``grammar``
  (an llguidance object of the server's compiler that does not encode); the worker's
  ``Engine.submit`` compiles it again from ``response_format``, on the worker process's receiving
  thread, never on its model worker thread.
* worker → server: a list of :data:`FromWorker` per frame, in publication order: first
  :class:`WorkerReady` (with how long the worker process took to load) or :class:`WorkerStartFailed`,
  then the engine's events as it publishes them (a decode round's
  :class:`~helios_core.runtime.messages.RoundTokens` once per round, wrapped in
  :class:`RoundDelivery`), :class:`LoadUpdate` whenever the statistics, the live load gauges or the
  KV-cache event counters changed (checked every :data:`LOAD_INTERVAL_SECONDS`), the answer to a
  :class:`StartKvEvents` (:class:`KvEventsStarted` or :class:`KvEventsFailed`), and
  :class:`WorkerStopped` last after a ``Stop``.

In the worker process :func:`serve_worker` loads the core (:func:`~helios_core.runtime.startup.start`),
runs the :class:`~helios_core.runtime.engine.Engine` as in a thread-mode server, and redirects every
request stream's ``put`` onto one outbox that a sender thread drains into frames, so the worker thread
never touches the pipe and nothing in this process iterates a stream: the server process's own streams
build the events its readers see (text of ungated requests included), exactly as the engine's streams
would. The KV-cache event publisher (:class:`~helios_core.runtime.kv_events.KvEventPublisher`) runs here
too, beside the page allocator it listens to: :class:`StartKvEvents` attaches it (its first event is an
``AllBlocksCleared``, before the server's warm-up request), and after the engine stopped it is closed
(its last event is an ``AllBlocksCleared``) before :class:`WorkerStopped` is sent; its ``dropped`` and
``published`` counts travel in every :class:`LoadUpdate`. The worker process ignores SIGINT and SIGTERM
(the server process owns the shutdown: it drains, then sends ``Stop``) and ends when its pipe closes
(the server process died).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from helios_core.contract import LoadOptions
from helios_core.errors import HeliosError
from helios_core.loading import TrustSettings
from helios_core.runtime.engine import Engine, RequestStream
from helios_core.runtime.kv_events import KvEventPublisher, KvEventsConfig
from helios_core.runtime.messages import (
    AdmissionRejected,
    Cancel,
    ExecutionFailed,
    Finished,
    PreparedRequest,
    PromptScores,
    RoundTokens,
    Stop,
    Submit,
    TokenEvent,
)
from helios_core.runtime.stats import StatsSnapshot

__all__ = [
    "LOAD_INTERVAL_SECONDS",
    "FromWorker",
    "KvEventsFailed",
    "KvEventsStarted",
    "LoadUpdate",
    "RoundDelivery",
    "StartKvEvents",
    "ToWorker",
    "WorkerReady",
    "WorkerSpec",
    "WorkerStartFailed",
    "WorkerStopped",
    "from_worker_decoder",
    "serve_worker",
    "to_worker_decoder",
]

LOAD_INTERVAL_SECONDS = 0.02
"""How often the worker process checks its statistics and load gauges and sends them when changed: the
server's ``/metrics`` values are at most this old (plus one frame's transit)."""

_BATCH_LIMIT = 4096
"""The most messages one worker → server frame carries (the sender takes what is queued, up to this)."""


class WorkerReady(msgspec.Struct, frozen=True, tag="ready", gc=False):
    """The core is loaded and the engine runs; the first message of a worker that started."""

    pid: int
    clock_origin_ns: int
    """The worker's runtime origin of ``time.monotonic_ns`` (one system-wide clock on Linux)."""
    page_tokens: int
    total_pages: int
    snapshot: StatsSnapshot
    load_seconds: float = 0.0
    """How long the worker process took from entering :func:`serve_worker` (Helios imported, the
    specification received) to ready: verifying the core, loading the native model and starting the
    engine (``time.monotonic`` there)."""


class WorkerStartFailed(msgspec.Struct, frozen=True, tag="start_failed", gc=False):
    """Loading the core or starting the engine in the worker process raised; the process then exits."""

    message: str


class RoundDelivery(msgspec.Struct, frozen=True, tag="round", gc=False):
    """A decode round's tokens, sent once for every request of its cohort."""

    tokens: RoundTokens


class LoadUpdate(msgspec.Struct, frozen=True, tag="load", gc=False):
    """The engine's latest statistics snapshot and the live load gauges the gateway metrics read."""

    snapshot: StatsSnapshot
    running: int
    """Requests holding a model slot."""
    free_pages: int
    evictable_pages: int
    kv_events_dropped: int = 0
    """KV-cache events the worker's publisher dropped (its queue was full); 0 while none is attached."""
    kv_events_published: int = 0
    """KV-cache events the worker's publisher sent on its socket; 0 while none is attached."""


class StartKvEvents(msgspec.Struct, frozen=True, tag="kv_events", gc=False):
    """Publish the page allocator's events as ``config`` says, under ``topic`` (sent once, before the
    first ``Submit``); answered by :class:`KvEventsStarted` or :class:`KvEventsFailed`."""

    config: KvEventsConfig
    topic: str


class KvEventsStarted(msgspec.Struct, frozen=True, tag="kv_events_started", gc=False):
    """The publisher is attached: its first event, an ``AllBlocksCleared``, is queued."""


class KvEventsFailed(msgspec.Struct, frozen=True, tag="kv_events_failed", gc=False):
    """The publisher could not start (an endpoint that cannot be used, or one started already)."""

    message: str


class WorkerStopped(msgspec.Struct, frozen=True, tag="stopped", gc=False):
    """The engine stopped after a ``Stop``; every request got its terminal event before this."""


ToWorker = Submit | Cancel | Stop | StartKvEvents
FromWorker = (
    TokenEvent
    | PromptScores
    | Finished
    | AdmissionRejected
    | ExecutionFailed
    | RoundDelivery
    | LoadUpdate
    | KvEventsStarted
    | KvEventsFailed
    | WorkerReady
    | WorkerStartFailed
    | WorkerStopped
)


def to_worker_decoder() -> msgspec.msgpack.Decoder[ToWorker]:
    return msgspec.msgpack.Decoder(ToWorker)  # type: ignore[arg-type]


def from_worker_decoder() -> msgspec.msgpack.Decoder[list[FromWorker]]:
    return msgspec.msgpack.Decoder(list[FromWorker])


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process loads (pickled once to the spawned process, never on the request path)."""

    core: Path
    trust: TrustSettings
    load: LoadOptions
    backend: str


class _Outbox:
    """The worker process's one outgoing queue and the thread that sends it as frames."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.put = self._queue.put
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._send_all, name="helios-worker-sender", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Send what is queued, then stop the sender (after a :class:`WorkerStopped` was put)."""
        self._thread.join()

    def _send_all(self) -> None:
        get, get_nowait = self._queue.get, self._queue.get_nowait
        last_round: RoundTokens | None = None
        encode, send = self._encoder.encode, self._connection.send_bytes
        while True:
            pending = [get()]
            try:
                while len(pending) < _BATCH_LIMIT:
                    pending.append(get_nowait())
            except queue.Empty:
                pass
            batch: list[object] = []
            stopped = False
            for item in pending:
                if isinstance(item, RoundTokens):
                    # put on every stream of its cohort, all before the next round exists: one copy crosses
                    if item is last_round:
                        continue
                    last_round = item
                    batch.append(RoundDelivery(item))
                    continue
                batch.append(item)
                stopped = stopped or isinstance(item, WorkerStopped)
            try:
                send(encode(batch))
            except OSError:  # the server process is gone: nothing is left to deliver to
                return
            if stopped:
                return


class _KvEvents:
    """The worker process's KV-cache event publisher, once the server asked for one."""

    def __init__(self) -> None:
        self._publisher: KvEventPublisher | None = None

    def counts(self) -> tuple[int, int]:
        """``(dropped, published)``; both 0 while no publisher is attached (they never go down)."""
        publisher = self._publisher
        return (0, 0) if publisher is None else (publisher.dropped, publisher.published)

    def start(self, engine: Engine, message: StartKvEvents) -> KvEventsStarted | KvEventsFailed:
        """Bind or connect the sockets and attach to the engine's page allocator."""
        if self._publisher is not None:
            return KvEventsFailed("the KV-cache event publisher is started already")
        try:
            publisher = KvEventPublisher(message.config, message.topic)
        except HeliosError as exc:
            return KvEventsFailed(str(exc))
        except Exception as exc:  # a socket the system refuses (no descriptors left, ...)
            return KvEventsFailed(f"--kv-events-config: cannot open the sockets: {type(exc).__name__}: {exc}")
        publisher.attach(engine.allocator)
        self._publisher = publisher
        return KvEventsStarted()

    def close(self) -> None:
        """After the engine stopped: publish what is queued and the final ``AllBlocksCleared``."""
        if self._publisher is not None:
            self._publisher.close()


def _forward(engine: Engine, stream: RequestStream, outbox: _Outbox) -> None:
    """Send ``stream``'s events to the server process from now on, starting with any already put
    (:meth:`Engine.redirect`: the hand-over is atomic, so the events keep their order)."""
    engine.redirect(stream, outbox.put)


def _publish_load(engine: Engine, kv_events: _KvEvents, outbox: _Outbox, stopped: threading.Event) -> None:
    """Every :data:`LOAD_INTERVAL_SECONDS`: send the statistics, load gauges and KV-cache event counters
    when they changed."""
    last: tuple[StatsSnapshot, int, int, int, int, int] | None = None
    allocator, scheduler = engine.allocator, engine.scheduler
    while not stopped.wait(LOAD_INTERVAL_SECONDS):
        current = (
            engine.statistics(),
            len(scheduler.running),
            allocator.free_pages,
            allocator.evictable_pages,
            *kv_events.counts(),
        )
        if last is None or current[0] is not last[0] or current[1:] != last[1:]:
            last = current
            outbox.put(LoadUpdate(*current))


def serve_worker(connection: Connection, spec: WorkerSpec) -> None:
    """The worker process's entry point: load, announce, serve the pipe until ``Stop`` or its end."""
    began = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from helios_core.runtime.startup import start

    outbox = _Outbox(connection)
    try:
        running = start(spec.core, spec.trust, spec.load, backend=spec.backend)
    except Exception as exc:
        message = str(exc) if isinstance(exc, HeliosError) else f"{type(exc).__name__}: {exc}"
        outbox.put(WorkerStartFailed(message))
        outbox.put(WorkerStopped())
        outbox.close()
        connection.close()
        return
    engine = running.engine
    engine.make_text = None  # the server process's streams add the text of ungated requests
    pages = engine.allocator
    outbox.put(
        WorkerReady(
            os.getpid(),
            running.model.clock_origin_ns,
            pages.page_tokens,
            pages.total_pages,
            engine.statistics(),
            load_seconds=time.monotonic() - began,
        )
    )
    stopped = threading.Event()
    kv_events = _KvEvents()
    load = threading.Thread(
        target=_publish_load, args=(engine, kv_events, outbox, stopped), name="helios-worker-load", daemon=True
    )
    load.start()
    try:
        _receive(connection, engine, kv_events, outbox)
    finally:
        try:
            try:
                running.close()  # the engine publishes every remaining request's terminal event first
            finally:
                kv_events.close()  # once the engine stopped: the last event is AllBlocksCleared
        finally:
            stopped.set()
            load.join()
            outbox.put(WorkerStopped())
            outbox.close()
            connection.close()


def _receive(connection: Connection, engine: Engine, kv_events: _KvEvents, outbox: _Outbox) -> None:
    """Apply the server's messages until ``Stop`` or the pipe's end."""
    decode = to_worker_decoder().decode
    while True:
        try:
            message = decode(connection.recv_bytes())
        except (EOFError, OSError):  # the server process is gone
            return
        if isinstance(message, Submit):
            _submit(engine, message.request, outbox)
        elif isinstance(message, Cancel):
            engine.cancel(message.request_id)
        elif isinstance(message, StartKvEvents):
            outbox.put(kv_events.start(engine, message))
        else:
            return


def _submit(engine: Engine, request: PreparedRequest, outbox: _Outbox) -> None:
    try:
        stream = engine.submit(request)
    except HeliosError as exc:  # a duplicate id: the server process refuses those before they cross
        outbox.put(ExecutionFailed(request.request_id, str(exc)))
        return
    _forward(engine, stream, outbox)
