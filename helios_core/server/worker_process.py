"""The server side of a model worker in its own process (``helios run --worker-process``).

Owns starting the worker process and :class:`WorkerProcessEngine`, the ``Engine``-compatible proxy the
chat service uses in its place. The worker process (:func:`helios_core.runtime.remote.serve_worker`)
is started first (:func:`launch_worker_process`; ``helios run`` does so before it imports and builds
its HTTP server) and verifies the core and loads the native model; meanwhile the server process opens
and verifies the core itself (its contract, frontend assets and load-time selection: what preparation,
presentation and admission read) and builds its own structured-output compiler, then waits for
:class:`~helios_core.runtime.remote.WorkerReady`. The messages between them are
:mod:`helios_core.runtime.remote`'s.

The proxy keeps the engine's API and its behaviour: :meth:`WorkerProcessEngine.submit` returns a
:class:`~helios_core.runtime.engine.RequestStream` that yields the same events in the same order (the
text of ungated requests is added by the stream, here, as in the thread mode), ``cancel`` stops a
request before its next round, ``statistics`` returns the newest snapshot the worker sent (it sends one
whenever something changed, checked every 20 ms; reading it never blocks), ``live_load`` the live load
gauges of ``/metrics``, ``kv_events`` the worker's KV-cache event counters (0 until
:meth:`WorkerProcessEngine.start_kv_events` attached the worker's publisher) and ``worker_alive``
whether the worker process runs. When the worker process
dies, every open request ends at once with an :class:`~helios_core.runtime.messages.ExecutionFailed`
(HTTP 500 ``execution_error``, a stream's ``error`` event) naming the exit, later submissions end the
same way, and ``/health`` answers 503. ``shutdown`` sends ``Stop``: the worker cancels what remains
(each request's terminal event arrives first), closes its core and exits.

With ``--http-processes N`` the worker process gets N pipes (:func:`launch_worker_process` with
``http_processes``): the ``helios run`` process keeps the first and owns the worker as above; each other
HTTP process builds its proxy on its own pipe with :func:`connect_worker_process`. Such a proxy does not own
the worker: its ``shutdown`` sends ``Stop``, which there means that this process leaves (the worker cancels
its requests and answers on its pipe alone), and when the worker dies it learns the exit (not its child)
from the ``helios run`` process, which relays the message its own proxy made (``on_exit`` of
:func:`start_worker_process`), so that every process ends its requests with the same message.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

import msgspec
from tokenizers import Tokenizer

from helios_core.contract import LoadOptions, PreparedContract, Selection, select
from helios_core.errors import HeliosError, StartupError
from helios_core.frontend.bootstrap import Bootstrap
from helios_core.frontend.detokenizer import TokenBytes
from helios_core.frontend.structured import GrammarCompiler
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.runtime.engine import Engine, GenerationResult, RequestStream, collect_generation, compile_format
from helios_core.runtime.gates import StreamText, TextlessIds, needs_gate
from helios_core.runtime.kv_events import KvEventsConfig
from helios_core.runtime.messages import (
    TERMINAL_EVENTS,
    AdmissionRejected,
    Cancel,
    ExecutionFailed,
    PreparedRequest,
    Stop,
    Submit,
)
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.remote import (
    FromWorker,
    KvEventsFailed,
    KvEventsStarted,
    LoadUpdate,
    RoundDelivery,
    StartKvEvents,
    WorkerReady,
    WorkerSpec,
    WorkerStartFailed,
    WorkerStopped,
    from_worker_decoder,
    serve_worker,
)
from helios_core.runtime.startup import RunningModel
from helios_core.runtime.stats import StatsSnapshot

__all__ = [
    "LiveLoad",
    "RemoteKvEventCounts",
    "WorkerLaunch",
    "WorkerPeer",
    "WorkerProcessEngine",
    "connect_worker_process",
    "launch_worker_process",
    "start_worker_process",
]

_STOP_SECONDS = 60.0
"""How long :meth:`WorkerProcessEngine.shutdown` waits for the worker to stop before killing it."""
_KV_EVENTS_START_SECONDS = 30.0
"""How long :meth:`WorkerProcessEngine.start_kv_events` waits for the worker's answer."""
_EXIT_RELAY_SECONDS = 2.0
"""How long a proxy that does not own the worker waits for the relayed exit of a worker whose pipe ended."""


@dataclass(frozen=True)
class LiveLoad:
    """The worker's live load values the gateway gauges read."""

    running: int
    free_pages: int
    evictable_pages: int
    total_pages: int
    page_tokens: int


@dataclass
class RemoteKvEventCounts:
    """The worker's KV-cache event counters as its newest :class:`LoadUpdate` carried them."""

    dropped: int = 0
    """Events the worker's publisher dropped because its queue was full."""
    published: int = 0
    """Events the worker's publisher sent on its socket."""


class _OwnedWorker:
    """The worker process this process started: it can join it and read its exit status."""

    owner = True

    def __init__(self, process: BaseProcess) -> None:
        self.process = process

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_message(self) -> str:
        """Why the pipe ended while the worker was not asked to stop."""
        self.process.join(1.0)
        code = self.process.exitcode
        how = "" if code is None else f" (signal {-code})" if code < 0 else f" (exit status {code})"
        return f"the model worker process exited unexpectedly{how}"

    def stopped(self, receiver_ended: bool) -> None:
        """After ``Stop``: wait for the process to exit (at once when its pipe did not end), kill it if not."""
        process = self.process
        process.join(_STOP_SECONDS if receiver_ended else 0)
        if process.is_alive():
            process.kill()
            process.join()


class _SharedWorker:
    """The worker process another process (``helios run``) started and owns: its exit is relayed here."""

    owner = False

    def __init__(self, exits: queue.SimpleQueue[str]) -> None:
        self._exits = exits

    def is_alive(self) -> bool:
        return True  # its pipe's end says when it stopped

    def exit_message(self) -> str:
        try:
            return self._exits.get(timeout=_EXIT_RELAY_SECONDS)
        except queue.Empty:
            return "the model worker process exited unexpectedly"

    def stopped(self, receiver_ended: bool) -> None:
        """Nothing to join: the owner stops the worker process."""


class _RemoteModel:
    """What the server process knows of the model the worker process loaded (no backend here)."""

    def __init__(self, contract: PreparedContract, selection: Selection, clock_origin_ns: int) -> None:
        self.contract = contract
        self.selection = selection
        self.clock_origin_ns = clock_origin_ns

    def close(self) -> None:
        """Nothing to release here: the worker process closes the model."""


class WorkerProcessEngine:
    """The engine's API over the pipe to a model worker process (see the module docstring)."""

    def __init__(
        self,
        worker: BaseProcess | _SharedWorker,
        connection: Connection,
        ready: WorkerReady,
        selection: Selection,
        tokenizer: Tokenizer,
        grammar_compiler: GrammarCompiler,
        *,
        textless: TextlessIds,
        pending: list[FromWorker] | None = None,
        on_exit: Callable[[str], None] | None = None,
    ) -> None:
        self._worker = worker if isinstance(worker, _SharedWorker) else _OwnedWorker(worker)
        self._connection = connection
        self.pid = ready.pid
        self.queue_capacity = selection.queue_capacity
        self.capacity = selection.queue_capacity + selection.max_active
        self.grammar_compiler = grammar_compiler
        token_bytes = TokenBytes.from_tokenizer(tokenizer)
        self.make_text: Callable[[PreparedRequest], StreamText] = lambda request: StreamText(
            tokenizer, token_bytes, textless.of(request)[1]
        )
        self._encode = msgspec.msgpack.Encoder().encode
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._snapshot = ready.snapshot
        self._load = LiveLoad(0, ready.total_pages, 0, ready.total_pages, ready.page_tokens)
        self.kv_events = RemoteKvEventCounts()
        """The worker's KV-cache event counters (``/metrics`` reads them; updated from each LoadUpdate)."""
        self._kv_answers: queue.SimpleQueue[KvEventsStarted | KvEventsFailed] = queue.SimpleQueue()
        self._failure: str | None = None
        """Why every request now fails at once (the worker process died), or None while it runs."""
        self._pipe_ended = False
        """The worker's pipe ended (the worker is gone, its exit not known yet)."""
        self._on_exit = on_exit
        """Told the message of a worker that exited unexpectedly, before the open requests fail with it."""
        self._stopping = False
        if pending:  # what the worker sent after WorkerReady, in its frame
            self._deliver(pending)
        self._receiver = threading.Thread(target=self._receive, name="helios-worker-receiver", daemon=True)
        self._receiver.start()

    # -- the engine API ---------------------------------------------------------------------------
    def submit(self, request: PreparedRequest) -> RequestStream:
        """Send ``request`` to the worker; its events arrive on the returned stream (as ``Engine.submit``)."""
        if request.response_format is not None and request.grammar is None:
            compiled = compile_format(request, request.response_format, self.grammar_compiler)
            if isinstance(compiled, AdmissionRejected):
                refused = RequestStream(request.request_id)
                refused.put(compiled)
                return refused
            request = compiled
        stream = RequestStream(request.request_id, None if needs_gate(request) else self.make_text(request))
        with self._lock:
            if self._failure is not None:
                stream.put(ExecutionFailed(request.request_id, self._failure))
                return stream
            if request.request_id in self._streams:
                raise HeliosError(f"request id {request.request_id!r} is already active")
            self._streams[request.request_id] = stream
        # the compiled grammar stays here: the worker compiles it again from response_format
        self._send(Submit(msgspec.structs.replace(request, grammar=None)))
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request before its next round; it finishes with reason ``cancelled``."""
        with self._lock:
            if request_id not in self._streams or self._failure is not None:
                return
        self._send(Cancel(request_id))

    def generate(self, request: PreparedRequest) -> GenerationResult:
        """Submit and wait: the tokens and finish reason, or the rejection/failure as an error."""
        return collect_generation(self.submit(request))

    def start_kv_events(self, config: KvEventsConfig, topic: str) -> None:
        """Start the KV-cache event publisher in the worker process, beside its page allocator, and wait
        until it is attached (its first event, ``AllBlocksCleared``, is then queued). Call once, before the
        first request. A StartupError says why it did not start (an endpoint that cannot be used, the
        worker's exit, or no answer within 30 s)."""
        self._send(StartKvEvents(config, topic))
        deadline = time.monotonic() + _KV_EVENTS_START_SECONDS
        while True:
            try:
                answer = self._kv_answers.get(timeout=0.05)
            except queue.Empty:
                if not self.worker_alive():
                    raise StartupError(
                        "the model worker process stopped before it started the KV-cache event publisher"
                    ) from None
                if time.monotonic() > deadline:
                    raise StartupError(
                        f"the model worker process did not start the KV-cache event publisher within "
                        f"{_KV_EVENTS_START_SECONDS:g} s"
                    ) from None
                continue
            if isinstance(answer, KvEventsFailed):
                raise StartupError(answer.message)
            return

    def worker_alive(self) -> bool:
        """Whether the worker process runs and its pipe is open."""
        return self._failure is None and not self._pipe_ended and self._worker.is_alive()

    def statistics(self) -> StatsSnapshot:
        """The newest statistics snapshot the worker sent (never blocks)."""
        return self._snapshot

    def live_load(self) -> LiveLoad:
        """The newest live load gauges the worker sent (never blocks)."""
        return self._load

    def shutdown(self) -> None:
        """Stop the worker after its round in progress; what remains is cancelled (each stream gets its
        terminal event), then the worker closes the model and exits. A proxy that does not own the worker
        leaves it instead: the worker cancels this process's requests and serves on. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._send(Stop())
        self._receiver.join(_STOP_SECONDS)
        self._worker.stopped(not self._receiver.is_alive())
        self._fail_open("the model worker process stopped")
        with contextlib.suppress(OSError):
            self._connection.close()

    # -- the pipe ---------------------------------------------------------------------------------
    def _send(self, message: Submit | Cancel | Stop | StartKvEvents) -> None:
        data = self._encode(message)
        # a worker that is gone refuses the write: the receiver fails every open request
        with self._send_lock, contextlib.suppress(OSError):
            self._connection.send_bytes(data)

    def _receive(self) -> None:
        decode = from_worker_decoder().decode
        recv = self._connection.recv_bytes
        while True:
            try:
                batch = decode(recv())
            except (EOFError, OSError):
                break
            if self._deliver(batch):
                return
        self._pipe_ended = True
        if self._stopping:
            return
        message = self._worker.exit_message()
        if self._on_exit is not None:
            self._on_exit(message)
        self._fail_open(message)

    def _deliver(self, batch: list[FromWorker]) -> bool:
        """Put a frame's events on their streams; True once the worker said it stopped."""
        stopped = False
        with self._lock:
            streams = self._streams
            for item in batch:
                if isinstance(item, RoundDelivery):
                    tokens = item.tokens
                    for request_id in tokens.lanes:
                        stream = streams.get(request_id)
                        if stream is not None:
                            stream.put(tokens)
                elif isinstance(item, LoadUpdate):
                    self._snapshot = item.snapshot
                    load = self._load
                    self._load = LiveLoad(
                        item.running, item.free_pages, item.evictable_pages, load.total_pages, load.page_tokens
                    )
                    self.kv_events.dropped = item.kv_events_dropped
                    self.kv_events.published = item.kv_events_published
                elif isinstance(item, KvEventsStarted | KvEventsFailed):
                    self._kv_answers.put(item)
                elif isinstance(item, WorkerStopped):
                    stopped = True
                elif isinstance(item, WorkerReady | WorkerStartFailed):
                    continue
                else:
                    stream = streams.get(item.request_id)
                    if stream is not None:
                        if isinstance(item, TERMINAL_EVENTS):
                            del streams[item.request_id]
                        stream.put(item)
        return stopped

    def _fail_open(self, message: str) -> None:
        """End every open request with ``message``; later submissions fail the same way at once."""
        with self._lock:
            if self._failure is None:
                self._failure = message
            open_streams, self._streams = self._streams, {}
        for request_id, stream in open_streams.items():
            stream.put(ExecutionFailed(request_id, message))


@dataclass
class WorkerLaunch:
    """A model worker process that was started and is loading: not yet known to be ready.

    Made by :func:`launch_worker_process` and handed to :func:`start_worker_process`, which then owns it
    (it stops it on any failure). Whoever holds one that was never handed over stops it with :meth:`stop`.
    """

    process: BaseProcess
    connection: Connection
    """The server's end of the pipe to the worker process."""
    started: float
    """``time.monotonic()`` just before the worker process was started."""
    peers: list[Connection] = field(default_factory=list)
    """With several HTTP processes: the other processes' ends of their pipes to the worker (the launching
    process hands each to its process and closes its own copy)."""

    def stop(self) -> None:
        """Close the pipes, kill the worker process if it still runs, and join it (no orphan is left)."""
        for peer in self.peers:
            peer.close()
        _stop_worker(self.process, self.connection)


def launch_worker_process(
    path: Path, settings: TrustSettings, options: LoadOptions, *, backend: str = "auto", http_processes: int = 1
) -> WorkerLaunch:
    """Start the model worker process on ``path`` (spawned: it imports Helios, verifies the core and loads
    the native model on its own) and return at once, without waiting for it.

    ``helios run --worker-process`` calls this as early as it can, before the HTTP server is imported
    and built, so the worker process loads while the server process starts. With ``http_processes`` N > 1
    the worker gets N pipes: the first is this process's, the others' ends are the launch's ``peers``."""
    if http_processes < 1:
        raise StartupError(f"--http-processes must be at least 1, not {http_processes}")
    context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
    pipes = [context.Pipe(duplex=True) for _ in range(http_processes)]
    ends = [server for server, _ in pipes]
    worker_ends = [worker for _, worker in pipes]
    process = context.Process(
        target=serve_worker,
        args=(worker_ends, WorkerSpec(path, settings, options, backend)),
        name="helios-model-worker",
        daemon=True,
    )
    started = time.monotonic()
    try:
        process.start()
    except BaseException:
        for end in ends:
            end.close()
        raise
    finally:
        for end in worker_ends:
            end.close()
    return WorkerLaunch(process, ends[0], started, ends[1:])


@dataclass(frozen=True)
class _Frontend:
    """What the server side builds from the core while the worker loads."""

    verified: VerifiedCore
    bootstrap: Bootstrap
    selection: Selection
    grammar_compiler: GrammarCompiler

    @property
    def textless(self) -> TextlessIds:
        """The ids generated text leaves out (the worker's engine builds the same set)."""
        contract = self.verified.contract
        return TextlessIds.of_core(self.bootstrap.tokenizer, contract.eos_token_ids, contract.model.frontend)


def _open_frontend(path: Path, settings: TrustSettings, options: LoadOptions) -> _Frontend:
    """Open and verify the core here, and build its frontend, selection and structured-output compiler (the
    core is closed again when building fails)."""
    verified = open_core(path, settings, check_resources=False)
    try:
        bootstrap = Bootstrap.load(verified.core, verified.contract)
        contract = verified.contract
        selection = select(contract, options)
        grammar_compiler = GrammarCompiler(
            bootstrap.tokenizer,
            sampled_size=contract.sampled_size,
            logits_width=contract.logits_width,
            eos_token_ids=contract.eos_token_ids,
        )
    except BaseException:
        verified.close()
        raise
    return _Frontend(verified, bootstrap, selection, grammar_compiler)


def _running_model(frontend: _Frontend, engine: WorkerProcessEngine, ready: WorkerReady) -> RunningModel:
    model = _RemoteModel(frontend.verified.contract, frontend.selection, ready.clock_origin_ns)
    # the proxy and the stand-in offer what the server reads of an engine and a model
    return RunningModel(
        frontend.verified,
        frontend.bootstrap,
        cast(NativeModel, model),
        cast(Engine, engine),
        frontend.grammar_compiler,
        worker_load_seconds=ready.load_seconds,
    )


def start_worker_process(
    path: Path,
    settings: TrustSettings,
    options: LoadOptions,
    *,
    backend: str = "auto",
    launched: WorkerLaunch | None = None,
    on_exit: Callable[[str], None] | None = None,
) -> RunningModel:
    """Start the model worker process on ``path`` (or take ``launched``, one :func:`launch_worker_process`
    started with the same arguments), verify the core here while it loads, and wait until it is ready.

    The worker process is started first: opening and verifying the core here, its frontend assets,
    the load-time selection and the structured-output compiler are built while the worker process
    imports Helios and loads the native model. Raises the verification error itself when the core does
    not open here (the worker process is then killed and joined), and a StartupError naming what failed
    when the worker process does not start (its own loading error, or its exit); either way nothing
    started here, or handed over in ``launched``, is left running or open. ``on_exit`` is told the
    message of a worker process that later exits unexpectedly (before the open requests end with it)."""
    launch = launch_worker_process(path, settings, options, backend=backend) if launched is None else launched
    process, connection = launch.process, launch.connection
    try:
        frontend = _open_frontend(path, settings, options)
    except BaseException:
        launch.stop()
        raise
    try:
        ready, pending = _await_ready(connection, process)
        engine = WorkerProcessEngine(
            process,
            connection,
            ready,
            frontend.selection,
            frontend.bootstrap.tokenizer,
            frontend.grammar_compiler,
            textless=frontend.textless,
            pending=pending,
            on_exit=on_exit,
        )
    except BaseException:
        try:
            launch.stop()
        finally:
            frontend.verified.close()
        raise
    return _running_model(frontend, engine, ready)


@dataclass
class WorkerPeer:
    """Another HTTP process's way to the model worker process that ``helios run`` started and owns."""

    connection: Connection
    """This process's pipe to the worker (a :class:`WorkerLaunch`'s peer end)."""
    exits: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)
    """Where the exit of a worker that died is relayed to this process (its proxy waits on it)."""


def connect_worker_process(path: Path, settings: TrustSettings, options: LoadOptions, peer: WorkerPeer) -> RunningModel:
    """The running model of another HTTP process: verify the core and build its frontend here, then wait
    for the worker's :class:`~helios_core.runtime.remote.WorkerReady` on this process's own pipe. Closing
    the result leaves the worker (it cancels this process's requests and serves on); a StartupError says
    when the worker stopped before it was ready. What was opened here is closed on any failure."""
    frontend = _open_frontend(path, settings, options)
    try:
        ready, pending = _await_ready(peer.connection, None)
        engine = WorkerProcessEngine(
            _SharedWorker(peer.exits),
            peer.connection,
            ready,
            frontend.selection,
            frontend.bootstrap.tokenizer,
            frontend.grammar_compiler,
            textless=frontend.textless,
            pending=pending,
        )
    except BaseException:
        frontend.verified.close()
        raise
    return _running_model(frontend, engine, ready)


def _stop_worker(process: BaseProcess, connection: Connection) -> None:
    """Close the pipe, kill the worker process if it still runs, and join it (no orphan is left)."""
    connection.close()
    if process.is_alive():
        process.kill()
    process.join()


def _await_ready(connection: Connection, process: BaseProcess | None) -> tuple[WorkerReady, list[FromWorker]]:
    """The worker's first message: ready (with what followed it in its frame), or why it did not start.
    ``process`` is the worker process when this process started it (None: another process owns it, and
    its pipe's end says that it stopped)."""
    while not connection.poll(0.1):
        if process is not None and not process.is_alive():
            raise StartupError(
                f"the model worker process exited (exit status {process.exitcode}) before it loaded the core"
            )
    try:
        first, *rest = from_worker_decoder().decode(connection.recv_bytes())
    except (EOFError, OSError) as exc:
        if process is None:
            raise StartupError("the model worker process exited before it loaded the core") from exc
        process.join(1.0)
        raise StartupError(
            f"the model worker process exited (exit status {process.exitcode}) before it loaded the core"
        ) from exc
    if isinstance(first, WorkerStartFailed):
        if process is not None:
            process.join(10.0)
        raise StartupError(f"the model worker process could not start: {first.message}")
    if not isinstance(first, WorkerReady):
        raise StartupError(f"the model worker process sent {type(first).__name__} before it was ready")
    return first, rest
