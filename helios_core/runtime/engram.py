"""Engram staging: host-resident hashed n-gram tables and their two host staging frames.

Owns, for a core that declares Engram tables (``ExecutionManifest.engram_tables``), the host copy of each
table (read once at load from its WEIGHTS resource, with its optional input-id compression table), the
hash that addresses it, and the frames its gathered rows are staged in.

Hash (per table, per packed token at position ``p`` of its request): the input ids ``t_{-i}`` at positions
``p - i`` for ``i = 0 .. max_order - 1`` (each mapped through the compression table when the table has one;
``pad_id``, never compressed, before the start of the context). For each order ``n = 2 .. max_order``,
``mix_n = XOR over i < n of t_{-i} * m_i`` in wrapping int64 arithmetic, and for each head ``h`` of that
order ``row = mix_n mod prime_{n,h}`` (the non-negative remainder), offset by the rows of the (order, head)
bands before it (``primes`` order: order-major). A packed token gathers ``(max_order - 1) x heads`` rows,
concatenated in that order into one row of the destination; packed rows past the round's tokens are zero.

Frames: the destination is a transport entry, so staging frame ``k`` is the staging of execution frame
``k`` and reaches the program the way every transport entry does (the reference backend binds the frame's
arrays; the CUDA backend copies the frame's staging to the device at the start of the graph). Frame ``k``
is refilled only after every participating rank retired the round that read it: :meth:`EngramStaging.acquire`
takes a free frame for a round, :meth:`EngramStaging.retire` records that one rank's consumer finished (its
completion record was read), and the frame is free again once every rank retired it. Acquiring a frame
some rank has not retired raises :class:`EngramFrameBusy`: the rows a rank may still read are never
overwritten. :meth:`EngramStaging.release` frees a frame whose round never ran or failed (nothing reads it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from helios_core.container.reader import CoreFile
from helios_core.contract import PreparedContract
from helios_core.dtypes import NUMPY_DTYPES
from helios_core.errors import HeliosError, StartupError
from helios_core.runtime.packing import Lane, LaneBatch
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

__all__ = [
    "EngramFrameBusy",
    "EngramStaging",
    "EngramStagingError",
    "HostEngramTable",
    "engram_rows",
    "load_engram",
]

Ids = npt.NDArray[np.int64]


class EngramStagingError(HeliosError):
    """A staging frame was used against its rules (retired twice, by an unknown rank, or never acquired)."""


class EngramFrameBusy(EngramStagingError):
    """A staging frame was to be refilled while some rank may still read the rows staged in it."""


@dataclass(frozen=True)
class EngramHash:
    """The addressing of one table: orders 2..max_order, heads per order, primes, multipliers, pad id."""

    max_order: int
    heads_per_order: int
    primes: tuple[int, ...]
    multipliers: tuple[int, ...]
    pad_id: int

    @property
    def gathered(self) -> int:
        """Rows one packed token gathers."""
        return (self.max_order - 1) * self.heads_per_order

    @property
    def band_starts(self) -> tuple[int, ...]:
        """First table row of each (order, head) band, in ``primes`` order."""
        starts, total = [], 0
        for prime in self.primes:
            starts.append(total)
            total += prime
        return tuple(starts)


def engram_rows(hash_: EngramHash, contexts: Ids) -> Ids:
    """Table rows ``[T, gathered]`` of ``contexts`` ``[T, max_order]`` (column ``i``: the id ``i`` tokens back,
    already compressed or the pad id)."""
    contexts = np.ascontiguousarray(contexts, dtype=np.int64)
    multipliers = np.asarray(hash_.multipliers, dtype=np.int64)
    with np.errstate(over="ignore"):
        products = contexts * multipliers  # wrapping int64
    starts = hash_.band_starts
    rows = np.empty((contexts.shape[0], hash_.gathered), dtype=np.int64)
    mix = products[:, 0].copy()
    column = 0
    for order in range(2, hash_.max_order + 1):
        mix ^= products[:, order - 1]
        for _head in range(hash_.heads_per_order):
            prime = np.int64(hash_.primes[column])
            rows[:, column] = np.mod(mix, prime) + starts[column]
            column += 1
    return rows


@dataclass(frozen=True)
class HostEngramTable:
    """One table in host memory: its rows, its compression table and its hash."""

    name: str
    destination: str
    rows: npt.NDArray[Any]
    """``[table_rows, row_width]`` (float32, or bfloat16 bit patterns as uint16)."""
    compression: npt.NDArray[np.int64] | None
    hash: EngramHash

    @classmethod
    def of(
        cls, table: mf.EngramTable, rows: npt.NDArray[Any], compression: npt.NDArray[np.int64] | None
    ) -> HostEngramTable:
        return cls(
            table.name,
            table.buffer,
            rows,
            compression,
            EngramHash(
                table.max_order,
                table.heads_per_order,
                tuple(int(p) for p in table.primes),
                tuple(int(m) for m in table.multipliers),
                int(table.pad_id),
            ),
        )

    def gather(self, windows: Ids) -> npt.NDArray[Any]:
        """Rows ``[T, gathered x row_width]`` of the packed tokens whose input-id windows are ``windows``
        (``[T, max_order]``, column ``i`` the raw id ``i`` tokens back, -1 before the start)."""
        before = windows < 0
        hashed = windows.copy()
        if self.compression is not None:
            hashed[~before] = self.compression[windows[~before]]
        hashed[before] = self.hash.pad_id
        rows = engram_rows(self.hash, hashed)
        return self.rows[rows].reshape(windows.shape[0], self.hash.gathered * self.rows.shape[1])


@dataclass
class _Frame:
    sequence: int = -1
    """The round holding the frame (-1: free)."""
    retired: frozenset[int] = frozenset()


class EngramStaging:
    """The Engram tables of a loaded core and their two staging frames (see the module docstring)."""

    def __init__(self, tables: Sequence[HostEngramTable], *, participants: int = 1, frames: int = 2) -> None:
        if participants < 1:
            raise ValueError(f"participants must be positive, not {participants}")
        self.tables = tuple(tables)
        self.participants = participants
        self.window = max(t.hash.max_order for t in self.tables) if self.tables else 1
        self._frames = [_Frame() for _ in range(frames)]

    @property
    def frames(self) -> int:
        return len(self._frames)

    def held_by(self, frame: int) -> int:
        """The round (its submission sequence) holding ``frame``; -1 when it is free."""
        return self._frame(frame).sequence

    def unretired(self, frame: int) -> tuple[int, ...]:
        """The ranks that have not retired the round holding ``frame`` (none when it is free)."""
        state = self._frame(frame)
        if state.sequence < 0:
            return ()
        return tuple(r for r in range(self.participants) if r not in state.retired)

    def acquire(self, frame: int, sequence: int) -> None:
        """Take ``frame`` for the round ``sequence``; raises :class:`EngramFrameBusy` while any rank has not
        retired the round that read it before."""
        state = self._frame(frame)
        if state.sequence >= 0:
            raise EngramFrameBusy(
                f"Engram staging frame {frame} cannot be refilled for round {sequence}: round {state.sequence} "
                f"staged in it is not retired by rank(s) {list(self.unretired(frame))}"
            )
        state.sequence = sequence
        state.retired = frozenset()

    def retire(self, frame: int, rank: int) -> bool:
        """Rank ``rank``'s consumer of ``frame`` finished; True when every rank has (the frame is free)."""
        state = self._frame(frame)
        if not 0 <= rank < self.participants:
            raise EngramStagingError(f"rank {rank} does not take part in Engram staging ({self.participants} ranks)")
        if state.sequence < 0:
            raise EngramStagingError(
                f"Engram staging frame {frame} is not held by any round; rank {rank} cannot retire it"
            )
        if rank in state.retired:
            raise EngramStagingError(
                f"rank {rank} already retired round {state.sequence} of Engram staging frame {frame}"
            )
        state.retired = state.retired | {rank}
        if len(state.retired) == self.participants:
            state.sequence = -1
            state.retired = frozenset()
            return True
        return False

    def release(self, frame: int) -> None:
        """Free ``frame`` whose round never ran or failed (no rank reads it any more)."""
        state = self._frame(frame)
        state.sequence = -1
        state.retired = frozenset()

    def fill(
        self,
        frame: int,
        sequence: int,
        staging: Mapping[str, npt.NDArray[Any]],
        windows: Ids,
    ) -> None:
        """Write every table's rows of the packed tokens whose input-id windows are ``windows`` (``[T,
        window]``: column ``i`` the id ``i`` tokens back, -1 before the start) into ``frame``'s destination,
        which round ``sequence`` must hold."""
        state = self._frame(frame)
        if state.sequence != sequence:
            raise EngramStagingError(
                f"Engram staging frame {frame} is held by round {state.sequence}, not {sequence}; acquire it first"
            )
        count = windows.shape[0]
        for table in self.tables:
            dest = staging[table.destination]
            if count > dest.shape[0]:
                raise EngramStagingError(
                    f"Engram table {table.name!r}: {count} packed tokens exceed its {dest.shape[0]} staged rows"
                )
            dest[:count] = table.gather(windows[:, : table.hash.max_order])
            dest[count:] = 0

    def stage(
        self,
        frame: int,
        sequence: int,
        staging: Mapping[str, npt.NDArray[Any]],
        lanes: Sequence[Lane] | LaneBatch,
        tokens: npt.NDArray[np.integer[Any]],
    ) -> None:
        """Acquire ``frame`` for round ``sequence`` and fill it with the rows of ``lanes``' packed tokens;
        ``tokens`` is the slot table's ``[slots, context]`` input ids (the history before each lane's first
        packed token). A fill that raises frees the frame again."""
        self.acquire(frame, sequence)
        try:
            self.fill(frame, sequence, staging, packed_windows(lanes, tokens, self.window))
        except BaseException:
            self.release(frame)
            raise

    def _frame(self, frame: int) -> _Frame:
        if not 0 <= frame < len(self._frames):
            raise EngramStagingError(f"Engram staging has {len(self._frames)} frames; there is no frame {frame}")
        return self._frames[frame]


def packed_windows(lanes: Sequence[Lane] | LaneBatch, tokens: npt.NDArray[np.integer[Any]], window: int) -> Ids:
    """``[T, window]`` input ids of a round's packed tokens in packing order: column ``i`` the id ``i``
    tokens back (-1 before the start of the context). A lane's own packed tokens are its host-fed tokens
    (the slot table's ids at its positions when it has none); earlier positions come from the slot table."""
    if isinstance(lanes, LaneBatch):
        slots = np.repeat(
            np.asarray(lanes.rows[ct.VALUE_SOURCE_SLOT], dtype=np.int64),
            np.asarray(lanes.rows[ct.VALUE_SOURCE_QUERY_LENGTH], dtype=np.int64),
        )
        positions = np.asarray(lanes.tokens[ct.VALUE_SOURCE_PROMPT_POSITIONS], dtype=np.int64)
        back = positions[:, None] - np.arange(window, dtype=np.int64)[None, :]
        windows = np.where(back >= 0, tokens[slots[:, None], np.maximum(back, 0)], -1).astype(np.int64)
        for source in (ct.VALUE_SOURCE_PENDING_TOKEN, ct.VALUE_SOURCE_PROMPT_TOKENS):
            fed = lanes.tokens.get(source)
            if fed is not None:
                windows[:, 0] = np.asarray(fed, dtype=np.int64)
        return windows
    parts: list[Ids] = []
    for lane in lanes:
        if not lane.positions:
            continue
        start = int(lane.positions[0])
        count = len(lane.positions)
        own = (
            np.asarray(lane.tokens, dtype=np.int64)
            if len(lane.tokens) == count
            else np.asarray(tokens[lane.slot, start : start + count], dtype=np.int64)
        )
        history = np.asarray(tokens[lane.slot, max(start - (window - 1), 0) : start], dtype=np.int64)
        padded = np.concatenate([np.full(window - 1 - history.shape[0], -1, dtype=np.int64), history, own])
        # row k: the ids ending at own token k, newest first
        view = np.lib.stride_tricks.sliding_window_view(padded, window)[:count]
        parts.append(view[:, ::-1])
    if not parts:
        return np.empty((0, window), dtype=np.int64)
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.int64)


def load_engram(contract: PreparedContract, core: CoreFile, *, participants: int = 1) -> EngramStaging | None:
    """The core's Engram tables read from their resources (None when it declares none); the contract
    checked every size, so a resource that reads otherwise is a StartupError."""
    declared = list(contract.execution.engram_tables)
    if not declared:
        return None
    tables = []
    vocabulary = contract.model.input_vocabulary.size
    for table in declared:
        dtype = NUMPY_DTYPES[table.dtype]
        data = core.read_resource(table.resource_id, cb.RESOURCE_KIND_WEIGHTS)
        rows = np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        rows = rows.reshape(int(table.table_rows), int(table.row_width))
        compression = None
        if table.compression_resource_id:
            mapped = core.read_resource(table.compression_resource_id, cb.RESOURCE_KIND_WEIGHTS)
            compression = np.frombuffer(mapped, dtype="<i4").astype(np.int64)
            if compression.shape[0] != vocabulary or (compression.shape[0] and int(compression.min()) < 0):
                raise StartupError(
                    f"Engram table {table.name!r}: the compression table must map each of {vocabulary} ids to a "
                    "non-negative id"
                )
        tables.append(HostEngramTable.of(table, rows, compression))
    return EngramStaging(tables, participants=participants, frames=max(contract.execution.transport.frames, 1))
