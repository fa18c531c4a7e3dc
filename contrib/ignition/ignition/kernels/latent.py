"""Paged-latent kernels: the latent cache write and attention over latent records.

Owns the Triton kernels, and the registered lowering functions, of ``latent_cache_write`` and
``latent_attention`` (paged-latent histories, ``HISTORY_KIND_PAGED_LATENT``). A plane is
``[pages, page_tokens / R, d_c]`` float32 (``R = tokens_per_record``); cache slots are token slots
``page * page_tokens + offset`` and token slot ``s`` belongs to record ``s // R`` of the flattened plane.

``latent_cache_write`` with R = 1 has one program per token, copying its latent to record ``slot``
(a negative slot writes nothing). With R > 1 a record is the float32 mean of its R tokens' latents,
accumulated in packed order (the token at ``slot % R == 0`` sets ``latent * (1 / R)``, each later token
adds its ``latent * (1 / R)``), so the kernel keeps the reference's order exactly: one program per
block of latent channels walks the packed tokens in order.

``latent_attention`` has one program per (token, query head). A token at position ``p`` of row ``r``
sees the records ``0 .. (p + 1) // R - 1``; record ``i`` lives at page
``page_table[r, page_offset + i // (page_tokens / R)]``, record ``i % (page_tokens / R)`` of that page.
The up-projections are applied to the query and to the result instead of to every record (the same
products, reassociated): ``q' = W_uk[h]^T q`` (``[d_c]``), the score of record ``c`` is ``q' . c * scale``,
and the output is ``W_uv[h] (sum_i p_i c_i)`` with the softmax weights ``p`` computed online in float32.
Every product and sum is float32 (weights in bf16 are widened exactly), so the result agrees with the
reference's (which up-projects every record first) to float32 rounding. A padding token (negative row)
and a token that sees no record get zeros. Page ids and slots are runtime extents and are trusted
(``lowering.py``). Each kernel calls ``gdc_wait()`` before its first access to a buffer other than
weights (``USE_PDL``), then ``gdc_launch_dependents()``.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import LoweringContext, cdiv, lowering, next_power_of_two

INDEX_DTYPES = frozenset({mf.DTYPE_I32, mf.DTYPE_I64})
"""Integer dtypes accepted for slots, rows, positions and page tables."""

BLOCK_RECORDS = 32
"""Latent records one attention program scores at a time."""


@triton.jit  # type: ignore[misc, untyped-decorator]
def latent_write_kernel(  # type: ignore[no-untyped-def]
    latent_ptr,
    slot_ptr,
    plane_ptr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """R = 1: token ``program_id(0)``'s latent into record ``slot``."""
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_W)
    ok = cols < WIDTH
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        values = tl.load(latent_ptr + token * WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(plane_ptr + slot * WIDTH + cols, values, mask=ok)


@triton.jit  # type: ignore[misc, untyped-decorator]
def latent_mean_write_kernel(  # type: ignore[no-untyped-def]
    latent_ptr,
    slot_ptr,
    plane_ptr,
    TOKENS: tl.constexpr,
    WIDTH: tl.constexpr,
    R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """R > 1: the packed tokens in order, each adding ``latent * (1 / R)`` to its record (the first
    token of a record sets it)."""
    cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = cols < WIDTH
    share = 1.0 / R
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for token in range(TOKENS):
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            part = tl.load(latent_ptr + token * WIDTH + cols, mask=ok, other=0.0).to(tl.float32) * share
            record = plane_ptr + (slot // R) * WIDTH + cols
            if slot % R != 0:
                part = tl.load(record, mask=ok, other=0.0) + part
            tl.store(record, part, mask=ok)


@triton.jit  # type: ignore[misc, untyped-decorator]
def latent_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    plane_ptr,
    w_uk_ptr,
    w_uv_ptr,
    table_ptr,
    row_ptr,
    position_ptr,
    out_ptr,
    scale,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_P: tl.constexpr,
    RECORDS: tl.constexpr,
    R: tl.constexpr,
    TABLE_WIDTH: tl.constexpr,
    PAGE_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    cols = tl.arange(0, WIDTH_P)
    col_ok = cols < WIDTH
    both = dim_ok[:, None] & col_ok[None, :]
    # This head's [HEAD_DIM, WIDTH] blocks of the up-projections (weights: read before the wait).
    w_index = (head * HEAD_DIM + dims)[:, None] * WIDTH + cols[None, :]
    up_k = tl.load(w_uk_ptr + w_index, mask=both, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.load(row_ptr + token)
    position = tl.load(position_ptr + token)
    count = (position + 1) // R
    if row < 0:
        count = 0
    q = tl.load(q_ptr + (token * HEADS + head) * HEAD_DIM + dims, mask=dim_ok, other=0.0).to(tl.float32)
    q_latent = tl.sum(up_k * q[:, None], axis=0) * scale  # [WIDTH_P]: W_uk[h]^T q, scaled
    running_max = tl.max(tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), axis=0)
    running_sum = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
    acc = tl.zeros([WIDTH_P], dtype=tl.float32)
    table_row = table_ptr + tl.where(row >= 0, row, 0).to(tl.int64) * TABLE_WIDTH + PAGE_OFFSET
    for start in range(0, count, BLOCK_N):
        records = start + tl.arange(0, BLOCK_N)
        ok = records < count
        page = tl.load(table_row + records // RECORDS, mask=ok, other=0).to(tl.int64)
        flat = page * RECORDS + records % RECORDS
        latents = tl.load(
            plane_ptr + flat[:, None] * WIDTH + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
        )  # [BLOCK_N, WIDTH_P]
        scores = tl.sum(latents * q_latent[None, :], axis=1)
        scores = tl.where(ok, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        acc = acc * correction + tl.sum(latents * weights[:, None], axis=0)
        running_max = new_max
    mixed = acc / tl.where(running_sum > 0.0, running_sum, 1.0)  # [WIDTH_P]: sum_i p_i c_i
    up_v = tl.load(w_uv_ptr + w_index, mask=both, other=0.0).to(tl.float32)
    result = tl.sum(up_v * mixed[None, :], axis=1)  # [HEAD_DIM_P]
    result = tl.where(count > 0, result, 0.0)
    tl.store(out_ptr + (token * HEADS + head) * HEAD_DIM + dims, result, mask=dim_ok)


def _count(shape: tuple[int, ...]) -> int:
    return math.prod(int(s) for s in shape)


def _plane_geometry(ctx: LoweringContext, plane: mf.BufferView, tokens_per_record: int) -> tuple[int, int]:
    """(records per page, latent width) of a paged-latent plane; checks its shape and dtype."""
    shape = ctx.buffer_shape(plane)
    if len(shape) != 3:
        raise ctx.fail(f"plane must be [pages, page_tokens / R, d_c], got {list(shape)}")
    if ctx.dtype(plane) != mf.DTYPE_F32:
        raise ctx.fail("plane must be float32")
    if tokens_per_record < 1:
        raise ctx.fail(f"tokens_per_record must be at least 1, got {tokens_per_record}")
    return int(shape[1]), int(shape[2])


def _require_index(ctx: LoweringContext, view: mf.BufferView, name: str, count: int) -> None:
    if ctx.dtype(view) not in INDEX_DTYPES:
        raise ctx.fail(f"{name} must be int32 or int64")
    if _count(ctx.shape(view)) != count:
        raise ctx.fail(f"{name} holds {_count(ctx.shape(view))} entries for {count} tokens")


@lowering("latent_cache_write")
def lower_latent_cache_write(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    latent, slots, plane = ctx.need(node, "latent"), ctx.need(node, "slots"), ctx.need(node, "plane")
    tokens_per_record = int(ctx.attribute(node, "tokens_per_record", 1))
    _, width = _plane_geometry(ctx, plane, tokens_per_record)
    shape = ctx.shape(latent)
    if len(shape) != 2 or shape[1] != width:
        raise ctx.fail(f"latent must be [tokens, {width}], got {list(shape)}")
    if ctx.dtype(latent) not in (mf.DTYPE_F32, mf.DTYPE_BF16, mf.DTYPE_F16):
        raise ctx.fail("latent must be a float buffer")
    tokens = int(shape[0])
    _require_index(ctx, slots, "slots", tokens)
    args = {"latent_ptr": ctx.pointer(latent), "slot_ptr": ctx.pointer(slots), "plane_ptr": ctx.pointer(plane)}
    block_w = max(32, next_power_of_two(width))
    if tokens_per_record == 1:
        launch = ctx.launch(
            latent_write_kernel, args, {"WIDTH": width, "BLOCK_W": block_w}, (tokens,), num_warps=1, num_stages=1
        )
    else:
        block_w = min(block_w, 256)
        launch = ctx.launch(
            latent_mean_write_kernel,
            args,
            {"TOKENS": tokens, "WIDTH": width, "R": tokens_per_record, "BLOCK_W": block_w},
            (cdiv(width, block_w),),
            num_warps=1,
            num_stages=1,
        )
    return [launch]


@lowering("latent_attention")
def lower_latent_attention(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    q, plane, out = ctx.need(node, "q"), ctx.need(node, "plane"), ctx.need(node, "out")
    w_uk, w_uv = ctx.need(node, "w_uk"), ctx.need(node, "w_uv")
    table, rows, positions = ctx.need(node, "page_table"), ctx.need(node, "token_row"), ctx.need(node, "token_position")
    tokens_per_record = int(ctx.attribute(node, "tokens_per_record", 1))
    page_offset = int(ctx.attribute(node, "page_offset", 0))
    if page_offset < 0:
        raise ctx.fail(f"page_offset must be 0 or positive, got {page_offset}")
    records, width = _plane_geometry(ctx, plane, tokens_per_record)
    q_shape = ctx.shape(q)
    if len(q_shape) != 3:
        raise ctx.fail(f"q must be [tokens, heads, head_dim], got {list(q_shape)}")
    tokens, heads, head_dim = (int(s) for s in q_shape)
    if ctx.shape(out) != q_shape:
        raise ctx.fail(f"out {list(ctx.shape(out))} must match q {list(q_shape)}")
    for view, name in ((w_uk, "w_uk"), (w_uv, "w_uv")):
        if ctx.shape(view) != (heads * head_dim, width):
            raise ctx.fail(f"{name} must be [{heads * head_dim}, {width}], got {list(ctx.shape(view))}")
        if ctx.dtype(view) not in (mf.DTYPE_F32, mf.DTYPE_BF16):
            raise ctx.fail(f"{name} must be float32 or bfloat16")
    for view, name in ((q, "q"), (out, "out")):
        if ctx.dtype(view) != mf.DTYPE_F32:
            raise ctx.fail(f"{name} must be float32")
    table_shape = ctx.shape(table)
    if len(table_shape) != 2 or ctx.dtype(table) not in INDEX_DTYPES:
        raise ctx.fail(f"page_table must be an integer [rows, columns] view, got {list(table_shape)}")
    if page_offset >= table_shape[1]:
        raise ctx.fail(f"page_offset {page_offset} leaves none of the page table's {table_shape[1]} columns")
    _require_index(ctx, rows, "token_row", tokens)
    _require_index(ctx, positions, "token_position", tokens)
    scale = float(ctx.attribute(node, "scale", 1.0 / math.sqrt(head_dim)))
    width_p = next_power_of_two(width)
    launch = ctx.launch(
        latent_attention_kernel,
        {
            "q_ptr": ctx.pointer(q),
            "plane_ptr": ctx.pointer(plane),
            "w_uk_ptr": ctx.pointer(w_uk),
            "w_uv_ptr": ctx.pointer(w_uv),
            "table_ptr": ctx.pointer(table),
            "row_ptr": ctx.pointer(rows),
            "position_ptr": ctx.pointer(positions),
            "out_ptr": ctx.pointer(out),
            "scale": ctx.f32(scale),
        },
        {
            "HEADS": heads,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_P": next_power_of_two(head_dim),
            "WIDTH": width,
            "WIDTH_P": width_p,
            "RECORDS": records,
            "R": tokens_per_record,
            "TABLE_WIDTH": int(table_shape[1]),
            "PAGE_OFFSET": page_offset,
            "BLOCK_N": BLOCK_RECORDS,
        },
        (tokens, heads),
        num_warps=4 if width_p * BLOCK_RECORDS > 2048 else 2,
        num_stages=1,
    )
    return [launch]
