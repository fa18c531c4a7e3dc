"""The model worker in its own process: the messages that cross the process boundary and the process's loop.

Owns the wire between the server's HTTP processes and a model worker process (``helios run
--worker-process``) and everything that runs in the worker process. Each HTTP process talks to the worker
over a duplex pipe of its own (``multiprocessing.Pipe``; one with ``--http-processes 1``, the default);
each message is one msgpack frame of typed msgspec structs:

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

With several HTTP processes (``--http-processes N``) the worker holds N pipes. The first is the ``helios
run`` process's (the owner's): its ``Stop`` or its end stops the worker as above. Every pipe has its own
outbox and sender thread, and a receiving thread of its own. The worker keeps which pipe submitted each
active request (:class:`_Routes`): a request's events go to that pipe only, and a decode round's
:class:`RoundDelivery` is split per pipe, each carrying only its own requests' lanes (indices renumbered;
the split of a cohort is found once and reused for its rounds). An id already active on any pipe is
refused with an :class:`~helios_core.runtime.messages.ExecutionFailed` on the pipe that sent it, so a
request's events never reach another process. :class:`LoadUpdate`, :class:`WorkerReady`,
:class:`WorkerStartFailed` and :class:`WorkerStopped` go to every pipe. Another HTTP process that leaves
(its ``Stop``: the worker cancels its requests and answers :class:`WorkerStopped` on that pipe) or dies
(its pipe ends: its requests are cancelled) is dropped, and the worker carries on serving the others.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
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
    TERMINAL_EVENTS,
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


class _Routes:
    """Which pipe submitted each active request (only with several pipes): ids never collide across them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, _Link] = {}

    def claim(self, request_id: str, link: _Link) -> bool:
        """Route ``request_id``'s events to ``link``; False when the id is active already (on any pipe)."""
        with self._lock:
            if request_id in self._active:
                return False
            self._active[request_id] = link
            link.requests.add(request_id)
            return True

    def release(self, request_id: str, link: _Link) -> None:
        """``link`` sent the request's terminal event: its id is free again (an id ``link`` was refused
        because another pipe holds it stays that pipe's)."""
        with self._lock:
            if self._active.get(request_id) is link:
                del self._active[request_id]
                link.requests.discard(request_id)

    def drop(self, link: _Link) -> list[str]:
        """Forget every request ``link`` submitted; their ids."""
        with self._lock:
            ids = list(link.requests)
            link.requests.clear()
            for request_id in ids:
                self._active.pop(request_id, None)
            return ids


class _Outbox:
    """One pipe's outgoing queue and the thread that sends it as frames.

    With ``link`` (several pipes) a decode round's tokens are cut down to the lanes of ``link``'s own
    requests, and each terminal event sent frees its request's route."""

    def __init__(self, connection: Connection, link: _Link | None = None, routes: _Routes | None = None) -> None:
        self._connection = connection
        self._link = link
        self._routes = routes
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.put = self._queue.put
        self._encoder = msgspec.msgpack.Encoder()
        self._cohort: dict[str, int] | None = None
        """The lanes of the last cohort split (its rounds share the one dict)."""
        self._picks: list[int] | None = None
        """The cohort's lanes of this pipe's requests, in order (None: every lane is this pipe's)."""
        self._lanes: dict[str, int] = {}
        """This pipe's requests of the cohort and their lanes in the cut round."""
        self._thread = threading.Thread(target=self._send_all, name="helios-worker-sender", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Send what is queued, then stop the sender (after a :class:`WorkerStopped` was put)."""
        self._thread.join()

    def _own_round(self, tokens: RoundTokens) -> RoundTokens:
        """``tokens`` with only the lanes of this pipe's requests (``tokens`` itself when all are)."""
        link = self._link
        if link is None:
            return tokens
        if tokens.lanes is not self._cohort:
            self._cohort = tokens.lanes
            mine = [(request_id, lane) for request_id, lane in tokens.lanes.items() if request_id in link.requests]
            if len(mine) == len(tokens.lanes):
                self._picks = None
            else:
                self._picks = [lane for _, lane in mine]
                self._lanes = {request_id: index for index, (request_id, _) in enumerate(mine)}
        picks = self._picks
        if picks is None:
            return tokens
        token_ids, logprobs, texts = tokens.token_ids, tokens.logprobs, tokens.texts
        return RoundTokens(
            self._lanes,
            [token_ids[lane] for lane in picks],
            [logprobs[lane] for lane in picks],
            None if texts is None else [texts[lane] for lane in picks],
        )

    def _send_all(self) -> None:
        get, get_nowait = self._queue.get, self._queue.get_nowait
        last_round: RoundTokens | None = None
        encode, send = self._encoder.encode, self._connection.send_bytes
        link, routes = self._link, self._routes
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
                    batch.append(RoundDelivery(self._own_round(item)))
                    continue
                batch.append(item)
                stopped = stopped or isinstance(item, WorkerStopped)
                if link is not None and routes is not None and isinstance(item, TERMINAL_EVENTS):
                    routes.release(item.request_id, link)
            try:
                send(encode(batch))
            except OSError:  # the server process is gone: nothing is left to deliver to
                return
            if stopped:
                return


class _Link:
    """One HTTP process's pipe in the worker process: its outbox and the requests it submitted."""

    def __init__(self, index: int, connection: Connection, routes: _Routes | None) -> None:
        self.index = index
        self.connection = connection
        self.requests: set[str] = set()
        """The active requests this pipe submitted (kept only with several pipes)."""
        self.open = True
        """False once its process left or its pipe ended: load updates no longer go to it."""
        self.outbox = _Outbox(connection, self if routes is not None else None, routes)


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


def _publish_load(engine: Engine, kv_events: _KvEvents, links: Sequence[_Link], stopped: threading.Event) -> None:
    """Every :data:`LOAD_INTERVAL_SECONDS`: send the statistics, load gauges and KV-cache event counters
    to every open pipe when they changed."""
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
            update = LoadUpdate(*current)
            for link in links:
                if link.open:
                    link.outbox.put(update)


def serve_worker(connections: Sequence[Connection], spec: WorkerSpec) -> None:
    """The worker process's entry point: load, announce on every pipe, serve them until the first pipe's
    ``Stop`` or its end (the others may leave earlier; see the module docstring)."""
    began = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from helios_core.runtime.startup import start

    routes = _Routes() if len(connections) > 1 else None
    links = [_Link(index, connection, routes) for index, connection in enumerate(connections)]

    def tell_all(message: object) -> None:
        for link in links:
            link.outbox.put(message)

    def close_all() -> None:
        tell_all(WorkerStopped())
        for link in links:
            link.outbox.close()
            link.connection.close()

    try:
        running = start(spec.core, spec.trust, spec.load, backend=spec.backend)
    except Exception as exc:
        message = str(exc) if isinstance(exc, HeliosError) else f"{type(exc).__name__}: {exc}"
        tell_all(WorkerStartFailed(message))
        close_all()
        return
    engine = running.engine
    engine.make_text = None  # the server process's streams add the text of ungated requests
    pages = engine.allocator
    tell_all(
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
        target=_publish_load, args=(engine, kv_events, links, stopped), name="helios-worker-load", daemon=True
    )
    load.start()
    for link in links[1:]:
        threading.Thread(
            target=_receive_peer,
            args=(link, engine, kv_events, routes),
            name=f"helios-worker-receiver-{link.index}",
            daemon=True,
        ).start()
    try:
        _receive(links[0], engine, kv_events, routes)
    finally:
        try:
            try:
                running.close()  # the engine publishes every remaining request's terminal event first
            finally:
                kv_events.close()  # once the engine stopped: the last event is AllBlocksCleared
        finally:
            stopped.set()
            load.join()
            close_all()


def _receive(link: _Link, engine: Engine, kv_events: _KvEvents, routes: _Routes | None) -> None:
    """Apply the messages of ``link``'s process until its ``Stop`` or its pipe's end."""
    decode = to_worker_decoder().decode
    connection, outbox = link.connection, link.outbox
    while True:
        try:
            message = decode(connection.recv_bytes())
        except (EOFError, OSError):  # the server process is gone
            return
        if isinstance(message, Submit):
            _submit(engine, message.request, link, routes)
        elif isinstance(message, Cancel):
            if routes is None or message.request_id in link.requests:  # a process cancels its own requests only
                engine.cancel(message.request_id)
        elif isinstance(message, StartKvEvents):
            outbox.put(kv_events.start(engine, message))
        else:
            return


def _receive_peer(link: _Link, engine: Engine, kv_events: _KvEvents, routes: _Routes | None) -> None:
    """Serve another HTTP process's pipe until it leaves (its ``Stop``: answered with :class:`WorkerStopped`)
    or its pipe ends (the process died); then cancel the requests it still has and drop the pipe."""
    try:
        _receive(link, engine, kv_events, routes)
    finally:
        link.open = False
        for request_id in routes.drop(link) if routes is not None else []:
            engine.cancel(request_id)
        link.outbox.put(WorkerStopped())  # a process that left reads it; a dead one's sender ends on the write


def _submit(engine: Engine, request: PreparedRequest, link: _Link, routes: _Routes | None) -> None:
    request_id, outbox = request.request_id, link.outbox
    if routes is not None and not routes.claim(request_id, link):  # active on this pipe or another
        outbox.put(ExecutionFailed(request_id, f"request id {request_id!r} is already active"))
        return
    try:
        stream = engine.submit(request)
    except HeliosError as exc:  # a duplicate id: the server process refuses those before they cross
        outbox.put(ExecutionFailed(request_id, str(exc)))
        return
    _forward(engine, stream, outbox)
