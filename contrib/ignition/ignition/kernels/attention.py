"""Attention kernels: paged attention and the fused rotary-embedding + cache write.

Owns the lowering of ``paged_attention`` and ``rope_kv_cache_write``.

``paged_attention`` runs in one launch (split-position attention): every (token, KV head, position
split) gets one program that attends the group of query heads sharing that KV head to its split's
positions ``[s * SPLIT, (s + 1) * SPLIT)`` up to the token's own position, reading keys and values
through the page table, and writes the split's running maximum, sum and unnormalised output to
workspaces; the last program of a (token, KV head) to finish (an atomic count of finished splits,
which it resets) merges the splits of that group's query heads. A decode step therefore spreads a
long context over many programs instead of walking it in one, without a second launch.
Softmax is computed online in float32 (the reference subtracts the exact maximum first; the two
agree to float32 rounding). Tokens whose row is negative (padding) get zero output.

``rope_kv_cache_write`` gives each packed token one program: it splits the token's packed
``[q | k | v]`` projection, rotates the query and key heads (both pair layouts; inverse frequencies
with optional frequency-band scaling, angles, cos and sin in float64 as the reference, the rotation
in float32), writes the
rotated queries and the key and value heads into the cache planes at the token's slot (a negative
slot writes no cache, the queries are still written).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import LoweringContext, cdiv, lowering, next_power_of_two
from ignition.kernels.rotary import frequency_args, inverse_frequencies

SPLIT_POSITIONS = 64
"""Positions one attention program covers."""


@triton.jit  # type: ignore[misc, untyped-decorator]
def attention_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    row_ptr,
    position_ptr,
    max_ws,
    sum_ws,
    acc_ws,
    count_ws,
    out_ptr,
    scale,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    D: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    TABLE_WIDTH: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.load(row_ptr + token)
    position = tl.load(position_ptr + token)
    heads = tl.arange(0, GROUP_P2)
    head_ok = heads < GROUP
    dims = tl.arange(0, D)
    q_heads = kv * GROUP + heads
    q = tl.load(
        q_ptr + (token * HEADS + q_heads)[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0
    )  # [GROUP_P2, D]
    q = q * scale
    running_max = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, D], dtype=tl.float32)
    start = split * SPLIT
    stop = tl.minimum(start + SPLIT, position + 1)
    if (row >= 0) & (start <= position):
        for base in range(0, SPLIT, BLOCK_N):
            offs = start + base + tl.arange(0, BLOCK_N)
            ok = offs < stop
            page = tl.load(table_ptr + row * TABLE_WIDTH + offs // PAGE_TOKENS, mask=ok, other=0)
            slot = page.to(tl.int64) * PAGE_TOKENS + (offs % PAGE_TOKENS)
            address = (slot * KV_HEADS + kv)[:, None] * D + dims[None, :]
            keys = tl.load(k_ptr + address, mask=ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, D]
            values = tl.load(v_ptr + address, mask=ok[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [GROUP_P2, BLOCK_N]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            block_max = tl.max(scores, axis=1)
            new_max = tl.maximum(running_max, block_max)
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp(running_max - safe_max)
            weights = tl.exp(scores - safe_max[:, None])
            running_sum = running_sum * correction + tl.sum(weights, axis=1)
            acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
            running_max = new_max
    out_index = (token * HEADS + q_heads) * SPLITS + split
    tl.store(max_ws + out_index, running_max, mask=head_ok)
    tl.store(sum_ws + out_index, running_sum, mask=head_ok)
    tl.store(acc_ws + out_index[:, None] * D + dims[None, :], acc, mask=head_ok[:, None])
    # The last split of this (token, KV head) to finish merges all of them: every program's partials
    # are stored before its counter increment (barrier, then a release), the merger reads them after
    # its acquire, past L1, and resets the counter for the next launch.
    tl.debug_barrier()
    counter = count_ws + token * KV_HEADS + kv
    finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if finished == SPLITS - 1:
        splits = tl.arange(0, SPLITS_P2)
        split_ok = splits < SPLITS
        both = head_ok[:, None] & split_ok[None, :]
        index = (token * HEADS + q_heads)[:, None] * SPLITS + splits[None, :]  # [GROUP_P2, SPLITS_P2]
        maxima = tl.load(max_ws + index, mask=both, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(sum_ws + index, mask=both, other=0.0, cache_modifier=".cg")
        peak = tl.max(maxima, axis=1)
        safe_peak = tl.where(peak == float("-inf"), 0.0, peak)
        factors = tl.where(both & (maxima > float("-inf")), tl.exp(maxima - safe_peak[:, None]), 0.0)
        total = tl.sum(sums * factors, axis=1)  # [GROUP_P2]
        partial = tl.load(
            acc_ws + index[:, :, None] * D + dims[None, None, :],
            mask=both[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [GROUP_P2, SPLITS_P2, D]
        merged = tl.sum(partial * factors[:, :, None], axis=1)
        result = tl.where(total[:, None] > 0.0, merged / tl.where(total > 0.0, total, 1.0)[:, None], 0.0)
        result = tl.where(row >= 0, result, 0.0)
        tl.store(out_ptr + (token * HEADS + q_heads)[:, None] * D + dims[None, :], result, mask=head_ok[:, None])
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@lowering("paged_attention")
def lower_paged_attention(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    q, out = ctx.need(node, "q"), ctx.need(node, "out")
    k_plane, v_plane = ctx.need(node, "k_plane"), ctx.need(node, "v_plane")
    table, rows, positions = ctx.need(node, "page_table"), ctx.need(node, "token_row"), ctx.need(node, "token_position")
    tokens, heads, head_dim = _three(ctx, q, "q")
    plane = ctx.buffer_shape(k_plane)
    if len(plane) != 4 or ctx.buffer_shape(v_plane) != plane:
        raise ctx.fail(f"cache planes must be equal [pages, page_tokens, kv_heads, head_dim], got {list(plane)}")
    _, page_tokens, kv_heads, plane_dim = plane
    if plane_dim != head_dim or heads % kv_heads:
        raise ctx.fail(f"{heads} query heads of {head_dim} do not fit {kv_heads} KV heads of {plane_dim}")
    if head_dim != next_power_of_two(head_dim):
        raise ctx.fail(f"head_dim {head_dim} must be a power of two")
    table_shape = ctx.shape(table)
    if len(table_shape) != 2:
        raise ctx.fail("page_table must be [rows, pages]")
    width = table_shape[1]
    for view, name in ((q, "q"), (out, "out"), (k_plane, "k_plane"), (v_plane, "v_plane")):
        if ctx.dtype(view) != mf.DTYPE_F32:
            raise ctx.fail(f"{name} must be float32")
    for view, name in ((table, "page_table"), (rows, "token_row"), (positions, "token_position")):
        if ctx.dtype(view) != mf.DTYPE_I32:
            raise ctx.fail(f"{name} must be int32")
    group = heads // kv_heads
    span = width * page_tokens
    split = min(SPLIT_POSITIONS, next_power_of_two(span))
    splits = cdiv(span, split)
    block_n = min(split, 64 if head_dim <= 64 else 32)
    max_ws = ctx.workspace("attention_max", mf.DTYPE_F32, tokens * heads * splits)
    sum_ws = ctx.workspace("attention_sum", mf.DTYPE_F32, tokens * heads * splits)
    acc_ws = ctx.workspace("attention_acc", mf.DTYPE_F32, tokens * heads * splits * head_dim)
    # zero at allocation; every launch leaves each counter at zero again
    count_ws = ctx.workspace("attention_splits_done", mf.DTYPE_I32, tokens * kv_heads)
    scale = float(ctx.attribute(node, "scale", 1.0 / math.sqrt(head_dim)))
    launch = ctx.launch(
        attention_split_kernel,
        {
            "q_ptr": ctx.pointer(q),
            "k_ptr": ctx.pointer(k_plane),
            "v_ptr": ctx.pointer(v_plane),
            "table_ptr": ctx.pointer(table),
            "row_ptr": ctx.pointer(rows),
            "position_ptr": ctx.pointer(positions),
            "max_ws": ctx.pointer(max_ws),
            "sum_ws": ctx.pointer(sum_ws),
            "acc_ws": ctx.pointer(acc_ws),
            "count_ws": ctx.pointer(count_ws),
            "out_ptr": ctx.pointer(out),
            "scale": ctx.f32(scale),
        },
        {
            "HEADS": heads,
            "KV_HEADS": kv_heads,
            "GROUP": group,
            "GROUP_P2": next_power_of_two(group),
            "D": head_dim,
            "PAGE_TOKENS": page_tokens,
            "TABLE_WIDTH": width,
            "SPLITS": splits,
            "SPLITS_P2": next_power_of_two(splits),
            "SPLIT": split,
            "BLOCK_N": block_n,
        },
        (tokens, kv_heads, splits),
        num_warps=4,
        num_stages=2,
    )
    return [launch]


def _three(ctx: LoweringContext, view: mf.BufferView, name: str) -> tuple[int, int, int]:
    shape = ctx.shape(view)
    if len(shape) != 3:
        raise ctx.fail(f"{name} must be [tokens, heads, head_dim], got {list(shape)}")
    return shape[0], shape[1], shape[2]


@triton.jit  # type: ignore[misc, untyped-decorator]
def rope_cache_kernel(  # type: ignore[no-untyped-def]
    qkv_ptr,
    position_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    log2_theta_bits,
    factor_bits,
    low_bits,
    high_bits,
    original_bits,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    ROTATED_P2: tl.constexpr,
    D: tl.constexpr,
    HALF_PAIRS: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Inverse frequencies, angles, cos and sin in float64 (the ``*_bits`` are float64 bit patterns),
    # the rotation in float32, as the reference computes them.
    pairs = tl.arange(0, D // 2)
    inv_freq = inverse_frequencies(
        pairs, D, log2_theta_bits, factor_bits, low_bits, high_bits, original_bits, SCALED
    )
    token = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    angle = tl.load(position_ptr + token).to(tl.float64) * inv_freq
    cos = tl.cos(angle).to(tl.float32)
    sin = tl.sin(angle).to(tl.float32)
    slot = tl.load(slot_ptr + token)
    heads = tl.arange(0, ROTATED_P2)
    rotated = HEADS + KV_HEADS
    ok = heads < rotated
    width = (HEADS + 2 * KV_HEADS) * D
    base = qkv_ptr + token * width + heads[:, None] * D
    if HALF_PAIRS:
        first_index = pairs
        second_index = pairs + D // 2
    else:
        first_index = 2 * pairs
        second_index = 2 * pairs + 1
    first = tl.load(base + first_index[None, :], mask=ok[:, None], other=0.0)
    second = tl.load(base + second_index[None, :], mask=ok[:, None], other=0.0)
    out_first = first * cos[None, :] - second * sin[None, :]
    out_second = first * sin[None, :] + second * cos[None, :]
    is_q = heads < HEADS
    q_base = q_ptr + token * HEADS * D + heads[:, None] * D
    tl.store(q_base + first_index[None, :], out_first, mask=is_q[:, None])
    tl.store(q_base + second_index[None, :], out_second, mask=is_q[:, None])
    if slot >= 0:
        is_k = ok & (heads >= HEADS)
        k_base = k_ptr + (slot * KV_HEADS + (heads - HEADS))[:, None] * D
        tl.store(k_base + first_index[None, :], out_first, mask=is_k[:, None])
        tl.store(k_base + second_index[None, :], out_second, mask=is_k[:, None])
        kv_heads = tl.arange(0, ROTATED_P2)
        v_ok = kv_heads < KV_HEADS
        dims = tl.arange(0, D)
        values = tl.load(
            qkv_ptr + token * width + (HEADS + KV_HEADS + kv_heads)[:, None] * D + dims[None, :],
            mask=v_ok[:, None],
            other=0.0,
        )
        tl.store(v_ptr + (slot * KV_HEADS + kv_heads)[:, None] * D + dims[None, :], values, mask=v_ok[:, None])


@lowering("rope_kv_cache_write")
def lower_rope_kv_cache_write(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    qkv, positions, slots = ctx.need(node, "qkv"), ctx.need(node, "positions"), ctx.need(node, "slots")
    q, k_plane, v_plane = ctx.need(node, "q"), ctx.need(node, "k_plane"), ctx.need(node, "v_plane")
    tokens, heads, head_dim = _three(ctx, q, "q")
    plane = ctx.buffer_shape(k_plane)
    if len(plane) != 4 or ctx.buffer_shape(v_plane) != plane or plane[3] != head_dim:
        raise ctx.fail(f"cache planes {list(plane)} do not hold heads of {head_dim}")
    kv_heads = plane[2]
    qkv_shape = ctx.shape(qkv)
    if qkv_shape[0] != tokens or math.prod(qkv_shape[1:]) != (heads + 2 * kv_heads) * head_dim:
        raise ctx.fail(f"qkv {list(qkv_shape)} must be [{tokens}, {(heads + 2 * kv_heads) * head_dim}]")
    if head_dim != next_power_of_two(head_dim) or head_dim < 2:
        raise ctx.fail(f"head_dim {head_dim} must be a power of two")
    for view, name in ((qkv, "qkv"), (q, "q"), (k_plane, "k_plane"), (v_plane, "v_plane")):
        if ctx.dtype(view) != mf.DTYPE_F32:
            raise ctx.fail(f"{name} must be float32")
    if ctx.dtype(positions) != mf.DTYPE_I32 or ctx.dtype(slots) != mf.DTYPE_I64:
        raise ctx.fail("positions must be int32 and slots int64")
    style = ctx.attribute(node, "style", "")
    if style not in ("half", "interleaved"):
        raise ctx.fail(f"rope style must be 'half' or 'interleaved', got {style!r}")
    frequencies, scaled = frequency_args(ctx, node)
    launch = ctx.launch(
        rope_cache_kernel,
        {
            "qkv_ptr": ctx.pointer(qkv),
            "position_ptr": ctx.pointer(positions),
            "slot_ptr": ctx.pointer(slots),
            "q_ptr": ctx.pointer(q),
            "k_ptr": ctx.pointer(k_plane),
            "v_ptr": ctx.pointer(v_plane),
            **frequencies,
        },
        {
            "HEADS": heads,
            "KV_HEADS": kv_heads,
            "ROTATED_P2": next_power_of_two(heads + kv_heads),
            "D": head_dim,
            "HALF_PAIRS": style == "half",
            "SCALED": scaled,
        },
        (tokens,),
        num_warps=4,
        num_stages=1,
    )
    return [launch]
