"""Row-wise and elementwise GPU kernels and their lowerings.

Owns the Triton kernels, and the registered lowering functions, of the operators that touch each
row or element on its own: ``embedding``, ``rmsnorm``, ``silu_mul``, ``add``, ``gather_rows``,
``lane_last_index``, ``copy_rows``, ``init_sampling_state``, ``completion_lanes``,
``completion_copy_lanes``, ``tail_page``, ``rope`` and ``kv_cache_write``. Each lowering makes one
launch (``copy_rows`` within one buffer makes two, through a workspace, so that every source is read
before any destination is written) and reproduces the reference semantics of
:mod:`helios_core.backends.reference_kernels` and the reference adapters:

* float arithmetic is float32 as in the reference; ``rmsnorm`` sums the squares of a row in float64,
  then ``1 / sqrt(mean + eps)`` with correctly rounded float32 square root and division;
  ``silu_mul`` divides with correct rounding and uses the device ``exp`` (a few ulp);
* ``rope`` computes ``inv_freq``, the angle ``position * inv_freq`` and its cosine and sine in
  float64 on the device (the optional frequency-band scaling too, with the reference's formula and
  operation order), then rounds cos/sin to float32 and rotates in float32. The only difference
  from the reference is ``theta ** e`` evaluated as ``exp2(e * log2(theta))`` (a few float64 ulp),
  which after rounding to float32 leaves cos/sin equal to the reference's or one float32 ulp away,
  and a possible fused multiply-add in the rotation (about 1e-7 relative);
* a negative index gives a zero row (``gather_rows``) or skips the pair or token (``copy_rows``,
  ``kv_cache_write``, ``init_sampling_state``); ``when`` flags equal to zero skip a pair. Where the
  reference raises on an index past the end of a buffer whose extent is fixed at build time, the
  kernels do not access memory there: ``gather_rows`` and ``embedding`` (also for an id < 0,
  which the reference rejects) write a zero row, copies
  and cache writes skip, ``tail_page`` gives -1, ``completion_lanes`` reports 0 consumed tokens.
  Extents the runtime fixes (cache pages, state and snapshot rows) are never compiled in, so
  indices into those are trusted.

Shapes known at build time (trailing extents, row counts of views) are compile-time constants;
launch grids cover the row counts of the views. Copies run in the widest unit (8, 4, 2 or 1 bytes)
that divides the row width and both view offsets, so rows move in 16-byte vector accesses where
alignment allows. Every kernel ends in ``USE_PDL``: when set it calls ``gdc_wait()`` before its
first access to a buffer other than weights, then ``gdc_launch_dependents()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import (
    ITEMSIZE,
    KernelArg,
    LoweringContext,
    cdiv,
    lowering,
    next_power_of_two,
)
from ignition.kernels.rotary import frequency_args, inverse_frequencies

FLOAT_DTYPES = frozenset({mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16})
"""Float buffer dtypes the kernels read and write (bf16 as ``*bf16``, converted exactly)."""
INT_DTYPES = frozenset({mf.DTYPE_I32, mf.DTYPE_I64, mf.DTYPE_U8, mf.DTYPE_U32, mf.DTYPE_U64})
"""Integer buffer dtypes accepted for indices, flags and integer rows."""

_TILE_BYTES = 8192
"""Bytes of one row-kernel tile (rows x columns) per program."""
_FLAT_BLOCK = 2048
"""Elements per program of the flat elementwise kernels."""
_RMSNORM_SINGLE = 8192
"""Widest row (padded to a power of two) that ``rmsnorm`` keeps in registers; wider rows take two passes."""
_RMSNORM_CHUNK = 4096
_ROPE_TILE = 4096
"""Elements of one token's heads that one ``rope`` program rotates."""
_MAX_GRID_YZ = 65535
_ITEMSIZE: dict[int, int] = {int(dtype): size for dtype, size in ITEMSIZE.items()}
_COPY_UNITS = ((8, mf.DTYPE_I64), (4, mf.DTYPE_I32), (2, mf.DTYPE_F16), (1, mf.DTYPE_U8))


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit  # type: ignore[untyped-decorator]
def _gather_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    index_ptr,
    out_ptr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[i] = x[index[i]]`` (converted to out's dtype); zeros where index < 0 or >= LIMIT (if > 0)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < ROWS
    index = tl.load(index_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (index >= 0)
    if LIMIT > 0:
        keep = keep & (index < LIMIT)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    col_ok = (cols < WIDTH)[None, :]
    values = tl.load(x_ptr + index[:, None] * WIDTH + cols[None, :], mask=keep[:, None] & col_ok, other=0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * WIDTH + cols[None, :], values, mask=in_range[:, None] & col_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _copy_rows_kernel(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_rows_ptr,
    src_rows_ptr,
    when_ptr,
    dst_ptr,
    PAIRS: tl.constexpr,
    WIDTH: tl.constexpr,
    SRC_LIMIT: tl.constexpr,
    DST_LIMIT: tl.constexpr,
    HAS_SRC_ROWS: tl.constexpr,
    HAS_WHEN: tl.constexpr,
    READ_BY_PAIR: tl.constexpr,
    WRITE_BY_PAIR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for the pairs with both indices >= 0 (and when != 0).

    ``READ_BY_PAIR``/``WRITE_BY_PAIR`` address the source/destination by pair number instead (the
    two halves of a copy through a workspace); the pairs kept are the same either way.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pairs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = pairs < PAIRS
    dst_row = tl.load(dst_rows_ptr + pairs, mask=in_range, other=-1).to(tl.int64)
    if HAS_SRC_ROWS:
        src_row = tl.load(src_rows_ptr + pairs, mask=in_range, other=-1).to(tl.int64)
    else:
        src_row = pairs.to(tl.int64)
    keep = in_range & (dst_row >= 0) & (src_row >= 0)
    if SRC_LIMIT > 0:
        keep = keep & (src_row < SRC_LIMIT)
    if DST_LIMIT > 0:
        keep = keep & (dst_row < DST_LIMIT)
    if HAS_WHEN:
        flag = tl.load(when_ptr + pairs, mask=in_range, other=0)
        keep = keep & (flag != 0)
    if READ_BY_PAIR:
        src_row = pairs.to(tl.int64)
    if WRITE_BY_PAIR:
        dst_row = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = keep[:, None] & (cols < WIDTH)[None, :]
    values = tl.load(src_ptr + src_row[:, None] * WIDTH + cols[None, :], mask=mask)
    tl.store(dst_ptr + dst_row[:, None] * WIDTH + cols[None, :], values, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _rmsnorm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    out_ptr,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    WEIGHT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row per program (:func:`rmsnorm_row`)."""
    row = tl.program_id(0).to(tl.int64)
    rmsnorm_row(
        x_ptr + row * HIDDEN, weight_ptr, out_ptr + row * HIDDEN, eps, HIDDEN, BLOCK, SINGLE, WEIGHT_EARLY, USE_PDL
    )


@triton.jit  # type: ignore[untyped-decorator]
def rmsnorm_row(  # type: ignore[no-untyped-def]
    x_row,
    weight_ptr,
    out_row,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    WEIGHT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The RMS norm of the row at ``x_row`` into ``out_row``: float32 squares summed in float64, mean to
    float32, (x * scale) * weight; the whole row in registers when ``SINGLE``, else two passes of
    ``BLOCK``. With ``WEIGHT_EARLY`` the gains are loaded before ``gdc_wait`` (weights are never written)."""
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        col_ok = cols < HIDDEN
        if WEIGHT_EARLY:
            weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if not WEIGHT_EARLY:
            weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        total = tl.sum((x * x).to(tl.float64), axis=0)
        mean = (total / HIDDEN).to(tl.float32)
        scale = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
        tl.store(out_row + cols, (x * scale) * weight, mask=col_ok)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, HIDDEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
            acc += (x * x).to(tl.float64)
        mean = (tl.sum(acc, axis=0) / HIDDEN).to(tl.float32)
        scale = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
        for start in range(0, HIDDEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            col_ok = cols < HIDDEN
            x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (x * scale) * weight, mask=col_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    gate_ptr, up_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """``out = (g / (1 + exp(-g))) * up`` in float32, flat."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g))
    tl.store(out_ptr + offs, silu * u, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _add_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    out_ptr,
    N: tl.constexpr,
    B_SIZE: tl.constexpr,
    B_INNER: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[i] = a[i] + b[(i // B_INNER) % B_SIZE]`` in float32 (b equal-shaped when B_SIZE == N)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if B_SIZE == N:
        b_offs = offs
    elif B_INNER == 1:
        b_offs = offs % B_SIZE
    else:
        b_offs = (offs // B_INNER) % B_SIZE
    b = tl.load(b_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, a + b, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _lane_last_index_kernel(  # type: ignore[no-untyped-def]
    length_ptr, out_ptr, LANES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """One program: ``out[i] = cumsum(max(length, 0))[i] - 1`` where ``length[i] > 0``, else -1."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    carry = tl.full([], 0, tl.int64)
    for start in range(0, LANES, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < LANES
        length = tl.load(length_ptr + offs, mask=mask, other=0).to(tl.int64)
        counted = tl.maximum(length, 0)
        ends = tl.cumsum(counted, axis=0) + carry - 1
        tl.store(out_ptr + offs, tl.where(length > 0, ends, -1), mask=mask)
        carry += tl.sum(counted, axis=0)


@triton.jit  # type: ignore[untyped-decorator]
def _init_sampling_state_kernel(  # type: ignore[no-untyped-def]
    histogram_ptr,
    rows_ptr,
    presence_ptr,
    counts_ptr,
    ROWS: tl.constexpr,
    HIST_WIDTH: tl.constexpr,
    COUNTS_WIDTH: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``presence[rows[i]] = histogram[i] > 0`` and ``counts[rows[i]] = 0`` for rows[i] >= 0."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    lanes = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = lanes < ROWS
    target = tl.load(rows_ptr + lanes, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (target >= 0)
    if LIMIT > 0:
        keep = keep & (target < LIMIT)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    hist_mask = keep[:, None] & (cols < HIST_WIDTH)[None, :]
    hist = tl.load(histogram_ptr + lanes.to(tl.int64)[:, None] * HIST_WIDTH + cols[None, :], mask=hist_mask, other=0)
    tl.store(presence_ptr + target[:, None] * HIST_WIDTH + cols[None, :], hist > 0, mask=hist_mask)
    counts_mask = keep[:, None] & (cols < COUNTS_WIDTH)[None, :]
    zeros = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int32)
    tl.store(counts_ptr + target[:, None] * COUNTS_WIDTH + cols[None, :], zeros, mask=counts_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _completion_lanes_kernel(  # type: ignore[no-untyped-def]
    generation_ptr,
    active_ptr,
    last_index_ptr,
    positions_ptr,
    sequence_ptr,
    out_generation_ptr,
    out_emitted_ptr,
    out_consumed_ptr,
    out_draft_cursor_ptr,
    out_reserved_ptr,
    out_sequence_ptr,
    LANES: tl.constexpr,
    TOKENS: tl.constexpr,
    SEQUENCE: tl.constexpr,
    BLOCK: tl.constexpr,
    SEQUENCE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Per lane: echo generation, emitted = active != 0, consumed = positions[last] + 1 (0 if last < 0)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = lanes < LANES
    generation = tl.load(generation_ptr + lanes, mask=mask, other=0)
    active = tl.load(active_ptr + lanes, mask=mask, other=0)
    last = tl.load(last_index_ptr + lanes, mask=mask, other=-1).to(tl.int64)
    valid = mask & (last >= 0) & (last < TOKENS)
    position = tl.load(positions_ptr + last, mask=valid, other=0).to(tl.int64)
    consumed = tl.where(valid, position + 1, 0)
    minus_one = tl.full([BLOCK], -1, tl.int32)
    tl.store(out_generation_ptr + lanes, generation, mask=mask)
    tl.store(out_emitted_ptr + lanes, (active != 0).to(tl.int32), mask=mask)
    tl.store(out_consumed_ptr + lanes, consumed, mask=mask)
    tl.store(out_draft_cursor_ptr + lanes, minus_one, mask=mask)
    tl.store(out_reserved_ptr + lanes, minus_one, mask=mask)
    if tl.program_id(0) == 0:
        seq = tl.arange(0, SEQUENCE_BLOCK)
        seq_mask = seq < SEQUENCE
        tl.store(out_sequence_ptr + seq, tl.load(sequence_ptr + seq, mask=seq_mask), mask=seq_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _completion_copy_lanes_kernel(  # type: ignore[no-untyped-def]
    generation_ptr,
    consumed_ptr,
    sequence_ptr,
    out_generation_ptr,
    out_emitted_ptr,
    out_consumed_ptr,
    out_draft_cursor_ptr,
    out_reserved_ptr,
    out_sequence_ptr,
    LANES: tl.constexpr,
    SEQUENCE: tl.constexpr,
    BLOCK: tl.constexpr,
    SEQUENCE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Per lane: echo generation, emitted 0, consumed copied, draft cursor and reserved -1."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = lanes < LANES
    generation = tl.load(generation_ptr + lanes, mask=mask, other=0)
    consumed = tl.load(consumed_ptr + lanes, mask=mask, other=0)
    minus_one = tl.full([BLOCK], -1, tl.int32)
    tl.store(out_generation_ptr + lanes, generation, mask=mask)
    tl.store(out_emitted_ptr + lanes, tl.zeros([BLOCK], dtype=tl.int32), mask=mask)
    tl.store(out_consumed_ptr + lanes, consumed, mask=mask)
    tl.store(out_draft_cursor_ptr + lanes, minus_one, mask=mask)
    tl.store(out_reserved_ptr + lanes, minus_one, mask=mask)
    if tl.program_id(0) == 0:
        seq = tl.arange(0, SEQUENCE_BLOCK)
        seq_mask = seq < SEQUENCE
        tl.store(out_sequence_ptr + seq, tl.load(sequence_ptr + seq, mask=seq_mask), mask=seq_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _tail_page_kernel(  # type: ignore[no-untyped-def]
    page_table_ptr,
    consumed_ptr,
    out_ptr,
    ROWS: tl.constexpr,
    PAGES: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[r] = page_table[r, consumed[r] // PAGE_TOKENS]`` for a partial last page, else -1."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < ROWS
    consumed = tl.load(consumed_ptr + rows, mask=mask, other=0).to(tl.int64)
    positive = tl.maximum(consumed, 0)
    page = positive // PAGE_TOKENS
    valid = mask & (consumed > 0) & (positive % PAGE_TOKENS != 0) & (page < PAGES)
    found = tl.load(page_table_ptr + rows.to(tl.int64) * PAGES + page, mask=valid, other=0)
    tl.store(out_ptr + rows, tl.where(valid, found.to(tl.int64), -1), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _rope_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    positions_ptr,
    out_ptr,
    log2_theta_bits,
    factor_bits,
    low_bits,
    high_bits,
    original_bits,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token, BLOCK_H heads per program; inv_freq, angle, cos and sin in float64, rotation in float32.

    The ``*_bits`` parameters are float64 values passed as their int64 bit patterns.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    pair = tl.arange(0, HALF_BLOCK)
    inv_freq = inverse_frequencies(
        pair, HEAD_DIM, log2_theta_bits, factor_bits, low_bits, high_bits, original_bits, HAS_SCALING
    )
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    angle = tl.load(positions_ptr + token).to(tl.float64) * inv_freq
    cos = tl.cos(angle).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(tl.float32)[None, :]
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    base = token * (HEADS * HEAD_DIM) + heads.to(tl.int64)[:, None] * HEAD_DIM
    head_ok = (heads < HEADS)[:, None]
    if INTERLEAVED:
        cols = tl.arange(0, 2 * HALF_BLOCK)
        mask = head_ok & (cols < HEAD_DIM)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        first, second = tl.split(tl.reshape(x, [BLOCK_H, HALF_BLOCK, 2]))
        rotated = tl.join(first * cos - second * sin, first * sin + second * cos)
        tl.store(out_ptr + base + cols[None, :], tl.reshape(rotated, [BLOCK_H, 2 * HALF_BLOCK]), mask=mask)
    else:
        mask = head_ok & (pair < HALF)[None, :]
        first = tl.load(x_ptr + base + pair[None, :], mask=mask, other=0.0).to(tl.float32)
        second = tl.load(x_ptr + base + HALF + pair[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + pair[None, :], first * cos - second * sin, mask=mask)
        tl.store(out_ptr + base + HALF + pair[None, :], first * sin + second * cos, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _kv_cache_write_kernel(  # type: ignore[no-untyped-def]
    k_ptr,
    v_ptr,
    slots_ptr,
    k_plane_ptr,
    v_plane_ptr,
    TOKENS: tl.constexpr,
    WIDTH: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``plane[slot[t]] = k[t]`` / ``v[t]`` with planes as ``[slots, WIDTH]`` rows; slot < 0 skips."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = tokens < TOKENS
    slot = tl.load(slots_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0)
    if LIMIT > 0:
        keep = keep & (slot < LIMIT)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = keep[:, None] & (cols < WIDTH)[None, :]
    source = tokens.to(tl.int64)[:, None] * WIDTH + cols[None, :]
    target = slot[:, None] * WIDTH + cols[None, :]
    tl.store(k_plane_ptr + target, tl.load(k_ptr + source, mask=mask), mask=mask)
    tl.store(v_plane_ptr + target, tl.load(v_ptr + source, mask=mask), mask=mask)


# ----------------------------------------------------------------------------------------------
# lowering helpers
# ----------------------------------------------------------------------------------------------


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _dtype_name(dtype: int) -> str:
    return str(mf.DType.Name(dtype))


def _require_dtype(ctx: LoweringContext, name: str, view: mf.BufferView, allowed: frozenset[int]) -> int:
    dtype = ctx.dtype(view)
    if dtype not in allowed:
        names = ", ".join(sorted(_dtype_name(d) for d in allowed))
        raise ctx.fail(f"argument {name!r} has dtype {_dtype_name(dtype)}; expected one of {names}")
    return dtype


def _require_numel(ctx: LoweringContext, name: str, view: mf.BufferView, count: int) -> None:
    found = _numel(ctx.shape(view))
    if found != count:
        raise ctx.fail(f"argument {name!r} of shape {list(ctx.shape(view))} holds {found} elements, expected {count}")


def _leading_bound(ctx: LoweringContext, view: mf.BufferView) -> int:
    """Rows the view surely holds, or 0 when the runtime fixes its leading extent (a symbolic buffer)."""
    for decl in ctx.manifest.buffers:
        if decl.name == view.buffer:
            declared = tuple(int(d.size) for d in decl.shape)
            symbolic = bool(decl.shape) and int(decl.shape[0].symbol) != mf.DIM_SYMBOL_UNSPECIFIED
            whole = int(view.element_offset) == 0 and (not view.shape or tuple(int(s) for s in view.shape) == declared)
            if symbolic and whole:
                return 0
            break
    shape = ctx.shape(view)
    return int(shape[0]) if shape else 1


def _row_tile(ctx: LoweringContext, rows: int, width: int, itemsize: int) -> tuple[int, int, int, list[int]]:
    """``(BLOCK_R, BLOCK_W, num_warps, grid)`` for a row kernel over ``rows`` rows of ``width`` elements."""
    budget = max(1, _TILE_BYTES // itemsize)
    block_w = min(next_power_of_two(width), budget)
    block_r = max(1, min(next_power_of_two(rows), budget // block_w))
    num_warps = max(1, min(8, block_r * block_w * itemsize // 2048))
    grid = [max(1, cdiv(rows, block_r)), max(1, cdiv(width, block_w))]
    if grid[1] > _MAX_GRID_YZ:
        raise ctx.fail(f"rows of {width} elements need {grid[1]} column blocks (at most {_MAX_GRID_YZ})")
    return block_r, block_w, num_warps, grid


def _flat_tile(count: int) -> tuple[int, int, list[int]]:
    block = min(next_power_of_two(count), _FLAT_BLOCK)
    num_warps = max(1, min(8, block // 256))
    return block, num_warps, [max(1, cdiv(count, block))]


def _lane_block(count: int) -> tuple[int, int, list[int]]:
    block = min(next_power_of_two(count), 1024)
    num_warps = max(1, min(4, block // 256))
    return block, num_warps, [max(1, cdiv(count, block))]


def _check_index_count(ctx: LoweringContext, count: int) -> None:
    if count >= 2**31:
        raise ctx.fail(f"{count} rows exceed the kernels' 32-bit row numbering")


# ----------------------------------------------------------------------------------------------
# lowerings
# ----------------------------------------------------------------------------------------------


def _gather_launch(
    ctx: LoweringContext,
    x: mf.BufferView,
    index: mf.BufferView,
    out: mf.BufferView,
    rows: int,
    width: int,
    limit: int,
) -> mf.KernelLaunch:
    _check_index_count(ctx, rows)
    itemsize = max(_ITEMSIZE[ctx.dtype(x)], _ITEMSIZE[ctx.dtype(out)])
    block_r, block_w, num_warps, grid = _row_tile(ctx, rows, width, itemsize)
    args = {"x_ptr": ctx.pointer(x), "index_ptr": ctx.pointer(index), "out_ptr": ctx.pointer(out)}
    constants = {"ROWS": rows, "WIDTH": width, "LIMIT": limit, "BLOCK_R": block_r, "BLOCK_W": block_w}
    return ctx.launch(_gather_rows_kernel, args, constants, grid, num_warps=num_warps)


@lowering("embedding")
def lower_embedding(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """``out[t] = table[ids[t]]`` widened to float32; an id outside ``[0, V)`` gives a zero row."""
    table, ids, out = ctx.need(node, "table"), ctx.need(node, "ids"), ctx.need(node, "out")
    _require_dtype(ctx, "table", table, FLOAT_DTYPES)
    _require_dtype(ctx, "ids", ids, INT_DTYPES)
    _require_dtype(ctx, "out", out, FLOAT_DTYPES)
    shape = ctx.shape(table)
    if len(shape) != 2:
        raise ctx.fail(f"table must be [V, H], got shape {list(shape)}")
    vocab, hidden = int(shape[0]), int(shape[1])
    if vocab <= 0 or hidden <= 0:
        raise ctx.fail(f"table of shape {list(shape)} is empty")
    tokens = _numel(ctx.shape(ids))
    _require_numel(ctx, "out", out, tokens * hidden)
    return [_gather_launch(ctx, table, ids, out, tokens, hidden, vocab)]


@lowering("gather_rows")
def lower_gather_rows(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """``out[i] = x[index[i]]``, a zero row where ``index[i] < 0``; float rows or integer rows."""
    x, index, out = ctx.need(node, "x"), ctx.need(node, "index"), ctx.need(node, "out")
    x_dtype = _require_dtype(ctx, "x", x, FLOAT_DTYPES | INT_DTYPES)
    out_dtype = _require_dtype(ctx, "out", out, FLOAT_DTYPES | INT_DTYPES)
    _require_dtype(ctx, "index", index, INT_DTYPES)
    if (x_dtype in FLOAT_DTYPES) != (out_dtype in FLOAT_DTYPES):
        raise ctx.fail(f"x ({_dtype_name(x_dtype)}) and out ({_dtype_name(out_dtype)}) must both be float or integer")
    shape = ctx.shape(x)
    if not shape:
        raise ctx.fail("x needs at least one dimension")
    width = _numel(shape[1:])
    rows = _numel(ctx.shape(index))
    _require_numel(ctx, "out", out, rows * width)
    return [_gather_launch(ctx, x, index, out, rows, width, _leading_bound(ctx, x))]


def rmsnorm_blocks(hidden: int) -> tuple[bool, int, int]:
    """(whole row in registers, block, warps) of :func:`rmsnorm_row` over rows of ``hidden`` values: rows
    wider than 8192 (padded) take two passes of 4096."""
    padded = next_power_of_two(hidden)
    single = padded <= _RMSNORM_SINGLE
    block = padded if single else _RMSNORM_CHUNK
    return single, block, max(1, min(8, block // 256))


@lowering("rmsnorm")
def lower_rmsnorm(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program per row of ``x``; rows wider than 8192 (padded) take two passes."""
    x, weight, out = ctx.need(node, "x"), ctx.need(node, "weight"), ctx.need(node, "out")
    for name, view in (("x", x), ("weight", weight), ("out", out)):
        _require_dtype(ctx, name, view, FLOAT_DTYPES)
    eps = ctx.attribute(node, "eps")
    if not isinstance(eps, int | float) or not float(eps) > 0.0:
        raise ctx.fail(f"attribute 'eps' must be a number > 0, got {eps!r}")
    shape = ctx.shape(x)
    if len(shape) != 2:
        raise ctx.fail(f"x must be [T, H], got shape {list(shape)}")
    rows, hidden = int(shape[0]), int(shape[1])
    _require_numel(ctx, "weight", weight, hidden)
    _require_numel(ctx, "out", out, rows * hidden)
    _check_index_count(ctx, rows)
    single, block, num_warps = rmsnorm_blocks(hidden)
    args = {
        "x_ptr": ctx.pointer(x),
        "weight_ptr": ctx.pointer(weight),
        "out_ptr": ctx.pointer(out),
        "eps": ctx.f32(float(eps)),
    }
    constants = {"HIDDEN": hidden, "BLOCK": block, "SINGLE": single, "WEIGHT_EARLY": ctx.is_weights(weight)}
    return [ctx.launch(_rmsnorm_kernel, args, constants, [max(1, rows)], num_warps=num_warps)]


@lowering("silu_mul")
def lower_silu_mul(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Flat over every element of ``gate``/``up``."""
    gate, up, out = ctx.need(node, "gate"), ctx.need(node, "up"), ctx.need(node, "out")
    for name, view in (("gate", gate), ("up", up), ("out", out)):
        _require_dtype(ctx, name, view, FLOAT_DTYPES)
    if ctx.shape(gate) != ctx.shape(up):
        raise ctx.fail(f"gate {list(ctx.shape(gate))} and up {list(ctx.shape(up))} must have the same shape")
    count = _numel(ctx.shape(gate))
    _require_numel(ctx, "out", out, count)
    block, num_warps, grid = _flat_tile(count)
    args = {"gate_ptr": ctx.pointer(gate), "up_ptr": ctx.pointer(up), "out_ptr": ctx.pointer(out)}
    return [ctx.launch(_silu_mul_kernel, args, {"N": count, "BLOCK": block}, grid, num_warps=num_warps)]


def _broadcast(ctx: LoweringContext, a: Sequence[int], b: Sequence[int]) -> tuple[int, int]:
    """``(B_SIZE, B_INNER)`` with ``b``'s flat index ``(i // B_INNER) % B_SIZE`` for a's flat index ``i``."""
    if len(b) > len(a):
        if any(int(d) != 1 for d in b[: len(b) - len(a)]):
            raise ctx.fail(f"b: shape {list(b)} would change a's shape {list(a)}")
        b = b[len(b) - len(a) :]
    padded = [1] * (len(a) - len(b)) + [int(d) for d in b]
    varying = []
    for axis, (da, db) in enumerate(zip(a, padded, strict=True)):
        if db not in (1, int(da)):
            raise ctx.fail(f"b: shape {list(b)} does not broadcast to a's shape {list(a)}")
        if db == int(da) and db != 1:
            varying.append(axis)
    if not varying:
        return 1, 1
    lo, hi = varying[0], varying[-1] + 1
    if varying != list(range(lo, hi)):
        raise ctx.fail(f"b: broadcasting {list(b)} over {list(a)} along non-adjacent axes is not supported")
    return _numel(a[lo:hi]), _numel(a[hi:])


@lowering("add")
def lower_add(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Flat over ``a``; ``b`` equal-shaped or broadcast along one run of adjacent axes."""
    a, b, out = ctx.need(node, "a"), ctx.need(node, "b"), ctx.need(node, "out")
    for name, view in (("a", a), ("b", b), ("out", out)):
        _require_dtype(ctx, name, view, FLOAT_DTYPES)
    a_shape = ctx.shape(a)
    count = _numel(a_shape)
    _require_numel(ctx, "out", out, count)
    b_size, b_inner = _broadcast(ctx, a_shape, ctx.shape(b))
    block, num_warps, grid = _flat_tile(count)
    args = {"a_ptr": ctx.pointer(a), "b_ptr": ctx.pointer(b), "out_ptr": ctx.pointer(out)}
    constants = {"N": count, "B_SIZE": b_size, "B_INNER": b_inner, "BLOCK": block}
    return [ctx.launch(_add_kernel, args, constants, grid, num_warps=num_warps)]


@lowering("lane_last_index")
def lower_lane_last_index(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One program scanning every lane (in blocks of up to 1024, carrying the running sum)."""
    lengths, out = ctx.need(node, "query_length"), ctx.need(node, "out")
    _require_dtype(ctx, "query_length", lengths, INT_DTYPES)
    _require_dtype(ctx, "out", out, INT_DTYPES)
    lanes = _numel(ctx.shape(lengths))
    _require_numel(ctx, "out", out, lanes)
    block = min(next_power_of_two(lanes), 1024)
    num_warps = max(1, min(4, block // 256))
    args = {"length_ptr": ctx.pointer(lengths), "out_ptr": ctx.pointer(out)}
    return [ctx.launch(_lane_last_index_kernel, args, {"LANES": lanes, "BLOCK": block}, [1], num_warps=num_warps)]


def _copy_unit(ctx: LoweringContext, row_bytes: int, views: Sequence[mf.BufferView], itemsize: int) -> tuple[int, int]:
    """The widest ``(bytes, dtype)`` unit dividing the row width and every view's byte offset."""
    offsets = [int(v.element_offset) * itemsize for v in views]
    for size, dtype in _COPY_UNITS:
        if row_bytes % size == 0 and all(off % size == 0 for off in offsets):
            return size, dtype
    raise ctx.fail("no copy unit fits")  # unreachable: one byte always fits


@lowering("copy_rows")
def lower_copy_rows(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Rows move as raw bytes in the widest aligned unit; within one buffer, through a workspace."""
    src, dst_rows, dst = ctx.need(node, "src"), ctx.need(node, "dst_rows"), ctx.need(node, "dst")
    src_rows, when = ctx.arg(node, "src_rows"), ctx.arg(node, "when")
    dtype = ctx.dtype(src)
    if ctx.dtype(dst) != dtype:
        raise ctx.fail(f"src dtype {_dtype_name(dtype)} differs from dst dtype {_dtype_name(ctx.dtype(dst))}")
    if dtype not in ITEMSIZE:
        raise ctx.fail(f"copy_rows does not support dtype {_dtype_name(dtype)}")
    _require_dtype(ctx, "dst_rows", dst_rows, INT_DTYPES)
    src_shape, dst_shape = ctx.shape(src), ctx.shape(dst)
    if not src_shape or not dst_shape:
        raise ctx.fail("src and dst need at least one dimension")
    if tuple(src_shape[1:]) != tuple(dst_shape[1:]):
        raise ctx.fail(f"src trailing shape {list(src_shape[1:])} differs from dst's {list(dst_shape[1:])}")
    pairs = _numel(ctx.shape(dst_rows))
    _check_index_count(ctx, pairs)
    if src_rows is not None:
        _require_dtype(ctx, "src_rows", src_rows, INT_DTYPES)
        _require_numel(ctx, "src_rows", src_rows, pairs)
    if when is not None:
        _require_dtype(ctx, "when", when, INT_DTYPES)
        if _numel(ctx.shape(when)) < pairs:
            raise ctx.fail(f"when holds {_numel(ctx.shape(when))} flags for {pairs} pairs")
    itemsize = _ITEMSIZE[dtype]
    row_bytes = _numel(src_shape[1:]) * itemsize
    if row_bytes == 0:
        raise ctx.fail("rows of zero elements")
    unit, unit_dtype = _copy_unit(ctx, row_bytes, (src, dst), itemsize)
    width = row_bytes // unit
    block_r, block_w, num_warps, grid = _row_tile(ctx, pairs, width, unit)
    src_limit = _leading_bound(ctx, src)
    dst_limit = _leading_bound(ctx, dst)

    def index_args(first: KernelArg, last: KernelArg) -> dict[str, KernelArg]:
        args = {"src_ptr": first, "dst_rows_ptr": ctx.pointer(dst_rows)}
        if src_rows is not None:
            args["src_rows_ptr"] = ctx.pointer(src_rows)
        if when is not None:
            args["when_ptr"] = ctx.pointer(when)
        args["dst_ptr"] = last
        return args

    def constants(read_by_pair: bool, write_by_pair: bool) -> dict[str, int | float | bool]:
        found: dict[str, int | float | bool] = {
            "PAIRS": pairs,
            "WIDTH": width,
            "SRC_LIMIT": src_limit,
            "DST_LIMIT": dst_limit,
            "HAS_SRC_ROWS": src_rows is not None,
            "HAS_WHEN": when is not None,
            "READ_BY_PAIR": read_by_pair,
            "WRITE_BY_PAIR": write_by_pair,
            "BLOCK_R": block_r,
            "BLOCK_W": block_w,
        }
        if src_rows is None:
            found["src_rows_ptr"] = 0
        if when is None:
            found["when_ptr"] = 0
        return found

    src_arg = ctx.pointer(src, as_dtype=unit_dtype)
    dst_arg = ctx.pointer(dst, as_dtype=unit_dtype)
    if src.buffer != dst.buffer:
        args = index_args(src_arg, dst_arg)
        return [ctx.launch(_copy_rows_kernel, args, constants(False, False), grid, num_warps=num_warps)]
    # Source and destination rows may overlap: stage every kept source row first.
    staging = ctx.workspace("copy_rows", mf.DTYPE_U8, max(1, pairs * row_bytes))
    staged = ctx.pointer(staging, as_dtype=unit_dtype)
    return [
        ctx.launch(_copy_rows_kernel, index_args(src_arg, staged), constants(False, True), grid, num_warps=num_warps),
        ctx.launch(_copy_rows_kernel, index_args(staged, dst_arg), constants(True, False), grid, num_warps=num_warps),
    ]


@lowering("init_sampling_state")
def lower_init_sampling_state(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Tiles of admitted lanes by vocabulary columns; negative rows are skipped."""
    histogram, rows = ctx.need(node, "prompt_histogram"), ctx.need(node, "rows")
    presence, counts = ctx.need(node, "prompt_presence"), ctx.need(node, "output_counts")
    for name, view in (("prompt_histogram", histogram), ("rows", rows), ("prompt_presence", presence)):
        _require_dtype(ctx, name, view, INT_DTYPES)
    _require_dtype(ctx, "output_counts", counts, INT_DTYPES)
    hist_shape, presence_shape, counts_shape = ctx.shape(histogram), ctx.shape(presence), ctx.shape(counts)
    lanes = _numel(ctx.shape(rows))
    if len(hist_shape) != 2 or int(hist_shape[0]) != lanes:
        raise ctx.fail(f"prompt_histogram {list(hist_shape)} must be [{lanes}, V] for {lanes} rows")
    if len(presence_shape) != 2 or int(presence_shape[1]) != int(hist_shape[1]):
        raise ctx.fail(f"prompt_presence {list(presence_shape)} must be [rows, {int(hist_shape[1])}]")
    if len(counts_shape) < 1 or not counts_shape[1:]:
        raise ctx.fail(f"output_counts {list(counts_shape)} must be [rows, V]")
    _check_index_count(ctx, lanes)
    hist_width, counts_width = int(hist_shape[1]), _numel(counts_shape[1:])
    bounds = [b for b in (_leading_bound(ctx, presence), _leading_bound(ctx, counts)) if b > 0]
    width = max(hist_width, counts_width)
    itemsize = max(_ITEMSIZE[ctx.dtype(presence)], _ITEMSIZE[ctx.dtype(counts)])
    block_r, block_w, num_warps, grid = _row_tile(ctx, lanes, width, itemsize)
    args = {
        "histogram_ptr": ctx.pointer(histogram),
        "rows_ptr": ctx.pointer(rows),
        "presence_ptr": ctx.pointer(presence),
        "counts_ptr": ctx.pointer(counts),
    }
    constants = {
        "ROWS": lanes,
        "HIST_WIDTH": hist_width,
        "COUNTS_WIDTH": counts_width,
        "LIMIT": min(bounds) if bounds else 0,
        "BLOCK_R": block_r,
        "BLOCK_W": block_w,
    }
    return [ctx.launch(_init_sampling_state_kernel, args, constants, grid, num_warps=num_warps)]


_RECORD_OUTPUTS = ("out_generation", "out_emitted", "out_consumed", "out_draft_cursor", "out_reserved")


def _record_views(
    ctx: LoweringContext, node: mf.Node, per_lane: Sequence[str]
) -> tuple[int, int, dict[str, mf.BufferView]]:
    """Lanes, sequence length and the views of a completion-record node (per-lane sizes checked)."""
    views = {name: ctx.need(node, name) for name in ("generation", *per_lane, "submission_sequence")}
    views.update({name: ctx.need(node, name) for name in (*_RECORD_OUTPUTS, "out_sequence")})
    for name, view in views.items():
        _require_dtype(ctx, name, view, INT_DTYPES)
    lanes = _numel(ctx.shape(views["generation"]))
    for name in (*per_lane, *_RECORD_OUTPUTS):
        _require_numel(ctx, name, views[name], lanes)
    sequence = _numel(ctx.shape(views["submission_sequence"]))
    _require_numel(ctx, "out_sequence", views["out_sequence"], sequence)
    _check_index_count(ctx, lanes)
    return lanes, sequence, views


@lowering("completion_lanes")
def lower_completion_lanes(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Programs of up to 1024 lanes; the first also copies the submission sequence."""
    lanes, sequence, views = _record_views(ctx, node, ("sample_active", "last_index"))
    positions = ctx.need(node, "positions")
    _require_dtype(ctx, "positions", positions, INT_DTYPES)
    block, num_warps, grid = _lane_block(lanes)
    order = (
        ("generation_ptr", "generation"),
        ("active_ptr", "sample_active"),
        ("last_index_ptr", "last_index"),
        ("positions_ptr", "positions"),
        ("sequence_ptr", "submission_sequence"),
        *((f"{name}_ptr", name) for name in (*_RECORD_OUTPUTS, "out_sequence")),
    )
    views["positions"] = positions
    args = {param: ctx.pointer(views[name]) for param, name in order}
    constants = {
        "LANES": lanes,
        "TOKENS": _numel(ctx.shape(positions)),
        "SEQUENCE": sequence,
        "BLOCK": block,
        "SEQUENCE_BLOCK": next_power_of_two(max(sequence, 1)),
    }
    return [ctx.launch(_completion_lanes_kernel, args, constants, grid, num_warps=num_warps)]


@lowering("completion_copy_lanes")
def lower_completion_copy_lanes(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Programs of up to 1024 lanes; the first also copies the submission sequence."""
    lanes, sequence, views = _record_views(ctx, node, ("consumed",))
    block, num_warps, grid = _lane_block(lanes)
    order = (
        ("generation_ptr", "generation"),
        ("consumed_ptr", "consumed"),
        ("sequence_ptr", "submission_sequence"),
        *((f"{name}_ptr", name) for name in (*_RECORD_OUTPUTS, "out_sequence")),
    )
    args = {param: ctx.pointer(views[name]) for param, name in order}
    constants = {
        "LANES": lanes,
        "SEQUENCE": sequence,
        "BLOCK": block,
        "SEQUENCE_BLOCK": next_power_of_two(max(sequence, 1)),
    }
    return [ctx.launch(_completion_copy_lanes_kernel, args, constants, grid, num_warps=num_warps)]


@lowering("tail_page")
def lower_tail_page(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Programs of up to 1024 rows."""
    table, consumed, out = ctx.need(node, "page_table"), ctx.need(node, "consumed"), ctx.need(node, "out")
    for name, view in (("page_table", table), ("consumed", consumed), ("out", out)):
        _require_dtype(ctx, name, view, INT_DTYPES)
    page_tokens = ctx.attribute(node, "page_tokens")
    if not isinstance(page_tokens, int) or page_tokens <= 0:
        raise ctx.fail(f"attribute 'page_tokens' must be a positive integer, got {page_tokens!r}")
    shape = ctx.shape(table)
    if len(shape) != 2:
        raise ctx.fail(f"page_table must be [rows, pages], got shape {list(shape)}")
    rows, pages = int(shape[0]), int(shape[1])
    _require_numel(ctx, "consumed", consumed, rows)
    _require_numel(ctx, "out", out, rows)
    _check_index_count(ctx, rows)
    block, num_warps, grid = _lane_block(rows)
    args = {"page_table_ptr": ctx.pointer(table), "consumed_ptr": ctx.pointer(consumed), "out_ptr": ctx.pointer(out)}
    constants = {"ROWS": rows, "PAGES": pages, "PAGE_TOKENS": page_tokens, "BLOCK": block}
    return [ctx.launch(_tail_page_kernel, args, constants, grid, num_warps=num_warps)]


@lowering("rope")
def lower_rope(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One token per program row, up to 4096 elements of its heads per program."""
    x, positions, out = ctx.need(node, "x"), ctx.need(node, "positions"), ctx.need(node, "out")
    _require_dtype(ctx, "x", x, FLOAT_DTYPES)
    _require_dtype(ctx, "out", out, FLOAT_DTYPES)
    _require_dtype(ctx, "positions", positions, INT_DTYPES)
    shape = ctx.shape(x)
    if len(shape) != 3:
        raise ctx.fail(f"x must be [T, heads, hd], got shape {list(shape)}")
    tokens, heads, head_dim = (int(s) for s in shape)
    if head_dim <= 0 or head_dim % 2:
        raise ctx.fail(f"head dim {head_dim} must be a positive even number")
    _require_numel(ctx, "positions", positions, tokens)
    _require_numel(ctx, "out", out, tokens * heads * head_dim)
    _check_index_count(ctx, tokens)
    style = ctx.attribute(node, "style")
    if style not in ("interleaved", "half"):
        raise ctx.fail(f"attribute 'style' must be 'interleaved' or 'half', got {style!r}")
    frequencies, scaled = frequency_args(ctx, node)
    half_block = next_power_of_two(head_dim // 2)
    block_h = max(1, min(next_power_of_two(heads), _ROPE_TILE // (2 * half_block)))
    grid = [max(1, tokens), max(1, cdiv(heads, block_h))]
    if grid[1] > _MAX_GRID_YZ:
        raise ctx.fail(f"{heads} heads need {grid[1]} head blocks (at most {_MAX_GRID_YZ})")
    num_warps = max(1, min(8, block_h * 2 * half_block // 512))
    args = {
        "x_ptr": ctx.pointer(x),
        "positions_ptr": ctx.pointer(positions),
        "out_ptr": ctx.pointer(out),
        **frequencies,
    }
    constants = {
        "HEADS": heads,
        "HEAD_DIM": head_dim,
        "HALF_BLOCK": half_block,
        "BLOCK_H": block_h,
        "INTERLEAVED": style == "interleaved",
        "HAS_SCALING": scaled,
    }
    return [ctx.launch(_rope_kernel, args, constants, grid, num_warps=num_warps)]


@lowering("kv_cache_write")
def lower_kv_cache_write(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Tiles of tokens by ``kvh * hd`` columns, keys and values in the same program."""
    k, v, slots = ctx.need(node, "k"), ctx.need(node, "v"), ctx.need(node, "slots")
    k_plane, v_plane = ctx.need(node, "k_plane"), ctx.need(node, "v_plane")
    for name, view in (("k", k), ("v", v), ("k_plane", k_plane), ("v_plane", v_plane)):
        _require_dtype(ctx, name, view, FLOAT_DTYPES)
    _require_dtype(ctx, "slots", slots, INT_DTYPES)
    plane_shape = ctx.shape(k_plane)
    if len(plane_shape) != 4 or ctx.shape(v_plane) != plane_shape:
        raise ctx.fail(
            f"k_plane {list(plane_shape)} and v_plane {list(ctx.shape(v_plane))} must be equal "
            "[pages, page_tokens, kvh, hd]"
        )
    k_shape = ctx.shape(k)
    if len(k_shape) != 3 or tuple(k_shape[1:]) != tuple(plane_shape[2:]) or ctx.shape(v) != k_shape:
        raise ctx.fail(f"k {list(k_shape)} and v {list(ctx.shape(v))} must be [T, {plane_shape[2]}, {plane_shape[3]}]")
    tokens = int(k_shape[0])
    _require_numel(ctx, "slots", slots, tokens)
    _check_index_count(ctx, tokens)
    width = int(plane_shape[2]) * int(plane_shape[3])
    bounds = [b for b in (_leading_bound(ctx, k_plane), _leading_bound(ctx, v_plane)) if b > 0]
    limit = min(bounds) * int(plane_shape[1]) if len(bounds) == 2 else 0
    itemsize = max(_ITEMSIZE[ctx.dtype(k)], _ITEMSIZE[ctx.dtype(k_plane)])
    block_r, block_w, num_warps, grid = _row_tile(ctx, tokens, width, itemsize)
    args = {
        "k_ptr": ctx.pointer(k),
        "v_ptr": ctx.pointer(v),
        "slots_ptr": ctx.pointer(slots),
        "k_plane_ptr": ctx.pointer(k_plane),
        "v_plane_ptr": ctx.pointer(v_plane),
    }
    constants = {"TOKENS": tokens, "WIDTH": width, "LIMIT": limit, "BLOCK_R": block_r, "BLOCK_W": block_w}
    return [ctx.launch(_kv_cache_write_kernel, args, constants, grid, num_warps=num_warps)]


KERNELS: dict[str, Any] = {
    "embedding": _gather_rows_kernel,
    "gather_rows": _gather_rows_kernel,
    "copy_rows": _copy_rows_kernel,
    "rmsnorm": _rmsnorm_kernel,
    "silu_mul": _silu_mul_kernel,
    "add": _add_kernel,
    "lane_last_index": _lane_last_index_kernel,
    "init_sampling_state": _init_sampling_state_kernel,
    "completion_lanes": _completion_lanes_kernel,
    "completion_copy_lanes": _completion_copy_lanes_kernel,
    "tail_page": _tail_page_kernel,
    "rope": _rope_kernel,
    "kv_cache_write": _kv_cache_write_kernel,
}
"""The kernel each operator's lowering launches, by operator name."""
