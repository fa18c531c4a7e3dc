"""Kernels of self-drafting rounds with greedy drafts: draft positions, choice, allocation, layout, record.

Owns the Triton kernels and the lowerings of ``lane_positions``, ``draft_argmax``, ``draft_allocate``,
``speculative_layout`` and ``completion_self_draft``. The semantics are those of
:mod:`helios_core.backends.reference_kernels` (the first four) and of the reference adapter
(``completion_self_draft``); cache slots are ``page_table[r, position // page_tokens] * page_tokens +
position % page_tokens``. Each operator is one launch:

* ``lane_positions``, ``completion_self_draft`` and ``draft_allocate``: grid ``(1,)``, one program
  walking the lanes (in blocks, carrying running sums where a lane's packed start is needed);
  ``lane_positions`` takes its ``offset`` as a runtime scalar, so every draft step shares one module.
* ``draft_argmax``: grid ``(B,)``, one program a lane, two passes over ``logits[r, :vocab_limit]``
  in chunks: the largest value and its lowest id (exact, as the reference), then ``sum exp(x - max)``
  in float32 with the device ``exp``. The reference computes that sum in float64; the float32 sum
  of terms in ``(0, 1]`` keeps the confidence within a relative ``1e-5`` of the reference's for
  vocabularies up to ``2**17``.
* ``draft_allocate``: the reference's greedy loop, once per row it may add: every lane's frontier
  survival is its admitted prefix's product times its next confidence, multiplied in float64 in
  the reference's order (IEEE products, so bit-identical); the highest wins, ties to the shorter
  prefix, then the lower lane.
* ``speculative_layout``: grid ``(P / BLOCK_P,)``, a program a block of packed rows: each row finds
  its lane from the inclusive running sums of the (non-negative) query lengths.

Where the reference raises the kernels do not fault:

* ``lane_positions`` and ``speculative_layout`` give slot -1 (no cache write) to a row of an active
  lane whose endpoint is negative or whose page lies past the page-table row or is negative; a
  negative query length counts as 0 and rows past P are not written;
* ``draft_argmax`` gives a drafting lane with a non-finite logit below ``vocab_limit`` id 0 and
  confidence 0;
* ``draft_allocate`` treats a negative ceiling as 0 and a non-finite or negative confidence as 0, and
  when the lanes with tokens alone exceed P gives a row to the first P of them only;
* ``completion_self_draft`` counts a negative query length as 0 and writes no confidence for a frame
  index outside ``[0, frames)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import KernelArg, LoweringContext, cdiv, lowering, next_power_of_two
from ignition.kernels.speculative import _FLOATS, _INTS, _RECORD_OUTPUTS, _lane_walk, _numel, _per_lane, _typed

__all__ = [
    "ARGMAX_BLOCK",
    "LAYOUT_TILE",
    "lower_completion_self_draft",
    "lower_draft_allocate",
    "lower_draft_argmax",
    "lower_lane_positions",
    "lower_speculative_layout",
]

ARGMAX_BLOCK = 4096
"""Logits per chunk of ``draft_argmax``'s passes over a row."""
LAYOUT_TILE = 4096
"""Packed rows x lanes of one ``speculative_layout`` program (every lane is in each tile)."""
MAX_LANES = 4096
"""The most lanes ``draft_allocate`` and ``speculative_layout`` hold in one block."""

_RECORD_INPUTS = ("generation", "query_length", "accepted", "emitted", "consumed")


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` with a type for the checker (Triton itself is untyped)."""
    return triton.jit(fn)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@_jit
def _lane_positions_kernel(
    consumed: tl.tensor,
    page_table: tl.tensor,
    limit: tl.tensor,
    positions: tl.tensor,
    token_rows: tl.tensor,
    cache_slots: tl.tensor,
    offset: tl.tensor,
    LANES: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Lane r with ``offset < limit[r]``: position ``consumed[r] + offset``, token row r, its slot;
    every other lane: 0, -1, -1."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    step = offset.to(tl.int64)
    for first in range(0, LANES, BLOCK_L):
        lanes = first + tl.arange(0, BLOCK_L)
        in_range = lanes < LANES
        active = in_range & (tl.load(limit + lanes, mask=in_range, other=0).to(tl.int64) > step)
        endpoint = tl.load(consumed + lanes, mask=active, other=0).to(tl.int64)
        where = endpoint + step
        page_index = where // PAGE_TOKENS
        paged = active & (endpoint >= 0) & (page_index < PAGES)
        page = tl.load(page_table + lanes.to(tl.int64) * PAGES + page_index, mask=paged, other=-1).to(tl.int64)
        slot = tl.where(paged & (page >= 0), page * PAGE_TOKENS + where % PAGE_TOKENS, -1)
        tl.store(positions + lanes, tl.where(active, where, 0).to(positions.dtype.element_ty), mask=in_range)
        tl.store(token_rows + lanes, tl.where(active, lanes, -1).to(token_rows.dtype.element_ty), mask=in_range)
        tl.store(cache_slots + lanes, tl.where(active, slot, -1).to(cache_slots.dtype.element_ty), mask=in_range)


@_jit
def _draft_argmax_kernel(
    logits: tl.tensor,
    token_rows: tl.tensor,
    ids: tl.tensor,
    confidence: tl.tensor,
    V: tl.constexpr,
    LIMIT: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r: the lowest id of the largest of ``logits[r, :LIMIT]`` and ``1 / sum exp(x - max)``."""
    r = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    drafting = r >= 0
    if HAS_ROWS:
        drafting = tl.load(token_rows + r) >= 0
    row = logits + r.to(tl.int64) * V
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], tl.int32)
    broken = tl.zeros([], tl.int32)
    for first in range(0, LIMIT, BLOCK_V):
        offs = first + tl.arange(0, BLOCK_V)
        valid = (offs < LIMIT) & drafting
        x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        broken += tl.sum((valid & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32), axis=0)
        top = tl.max(x, axis=0)
        first_top = tl.min(tl.where(valid & (x == top), offs, LIMIT), axis=0)
        better = top > best  # a later chunk's equal maximum keeps the earlier, lower id
        best_id = tl.where(better, first_top, best_id)
        best = tl.where(better, top, best)
    total = tl.zeros([], tl.float32)
    for first in range(0, LIMIT, BLOCK_V):
        offs = first + tl.arange(0, BLOCK_V)
        valid = (offs < LIMIT) & drafting & (broken == 0)
        x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.where(valid, tl.exp(x - best), 0.0), axis=0)
    chosen = drafting & (broken == 0)
    tl.store(ids + r, tl.where(chosen, best_id, 0).to(ids.dtype.element_ty))
    tl.store(confidence + r, tl.where(chosen, 1.0 / tl.where(chosen, total, 1.0), 0.0))


@_jit
def _draft_allocate_kernel(
    confidence: tl.tensor,
    ceilings: tl.tensor,
    query_length: tl.tensor,
    LANES: tl.constexpr,
    DRAFTS: tl.constexpr,
    CAP: tl.constexpr,
    PACKED: tl.constexpr,
    ADDITIONS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """One row per lane with a positive ceiling (the first ``PACKED`` of them), then up to ``ADDITIONS``
    times one row to the frontier of highest float64 survival (ties: shorter prefix, lower lane)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    lanes = tl.arange(0, BLOCK_L)
    in_range = lanes < LANES
    ceiling = tl.maximum(tl.load(ceilings + lanes, mask=in_range, other=0).to(tl.int64), 0)
    has_tokens = (ceiling > 0).to(tl.int32)
    rank = tl.cumsum(has_tokens, axis=0)
    lengths = tl.where((has_tokens > 0) & (rank <= PACKED), 1, 0).to(tl.int32)
    caps = tl.minimum(ceiling, CAP).to(tl.int32)
    total = tl.sum(lengths, axis=0)
    survival = tl.full([BLOCK_L], 1.0, tl.float64)
    for _ in range(ADDITIONS):
        open_ = in_range & (lengths > 0) & (lengths < caps) & (total < PACKED)
        value = tl.load(confidence + lanes.to(tl.int64) * DRAFTS + (lengths - 1), mask=open_, other=0.0)
        value = tl.where((value >= 0.0) & (value < float("inf")), value, 0.0)  # NaN fails both
        frontier = survival * value.to(tl.float64)
        key = tl.where(open_, frontier, -1.0)
        highest = tl.max(key, axis=0)
        tied = open_ & (key == highest)
        shortest = tl.min(tl.where(tied, lengths, CAP + 1), axis=0)
        tied = tied & (lengths == shortest)
        winner = tl.min(tl.where(tied, lanes, BLOCK_L), axis=0)
        chosen = tied & (lanes == winner)
        survival = tl.where(chosen, frontier, survival)
        lengths += chosen.to(tl.int32)
        total += tl.sum(chosen.to(tl.int32), axis=0)
    tl.store(query_length + lanes, lengths.to(query_length.dtype.element_ty), mask=in_range)


@_jit
def _speculative_layout_kernel(
    query_length: tl.tensor,
    consumed: tl.tensor,
    page_table: tl.tensor,
    positions: tl.tensor,
    token_rows: tl.tensor,
    cache_slots: tl.tensor,
    LANES: tl.constexpr,
    PACKED: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Rows of block ``program_id``: row p < total of lane r (start s) gets position ``consumed[r] + p - s``,
    token row r and its slot; rows past the total get 0, -1, -1."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_range = rows < PACKED
    lanes = tl.arange(0, BLOCK_L)
    lane_ok = lanes < LANES
    length = tl.maximum(tl.load(query_length + lanes, mask=lane_ok, other=0).to(tl.int64), 0)
    ends = tl.cumsum(length, axis=0)  # inclusive: lane r's block is [ends[r] - length[r], ends[r])
    total = tl.sum(length, axis=0)
    before = lane_ok[None, :] & (ends[None, :] <= rows.to(tl.int64)[:, None])  # lanes ending at or before p
    lane = tl.sum(before.to(tl.int32), axis=1)
    start = tl.max(tl.where(before, ends[None, :], 0), axis=1)
    live = in_range & (rows < total)
    endpoint = tl.load(consumed + lane, mask=live, other=0).to(tl.int64)
    where = endpoint + rows - start
    page_index = where // PAGE_TOKENS
    paged = live & (endpoint >= 0) & (page_index < PAGES)
    page = tl.load(page_table + lane.to(tl.int64) * PAGES + page_index, mask=paged, other=-1).to(tl.int64)
    slot = tl.where(paged & (page >= 0), page * PAGE_TOKENS + where % PAGE_TOKENS, -1)
    tl.store(positions + rows, tl.where(live, where, 0).to(positions.dtype.element_ty), mask=in_range)
    tl.store(token_rows + rows, tl.where(live, lane, -1).to(token_rows.dtype.element_ty), mask=in_range)
    tl.store(cache_slots + rows, tl.where(live, slot, -1).to(cache_slots.dtype.element_ty), mask=in_range)


@_jit
def _completion_self_draft_kernel(
    generation: tl.tensor,
    query_length: tl.tensor,
    accepted: tl.tensor,
    emitted: tl.tensor,
    consumed: tl.tensor,
    sequence: tl.tensor,
    confidence: tl.tensor,
    frame_index: tl.tensor,
    out_generation: tl.tensor,
    out_offers: tl.tensor,
    out_accepted: tl.tensor,
    out_emitted: tl.tensor,
    out_consumed: tl.tensor,
    out_draft_cursor: tl.tensor,
    out_reserved: tl.tensor,
    out_sequence: tl.tensor,
    out_confidence: tl.tensor,
    lag_tokens: tl.tensor,
    LANES: tl.constexpr,
    SEQUENCE: tl.constexpr,
    HAS_CONFIDENCE: tl.constexpr,
    DRAFTS: tl.constexpr,
    FRAMES: tl.constexpr,
    SLOTS: tl.constexpr,
    CAPACITY: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEQUENCE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Per lane: echoes, offers, consumed ``consumed + accepted + 1`` (emitted) or ``consumed +
    query_length`` (not), the draft cursor; the confidences into ``out_confidence[frame_index]``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    lag = lag_tokens.to(tl.int64)
    minus_one = tl.full([BLOCK], -1, tl.int32)
    for first in range(0, LANES, BLOCK):
        lanes = first + tl.arange(0, BLOCK)
        mask = lanes < LANES
        length = tl.maximum(tl.load(query_length + lanes, mask=mask, other=0).to(tl.int64), 0)
        taken = tl.load(accepted + lanes, mask=mask, other=0).to(tl.int64)
        produced = tl.load(emitted + lanes, mask=mask, other=0)
        before = tl.load(consumed + lanes, mask=mask, other=0).to(tl.int64)
        has_tokens = mask & (length > 0)
        after = tl.where(produced != 0, before + taken + 1, before + length)
        endpoint = tl.where(has_tokens, after, 0)
        tl.store(out_generation + lanes, tl.load(generation + lanes, mask=mask, other=0), mask=mask)
        tl.store(out_offers + lanes, tl.where(length > 0, length - 1, 0), mask=mask)
        tl.store(out_accepted + lanes, taken, mask=mask)
        tl.store(out_emitted + lanes, produced, mask=mask)
        tl.store(out_consumed + lanes, endpoint, mask=mask)
        tl.store(out_draft_cursor + lanes, tl.where(has_tokens, tl.maximum(endpoint - lag, 0), -1), mask=mask)
        tl.store(out_reserved + lanes, minus_one, mask=mask)
    seq = tl.arange(0, SEQUENCE_BLOCK)
    seq_mask = seq < SEQUENCE
    tl.store(out_sequence + seq, tl.load(sequence + seq, mask=seq_mask), mask=seq_mask)
    if HAS_CONFIDENCE:
        frame = tl.load(frame_index).to(tl.int64)
        framed = (frame >= 0) & (frame < FRAMES)
        half = out_confidence + tl.where(framed, frame, 0) * (SLOTS * CAPACITY)
        column = tl.arange(0, BLOCK_D)[None, :]
        for first in range(0, LANES, BLOCK):
            lanes = (first + tl.arange(0, BLOCK)).to(tl.int64)[:, None]
            inside = framed & (lanes < LANES) & (column < DRAFTS)
            values = tl.load(confidence + lanes * DRAFTS + column, mask=inside, other=0.0)
            tl.store(half + lanes * CAPACITY + column, values, mask=inside)


# ----------------------------------------------------------------------------------------------
# lowerings
# ----------------------------------------------------------------------------------------------


def _positive_attribute(ctx: LoweringContext, node: mf.Node, name: str, *, allow_zero: bool = False) -> int:
    value = ctx.attribute(node, name)
    if not isinstance(value, int) or value < (0 if allow_zero else 1):
        bound = "non-negative" if allow_zero else "positive"
        raise ctx.fail(f"attribute {name}: expected a {bound} integer, got {value!r}")
    return value


def _page_table(ctx: LoweringContext, node: mf.Node, lanes: int) -> tuple[KernelArg, int]:
    view = ctx.need(node, "page_table")
    shape = ctx.shape(view)
    if len(shape) != 2 or shape[0] != lanes or shape[1] < 1:
        raise ctx.fail(f"page_table: expected [{lanes}, pages], got shape {list(shape)}")
    return _typed(ctx, view, "page_table", _INTS), int(shape[1])


def _layout_outputs(ctx: LoweringContext, node: mf.Node, rows: int) -> dict[str, KernelArg]:
    outputs = {}
    for name, allowed in (("positions", _INTS), ("token_rows", _INTS), ("cache_slots", (mf.DTYPE_I64,))):
        view = ctx.need(node, name)
        if _numel(ctx.shape(view)) != rows:
            raise ctx.fail(f"{name}: expected {rows} elements, got shape {list(ctx.shape(view))}")
        outputs[name] = _typed(ctx, view, name, allowed)
    return outputs


@lowering("lane_positions")
def lower_lane_positions(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program walking the lanes in blocks; ``offset`` a runtime scalar (one module every step)."""
    offset = _positive_attribute(ctx, node, "offset", allow_zero=True)
    page_tokens = _positive_attribute(ctx, node, "page_tokens")
    consumed = ctx.need(node, "consumed")
    lanes = _numel(ctx.shape(consumed))
    if lanes < 1:
        raise ctx.fail("consumed: no lanes")
    table, pages = _page_table(ctx, node, lanes)
    block, num_warps = _lane_walk(lanes)
    args = {
        "consumed": _typed(ctx, consumed, "consumed", _INTS),
        "page_table": table,
        "limit": _per_lane(ctx, node, "limit", lanes, _INTS),
        **_layout_outputs(ctx, node, lanes),
        "offset": ctx.i32(offset),
    }
    constants = {"LANES": lanes, "PAGES": pages, "PAGE_TOKENS": page_tokens, "BLOCK_L": block}
    return [ctx.launch(_lane_positions_kernel, args, constants, [1], num_warps=num_warps)]


@lowering("draft_argmax")
def lower_draft_argmax(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program a lane: an exact argmax pass, then a float32 exp-sum pass, over chunks of the row."""
    logits_view = ctx.need(node, "logits")
    shape = ctx.shape(logits_view)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ctx.fail(f"logits: expected [B, V], got shape {list(shape)}")
    lanes, vocab = int(shape[0]), int(shape[1])
    limit = ctx.attribute(node, "vocab_limit")
    if not isinstance(limit, int) or not 1 <= limit <= vocab:
        raise ctx.fail(f"attribute vocab_limit: expected an integer in [1, {vocab}], got {limit!r}")
    ids = _per_lane(ctx, node, "ids", lanes, _INTS)
    rows_view = ctx.arg(node, "token_rows")
    block = min(ARGMAX_BLOCK, next_power_of_two(limit))
    args = {
        "logits": _typed(ctx, logits_view, "logits", _FLOATS),
        # without token_rows the kernel never reads the parameter (given the ids)
        "token_rows": _per_lane(ctx, node, "token_rows", lanes, _INTS) if rows_view is not None else ids,
        "ids": ids,
        "confidence": _per_lane(ctx, node, "confidence", lanes, (mf.DTYPE_F32,)),
    }
    constants = {"V": vocab, "LIMIT": limit, "HAS_ROWS": rows_view is not None, "BLOCK_V": block}
    num_warps = max(1, min(8, block // 512))
    return [ctx.launch(_draft_argmax_kernel, args, constants, [lanes], num_warps=num_warps)]


@lowering("draft_allocate")
def lower_draft_allocate(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program holding every lane: the reference's greedy loop, at most one row an iteration."""
    packed = _positive_attribute(ctx, node, "packed_capacity")
    width = _positive_attribute(ctx, node, "token_capacity")
    confidence_view = ctx.need(node, "confidence")
    shape = ctx.shape(confidence_view)
    if len(shape) != 2:
        raise ctx.fail(f"confidence: expected [B, D], got shape {list(shape)}")
    lanes, drafts = int(shape[0]), int(shape[1])
    if not 1 <= lanes <= MAX_LANES:
        raise ctx.fail(f"confidence: expected 1 to {MAX_LANES} lanes, got shape {list(shape)}")
    cap = min(drafts + 1, width)
    args = {
        "confidence": _typed(ctx, confidence_view, "confidence", (mf.DTYPE_F32,)),
        "ceilings": _per_lane(ctx, node, "ceilings", lanes, _INTS),
        "query_length": _per_lane(ctx, node, "query_length", lanes, _INTS),
    }
    block = next_power_of_two(lanes)
    constants = {
        "LANES": lanes,
        "DRAFTS": drafts,
        "CAP": cap,
        "PACKED": packed,
        "ADDITIONS": max(1, min(packed, lanes * (cap - 1))),
        "BLOCK_L": block,
    }
    num_warps = max(1, min(4, block // 32))
    return [ctx.launch(_draft_allocate_kernel, args, constants, [1], num_warps=num_warps)]


@lowering("speculative_layout")
def lower_speculative_layout(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """A program a block of packed rows, every lane's running sum in each."""
    page_tokens = _positive_attribute(ctx, node, "page_tokens")
    lengths = ctx.need(node, "query_length")
    lanes = _numel(ctx.shape(lengths))
    if not 1 <= lanes <= MAX_LANES:
        raise ctx.fail(f"query_length: expected 1 to {MAX_LANES} lanes, got shape {list(ctx.shape(lengths))}")
    packed = _numel(ctx.shape(ctx.need(node, "positions")))
    if packed < 1:
        raise ctx.fail("positions: no packed rows")
    table, pages = _page_table(ctx, node, lanes)
    block_l = next_power_of_two(lanes)
    block_p = max(1, min(next_power_of_two(packed), LAYOUT_TILE // block_l))
    args = {
        "query_length": _typed(ctx, lengths, "query_length", _INTS),
        "consumed": _per_lane(ctx, node, "consumed", lanes, _INTS),
        "page_table": table,
        **_layout_outputs(ctx, node, packed),
    }
    constants = {
        "LANES": lanes,
        "PACKED": packed,
        "PAGES": pages,
        "PAGE_TOKENS": page_tokens,
        "BLOCK_L": block_l,
        "BLOCK_P": block_p,
    }
    num_warps = max(1, min(4, block_l * block_p // 256))
    return [ctx.launch(_speculative_layout_kernel, args, constants, [cdiv(packed, block_p)], num_warps=num_warps)]


@lowering("completion_self_draft")
def lower_completion_self_draft(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program walking the lanes in blocks, then (with the confidence inputs) their rows of the frame."""
    lag = _positive_attribute(ctx, node, "lag_tokens", allow_zero=True)
    views = {
        name: ctx.need(node, name)
        for name in (*_RECORD_INPUTS, "submission_sequence", *_RECORD_OUTPUTS, "out_sequence")
    }
    lanes = _numel(ctx.shape(views["generation"]))
    if lanes < 1:
        raise ctx.fail("generation: no lanes")
    for name in (*_RECORD_INPUTS[1:], *_RECORD_OUTPUTS):
        if _numel(ctx.shape(views[name])) != lanes:
            raise ctx.fail(f"{name}: expected {lanes} elements, got shape {list(ctx.shape(views[name]))}")
    sequence = _numel(ctx.shape(views["submission_sequence"]))
    if _numel(ctx.shape(views["out_sequence"])) != sequence:
        found = list(ctx.shape(views["out_sequence"]))
        raise ctx.fail(f"out_sequence: expected {sequence} elements, got shape {found}")
    framed = {name: ctx.arg(node, name) for name in ("confidence", "frame_index", "out_confidence")}
    given = [name for name, view in framed.items() if view is not None]
    if given and len(given) != len(framed):
        raise ctx.fail("confidence, frame_index and out_confidence must be given together or not at all")
    drafts = frames = slots = capacity = 0
    confidence_arg = frame_arg = out_confidence_arg = None
    confidence, frame_index, out_confidence = framed["confidence"], framed["frame_index"], framed["out_confidence"]
    if confidence is not None and frame_index is not None and out_confidence is not None:
        shape, out_shape = ctx.shape(confidence), ctx.shape(out_confidence)
        if len(shape) != 2 or shape[0] != lanes:
            raise ctx.fail(f"confidence: expected [{lanes}, D], got shape {list(shape)}")
        drafts = int(shape[1])
        if len(out_shape) != 3 or out_shape[1] < lanes or out_shape[2] < drafts:
            raise ctx.fail(
                f"out_confidence: expected [frames, slots >= {lanes}, capacity >= {drafts}], "
                f"got shape {list(out_shape)}"
            )
        if _numel(ctx.shape(frame_index)) != 1:
            raise ctx.fail(f"frame_index: expected 1 element, got shape {list(ctx.shape(frame_index))}")
        frames, slots, capacity = (int(s) for s in out_shape)
        confidence_arg = _typed(ctx, confidence, "confidence", (mf.DTYPE_F32,))
        frame_arg = _typed(ctx, frame_index, "frame_index", _INTS)
        out_confidence_arg = _typed(ctx, out_confidence, "out_confidence", (mf.DTYPE_F32,))
    record = (*_INTS, mf.DTYPE_U8)
    generation = _typed(ctx, views["generation"], "generation", record)
    args = {
        **{name: _typed(ctx, views[name], name, record) for name in _RECORD_INPUTS},
        "sequence": _typed(ctx, views["submission_sequence"], "submission_sequence", record),
        # without the confidence inputs the kernel never touches these parameters (given the generation)
        "confidence": confidence_arg or generation,
        "frame_index": frame_arg or generation,
        **{name: _typed(ctx, views[name], name, record) for name in _RECORD_OUTPUTS},
        "out_sequence": _typed(ctx, views["out_sequence"], "out_sequence", record),
        "out_confidence": out_confidence_arg or generation,
        "lag_tokens": ctx.i32(lag),
    }
    block_d = next_power_of_two(max(drafts, 1))
    block, num_warps = _lane_walk(lanes, block_d)
    constants = {
        "LANES": lanes,
        "SEQUENCE": sequence,
        "HAS_CONFIDENCE": confidence_arg is not None,
        "DRAFTS": drafts,
        "FRAMES": frames,
        "SLOTS": slots,
        "CAPACITY": capacity,
        "BLOCK": block,
        "BLOCK_D": block_d,
        "SEQUENCE_BLOCK": next_power_of_two(max(sequence, 1)),
    }
    return [ctx.launch(_completion_self_draft_kernel, args, constants, [1], num_warps=num_warps)]
