"""Kernels of speculative rounds with copied proposals: packing, verification, the completion record.

Owns the Triton kernels and the lowerings of ``speculative_inputs``, ``sample_verify`` and
``completion_speculative``. The semantics are those of :mod:`helios_core.backends.reference_kernels`
(``speculative_inputs``, ``sample_verify``) and of the reference adapters (``completion_speculative``);
lane ``r``'s packed block starts at ``start_r = query_length[0] + ... + query_length[r-1]``.

``speculative_inputs`` and ``completion_speculative`` are one launch each, grid ``(1,)``: a single
program walks the lanes in blocks, carrying the running sum of query lengths.

``sample_verify`` reuses the ``sample`` kernels of :mod:`ignition.kernels.sampling` unchanged, once
per position ``j`` a lane may reach (``C + 1`` for ``C`` candidate columns), so every emitted token
is the one one-token ``sample`` would draw. Its launches, in order:

1. grid ``(B, V / GATHER_BLOCK)``: every lane's start, the outputs' initial values (ids -1, logprob 0,
   accepted 0, emitted 0, pending -1), per-position RNG counters ``step[r] + j`` and the position-0
   flags (active, has a packed token, a state row >= 0, its block within the logits); each lane
   active at position 0 copies its logits row ``start_r`` into a ``[B, V]`` workspace (and, with the
   grammar inputs, a constrained lane its mask row ``start_r`` into a ``[B, words]`` mask workspace).
2. for each position ``j``: the three ``sample`` launches over the workspace rows with the
   position's flags and counters (the finishing launch adds the drawn token to ``output_counts``,
   so the next position samples with the counts as they are then), then one launch, grid ``(B,
   V / GATHER_BLOCK)`` (``(B, 1)`` at the last position), that records the drawn token of every
   lane active at ``j`` (``ids[r, j]``, ``logprob[r, j]``, ``accepted = j``, ``emitted = j + 1``,
   ``pending``), sets the lane's flag for ``j + 1`` when ``j`` is below its candidate count and the
   token equals ``candidate_ids[r, j]``, and copies row ``start_r + j + 1`` (logits, and the mask row
   of a constrained lane) for those lanes. Each position's ``sample`` launches read the mask
   workspace with the node's own ``constrained`` flags.

A lane that stops verifying is inactive at every later position: the ``sample`` launches return at
once for it and no logits row past its last reached position is read.

Where the reference raises, the kernels do not fault: an active lane with no packed token, a
negative state row or a block past the end of the logits is treated as inactive; a lane offering
more than ``C`` candidates verifies the first ``C``; a position whose ``sample`` yields no token
(no finite logit) ends the lane with what it emitted before; ``speculative_inputs`` writes only the
entries that fit ``ids`` and skips the pending token of a negative state row;
``completion_speculative`` reports 0 consumed tokens for a lane whose block lies past the end of
``positions``. State rows are trusted to lie in range (their count is never compiled in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import KernelArg, LoweringContext, cdiv, lowering, next_power_of_two
from ignition.kernels.sampling import lower_sample

__all__ = [
    "GATHER_BLOCK",
    "lower_completion_speculative",
    "lower_sample_verify",
    "lower_speculative_inputs",
]

GATHER_BLOCK = 4096
"""Logits per program of the row copies of ``sample_verify``."""
ROW_ALIGN = 16
"""Per-position workspace rows are padded to a multiple of this many lanes (16-byte aligned rows, so
every position's ``sample`` launches share one specialization)."""
LANE_TILE = 2048
"""Lanes x token slots of one block of the single-program lane walks."""

_INTS = (mf.DTYPE_I32, mf.DTYPE_I64)
_FLAGS = (mf.DTYPE_U8, mf.DTYPE_I32)
_FLOATS = (mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16)
_WORDS = (mf.DTYPE_I32, mf.DTYPE_U32)
_RECORD_OUTPUTS = (
    "out_generation",
    "out_offers",
    "out_accepted",
    "out_emitted",
    "out_consumed",
    "out_draft_cursor",
    "out_reserved",
)
_SAMPLE_SETTINGS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "rows",
    "prompt_presence",
    "output_counts",
)
"""Arguments ``sample_verify`` hands to each position's ``sample`` launches as they are."""


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` with a type for the checker (Triton itself is untyped)."""
    return triton.jit(fn)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@_jit
def _speculative_inputs_kernel(
    pending_tokens: tl.tensor,
    rows: tl.tensor,
    candidates: tl.tensor,
    query_length: tl.tensor,
    ids: tl.tensor,
    LANES: tl.constexpr,
    CAPACITY: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """``ids[start_r] = pending_tokens[rows[r]]``, ``ids[start_r + 1 + j] = candidates[r, j]``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.arange(0, BLOCK_T)[None, :]  # 0: the pending token, 1 + j: candidate j
    carry = tl.zeros([], tl.int64)
    for first in range(0, LANES, BLOCK_L):
        lanes = first + tl.arange(0, BLOCK_L)
        in_range = lanes < LANES
        length = tl.maximum(tl.load(query_length + lanes, mask=in_range, other=0).to(tl.int64), 0)
        starts = tl.cumsum(length, axis=0) - length + carry
        carry += tl.sum(length, axis=0)
        live = in_range & (length > 0)
        state = tl.load(rows + lanes, mask=live, other=-1).to(tl.int64)
        pending = tl.load(pending_tokens + state, mask=live & (state >= 0), other=0).to(tl.int64)
        wanted = live[:, None] & (slot < length[:, None]) & (slot <= CAPACITY)
        offered = tl.load(
            candidates + lanes.to(tl.int64)[:, None] * CAPACITY + (slot - 1),
            mask=wanted & (slot >= 1),
            other=0,
        ).to(tl.int64)
        value = tl.where(slot == 0, pending[:, None], offered)
        dest = starts[:, None] + slot
        write = wanted & (dest < PACKED) & ((slot > 0) | (state[:, None] >= 0))
        tl.store(ids + dest, value.to(ids.dtype.element_ty), mask=write)


@_jit
def _completion_speculative_kernel(
    generation: tl.tensor,
    query_length: tl.tensor,
    accepted: tl.tensor,
    emitted: tl.tensor,
    positions: tl.tensor,
    sequence: tl.tensor,
    out_generation: tl.tensor,
    out_offers: tl.tensor,
    out_accepted: tl.tensor,
    out_emitted: tl.tensor,
    out_consumed: tl.tensor,
    out_draft_cursor: tl.tensor,
    out_reserved: tl.tensor,
    out_sequence: tl.tensor,
    LANES: tl.constexpr,
    TOKENS: tl.constexpr,
    SEQUENCE: tl.constexpr,
    BLOCK: tl.constexpr,
    SEQUENCE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Per lane: echoes, offers ``query_length - 1``, consumed ``positions[start] + accepted + 1`` on a
    lane that emitted, ``positions[start + query_length - 1] + 1`` on one that did not."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    carry = tl.zeros([], tl.int64)
    minus_one = tl.full([BLOCK], -1, tl.int32)
    for first in range(0, LANES, BLOCK):
        lanes = first + tl.arange(0, BLOCK)
        mask = lanes < LANES
        length = tl.maximum(tl.load(query_length + lanes, mask=mask, other=0).to(tl.int64), 0)
        starts = tl.cumsum(length, axis=0) - length + carry
        carry += tl.sum(length, axis=0)
        taken = tl.load(accepted + lanes, mask=mask, other=0).to(tl.int64)
        produced = tl.load(emitted + lanes, mask=mask, other=0)
        has_tokens = mask & (length > 0) & (starts + length <= TOKENS)
        sampled = produced != 0
        index = tl.where(sampled, starts, starts + length - 1)
        position = tl.load(positions + index, mask=has_tokens, other=0).to(tl.int64)
        consumed = tl.where(has_tokens, tl.where(sampled, position + taken + 1, position + 1), 0)
        tl.store(out_generation + lanes, tl.load(generation + lanes, mask=mask, other=0), mask=mask)
        tl.store(out_offers + lanes, tl.where(length > 0, length - 1, 0), mask=mask)
        tl.store(out_accepted + lanes, taken, mask=mask)
        tl.store(out_emitted + lanes, produced, mask=mask)
        tl.store(out_consumed + lanes, consumed, mask=mask)
        tl.store(out_draft_cursor + lanes, minus_one, mask=mask)
        tl.store(out_reserved + lanes, minus_one, mask=mask)
    seq = tl.arange(0, SEQUENCE_BLOCK)
    seq_mask = seq < SEQUENCE
    tl.store(out_sequence + seq, tl.load(sequence + seq, mask=seq_mask), mask=seq_mask)


@_jit
def _verify_begin_kernel(
    logits: tl.tensor,
    query_length: tl.tensor,
    rows: tl.tensor,
    step: tl.tensor,
    active: tl.tensor,
    starts: tl.tensor,
    steps: tl.tensor,
    flags: tl.tensor,
    scratch: tl.tensor,
    masks: tl.tensor,
    constrained: tl.tensor,
    mask_scratch: tl.tensor,
    ids: tl.tensor,
    logprob: tl.tensor,
    accepted: tl.tensor,
    emitted: tl.tensor,
    pending: tl.tensor,
    LANES: tl.constexpr,
    STRIDE: tl.constexpr,
    V: tl.constexpr,
    WIDTH: tl.constexpr,
    POSITIONS: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    COL_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program ``(r, c)``: lane r's start and position-0 flag; c == 0 also initializes the lane's
    outputs and counters (and copies a constrained lane's first mask row into mask scratch row r); an
    active lane copies chunk c of its first logits row into scratch row r."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.zeros([], tl.int64)
    for first in range(0, LANES, BLOCK_L):
        lanes = first + tl.arange(0, BLOCK_L)
        earlier = tl.load(query_length + lanes, mask=lanes < r, other=0).to(tl.int64)
        start += tl.sum(tl.maximum(earlier, 0), axis=0)
    length = tl.load(query_length + r).to(tl.int64)
    state = tl.load(rows + r).to(tl.int64)
    live = (tl.load(active + r) != 0) & (length > 0) & (state >= 0) & (start + length <= PACKED)
    if c == 0:
        col = tl.arange(0, COL_PAD)
        tl.store(ids + r * WIDTH + col, tl.full([COL_PAD], -1, tl.int32), mask=col < WIDTH)
        if HAS_LOGPROB:
            tl.store(logprob + r * WIDTH + col, tl.zeros([COL_PAD], tl.float32), mask=col < WIDTH)
        tl.store(accepted + r, 0)
        tl.store(emitted + r, 0)
        tl.store(pending + r, -1)
        tl.store(starts + r, start)
        first_step = tl.load(step + r).to(tl.int64)
        tl.store(steps + col * STRIDE + r, first_step + col, mask=col < POSITIONS)
        tl.store(flags + r, live.to(tl.uint8))
        if HAS_MASK:  # noqa: SIM102 (the constant prunes the load)
            if live & (tl.load(constrained + r) != 0):
                for first_word in range(0, WORDS, BLOCK_W):
                    words = first_word + tl.arange(0, BLOCK_W)
                    inside = words < WORDS
                    row = tl.load(masks + start * WORDS + words, mask=inside, other=0)
                    tl.store(mask_scratch + r.to(tl.int64) * WORDS + words, row, mask=inside)
    if live:
        offs = c * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = offs < V
        row = tl.load(logits + start * V + offs, mask=valid, other=0.0)
        tl.store(scratch + r.to(tl.int64) * V + offs, row, mask=valid)


@_jit
def _position_token(
    drawn: tl.tensor,
    flags: tl.tensor,
    query_length: tl.tensor,
    candidates: tl.tensor,
    r: tl.tensor,
    j: tl.tensor,
    here: tl.tensor,
    CAPACITY: tl.constexpr,
) -> Any:
    """Lane r's token drawn at position ``j`` and what it is checked against: ``(token, reached,
    offers, more, offered)``; ``reached``: the lane was active at ``j`` and drew a token, ``offers``:
    its candidate count, ``more``: ``j`` is below it, ``offered``: ``candidate_ids[r, j]`` (-1 past it)."""
    token = tl.load(drawn + here)
    reached = (tl.load(flags + here) != 0) & (token >= 0)
    offers = tl.minimum(tl.load(query_length + r).to(tl.int64) - 1, CAPACITY)
    more = reached & (j < offers)
    offered = tl.load(candidates + r.to(tl.int64) * CAPACITY + j, mask=more, other=-1).to(tl.int64)
    return token, reached, offers, more, offered


@_jit
def _record_token(
    ids: tl.tensor,
    logprob: tl.tensor,
    drawn_logprob: tl.tensor,
    accepted: tl.tensor,
    emitted: tl.tensor,
    pending: tl.tensor,
    token: tl.tensor,
    r: tl.tensor,
    j: tl.tensor,
    here: tl.tensor,
    WIDTH: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
) -> None:
    """Records lane r's token of position ``j``: ``ids[r, j]``, ``logprob[r, j]``, ``accepted = j``,
    ``emitted = j + 1`` and ``pending``."""
    tl.store(ids + r * WIDTH + j, token)
    if HAS_LOGPROB:
        tl.store(logprob + r * WIDTH + j, tl.load(drawn_logprob + here))
    tl.store(accepted + r, j.to(tl.int32))
    tl.store(emitted + r, (j + 1).to(tl.int32))
    tl.store(pending + r, token)


@_jit
def _copy_next_row(
    logits: tl.tensor,
    starts: tl.tensor,
    scratch: tl.tensor,
    go_on: tl.tensor,
    r: tl.tensor,
    c: tl.tensor,
    j: tl.tensor,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    """Chunk c of logits row ``start_r + j + 1`` into scratch row r, for a lane that goes on."""
    offs = c * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = (offs < V) & go_on
    source = (tl.load(starts + r) + j + 1) * V
    row = tl.load(logits + source + offs, mask=valid, other=0.0)
    tl.store(scratch + r.to(tl.int64) * V + offs, row, mask=valid)


@_jit
def _verify_step_kernel(
    logits: tl.tensor,
    query_length: tl.tensor,
    candidates: tl.tensor,
    starts: tl.tensor,
    flags: tl.tensor,
    drawn: tl.tensor,
    drawn_logprob: tl.tensor,
    scratch: tl.tensor,
    masks: tl.tensor,
    constrained: tl.tensor,
    mask_scratch: tl.tensor,
    ids: tl.tensor,
    logprob: tl.tensor,
    accepted: tl.tensor,
    emitted: tl.tensor,
    pending: tl.tensor,
    position: tl.tensor,
    STRIDE: tl.constexpr,
    V: tl.constexpr,
    WIDTH: tl.constexpr,
    CAPACITY: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program ``(r, c)`` after position ``j``'s draw: c == 0 records lane r's token and its flag for
    j + 1 (and copies a constrained lane's mask row ``start + j + 1`` into mask scratch row r); a lane
    that goes on copies chunk c of logits row ``start + j + 1`` into scratch row r."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    j = position.to(tl.int64)
    here = j * STRIDE + r
    token, reached, _, more, offered = _position_token(drawn, flags, query_length, candidates, r, j, here, CAPACITY)
    go_on = more & (token.to(tl.int64) == offered)
    if c == 0:
        if reached:
            _record_token(
                ids, logprob, drawn_logprob, accepted, emitted, pending, token, r, j, here, WIDTH, HAS_LOGPROB
            )
        if HAS_NEXT:
            tl.store(flags + here + STRIDE, go_on.to(tl.uint8))
            if HAS_MASK:  # noqa: SIM102 (the constant prunes the load)
                if go_on & (tl.load(constrained + r) != 0):
                    next_row = tl.load(starts + r) + j + 1
                    for first_word in range(0, WORDS, BLOCK_W):
                        words = first_word + tl.arange(0, BLOCK_W)
                        inside = words < WORDS
                        row = tl.load(masks + next_row * WORDS + words, mask=inside, other=0)
                        tl.store(mask_scratch + r.to(tl.int64) * WORDS + words, row, mask=inside)
    if HAS_NEXT:
        _copy_next_row(logits, starts, scratch, go_on, r, c, j, V, BLOCK_V)


# ----------------------------------------------------------------------------------------------
# lowerings
# ----------------------------------------------------------------------------------------------


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _typed(ctx: LoweringContext, view: mf.BufferView, name: str, allowed: tuple[int, ...]) -> KernelArg:
    dtype = ctx.dtype(view)
    if dtype not in allowed:
        names = ", ".join(mf.DType.Name(d) for d in allowed)
        raise ctx.fail(f"{name}: dtype {mf.DType.Name(dtype)} is not one of {names}")
    return ctx.pointer(view)


def _per_lane(ctx: LoweringContext, node: mf.Node, name: str, lanes: int, allowed: tuple[int, ...]) -> KernelArg:
    view = ctx.need(node, name)
    if _numel(ctx.shape(view)) != lanes:
        raise ctx.fail(f"{name}: expected {lanes} elements, got shape {list(ctx.shape(view))}")
    return _typed(ctx, view, name, allowed)


def _candidates(ctx: LoweringContext, node: mf.Node, lanes: int) -> tuple[KernelArg, int]:
    view = ctx.need(node, "candidate_ids")
    shape = ctx.shape(view)
    if len(shape) != 2 or shape[0] != lanes:
        raise ctx.fail(f"candidate_ids: expected [{lanes}, C], got shape {list(shape)}")
    return _typed(ctx, view, "candidate_ids", _INTS), int(shape[1])


def _lane_walk(lanes: int, slots: int = 1) -> tuple[int, int]:
    """``(BLOCK_L, num_warps)`` of a single-program walk over ``lanes`` lanes of ``slots`` slots."""
    block = max(1, min(next_power_of_two(lanes), LANE_TILE // next_power_of_two(slots)))
    return block, max(1, min(4, block * next_power_of_two(slots) // 256))


@lowering("speculative_inputs")
def lower_speculative_inputs(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program walking the lanes in blocks, each lane's pending token and candidates a row of slots."""
    lengths = ctx.need(node, "query_length")
    lanes = _numel(ctx.shape(lengths))
    if lanes < 1:
        raise ctx.fail("query_length: no lanes")
    candidates, capacity = _candidates(ctx, node, lanes)
    pending_view = ctx.need(node, "pending_tokens")
    pending_shape = ctx.shape(pending_view)
    if not (len(pending_shape) == 1 or (len(pending_shape) == 2 and pending_shape[1] == 1)):
        raise ctx.fail(f"pending_tokens: expected [S] or [S, 1], got shape {list(pending_shape)}")
    ids_view = ctx.need(node, "ids")
    packed = _numel(ctx.shape(ids_view))
    slots = next_power_of_two(capacity + 1)
    block, num_warps = _lane_walk(lanes, slots)
    args = {
        "pending_tokens": _typed(ctx, pending_view, "pending_tokens", _INTS),
        "rows": _per_lane(ctx, node, "rows", lanes, _INTS),
        "candidates": candidates,
        "query_length": _typed(ctx, lengths, "query_length", _INTS),
        "ids": _typed(ctx, ids_view, "ids", _INTS),
    }
    constants = {"LANES": lanes, "CAPACITY": capacity, "PACKED": packed, "BLOCK_L": block, "BLOCK_T": slots}
    return [ctx.launch(_speculative_inputs_kernel, args, constants, [1], num_warps=num_warps)]


@lowering("completion_speculative")
def lower_completion_speculative(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program walking the lanes in blocks (consumed endpoints need each lane's packed start)."""
    inputs = ("generation", "query_length", "accepted", "emitted", "positions", "submission_sequence")
    views = {name: ctx.need(node, name) for name in (*inputs, *_RECORD_OUTPUTS, "out_sequence")}
    lanes = _numel(ctx.shape(views["generation"]))
    if lanes < 1:
        raise ctx.fail("generation: no lanes")
    for name in ("query_length", "accepted", "emitted", *_RECORD_OUTPUTS):
        if _numel(ctx.shape(views[name])) != lanes:
            raise ctx.fail(f"{name}: expected {lanes} elements, got shape {list(ctx.shape(views[name]))}")
    sequence = _numel(ctx.shape(views["submission_sequence"]))
    if _numel(ctx.shape(views["out_sequence"])) != sequence:
        found = list(ctx.shape(views["out_sequence"]))
        raise ctx.fail(f"out_sequence: expected {sequence} elements, got shape {found}")
    args = {
        param: _typed(ctx, views[name], name, (*_INTS, mf.DTYPE_U8))
        for param, name in (
            *((name, name) for name in inputs[:5]),
            ("sequence", "submission_sequence"),
            *((name, name) for name in (*_RECORD_OUTPUTS, "out_sequence")),
        )
    }
    block, num_warps = _lane_walk(lanes)
    constants = {
        "LANES": lanes,
        "TOKENS": _numel(ctx.shape(views["positions"])),
        "SEQUENCE": sequence,
        "BLOCK": block,
        "SEQUENCE_BLOCK": next_power_of_two(max(sequence, 1)),
    }
    return [ctx.launch(_completion_speculative_kernel, args, constants, [1], num_warps=num_warps)]


def _row_view(workspace: mf.BufferView, row: int, width: int, shape: list[int]) -> mf.BufferView:
    """Row ``row`` (of ``width`` elements) of a workspace, as a view of ``shape``."""
    return mf.BufferView(buffer=workspace.buffer, element_offset=row * width, shape=shape)


def _verify_logits(ctx: LoweringContext, node: mf.Node) -> tuple[mf.BufferView, int, int, int]:
    """A verification node's packed logits ``[P, V]``: ``(view, P, V, dtype)``."""
    logits_view = ctx.need(node, "logits")
    logits_shape = ctx.shape(logits_view)
    if len(logits_shape) != 2 or logits_shape[0] < 1 or logits_shape[1] < 1:
        raise ctx.fail(f"logits: expected [P, V], got shape {list(logits_shape)}")
    logits_dtype = ctx.dtype(logits_view)
    if logits_dtype not in _FLOATS:
        raise ctx.fail(f"logits: dtype {mf.DType.Name(logits_dtype)} is not a 16- or 32-bit float")
    return logits_view, int(logits_shape[0]), int(logits_shape[1]), logits_dtype


def _verify_ids(
    ctx: LoweringContext, node: mf.Node, lanes: int, capacity: int
) -> tuple[mf.BufferView, int, mf.BufferView | None]:
    """A verification node's ``ids`` ``[B, W]`` (``W`` above ``capacity``) and optional ``logprob``:
    ``(ids view, W, logprob view or None)``."""
    ids_view = ctx.need(node, "ids")
    ids_shape = ctx.shape(ids_view)
    if len(ids_shape) != 2 or ids_shape[0] != lanes or ids_shape[1] < capacity + 1:
        raise ctx.fail(f"ids: expected [{lanes}, W >= {capacity + 1}], got shape {list(ids_shape)}")
    width = int(ids_shape[1])
    logprob_view = ctx.arg(node, "logprob")
    if logprob_view is not None and _numel(ctx.shape(logprob_view)) != lanes * width:
        raise ctx.fail(f"logprob: expected {lanes * width} elements, got shape {list(ctx.shape(logprob_view))}")
    return ids_view, width, logprob_view


def _verify_outputs(
    ctx: LoweringContext, node: mf.Node, ids_view: mf.BufferView, logprob_view: mf.BufferView | None, lanes: int
) -> dict[str, KernelArg]:
    """A verification node's outputs in the order the kernels take them: ``ids``, ``logprob`` (without
    a logprob output, the ids: the kernels never write the parameter then), ``accepted``, ``emitted``
    and ``pending``."""
    ids = _typed(ctx, ids_view, "ids", (mf.DTYPE_I32,))
    accepted = _per_lane(ctx, node, "accepted", lanes, (mf.DTYPE_I32,))
    emitted = _per_lane(ctx, node, "emitted", lanes, (mf.DTYPE_I32,))
    pending = _per_lane(ctx, node, "pending", lanes, (mf.DTYPE_I32,))
    logprob = _typed(ctx, logprob_view, "logprob", (mf.DTYPE_F32,)) if logprob_view is not None else ids
    return {"ids": ids, "logprob": logprob, "accepted": accepted, "emitted": emitted, "pending": pending}


def _position_sample(
    ctx: LoweringContext,
    node: mf.Node,
    scratch: mf.BufferView,
    lanes: int,
    vocab: int,
    position_views: dict[str, mf.BufferView],
) -> list[mf.KernelLaunch]:
    """The ``sample`` launches of one verification position: the node's settings and ``vocab_limit``
    over the ``[B, V]`` logits workspace ``scratch``, then ``position_views`` (the position's
    ``active``, ``step``, ``ids``, ``logprob`` and grammar inputs, in that order)."""
    sample = mf.Node(name=node.name)
    sample.op.name = "sample"
    sample.op.version = 1
    views = {name: ctx.need(node, name) for name in _SAMPLE_SETTINGS}
    views["logits"] = mf.BufferView(buffer=scratch.buffer, element_offset=0, shape=[lanes, vocab])
    views.update(position_views)
    for name, view in views.items():
        sample.args.add(name=name, view=view)
    for attr in node.attributes:
        if attr.name == "vocab_limit":
            sample.attributes.add().CopyFrom(attr)
    return lower_sample(ctx, sample)


@lowering("sample_verify")
def lower_sample_verify(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """A begin launch, then per position the three ``sample`` launches and a record-and-copy launch."""
    logits_view, packed, vocab, logits_dtype = _verify_logits(ctx, node)
    lengths = ctx.need(node, "query_length")
    lanes = _numel(ctx.shape(lengths))
    if lanes < 1:
        raise ctx.fail("query_length: no lanes")
    candidates, capacity = _candidates(ctx, node, lanes)
    ids_view, width, logprob_view = _verify_ids(ctx, node, lanes, capacity)
    positions = capacity + 1
    mask_view, constrained_view = ctx.arg(node, "allowed_mask"), ctx.arg(node, "constrained")
    if (mask_view is None) != (constrained_view is None):
        raise ctx.fail("allowed_mask and constrained must be given together")
    outputs = _verify_outputs(ctx, node, ids_view, logprob_view, lanes)
    scratch_view = ctx.workspace("verify.logits", logits_dtype, lanes * vocab)
    starts = ctx.workspace("verify.starts", mf.DTYPE_I64, lanes)
    stride = cdiv(lanes, ROW_ALIGN) * ROW_ALIGN  # every position's row starts 16-byte aligned
    steps = ctx.workspace("verify.steps", mf.DTYPE_I64, positions * stride)
    flags = ctx.workspace("verify.active", mf.DTYPE_U8, positions * stride)
    drawn = ctx.workspace("verify.ids", mf.DTYPE_I32, positions * stride)
    drawn_logprob = ctx.workspace("verify.logprob", mf.DTYPE_F32, positions * stride)
    grammar: dict[str, KernelArg] = {"masks": outputs["ids"], "constrained": outputs["ids"]}  # never read without
    mask_words, mask_scratch_view = 1, None
    if mask_view is not None and constrained_view is not None:
        mask_shape = ctx.shape(mask_view)
        if len(mask_shape) != 2 or mask_shape[0] < packed or mask_shape[1] * 32 < vocab:
            raise ctx.fail(
                f"allowed_mask: expected [>= {packed}, >= {cdiv(vocab, 32)}] words (a row a packed token), "
                f"got shape {list(mask_shape)}"
            )
        mask_words = int(mask_shape[1])
        grammar = {
            "masks": _typed(ctx, mask_view, "allowed_mask", _WORDS),
            "constrained": _per_lane(ctx, node, "constrained", lanes, _FLAGS),
        }
        mask_scratch_view = ctx.workspace("verify.allowed_mask", mf.DTYPE_I32, lanes * mask_words)
    grammar["mask_scratch"] = ctx.pointer(mask_scratch_view) if mask_scratch_view is not None else outputs["ids"]
    mask_constants = {
        "HAS_MASK": mask_scratch_view is not None,
        "WORDS": mask_words,
        "BLOCK_W": min(next_power_of_two(mask_words), 1024),
    }
    chunks = cdiv(vocab, min(GATHER_BLOCK, next_power_of_two(vocab)))
    block_v = min(GATHER_BLOCK, next_power_of_two(vocab))
    block_l, _ = _lane_walk(lanes)
    launches = [
        ctx.launch(
            _verify_begin_kernel,
            {
                "logits": ctx.pointer(logits_view),
                "query_length": _typed(ctx, lengths, "query_length", _INTS),
                "rows": _per_lane(ctx, node, "rows", lanes, _INTS),
                "step": _per_lane(ctx, node, "step", lanes, _INTS),
                "active": _per_lane(ctx, node, "active", lanes, _FLAGS),
                "starts": ctx.pointer(starts),
                "steps": ctx.pointer(steps),
                "flags": ctx.pointer(flags),
                "scratch": ctx.pointer(scratch_view),
                **grammar,
                **outputs,
            },
            {
                **mask_constants,
                "LANES": lanes,
                "STRIDE": stride,
                "V": vocab,
                "WIDTH": width,
                "POSITIONS": positions,
                "PACKED": packed,
                "HAS_LOGPROB": logprob_view is not None,
                "BLOCK_L": block_l,
                "COL_PAD": next_power_of_two(max(width, positions)),
                "BLOCK_V": block_v,
            },
            (lanes, chunks),
            num_warps=4,
        )
    ]
    for position in range(positions):
        views = {
            "active": _row_view(flags, position, stride, [lanes]),
            "step": _row_view(steps, position, stride, [lanes]),
            "ids": _row_view(drawn, position, stride, [lanes, 1]),
        }
        if logprob_view is not None:
            views["logprob"] = _row_view(drawn_logprob, position, stride, [lanes, 1])
        if mask_scratch_view is not None and constrained_view is not None:
            views["allowed_mask"] = mf.BufferView(
                buffer=mask_scratch_view.buffer, element_offset=0, shape=[lanes, mask_words]
            )
            views["constrained"] = constrained_view
        launches.extend(_position_sample(ctx, node, scratch_view, lanes, vocab, views))
        last = position == positions - 1
        launches.append(
            ctx.launch(
                _verify_step_kernel,
                {
                    "logits": ctx.pointer(logits_view),
                    "query_length": _typed(ctx, lengths, "query_length", _INTS),
                    "candidates": candidates,
                    "starts": ctx.pointer(starts),
                    "flags": ctx.pointer(flags),
                    "drawn": ctx.pointer(drawn),
                    "drawn_logprob": ctx.pointer(drawn_logprob),
                    "scratch": ctx.pointer(scratch_view),
                    **grammar,
                    **outputs,
                    "position": ctx.i32(position),
                },
                {
                    **mask_constants,
                    "STRIDE": stride,
                    "V": vocab,
                    "WIDTH": width,
                    "CAPACITY": capacity,
                    "HAS_NEXT": not last,
                    "HAS_LOGPROB": logprob_view is not None,
                    "BLOCK_V": block_v,
                },
                (lanes, 1 if last else chunks),
                num_warps=4,
            )
        )
    return launches
