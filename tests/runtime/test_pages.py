"""The page allocator: exact page ids, reference counts, prefix matches and eviction order."""

from __future__ import annotations

import pytest

from helios_core.runtime.pages import AllocatorError, PageAllocator


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocation_takes_lowest_free_ids_and_reports_shortage_as_none() -> None:
    pages = PageAllocator(4, 2, "id")
    assert pages.allocate(2) == [0, 1]
    assert pages.allocate(1) == [2]
    assert pages.allocate(2) is None
    assert (pages.free_pages, pages.referenced_pages, pages.evictable_pages) == (1, 3, 0)
    pages.release([1])
    assert pages.allocate(2) == [1, 3]  # a released page is reused first
    pages.check()


def test_published_pages_are_matched_claimed_and_evicted_in_release_order() -> None:
    pages = PageAllocator(4, 2, "id")
    owned = pages.allocate(3)
    assert owned == [0, 1, 2]
    prompt = tokens(6)
    keys = []
    previous = None
    for index, page in enumerate(owned):
        previous = pages.chain_hash(previous, prompt[2 * index : 2 * index + 2])
        keys.append(previous)
        assert pages.publish(page, previous)
    # A second request with the same first 5 tokens matches the two complete pages inside them.
    match = pages.match_prefix([*tokens(5), 99], max_tokens=5)
    assert (match.pages, match.tokens) == ((0, 1), 4)
    pages.claim(match)
    assert [pages.refcount(p) for p in range(4)] == [2, 2, 1, 0]
    # The first request finishes: its pages stay published; page 2 is now evictable.
    pages.release(owned)
    assert pages.eviction_order() == [2]
    pages.release(list(match.pages))
    assert pages.eviction_order() == [2, 1, 0]  # each release frees its last page first
    pages.check()
    # Allocation uses the free page first, then evicts the least recently released.
    assert pages.allocate(2) == [3, 2]
    assert pages.stats.evicted == 1
    assert pages.match_prefix(prompt, 6).pages == (0, 1)  # page 2's content is gone
    pages.check()


def test_a_released_chain_loses_its_tail_first_and_keeps_matching_its_head() -> None:
    """Releasing a request's pages last page first makes eviction take a prefix's deepest pages before
    its head, so the same prompt readmitted under page pressure still reuses the head of its chain."""
    pages = PageAllocator(4, 2, "id")
    owned = pages.allocate(4)
    prompt = tokens(8)
    previous = None
    for index, page in enumerate(owned):
        previous = pages.chain_hash(previous, prompt[2 * index : 2 * index + 2])
        assert pages.publish(page, previous)
    pages.release(owned)
    assert pages.eviction_order() == [3, 2, 1, 0]
    assert pages.allocate(1) == [3]  # pressure takes the deepest page
    match = pages.match_prefix(prompt, max_tokens=8)
    assert (match.pages, match.tokens) == ((0, 1, 2), 6)
    pages.check()


def test_a_different_prefix_never_matches_a_later_page() -> None:
    pages = PageAllocator(4, 2, "id")
    a = pages.allocate(2)
    first = pages.chain_hash(None, [1, 2])
    pages.publish(a[0], first)
    pages.publish(a[1], pages.chain_hash(first, [3, 4]))
    assert pages.match_prefix([9, 9, 3, 4], 4).pages == ()
    assert pages.match_prefix([1, 2, 3, 4], 4).pages == (a[0], a[1])


def test_cache_identity_separates_prefixes() -> None:
    one, other = PageAllocator(2, 2, "weights-a"), PageAllocator(2, 2, "weights-b")
    assert one.chain_hash(None, [1, 2]) != other.chain_hash(None, [1, 2])


def test_duplicate_content_is_published_once() -> None:
    pages = PageAllocator(4, 2, "id")
    a, b = pages.allocate(2)
    key = pages.chain_hash(None, [5, 6])
    assert pages.publish(a, key) is True
    assert pages.publish(b, key) is False
    pages.release([a, b])
    assert pages.eviction_order() == [a] and pages.free_pages == 3
    pages.check()


def test_misuse_is_an_allocator_error() -> None:
    pages = PageAllocator(2, 2, "id")
    (page,) = pages.allocate(1) or []
    pages.release([page])
    with pytest.raises(AllocatorError, match="released more often"):
        pages.release([page])
    with pytest.raises(AllocatorError, match="nobody references it"):
        pages.publish(page, b"k" * 16)
