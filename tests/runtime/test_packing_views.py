"""Page-table views with page offsets: each view places a lane's pages at its own columns of the
destination row, byte for byte, from lanes and from batches alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helios_core.contract import PreparedContract, PreparedGraph
from helios_core.runtime.packing import GraphPacker, Lane, PageTableMemory, Submission
from helios_core.wire import contract_pb2 as ct

from .packing_harness import payload_contract, poisoned_staging
from .test_lane_batches import constants, decode_batch


@pytest.fixture(scope="module")
def contract() -> PreparedContract:
    return payload_contract()


def with_views(graph: PreparedGraph, *views: tuple[int, int]) -> PreparedGraph:
    """``graph`` with page-table views (page offset, pages a row) over its ``page_table`` entry."""
    declared = tuple(
        ct.PageTableView(buffer="page_table", page_offset=offset, region="kv", pages_per_row=pages)
        for offset, pages in views
    )
    return dataclasses.replace(graph, page_table_views=declared)


def lane(slot: int, generation: int, pages: list[int]) -> Lane:
    return Lane(slot=slot, generation=generation, state_row=0, positions=[0], cache_slots=[0], page_table=pages)


def test_a_shifted_view_places_the_pages_after_its_offset(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    graph = with_views(contract.graphs["decode_b4"], (1, 15))
    GraphPacker(graph, staging).pack(Submission([lane(2, 5, [7, 3]), lane(0, 9, [1, 2, 4])], 1), 0, staging)
    assert staging["page_table"].tolist() == [
        [0, 7, 3] + [0] * 13,
        [0, 1, 2, 4] + [0] * 12,
        [0] * 16,
        [0] * 16,
    ]


def test_two_views_share_one_entry_side_by_side(contract: PreparedContract) -> None:
    """A target view of 7 pages at column 0 and a draft view of 8 pages at column 8: column 7 and the
    columns past each lane's pages hold the padding."""
    staging = poisoned_staging(contract)
    packer = GraphPacker(with_views(contract.graphs["decode_b4"], (0, 7), (8, 8)), staging)
    packer.pack(Submission([lane(2, 5, [7, 3]), lane(0, 9, [1, 2, 4])], 1), 0, staging)
    assert staging["page_table"].tolist() == [
        [7, 3, 0, 0, 0, 0, 0, 0, 7, 3, 0, 0, 0, 0, 0, 0],
        [1, 2, 4, 0, 0, 0, 0, 0, 1, 2, 4, 0, 0, 0, 0, 0],
        [0] * 16,
        [0] * 16,
    ]
    # The next round of the same lanes uploads only the new page of each view.
    staging["page_table"][0, [0, 8]] = 55
    packer.pack(Submission([lane(2, 5, [7, 3, 6]), lane(0, 9, [1, 2, 4])], 2), 0, staging)
    assert staging["page_table"][0].tolist() == [55, 3, 6, 0, 0, 0, 0, 0, 55, 3, 6, 0, 0, 0, 0, 0]


def test_a_lane_with_more_pages_than_its_view_holds_is_refused(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    packer = GraphPacker(with_views(contract.graphs["decode_b4"], (0, 7), (8, 3)), staging)
    with pytest.raises(ValueError, match=r"^lane 0 needs 4 pages; the page table holds 3$"):
        packer.pack(Submission([lane(2, 5, [7, 3, 6, 1])], 1), 0, staging)


@pytest.mark.parametrize("views", [((1, 15),), ((0, 7), (8, 8)), ((2, 6), (9, 7))])
def test_a_batch_stages_the_bytes_of_its_lanes_with_shifted_views(
    contract: PreparedContract, views: tuple[tuple[int, int], ...]
) -> None:
    rng = np.random.default_rng(len(views))
    graph = with_views(contract.graphs["decode_b4"], *views)
    other = with_views(contract.graphs["decode_b1"], *views)
    batch_staging, lane_staging = poisoned_staging(contract), poisoned_staging(contract)
    batch_memory, lane_memory = PageTableMemory(), PageTableMemory()
    by_batch, by_lanes = GraphPacker(graph, batch_staging, batch_memory), GraphPacker(graph, lane_staging, lane_memory)
    other_batch = GraphPacker(other, batch_staging, batch_memory)
    other_lanes = GraphPacker(other, lane_staging, lane_memory)
    tables = rng.integers(0, 60, (4, 16)).astype(np.int64)
    counts = np.array([2, 3, 1, 4], dtype=np.int64)
    rows = constants(rng, 3)
    positions = (counts[rows[ct.VALUE_SOURCE_SLOT]] * 4 - 2).astype(np.int32)
    for step in range(8):
        batch = decode_batch(rows, positions, tables, counts, step)
        for frame in (0, 1):
            by_batch.pack(Submission(batch, step), frame, batch_staging)
            by_lanes.pack(Submission(batch.to_lanes(), step), frame, lane_staging)
            assert batch_staging["page_table"].tobytes() == lane_staging["page_table"].tobytes()
        positions = positions + 1
        grow = positions // 4 >= counts[rows[ct.VALUE_SOURCE_SLOT]]
        counts[rows[ct.VALUE_SOURCE_SLOT][grow]] += 1
        if step == 3:  # another graph writes the same staging in between
            other_batch.pack(Submission([lane(9, 4242, [5, 6])], 99), 0, batch_staging)
            other_lanes.pack(Submission([lane(9, 4242, [5, 6])], 99), 0, lane_staging)
    table = lane_staging["page_table"]
    for row, slot in enumerate(rows[ct.VALUE_SOURCE_SLOT].tolist()):
        pages = tables[slot, : counts[slot]].tolist()
        for offset, width in views:
            assert table[row, offset : offset + len(pages)].tolist() == pages
            assert table[row, offset + len(pages) : offset + width].tolist() == [0] * (width - len(pages))
        covered = {column for offset, width in views for column in range(offset, offset + width)}
        assert [int(table[row, c]) for c in range(16) if c not in covered] == [0] * (16 - len(covered))
