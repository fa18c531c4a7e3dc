"""Tensor-parallel ranks in processes of their own (``RankPeers::Processes``): the leader and its rank peers.

Owns everything between a serving process (the *leader*, rank 0) and the rank processes that join it over
TCP (``helios rank``):

* the shared secret (:func:`read_secret_file`: a private, non-empty file, refused like an ssh key readable by
  others) and the digest of a verified contract (:func:`contract_digest`) every peer must match;
* the wire: length-prefixed frames (a 4-byte big-endian length, then a msgpack body) of typed msgspec
  messages (:data:`Message`); every read on the leader has a deadline, and both ends turn TCP keepalive on so a
  peer whose host vanishes is noticed while idle;
* the handshake: HMAC-SHA256 challenge-response in both directions over the shared secret. The rank sends
  its rank, the digest of its contract and a fresh challenge; the leader answers with its own challenge and its
  proof over both; the rank checks that proof, then proves itself over both challenges, its rank and its digest.
  Proofs are compared in constant time. A peer that fails the proof, names a rank outside ``1..N-1`` or one
  already joined, or carries another core is refused with a logged reason and never joins; the leader goes on
  waiting for the right peers until ``join_timeout_s``;
* :class:`ProcessRankedBackend`: the runtime's ``Backend`` over rank 0's backend in the leader and
  the rank processes. A round sends each peer the program, the frame and the staged transport entries that
  changed since that frame's last round; rank 0 runs the program meanwhile, and every collective of rank 0
  (:class:`LeaderCommunicator`) reads each peer's array, combines them in rank order exactly as
  :class:`~helios_core.backends.ranks.ThreadGroup` does and sends the result back. Each peer then replies with
  its completion record (``rank_completions`` gives the engine every rank's) or an error naming the rank.
  A failing rank fails the round (a :class:`~helios_core.backends.ranks.RankError` naming it) and the next
  round runs; a peer that disconnects or misses a deadline breaks the group: every other peer is told to stop,
  the sockets close, and ``on_lost`` is called once (``helios run`` then stops serving and exits non-zero);
  a monitor thread notices a peer that disconnects between rounds.
* the CUDA backend (``Welcome.backend`` ``cuda``): every rank runs a CUDA backend on a GPU of its host, and the
  collectives are NCCL calls captured in every rank's graphs, over one NCCL group whose unique id the leader
  makes and sends in ``Welcome``; a round then carries only the program, the frame and the staged entries, and
  no collective crosses the sockets. A rank that fails a round may leave the others' collectives waiting on their
  devices, so any failure breaks the group as a lost peer does (rank 0 aborts its NCCL communicator, the peers
  are stopped and abort theirs, ``on_lost`` is called).
* :func:`join_leader` and :class:`RankPeer`: the rank process's side: connect (retrying until the leader
  listens), authenticate, build its rank's reference backend with the leader's geometry, then execute what
  the leader sends until it says stop (a leader that goes away ends the rank with a clear error).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.backends.ranks import DEFAULT_DEADLINE_S, RankError, _combine
from helios_core.contract.selection import DEFAULT_RANK_JOIN_TIMEOUT_S, JoinStopped, ProcessRankSettings
from helios_core.errors import HeliosError, StartupError

if TYPE_CHECKING:
    from helios_core.container.reader import CoreFile
    from helios_core.contract.prepared import PreparedContract

__all__ = [
    "DEFAULT_JOIN_TIMEOUT_S",
    "LeaderCommunicator",
    "ProcessRankSettings",
    "ProcessRankedBackend",
    "RankPeer",
    "contract_digest",
    "join_leader",
    "load_process_ranks",
    "parse_address",
    "read_secret_file",
]

AnyArray = npt.NDArray[Any]

DEFAULT_JOIN_TIMEOUT_S = DEFAULT_RANK_JOIN_TIMEOUT_S
"""``--rank-join-timeout``: how long the leader waits for every rank process to join (and a rank process
keeps trying to reach the leader)."""

HANDSHAKE_DEADLINE_S = 5.0
"""The longest one peer's handshake may take (a silent connection cannot hold the others up longer)."""

MONITOR_INTERVAL_S = 0.2
"""How often the leader checks, between rounds, that no peer has disconnected."""

MAX_FRAME_BYTES = 1 << 30
"""The largest message either end accepts (a length above it is a protocol error, never an allocation)."""

SEND_DEADLINE_S = DEFAULT_DEADLINE_S
"""The longest one send may wait for the peer to take its bytes."""

HANDSHAKE_FRAME_BYTES = 4096
"""The largest handshake message: an unauthenticated peer cannot make the leader allocate more."""

_CHALLENGE_BYTES = 32
_LEADER_LABEL = b"helios-rank-leader-v1"
_RANK_LABEL = b"helios-rank-peer-v1"

log = logging.getLogger("helios_core.server.ranks")


# ------------------------------------------------------------------------------------------------ settings


def parse_address(text: str, option: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a host and a port, or a StartupError naming ``option``."""
    host, separator, port_text = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not separator or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise StartupError(f"{option} must be HOST:PORT with a port from 1 to 65535, not {text!r}")
    return host, int(port_text)


def read_secret_file(path: Path) -> bytes:
    """The shared secret: the file's bytes less surrounding whitespace. A file that is not a regular file,
    is readable or writable by group or others, or is empty is refused with a StartupError."""
    try:
        status = path.stat()
    except OSError as exc:
        raise StartupError(f"cannot read --rank-secret-file {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(status.st_mode):
        raise StartupError(f"--rank-secret-file {path} is not a regular file")
    mode = stat.S_IMODE(status.st_mode)
    if mode & 0o077:
        raise StartupError(
            f"--rank-secret-file {path} is accessible by group or others (mode {mode:04o}); it must be private to "
            f"its owner: chmod 600 {path}"
        )
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise StartupError(f"cannot read --rank-secret-file {path}: {exc.strerror or exc}") from exc
    if not secret:
        raise StartupError(f"--rank-secret-file {path} is empty; put a long random secret in it")
    return secret


def contract_digest(contract: PreparedContract) -> str:
    """SHA-256 of the verified contract (version, serving and model contracts, execution manifest)."""
    digest = hashlib.sha256(b"helios-contract-v1\0")
    digest.update(str(contract.version).encode("ascii") + b"\0")
    for part in (contract.serving, contract.model, contract.execution):
        body = part.SerializeToString(deterministic=True)
        digest.update(struct.pack(">Q", len(body)))
        digest.update(body)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ messages


class Array(msgspec.Struct, frozen=True):
    """An array's dtype (numpy name), shape and C-order bytes."""

    dtype: str
    shape: list[int]
    data: bytes


class Hello(msgspec.Struct, tag=True, frozen=True):
    rank: int
    contract: str
    challenge: bytes


class LeaderProof(msgspec.Struct, tag=True, frozen=True):
    challenge: bytes
    proof: bytes


class RankProof(msgspec.Struct, tag=True, frozen=True):
    proof: bytes


class Welcome(msgspec.Struct, tag=True, frozen=True):
    ranks: int
    cache_pages: int
    state_rows: int
    frames: int
    snapshot_rows: int
    deadline_s: float
    backend: str = "reference"
    """The backend every rank runs: ``reference``, or ``cuda`` (collectives through NCCL on the devices)."""
    nccl_id: bytes = b""
    """``cuda``: the unique id of the NCCL group the ranks join (made by the leader)."""


class Refused(msgspec.Struct, tag=True, frozen=True):
    reason: str


class Run(msgspec.Struct, tag=True, frozen=True):
    round: int
    program: str
    frame: int
    entries: dict[str, Array]


class ReserveHostPages(msgspec.Struct, tag=True, frozen=True):
    round: int
    count: int


class CopyPage(msgspec.Struct, tag=True, frozen=True):
    round: int
    to_host: bool
    page: int
    slot: int


class Collective(msgspec.Struct, tag=True, frozen=True):
    operator: str
    parameter: int
    array: Array


class Result(msgspec.Struct, tag=True, frozen=True):
    array: Array


class Abort(msgspec.Struct, tag=True, frozen=True):
    round: int
    rank: int
    reason: str


class Done(msgspec.Struct, tag=True, frozen=True):
    record: dict[int, Array]


class Failed(msgspec.Struct, tag=True, frozen=True):
    rank: int
    """The rank at fault (the sender, or the peer whose failure stopped it)."""
    message: str


class Stop(msgspec.Struct, tag=True, frozen=True):
    reason: str


Message = (
    Hello | LeaderProof | RankProof | Welcome | Refused | Run | ReserveHostPages | CopyPage | Collective | Result
    | Abort | Done | Failed | Stop
)  # fmt: skip
"""Every message either end sends."""


class ProtocolError(HeliosError):
    """A peer sent bytes that are not a message, or a message out of place."""


class PeerClosed(HeliosError):
    """The other end closed the connection."""


class PeerTimeout(HeliosError):
    """The other end sent nothing before the deadline."""


def encode_array(array: AnyArray) -> Array:
    contiguous = np.ascontiguousarray(array)
    return Array(contiguous.dtype.str, list(contiguous.shape), contiguous.tobytes())


def decode_array(array: Array) -> AnyArray:
    """The array (read-only, over the message's bytes); a ProtocolError when its parts disagree."""
    try:
        dtype = np.dtype(array.dtype)
    except TypeError as exc:
        raise ProtocolError(f"unknown dtype {array.dtype!r}") from exc
    if dtype.hasobject or any(extent < 0 for extent in array.shape):
        raise ProtocolError(f"an array of {array.dtype} {array.shape} cannot cross the wire")
    count = int(np.prod(array.shape, dtype=np.int64))
    if count * dtype.itemsize != len(array.data):
        raise ProtocolError(f"{len(array.data)} bytes do not hold {array.dtype} {array.shape}")
    return np.frombuffer(array.data, dtype=dtype).reshape(array.shape)


class Wire:
    """One TCP connection carrying length-prefixed msgpack messages; sends are serialized by a lock."""

    _encoder = msgspec.msgpack.Encoder()
    _decoder = msgspec.msgpack.Decoder(Message)

    def __init__(self, connection: socket.socket, peer: str) -> None:
        self.socket = connection
        self.peer = peer
        self._send_lock = threading.Lock()
        with contextlib.suppress(OSError):
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(connection)

    def send(self, message: Message) -> None:
        """Send one message; an OSError (TimeoutError among them) when the peer takes nothing for
        :data:`SEND_DEADLINE_S`."""
        body = self._encoder.encode(message)
        with self._send_lock:
            self.socket.settimeout(SEND_DEADLINE_S)
            self.socket.sendall(struct.pack(">I", len(body)) + body)

    def receive(self, deadline_s: float | None, *, max_bytes: int = MAX_FRAME_BYTES) -> Message:
        """The next message; PeerTimeout past ``deadline_s`` (None: wait as long as the connection lives),
        PeerClosed at the end of the stream, ProtocolError for a malformed frame or one over ``max_bytes``."""
        ends = None if deadline_s is None else time.monotonic() + deadline_s
        head = self._exactly(4, ends)
        if head == b"HTTP":
            raise ProtocolError(
                "the peer answered HTTP, not as a Helios leader or rank (an HTTP --port, not the --rank-listen "
                "address?)"
            )
        (length,) = struct.unpack(">I", head)
        if length > max_bytes:
            raise ProtocolError(f"a frame of {length} bytes is larger than the {max_bytes} accepted")
        body = self._exactly(length, ends)
        try:
            return self._decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"not a rank message: {exc}") from exc

    def _exactly(self, count: int, ends: float | None) -> bytes:
        buffer = bytearray(count)
        view = memoryview(buffer)
        received = 0
        while received < count:
            if ends is not None:
                remaining = ends - time.monotonic()
                if remaining <= 0:
                    raise PeerTimeout(f"{self.peer} sent nothing within the deadline")
                self.socket.settimeout(remaining)
            else:
                self.socket.settimeout(None)
            try:
                got = self.socket.recv_into(view[received:])
            except TimeoutError:
                raise PeerTimeout(f"{self.peer} sent nothing within the deadline") from None
            except OSError as exc:
                raise PeerClosed(f"the connection to {self.peer} failed: {exc.strerror or exc}") from exc
            if got == 0:
                raise PeerClosed(f"{self.peer} closed the connection")
            received += got
        return bytes(buffer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.socket.close()


def _keepalive(connection: socket.socket) -> None:
    """TCP keepalive: a peer whose host is gone is noticed within about half a minute even when idle."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _leader_proof(secret: bytes, rank_challenge: bytes, leader_challenge: bytes) -> bytes:
    return hmac.new(secret, _LEADER_LABEL + rank_challenge + leader_challenge, hashlib.sha256).digest()


def _rank_proof(secret: bytes, leader_challenge: bytes, rank_challenge: bytes, rank: int, digest: str) -> bytes:
    body = _RANK_LABEL + leader_challenge + rank_challenge + struct.pack(">I", rank) + digest.encode("ascii")
    return hmac.new(secret, body, hashlib.sha256).digest()


# ------------------------------------------------------------------------------------------------ the leader


class _Refusal(Exception):
    """A peer the leader does not join; ``reason`` is logged (and sent when the peer proved the secret)."""

    def __init__(self, reason: str, *, tell: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.tell = tell


def _handshake(wire: Wire, secret: bytes, digest: str, ranks: int, joined: Mapping[int, Wire]) -> int:
    """Authenticate one connecting peer; its rank, or a _Refusal."""
    try:
        hello = wire.receive(HANDSHAKE_DEADLINE_S, max_bytes=HANDSHAKE_FRAME_BYTES)
        if not isinstance(hello, Hello) or not _well_formed(hello):
            raise _Refusal("it did not open with a rank greeting", tell=False)
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        wire.send(LeaderProof(challenge, _leader_proof(secret, hello.challenge, challenge)))
    except (PeerClosed, PeerTimeout, ProtocolError, OSError) as exc:
        raise _Refusal(f"the handshake failed: {exc}", tell=False) from None
    try:
        answer = wire.receive(HANDSHAKE_DEADLINE_S, max_bytes=HANDSHAKE_FRAME_BYTES)
    except PeerClosed:
        raise _Refusal(
            f"a peer claiming rank {hello.rank} hung up on the leader's proof: it holds another secret "
            "(authentication failed)",
            tell=False,
        ) from None
    except (PeerTimeout, ProtocolError, OSError) as exc:
        raise _Refusal(f"the handshake failed: {exc}", tell=False) from None
    expected = _rank_proof(secret, challenge, hello.challenge, hello.rank, hello.contract)
    if not isinstance(answer, RankProof) or not hmac.compare_digest(answer.proof, expected):
        raise _Refusal("it does not hold the shared secret (authentication failed)", tell=False)
    if not 1 <= hello.rank < ranks:
        raise _Refusal(f"rank {hello.rank} is not one of the rank processes 1..{ranks - 1} of this core", tell=True)
    if hello.rank in joined:
        raise _Refusal(f"rank {hello.rank} has already joined", tell=True)
    if not hmac.compare_digest(hello.contract, digest):
        raise _Refusal(
            f"rank {hello.rank} loaded another core (contract digest {hello.contract[:16]}..., the leader's is "
            f"{digest[:16]}...)",
            tell=True,
        )
    return hello.rank


def _well_formed(hello: Hello) -> bool:
    """A greeting whose rank packs into four bytes, whose digest is SHA-256 hex and whose challenge is whole."""
    digits = set("0123456789abcdef")
    return (
        0 <= hello.rank < 1 << 32
        and len(hello.contract) == 64
        and set(hello.contract) <= digits
        and len(hello.challenge) == _CHALLENGE_BYTES
    )


_JOIN_POLL_S = 0.2
"""How often a leader waiting for rank processes looks whether the server was asked to stop."""


def gather_peers(settings: ProcessRankSettings, digest: str, ranks: int) -> dict[int, Wire]:
    """Listen on ``settings``'s address until ranks 1..ranks-1 have joined (authenticated, distinct, same
    core); a StartupError naming the missing ranks once ``join_timeout_s`` passed."""
    try:
        listener = socket.create_server((settings.host, settings.port), reuse_port=False)
    except OSError as exc:
        raise StartupError(f"cannot listen for rank processes on {settings.address}: {exc.strerror or exc}") from exc
    joined: dict[int, Wire] = {}
    ends = time.monotonic() + settings.join_timeout_s
    log.info("waiting for rank processes 1..%d at %s", ranks - 1, settings.address)
    try:
        while len(joined) < ranks - 1:
            remaining = ends - time.monotonic()
            if remaining <= 0:
                missing = ", ".join(str(rank) for rank in range(1, ranks) if rank not in joined)
                raise StartupError(
                    f"rank process{'es' if ranks - 1 - len(joined) > 1 else ''} {missing} did not join at "
                    f"{settings.address} within {settings.join_timeout_s:g} s (--rank-join-timeout)"
                )
            stop = settings.stop_joining
            if stop is not None and stop.is_set():
                raise JoinStopped("stopped while waiting for rank processes to join")
            # short waits while a stop may come: the server stops at once, not at the join deadline
            listener.settimeout(remaining if stop is None else min(remaining, _JOIN_POLL_S))
            try:
                connection, address = listener.accept()
            except TimeoutError:
                continue
            wire = Wire(connection, f"{address[0]}:{address[1]}")
            try:
                rank = _handshake(wire, settings.secret, digest, ranks, joined)
            except _Refusal as refusal:
                log.warning("refused a rank process from %s: %s", wire.peer, refusal.reason)
                if refusal.tell:
                    with contextlib.suppress(OSError):
                        wire.send(Refused(refusal.reason))
                wire.close()
                continue
            wire.peer = f"rank {rank} ({wire.peer})"
            joined[rank] = wire
            log.info("rank %d joined from %s", rank, address[0])
    except BaseException:
        for wire in joined.values():
            with contextlib.suppress(OSError):
                wire.send(Stop("the leader did not start"))
            wire.close()
        raise
    finally:
        listener.close()
    return joined


class LeaderCommunicator:
    """Rank 0's communicator: every collective meets the rank processes' arrays over their connections."""

    def __init__(self, group: ProcessRankedBackend) -> None:
        self._group = group

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return self._group.size

    def all_reduce(self, array: AnyArray) -> AnyArray:
        return self._group.collective("all_reduce", 0, array)

    def all_gather(self, array: AnyArray, axis: int) -> AnyArray:
        if not -array.ndim <= axis < array.ndim:
            raise RankError(0, f"all_gather axis {axis} is outside an array of {array.ndim} axes")
        return self._group.collective("all_gather", axis % array.ndim, array)

    def broadcast(self, array: AnyArray, root: int) -> AnyArray:
        if not 0 <= root < self.size:
            raise RankError(0, f"broadcast root {root} is outside [0, {self.size})")
        return self._group.collective("broadcast", root, array)

    def abort(self, reason: str) -> None:
        self._group.abort_round(0, reason)

    def reset(self) -> None:
        return None


class ProcessRankedBackend:
    """The runtime's backend over rank 0 (in this process) and the rank processes (see the module docstring).

    Every command to the peers (a round, a page copy, loading) runs under one lock: rank 0 acts while each
    peer does the same, then every peer's terminal reply is read (``Done`` or ``Failed``) so the next command
    starts with every connection idle."""

    def __init__(
        self, peers: Mapping[int, Wire], settings: ProcessRankSettings, *, collectives_on_device: bool = False
    ) -> None:
        self._peers = dict(sorted(peers.items()))
        self._collectives_on_device = collectives_on_device
        """The ranks' collectives run on their devices (CUDA): a failed command breaks the group."""
        self._settings = settings
        self._deadline_s = settings.deadline_s
        self.size = len(self._peers) + 1
        self.communicator = LeaderCommunicator(self)
        self._rank0: Any = None
        self._lock = threading.RLock()
        self._round = 0
        self._settled: set[int] = set()
        """Peers that sent their terminal reply of the current command."""
        self._aborted: set[int] = set()
        self._failure: RankError | None = None
        """The first failure of the current command (a failed round; the group stays usable)."""
        self._records: dict[int, dict[int, Mapping[int, AnyArray]]] = {}
        """Per frame: each peer's completion record of the frame's last round."""
        self._sent: dict[int, dict[str, bytes]] = {}
        """Per frame: the staged bytes each entry had when last sent."""
        self._broken: RankError | None = None
        self._closed = False
        self._monitor: threading.Thread | None = None

    # -- loading ----------------------------------------------------------------------------------------
    def load(self, build_rank0: Callable[[LeaderCommunicator], Any], welcome: Welcome) -> None:
        """Send every peer the geometry, build rank 0 while they build theirs (their tuning collectives meet
        rank 0's), and wait until each has loaded; a StartupError naming the rank that failed."""
        with self._lock:
            self._begin()
            try:
                self._broadcast_command(welcome)
                self._rank0 = self._on_rank0(build_rank0, "loading")
                self._collect(max(self._deadline_s, self._settings.join_timeout_s))
            except RankError as lost:  # a peer disconnected or missed the deadline while loading
                self._close_peers("a rank was lost while loading")
                if self._rank0 is not None:
                    self._rank0.close()
                raise StartupError(f"rank {lost.rank} was lost while loading: {lost}") from lost
            if self._failure is not None:
                failure = self._failure
                self._close_peers("a rank failed to load")
                if self._rank0 is not None:
                    self._rank0.close()
                raise StartupError(f"rank {failure.rank} failed to load: {failure}") from failure
        self._monitor = threading.Thread(target=self._watch, name="helios-rank-monitor", daemon=True)
        self._monitor.start()

    # -- the Backend protocol ---------------------------------------------------------------------------
    @property
    def leader(self) -> Any:
        """Rank 0's backend (the other ranks' live in their processes)."""
        return self._rank0

    def transport(self, frame: int) -> Mapping[str, AnyArray]:
        """Rank 0's staging: the packer writes it once; :meth:`run` sends what changed to every peer."""
        return self._rank0.transport(frame)  # type: ignore[no-any-return]

    def run(self, program: str, frame: int) -> None:
        """Run ``program`` on ``frame`` on every rank; a RankError naming the rank at fault."""
        with self._lock:
            self._check_usable()
            staged = self._rank0.transport(frame)
            sent = self._sent.setdefault(frame, {})
            entries: dict[str, Array] = {}
            for name, values in staged.items():
                data = np.ascontiguousarray(values).tobytes()
                if sent.get(name) != data:
                    entries[name] = Array(values.dtype.str, list(values.shape), data)
                    sent[name] = data
            self._begin()
            try:
                self._broadcast_command(Run(self._round, program, frame, entries))
            except RankError:
                self._sent.pop(frame, None)
                raise
            self._records.pop(frame, None)
            self._on_rank0(lambda _: self._rank0.run(program, frame), f"program {program!r}")
            records = self._collect(self._deadline_s)
            if self._failure is not None:
                self._sent.pop(frame, None)  # a failed round: send every entry next time
                self._fatal_on_device()
                raise self._failure
            for name, values in staged.items():  # what every rank's staging holds now
                sent[name] = np.ascontiguousarray(values).tobytes()
            self._records[frame] = {
                rank: {int(field): decode_array(array) for field, array in record.items()}
                for rank, record in records.items()
            }

    def completion(self, frame: int) -> Mapping[int, AnyArray]:
        """Rank 0's completion record."""
        return self._rank0.completion(frame)  # type: ignore[no-any-return]

    def rank_completions(self, frame: int) -> tuple[Mapping[int, AnyArray], ...]:
        """Every rank's completion record of the frame's last round, rank order."""
        records = self._records.get(frame)
        if records is None:
            raise RankError(1, f"the rank processes have no completion record of frame {frame}")
        return (self._rank0.completion(frame), *(records[rank] for rank in self._peers))

    def reserve_host_pages(self, count: int) -> None:
        self._command(ReserveHostPages(0, count), lambda backend: backend.reserve_host_pages(count), "host pages")

    def copy_page_to_host(self, page: int, slot: int) -> None:
        self._command(
            CopyPage(0, True, page, slot), lambda backend: backend.copy_page_to_host(page, slot), "a page copy"
        )

    def copy_page_to_device(self, slot: int, page: int) -> None:
        self._command(
            CopyPage(0, False, page, slot), lambda backend: backend.copy_page_to_device(slot, page), "a page copy"
        )

    def reserve_host_snapshots(self, count: int, rows: int) -> None:
        raise ValueError("rank processes keep no host tier of checkpoints; serve without --offload-checkpoints")

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        raise ValueError("rank processes keep no host tier of checkpoints")

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        raise ValueError("rank processes keep no host tier of checkpoints")

    def close(self) -> None:
        """Tell every peer to stop, close the connections, then close rank 0's backend."""
        with self._lock:
            self._closed = True
            self._close_peers("the leader is shutting down")
            rank0, self._rank0 = self._rank0, None
        if rank0 is not None:
            rank0.close()

    # -- collectives (rank 0's communicator) ------------------------------------------------------------
    def collective(self, operator: str, parameter: int, array: AnyArray) -> AnyArray:
        """Read every peer's array for ``operator``, combine them with rank 0's in rank order, send it back."""
        if self._failure is not None:
            raise RankError(self._failure.rank, f"rank 0 stopped: {self._failure}")
        arrays: list[AnyArray] = [array]
        for rank, wire in self._peers.items():
            message = self._receive(rank, wire, self._deadline_s)
            if isinstance(message, Failed):
                self._settle(rank, message)
                raise RankError(message.rank, f"rank 0 stopped: {message.message}")
            if not isinstance(message, Collective):
                self._fail(rank, f"rank {rank} sent {type(message).__name__} where rank 0 reached {operator}")
                raise RankError(rank, f"rank 0 stopped: {self._failure}")
            if message.operator != operator or message.parameter != parameter:
                self._fail(
                    rank,
                    f"rank {rank} reached {message.operator}({message.parameter}) where rank 0 reached "
                    f"{operator}({parameter})",
                )
                raise RankError(rank, f"rank 0 stopped: {self._failure}")
            other = self._decoded(rank, message.array)
            if operator != "broadcast" and (other.shape != array.shape or other.dtype != array.dtype):
                self._fail(
                    rank,
                    f"rank {rank} passed {operator} an array of {other.shape} {other.dtype}; rank 0 passed "
                    f"{array.shape} {array.dtype}",
                )
                raise RankError(rank, f"rank 0 stopped: {self._failure}")
            arrays.append(other)
        result = _combine(operator, parameter, arrays)
        encoded = Result(encode_array(result))
        for rank, wire in self._peers.items():
            self._send(rank, wire, encoded)
        result.flags.writeable = False
        return result

    def abort_round(self, rank: int, reason: str) -> None:
        """Rank ``rank`` failed the current command: every peer still inside it is told to stop."""
        if self._failure is None:
            self._failure = RankError(rank, reason)
        for peer, wire in self._peers.items():
            if peer not in self._settled and peer not in self._aborted:
                self._aborted.add(peer)
                self._send(peer, wire, Abort(self._round, rank, reason))

    # -- internals --------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed or self._rank0 is None:
            raise RankError(0, "the rank group is closed")

    def _begin(self) -> None:
        self._round += 1
        self._settled = set()
        self._aborted = set()
        self._failure = None

    def _command(self, message: ReserveHostPages | CopyPage, action: Callable[[Any], None], what: str) -> None:
        with self._lock:
            self._check_usable()
            self._begin()
            self._broadcast_command(msgspec.structs.replace(message, round=self._round))
            self._on_rank0(lambda _: action(self._rank0), what)
            self._collect(self._deadline_s)
            if self._failure is not None:
                self._fatal_on_device()
                raise self._failure

    def _broadcast_command(self, message: Message) -> None:
        for rank, wire in self._peers.items():
            self._send(rank, wire, message)

    def _on_rank0(self, action: Callable[[LeaderCommunicator], Any], what: str) -> Any:
        """Rank 0's part of a command; its own failure aborts the peers (kept as the command's failure)."""
        try:
            return action(self.communicator)
        except RankError as exc:
            if self._broken is not None:
                raise
            self.abort_round(exc.rank, str(exc))
        except Exception as exc:
            if self._broken is not None:
                raise
            self.abort_round(0, f"rank 0 failed {what}: {type(exc).__name__}: {exc}")
        return None

    def _collect(self, deadline_s: float) -> dict[int, dict[int, Array]]:
        """Every peer's terminal reply of the current command: the records of those that finished."""
        records: dict[int, dict[int, Array]] = {}
        for rank, wire in self._peers.items():
            while rank not in self._settled:
                message = self._receive(rank, wire, deadline_s)
                if isinstance(message, Done):
                    self._settled.add(rank)
                    records[rank] = message.record
                elif isinstance(message, Failed):
                    self._settle(rank, message)
                elif isinstance(message, Collective):  # a collective rank 0 never reached (it failed first)
                    if self._failure is None:
                        self._fail(rank, f"rank {rank} reached {message.operator} after rank 0 finished")
                    else:
                        self.abort_round(self._failure.rank, str(self._failure))
                else:
                    self._lose(rank, f"rank {rank} sent {type(message).__name__} where a reply was due")
        return records

    def _settle(self, rank: int, failed: Failed) -> None:
        self._settled.add(rank)
        if self._failure is None:
            self._failure = RankError(failed.rank, failed.message)
            self.abort_round(failed.rank, failed.message)

    def _fail(self, rank: int, reason: str) -> None:
        self.abort_round(rank, reason)

    def _decoded(self, rank: int, array: Array) -> AnyArray:
        try:
            return decode_array(array)
        except ProtocolError as exc:
            raise self._lose(rank, f"rank {rank} sent a malformed array: {exc}") from None

    def _receive(self, rank: int, wire: Wire, deadline_s: float) -> Message:
        try:
            return wire.receive(deadline_s)
        except PeerTimeout:
            raise self._lose(rank, f"rank {rank} did not answer within {deadline_s:g} s") from None
        except PeerClosed:
            raise self._lose(rank, f"rank {rank} disconnected (its process ended or its connection failed)") from None
        except ProtocolError as exc:
            raise self._lose(rank, f"rank {rank} broke the protocol: {exc}") from None

    def _send(self, rank: int, wire: Wire, message: Message) -> None:
        try:
            wire.send(message)
        except OSError as exc:
            raise self._lose(rank, f"rank {rank} disconnected ({exc.strerror or exc})") from None

    def _fatal_on_device(self) -> None:
        """A failed command of ranks whose collectives run on their devices breaks the group (raised)."""
        if self._collectives_on_device and self._failure is not None:
            raise self._lose(self._failure.rank, str(self._failure), reachable=True)

    def _lose(self, rank: int, reason: str, *, reachable: bool = False) -> RankError:
        """A peer is gone or late (or, ``reachable``, failed a command its collectives could not recover from):
        the group is broken for good; stop the others (and a reachable one) and report it once."""
        if self._broken is None:
            self._broken = RankError(rank, reason)
            log.error("%s; stopping every rank", reason)
            if self._collectives_on_device and self._rank0 is not None:  # its collectives may wait for the lost
                with contextlib.suppress(Exception):
                    self._rank0.abort_collectives()
            self._close_peers(f"rank {rank} was lost: {reason}", skip=None if reachable else rank)
            on_lost = self._settings.on_lost
            if on_lost is not None:
                broken = self._broken
                threading.Thread(target=on_lost, args=(broken,), name="helios-rank-lost", daemon=True).start()
        return self._broken

    def _close_peers(self, reason: str, *, skip: int | None = None) -> None:
        for rank, wire in self._peers.items():
            if rank != skip:
                with contextlib.suppress(OSError):
                    wire.send(Stop(reason))
            wire.close()

    def _watch(self) -> None:
        """Between commands no peer sends anything: readable data or the end of a stream means a peer left."""
        while not self._closed and self._broken is None:
            if not self._lock.acquire(timeout=MONITOR_INTERVAL_S):
                continue
            try:
                if self._closed or self._broken is not None:
                    return
                sockets = {wire.socket: rank for rank, wire in self._peers.items()}
                try:
                    readable, _, _ = select.select(list(sockets), [], [], 0)
                except (OSError, ValueError):
                    readable = list(sockets)
                for connection in readable:
                    rank = sockets[connection]
                    try:
                        peeked = connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        continue
                    except OSError:
                        peeked = b""
                    what = "disconnected" if not peeked else "sent a message while idle"
                    self._lose(rank, f"rank {rank} {what} (its process ended or its connection failed)")
                    return
            finally:
                self._lock.release()
            time.sleep(MONITOR_INTERVAL_S)


def load_process_ranks(
    contract: PreparedContract,
    core: CoreFile,
    ranks: int,
    settings: ProcessRankSettings,
    *,
    cache_pages: int,
    state_rows: int,
    frames: int,
    snapshot_rows: int,
    cuda_context: Any = None,
) -> ProcessRankedBackend:
    """Wait for the rank processes, then load rank 0 here while each loads its own rank: reference backends,
    or with ``cuda_context`` (rank 0's GPU, taken over) CUDA backends joined by one NCCL group."""
    try:
        peers = gather_peers(settings, contract_digest(contract), ranks)
    except BaseException:
        if cuda_context is not None:
            cuda_context.close()
        raise
    backend = ProcessRankedBackend(peers, settings, collectives_on_device=cuda_context is not None)
    welcome = Welcome(ranks, cache_pages, state_rows, frames, snapshot_rows, settings.deadline_s)
    if cuda_context is None:
        from helios_core.backends.reference import ReferenceBackend

        def build(communicator: LeaderCommunicator) -> Any:
            return ReferenceBackend(
                contract, core, cache_pages=cache_pages, state_rows=state_rows, frames=frames,
                snapshot_rows=snapshot_rows, rank=0, communicator=communicator,
            )  # fmt: skip

    else:
        from helios_core.backends.nccl import load_library

        try:
            nccl_id = load_library().unique_id()
        except BaseException:
            backend.close()
            cuda_context.close()
            raise
        welcome = msgspec.structs.replace(welcome, backend="cuda", nccl_id=nccl_id)

        def build(communicator: LeaderCommunicator) -> Any:
            return cuda_rank_backend(contract, core, welcome, 0, cuda_context)

    backend.load(build, welcome)
    return backend


def cuda_rank_backend(contract: PreparedContract, core: CoreFile, welcome: Welcome, rank: int, context: Any) -> Any:
    """Rank ``rank``'s CUDA backend on ``context`` (taken over) with the geometry of ``welcome``, joining its
    NCCL group (returns once every rank has joined); a StartupError naming what failed."""
    ranks = welcome.ranks
    from helios_core.backends.cuda import CudaBackend
    from helios_core.backends.nccl import NcclCommunicator, NcclError, load_library

    try:
        context.make_current()
        communicator = NcclCommunicator.joined(load_library(), ranks, welcome.nccl_id, rank)
    except NcclError as exc:
        context.close()
        raise StartupError(f"rank {rank} could not join the NCCL group of {ranks} ranks: {exc}") from exc
    except BaseException:
        context.close()
        raise
    return CudaBackend(
        contract, core, cache_pages=welcome.cache_pages, state_rows=welcome.state_rows, frames=welcome.frames,
        snapshot_rows=welcome.snapshot_rows, context=context, communicator=communicator, rank=rank,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ a rank process


class LeaderGone(HeliosError):
    """The leader closed the connection or stopped answering (the rank process ends)."""


class StoppedByLeader(Exception):
    """The leader said stop (the rank process ends normally)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RankSideCommunicator:
    """A rank process's communicator: each collective sends its array to the leader and reads the result."""

    def __init__(self, peer: RankPeer) -> None:
        self._peer = peer

    @property
    def rank(self) -> int:
        return self._peer.rank

    @property
    def size(self) -> int:
        return self._peer.size

    def all_reduce(self, array: AnyArray) -> AnyArray:
        return self._peer.collective("all_reduce", 0, array)

    def all_gather(self, array: AnyArray, axis: int) -> AnyArray:
        if not -array.ndim <= axis < array.ndim:
            raise RankError(self.rank, f"all_gather axis {axis} is outside an array of {array.ndim} axes")
        return self._peer.collective("all_gather", axis % array.ndim, array)

    def broadcast(self, array: AnyArray, root: int) -> AnyArray:
        if not 0 <= root < self.size:
            raise RankError(self.rank, f"broadcast root {root} is outside [0, {self.size})")
        return self._peer.collective("broadcast", root, array)

    def abort(self, reason: str) -> None:
        return None  # the failure reaches the leader as this rank's reply to the command

    def reset(self) -> None:
        return None


class RankPeer:
    """A joined rank process: its connection to the leader, its backend, and the command loop."""

    def __init__(self, wire: Wire, rank: int, welcome: Welcome, address: str) -> None:
        self.wire = wire
        self.rank = rank
        self.size = welcome.ranks
        self.welcome = welcome
        self.address = address
        self.backend: Any = None
        self._round = 0

    def collective(self, operator: str, parameter: int, array: AnyArray) -> AnyArray:
        self._send(Collective(operator, parameter, encode_array(array)))
        while True:
            message = self._receive(2 * self.welcome.deadline_s)  # the leader's deadline for a late peer first
            if isinstance(message, Result):
                try:
                    return decode_array(message.array)
                except ProtocolError as exc:
                    raise LeaderGone(f"the leader at {self.address} sent a malformed result: {exc}") from None
            if isinstance(message, Abort):
                if message.round != self._round:
                    continue  # an earlier command's abort, read late
                raise RankError(message.rank, f"rank {self.rank} stopped: {message.reason}")
            if isinstance(message, Stop):
                raise StoppedByLeader(message.reason)
            raise LeaderGone(f"the leader at {self.address} sent {type(message).__name__} during {operator}")

    def load(self, build: Callable[[RankSideCommunicator], Any]) -> None:
        """Build this rank's backend (its tuning collectives meet the other ranks'), then say so."""
        self._round = 1
        self.backend = self._act(lambda: build(RankSideCommunicator(self)), "loading")
        if self.backend is not None:
            self._send(Done({}))

    def serve(self) -> str:
        """Execute the leader's commands until it says stop: the reason it gave. LeaderGone when it vanished."""
        try:
            return self._command_loop()
        except StoppedByLeader as stop:  # said while this rank was inside a collective
            return stop.reason

    def _command_loop(self) -> str:
        while True:
            message = self._receive(None)
            if isinstance(message, Stop):
                return message.reason
            if isinstance(message, Abort | Result):
                continue  # the tail of a command this rank already answered
            if isinstance(message, Run):
                self._round = message.round
                self._run(message)
            elif isinstance(message, ReserveHostPages | CopyPage):
                self._round = message.round
                if self._act(partial(self._pages, message), "a page command") is not None:
                    self._send(Done({}))
            else:
                raise LeaderGone(f"the leader at {self.address} sent an unexpected {type(message).__name__}")

    def _pages(self, message: ReserveHostPages | CopyPage) -> bool:
        if isinstance(message, ReserveHostPages):
            self.backend.reserve_host_pages(message.count)
        elif message.to_host:
            self.backend.copy_page_to_host(message.page, message.slot)
        else:
            self.backend.copy_page_to_device(message.slot, message.page)
        return True

    def _run(self, message: Run) -> None:
        def execute() -> bool:
            staging = self.backend.transport(message.frame)
            for name, array in message.entries.items():
                if name not in staging:
                    raise ProtocolError(f"staged entry {name!r} is not in this rank's transport")
                staging[name][...] = decode_array(array)
            self.backend.run(message.program, message.frame)
            return True

        if self._act(execute, f"program {message.program!r}") is None:
            return
        record = self.backend.completion(message.frame)
        self._send(Done({int(field): encode_array(np.asarray(values)) for field, values in record.items()}))

    def _act(self, action: Callable[[], Any], what: str) -> Any:
        """``action()``; its failure is sent to the leader as this rank's reply (None is returned then)."""
        try:
            return action()
        except (StoppedByLeader, LeaderGone):
            raise
        except RankError as exc:
            self._send(Failed(exc.rank, str(exc)))
        except Exception as exc:
            self._send(Failed(self.rank, f"rank {self.rank} failed {what}: {type(exc).__name__}: {exc}"))
        return None

    def _send(self, message: Message) -> None:
        try:
            self.wire.send(message)
        except OSError as exc:
            raise LeaderGone(f"the connection to the leader at {self.address} failed: {exc.strerror or exc}") from None

    def _receive(self, deadline_s: float | None) -> Message:
        try:
            return self.wire.receive(deadline_s)
        except PeerClosed:
            raise LeaderGone(f"the leader at {self.address} closed the connection") from None
        except PeerTimeout:
            raise LeaderGone(f"the leader at {self.address} sent nothing within {deadline_s:g} s") from None
        except ProtocolError as exc:
            raise LeaderGone(f"the leader at {self.address} broke the protocol: {exc}") from None


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """Connect, retrying while the leader is not listening yet, until ``timeout_s``."""
    ends = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(min(ends - time.monotonic(), 5.0), 0.1))
        except OSError as exc:
            if time.monotonic() >= ends:
                raise StartupError(
                    f"cannot reach the leader at {host}:{port} within {timeout_s:g} s: {exc.strerror or exc}"
                ) from exc
            time.sleep(0.1)


def join_leader(
    host: str, port: int, rank: int, secret: bytes, digest: str, *, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
) -> RankPeer:
    """Connect to the leader, authenticate both ways, and receive its geometry: the joined peer.
    A StartupError when the leader cannot be reached, does not prove the secret or refuses this rank."""
    address = f"{host}:{port}"
    wire = Wire(_connect(host, port, timeout_s), f"the leader at {address}")
    try:
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        wire.send(Hello(rank, digest, challenge))
        answer = wire.receive(HANDSHAKE_DEADLINE_S, max_bytes=HANDSHAKE_FRAME_BYTES)
        if isinstance(answer, Refused):
            raise StartupError(f"the leader at {address} refused rank {rank}: {answer.reason}")
        if not isinstance(answer, LeaderProof) or len(answer.challenge) != _CHALLENGE_BYTES:
            raise StartupError(f"the peer at {address} is not a Helios leader")
        if not hmac.compare_digest(answer.proof, _leader_proof(secret, challenge, answer.challenge)):
            raise StartupError(
                f"the leader at {address} does not hold the shared secret (authentication failed); check "
                "--rank-secret-file"
            )
        wire.send(RankProof(_rank_proof(secret, answer.challenge, challenge, rank, digest)))
        try:
            welcome = wire.receive(None)  # the leader sends it once every rank has joined
        except PeerClosed:
            raise StartupError(
                f"the leader at {address} closed the connection before serving (a wrong rank or core is refused "
                "there; its log says why)"
            ) from None
        if isinstance(welcome, Refused):
            raise StartupError(f"the leader at {address} refused rank {rank}: {welcome.reason}")
        if isinstance(welcome, Stop):
            raise StartupError(f"the leader at {address} stopped before serving: {welcome.reason}")
        if not isinstance(welcome, Welcome):
            raise StartupError(f"the leader at {address} sent {type(welcome).__name__} instead of its geometry")
    except PeerClosed:
        wire.close()
        raise StartupError(
            f"the leader at {address} closed the connection during the handshake (a peer without the shared secret "
            "is refused there; its log says why)"
        ) from None
    except (PeerTimeout, ProtocolError, OSError) as exc:
        wire.close()
        raise StartupError(f"the handshake with the leader at {address} failed: {exc}") from None
    except BaseException:
        wire.close()
        raise
    return RankPeer(wire, rank, welcome, address)


@contextlib.contextmanager
def closing_peer(peer: RankPeer) -> Iterator[RankPeer]:
    """Close the peer's backend and connection however its serving ends (a CUDA rank aborts its NCCL
    communicator first: its collectives may wait for a rank that is gone)."""
    try:
        yield peer
    finally:
        if peer.backend is not None:
            with contextlib.suppress(Exception):
                abort = getattr(peer.backend, "abort_collectives", None)
                if abort is not None:
                    abort()
            with contextlib.suppress(Exception):
                peer.backend.close()
        peer.wire.close()


def run_rank_process(
    contract: PreparedContract,
    core: CoreFile,
    host: str,
    port: int,
    rank: int,
    secret: bytes,
    *,
    timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    announce: Callable[[str], None] = lambda line: None,
    device: int | None = None,
) -> str:
    """Join the leader as ``rank``, load, serve its commands: the reason the leader gave for stopping.
    LeaderGone when the leader vanished; StartupError when joining or loading failed. A leader on the CUDA
    backend has this rank run on GPU ``device`` (None: the rank's number modulo the GPUs visible)."""
    from helios_core.backends.reference import ReferenceBackend

    if contract.ranks <= 1:
        raise StartupError("the core has one rank: it runs in the serving process alone, with no rank processes")
    if not 1 <= rank < contract.ranks:
        raise StartupError(f"--rank {rank} is not one of the core's rank processes 1..{contract.ranks - 1}")
    peer = join_leader(host, port, rank, secret, contract_digest(contract), timeout_s=timeout_s)
    with closing_peer(peer):
        welcome = peer.welcome
        if welcome.ranks != contract.ranks:
            raise StartupError(f"the leader runs {welcome.ranks} ranks; the core has {contract.ranks}")
        announce(f"joined the leader at {peer.address} as rank {rank} of {welcome.ranks} ({welcome.backend})")

        def build(communicator: RankSideCommunicator) -> Any:
            if welcome.backend == "cuda":
                from helios_core.backends.cuda_driver import CudaUnavailableError, device_count, open_context

                chosen = rank % max(device_count(), 1) if device is None else device
                try:
                    context = open_context(chosen)
                except CudaUnavailableError as exc:
                    raise StartupError(f"the leader runs the CUDA backend; this rank has no GPU ({exc})") from exc
                return cuda_rank_backend(contract, core, welcome, rank, context)
            if welcome.backend != "reference":
                raise StartupError(f"the leader runs backend {welcome.backend!r}, which a rank process cannot run")
            return ReferenceBackend(
                contract, core, cache_pages=welcome.cache_pages, state_rows=welcome.state_rows,
                frames=welcome.frames, snapshot_rows=welcome.snapshot_rows, rank=rank, communicator=communicator,
            )  # fmt: skip

        try:
            peer.load(build)
            if peer.backend is None:
                return peer.serve()  # the leader stops every rank after a failed load
            announce(f"rank {rank} loaded; serving")
            return peer.serve()
        except StoppedByLeader as stop:
            return stop.reason
