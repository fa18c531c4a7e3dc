"""Published checkpoints: immutable snapshots at exact token endpoints, reused as shared prefixes.

Owns :class:`CheckpointIndex`, the index of published checkpoints of a core whose history is not all
in pages (a recurrent region: its state rows hold the effect of every consumed token, and no page
does). A checkpoint is a snapshot row holding a request's committed state at an exact endpoint of its
known tokens: its recurrent state rows, pending token and sampling state rows, as the core's
``snapshot`` program copies them. It is keyed by the token-chain hash of the prefix it covers (the
key the page allocator gives the complete page ending there,
:meth:`~helios_core.runtime.pages.PageAllocator.chain_hash`), so a lookup is exact for the whole
prefix and never crosses cores of different cache identity.

Who changes it: the :class:`~helios_core.runtime.residency.Residency` only. It marks a prefilling
request for a checkpoint (a snapshot row is taken, the key is :meth:`CheckpointIndex.reserve` d), the
planner plans that request's ``snapshot`` round before any round that computes past the endpoint,
and the round's completion publishes it (:meth:`CheckpointIndex.publish`) only after the round's
completion record validated; a failed round returns the row and publishes nothing. Admission looks
up the deepest checkpoint a prompt shares (:meth:`CheckpointIndex.deepest`), pins it
(:meth:`CheckpointIndex.claim`) until the request's ``restore`` round has copied it, and the request
then computes only the tokens after its endpoint.

Invariants, checked by :meth:`CheckpointIndex.check`: every checkpoint has its own snapshot row, no
row is both published and reserved, pins are never negative. Checkpoints are immutable: a row is
written once, by the snapshot round that publishes it, and only read afterwards (by restores) until
it is evicted. Eviction is least recently used first (publication and every claim count as a use)
and skips pinned checkpoints; the residency evicts one when a preemption needs a snapshot row and
none is free, or when a deeper checkpoint of the same chain needs a row.

Host tier (``--offload-checkpoints``, a :class:`~helios_core.runtime.offload.HostCheckpointStore`): an evicted
checkpoint is copied from its snapshot row into a host slot instead of being dropped, and stays in the
index (its :attr:`Checkpoint.row` is :data:`ON_HOST` meanwhile), so :meth:`CheckpointIndex.deepest` finds it
like one in a row. Before it is claimed it is copied back into a free snapshot row
(:meth:`CheckpointIndex.bring_back`) and is then an ordinary published checkpoint again. A key held on the
host is not taken again (:meth:`CheckpointIndex.wanted`). A shallower checkpoint whose row a deeper one of
the same chain takes is dropped, not moved (the deeper one serves every prompt sharing its whole prefix, and
the host slots are kept for other prefixes); with a host tier a new checkpoint may also take the row of the
least recently used checkpoint of another chain, which moves to the host, so nothing is lost.
The host tier evicts least recently used first: an entry is used once, by the copy back that ends its stay,
so the one that arrived first leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from helios_core.errors import HeliosError
from helios_core.runtime.offload import HostCheckpointStore

ChainHash = Callable[[bytes | None, Sequence[int]], bytes]
"""The page allocator's chain hash: the key of a complete page of tokens after the prefix keyed first."""


ON_HOST = -1
"""The :attr:`Checkpoint.row` of a checkpoint held in the host tier (copied back into a row before a claim)."""


class CheckpointError(HeliosError):
    """A checkpoint operation that breaks the index's rules (a bug in the caller)."""


@dataclass(eq=False, slots=True)
class Checkpoint:
    """One published checkpoint: snapshot row ``row`` holds the committed state after ``endpoint`` tokens."""

    key: bytes
    """The chain hash of the prefix's complete pages (its endpoint is a page boundary)."""
    row: int
    """The snapshot row (in units of a request's rows) holding the state; :data:`ON_HOST` while the host
    tier holds it."""
    endpoint: int
    """Tokens of the prefix the state has consumed (a multiple of the page size)."""
    presence: frozenset[int]
    """The token ids the copied prompt-presence row marks (the prompt of the request it was taken from):
    a restore copies it, so it is exact for a request whose prompt has the same ids, or whose sampling
    does not read prompt presence (repetition penalty 1)."""
    pins: int = 0
    """Admitted requests whose restore from this checkpoint is pending (it is not evicted meanwhile)."""


@dataclass
class CheckpointStats:
    """Counters of checkpoint traffic."""

    published: int = 0
    hits: int = 0
    """Admissions that restored a checkpoint."""
    reused_tokens: int = 0
    """Prompt tokens those admissions did not compute."""
    evicted: int = 0
    abandoned: int = 0
    """Reserved checkpoints whose snapshot round failed or whose request left first (never published)."""


class CheckpointIndex:
    """Published checkpoints by chain key, least recently used first."""

    def __init__(self, page_tokens: int, chain_hash: ChainHash, *, host: HostCheckpointStore | None = None) -> None:
        if page_tokens <= 0:
            raise CheckpointError("checkpoints need pages of at least one token")
        self.page_tokens = page_tokens
        self._chain_hash = chain_hash
        self._by_key: OrderedDict[bytes, Checkpoint] = OrderedDict()
        """Published checkpoints, least recently used first."""
        self._reserved: dict[bytes, int] = {}
        """Keys whose snapshot round is planned or running, with their row (not reusable yet)."""
        self.stats = CheckpointStats()
        self.host = host
        """The host tier evicted checkpoints move to (None: they are dropped)."""
        self._on_host: dict[bytes, Checkpoint] = {}
        """Checkpoints the host tier holds, by key (never also in a snapshot row)."""

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def on_host(self) -> list[int]:
        """The endpoints of the checkpoints the host tier holds, next to leave it first."""
        if self.host is None:
            return []
        return [self._on_host[key].endpoint for key in self.host.eviction_order()]

    def rows(self) -> list[int]:
        """The snapshot rows of published checkpoints, least recently used first."""
        return [checkpoint.row for checkpoint in self._by_key.values()]

    def endpoints(self) -> list[int]:
        """The endpoints of published checkpoints, least recently used first."""
        return [checkpoint.endpoint for checkpoint in self._by_key.values()]

    # -- keys ----------------------------------------------------------------------------------------
    def chain_keys(self, tokens: Sequence[int], limit: int) -> list[bytes]:
        """The chain key of each complete page of ``tokens[:limit]``, in order."""
        keys: list[bytes] = []
        step = self.page_tokens
        previous: bytes | None = None
        for start in range(0, min(limit, len(tokens)) - step + 1, step):
            previous = self._chain_hash(previous, tokens[start : start + step])
            keys.append(previous)
        return keys

    # -- lookups -------------------------------------------------------------------------------------
    def deepest(
        self, keys: Sequence[bytes], usable: Callable[[Checkpoint], bool] = lambda checkpoint: True
    ) -> Checkpoint | None:
        """The published checkpoint deepest along ``keys`` (a prompt's chain keys) that ``usable`` accepts,
        in a snapshot row or (its row :data:`ON_HOST`) in the host tier."""
        for key in reversed(keys):
            checkpoint = self._by_key.get(key) or self._on_host.get(key)
            if checkpoint is not None and usable(checkpoint):
                return checkpoint
        return None

    def pin_on_host(self, checkpoint: Checkpoint) -> None:
        """Keep the host tier from dropping ``checkpoint`` while a snapshot row is freed for it."""
        if self.host is None or self._on_host.get(checkpoint.key) is not checkpoint:
            raise CheckpointError(f"checkpoint at endpoint {checkpoint.endpoint} is not in the host tier")
        self.host.pin(checkpoint.key)

    def unpin_on_host(self, checkpoint: Checkpoint) -> None:
        if self.host is not None:
            self.host.unpin(checkpoint.key)

    def bring_back(self, checkpoint: Checkpoint, row: int) -> None:
        """Copy the host tier's ``checkpoint`` into the free snapshot ``row``: it is published in that row
        again (most recently used) and leaves the host tier."""
        if self.host is None or self._on_host.get(checkpoint.key) is not checkpoint:
            raise CheckpointError(f"checkpoint at endpoint {checkpoint.endpoint} is not in the host tier")
        self.host.restore(checkpoint.key, row)
        del self._on_host[checkpoint.key]
        checkpoint.row = row
        self._by_key[checkpoint.key] = checkpoint

    def claim(self, checkpoint: Checkpoint) -> None:
        """An admitted request will restore ``checkpoint``: pin it (it is not evicted before the restore)
        and count it as used now."""
        if self._by_key.get(checkpoint.key) is not checkpoint:
            raise CheckpointError(f"checkpoint at endpoint {checkpoint.endpoint} is not published")
        checkpoint.pins += 1
        self._by_key.move_to_end(checkpoint.key)
        self.stats.hits += 1
        self.stats.reused_tokens += checkpoint.endpoint

    def unpin(self, checkpoint: Checkpoint) -> None:
        """The restore from ``checkpoint`` was copied, or its request left before it."""
        if checkpoint.pins <= 0:
            raise CheckpointError(f"checkpoint at endpoint {checkpoint.endpoint} is unpinned more often than pinned")
        checkpoint.pins -= 1

    # -- publishing ----------------------------------------------------------------------------------
    def wanted(self, key: bytes) -> bool:
        """No checkpoint is published (in a row or the host tier) or being taken under ``key``."""
        return key not in self._by_key and key not in self._reserved and key not in self._on_host

    def reserve(self, key: bytes, row: int) -> None:
        """A snapshot round into ``row`` will take the checkpoint keyed ``key`` (not reusable until published)."""
        if not self.wanted(key):
            raise CheckpointError("a checkpoint under this key is published or being taken already")
        self._reserved[key] = row

    def publish(self, key: bytes, endpoint: int, presence: frozenset[int]) -> Checkpoint:
        """The snapshot round of the reserved ``key`` validated: its row is a published checkpoint."""
        if key not in self._reserved:
            raise CheckpointError("a checkpoint is published that was not reserved")
        if endpoint <= 0 or endpoint % self.page_tokens:
            raise CheckpointError(f"checkpoint endpoint {endpoint} is not a positive page boundary")
        row = self._reserved.pop(key)
        checkpoint = self._by_key[key] = Checkpoint(key, row, endpoint, presence)
        self.stats.published += 1
        return checkpoint

    def abandon(self, key: bytes) -> int:
        """The reserved ``key`` will not be published (its round failed or its request left): its row."""
        row = self._reserved.pop(key, None)
        if row is None:
            raise CheckpointError("a checkpoint is abandoned that was not reserved")
        self.stats.abandoned += 1
        return row

    # -- eviction ------------------------------------------------------------------------------------
    def evict(
        self, among: Callable[[Checkpoint], bool] = lambda checkpoint: True, *, offload: bool = True
    ) -> int | None:
        """Evict the least recently used unpinned checkpoint in a row that ``among`` accepts: into the host
        tier when there is one and ``offload`` (its least recently used entry may leave to make room), else
        dropped; its freed row, or None when there is none."""
        for key, checkpoint in self._by_key.items():
            if checkpoint.pins == 0 and among(checkpoint):
                del self._by_key[key]
                self.stats.evicted += 1
                row = checkpoint.row
                if self.host is not None and offload:
                    for gone in self.host.store(key, row):
                        self._on_host.pop(gone, None)
                    if key in self.host:
                        checkpoint.row = ON_HOST
                        self._on_host[key] = checkpoint
                return row
        return None

    def check(self) -> None:
        """Raise CheckpointError unless every published and reserved checkpoint has its own row."""
        rows = [checkpoint.row for checkpoint in self._by_key.values()] + list(self._reserved.values())
        if len(set(rows)) != len(rows):
            raise CheckpointError("a snapshot row holds two checkpoints")
        if any(checkpoint.pins < 0 for checkpoint in self._by_key.values()):
            raise CheckpointError("a negative pin count")
        if not set(self._by_key).isdisjoint(self._reserved):
            raise CheckpointError("a key is both published and reserved")
        if self.host is not None:
            self.host.check()
            if set(self._on_host) != set(self.host.eviction_order()):
                raise CheckpointError("the host tier and the index disagree on the checkpoints it holds")
            if not set(self._on_host).isdisjoint(set(self._by_key) | set(self._reserved)):
                raise CheckpointError("a checkpoint is both in the host tier and in a snapshot row")
