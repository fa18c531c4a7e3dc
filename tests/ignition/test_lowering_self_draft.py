"""The greedy self-drafting operators lower to sm_90a launches on a machine without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.build import assemble
from ignition.kernels import self_draft
from ignition.kernels.lowering import LOWERINGS, LoweringContext, LoweringError
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import lower

LANES = 4
PAGES = 9
SELF_DRAFT_OPS = ("lane_positions", "draft_argmax", "draft_allocate", "speculative_layout", "completion_self_draft")


def _check_launch(launch: mf.KernelLaunch, symbol: str, grid: tuple[int, int, int]) -> None:
    assert launch.target == "sm_90a"
    assert launch.symbol == symbol
    assert tuple(launch.grid) == grid
    assert launch.programmatic_wait
    assert 0 <= launch.shared_bytes <= 227 * 1024


def _named(launch: mf.KernelLaunch) -> list[str]:
    return [p.buffer for p in launch.params if p.kind == mf.PARAM_KIND_ADDRESS and p.buffer]


def _scalars(launch: mf.KernelLaunch) -> list[int]:
    return [int(p.int_value) for p in launch.params if p.kind == mf.PARAM_KIND_I32]


def _layout_arrays(lanes: int, rows: int) -> dict[str, Any]:
    return {
        "positions": np.zeros(rows, np.int32),
        "token_rows": np.zeros(rows, np.int32),
        "cache_slots": np.zeros(rows, np.int64),
    }


def _positions_arrays() -> dict[str, Any]:
    return {
        "consumed": np.zeros(LANES, np.int32),
        "page_table": np.zeros((LANES, PAGES), np.int32),
        "limit": np.zeros(LANES, np.int32),
        **_layout_arrays(LANES, LANES),
    }


def test_lane_positions_is_one_program_and_every_offset_shares_its_module() -> None:
    launches = [lower("lane_positions", _positions_arrays(), {"offset": i, "page_tokens": 4})[1] for i in range(3)]
    for offset, (launch,) in enumerate(launches):
        _check_launch(launch, "_lane_positions_kernel", (1, 1, 1))
        assert _named(launch) == ["consumed", "page_table", "limit", "positions", "token_rows", "cache_slots"]
        assert _scalars(launch) == [offset]  # the offset is a runtime scalar
    assert len({launch.module for (launch,) in launches}) == 1


def _argmax_arrays(vocab: int, *, rows: bool = True) -> dict[str, Any]:
    arrays: dict[str, Any] = {"logits": np.zeros((LANES, vocab), np.float32)}
    if rows:
        arrays["token_rows"] = np.zeros(LANES, np.int32)
    arrays.update(ids=np.zeros(LANES, np.int32), confidence=np.zeros(LANES, np.float32))
    return arrays


def test_draft_argmax_is_one_program_a_lane() -> None:
    _, (launch,) = lower("draft_argmax", _argmax_arrays(320), {"vocab_limit": 300})
    _check_launch(launch, "_draft_argmax_kernel", (LANES, 1, 1))
    assert _named(launch) == ["logits", "token_rows", "ids", "confidence"]
    # without token_rows every lane drafts; the parameter is bound to ids and never read
    _, (plain,) = lower("draft_argmax", _argmax_arrays(49152, rows=False), {"vocab_limit": 49152})
    _check_launch(plain, "_draft_argmax_kernel", (LANES, 1, 1))
    assert _named(plain) == ["logits", "ids", "ids", "confidence"]
    assert plain.block[0] == 32 * 8  # a 4096-wide chunk of the row: eight warps


def _allocate_arrays(drafts: int) -> dict[str, Any]:
    return {
        "confidence": np.zeros((LANES, drafts), np.float32),
        "ceilings": np.zeros(LANES, np.int32),
        "query_length": np.zeros(LANES, np.int32),
    }


@pytest.mark.parametrize("drafts", [0, 3])
def test_draft_allocate_is_one_program(drafts: int) -> None:
    _, (launch,) = lower("draft_allocate", _allocate_arrays(drafts), {"packed_capacity": 6, "token_capacity": 4})
    _check_launch(launch, "_draft_allocate_kernel", (1, 1, 1))
    assert _named(launch) == ["confidence", "ceilings", "query_length"]


def test_speculative_layout_covers_the_packed_rows_in_blocks() -> None:
    arrays = {
        "query_length": np.zeros(LANES, np.int32),
        "consumed": np.zeros(LANES, np.int32),
        "page_table": np.zeros((LANES, PAGES), np.int32),
        **_layout_arrays(LANES, 20),
    }
    _, (launch,) = lower("speculative_layout", arrays, {"page_tokens": 16})
    _check_launch(launch, "_speculative_layout_kernel", (1, 1, 1))
    assert _named(launch) == ["query_length", "consumed", "page_table", "positions", "token_rows", "cache_slots"]
    many = {**arrays, "query_length": np.zeros(1024, np.int32), "consumed": np.zeros(1024, np.int32)}
    many.update(page_table=np.zeros((1024, PAGES), np.int32), **_layout_arrays(1024, 3000))
    _, (wide,) = lower("speculative_layout", many, {"page_tokens": 16})
    block = self_draft.LAYOUT_TILE // 1024  # every lane in each program: four rows a program
    _check_launch(wide, "_speculative_layout_kernel", (-(-3000 // block), 1, 1))


RECORD = ("out_generation", "out_offers", "out_accepted", "out_emitted", "out_consumed", "out_draft_cursor")


def _record_arrays(drafts: int | None) -> dict[str, Any]:
    arrays: dict[str, Any] = {
        name: np.zeros(LANES, np.int32)
        for name in ("generation", "query_length", "accepted", "emitted", "consumed", *RECORD, "out_reserved")
    }
    arrays["submission_sequence"] = np.zeros(1, np.int64)
    arrays["out_sequence"] = np.zeros(1, np.int64)
    if drafts is not None:
        arrays["confidence"] = np.zeros((LANES, drafts), np.float32)
        arrays["frame_index"] = np.zeros(1, np.int32)
        arrays["out_confidence"] = np.zeros((2, LANES + 4, drafts + 1), np.float32)
    return arrays


def test_completion_self_draft_is_one_program_with_or_without_confidences() -> None:
    _, (framed,) = lower("completion_self_draft", _record_arrays(3), {"lag_tokens": 2})
    _check_launch(framed, "_completion_self_draft_kernel", (1, 1, 1))
    assert _named(framed) == [
        "generation", "query_length", "accepted", "emitted", "consumed", "submission_sequence", "confidence",
        "frame_index", *RECORD, "out_reserved", "out_sequence", "out_confidence",
    ]  # fmt: skip
    assert _scalars(framed) == [2]  # lag_tokens
    _, (plain,) = lower("completion_self_draft", _record_arrays(None), {"lag_tokens": 0})
    _check_launch(plain, "_completion_self_draft_kernel", (1, 1, 1))
    names = _named(plain)
    assert "out_confidence" not in names and names[6:8] == ["generation", "generation"]  # never read
    assert framed.module != plain.module


@pytest.mark.parametrize(
    ("op", "arrays", "attributes", "message"),
    [
        (
            "lane_positions",
            _positions_arrays(),
            {"offset": -1, "page_tokens": 4},
            "attribute offset: expected a non-neg",
        ),
        (
            "lane_positions",
            _positions_arrays(),
            {"offset": 0, "page_tokens": 0},
            "attribute page_tokens: expected a pos",
        ),
        (
            "lane_positions",
            {**_positions_arrays(), "page_table": np.zeros((LANES + 1, PAGES), np.int32)},
            {"offset": 0, "page_tokens": 4},
            r"page_table: expected \[4, pages\], got shape \[5, 9\]",
        ),
        (
            "lane_positions",
            {**_positions_arrays(), "cache_slots": np.zeros(LANES, np.int32)},
            {"offset": 0, "page_tokens": 4},
            "cache_slots: dtype DTYPE_I32 is not one of DTYPE_I64",
        ),
        ("draft_argmax", _argmax_arrays(320), {"vocab_limit": 321}, r"vocab_limit: expected an integer in \[1, 320\]"),
        (
            "draft_argmax",
            {**_argmax_arrays(320), "confidence": np.zeros(LANES + 1, np.float32)},
            {"vocab_limit": 320},
            r"confidence: expected 4 elements, got shape \[5\]",
        ),
        (
            "draft_argmax",
            {**_argmax_arrays(320), "logits": np.zeros((LANES, 320), np.int32)},
            {"vocab_limit": 320},
            "logits: dtype DTYPE_I32",
        ),
        (
            "draft_allocate",
            _allocate_arrays(3),
            {"packed_capacity": 0, "token_capacity": 4},
            "attribute packed_capacity: expected a positive integer, got 0",
        ),
        (
            "draft_allocate",
            {**_allocate_arrays(3), "ceilings": np.zeros(LANES - 1, np.int32)},
            {"packed_capacity": 6, "token_capacity": 4},
            r"ceilings: expected 4 elements, got shape \[3\]",
        ),
        (
            "speculative_layout",
            {
                "query_length": np.zeros(LANES, np.int32),
                "consumed": np.zeros(LANES, np.int32),
                "page_table": np.zeros((LANES, PAGES), np.int32),
                **_layout_arrays(LANES, 20),
                "token_rows": np.zeros(19, np.int32),
            },
            {"page_tokens": 16},
            r"token_rows: expected 20 elements, got shape \[19\]",
        ),
        (
            "completion_self_draft",
            {key: value for key, value in _record_arrays(3).items() if key != "frame_index"},
            {"lag_tokens": 0},
            "confidence, frame_index and out_confidence must be given together or not at all",
        ),
        (
            "completion_self_draft",
            {**_record_arrays(3), "out_confidence": np.zeros((2, LANES, 2), np.float32)},
            {"lag_tokens": 0},
            r"out_confidence: expected \[frames, slots >= 4, capacity >= 3\], got shape \[2, 4, 2\]",
        ),
        ("completion_self_draft", _record_arrays(3), {"lag_tokens": -1}, "attribute lag_tokens: expected a non-neg"),
    ],
)
def test_bad_nodes_are_refused(op: str, arrays: dict[str, Any], attributes: dict[str, Any], message: str) -> None:
    with pytest.raises(LoweringError, match=message):
        lower(op, arrays, attributes)


def test_the_self_drafting_program_s_own_nodes_lower() -> None:
    """Every greedy self-drafting node of a tiny core's kernel graph, with the recipe's own views, dtypes
    and attributes, lowers to its kernel (the decoder's nodes are lowered by their own tests)."""
    caps = Capacities(
        max_rows=2, prefill_tokens=(8,), decode_rows=(1, 2), page_tokens=4, cache_pages=16, context=32, snapshots=0,
        speculative_widths=(1, 2, 4), speculation="self-draft", draft_tokens=3,
    )  # fmt: skip
    _, builder, _ = assemble(synthetic_declaration("tiny"), caps, kernel_graph=True)
    manifest = builder.manifest
    context = LoweringContext(manifest, "sm_90a")
    lowered: dict[str, set[str]] = {}
    for program in manifest.programs:
        if not program.name.startswith("selfdraft_"):
            continue
        context.program = program.name
        for node in program.nodes:
            if node.op.name in SELF_DRAFT_OPS:
                context.node = node.name
                (launch,) = LOWERINGS[(node.op.name, 1)](context, node)
                lowered.setdefault(program.name, set()).add(launch.symbol)
    wide = {f"_{op}_kernel" for op in SELF_DRAFT_OPS}
    narrow = wide - {"_lane_positions_kernel", "_draft_argmax_kernel"}  # width one drafts nothing
    assert lowered == {
        **{f"selfdraft_w{w}_b{b}": wide for w in (2, 4) for b in (1, 2)},
        **{f"selfdraft_w1_b{b}": narrow for b in (1, 2)},
    }
