"""The host-memory tier of the prefix cache: published pages evicted from the device, kept in host memory.

Owns the host page slots (their number is fixed at load: ``--offload-pages``, ``LoadOptions.offload_pages``),
the prefix-index key each occupied slot holds, the host tier's eviction order, its counters, and the
copies between a device page and a host slot, which it asks of the backend (:class:`PageCopier`: plain
numpy memory on the reference backend, pinned host memory on the CUDA backend).

It also owns the host slots of published prefix checkpoints (:class:`HostCheckpointStore`, their number fixed
at load: ``--offload-checkpoints``, ``LoadOptions.offload_checkpoints``) and their copies between a snapshot row
and a host slot (:class:`SnapshotCopier`); the :class:`~helios_core.runtime.checkpoints.CheckpointIndex` decides
when a checkpoint moves, by the same rules and copy ordering as pages below.

The :class:`~helios_core.runtime.pages.PageAllocator` decides when a page moves: when it evicts a
published page from the device, :meth:`HostPageStore.store` copies the page into a host slot instead of
dropping it, and the page's key stays in the prefix index; when a prefix match reaches a key held here,
:meth:`HostPageStore.restore` copies it back into a freshly allocated device page before the request's
first round reads it.

Eviction order (least recently used): a host slot's entry is used exactly once, by the restore that
ends its stay here, so the least recently used entry is the one that arrived first. When every slot is
occupied, storing a page drops the entry that arrived first, skipping entries pinned by a claim in
progress; when every entry is pinned, the evicted device page is dropped instead. Device pages are
evicted deepest page of a prefix first (release order), so the host tier also loses a prefix's deepest
pages before its head.

Ordering of the copies: every copy is issued between rounds, on the model worker's thread, and a
backend runs copies in program order with its rounds (the reference backend copies at once; the CUDA
backend enqueues them on the one stream its rounds run on, after every round launched before and before
every round launched after). So a page being copied to the host is written by its next owner's round
only after the copy, a restored page is read by the request's round only after its copy, and a host
slot is overwritten by a later copy only after every earlier copy that reads it. The host never reads
or writes the slots itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from helios_core.errors import HeliosError

HOST_RESIDENT = -1
"""The page id a prefix match reports for a matched page held in the host tier (restored when claimed)."""


class OffloadError(HeliosError):
    """A host-tier operation that breaks its rules (a bug in the caller)."""


class PageCopier(Protocol):
    """The backend's page copies: every plane with a ``CACHE_PAGES`` leading dimension, one page at a time."""

    def copy_page_to_host(self, page: int, slot: int) -> None:
        """Copy device page ``page`` into host slot ``slot`` (ordered after every round launched before)."""

    def copy_page_to_device(self, slot: int, page: int) -> None:
        """Copy host slot ``slot`` into device page ``page`` (ordered before every round launched after)."""


@dataclass
class OffloadStats:
    """Counters of host-tier traffic (exported as metrics)."""

    offloaded: int = 0
    """Device pages copied into a host slot."""
    restored: int = 0
    """Host slots copied back into a device page for a prefix match."""
    evicted: int = 0
    """Host entries dropped from the prefix index to make room (or device pages dropped when every entry was pinned)."""


class HostPageStore:
    """The host slots of one cache and the prefix-index keys they hold."""

    def __init__(self, capacity: int, copier: PageCopier) -> None:
        if capacity <= 0:
            raise OffloadError(f"a host tier needs at least one page, not {capacity}")
        self.capacity = capacity
        self._copier = copier
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() yields the lowest slot
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        """Occupied slots by key, least recently used first."""
        self._pinned: set[bytes] = set()
        self.stats = OffloadStats()

    # -- queries ------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    @property
    def used_pages(self) -> int:
        return len(self._slot_of)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def keys(self) -> frozenset[bytes]:
        """The keys of every page held here."""
        return frozenset(self._slot_of)

    def slot(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def eviction_order(self) -> list[bytes]:
        """Keys held here, next victim first (pinned keys included where they stand)."""
        return list(self._slot_of)

    # -- moves --------------------------------------------------------------------------------
    def store(self, key: bytes, page: int) -> tuple[bytes, ...]:
        """Copy device ``page``, published under ``key``, into a host slot; the keys that left the prefix
        index to make room (the least recently used unpinned entry), or ``(key,)`` when every slot is
        held by a pinned entry and the page is dropped instead."""
        if key in self._slot_of:
            raise OffloadError("a key is stored in the host tier twice")
        gone: tuple[bytes, ...] = ()
        if not self._free:
            victim = next((k for k in self._slot_of if k not in self._pinned), None)
            if victim is None:
                self.stats.evicted += 1
                return (key,)
            self._free.append(self._slot_of.pop(victim))
            self.stats.evicted += 1
            gone = (victim,)
        slot = self._free.pop()
        self._copier.copy_page_to_host(page, slot)
        self._slot_of[key] = slot
        self.stats.offloaded += 1
        return gone

    def restore(self, key: bytes, page: int) -> None:
        """Copy the entry of ``key`` into device ``page`` and free its slot (it leaves the host tier)."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            raise OffloadError("a key the host tier does not hold is restored")
        self._pinned.discard(key)
        self._copier.copy_page_to_device(slot, page)
        self._free.append(slot)
        self.stats.restored += 1

    def discard(self, key: bytes) -> bool:
        """Free the slot of ``key`` without copying (a device page now holds the same content); False when
        the key is not held here."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        self._pinned.discard(key)
        self._free.append(slot)
        return True

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keep ``keys`` from being dropped to make room (while a claim allocates their device pages)."""
        self._pinned.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._pinned.difference_update(keys)

    def check(self) -> None:
        """Raise OffloadError unless occupied + free == capacity with no slot twice and nothing pinned."""
        occupied = set(self._slot_of.values())
        free = set(self._free)
        if len(occupied) != len(self._slot_of) or len(free) != len(self._free):
            raise OffloadError("a host slot is used twice")
        if occupied & free or len(occupied) + len(free) != self.capacity:
            raise OffloadError(f"occupied {len(occupied)} + free {len(free)} host slots != capacity {self.capacity}")
        if self._pinned:
            raise OffloadError("host entries are still pinned outside a claim")


# -- the host tier of prefix checkpoints ------------------------------------------------------------------
class SnapshotCopier(Protocol):
    """The backend's checkpoint copies: every buffer with a ``SNAPSHOT_ROWS`` leading dimension, one
    checkpoint (a request's rows of snapshot state) at a time."""

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        """Copy snapshot row ``row`` (in units of a request's rows) into host slot ``slot`` (ordered after
        every round launched before)."""

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        """Copy host slot ``slot`` into snapshot row ``row`` (ordered before every round launched after)."""


@dataclass
class CheckpointOffloadStats:
    """Counters of the checkpoint host tier's traffic (exported as metrics)."""

    stored: int = 0
    """Evicted published checkpoints copied from their snapshot row into a host slot."""
    restored: int = 0
    """Host checkpoints copied back into a snapshot row for a prompt that shares their prefix."""
    evicted: int = 0
    """Host checkpoints dropped to make room (or evicted checkpoints dropped when every host entry was pinned)."""


class HostCheckpointStore:
    """The host slots of published checkpoints evicted from their snapshot rows (``--offload-checkpoints``).

    Same rules as :class:`HostPageStore`: an entry is used once, by the restore that ends its stay, so the
    least recently used entry is the one that arrived first; storing into a full store drops that entry
    (skipping pinned ones, which a restore in progress holds), or drops the arriving checkpoint when every
    entry is pinned. Copies go through the backend in program order with its rounds."""

    def __init__(self, capacity: int, copier: SnapshotCopier) -> None:
        if capacity <= 0:
            raise OffloadError(f"a checkpoint host tier needs at least one slot, not {capacity}")
        self.capacity = capacity
        self._copier = copier
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() yields the lowest slot
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        """Occupied slots by checkpoint key, least recently used (first arrived) first."""
        self._pinned: set[bytes] = set()
        self.stats = CheckpointOffloadStats()

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def eviction_order(self) -> list[bytes]:
        """Keys held here, next victim first."""
        return list(self._slot_of)

    def store(self, key: bytes, row: int) -> tuple[bytes, ...]:
        """Copy the checkpoint published under ``key`` from snapshot ``row`` into a host slot; the keys that
        left the host tier to make room, or ``(key,)`` when every slot is pinned and it is dropped instead."""
        if key in self._slot_of:
            raise OffloadError("a checkpoint is stored in the host tier twice")
        gone: tuple[bytes, ...] = ()
        if not self._free:
            victim = next((k for k in self._slot_of if k not in self._pinned), None)
            self.stats.evicted += 1
            if victim is None:
                return (key,)
            self._free.append(self._slot_of.pop(victim))
            gone = (victim,)
        slot = self._free.pop()
        self._copier.copy_snapshot_to_host(row, slot)
        self._slot_of[key] = slot
        self.stats.stored += 1
        return gone

    def restore(self, key: bytes, row: int) -> None:
        """Copy the entry of ``key`` into snapshot ``row`` and free its slot (it leaves the host tier)."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            raise OffloadError("a checkpoint the host tier does not hold is restored")
        self._pinned.discard(key)
        self._copier.copy_snapshot_to_device(slot, row)
        self._free.append(slot)
        self.stats.restored += 1

    def pin(self, key: bytes) -> None:
        """Keep ``key`` from being dropped to make room (while a snapshot row is freed for its restore)."""
        if key not in self._slot_of:
            raise OffloadError("a checkpoint the host tier does not hold is pinned")
        self._pinned.add(key)

    def unpin(self, key: bytes) -> None:
        self._pinned.discard(key)

    def check(self) -> None:
        """Raise OffloadError unless occupied + free == capacity with no slot twice and nothing pinned."""
        occupied = set(self._slot_of.values())
        free = set(self._free)
        if len(occupied) != len(self._slot_of) or len(free) != len(self._free):
            raise OffloadError("a checkpoint host slot is used twice")
        if occupied & free or len(occupied) + len(free) != self.capacity:
            raise OffloadError(
                f"occupied {len(occupied)} + free {len(free)} checkpoint host slots != capacity {self.capacity}"
            )
        if self._pinned:
            raise OffloadError("host checkpoints are still pinned outside a restore")
