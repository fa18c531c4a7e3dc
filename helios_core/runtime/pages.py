"""The page allocator: page ids, reference counts, the prefix index and the eviction order.

Owns every physical cache page. A page is in exactly one of three states:

* free: holds nothing reusable, in ``_free`` (taken first, lowest ids first);
* referenced: ``refcount > 0``, owned by one or more requests;
* evictable: ``refcount == 0`` but its content is published in the prefix index, in ``_evictable`` in
  release order (least recently released first); allocation evicts from the front.

Invariant, checked by :meth:`PageAllocator.check`: free + referenced + evictable == total, and no page
is in two states. Published pages are complete and immutable: a request writes only positions past
its consumed endpoint, so a page that was complete when published is never written again. Prefix
reuse is keyed by a hash chain over the cache identity and the token ids of each complete page (and, for
a page holding tokens of an image span, that image's digest and where its span starts), so a match is
exact for the whole prefix up to that page, images included. Running out of pages is a return value
(``None``), not an exception.

With a host tier (:class:`~helios_core.runtime.offload.HostPageStore`, ``--offload-pages``), evicting a
published page copies it into host memory instead of dropping it: its key stays in the prefix index,
held by the host tier, until the host tier drops it to make room (least recently used first). A prefix
match reports such a page as :data:`~helios_core.runtime.offload.HOST_RESIDENT`, and :meth:`PageAllocator.claim`
allocates a device page for it and copies it back before the request's first round reads it. Publishing
content the host tier holds frees the host copy (the device page supersedes it).

Listeners of the prefix index (:class:`PageEventSink`, attached with :meth:`PageAllocator.attach_events`)
hear every change of the set of reusable pages: a page published into the index with its key, its
parent's key and its exact token ids (only complete pages are ever published), a published page
leaving the index (evicted from the device without a host tier, dropped by the host tier, or evicted
while every host entry was pinned), and the whole index cleared when the listener is attached and
detached. Nothing is announced twice: a page whose key already has a page is not published, and every
announced page that leaves the index is announced as removed. A page moving between the device and the
host tier stays in the index and is not announced (it remains reusable here, which is what a
prefix-aware router needs to know). The listener is called on the model worker's thread and must
return at once (the KV-cache event publisher only puts the event on a bounded queue).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from helios_core.errors import HeliosError
from helios_core.runtime.messages import PromptImage
from helios_core.runtime.offload import HOST_RESIDENT, HostPageStore


def page_images(images: Sequence[PromptImage], start: int, page_tokens: int) -> tuple[tuple[int, bytes], ...]:
    """The image spans (of ``images``, in prompt order) that hold tokens of the page starting at position
    ``start``: each span's start relative to the page and its image digest (part of the page's key)."""
    if not images:
        return ()
    stop = start + page_tokens
    return tuple((image.start - start, image.digest) for image in images if image.start < stop and image.end > start)


def inside_span(images: Sequence[PromptImage], position: int) -> PromptImage | None:
    """The image whose span ``position`` cuts (a token of it before and one at or after), else None."""
    for image in images:
        if image.start < position < image.end:
            return image
    return None


class AllocatorError(HeliosError):
    """A page operation that breaks the allocator's rules (a bug in the caller)."""


class PageEventSink(Protocol):
    """A listener of the prefix index; every call is made on the model worker's thread and is O(1)."""

    def page_stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int], page_tokens: int) -> None:
        """A complete page holding ``tokens`` was published under ``key`` after the page keyed ``parent``
        (None: the first page of a prefix)."""

    def page_removed(self, key: bytes) -> None:
        """The page published under ``key`` (announced by :meth:`page_stored`) left the prefix index."""

    def all_cleared(self) -> None:
        """Forget every page announced before: the index starts empty (attaching) or ends (detaching)."""


@dataclass(frozen=True)
class PrefixMatch:
    """Complete pages whose content equals a prompt's prefix, and the chain hashes that keyed them."""

    pages: tuple[int, ...]
    """The device page of each matched page; :data:`HOST_RESIDENT` where the host tier holds it (a claim
    restores it into a device page)."""
    hashes: tuple[bytes, ...]
    tokens: int

    @property
    def host_pages(self) -> int:
        """Matched pages the host tier holds."""
        return self.pages.count(HOST_RESIDENT)


@dataclass
class PageStats:
    """Counters of page traffic (exported as metrics)."""

    allocated: int = 0
    published: int = 0
    evicted: int = 0
    prefix_queries: int = 0
    prefix_hit_pages: int = 0
    reused_tokens: int = 0


class PageAllocator:
    """Owns the physical pages of one model's cache."""

    def __init__(
        self, total_pages: int, page_tokens: int, cache_identity: str, *, host: HostPageStore | None = None
    ) -> None:
        if total_pages <= 0 or page_tokens <= 0:
            raise AllocatorError("a cache needs at least one page of at least one token")
        self.total_pages = total_pages
        self.page_tokens = page_tokens
        self._root = hashlib.blake2b(cache_identity.encode(), digest_size=16).digest()
        self._free: list[int] = list(range(total_pages - 1, -1, -1))  # pop() yields the lowest id
        self._refcount = [0] * total_pages
        self._referenced = 0
        """Pages with a reference count above zero (kept as counts change, read by every statistics snapshot)."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.stats = PageStats()
        self._events: PageEventSink | None = None
        self._unannounced: set[bytes] = set()
        """Keys published before the listener was attached: their leaving the index is not announced."""
        self.host = host
        """The host-memory tier evicted published pages move to (None: they are dropped)."""

    # -- queries ------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def referenced_pages(self) -> int:
        return self._referenced

    def available(self) -> int:
        """Pages an allocation can obtain now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def published_keys(self) -> frozenset[bytes]:
        """The keys of every page in the prefix index (on the device or in the host tier)."""
        if self.host is not None:
            return frozenset(self._page_of) | self.host.keys()
        return frozenset(self._page_of)

    def location(self, key: bytes) -> int | None:
        """Where the page published under ``key`` is: its device page, :data:`HOST_RESIDENT`, or None when
        the key is not in the prefix index."""
        page = self._page_of.get(key)
        if page is None and self.host is not None and key in self.host:
            return HOST_RESIDENT
        return page

    def eviction_order(self) -> list[int]:
        """Evictable device pages, next victim first (the host tier's order: ``host.eviction_order()``)."""
        return list(self._evictable)

    def chain_hash(
        self,
        previous: bytes | None,
        tokens: Sequence[int] | npt.NDArray[np.int64],
        images: Sequence[tuple[int, bytes]] = (),
    ) -> bytes:
        """The key of a complete page holding ``tokens`` after the prefix keyed ``previous``.

        ``images``: each image span that holds tokens of the page, as (its start relative to the page's
        first token, the image's digest) (:func:`page_images`); the same token ids from a different image
        make a different key."""
        digest = hashlib.blake2b(previous if previous is not None else self._root, digest_size=16)
        if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and tokens.flags.c_contiguous:
            digest.update(tokens.data)  # the same bytes as array("q", ...) of its ids: native int64
        else:
            try:
                digest.update(array("q", tokens))  # a page holds page_tokens ids: fixed width, one encoding per content
            except OverflowError:  # an id outside int64: spelled out instead
                digest.update(b"*" + ",".join(map(str, tokens)).encode())
        for start, image in images:  # after the fixed-width ids: one encoding per (ids, images)
            digest.update(b"#" + start.to_bytes(8, "little", signed=True) + len(image).to_bytes(4, "little") + image)
        return digest.digest()

    # -- check / act pairs ---------------------------------------------------------------------
    def can_allocate(self, count: int) -> bool:
        return count <= self.available()

    def allocate(self, count: int) -> list[int] | None:
        """``count`` private pages (refcount 1), or None when too few are free or evictable."""
        if count < 0:
            raise AllocatorError(f"cannot allocate {count} pages")
        if not self.can_allocate(count):
            return None
        pages: list[int] = []
        free, refcount = self._free, self._refcount
        for _ in range(count):
            if free:
                page = free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                key = self._hash_of.pop(page)
                del self._page_of[key]
                self.stats.evicted += 1
                for gone in self.host.store(key, page) if self.host is not None else (key,):
                    self._left_index(gone)
            refcount[page] = 1
            pages.append(page)
        self._referenced += count
        self.stats.allocated += count
        return pages

    def _left_index(self, key: bytes) -> None:
        """``key`` is no longer in the prefix index: announce it, unless it was never announced."""
        if self._events is not None:
            if key in self._unannounced:
                self._unannounced.discard(key)
            else:
                self._events.page_removed(key)

    def match_prefix(self, tokens: Sequence[int], max_tokens: int, images: Sequence[PromptImage] = ()) -> PrefixMatch:
        """The longest run of published complete pages equal to ``tokens[:max_tokens]``'s prefix, on the
        device or (:data:`HOST_RESIDENT`) in the host tier. ``images``: the prompt's images (their digests
        are part of the keys of the pages holding their spans). A lookup counts in the statistics only
        when a request is admitted with it (:meth:`count_reuse`)."""
        pages: list[int] = []
        hashes: list[bytes] = []
        previous: bytes | None = None
        step = self.page_tokens
        host = self.host
        for start in range(0, max_tokens - step + 1, step):
            key = self.chain_hash(previous, tokens[start : start + step], page_images(images, start, step))
            page = self._page_of.get(key)
            if page is None:
                if host is None or key not in host:
                    break
                page = HOST_RESIDENT
            pages.append(page)
            hashes.append(key)
            previous = key
        return PrefixMatch(tuple(pages), tuple(hashes), len(pages) * step)

    def claim(self, match: PrefixMatch) -> PrefixMatch | None:
        """Take a reference on each matched page (an evictable page becomes referenced again) and restore
        each page the host tier holds into a fresh private device page, published under its key again.

        Returns the match with every page on the device, or None, holding nothing, when too few device
        pages are free or evictable for the restores (a request needs a device page for each of its pages
        anyway, so its admission would have failed for lack of pages too)."""
        host = self.host
        for page, key in zip(match.pages, match.hashes, strict=True):
            if page == HOST_RESIDENT:
                if host is None or key not in host:
                    raise AllocatorError("a matched page is no longer in the host tier")
            elif self._hash_of.get(page) != key:
                raise AllocatorError(f"page {page} no longer holds the matched content")
        device = [page for page in match.pages if page != HOST_RESIDENT]
        for page in device:
            if self._refcount[page] == 0:
                del self._evictable[page]
                self._referenced += 1
            self._refcount[page] += 1
        if host is not None and len(device) < len(match.pages):
            restoring = [index for index, page in enumerate(match.pages) if page == HOST_RESIDENT]
            keys = [match.hashes[index] for index in restoring]
            host.pin(keys)  # the allocation below may evict device pages into the host tier
            try:
                fresh = self.allocate(len(restoring))
            finally:
                host.unpin(keys)
            if fresh is None:
                self.release(device)
                return None
            pages = list(match.pages)
            for index, key, page in zip(restoring, keys, fresh, strict=True):
                host.restore(key, page)
                self._page_of[key] = page
                self._hash_of[page] = key
                pages[index] = page
            match = PrefixMatch(tuple(pages), match.hashes, match.tokens)
        return match

    def count_reuse(self, claimed: PrefixMatch, reused_tokens: int) -> None:
        """Count one prefix lookup that admitted its request: the pages it claimed and the prompt tokens it
        reused (a checkpoint's tokens included). A lookup whose request could not be admitted yet (its claim
        released, the lookup repeated next round) is not counted, so every reused token counts once."""
        self.stats.prefix_queries += 1
        self.stats.prefix_hit_pages += len(claimed.pages)
        self.stats.reused_tokens += reused_tokens

    def publish(
        self, page: int, key: bytes, *, parent: bytes | None = None, tokens: Sequence[int] | None = None
    ) -> bool:
        """Record a referenced, complete page under ``key``; False when the key already has a page.

        ``key`` is :meth:`chain_hash` of (``parent``, ``tokens``): the attached listener hears both. A
        caller that publishes without ``tokens`` cannot be announced; with a listener attached that is
        an AllocatorError (a bug in the caller)."""
        if self._refcount[page] <= 0:
            raise AllocatorError(f"page {page} is published while nobody references it")
        if key in self._page_of or page in self._hash_of:
            return False
        events = self._events
        if events is not None and (tokens is None or len(tokens) != self.page_tokens):
            raise AllocatorError(
                f"page {page} is published without its {self.page_tokens} token ids while a listener is attached"
            )
        superseded = self.host is not None and self.host.discard(key)  # the device page replaces the host copy
        self._page_of[key] = page
        self._hash_of[page] = key
        self.stats.published += 1
        if events is not None and tokens is not None:
            if not superseded:
                events.page_stored(key, parent, tokens, self.page_tokens)
            elif key in self._unannounced:  # the host copy was never announced: the device page is
                self._unannounced.discard(key)
                events.page_stored(key, parent, tokens, self.page_tokens)
        return True

    # -- listeners ------------------------------------------------------------------------------
    @property
    def announces(self) -> bool:
        """Whether a listener is attached (publishing then needs each page's token ids)."""
        return self._events is not None

    def attach_events(self, sink: PageEventSink) -> None:
        """Announce every later change of the prefix index to ``sink``, after an ``all_cleared``.

        Attach before the engine serves requests. Pages published before are not announced (so their
        eviction is not either)."""
        if self._events is not None:
            raise AllocatorError("a prefix-index listener is attached already")
        self._unannounced = set(self.published_keys())
        sink.all_cleared()
        self._events = sink

    def detach_events(self) -> None:
        """Stop announcing, ending with ``all_cleared`` (at exit, once the model worker has stopped)."""
        sink, self._events = self._events, None
        self._unannounced = set()
        if sink is not None:
            sink.all_cleared()

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page; unreferenced pages become evictable or free.

        ``pages`` are in position order (a request's page table); they are released last page first,
        so a prefix's deeper pages are evicted before its head and a readmitted request still matches
        the head of its chain."""
        for page in reversed(pages):
            if self._refcount[page] <= 0:
                raise AllocatorError(f"page {page} is released more often than it was referenced")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._referenced -= 1
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def check(self) -> None:
        """Raise AllocatorError unless free + referenced + evictable == total with no overlap."""
        free, evictable = set(self._free), set(self._evictable)
        referenced = {p for p, count in enumerate(self._refcount) if count > 0}
        if len(free) != len(self._free):
            raise AllocatorError("a page is free twice")
        if free & evictable or free & referenced or evictable & referenced:
            raise AllocatorError("a page is in two states")
        if len(free) + len(evictable) + len(referenced) != self.total_pages:
            raise AllocatorError(
                f"free {len(free)} + referenced {len(referenced)} + evictable {len(evictable)} != "
                f"total {self.total_pages}"
            )
        if any(count < 0 for count in self._refcount):
            raise AllocatorError("a negative reference count")
        if len(referenced) != self._referenced:
            raise AllocatorError(f"{len(referenced)} referenced pages, counted {self._referenced}")
        if any(page not in self._hash_of for page in evictable):
            raise AllocatorError("an evictable page without published content")
        if self.host is not None:
            self.host.check()
            if not self.host.keys().isdisjoint(self._page_of):
                raise AllocatorError("a key is held both by a device page and by the host tier")
