"""Shared packing: staged bytes compared exactly with hand-computed layouts."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from helios_core.contract import PreparedContract, PreparedGraph
from helios_core.errors import UnsupportedFeatureError
from helios_core.runtime.packing import GraphPacker, Lane, PageTableMemory, Submission
from helios_core.sampling import SamplingParams
from helios_core.wire import contract_pb2 as ct

from .packing_harness import POISON, payload_contract, poisoned_staging


@pytest.fixture(scope="module")
def contract() -> PreparedContract:
    return payload_contract()


MASK = np.arange(10, dtype=np.int32) * 3 + 1


def two_lanes() -> list[Lane]:
    return [
        Lane(
            slot=2, generation=5, state_row=1, positions=[0, 1, 2], cache_slots=[28, 29, 30], page_table=[7, 3],
            tokens=[10, 11, 12], sample=True, sampling=SamplingParams(
                temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.25,
                presence_penalty=-0.5, seed=2**63 + 5,
            ), sampling_step=0,
        ),
        Lane(
            slot=0, generation=9, state_row=3, positions=[5, 6], cache_slots=[9, 10], page_table=[1, 2, 4],
            tokens=[20, 21], sample=False, sampling=SamplingParams(seed=3), sampling_step=4, grammar_mask=MASK,
        ),
    ]  # fmt: skip


def test_every_source_and_indexing_of_a_prefill_program(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    packer = GraphPacker(contract.graphs["prefill_p16"], staging)
    packer.pack(Submission(two_lanes(), sequence=12), 0, staging)
    s = {name: array.tolist() for name, array in staging.items()}
    assert s["state_rows"] == [1, 3, -1, -1]
    assert s["generation"] == [5, 9, -1, -1]
    assert s["query_length"] == [3, 2, 0, 0]
    assert s["input_ids"] == [10, 11, 12, 20, 21] + [0] * 11
    assert s["positions"] == [0, 1, 2, 5, 6] + [0] * 11
    assert s["token_rows"] == [0, 0, 0, 1, 1] + [-1] * 11
    assert s["cache_slots"] == [28, 29, 30, 9, 10] + [-1] * 11
    assert s["page_table"] == [[7, 3] + [0] * 14, [1, 2, 4] + [0] * 13, [0] * 16, [0] * 16]
    assert s["sample_active"] == [1, 0, 0, 0]
    assert s["temperature"] == [0.5, 1.0, 0.0, 0.0]
    assert s["top_p"] == pytest.approx([0.9, 1.0, 1.0, 1.0])
    assert s["top_k"] == [40, 0, 0, 0]
    assert s["min_p"] == pytest.approx([0.05, 0.0, 0.0, 0.0])
    assert s["repetition_penalty"] == pytest.approx([1.1, 1.0, 1.0, 1.0])
    assert s["frequency_penalty"] == [0.25, 0.0, 0.0, 0.0]
    assert s["presence_penalty"] == [-0.5, 0.0, 0.0, 0.0]
    assert s["seed"] == [2**63 + 5, 3, 0, 0]
    assert s["sampling_step"] == [0, 4, 0, 0]
    assert s["grammar_mask"] == [[-1] * 10, MASK.tolist(), [-1] * 10, [-1] * 10]
    assert s["constrained"] == [0, 1, 0, 0]
    # Entries this graph does not bind keep their bytes (omitted transfers retain device bytes).
    assert s["prompt_histogram"] == [[POISON] * 320] * 4
    assert s["score_targets"] == [POISON] * 16
    assert s["submission_sequence"] == [POISON]


def test_active_row_indexing_leaves_the_inactive_tail(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    histogram = np.zeros(320, dtype=np.uint8)
    histogram[[3, 5]] = [2, 1]
    lane = Lane(
        slot=1, generation=2, state_row=1, positions=[], cache_slots=[], page_table=[], prompt_histogram=histogram
    )
    GraphPacker(contract.graphs["initialize"], staging).pack(Submission([lane], 1), 0, staging)
    assert staging["prompt_histogram"][0].tolist() == histogram.tolist()
    assert staging["prompt_histogram"][1:].tolist() == [[POISON] * 320] * 3
    assert staging["state_rows"].tolist() == [1, -1, -1, -1]


def test_page_tables_upload_only_new_entries_until_the_generation_changes(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    packer = GraphPacker(contract.graphs["decode_b1"], staging)
    table = staging["page_table"]

    def lane(pages: list[int], generation: int) -> Lane:
        return Lane(slot=2, generation=generation, state_row=0, positions=[0], cache_slots=[0], page_table=pages)

    packer.pack(Submission([lane([7, 3], 5)], 1), 0, staging)
    assert table[0, :4].tolist() == [7, 3, 0, 0]
    table[0, :2] = 55  # what is already staged must not be written again
    packer.pack(Submission([lane([7, 3, 9], 5)], 2), 0, staging)
    assert table[0, :4].tolist() == [55, 55, 9, 0]
    # The same physical slot under a new generation is a different request: the row is rewritten.
    packer.pack(Submission([lane([8], 6)], 3), 0, staging)
    assert table[0, :4].tolist() == [8, 0, 0, 0]
    # Each frame has its own staging and its own memory of it.
    other = poisoned_staging(contract)
    packer.pack(Submission([lane([8, 1], 6)], 4), 1, other)
    assert other["page_table"][0, :3].tolist() == [8, 1, 0]


def _with_bindings(graph: PreparedGraph, *bindings: ct.ValueBinding) -> PreparedGraph:
    contract = ct.GraphContract()
    contract.CopyFrom(graph.contract)
    del contract.bindings[:]
    contract.bindings.extend(bindings)
    return dataclasses.replace(graph, contract=contract)


def test_scalar_physical_row_constant_and_row_count(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    bind = ct.ValueBinding
    graph = _with_bindings(
        contract.graphs["prefill_p16"],
        bind(destination="top_k", source=ct.VALUE_SOURCE_SLOT, indexing=ct.INDEXING_PHYSICAL_REQUEST_ROW, offset=100),
        bind(destination="frame_index", source=ct.VALUE_SOURCE_LIVE_ROW_COUNT, indexing=ct.INDEXING_SCALAR),
        bind(destination="state_rows", source=ct.VALUE_SOURCE_CONSTANT, indexing=ct.INDEXING_SCALAR, constant=41),
        bind(
            destination="generation",
            source=ct.VALUE_SOURCE_INACTIVE_PADDING,
            indexing=ct.INDEXING_SUBMISSION_ROW,
            padding=-3,
        ),
        bind(destination="query_length", source=ct.VALUE_SOURCE_GENERATION, indexing=ct.INDEXING_SCALAR),
    )
    GraphPacker(graph, staging).pack(Submission(two_lanes(), 1), 0, staging)
    assert staging["top_k"].tolist() == [100, POISON, 102, POISON]  # slots 0 and 2, offset 100
    assert staging["frame_index"].tolist() == [2]
    assert staging["state_rows"].tolist() == [41, POISON, POISON, POISON]
    assert staging["generation"].tolist() == [-3, -3, -3, -3]
    assert staging["query_length"].tolist() == [5, POISON, POISON, POISON]


def test_packing_refuses_what_does_not_fit(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    packer = GraphPacker(contract.graphs["decode_b1"], staging)
    with pytest.raises(ValueError, match="exceed 'decode_b1'"):
        packer.pack(Submission(two_lanes(), 1), 0, staging)
    prefill = GraphPacker(contract.graphs["prefill_p16"], staging)
    broken = two_lanes()
    broken[0] = msgspec.structs.replace(broken[0], tokens=[1])
    with pytest.raises(ValueError, match="supplies 1 values for 'input_ids'"):
        prefill.pack(Submission(broken, 1), 0, staging)


def test_a_source_packing_cannot_supply_fails_at_startup(contract: PreparedContract) -> None:
    graph = _with_bindings(
        contract.graphs["decode_b1"],
        ct.ValueBinding(
            destination="input_ids",
            source=ct.VALUE_SOURCE_UNSPECIFIED,
            indexing=ct.INDEXING_PACKED_TOKEN,
        ),
    )
    with pytest.raises(UnsupportedFeatureError, match="binds VALUE_SOURCE_UNSPECIFIED, which this runtime"):
        GraphPacker(graph, poisoned_staging(contract))
    per_lane = _with_bindings(
        contract.graphs["decode_b1"],
        ct.ValueBinding(
            destination="grammar_mask",
            source=ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS,
            indexing=ct.INDEXING_SUBMISSION_ROW,
        ),
    )
    with pytest.raises(
        UnsupportedFeatureError,
        match="binds VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS with INDEXING_SUBMISSION_ROW; packing supplies it per "
        "packed token only",
    ):
        GraphPacker(per_lane, poisoned_staging(contract))


def _candidate_mask_packer(contract: PreparedContract) -> tuple[GraphPacker, dict[str, np.ndarray]]:
    """``prefill_p16`` binding per-position masks into a [16, 10] entry and CONSTRAINED per lane."""
    staging = poisoned_staging(contract)
    staging["candidate_masks"] = np.full((16, 10), POISON, dtype=np.int32)
    graph = _with_bindings(
        contract.graphs["prefill_p16"],
        ct.ValueBinding(
            destination="candidate_masks",
            source=ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS,
            indexing=ct.INDEXING_PACKED_TOKEN,
            padding=-1,
        ),
        ct.ValueBinding(
            destination="constrained", source=ct.VALUE_SOURCE_CONSTRAINED, indexing=ct.INDEXING_SUBMISSION_ROW
        ),
    )
    return GraphPacker(graph, staging), staging


def test_candidate_grammar_masks_are_staged_a_row_a_packed_token(contract: PreparedContract) -> None:
    packer, staging = _candidate_mask_packer(contract)
    first, second = MASK, MASK[:7] + 100  # a shorter row is padded like GRAMMAR_MASK's
    constrained = msgspec.structs.replace(two_lanes()[0], candidate_masks=[first, None, second])
    plain = msgspec.structs.replace(two_lanes()[1], grammar_mask=None)
    packer.pack(Submission([constrained, plain], 1), 0, staging)
    rows = staging["candidate_masks"].tolist()
    assert rows[0] == MASK.tolist()
    assert rows[1] == [-1] * 10  # None: every id
    assert rows[2] == (MASK[:7] + 100).tolist() + [-1] * 3
    assert rows[3:] == [[-1] * 10] * 13  # the unconstrained lane's two tokens and the rows past the lanes
    assert staging["constrained"].tolist() == [1, 0, 0, 0]


def test_candidate_grammar_masks_must_cover_every_packed_token(contract: PreparedContract) -> None:
    packer, staging = _candidate_mask_packer(contract)
    short = msgspec.structs.replace(two_lanes()[0], candidate_masks=[MASK, MASK])
    message = r"^lane 0 supplies 2 values for 'candidate_masks', but its query length is 3$"
    with pytest.raises(ValueError, match=message):
        packer.pack(Submission([short], 1), 0, staging)


def test_page_table_memory_is_shared_by_every_graph_of_a_frame(contract: PreparedContract) -> None:
    staging = poisoned_staging(contract)
    memory = PageTableMemory()
    decode = GraphPacker(contract.graphs["decode_b1"], staging, memory)
    prefill = GraphPacker(contract.graphs["prefill_p16"], staging, memory)

    def lane(slot: int, generation: int, pages: list[int]) -> Lane:
        return Lane(
            slot=slot, generation=generation, state_row=0, positions=[0], cache_slots=[0], page_table=pages, tokens=[1]
        )

    decode.pack(Submission([lane(1, 1, [4, 5])], 1), 0, staging)
    prefill.pack(Submission([lane(2, 7, [9])], 2), 0, staging)  # another request takes row 0
    decode.pack(Submission([lane(1, 1, [4, 5, 6])], 3), 0, staging)
    # Row 0 held the other request's table, so the whole table is uploaded again.
    assert staging["page_table"][0, :4].tolist() == [4, 5, 6, 0]


def test_lanes_as_the_planner_builds_them_pack_the_bytes_of_their_lists(contract: PreparedContract) -> None:
    """The planner hands positions over as a range and cache slots and tokens as arrays: they pack
    exactly as lists of the same values."""
    as_lists = two_lanes()
    as_planned = [
        msgspec.structs.replace(
            lane,
            positions=range(lane.positions[0], lane.positions[-1] + 1),
            cache_slots=np.asarray(lane.cache_slots, dtype=np.int64),
            tokens=np.asarray(lane.tokens, dtype=np.int32),
        )
        for lane in as_lists
    ]
    packed = []
    for lanes in (as_lists, as_planned):
        staging = poisoned_staging(contract)
        GraphPacker(contract.graphs["prefill_p16"], staging).pack(Submission(lanes, sequence=3), 0, staging)
        packed.append({name: array.tolist() for name, array in staging.items()})
    assert packed[1] == packed[0]
    assert packed[1]["positions"][:5] == [0, 1, 2, 5, 6] and packed[1]["token_rows"][:6] == [0, 0, 0, 1, 1, -1]


def test_padded_grammar_mask_rows_are_not_written_again_until_a_mask_or_another_graph_used_them(
    contract: PreparedContract,
) -> None:
    """A mask row is a vocabulary's worth of words: rows already holding padding are left alone."""
    staging = poisoned_staging(contract)
    memory = PageTableMemory()
    prefill = GraphPacker(contract.graphs["prefill_p16"], staging, memory)
    decode = GraphPacker(contract.graphs["decode_b1"], staging, memory)
    masks = staging["grammar_mask"]
    lanes = two_lanes()  # the second lane is constrained
    prefill.pack(Submission(lanes, 1), 0, staging)
    assert masks.tolist() == [[-1] * 10, MASK.tolist(), [-1] * 10, [-1] * 10]
    masks[[0, 2, 3]] = 77  # what already holds padding must not be written again
    prefill.pack(Submission(lanes, 2), 0, staging)
    assert masks.tolist() == [[77] * 10, MASK.tolist(), [77] * 10, [77] * 10]
    # The row that held a mask is padded once its lane no longer has one.
    unconstrained = [lanes[0], msgspec.structs.replace(lanes[1], grammar_mask=None)]
    prefill.pack(Submission(unconstrained, 3), 0, staging)
    assert masks[1].tolist() == [-1] * 10 and masks[0].tolist() == [77] * 10
    # Another graph of the same frame staging a mask in row 0: the next unconstrained row 0 is padded.
    moved = msgspec.structs.replace(lanes[1], positions=[5], cache_slots=[9], tokens=[20])
    decode.pack(Submission([moved], 4), 0, staging)
    assert masks[0].tolist() == MASK.tolist()
    prefill.pack(Submission(unconstrained, 5), 0, staging)
    assert masks[0].tolist() == [-1] * 10 and masks[2].tolist() == [77] * 10
    # Another frame has its own staging and memory; a forgotten frame is written in full.
    other = poisoned_staging(contract)
    prefill.pack(Submission(unconstrained, 6), 1, other)
    assert other["grammar_mask"].tolist() == [[-1] * 10] * 4
    memory.forget(0)
    prefill.pack(Submission(unconstrained, 7), 0, staging)
    assert masks.tolist() == [[-1] * 10] * 4
