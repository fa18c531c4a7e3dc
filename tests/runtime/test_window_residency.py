"""Page ownership with a sliding-window history, on the residency and slot table alone (nothing runs).

A :class:`Residency` over the golden fixture core's contract (pages of 4 tokens, 16 per row) with its
window set by hand: the release rule, the page-table row it leaves, publication before release, and the
pages a later request's prefix match may claim.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helios_core.contract import PreparedContract
from helios_core.loading import open_core
from helios_core.runtime.messages import PreparedRequest, SamplingParams
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.residency import Residency, history_window
from helios_core.runtime.slots import RequestState
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct

from .conftest import FIXTURES, fixture_settings

WINDOW = 6
"""Not a multiple of the page size: the boundary is exact, not page-rounded."""
PROMPT = list(range(10, 30))
"""20 tokens: 5 complete pages of 4."""


@pytest.fixture(scope="module")
def contract() -> Iterator[PreparedContract]:
    core = open_core(FIXTURES / "payload-v3.core", fixture_settings(), check_resources=False)
    yield core.contract
    core.close()


def residency(contract: PreparedContract, *, pages: int = 32) -> Residency:
    allocator = PageAllocator(pages, contract.model.cache.page_tokens, contract.serving.cache_identity)
    made = Residency(
        contract,
        allocator,
        SchedulerStats(),
        max_active=4,
        queue_capacity=8,
        snapshot_rows=0,
        scored_prefill=False,
        make_gate=None,
    )
    made.window = WINDOW
    return made


def admitted(where: Residency, request_id: str, prompt: list[int]) -> RequestState:
    where.add(PreparedRequest(request_id, prompt, 8, SamplingParams(temperature=0.0), ignore_eos=True))
    where.admit()
    state = where.running[-1]
    if state.request_id != request_id:
        raise AssertionError(f"{request_id} was not admitted")
    return state


def test_a_paged_core_declares_no_window(contract: PreparedContract) -> None:
    assert history_window(contract.model.cache) == 0


def test_the_window_is_read_from_the_sliding_window_region_the_page_table_addresses(
    contract: PreparedContract,
) -> None:
    cache = ct.CacheContract()
    cache.CopyFrom(contract.model.cache)
    region = next(r for r in cache.regions if r.name == cache.page_table_views[0].region)
    region.kind = ct.HISTORY_KIND_SLIDING_WINDOW
    region.window_tokens = 24
    assert history_window(cache) == 24
    cache.regions.add(name="other", kind=ct.HISTORY_KIND_PAGED_KV)
    cache.page_table_views.add(buffer="other_table", region="other", pages_per_row=1)
    assert history_window(cache) == 0  # a view of an unlimited history keeps every page


def test_pages_are_released_exactly_when_no_later_position_attends_them(contract: PreparedContract) -> None:
    where = residency(contract)
    state = admitted(where, "a", PROMPT)
    slot, table, allocator = state.slot, where.table, where.allocator
    row = table.page_list(slot)
    assert len(row) == 5 and allocator.referenced_pages == 5

    # consumed 8: the next position 8 attends 3..8, so page 0 (positions 0..3) is still attended
    table.consumed[slot] = 8
    where.release_outside_window()
    assert int(table.released[slot]) == 0 and allocator.referenced_pages == 5

    # consumed 9: position 9 attends 4..9 and later positions attend later windows: page 0 goes
    table.consumed[slot] = 9
    where.release_outside_window()
    assert int(table.released[slot]) == 1
    assert allocator.refcount(row[0]) == 0 and allocator.referenced_pages == 4
    assert table.held_pages(slot) == row[1:]
    assert table.page_list(slot) == row  # the packed row keeps every entry: positions still index it

    # consumed 17: position 17 attends 12..17: pages 0..2 are outside, page 3 (12..15) is not
    table.consumed[slot] = 17
    where.release_outside_window()
    assert int(table.released[slot]) == 3
    assert [allocator.refcount(p) for p in row] == [0, 0, 0, 1, 1]
    allocator.check()


def test_released_pages_are_published_first_and_stay_reusable(contract: PreparedContract) -> None:
    where = residency(contract)
    state = admitted(where, "a", PROMPT)
    slot, table, allocator = state.slot, where.table, where.allocator
    row = table.page_list(slot)
    table.consumed[slot] = 17
    where.release_outside_window()
    # every released page was hashed while held: the row's hashes cover them, and they are evictable
    assert len(table.hashes[slot]) >= 3
    assert set(allocator.eviction_order()) == set(row[:3])
    allocator.check()


def test_retiring_releases_only_the_pages_still_held(contract: PreparedContract) -> None:
    where = residency(contract)
    state = admitted(where, "a", PROMPT)
    slot, table, allocator = state.slot, where.table, where.allocator
    table.consumed[slot] = 20
    where.release_outside_window()
    assert int(table.released[slot]) == 3
    where.retire(state)  # a second release of pages 0..2 would raise AllocatorError
    assert allocator.referenced_pages == 0 and int(table.released[slot]) == 0
    allocator.check()


def test_a_later_prefix_match_claims_the_released_pages_it_attends(contract: PreparedContract) -> None:
    where = residency(contract)
    first = admitted(where, "a", PROMPT)
    slot, table = first.slot, where.table
    row = table.page_list(slot)
    table.consumed[slot] = 20
    where.release_outside_window()
    where.retire(first)

    second = admitted(where, "b", [*PROMPT, 99])
    assert second.reused_tokens == 20  # the whole chain from page 0: exact, no gap
    assert where.table.page_list(second.slot)[:5] == row
    # the match ends at 20: position 20 attends 15..20, so pages 0..2 were released again at admission
    assert int(where.table.released[second.slot]) == 3
    assert [where.allocator.refcount(p) for p in row] == [0, 0, 0, 1, 1]
    where.allocator.check()


def test_an_evicted_head_page_ends_the_match_at_page_zero(contract: PreparedContract) -> None:
    where = residency(contract, pages=8)
    first = admitted(where, "a", PROMPT)
    where.table.consumed[first.slot] = 20
    where.release_outside_window()
    where.retire(first)
    # allocation takes the 3 free pages, then evicts the least recently released: the early pages 2, 1, 0
    taken = where.allocator.allocate(6)
    assert taken is not None and where.allocator.stats.evicted == 3
    still_cached = where.allocator.eviction_order()
    assert len(still_cached) == 2  # pages 3 and 4 keep their content
    where.allocator.release(taken)

    second = admitted(where, "b", [*PROMPT, 99])
    assert second.reused_tokens == 0  # a chain without its head page matches nothing, so no gap is claimed
    assert all(where.allocator.refcount(p) == 0 for p in still_cached)
    where.allocator.check()
