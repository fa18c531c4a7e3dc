"""The counts that the HTTP processes of one server share (``helios run --http-processes N``).

Owns :class:`ServerTally`: one small shared-memory table, a row per HTTP process, of what an HTTP process
counts itself and the whole server must see as one figure: the admission permits held (the 429 bound is
``queue_capacity + max_active`` over all the processes), the permits whose generation ended (the load
gauges' undelivered responses), the requests each process admitted and refused (429), and the output
failures by the finish reason the worker counted (moved from finished to failed in ``/metrics``). Whichever
process answers a scrape reads every row, so its figures are the server's.

The table is an anonymous memory file (``memfd``, or an unnamed temporary file where there is none) that
``helios run`` creates; each other HTTP process receives a duplicate of its descriptor when it is spawned
(:meth:`ServerTally.share`), and nothing is left on any file system. A process writes its own row only.
Taking a permit reads every row's permits and adds one to its own as one step, under an exclusive record
lock on the file (``fcntl.lockf``) and a thread lock: two processes can never both take the last permit.
The kernel releases a record lock when its process dies, so a process killed inside that step blocks no
other. Each cell is one aligned 64-bit integer: a reader sees a value whole. When a process dies, the
supervisor clears its permits (:meth:`ServerTally.forget`); its counters stay, as counters do. Once a
process closed its view (at its exit) the view counts nothing more and reads zeros.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.reduction import DupFd
from typing import Any, get_args

from helios_core.runtime.messages import FinishReason

__all__ = ["FAILURE_REASONS", "ServerTally", "TallyShare"]

FAILURE_REASONS: tuple[str, ...] = get_args(FinishReason)
"""The finish reasons an output failure can be moved from (every reason the worker finishes with)."""

_HELD, _ENDED, _ADMITTED, _REFUSED = 0, 1, 2, 3
_FAILED = 4
"""Column of the first output-failure count (one column per :data:`FAILURE_REASONS` entry)."""
_COLUMNS = _FAILED + len(FAILURE_REASONS)
_CELL_BYTES = 8


class TallyShare:
    """A :class:`ServerTally`'s file as it travels to a spawned HTTP process (its descriptor is duplicated
    into the child while the process is started; pickling it anywhere else is refused)."""

    def __init__(self, fd: int, processes: int) -> None:
        self.fd = fd
        self.processes = processes

    def __reduce__(self) -> tuple[Any, tuple[Any, int]]:
        return _rebuild_share, (DupFd(self.fd), self.processes)


def _rebuild_share(duplicate: Any, processes: int) -> TallyShare:
    return TallyShare(duplicate.detach(), processes)


class ServerTally:
    """One HTTP process's view of the shared table (see the module docstring)."""

    def __init__(self, fd: int, processes: int, index: int) -> None:
        if processes < 1 or not 0 <= index < processes:
            raise ValueError(f"HTTP process {index} of {processes} is not a row of the table")
        self.processes = processes
        self.index = index
        self._fd = fd
        self._map = mmap.mmap(fd, processes * _COLUMNS * _CELL_BYTES)
        self._cells = memoryview(self._map).cast("q")
        self._row = index * _COLUMNS
        self._local = threading.Lock()

    @classmethod
    def create(cls, processes: int) -> ServerTally:
        """A new zeroed table for ``processes`` HTTP processes; this process is the first (index 0)."""
        try:
            fd = os.memfd_create("helios-server-tally", os.MFD_CLOEXEC)
        except (AttributeError, OSError):  # no memfd here: an unnamed temporary file
            with tempfile.TemporaryFile() as unnamed:
                fd = os.dup(unnamed.fileno())  # the duplicate outlives the file object
        try:
            os.ftruncate(fd, processes * _COLUMNS * _CELL_BYTES)
            return cls(fd, processes, 0)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, share: TallyShare, index: int) -> ServerTally:
        """HTTP process ``index``'s view of the table ``share`` names (in a spawned process)."""
        return cls(share.fd, share.processes, index)

    def share(self) -> TallyShare:
        """What a spawned HTTP process attaches with (pass it among the process's arguments)."""
        return TallyShare(self._fd, self.processes)

    def close(self) -> None:
        """Unmap the table and close this process's descriptor (idempotent)."""
        with self._local:
            if self._fd < 0:
                return
            self._cells.release()
            self._map.close()
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[bool]:
        """No other thread of this process and no other process in the table meanwhile; yields False
        (and locks nothing) once the view is closed."""
        with self._local:
            if self._fd < 0:
                yield False
                return
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _add(self, column: int, count: int) -> None:
        """``count`` more in this process's ``column``."""
        with self._local:
            if self._fd >= 0:
                self._cells[self._row + column] += count

    def _column(self, column: int) -> int:
        with self._local:
            if self._fd < 0:
                return 0
            cells = self._cells
            return sum(cells[row * _COLUMNS + column] for row in range(self.processes))

    # -- admission permits ------------------------------------------------------------------------
    def take_permit(self, capacity: int) -> bool:
        """Take one of the server's ``capacity`` permits for this process; False when all are held."""
        with self._exclusive() as open_:
            if not open_:
                return False
            cells, row = self._cells, self._row
            if sum(cells[other * _COLUMNS + _HELD] for other in range(self.processes)) >= capacity:
                return False
            cells[row + _HELD] += 1
            cells[row + _ADMITTED] += 1
        return True

    def return_permit(self) -> None:
        self._add(_HELD, -1)

    def add_refused(self) -> None:
        """One request this process refused because every permit was held (a 429)."""
        self._add(_REFUSED, 1)

    def refused(self) -> int:
        """Requests refused over the whole server because every permit was held."""
        return self._column(_REFUSED)

    def add_ended(self, count: int) -> None:
        """``count`` (1 or -1) more of this process's permits whose generation ended."""
        self._add(_ENDED, count)

    def held(self) -> int:
        """Permits held over the whole server."""
        return self._column(_HELD)

    def ended(self) -> int:
        """Permits over the whole server whose generation ended while the response is delivered."""
        return self._column(_ENDED)

    def admitted(self) -> list[int]:
        """Requests each HTTP process admitted so far, by process index."""
        with self._local:
            if self._fd < 0:
                return [0] * self.processes
            cells = self._cells
            return [cells[row * _COLUMNS + _ADMITTED] for row in range(self.processes)]

    def forget(self, index: int) -> None:
        """HTTP process ``index`` died: its permits are no longer held (its counters stay)."""
        if not 0 <= index < self.processes:
            raise ValueError(f"HTTP process {index} of {self.processes} is not a row of the table")
        row = index * _COLUMNS
        with self._exclusive() as open_:
            if open_:
                self._cells[row + _HELD] = 0
                self._cells[row + _ENDED] = 0

    # -- output failures --------------------------------------------------------------------------
    def record_output_failure(self, reason: str) -> None:
        """One output failure in this process of a request the worker finished with ``reason``."""
        try:
            column = _FAILED + FAILURE_REASONS.index(reason)
        except ValueError:
            raise ValueError(f"{reason!r} is not a finish reason ({', '.join(FAILURE_REASONS)})") from None
        self._add(column, 1)

    def output_failures(self) -> dict[str, int]:
        """Output failures over the whole server, by finish reason (reasons with none left out)."""
        counts = {reason: self._column(_FAILED + position) for position, reason in enumerate(FAILURE_REASONS)}
        return {reason: count for reason, count in counts.items() if count}
