"""The self-drafting operators: device positions, greedy drafts, confidence allocation, packed layout, record.

Each operator runs through the reference backend's node builders (``_ADAPTERS``) on exact inputs and is
compared with exact expected values; ``draft_allocate`` is also compared, over random cases, with an
independent statement of its rule (a global sort of every admissible proposal).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.reference import _ADAPTERS, _Bound, _Node
from helios_core.errors import ContractError
from helios_core.ops.catalogue import lookup
from helios_core.wire import manifest_pb2 as mf

ROOT = Path(__file__).resolve().parents[1]
PAGE_TOKENS = 4

_WIRE_DTYPES = {
    np.dtype(np.float32): mf.DTYPE_F32,
    np.dtype(np.int32): mf.DTYPE_I32,
    np.dtype(np.int64): mf.DTYPE_I64,
}


def _node(op: str, arrays: Mapping[str, np.ndarray], **attributes: int) -> Any:
    """The step of one reference node of ``op`` over ``arrays`` (bound as whole buffers)."""
    args = {name: _Bound(array, _WIRE_DTYPES[array.dtype]) for name, array in arrays.items()}
    return _ADAPTERS[(op, 1)](_Node(f"node {op}", args, attributes))


def _i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


PAGE_TABLE = np.array([[5, 9, 1], [2, 7, 0], [0, 0, 0]], dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# lane_positions
# ----------------------------------------------------------------------------------------------


def test_lane_positions_place_one_token_past_each_endpoint_within_its_limit() -> None:
    arrays = {
        "consumed": _i32(6, 3, 0),
        "page_table": PAGE_TABLE,
        "limit": _i32(4, 1, 0),
        "positions": np.full(3, 9, np.int32),
        "token_rows": np.full(3, 9, np.int32),
        "cache_slots": np.full(3, 9, np.int64),
    }
    _node("lane_positions", arrays, offset=1, page_tokens=PAGE_TOKENS)()
    # lane 0: position 7 = page 9 (index 1), offset 3; lane 1's limit 1 covers offset 0 only; lane 2 has none
    assert arrays["positions"].tolist() == [7, 0, 0]
    assert arrays["token_rows"].tolist() == [0, -1, -1]
    assert arrays["cache_slots"].tolist() == [9 * 4 + 3, -1, -1]
    _node("lane_positions", arrays, offset=0, page_tokens=PAGE_TOKENS)()
    assert arrays["positions"].tolist() == [6, 3, 0]
    assert arrays["token_rows"].tolist() == [0, 1, -1]
    assert arrays["cache_slots"].tolist() == [9 * 4 + 2, 2 * 4 + 3, -1]


def test_lane_positions_refuse_a_position_past_the_page_table() -> None:
    with pytest.raises(ValueError) as refused:
        rk.lane_positions(_i32(11), PAGE_TABLE[:1], _i32(3), offset=1, page_tokens=PAGE_TOKENS)
    assert str(refused.value) == "page_table: position 12 lies past the row's 3 pages"


# ----------------------------------------------------------------------------------------------
# draft_argmax
# ----------------------------------------------------------------------------------------------


def test_draft_argmax_chooses_the_lowest_best_id_below_the_limit_with_its_probability() -> None:
    logits = np.array([[0.5, 2.0, 2.0, 9.0], [1.0, -1.0, 0.0, 0.0], [3.0, 1.0, 2.0, 0.0]], dtype=np.float32)
    arrays = {
        "logits": logits,
        "token_rows": _i32(0, 1, -1),
        "ids": np.full(3, 9, np.int32),
        "confidence": np.full(3, 9, np.float32),
    }
    _node("draft_argmax", arrays, vocab_limit=3)()
    assert arrays["ids"].tolist() == [1, 0, 0]  # id 3 lies past the limit; ties go to the lower id
    wide = logits[:2, :3].astype(np.float64)
    expected = (np.exp(wide[[0, 1], [1, 0]]) / np.exp(wide).sum(axis=1)).astype(np.float32)
    np.testing.assert_allclose(arrays["confidence"][:2], expected, rtol=1e-7)
    assert float(arrays["confidence"][2]) == 0.0  # lane 2 drafted nothing at this step


def test_draft_argmax_refuses_a_non_finite_logit_of_a_drafting_lane() -> None:
    logits = np.array([[0.0, np.nan], [np.nan, 0.0]], dtype=np.float32)
    assert rk.draft_argmax(logits, 1, _i32(0, -1)).ids.tolist() == [0, 0]  # lane 1 does not draft
    with pytest.raises(ValueError) as refused:
        rk.draft_argmax(logits, 1, _i32(0, 1))
    assert str(refused.value) == "logits: a drafting lane has a non-finite logit"


# ----------------------------------------------------------------------------------------------
# draft_allocate
# ----------------------------------------------------------------------------------------------


def _allocate(confidence: list[list[float]], ceilings: list[int], packed: int, width: int) -> list[int]:
    arrays = {
        "confidence": np.array(confidence, dtype=np.float32),
        "ceilings": np.array(ceilings, dtype=np.int32),
        "query_length": np.full(len(ceilings), 9, np.int32),
    }
    _node("draft_allocate", arrays, packed_capacity=packed, token_capacity=width)()
    return list(arrays["query_length"].tolist())


def test_survival_is_multiplied_in_fp64_from_the_fp32_confidences() -> None:
    a, b = np.float32(0.9948649406433105), np.float32(0.6247325539588928)
    x, y = np.float32(0.9731219410896301), np.float32(0.6386913061141968)
    assert a * b == x * y  # in FP32 the two survivals tie (the tie would go to lane 0) ...
    assert np.float64(x) * np.float64(y) > np.float64(a) * np.float64(b)  # ... in FP64 lane 1 survives longer
    # Rows: one each; lane 0 (a > x); lane 1 (x > a b); then a b against x y: lane 1.
    assert _allocate([[float(a), float(b)], [float(x), float(y)]], [3, 3], packed=5, width=3) == [2, 3]


def test_ties_prefer_the_shorter_prefix_then_the_lower_lane() -> None:
    ones = [[1.0, 1.0]] * 3
    # lane 0 first (all tie at length one), then lane 1 (length one beats lane 0's length two)
    assert _allocate(ones, [3, 3, 3], packed=5, width=3) == [2, 2, 1]
    assert _allocate(ones, [3, 3, 3], packed=7, width=3) == [3, 2, 2]


def test_a_later_confidence_cannot_admit_a_position_before_its_predecessor() -> None:
    # Lane 0's second proposal is certain but its first is unlikely: only frontiers compete.
    assert _allocate([[0.1, 1.0], [0.5, 0.5]], [3, 3], packed=4, width=3) == [1, 3]
    assert _allocate([[0.1, 1.0], [0.5, 0.5]], [3, 3], packed=5, width=3) == [2, 3]


def test_each_lane_stops_at_its_ceiling_d_plus_one_and_w() -> None:
    confidence = [[0.9, 0.9, 0.9]] * 4
    # ceilings 2 and 0; lane 2 capped by W = 3 (below D + 1 = 4 and its ceiling 5); lane 3 by D + 1 = 4
    assert _allocate(confidence, [2, 0, 5, 6], packed=20, width=3) == [2, 0, 3, 3]
    assert _allocate(confidence, [2, 0, 5, 6], packed=20, width=8) == [2, 0, 4, 4]
    assert _allocate([[], []], [4, 1], packed=2, width=1) == [1, 1]  # width one: D = 0, the pending rows


def _oracle(confidence: np.ndarray, ceilings: np.ndarray, packed: int, width: int) -> list[int]:
    """The rule restated: with confidences in [0, 1] a lane's survival never grows, so admitting frontiers
    one at a time takes the first P - (lanes with tokens) of every admissible proposal sorted by
    (survival descending, prefix length, lane)."""
    lanes, drafts = confidence.shape
    lengths = [1 if c > 0 else 0 for c in ceilings.tolist()]
    candidates = []
    for lane in range(lanes):
        survival = 1.0
        for j in range(min(int(ceilings[lane]), drafts + 1, width) - 1):
            survival *= float(confidence[lane, j])
            candidates.append((-survival, j, lane))
    for _, _, lane in sorted(candidates)[: max(packed - sum(lengths), 0)]:
        lengths[lane] += 1
    return lengths


def test_random_allocations_follow_the_rule_and_fit_p() -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        lanes, drafts, width = int(rng.integers(1, 6)), int(rng.integers(0, 5)), int(rng.choice([1, 2, 4, 8]))
        ceilings = rng.integers(0, 9, size=lanes).astype(np.int32)
        active = int((ceilings > 0).sum())
        packed = int(rng.integers(max(active, 1), lanes * width + 2))
        confidence = rng.choice([0.0, 0.25, 0.5, 1.0, *rng.random(4)], size=(lanes, drafts)).astype(np.float32)
        found = rk.draft_allocate(confidence, ceilings, packed_capacity=packed, token_capacity=width)
        assert found.tolist() == _oracle(confidence, ceilings, packed, width)
        assert int(found.sum()) <= packed
        assert (found <= np.minimum(ceilings, min(drafts + 1, width))).all()


@pytest.mark.parametrize(
    ("confidence", "ceilings", "packed", "message"),
    [
        ([[0.5], [0.5]], [1, -1], 4, "ceilings: lane 1 has a negative ceiling"),
        ([[np.nan], [0.5]], [1, 1], 4, "confidence: values must be finite and non-negative"),
        ([[0.5], [0.5]], [2, 2], 1, "ceilings: 2 lanes with tokens exceed the 1 packed rows"),
    ],
)
def test_draft_allocate_refuses_bad_inputs(
    confidence: list[list[float]], ceilings: list[int], packed: int, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        rk.draft_allocate(
            np.array(confidence, np.float32), np.array(ceilings), packed_capacity=packed, token_capacity=2
        )
    assert str(refused.value) == message


# ----------------------------------------------------------------------------------------------
# speculative_layout
# ----------------------------------------------------------------------------------------------


def test_speculative_layout_packs_each_lane_s_block_and_pads_the_rest() -> None:
    arrays = {
        "query_length": _i32(3, 0, 1),
        "consumed": _i32(6, 5, 2),
        "page_table": PAGE_TABLE,
        "positions": np.full(6, 9, np.int32),
        "token_rows": np.full(6, 9, np.int32),
        "cache_slots": np.full(6, 9, np.int64),
    }
    _node("speculative_layout", arrays, page_tokens=PAGE_TOKENS)()
    assert arrays["positions"].tolist() == [6, 7, 8, 2, 0, 0]
    assert arrays["token_rows"].tolist() == [0, 0, 0, 2, -1, -1]
    assert arrays["cache_slots"].tolist() == [9 * 4 + 2, 9 * 4 + 3, 1 * 4 + 0, 0 * 4 + 2, -1, -1]


def test_speculative_layout_refuses_more_rows_than_p() -> None:
    arrays = {
        "query_length": _i32(4, 3, 0),
        "consumed": _i32(0, 0, 0),
        "page_table": PAGE_TABLE,
        "positions": np.zeros(6, np.int32),
        "token_rows": np.zeros(6, np.int32),
        "cache_slots": np.zeros(6, np.int64),
    }
    with pytest.raises(ValueError) as refused:
        _node("speculative_layout", arrays, page_tokens=PAGE_TOKENS)()
    assert str(refused.value) == "node speculative_layout: query_length: 7 packed rows exceed the 6 rows"


# ----------------------------------------------------------------------------------------------
# completion_self_draft
# ----------------------------------------------------------------------------------------------


def _record(lanes: int, draws: int) -> dict[str, np.ndarray]:
    outputs = ("out_generation", "out_offers", "out_accepted", "out_emitted", "out_consumed", "out_draft_cursor")
    found = {name: np.full(lanes, 7, np.int32) for name in (*outputs, "out_reserved")}
    found["out_sequence"] = np.full(1, 7, np.int64)
    found["out_confidence"] = np.full((2, lanes + 1, draws + 1), 7, np.float32)
    return found


def test_the_record_reports_offers_endpoints_the_cursor_and_framed_confidence() -> None:
    confidence = np.array([[0.5, 0.25], [0.75, 0.125], [0.0, 0.0]], dtype=np.float32)
    record = _record(3, 2)
    arrays = {
        "generation": _i32(4, 5, -1),
        "query_length": _i32(3, 2, 0),
        "accepted": _i32(1, 0, 0),
        "emitted": _i32(2, 0, 0),
        "consumed": _i32(1, 10, 0),
        "submission_sequence": np.array([99], np.int64),
        "confidence": confidence,
        "frame_index": _i32(1),
        **record,
    }
    _node("completion_self_draft", arrays, lag_tokens=2)()
    assert record["out_generation"].tolist() == [4, 5, -1]
    assert record["out_offers"].tolist() == [2, 1, 0]
    assert record["out_accepted"].tolist() == [1, 0, 0]
    assert record["out_emitted"].tolist() == [2, 0, 0]
    # lane 0 emitted: 1 + 1 + 1; lane 1 sampled nothing: it consumed its 2 rows; lane 2 had no rows
    assert record["out_consumed"].tolist() == [3, 12, 0]
    assert record["out_draft_cursor"].tolist() == [1, 10, -1]  # max(consumed - 2, 0); -1 without rows
    assert record["out_reserved"].tolist() == [-1, -1, -1]
    assert record["out_sequence"].tolist() == [99]
    assert (record["out_confidence"][1, :3, :2] == confidence).all()  # frame 1's half, rows in lane order
    assert (record["out_confidence"][0] == 7).all() and (record["out_confidence"][1, 3] == 7).all()
    assert (record["out_confidence"][1, :, 2] == 7).all()


def test_confidence_frame_and_storage_come_together() -> None:
    arrays = {
        "generation": _i32(4),
        "query_length": _i32(1),
        "accepted": _i32(0),
        "emitted": _i32(1),
        "consumed": _i32(3),
        "submission_sequence": np.array([1], np.int64),
        "confidence": np.zeros((1, 2), np.float32),
        **{k: v for k, v in _record(1, 2).items() if k != "out_confidence"},
    }
    with pytest.raises(ContractError) as refused:
        _node("completion_self_draft", arrays, lag_tokens=0)
    assert str(refused.value) == (
        "node completion_self_draft: confidence, frame_index and out_confidence are given together or not at all"
    )


# ----------------------------------------------------------------------------------------------
# documentation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op", ["lane_positions", "draft_argmax", "draft_allocate", "speculative_layout", "completion_self_draft"]
)
def test_the_summary_table_documents_the_signature(op: str) -> None:
    lines = (ROOT / "docs" / "ops.md").read_text().splitlines()
    cells = next(line for line in lines if line.startswith(f"| `{op}` |")).split("|")
    spec = lookup(op, 1)
    assert spec is not None
    names = [tuple(re.findall(r"`([a-z_]+)`", cell)) for cell in cells[2:6]]
    assert names == [spec.inputs, spec.outputs, spec.optional_inputs, spec.attributes]
    assert f"## {op} v1" in lines
