"""KV-cache events over ZeroMQ in vLLM's wire format: the publisher that runs beside the page allocator.

Owns the typed publishing settings (:class:`KvEventsConfig`, vLLM's keys and defaults; the server decodes
``--kv-events-config`` into it and, with ``--worker-process``, sends it to the worker process as it is),
the event publisher (:class:`KvEventPublisher`) and the wire encoding (:func:`encode_event`,
:func:`encode_batch`, :func:`frames`). It lives in the runtime layer so that it runs wherever the
allocator does: in the serving process in the thread mode, in the worker process with
``--worker-process``. The option parsing and the metrics collector of its counters are the server's
(:mod:`helios_core.server.kv_events`, :mod:`helios_core.server.metrics`).

The publisher is the page allocator's :class:`~helios_core.runtime.pages.PageEventSink`: the model
worker's calls only put a tuple on a bounded queue (a full queue drops the event and counts it in
:attr:`KvEventPublisher.dropped`), and the publisher's own thread (``helios-kv-events``) drains the
queue, encodes what it took as one batch and sends it on a PUB socket. The thread also answers the
optional replay socket.

The wire format, as llm-d's KV-cache indexer decodes it:

* three frames ``[topic, sequence, payload]``; ``sequence`` is the batch number, 8 bytes big-endian,
  from 0, one more per batch;
* ``payload`` is msgpack, positional arrays: the batch ``[timestamp (float, Unix seconds), [event, ...]]``
  and the events ``["BlockStored", [hash], parent_hash or nil, token_ids, block_size, nil, "GPU"]``,
  ``["BlockRemoved", [hash], "GPU"]`` and ``["AllBlocksCleared"]`` (the nil is the LoRA id, "GPU" the
  medium: the primary cache tier, whatever the backend);
* a hash is the last 8 bytes of the page's chain key, read as an unsigned big-endian integer; each
  ``BlockStored`` carries one complete page (``len(token_ids) == block_size``).

The PUB socket binds when the endpoint contains ``*``, ``::``, ``ipc://`` or ``inproc://`` and connects
otherwise (a router's central subscriber binds, a server connects to it). The replay socket (ROUTER,
always bound) keeps the last ``buffer_steps`` batches: a request ``[identity, b"", start]`` with an
8-byte big-endian start sequence gets ``[identity, b"", sequence, payload]`` for each kept batch from
``start`` on, then the end marker ``[identity, b"", -1 (8 bytes, signed), b""]``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgpack  # type: ignore[import-untyped]
import msgspec
import zmq

from helios_core.errors import StartupError
from helios_core.runtime.pages import PageAllocator

__all__ = [
    "END_OF_REPLAY",
    "MEDIUM",
    "KvEventPublisher",
    "KvEventsConfig",
    "binds",
    "encode_batch",
    "encode_event",
    "event_hash",
    "frames",
]

_LOG = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay."""

MEDIUM = "GPU"
"""The medium every event names: the primary cache tier."""

_SLICE_SECONDS = 0.02
"""How long the publisher thread waits for a first event before it looks at the replay socket again."""
_MAX_BATCH_EVENTS = 4096
"""The most events one batch carries (the rest go in the next batch)."""
_LINGER_MS = 1000
"""At close, how long queued frames may still be delivered before the sockets are dropped."""

_STORED = 0
_REMOVED = 1
_CLEARED = 2


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``--kv-events-config``: vLLM's keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] = "zmq"
    """``null`` publishes nothing."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    """Batches the replay socket keeps."""
    hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    """The PUB socket's send high-water mark (frames queued per subscriber; 0: no limit)."""
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    """Events the queue between the model worker and the publisher thread holds."""
    topic: str = ""
    """Empty: ``kv@<host>:<port>@<served model name>`` (the server's ``default_topic``)."""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def binds(endpoint: str) -> bool:
    """Whether a PUB socket binds ``endpoint`` (else it connects), as vLLM decides."""
    return any(marker in endpoint for marker in ("*", "::", "ipc://", "inproc://"))


def event_hash(key: bytes) -> int:
    """A page key on the wire: its last 8 bytes, unsigned big-endian."""
    return int.from_bytes(key[-8:], "big")


def encode_event(event: tuple[Any, ...]) -> list[Any]:
    """One queued event as its positional array."""
    kind = event[0]
    if kind == _STORED:
        _, key, parent, tokens, page_tokens = event
        return [
            "BlockStored",
            [event_hash(key)],
            None if parent is None else event_hash(parent),
            [int(token) for token in tokens],
            page_tokens,
            None,
            MEDIUM,
        ]
    if kind == _REMOVED:
        return ["BlockRemoved", [event_hash(event[1])], MEDIUM]
    return ["AllBlocksCleared"]


def encode_batch(timestamp: float, events: Sequence[list[Any]]) -> bytes:
    """The msgpack payload of one batch."""
    payload: bytes = msgpack.packb([float(timestamp), list(events)], use_bin_type=True)
    return payload


def frames(topic: bytes, sequence: int, payload: bytes) -> list[bytes]:
    """The three frames of one batch."""
    return [topic, sequence.to_bytes(8, "big"), payload]


class KvEventPublisher:
    """The page allocator's listener that publishes its events on ZeroMQ (see the module docstring).

    Construction binds or connects the sockets (a StartupError names an endpoint that cannot be used);
    :meth:`attach` makes it an allocator's listener and starts the thread; :meth:`close` detaches it,
    sends what is queued and a last ``AllBlocksCleared``, and closes the sockets.
    """

    def __init__(self, config: KvEventsConfig, topic: str) -> None:
        self.config = config
        self.topic = topic.encode()
        self.dropped = 0
        """Events dropped because the queue was full (``helios_kv_events_dropped_total``)."""
        self.published = 0
        """Events handed to the PUB socket (``helios_kv_events_published_total``)."""
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._sequence = 0
        self._allocator: PageAllocator | None = None
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._socket: zmq.Socket[bytes] = self._context.socket(zmq.PUB)
            self._socket.setsockopt(zmq.LINGER, _LINGER_MS)
            self._socket.setsockopt(zmq.SNDHWM, config.hwm)
            self._open(self._socket, config.endpoint, bind=binds(config.endpoint), key="endpoint")
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, _LINGER_MS)
                self._open(self._replay, config.replay_endpoint, bind=True, key="replay_endpoint")
        except BaseException:
            self._context.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="helios-kv-events", daemon=True)

    @staticmethod
    def _open(socket: zmq.Socket[bytes], endpoint: str, *, bind: bool, key: str) -> None:
        try:
            if bind:
                socket.bind(endpoint)
            else:
                socket.connect(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect to"
            raise StartupError(f"--kv-events-config: cannot {verb} {key} {endpoint!r}: {exc}") from None

    # -- the allocator's listener (model worker thread) ------------------------------------------
    def page_stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int], page_tokens: int) -> None:
        self._offer((_STORED, key, parent, tokens, page_tokens))

    def page_removed(self, key: bytes) -> None:
        self._offer((_REMOVED, key))

    def all_cleared(self) -> None:
        """Queued events are superseded by the clear: they are discarded (not counted as dropped), so
        the clear always finds room."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._offer((_CLEARED,))

    def _offer(self, event: tuple[Any, ...]) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    # -- lifecycle -----------------------------------------------------------------------------------
    def attach(self, allocator: PageAllocator) -> None:
        """Listen to ``allocator`` and start publishing (an ``AllBlocksCleared`` goes out first)."""
        allocator.attach_events(self)
        self._allocator = allocator
        self._thread.start()

    def close(self) -> None:
        """Detach from the allocator (once the model worker stopped), publish what is queued and the
        final ``AllBlocksCleared``, stop the thread and close the sockets. Idempotent."""
        if self._allocator is not None:
            self._allocator.detach_events()
            self._allocator = None
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    # -- the publisher thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                stopping = self._stop.is_set()
                events = self._take(0.0 if stopping else _SLICE_SECONDS)
                if events:
                    self._send(events)
                if self._replay is not None:
                    self._serve_replay(self._replay)
                if stopping and not events:
                    return
        except Exception:
            _LOG.exception("the KV-cache event publisher stopped")

    def _take(self, timeout: float) -> list[tuple[Any, ...]]:
        try:
            first = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        events = [first]
        while len(events) < _MAX_BATCH_EVENTS:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return events

    def _send(self, events: list[tuple[Any, ...]]) -> None:
        payload = encode_batch(time.time(), [encode_event(event) for event in events])
        sequence = self._sequence
        self._sequence += 1
        self._socket.send_multipart(frames(self.topic, sequence, payload))  # at the high-water mark PUB drops
        self.published += len(events)
        if self.config.buffer_steps:
            self._buffer.append((sequence, payload))

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        while replay.poll(0):
            request = replay.recv_multipart()
            if len(request) != 3 or request[1] != b"" or len(request[2]) != 8:
                _LOG.warning("ignored a malformed KV-cache event replay request (%d frames)", len(request))
                continue
            identity, start = request[0], int.from_bytes(request[2], "big")
            for sequence, payload in list(self._buffer):
                if sequence >= start:
                    replay.send_multipart([identity, b"", sequence.to_bytes(8, "big"), payload])
            replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
