"""The prefix index's listener: what the page allocator announces when pages are published and evicted."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from helios_core.runtime.pages import AllocatorError, PageAllocator


class Recorder:
    """A listener keeping every call, and the index the calls describe."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.index: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}

    def page_stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int], page_tokens: int) -> None:
        self.calls.append(("stored", key, parent, tuple(tokens), page_tokens))
        if key in self.index:
            raise AssertionError("a page announced twice")
        self.index[key] = (parent, tuple(tokens))

    def page_removed(self, key: bytes) -> None:
        self.calls.append(("removed", key))
        if self.index.pop(key, None) is None:
            raise AssertionError("a page removed that was never announced")

    def all_cleared(self) -> None:
        self.calls.append(("cleared",))
        self.index.clear()


def publish_prompt(pages: PageAllocator, prompt: Sequence[int]) -> tuple[list[int], list[bytes]]:
    """Allocate the complete pages of ``prompt``, publish them as residency does, return pages and keys."""
    step = pages.page_tokens
    count = len(prompt) // step
    owned = pages.allocate(count)
    if owned is None:
        raise AssertionError("no room")
    keys: list[bytes] = []
    parent: bytes | None = None
    for index, page in enumerate(owned):
        chunk = list(prompt[index * step : (index + 1) * step])
        key = pages.chain_hash(parent, chunk)
        pages.publish(page, key, parent=parent, tokens=chunk)
        keys.append(key)
        parent = key
    return owned, keys


def test_attaching_clears_then_publication_announces_key_parent_and_exact_tokens() -> None:
    pages = PageAllocator(4, 2, "id")
    recorder = Recorder()
    pages.attach_events(recorder)
    owned, keys = publish_prompt(pages, [5, 6, 7, 8, 9])  # two complete pages; the fifth token is not published
    assert owned == [0, 1]
    assert recorder.calls == [
        ("cleared",),
        ("stored", keys[0], None, (5, 6), 2),
        ("stored", keys[1], keys[0], (7, 8), 2),
    ]


def test_a_page_key_is_the_same_from_an_int64_array_as_from_its_ids() -> None:
    """Residency hashes a slot's pages from its token row (int64 views); prefix matching hashes a prompt's
    ids: both must give one key, and ids outside int64 still get a key of their own."""
    pages = PageAllocator(4, 4, "id")
    ids = [5, 2**40, -3, 0]
    parent = pages.chain_hash(None, [1, 2, 3, 4])
    assert pages.chain_hash(parent, np.array(ids, dtype=np.int64)) == pages.chain_hash(parent, ids)
    row = np.array([9, *ids, 9], dtype=np.int64)
    assert pages.chain_hash(parent, row[1:5]) == pages.chain_hash(parent, ids)
    assert pages.chain_hash(parent, np.array([5, -3, 0], dtype=np.int32)) == pages.chain_hash(parent, [5, -3, 0])
    strided = np.array([5, 0, 2**40, 0, -3, 0, 0, 0], dtype=np.int64)[::2]  # not contiguous: read id by id
    assert pages.chain_hash(parent, strided) == pages.chain_hash(parent, ids)
    assert pages.chain_hash(parent, [2**64, 1, 2, 3]) != pages.chain_hash(parent, [0, 1, 2, 3])


def test_eviction_announces_removal_of_each_announced_page_once() -> None:
    pages = PageAllocator(3, 2, "id")
    recorder = Recorder()
    pages.attach_events(recorder)
    owned, keys = publish_prompt(pages, [1, 2, 3, 4])
    pages.release(owned)  # both evictable, the deeper page first in line
    assert recorder.calls[-1][0] == "stored"
    assert pages.allocate(2) == [2, 1]  # the free page, then the deeper published page is evicted
    assert recorder.calls[-1] == ("removed", keys[1])
    assert pages.allocate(1) == [0]
    assert recorder.calls[-1] == ("removed", keys[0])
    assert recorder.index == {}
    assert [call[0] for call in recorder.calls] == ["cleared", "stored", "stored", "removed", "removed"]


def test_a_key_already_published_is_not_announced_again() -> None:
    pages = PageAllocator(4, 2, "id")
    recorder = Recorder()
    pages.attach_events(recorder)
    first, second = pages.allocate(2) or []
    key = pages.chain_hash(None, [3, 4])
    assert pages.publish(first, key, parent=None, tokens=[3, 4]) is True
    assert pages.publish(second, key, parent=None, tokens=[3, 4]) is False
    assert pages.publish(first, key, parent=None, tokens=[3, 4]) is False
    assert [call[0] for call in recorder.calls] == ["cleared", "stored"]
    pages.release([second])  # never published: freed, nothing to announce
    assert pages.allocate(2) is not None
    assert [call[0] for call in recorder.calls] == ["cleared", "stored"]


def test_only_complete_pages_with_their_tokens_can_be_announced() -> None:
    pages = PageAllocator(4, 2, "id")
    pages.attach_events(Recorder())
    page = (pages.allocate(1) or [])[0]
    with pytest.raises(AllocatorError, match="without its 2 token ids"):
        pages.publish(page, pages.chain_hash(None, [1, 2]))
    with pytest.raises(AllocatorError, match="without its 2 token ids"):
        pages.publish(page, pages.chain_hash(None, [1]), tokens=[1])
    assert pages.match_prefix([1, 2, 3], 3).pages == ()  # nothing was published


def test_pages_published_before_attaching_are_never_announced() -> None:
    pages = PageAllocator(2, 2, "id")
    early, _ = publish_prompt(pages, [1, 2])
    pages.release(early)
    recorder = Recorder()
    pages.attach_events(recorder)
    assert pages.allocate(2) is not None  # evicts the page published before: not announced
    assert recorder.calls == [("cleared",)]


def test_detaching_clears_and_stops_announcing() -> None:
    pages = PageAllocator(4, 2, "id")
    recorder = Recorder()
    pages.attach_events(recorder)
    with pytest.raises(AllocatorError, match="attached already"):
        pages.attach_events(Recorder())
    owned, _ = publish_prompt(pages, [1, 2])
    pages.detach_events()
    assert recorder.calls[-1] == ("cleared",)
    publish_prompt(pages, [3, 4])
    pages.release(owned)
    assert [call[0] for call in recorder.calls] == ["cleared", "stored", "cleared"]


def test_the_announced_index_equals_the_published_index_through_random_traffic() -> None:
    """Random prompts over a small vocabulary share prefixes; a small cache evicts often. After every
    step the listener's index (rebuilt from the calls alone) holds exactly the keys the allocator can
    match, and each announced key is the chain hash of its announced parent and tokens."""
    rng = random.Random(11)
    pages = PageAllocator(12, 2, "fleet")
    recorder = Recorder()
    pages.attach_events(recorder)
    held: list[list[int]] = []
    for _ in range(400):
        if held and (rng.random() < 0.5 or pages.available() < 4):
            pages.release(held.pop(rng.randrange(len(held))))
        else:
            prompt = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 4))]
            match = pages.match_prefix(prompt, len(prompt))
            pages.claim(match)
            fresh = pages.allocate(len(prompt) // 2 - len(match.pages))
            if fresh is None:
                pages.release(match.pages)
                continue
            owned = [*match.pages, *fresh]
            parent = match.hashes[-1] if match.hashes else None
            for index in range(len(match.pages), len(owned)):
                chunk = prompt[2 * index : 2 * index + 2]
                key = pages.chain_hash(parent, chunk)
                pages.publish(owned[index], key, parent=parent, tokens=chunk)
                parent = key
            held.append(owned)
        pages.check()
        assert set(recorder.index) == pages.published_keys()
        for key, (parent, tokens) in recorder.index.items():
            assert pages.chain_hash(parent, tokens) == key
    assert pages.stats.evicted > 20
