"""Tensor-parallel ranks on one host: communicators, the thread group, and a backend over N ranks.

Owns the runtime side of a core with ``ExecutionManifest.ranks = N``:

* :class:`Communicator`: what a rank's backend needs to run the collective operators (``all_reduce``,
  ``all_gather``, ``broadcast``; see ``docs/ops.md``), plus ``abort`` (a rank failed: its peers stop
  waiting) and ``reset`` (every rank has stopped: the next collective starts afresh).
* :class:`ThreadCommunicator`: the thread ranks of one process (``RankPeers::Threads``), one object per
  rank over a shared :class:`ThreadGroup` (a ``threading.Barrier`` of N parties). Every collective is two
  barrier waits: every rank posts its array, rank 0 computes the result once (sums in rank order with
  float32 accumulation, so every rank receives the same bits whatever the thread timing), and every rank
  reads it. Every wait has a deadline; a rank that fails aborts the barrier, and a peer that waits past
  the deadline breaks it, so the other ranks raise :class:`RankError` naming the rank at fault instead of
  hanging.
* :class:`RankedBackend`: the runtime's ``Backend`` protocol (``helios_core.runtime.native_model``) over
  N per-rank backends. Rank 0's staging is the transport the packer writes once; ``run`` copies the
  staged values to the other ranks and runs the program on every rank at once (one thread per rank),
  raising a :class:`RankError` naming the rank when any rank fails or does not finish in time;
  ``completion`` is rank 0's record and ``rank_completions`` every rank's (the engine validates them
  together: a lane any rank rejects is committed by none). Host page copies go to every rank. Ranks may
  share one staging (the CUDA ranks of a process read one page-locked block, whose holder is among the
  ``shared`` objects closed after every rank): ``transport`` then waits for every rank's fence of the frame
  before the packer rewrites it, and ``run`` copies nothing.

  Over backends whose ``run`` only enqueues work and returns (the CUDA backend: one rank a GPU, collectives
  captured as NCCL calls in each rank's graphs), ``in_order=True`` launches every rank from the calling
  thread in rank order (no thread hand-off per round; the collectives meet on the devices), and
  ``abort_group`` is what a failure calls: a rank that fails to launch leaves its peers' collectives
  waiting on the device, so the group is aborted (the CUDA ranks abort their NCCL communicators) and
  broken: every later round raises the :class:`RankError` of that failure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from helios_core.errors import HeliosError

__all__ = [
    "DEFAULT_DEADLINE_S",
    "Communicator",
    "RankError",
    "RankedBackend",
    "ThreadCommunicator",
    "ThreadGroup",
]

AnyArray = npt.NDArray[Any]

DEFAULT_DEADLINE_S = 120.0
"""Seconds a rank waits for its peers at one collective (and a round waits for its slowest rank)."""


class RankError(HeliosError):
    """A tensor-parallel rank failed, or did not reach a collective in time; ``rank`` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class Communicator(Protocol):
    """One rank's view of its group's collectives (``docs/ops.md``, "Collectives")."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_reduce(self, array: AnyArray) -> AnyArray:
        """The elementwise sum of every rank's ``array`` (rank order, float32 accumulation for floats)."""
        ...

    def all_gather(self, array: AnyArray, axis: int) -> AnyArray:
        """Every rank's ``array`` concatenated along ``axis`` in rank order."""
        ...

    def broadcast(self, array: AnyArray, root: int) -> AnyArray:
        """Rank ``root``'s ``array`` (every rank passes one of the same shape and dtype)."""
        ...

    def abort(self, reason: str) -> None:
        """This rank failed: every peer waiting at, or later reaching, a collective raises RankError."""
        ...

    def reset(self) -> None:
        """Make the group usable again once every rank has stopped (after an abort or a deadline)."""
        ...


class ThreadGroup:
    """The shared state of N thread ranks: the barrier, the posted arrays, the result and the abort reason."""

    def __init__(self, size: int, *, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if size < 1:
            raise ValueError(f"a rank group has at least one rank, not {size}")
        if deadline_s <= 0:
            raise ValueError(f"the collective deadline must be positive, not {deadline_s}")
        self.size = size
        self.deadline_s = deadline_s
        self._barrier = threading.Barrier(size)
        self._lock = threading.Lock()
        self._posted: list[tuple[str, int, AnyArray] | None] = [None] * size
        self._arrivals = [0] * size
        """Per rank: the collectives it has reached (a stuck rank is one behind the others)."""
        self._result: AnyArray | None = None
        self._failure: RankError | None = None
        self.communicators: tuple[ThreadCommunicator, ...] = tuple(ThreadCommunicator(self, r) for r in range(size))

    @property
    def failure(self) -> RankError | None:
        """The error that aborted the group (None while it is usable)."""
        return self._failure

    def abort(self, rank: int, reason: str) -> None:
        """Rank ``rank`` failed with ``reason``: the first failure is kept and every waiting rank is woken."""
        with self._lock:
            if self._failure is None:
                self._failure = RankError(rank, reason)
        self._barrier.abort()

    def reset(self) -> None:
        """Clear a failure; call only when no rank is inside a collective."""
        with self._lock:
            self._failure = None
            self._posted = [None] * self.size
            self._arrivals = [0] * self.size
            self._result = None
        self._barrier.reset()

    def collective(self, rank: int, operator: str, parameter: int, array: AnyArray) -> AnyArray:
        """Post ``array`` for ``operator``, wait for every rank, return the shared result (read-only)."""
        if self.size == 1:
            return _combine(operator, parameter, [array])
        if self._failure is not None:
            raise self._failure_for(rank)
        self._posted[rank] = (operator, parameter, array)
        self._arrivals[rank] += 1
        self._wait(rank, operator)
        if rank == 0:
            try:
                self._result = self._compute()
            except RankError as exc:
                self.abort(exc.rank, str(exc))
                raise
            except (ValueError, TypeError, MemoryError) as exc:
                self.abort(0, f"rank 0 could not combine {operator}: {type(exc).__name__}: {exc}")
                raise self._failure_for(0) from exc
        self._wait(rank, operator)
        result = self._result
        if result is None:  # unreachable once both waits passed; kept as a typed failure, never an assert
            raise RankError(0, f"{operator}: rank 0 posted no result")
        return result

    def _compute(self) -> AnyArray:
        posted = [entry for entry in self._posted if entry is not None]
        if len(posted) != self.size:
            raise RankError(0, "a rank reached a collective without posting its array")
        operator, parameter, first = posted[0]
        for rank, (other, other_parameter, array) in enumerate(posted[1:], start=1):
            if other != operator or other_parameter != parameter:
                raise RankError(
                    rank, f"rank {rank} reached {other}({other_parameter}) where rank 0 reached {operator}({parameter})"
                )
            if operator != "broadcast" and (array.shape != first.shape or array.dtype != first.dtype):
                raise RankError(
                    rank,
                    f"rank {rank} passed {operator} an array of {array.shape} {array.dtype}; rank 0 passed "
                    f"{first.shape} {first.dtype}",
                )
        result = _combine(operator, parameter, [entry[2] for entry in posted])
        result.flags.writeable = False
        return result

    def _wait(self, rank: int, operator: str) -> None:
        try:
            self._barrier.wait(self.deadline_s)
        except threading.BrokenBarrierError:
            with self._lock:
                if self._failure is None:  # nobody aborted: the deadline passed
                    mine = self._arrivals[rank]
                    late = [r for r, count in enumerate(self._arrivals) if count < mine]
                    if late:
                        names = ", ".join(map(str, late))
                        self._failure = RankError(
                            late[0],
                            f"rank {names} did not reach {operator} (collective {mine}) within {self.deadline_s:g} s",
                        )
                    else:
                        self._failure = RankError(
                            rank,
                            f"the ranks did not finish {operator} (collective {mine}) within {self.deadline_s:g} s",
                        )
            raise self._failure_for(rank) from None

    def _failure_for(self, rank: int) -> RankError:
        failure = self._failure
        if failure is None:
            return RankError(rank, f"rank {rank}: the rank group was aborted")
        if failure.rank == rank:
            return RankError(rank, str(failure))
        return RankError(failure.rank, f"rank {rank} stopped: {failure}")


def _combine(operator: str, parameter: int, arrays: Sequence[AnyArray]) -> AnyArray:
    """The collective's result from every rank's array, in rank order (``docs/ops.md``)."""
    if operator == "all_reduce":
        first = arrays[0]
        kind = first.dtype.kind
        total = np.array(first, dtype=np.float32 if kind == "f" else first.dtype, copy=True)
        for array in arrays[1:]:
            total += array
        return total.astype(first.dtype, copy=False)
    if operator == "all_gather":
        return np.concatenate([np.asarray(array) for array in arrays], axis=parameter)
    if operator == "broadcast":
        return np.array(arrays[parameter], copy=True)
    raise ValueError(f"unknown collective {operator!r}")


class ThreadCommunicator:
    """One thread rank of a :class:`ThreadGroup` (build the group with :meth:`group`)."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @staticmethod
    def group(size: int, *, deadline_s: float = DEFAULT_DEADLINE_S) -> tuple[ThreadCommunicator, ...]:
        """The communicators of a new group of ``size`` thread ranks, rank order."""
        return ThreadGroup(size, deadline_s=deadline_s).communicators

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    @property
    def deadline_s(self) -> float:
        return self._group.deadline_s

    def all_reduce(self, array: AnyArray) -> AnyArray:
        return self._group.collective(self._rank, "all_reduce", 0, array)

    def all_gather(self, array: AnyArray, axis: int) -> AnyArray:
        if not -array.ndim <= axis < array.ndim:
            self.abort(f"rank {self._rank}: all_gather axis {axis} is outside an array of {array.ndim} axes")
            raise RankError(self._rank, f"all_gather axis {axis} is outside an array of {array.ndim} axes")
        return self._group.collective(self._rank, "all_gather", axis % array.ndim, array)

    def broadcast(self, array: AnyArray, root: int) -> AnyArray:
        if not 0 <= root < self.size:
            self.abort(f"rank {self._rank}: broadcast root {root} is outside [0, {self.size})")
            raise RankError(self._rank, f"broadcast root {root} is outside [0, {self.size})")
        return self._group.collective(self._rank, "broadcast", root, array)

    def abort(self, reason: str) -> None:
        self._group.abort(self._rank, reason)

    def reset(self) -> None:
        self._group.reset()


class RankedBackend:
    """The runtime's backend over N per-rank backends running one program at once on thread ranks."""

    def __init__(
        self,
        backends: Sequence[Any],
        *,
        communicators: Sequence[Communicator] = (),
        deadline_s: float = DEFAULT_DEADLINE_S,
        in_order: bool = False,
        abort_group: Callable[[str], None] | None = None,
        shared: Sequence[Any] = (),
    ) -> None:
        if not backends:
            raise ValueError("a ranked backend needs at least one rank")
        self._backends = tuple(backends)
        self._communicators = tuple(communicators)
        self._deadline_s = deadline_s
        self._in_order = in_order
        self._abort_group = abort_group
        self._shared = tuple(shared)
        """What the ranks share (each with ``close()``), closed after every rank."""
        self._pool = ThreadPoolExecutor(max_workers=len(self._backends), thread_name_prefix="helios-rank")
        self._broken: RankError | None = None
        """Set when a rank never returned (its thread may still run) or a failure aborted the group: no later
        round is started."""

    @property
    def size(self) -> int:
        """The number of ranks."""
        return len(self._backends)

    @property
    def ranks(self) -> tuple[Any, ...]:
        """The per-rank backends, rank order."""
        return self._backends

    def transport(self, frame: int) -> Mapping[str, AnyArray]:
        """Rank 0's staging (the packer writes it once; :meth:`run` copies it to the other ranks), once no
        rank reads the frame any more (ranks may share one staging: every rank's frame fence is waited for)."""
        if self._broken is not None:
            raise self._broken
        for backend in self._backends[1:]:
            backend.transport(frame)
        return self._backends[0].transport(frame)  # type: ignore[no-any-return]

    def run(self, program: str, frame: int) -> None:
        """Copy rank 0's staged values to every rank, then run ``program`` on every rank at once."""
        if self._broken is not None:
            raise self._broken
        staged = self._backends[0].transport(frame)
        for backend in self._backends[1:]:
            target = backend.transport(frame)
            for name, values in staged.items():
                destination = target[name]
                if destination is not values and not _same_memory(destination, values):
                    destination[...] = values
        self.on_every_rank(lambda rank, backend: backend.run(program, frame), f"program {program!r}")

    def on_every_rank(self, action: Any, what: str) -> None:
        """Run ``action(rank, backend)`` on every rank at once (in rank order on this thread when the ranks
        only enqueue work); a RankError naming the first rank at fault."""
        if self._in_order:
            for rank, backend in enumerate(self._backends):
                try:
                    action(rank, backend)
                except Exception as exc:
                    self._break(RankError(rank, f"rank {rank} failed {what}: {type(exc).__name__}: {exc}"), exc)
            return
        try:
            self._on_every_rank_at_once(action, what)
        except RankError as failed:
            if self._abort_group is not None:
                self._break(failed, failed.__cause__)
            raise

    def _break(self, error: RankError, cause: BaseException | None) -> None:
        """Abort the group and refuse every later round with ``error``."""
        self._broken = error
        if self._abort_group is not None:
            self._abort_group(str(error))
        raise error from cause

    def _on_every_rank_at_once(self, action: Any, what: str) -> None:
        futures: list[Future[None]] = [
            self._pool.submit(self._one_rank, action, rank, backend) for rank, backend in enumerate(self._backends)
        ]
        _, pending = wait_futures(futures, timeout=self._deadline_s)
        if pending:  # wake the ranks waiting for the late ones at a collective, then give them a deadline more
            late = [rank for rank, future in enumerate(futures) if future in pending]
            reason = f"rank {', '.join(map(str, late))} did not finish {what} within {self._deadline_s:g} s"
            for rank in late:
                if rank < len(self._communicators):
                    self._communicators[rank].abort(reason)
            _, pending = wait_futures(futures, timeout=self._deadline_s)
            if pending:
                late = [rank for rank, future in enumerate(futures) if future in pending]
                self._broken = RankError(late[0], reason)
                raise self._broken
        errors = [(rank, future.exception()) for rank, future in enumerate(futures)]
        failed = [(rank, exc) for rank, exc in errors if exc is not None]
        if not failed:
            return
        for communicator in self._communicators:  # every rank has stopped: the next round starts afresh
            communicator.reset()
        causes = [(rank, exc) for rank, exc in failed if not isinstance(exc, RankError)]
        if causes:
            rank, cause = causes[0]
            raise RankError(rank, f"rank {rank} failed {what}: {type(cause).__name__}: {cause}") from cause
        first = next((exc for _, exc in failed if isinstance(exc, RankError)), None)
        if isinstance(first, RankError):
            raise RankError(first.rank, f"{what}: {first}") from first

    def _one_rank(self, action: Any, rank: int, backend: Any) -> None:
        try:
            action(rank, backend)
        except BaseException as exc:
            if not isinstance(exc, RankError) and rank < len(self._communicators):
                self._communicators[rank].abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")
            raise

    def completion(self, frame: int) -> Mapping[int, AnyArray]:
        """Rank 0's completion record."""
        return self._backends[0].completion(frame)  # type: ignore[no-any-return]

    def rank_completions(self, frame: int) -> tuple[Mapping[int, AnyArray], ...]:
        """Every rank's completion record, rank order."""
        return tuple(backend.completion(frame) for backend in self._backends)

    def reserve_host_pages(self, count: int) -> None:
        for backend in self._backends:
            backend.reserve_host_pages(count)

    def copy_page_to_host(self, page: int, slot: int) -> None:
        for backend in self._backends:
            backend.copy_page_to_host(page, slot)

    def copy_page_to_device(self, slot: int, page: int) -> None:
        for backend in self._backends:
            backend.copy_page_to_device(slot, page)

    def reserve_host_snapshots(self, count: int, rows: int) -> None:
        for backend in self._backends:
            backend.reserve_host_snapshots(count, rows)

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        for backend in self._backends:
            backend.copy_snapshot_to_host(row, slot)

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        for backend in self._backends:
            backend.copy_snapshot_to_device(slot, row)

    def close(self) -> None:
        """Close every rank's backend, the last rank first, then what they share; the first failure is raised
        once all are closed."""
        self._pool.shutdown(wait=self._broken is None, cancel_futures=True)
        failure: BaseException | None = None
        for closable in (*reversed(self._backends), *self._shared):
            try:
                closable.close()
            except BaseException as exc:  # close the others before reporting it
                failure = failure or exc
        if failure is not None:
            raise failure


def _same_memory(first: AnyArray, second: AnyArray) -> bool:
    """Two staging arrays are views of the same bytes (ranks sharing one staging block)."""
    return bool(
        first.__array_interface__["data"][0] == second.__array_interface__["data"][0] and first.nbytes == second.nbytes
    )
