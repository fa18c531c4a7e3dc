"""Projection kernels: ``linear`` and its fused forms, one Triton matrix kernel for all four.

Owns the lowering of ``linear``, ``rmsnorm_linear``, ``linear_add``, ``silu_mul_linear_add`` and
``rmsnorm_swiglu_mlp_add``. One kernel computes ``out[m, n] = residual[m, n] + sum_k prologue(x)[m, k]
* weight[n, k]``: the prologue optionally normalises each row (RMS norm with its gain) or applies SwiGLU
to a packed ``[gate | up]`` row, and the residual is optional. Over a ``[gate | up]`` weight it can
instead end in SwiGLU: each program multiplies its inputs with the gate block and the up block of the
same columns and stores ``silu(gate) * up``, so a SwiGLU MLP is two launches (and the norm's) with its
activation, in the weights' 16-bit type, the only value between them. Activations are float32 in memory
and rounded to the weight's type for the tensor cores (bf16 products, float32 accumulation), as every
bf16 serving engine does; matrix tiles read them staged in that type (the norm or SwiGLU, or the plain
float32 rows, written once into a workspace by a launch before). Each program computes a ``BLOCK_M x
BLOCK_N`` tile over the whole reduction, or, where the output tiles alone would leave multiprocessors
idle (a few rows, or narrow outputs), over one of ``split`` equal parts of it: each part stores a
partial tile, and the last part of a tile to finish adds the partials in part order and stores the
result. Nothing is accumulated in an
order that depends on timing, so a launch repeats bit for bit; how many parts a projection has
depends on its row count, so a row's last bits may differ between launches of different row counts.

Tile shapes are chosen from the shape at build time (:func:`choose_tiles`): one or two rows
(decode at batch 1 and 2) run on the FMA units, in the streaming kernel (a fixed grid of a few
programs a multiprocessor, each over several tiles of whole weight rows, the next tile loaded while
the current one is reduced) where a row of inputs fits in registers, else one program per column
block; up to 16 rows get 16-row tiles; up to 64 rows 64-row tiles; more rows (prefill, large decode
batches) 128-row tiles, which run on Hopper's warpgroup matrix instructions, except the narrow outputs
of up to 256 rows (fewer 128x128 tiles than multiprocessors), which take 64x128 tiles on four warps
(128x128 ones over a reduction of 12288 inputs or more, or over 16-bit rows no launch staged where two parts
of the reduction fill a wave), and the vocabulary-wide outputs of 129 to 256
rows (the LM head of a large decode batch), which take 256x128 tiles through tensor descriptors so that
each weight tile is read once; each with the reduction split so that about
one program a multiprocessor streams the weights (for the narrow tiles: no more programs than one wave;
for 64-row tiles: up to two programs a multiprocessor where each part keeps four reduction steps).

Wide outputs (at least one 128x128 tile a multiprocessor) and prefill chunks whose 128x128 tiles reach
two thirds of the multiprocessors read their inputs and weights through tensor descriptors: the copy
engine (TMA) moves each tile into shared memory, zero past the matrix edges, instead of every thread
computing and issuing its own loads. Triton keeps a program's descriptors in global scratch, which the
lowering passes (see :mod:`ignition.kernels.lowering`). Float32 weights (float32 inputs, staged in
float32) and rows whose bytes are not a multiple of 16 keep the per-thread loads and the tiles measured
with them. The widest projections of a prefill chunk over a
long reduction run persistent programs instead (:func:`persistent_projection_kernel`: one a
multiprocessor, each over every so many tiles, its loop over tiles and reduction steps one pipeline).
Plain projections of 129 to 512 rows whose 64x128 tiles make one wave over a reduction of 2048 to 12287
inputs take warp-specialised tiles (:mod:`ignition.kernels.specialised`: a copy warp feeding deep stages),
as do a prefill chunk's projections over 4096 or more inputs whose 128x128 tiles make two thirds of a wave
to two waves (128x128 or 128x256 tiles) and the LM head of 129 to 256 rows (256x128 tiles, persistent).

Every launch waits on the one before programmatically (its programs may start early and wait inside), except
a projection of more than 64 rows right after another launch of its own node (its staged inputs, or the
``[gate|up]`` projection before a down projection), which starts once that launch has finished
(:data:`ORDINARY_WAIT_ROWS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import ITEMSIZE, LoweringContext, cdiv, lowering, next_power_of_two
from ignition.kernels.specialised import specialised_projection_kernel


@triton.jit  # type: ignore[misc, untyped-decorator]
def projection_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    residual_ptr,
    partial_ptr,
    counter_ptr,
    rows,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    K_SPLIT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """One ``BLOCK_M x BLOCK_N`` tile of ``x @ weight.T (+ residual)`` over the reduction steps of
    split ``program_id(2)`` (the RMS norm or SwiGLU of the inputs, if any, is staged before).

    With ``SWIGLU`` the weight holds ``2N`` rows, the gate rows then the up rows, and the tile is
    ``silu(x @ gate.T) * (x @ up.T)`` over ``N`` outputs: each step multiplies the input tile with the
    gate block and the up block of the same columns into two accumulators (:func:`silu_times`).

    The row tile is ``program_id(0)``, the grid's fastest dimension: the row tiles of one column block
    are scheduled side by side, so the weight block they share comes from HBM once and from L2 after
    (with the column block first, a weight larger than L2 was read once per row tile: twice at 256 rows).

    With ``SPLIT`` > 1 each split stores its partial tile to ``partial_ptr``; the last split of a
    tile to finish (an atomic count in ``counter_ptr``) adds the partials in split order (so the
    result does not depend on which finished last), adds the residual, stores the tile and resets
    the count for the next launch.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < rows
    n_ok = offs_n < N
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the up half's sums (SWIGLU only)
    if DESCRIPTORS:
        # Tensor descriptors (written to this program's global scratch, after gdc_wait: see the lowering
        # module): the copy engine moves both tiles into shared memory, zero past the rows and K.
        x_tiles = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_rows = 2 * N if SWIGLU else N
        w_tiles = tl.make_tensor_descriptor(w_ptr, shape=[w_rows, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
        for k0 in range(0, K_SPLIT, BLOCK_K):
            xs = x_tiles.load([pid_m * BLOCK_M, pid_k * K_SPLIT + k0])
            w = w_tiles.load([pid_n * BLOCK_N, pid_k * K_SPLIT + k0])
            acc = tl.dot(xs.to(w.dtype), tl.trans(w), acc)
            if SWIGLU:
                # a gate block past N reads up rows: those columns are never stored
                w_up = w_tiles.load([N + pid_n * BLOCK_N, pid_k * K_SPLIT + k0])
                acc_up = tl.dot(xs.to(w_up.dtype), tl.trans(w_up), acc_up)
    else:
        for k0 in range(0, K_SPLIT, BLOCK_K):
            offs_k = pid_k * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x_mask = m_ok[:, None] & k_ok[None, :]
            w_mask = n_ok[:, None] & k_ok[None, :]
            xs = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=x_mask, other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
            acc = tl.dot(xs.to(w.dtype), tl.trans(w), acc)
            if SWIGLU:
                w_up = tl.load(w_ptr + (N + offs_n)[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
                acc_up = tl.dot(xs.to(w_up.dtype), tl.trans(w_up), acc_up)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_offsets = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        if SWIGLU:
            acc = silu_times(acc, acc_up)
        if RESIDUAL:
            acc += tl.load(residual_ptr + out_offsets, mask=out_mask, other=0.0)
        tl.store(out_ptr + out_offsets, acc, mask=out_mask)
    else:
        tile = pid_n * tl.num_programs(0) + pid_m
        area = BLOCK_M * BLOCK_N
        parts = 2 if SWIGLU else 1  # partial tiles a split stores: the gate's and the up's
        block = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(partial_ptr + (tile * SPLIT + pid_k) * (parts * area) + block, acc)
        if SWIGLU:
            tl.store(partial_ptr + (tile * SPLIT + pid_k) * (parts * area) + area + block, acc_up)
        # every thread's partial is stored before the count (barrier, then a release); the last split
        # reads the partials after its acquire, past L1
        tl.debug_barrier()
        counter = counter_ptr + tile
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == SPLIT - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(SPLIT):
                part = partial_ptr + (tile * SPLIT + split) * (parts * area)
                total += tl.load(part + block, cache_modifier=".cg")
                if SWIGLU:
                    total_up += tl.load(part + area + block, cache_modifier=".cg")
            if SWIGLU:
                total = silu_times(total, total_up)
            if RESIDUAL:
                total += tl.load(residual_ptr + out_offsets, mask=out_mask, other=0.0)
            tl.store(out_ptr + out_offsets, total, mask=out_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit  # type: ignore[misc, untyped-decorator]
def silu_times(gate, up):  # type: ignore[no-untyped-def]
    """``silu(gate) * up`` in float32, as ``silu_mul`` computes it."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit  # type: ignore[misc, untyped-decorator]
def persistent_projection_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    residual_ptr,
    rows,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROGRAMS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """``x @ weight.T (+ residual)`` in ``BLOCK_M x BLOCK_N`` tiles through tensor descriptors, ``PROGRAMS``
    programs each computing every ``PROGRAMS``-th tile over the whole reduction (with ``SWIGLU``, the
    gate and up blocks of each tile's columns, as in :func:`projection_kernel`).

    The tiles are numbered row tile fastest (the row tiles of one column block run side by side and
    share its weight block through L2, as in :func:`projection_kernel`). A program makes its two
    descriptors once, and its loop over (tile, reduction step) is flattened so the copies of a tile's
    first steps are issued while the tile before it is finished and stored: no program ends, starts
    or fills its pipeline again between tiles.
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles = tiles_m * tl.cdiv(N, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_tiles = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_rows = 2 * N if SWIGLU else N
    w_tiles = tl.make_tensor_descriptor(w_ptr, shape=[w_rows, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    for tile in tl.range(pid, tiles, PROGRAMS, flatten=True):
        pid_m = tile % tiles_m
        pid_n = tile // tiles_m
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = x_tiles.load([pid_m * BLOCK_M, k0])
            w = w_tiles.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(xs.to(w.dtype), tl.trans(w), acc)
            if SWIGLU:
                w_up = w_tiles.load([N + pid_n * BLOCK_N, k0])
                acc_up = tl.dot(xs.to(w_up.dtype), tl.trans(w_up), acc_up)
        if SWIGLU:
            acc = silu_times(acc, acc_up)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
        out_offsets = offs_m[:, None] * N + offs_n[None, :]
        if RESIDUAL:
            acc += tl.load(residual_ptr + out_offsets, mask=out_mask, other=0.0)
        tl.store(out_ptr + out_offsets, acc, mask=out_mask)


@triton.jit  # type: ignore[misc, untyped-decorator]
def vector_projection_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    residual_ptr,
    norm_ptr,
    eps,
    rows,
    N: tl.constexpr,
    K: tl.constexpr,
    ROWS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The same projection for one or two rows, on the FMA units: weights streamed once, wide loads.

    The first weight tile is loaded before ``gdc_wait`` (weights are never written by a program), so
    the weight stream starts while the previous kernel finishes; each step then loads the next
    weight tile and the next inputs (and gains) before it uses the current ones, so no step waits
    on a load it has just issued. With ``NORM`` the input is read once: the sums of squares
    accumulate beside the products with ``x * gain``, and each row's ``1 / rms`` scales its sums at
    the end.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS_P2)
    n_ok = offs_n < N
    r_ok = offs_r < rows
    x_stride = 2 * K if GATED else K
    up_rows = N if SWIGLU else 0  # with SWIGLU the up rows follow the N gate rows
    first_k = tl.arange(0, BLOCK_K)
    w_mask = n_ok[:, None] & (first_k[None, :] < K)
    w = tl.load(w_ptr + offs_n[:, None] * K + first_k[None, :], mask=w_mask, other=0.0)
    w_up = w
    if SWIGLU:
        w_up = tl.load(w_ptr + (up_rows + offs_n)[:, None] * K + first_k[None, :], mask=w_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    first, second, gain = _input_step(x_ptr, norm_ptr, offs_r, r_ok, first_k, K, x_stride, NORM, GATED)
    squares = tl.zeros([ROWS_P2], dtype=tl.float32)
    acc = tl.zeros([ROWS_P2, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([ROWS_P2, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        next_k = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
        next_mask = n_ok[:, None] & (next_k[None, :] < K)
        w_next = tl.load(w_ptr + offs_n[:, None] * K + next_k[None, :], mask=next_mask, other=0.0)
        w_up_next = w_next
        if SWIGLU:
            w_up_next = tl.load(w_ptr + (up_rows + offs_n)[:, None] * K + next_k[None, :], mask=next_mask, other=0.0)
        first_next, second_next, gain_next = _input_step(
            x_ptr, norm_ptr, offs_r, r_ok, next_k, K, x_stride, NORM, GATED
        )
        xs = first
        if GATED:
            xs = first / (1.0 + tl.exp(-first)) * second
        if NORM:  # the row's 1 / rms is one factor: applied to the sums after the loop
            squares += tl.sum(xs * xs, axis=1)
            xs = xs * gain[None, :]
        acc += w.to(tl.float32)[None, :, :] * xs[:, None, :]
        if SWIGLU:
            acc_up += w_up.to(tl.float32)[None, :, :] * xs[:, None, :]
        w, w_up, first, second, gain = w_next, w_up_next, first_next, second_next, gain_next
    result = tl.sum(acc, axis=2)
    result_up = tl.sum(acc_up, axis=2)
    if NORM:
        scale = (1.0 / tl.sqrt(squares / K + eps))[:, None]
        result = result * scale
        result_up = result_up * scale
    if SWIGLU:
        result = silu_times(result, result_up)
    out_mask = r_ok[:, None] & n_ok[None, :]
    out_offsets = offs_r[:, None] * N + offs_n[None, :]
    if RESIDUAL:
        result += tl.load(residual_ptr + out_offsets, mask=out_mask, other=0.0)
    tl.store(out_ptr + out_offsets, result, mask=out_mask)


@triton.jit  # type: ignore[misc, untyped-decorator]
def _input_step(  # type: ignore[no-untyped-def]
    x_ptr, norm_ptr, offs_r, r_ok, offs_k, K: tl.constexpr, x_stride, NORM: tl.constexpr, GATED: tl.constexpr
):
    """One step's inputs of the vector projection, loaded, not yet used: (x or the gate, the up
    half or x again, the gains or ones), zero past ``K``."""
    k_ok = offs_k < K
    x_mask = r_ok[:, None] & k_ok[None, :]
    x_offsets = offs_r[:, None] * x_stride + offs_k[None, :]
    first = tl.load(x_ptr + x_offsets, mask=x_mask, other=0.0)
    second = first
    if GATED:
        second = tl.load(x_ptr + x_offsets + K, mask=x_mask, other=0.0)
    gain = tl.full(offs_k.shape, 1.0, dtype=tl.float32)
    if NORM:
        gain = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0)
    return first, second, gain


@triton.jit  # type: ignore[misc, untyped-decorator]
def streaming_projection_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    residual_ptr,
    norm_ptr,
    eps,
    rows,
    N: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    ROWS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PROGRAMS: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The one- or two-row projection with a fixed number of programs, each streaming whole weight rows
    (with ``SWIGLU``, the gate rows and the up rows of its columns: ``silu(x @ gate.T) * (x @ up.T)``).

    Program ``p`` computes the column tiles ``p, p + P, p + 2P, ...`` (``P`` programs): it loads its
    first tile of ``BLOCK_N`` whole rows before ``gdc_wait``, prepares the input once (normalised or
    SwiGLU, kept in registers for every tile), then loads each next tile before it reduces the
    current one, so its weight stream never waits on arithmetic.
    """
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_P2)
    k_ok = ks < K
    offs_n = pid * BLOCK_N + lanes
    up_rows = N if SWIGLU else 0  # with SWIGLU the up rows follow the N gate rows
    w_mask = (offs_n < N)[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + offs_n[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
    w_up = w
    if SWIGLU:
        w_up = tl.load(w_ptr + (up_rows + offs_n)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_r = tl.arange(0, ROWS_P2)
    r_ok = offs_r < rows
    x_mask = r_ok[:, None] & k_ok[None, :]
    if GATED:
        gate = tl.load(x_ptr + offs_r[:, None] * (2 * K) + ks[None, :], mask=x_mask, other=0.0)
        up = tl.load(x_ptr + offs_r[:, None] * (2 * K) + K + ks[None, :], mask=x_mask, other=0.0)
        xs = gate / (1.0 + tl.exp(-gate)) * up
    else:
        xs = tl.load(x_ptr + offs_r[:, None] * K + ks[None, :], mask=x_mask, other=0.0)
    scale = tl.full([ROWS_P2], 1.0, dtype=tl.float32)
    if NORM:
        scale = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=1) / K + eps)
        xs = xs * tl.load(norm_ptr + ks, mask=k_ok, other=0.0)[None, :]
    for step in range(0, tl.cdiv(tl.cdiv(N, BLOCK_N), PROGRAMS)):  # past the last tile: all masked
        offs_n = (pid + step * PROGRAMS) * BLOCK_N + lanes
        next_n = offs_n + PROGRAMS * BLOCK_N
        next_mask = (next_n < N)[:, None] & k_ok[None, :]
        w_next = tl.load(w_ptr + next_n[:, None] * K + ks[None, :], mask=next_mask, other=0.0)
        w_up_next = w_next
        if SWIGLU:
            w_up_next = tl.load(w_ptr + (up_rows + next_n)[:, None] * K + ks[None, :], mask=next_mask, other=0.0)
        result = tl.sum(w.to(tl.float32)[None, :, :] * xs[:, None, :], axis=2)
        if NORM:
            result = result * scale[:, None]
        if SWIGLU:
            result_up = tl.sum(w_up.to(tl.float32)[None, :, :] * xs[:, None, :], axis=2)
            if NORM:
                result_up = result_up * scale[:, None]
            result = silu_times(result, result_up)
        out_mask = r_ok[:, None] & (offs_n < N)[None, :]
        out_offsets = offs_r[:, None] * N + offs_n[None, :]
        if RESIDUAL:
            result += tl.load(residual_ptr + out_offsets, mask=out_mask, other=0.0)
        tl.store(out_ptr + out_offsets, result, mask=out_mask)
        w, w_up = w_next, w_up_next


@dataclass(frozen=True)
class Tiles:
    """Tile shape and schedule of one projection.

    ``block_m == 1``: an FMA kernel for one or two rows; with ``per_sm`` > 0 the streaming kernel
    (``per_sm`` programs a multiprocessor, each over whole rows, ``block_k`` unused), else one
    program per ``block_n`` columns stepping ``block_k`` at a time.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    per_sm: int = 0
    split: int = 1
    """Matrix tiles only: the reduction split into this many parts, each a program (see
    :func:`projection_kernel`), where the tiles alone would leave multiprocessors idle."""
    descriptors: bool = False
    """Matrix tiles only: inputs and weights reach shared memory through tensor descriptors (Hopper's
    copy engine) instead of per-thread loads."""
    persistent: int = 0
    """Matrix tiles through tensor descriptors, unsplit: this many programs a multiprocessor, each over
    every so many tiles (:func:`persistent_projection_kernel`, or the warp-specialised kernel's persistent
    grid with ``specialised``); 0: one program a tile."""
    specialised: bool = False
    """Matrix tiles through tensor descriptors: a copy warp feeds the stages and the other warps multiply
    (:func:`ignition.kernels.specialised.specialised_projection_kernel`), ``num_stages`` stages; one program
    a tile, or ``persistent`` programs a multiprocessor."""


MULTIPROCESSORS = 132
"""Streaming multiprocessors of the target GPU (an H200; an H100 SXM has as many)."""


def choose_tiles(
    rows: int,
    n: int,
    k: int,
    *,
    multiprocessors: int = MULTIPROCESSORS,
    describable: bool = True,
    unstaged: bool = False,
    specialised: bool = False,
) -> Tiles:
    """Tiles for ``rows x n`` outputs over ``k`` (see the module docstring); with ``describable`` False
    (inputs tensor descriptors cannot serve) the per-thread-load tiles measured for the same shapes;
    ``unstaged``: the inputs are read as they are, 16-bit rows no launch before wrote (the output
    projection over attention's bf16 rows); ``specialised``: warp-specialised tiles may serve (the plain
    projection's lowering and a prefill chunk's rotating projection, which projects with the plain tiles;
    the SwiGLU projection and a decode batch's rotating projection were measured without them)."""
    if rows <= 2:
        # Weight streaming on the FMA units (measured on an H200, docs/benchmarks.md): rows of at most
        # 2048 inputs go to the streaming kernel, four rows a tile and four programs a multiprocessor,
        # rows of up to 4096 two rows a tile and eight programs a multiprocessor; longer rows to one
        # program per eight columns, 1024 inputs a step on eight warps.
        if next_power_of_two(k) <= 2048:
            return Tiles(1, 4, 0, 4, 1, per_sm=4)
        if next_power_of_two(k) <= 4096:
            return Tiles(1, 2, 0, 4, 1, per_sm=8)
        return Tiles(1, 8, 1024, 8, 1)
    if rows <= 16:
        block_n = 128 if cdiv(n, 128) >= SPLIT_PROGRAMS * multiprocessors else 64
        return _split_reduction(Tiles(16, block_n, 128, 4, 4), rows, n, k, multiprocessors)
    if rows <= 64:
        block_n = 128 if cdiv(n, 128) >= multiprocessors else 64
        return _split_reduction(Tiles(64, block_n, 128, 4, 3), rows, n, k, multiprocessors, two_a_multiprocessor=True)
    square_tiles = cdiv(rows, 128) * cdiv(n, 128)
    if describable and rows > 256 and k >= PERSISTENT_REDUCTION and square_tiles >= PERSISTENT_WAVES * multiprocessors:
        # A prefill chunk's wide projection over a long reduction (the 8B [gate|up] at 512 rows, 896
        # tiles): one persistent program a multiprocessor through tensor descriptors, four stages
        # (measured on an H200, docs/benchmarks.md: 207 -> 183 us; level or slower at 256 rows, over
        # 2048 inputs, or with fewer tiles).
        return Tiles(128, 128, 64, 8, 4, descriptors=True, persistent=1)
    if describable and 128 < rows <= NARROW_TILE_ROWS and cdiv(n, 128) >= TALL_TILE_WAVES * multiprocessors:
        # A vocabulary-wide projection of a large decode batch (the LM head at 256 rows): one 256-row tile
        # reads each weight tile once instead of twice, four stages (measured on an H200 at 256 rows,
        # docs/benchmarks.md: the 8B LM head 474 -> 445 us in a graph, the 1B one 256 -> 238; slower than
        # 128x128 tiles on every narrower projection, and with three stages or a split). Where warp-specialised
        # tiles may serve, the same tiles on one persistent program a multiprocessor (measured on an H100 at
        # 256 rows, in-graph: the 1B LM head 273.6 -> 258.6 us, the 8B one 484.6 -> 474.7).
        return Tiles(256, 128, 64, 8, 4, descriptors=True, persistent=1 if specialised else 0, specialised=specialised)
    wide_reduction = k >= WIDE_SPECIALISED_REDUCTION
    if specialised and describable and NARROW_TILE_ROWS < rows <= SPECIALISED_ROWS and wide_reduction:
        # A prefill chunk's projection over 4096 or more inputs whose 128x128 tiles make two thirds of a wave
        # to two waves (the 8B [q|k|v], output and down projections at 512 rows): warp-specialised tiles,
        # 128x256 where those make one wave of the 128x128 ones' one to two. Measured on an H100 at 512 rows
        # (docs/benchmarks.md), in-graph: the 8B [q|k|v] projection 50.1 -> 46.9 us, its output projection
        # 35.6 -> 34.0, its down projection 99.5 -> 95.6.
        if 3 * square_tiles >= 2 * multiprocessors and square_tiles <= multiprocessors:
            return Tiles(128, 128, 64, 8, 5, descriptors=True, specialised=True)
        if multiprocessors < square_tiles <= 2 * multiprocessors:
            return Tiles(128, 256, 64, 8, 4, descriptors=True, specialised=True)
    if square_tiles >= multiprocessors:
        # Wide outputs (the [gate|up] projection and the LM head of a large batch, every projection of a
        # long prefill chunk): 128x128 tiles, fed by tensor descriptors where they can serve (measured on
        # an H200 at 256 and 512 rows, docs/benchmarks.md), no split.
        return _split_reduction(Tiles(128, 128, 64, 8, 3, descriptors=describable), rows, n, k, multiprocessors)
    one_narrow_wave = cdiv(rows, 64) * cdiv(n, 128) <= multiprocessors
    reduction = SPECIALISED_REDUCTION <= k < LONG_REDUCTION
    if specialised and describable and 128 < rows <= SPECIALISED_ROWS and one_narrow_wave and reduction:
        # Narrow outputs of a large decode batch or a prefill chunk whose 64x128 tiles make at most one
        # wave, over 2048 to 12287 inputs (the 1B output and down projections at 256 and 512 rows, the 8B
        # output projection at 256): one unsplit 64x128 tile a program, a copy warp feeding eight stages
        # (six over more than 256 rows). Measured on an H100 (docs/benchmarks.md), in-graph: the 8B
        # output projection at 256 rows 29.1 -> 25.9 us, the 1B one 11.2 -> 10.0 and its down projection
        # 29.9 -> 26.1; at 512 rows 18.7 -> 14.1 and 49.2 -> 37.1. Level or slower: the 8B down
        # projection (14336 inputs), any of them at 64 rows, wider outputs.
        return Tiles(64, 128, 64, 4, 8 if rows <= NARROW_TILE_ROWS else 6, descriptors=True, specialised=True)
    if rows <= NARROW_TILE_ROWS:
        square = _split_within_one_wave(Tiles(128, 128, 64, 8, 4, descriptors=True), rows, n, k, multiprocessors)
        if describable and (k >= LONG_REDUCTION or (unstaged and square.split <= UNSTAGED_SPLIT)):
            # A long reduction over narrow outputs (the 8B down projection), or 16-bit rows read as they are
            # whose 128x128 tiles need at most two parts to fill a wave (the 8B output projection over
            # attention's bf16 rows at 256 rows): 128x128 tiles on two warpgroups through tensor descriptors,
            # split within one wave, beat one warpgroup's 64x128 tiles.
            return square
        # Narrow outputs of a large decode batch (measured on an H200 at 256 rows, docs/benchmarks.md):
        # 64x128 tiles on four warps, the reduction split only as far as one wave of programs allows.
        return _split_within_one_wave(Tiles(64, 128, 64, 4, 4), rows, n, k, multiprocessors)
    if describable and 3 * square_tiles >= 2 * multiprocessors:
        # A prefill chunk whose 128x128 tiles nearly fill the machine: those tiles, four stages, unsplit.
        return Tiles(128, 128, 64, 8, 4, descriptors=True)
    return _split_reduction(Tiles(128, 64, 64, 8, 3), rows, n, k, multiprocessors)


SPECIALISED_ROWS = 512
"""Rows up to which (from 129) a plain projection may take warp-specialised tiles (see :func:`choose_tiles`)."""

SPECIALISED_REDUCTION = 2048
"""Inputs from which a plain projection may take warp-specialised tiles: 32 steps of 64 or more a program."""

WIDE_SPECIALISED_REDUCTION = 4096
"""Inputs from which a plain projection of 257 to 512 rows whose 128x128 tiles make two thirds of a wave to
two waves takes warp-specialised 128x128 or 128x256 tiles (see :func:`choose_tiles`)."""

SPECIALISED_STEP = 64
"""Inputs a step of a warp-specialised tile: one 128-byte swizzled row of 16-bit values a tile row."""

TALL_TILE_WAVES = 4
"""Waves of 128-column tiles from which a projection of 129 to 256 rows takes 256-row tiles (see
:func:`choose_tiles`): only vocabulary-wide outputs (the measured LM heads have 1002 column tiles)."""

PERSISTENT_REDUCTION = 4096
"""Inputs from which a wide projection of a prefill chunk takes persistent tiles (see :func:`choose_tiles`)."""

PERSISTENT_WAVES = 4
"""128x128 tiles a multiprocessor from which a wide projection of a prefill chunk takes persistent tiles."""

POINTER_TILE_COLUMNS = 128
"""The widest matrix tile fed by per-thread loads: 128x256 tiles on float32 inputs (224 KB of shared memory)
gave launches whose results differed from one run to the next on an H200; :func:`choose_tiles` never
hands out a wider one without tensor descriptors."""

POINTER_TILE_ROWS = 128
"""The tallest matrix tile fed by per-thread loads: a 256-row tile's float32 inputs alone need 256 KB of
shared memory over four stages, more than a block may have."""

LONG_REDUCTION = 12288
"""Inputs from which a narrow projection of up to 256 rows takes 128x128 tiles (see :func:`choose_tiles`)."""

UNSTAGED_SPLIT = 2
"""The most parts a narrow projection of up to 256 rows over 16-bit rows no launch staged splits its 128x128
tiles into (to fill one wave) for it to take them (see :func:`choose_tiles`). Measured on an H100 at 256 rows
(``benchmarks/projection_tiles.py --projections o``, docs/benchmarks.md): the 8B output projection (64 such
tiles, two parts) gained 0.17 ms a decode step of 256 rows; the 1B one (32 tiles, four parts) ran 19.4 us
against 11.2 for 64x128 tiles, and the whole step 0.15 ms slower."""

_MAX_GRID_Y = 65535
"""The most programs of a launch grid's second dimension (CUDA's limit), where the column tiles go."""


NARROW_TILE_ROWS = 256
"""The most rows whose narrow projections (fewer 128x128 output tiles than multiprocessors) take 64x128
tiles; more rows (prefill chunks) keep the 128-row tiles they were measured with."""


SPLIT_PROGRAMS = 1
"""Programs a multiprocessor the split reduction aims for where the output tiles are fewer (measured on
an H200 with ``benchmarks/projection_tiles.py``: two a multiprocessor made the 1B ``[gate|up]``
projection of 8 rows a third slower than one; see docs/benchmarks.md)."""

SPLIT_MIN_STEPS = 4
"""Reduction steps each part of a 64-row tile's split keeps when the split goes past one program a
multiprocessor (see :func:`_split_reduction`)."""

SPLIT_MIN_INPUTS = 512
"""Inputs each part of a split reduction keeps at least, for 64-row tiles (:func:`_split_reduction`) and for
every split within one wave (:func:`_split_within_one_wave`): a shorter reduction is not split at all.
Measured on an H100 (``benchmarks/projection_tiles.py --shapes 135m``, docs/benchmarks.md), the 135M shape's
projections over 576 and 1536 inputs ran up to twice as fast with fewer parts (in-graph at 64 rows: the
output projection 4.7 us unsplit against 8.6 in five parts of one step, the down projection 6.2 to 6.4 in two
or three parts against 13.1 in twelve; at 128 and 256 rows the 64x128 tiles' output projection 6.3 unsplit against 14.9
and 10.8 in five parts), while every split of the 1B and 8B shapes (2048 inputs and more) keeps its parts.
Each part's partial tile is 16 KiB at 64 rows, and the last part reads them all back: a part of one or two
steps does less work than that. 16-row tiles, whose partials are a quarter as large, keep single steps."""


ORDINARY_WAIT_ROWS: int | None = 64
"""Projections of more rows than this that follow another launch of their own node wait for it the ordinary
way rather than programmatically: after their staged norm, SwiGLU or rounded rows (:func:`project`), after
the norm and rotation factors of the rotating projection (:func:`ignition.kernels.attention.rotary_projection`),
and the down projection after the ``[gate|up]`` projection of its MLP (:func:`lower_rmsnorm_swiglu_mlp_add`).
Launched programmatically, a projection's programs start as soon as every program of the launch before has
started, and each then holds its registers and shared memory on a multiprocessor, waiting, while that launch
still runs there. Measured on an H100 (docs/benchmarks.md): the 1B step of 256 rows replayed 60 us faster with
the rotating projection waiting on its norm the ordinary way and 58 us faster with the down projection waiting
on ``[gate|up]`` so (``benchmarks/program_profile.py --edges``); with this rule the served 1B step of 256 rows
was 3.6 to 4.4 % faster in three runs (2.338 against 2.425 ms in the last), the 8B one 0.9 %, and most
512-token prefills 2 to 6 %. Applied to the 16- and 64-row tiles too, it made the 135M steps of 8 and 64 rows
5 to 6 % slower (0.841 against 0.790 ms at 8 rows), so those keep their programmatic waits. ``None`` keeps
every wait programmatic."""


def waits_programmatically(rows: int, follows_own_launch: bool) -> bool:
    """Whether a projection launch over ``rows`` rows is marked ``programmatic_wait`` (:data:`ORDINARY_WAIT_ROWS`)."""
    return not (follows_own_launch and ORDINARY_WAIT_ROWS is not None and rows > ORDINARY_WAIT_ROWS)


def swiglu_tiles(plain: Tiles, rows: int, n: int, *, multiprocessors: int = MULTIPROCESSORS) -> Tiles:
    """The tiles of a projection ending in SwiGLU over ``n`` rows of ``[gate | up]`` weights (each program over
    the gate and the up block of the same columns) whose plain projection would take ``plain``.

    Where ``plain`` is an unsplit 128x128 tile through tensor descriptors (wide outputs of many rows, prefill
    chunks) and 128x128 blocks of each half still make at least three quarters of a wave of programs:
    those blocks, eight warps, four stages, one program a tile. Measured on an H200
    (``benchmarks/projection_tiles.py --projections swiglu``, docs/benchmarks.md), the 8B ``[gate | up]``
    went from 302.9 to 183.7 us at 512 rows (persistent 128x64 blocks before) and from 104.4 to 92.0 us at
    256 rows (128x64 blocks, three stages), the 1B one (128 programs at 256 rows) from 29.7 to 27.7 us.
    Otherwise the blocks of each half are half as wide, so as many programs run as the plain projection
    would have.
    """
    whole_blocks = cdiv(rows, 128) * cdiv(n // 2, 128)
    # (a 256x128 plain tile, vocabulary-wide outputs, is as unsplit and as wide)
    unsplit_square = plain.descriptors and plain.block_m in (128, 256) and plain.block_n == 128 and plain.split == 1
    if unsplit_square and 4 * whole_blocks >= 3 * multiprocessors:
        return Tiles(128, 128, 64, 8, 4, descriptors=True)
    return dataclasses.replace(plain, block_n=max(1, plain.block_n // 2))


def _split_within_one_wave(tiles: Tiles, rows: int, n: int, k: int, multiprocessors: int) -> Tiles:
    """``tiles`` with the reduction split into as many parts as keep every program of the launch in one
    wave (at most one program a multiprocessor; no split when the output tiles alone reach half the
    multiprocessors or more) and each part ``SPLIT_MIN_INPUTS`` inputs or more, every part but the last
    the same whole number of ``block_k`` steps."""
    count = cdiv(rows, tiles.block_m) * cdiv(n, tiles.block_n)
    steps = cdiv(k, tiles.block_k)
    wanted = max(1, min(multiprocessors // count, steps, k // SPLIT_MIN_INPUTS))
    return dataclasses.replace(tiles, split=cdiv(steps, cdiv(steps, wanted)))


def _split_reduction(
    tiles: Tiles, rows: int, n: int, k: int, multiprocessors: int, *, two_a_multiprocessor: bool = False
) -> Tiles:
    """``tiles`` with the reduction split so that about ``SPLIT_PROGRAMS`` programs a multiprocessor
    stream the weights (few rows or narrow outputs leave most multiprocessors idle otherwise); every
    split but the last gets the same whole number of ``block_k`` steps.

    With ``two_a_multiprocessor`` (64-row tiles, whose programs fit two a multiprocessor) the split goes
    on up to two programs a multiprocessor as long as each part keeps ``SPLIT_MIN_STEPS`` steps. Measured
    on an H200 (``benchmarks/projection_tiles.py --rows 64``, docs/benchmarks.md), the 1B down projection
    (32 tiles over 8192 inputs) took 14.6 us in eight parts against 17.0 in five, the 8B one (64 tiles over
    14336) 35.5 in four against 39.1 in three, the 8B output projection 14.1 against 14.9; a partial
    second program on some multiprocessors (160 or 192 programs) was the slowest of those splits. A 64-row
    tile's part also keeps ``SPLIT_MIN_INPUTS`` inputs or more, so reductions shorter than twice that are
    not split."""
    count = cdiv(rows, tiles.block_m) * cdiv(n, tiles.block_n)
    steps = cdiv(k, tiles.block_k)
    wanted = cdiv(SPLIT_PROGRAMS * multiprocessors, count)
    if two_a_multiprocessor:
        wanted = max(wanted, min(2 * multiprocessors // count, steps // SPLIT_MIN_STEPS))
        wanted = min(wanted, k // SPLIT_MIN_INPUTS)  # a 64-row tile's part keeps 512 inputs or more
    wanted = max(1, min(wanted, steps))
    return dataclasses.replace(tiles, split=cdiv(steps, cdiv(steps, wanted)))


def rotary_tiles(
    plain: Tiles, rows: int, n: int, k: int, *, multiprocessors: int = MULTIPROCESSORS, describable: bool = False
) -> Tiles | None:
    """The tiles of the rotating ``[q | k | v]`` projection (``attention.py``) whose plain projection would
    take ``plain``, or None where the projection does not rotate (the projection into a workspace, then the
    rotation in a launch of its own); ``describable``: tensor descriptors can serve its 128-column tiles
    (16-bit weights, aligned rows, whole heads a tile in the half layout: ``attention.rotary_describes``).

    - 64-row tiles fed by per-thread loads are split into as many parts as fit one wave where that makes
      two parts or more (the 1B projection of 64 rows, 48 tiles: 8.8 us in two parts against 10.6 in
      three and 10.1 in four, measured on an H200 with ``benchmarks/projection_tiles.py --projections
      rotary``, docs/benchmarks.md).
    - Narrow 64x128 tiles of 129 to 256 rows become 128x128 tiles through tensor descriptors, four stages,
      where ``describable`` and those tiles alone make half a wave or more (the 8B projection at 256 rows,
      96 tiles: 34.4 us against 36.7 on an H100, the decode step of 256 rows 0.13 ms faster; the 1B one's
      48 tiles ran 16.0 us against 12.8 and keep theirs).
    - Matrix tiles that are through tensor descriptors already (prefill chunks), persistent or streaming
      rows: None. Rotating in a chunk's 128x128 descriptor tiles ran slower than the plain projection
      by more than the rotation's own launch saves (the 8B chunk of 512 rows: 72.6 us against 49.8 with
      three stages, 58.3 with four; its prefill 16.6 ms against 16.2).
    """
    if plain.block_m <= 1 or plain.persistent or plain.per_sm or plain.descriptors:
        return None
    half_a_wave = 2 * cdiv(rows, 128) * cdiv(n, 128) >= multiprocessors
    if describable and 64 < rows <= NARROW_TILE_ROWS and plain.block_m == 64 and half_a_wave:
        return Tiles(128, 128, 64, 8, 4, descriptors=True)
    if plain.block_m != 64 or rows > 64:
        return plain
    one_wave = _split_within_one_wave(dataclasses.replace(plain, split=1), rows, n, k, multiprocessors)
    return one_wave if one_wave.split > 1 else plain


def check_projection(
    ctx: LoweringContext,
    x: mf.BufferView,
    weight: mf.BufferView,
    out: mf.BufferView | None,
    *,
    norm: mf.BufferView | None = None,
    residual: mf.BufferView | None = None,
    gated: bool = False,
    swiglu: bool = False,
) -> tuple[int, int, int]:
    """(rows, N, K) of a projection's views: an ``[N, K]`` bf16/f16/f32 weight, rows of ``K`` inputs
    (``2K`` when ``gated``), and ``out`` (when given) of ``N`` per row (``N / 2`` with ``swiglu``: the
    weight's gate rows, then its up rows). Inputs and outputs are float32; a plain projection (no norm
    or SwiGLU of its inputs) may read inputs of the weight's 16-bit type, and one without a residual may
    write a 16-bit type (rounded at the store).

    Raises:
        the context's lowering error naming the view that does not fit.
    """
    w_shape = ctx.shape(weight)
    if len(w_shape) != 2:
        raise ctx.fail(f"weight must be [N, K], got {list(w_shape)}")
    n, k = w_shape
    if swiglu and n % 2:
        raise ctx.fail(f"a [gate | up] weight needs an even number of rows, got {n}")
    x_shape = ctx.shape(x)
    rows = x_shape[0]
    x_width = math.prod(x_shape[1:])
    if x_width != (2 * k if gated else k):
        raise ctx.fail(f"x rows hold {x_width} values; the weight needs {'2 x ' if gated else ''}{k}")
    out_width = n // 2 if swiglu else n
    if out is not None:
        out_shape = ctx.shape(out)
        if out_shape[0] != rows or (len(out_shape) > 1 and out_shape[0] * out_width != math.prod(out_shape)):
            raise ctx.fail(f"out {list(out_shape)} must hold {rows} rows of {out_width}")
    weight_dtype = ctx.dtype(weight)
    if weight_dtype not in (mf.DTYPE_BF16, mf.DTYPE_F16, mf.DTYPE_F32):
        raise ctx.fail("weight must be bf16, f16 or f32")
    plain_input = norm is None and not gated
    if ctx.dtype(x) != mf.DTYPE_F32 and not (plain_input and ctx.dtype(x) == weight_dtype):
        raise ctx.fail("x must be float32 (or the weight's 16-bit type, without a norm or SwiGLU of the inputs)")
    if out is not None and ctx.dtype(out) not in (mf.DTYPE_F32, mf.DTYPE_BF16, mf.DTYPE_F16):
        raise ctx.fail("out must be float32, bf16 or f16")
    if out is not None and residual is not None and ctx.dtype(out) != mf.DTYPE_F32:
        raise ctx.fail("out must be float32 where a residual is added")
    for view, name in ((residual, "residual"), (norm, "norm_weight")):
        if view is not None and ctx.dtype(view) != mf.DTYPE_F32:
            raise ctx.fail(f"{name} must be float32")
    return rows, n, k


_STAGED_INPUT_KEYS: dict[int, str] = {mf.DTYPE_BF16: "projection_input_bf16", mf.DTYPE_F16: "projection_input_f16"}
"""The workspace of a staged prologue's output, per 16-bit weight type (float32 weights: ``projection_input``)."""


def project(
    ctx: LoweringContext,
    node: mf.Node,
    x: mf.BufferView,
    weight: mf.BufferView,
    out: mf.BufferView,
    *,
    norm: mf.BufferView | None = None,
    residual: mf.BufferView | None = None,
    gated: bool = False,
    swiglu: bool = False,
    tiles: Tiles | None = None,
    multiprocessors: int = MULTIPROCESSORS,
    follows_own_launch: bool = False,
) -> list[mf.KernelLaunch]:
    """The launches of ``out = residual + prologue(x) @ weight.T`` (module docstring); with ``swiglu``,
    ``out = silu(prologue(x) @ gate.T) * (prologue(x) @ up.T)`` over a ``[gate | up]`` weight, the tiles
    chosen for the whole weight with half as many columns each (one program multiplies its inputs with
    the gate and the up block of the same columns). ``multiprocessors`` sizes the streaming kernel's grid
    (the H200's 132 by default). ``follows_own_launch``: another launch of the node comes right before
    these (projections of many rows after it, or after a staged prologue, wait the ordinary way:
    :data:`ORDINARY_WAIT_ROWS`)."""
    rows, n, k = check_projection(ctx, x, weight, out, norm=norm, residual=residual, gated=gated, swiglu=swiglu)
    if swiglu and residual is not None:
        raise ctx.fail("a SwiGLU projection adds no residual")
    # Matrix tiles stage a norm or SwiGLU of the inputs in the weight's 16-bit type, and plain float32
    # inputs too (rounded there once, as the products would round them in every column tile) where that
    # was measured to pay.
    cast = norm is None and not gated and ctx.dtype(x) == mf.DTYPE_F32 and ctx.dtype(weight) in _STAGED_INPUT_KEYS
    cast = cast and stages_float32_inputs(rows, n, multiprocessors)
    prologue_staged = rows > 2 and (norm is not None or gated or cast)
    describable = describes(ctx, weight if prologue_staged else x, weight, k)
    unstaged = not prologue_staged and describable
    chosen = tiles or choose_tiles(
        rows, n, k, multiprocessors=multiprocessors, describable=describable, unstaged=unstaged,
        specialised=not swiglu,
    )  # fmt: skip
    if swiglu:
        if not tiles:
            chosen = swiglu_tiles(chosen, rows, n, multiprocessors=multiprocessors)
        n //= 2
    prologue: list[mf.KernelLaunch] = []
    if chosen.block_m > 1 and prologue_staged:
        # Matrix tiles: the row-wise prologue once into a workspace (instead of once per column tile),
        # then the plain projection reads it. (Run in the projection's steps instead, as measured on
        # an H200, it made 8-row projections about 1.5x slower: a row reduction every step.) The
        # workspace holds the weight's 16-bit type where it has one: the products round the inputs to
        # it anyway, so the results are the same and every column tile reads half the bytes (through
        # tensor descriptors where the tiles take them). Plain float32 inputs are only rounded there.
        staged_view = staged_input(ctx, weight, rows)
        prologue = _prologue(ctx, node, x, staged_view, norm, gated, rows, k)
        x, norm, gated = staged_view, None, False
    grid: tuple[int, ...]
    constants: dict[str, int | bool] = {
        "N": n, "K": k, "BLOCK_N": chosen.block_n, "RESIDUAL": residual is not None, "SWIGLU": swiglu
    }  # fmt: skip
    args = {"x_ptr": ctx.pointer(x), "w_ptr": ctx.pointer(weight), "out_ptr": ctx.pointer(out)}
    args["residual_ptr"] = ctx.pointer(residual if residual is not None else out)
    if chosen.block_m > 1:
        tiles_n, tiles_m = cdiv(n, chosen.block_n), cdiv(rows, chosen.block_m)
        programmatic = waits_programmatically(rows, follows_own_launch or bool(prologue))
        if tiles_n > _MAX_GRID_Y:
            raise ctx.fail(f"{n} outputs make {tiles_n} column tiles of {chosen.block_n}; the grid takes {_MAX_GRID_Y}")
        partials, counters = out, out  # never touched without a split
        if chosen.split > 1:
            area = tiles_n * tiles_m * chosen.split * chosen.block_m * chosen.block_n * (2 if swiglu else 1)
            partials = ctx.workspace("projection_partials", mf.DTYPE_F32, area)
            counters = ctx.workspace("projection_splits_done", mf.DTYPE_I32, tiles_n * tiles_m)
        args.update(partial_ptr=ctx.pointer(partials), counter_ptr=ctx.pointer(counters), rows=ctx.i32(rows))
        k_split = cdiv(cdiv(k, chosen.block_k), chosen.split) * chosen.block_k
        descriptors = chosen.descriptors and describable  # the staged rows have the weight's type and width
        if not descriptors and (chosen.block_n > POINTER_TILE_COLUMNS or chosen.block_m > POINTER_TILE_ROWS):
            raise ctx.fail(
                f"a {chosen.block_m}x{chosen.block_n} tile needs tensor descriptors (16-bit inputs and weights, "
                f"16-byte aligned rows); per-thread loads take at most {POINTER_TILE_ROWS} rows and "
                f"{POINTER_TILE_COLUMNS} columns a tile"
            )
        if chosen.persistent:
            if not descriptors or chosen.split > 1:
                raise ctx.fail("persistent tiles need tensor descriptors (16-bit inputs and weights) and no split")
            programs = min(tiles_n * tiles_m, chosen.persistent * multiprocessors)
        if chosen.persistent and not chosen.specialised:
            constants.update(BLOCK_M=chosen.block_m, BLOCK_K=chosen.block_k, PROGRAMS=programs)
            del args["partial_ptr"], args["counter_ptr"]
            args["rows"] = ctx.i32(rows)
            kernel, grid = persistent_projection_kernel, (programs,)
            launch = ctx.launch(
                kernel, args, constants, grid, num_warps=chosen.num_warps, num_stages=chosen.num_stages,
                programmatic=programmatic,
            )  # fmt: skip
            return [*prologue, launch]
        constants.update(BLOCK_M=chosen.block_m, BLOCK_K=chosen.block_k, SPLIT=chosen.split, K_SPLIT=k_split)
        if chosen.specialised:
            if not descriptors:
                raise ctx.fail("warp-specialised tiles need tensor descriptors (16-bit inputs and weights)")
            if chosen.block_k != SPECIALISED_STEP:
                raise ctx.fail(f"warp-specialised tiles step {SPECIALISED_STEP} inputs (128-byte swizzled rows)")
            kernel = specialised_projection_kernel
            constants.update(STAGES=chosen.num_stages)
        else:
            kernel = projection_kernel
            constants.update(DESCRIPTORS=descriptors)
        # a persistent grid of warp-specialised programs: each over every programs-th tile
        grid = (programs, 1, 1) if chosen.persistent else (tiles_m, tiles_n, chosen.split)
        launch = ctx.launch(
            kernel, args, constants, grid, num_warps=chosen.num_warps, num_stages=chosen.num_stages,
            programmatic=programmatic,
        )  # fmt: skip
        return [*prologue, launch]
    eps = float(ctx.attribute(node, "eps", 0.0)) if norm is not None else 0.0
    args.update(norm_ptr=ctx.pointer(norm if norm is not None else x), eps=ctx.f32(eps), rows=ctx.i32(rows))
    constants.update(NORM=norm is not None, GATED=gated)
    if rows > 2:
        raise ctx.fail(f"the vector projection takes at most 2 rows, not {rows}")
    if chosen.per_sm:
        programs = min(cdiv(n, chosen.block_n), chosen.per_sm * multiprocessors)
        constants.update(ROWS_P2=next_power_of_two(rows), K_P2=next_power_of_two(k), PROGRAMS=programs)
        kernel, grid = streaming_projection_kernel, (programs,)
    else:
        constants.update(ROWS_P2=next_power_of_two(rows), BLOCK_K=chosen.block_k)
        kernel, grid = vector_projection_kernel, (cdiv(n, chosen.block_n),)
    launch = ctx.launch(kernel, args, constants, grid, num_warps=chosen.num_warps, num_stages=chosen.num_stages)
    return [*prologue, launch]


def staged_input(ctx: LoweringContext, weight: mf.BufferView, rows: int) -> mf.BufferView:
    """The workspace a matrix projection's staged inputs (a norm or SwiGLU of them, or rounded float32 rows)
    take for ``rows`` rows of ``weight``'s inputs: the weight's 16-bit type where it has one (the products
    round the inputs to it anyway), else float32."""
    k = ctx.shape(weight)[1]
    weight_dtype = ctx.dtype(weight)
    staged_dtype = weight_dtype if weight_dtype in _STAGED_INPUT_KEYS else mf.DTYPE_F32
    staged = ctx.workspace(_STAGED_INPUT_KEYS.get(staged_dtype, "projection_input"), staged_dtype, rows * k)
    return mf.BufferView(buffer=staged.buffer, element_offset=0, shape=[rows, k])


def stages_float32_inputs(rows: int, n: int, multiprocessors: int = MULTIPROCESSORS) -> bool:
    """Whether matrix tiles over float32 inputs beside 16-bit weights read them rounded into a workspace by a
    launch before (:func:`project`). Measured on an H200 (docs/benchmarks.md), on the 1B output projection:
    at 64 rows its launches went from 169 to 123 µs of the step's graph and the 512-token prefill gained; the
    narrow projections of 65 to 256 rows (64x128 tiles on one warpgroup) made the batch-256 step 0.1 ms
    slower on two leases, so those keep reading float32."""
    narrow = 64 < rows <= NARROW_TILE_ROWS and cdiv(rows, 128) * cdiv(n, 128) < multiprocessors
    return rows > 2 and not narrow


def describes(ctx: LoweringContext, x: mf.BufferView, weight: mf.BufferView, k: int) -> bool:
    """Whether tensor descriptors can serve ``x`` and ``weight``: 16-bit values (float32 inputs, converted
    in registers after a descriptor's copy, gave launches that differ in their last bits from one run to
    the next on an H200), rows whose bytes are a multiple of 16 and views that start 16-byte aligned (the
    copy engine's requirements)."""
    for view in (x, weight):
        if ctx.dtype(view) not in (mf.DTYPE_BF16, mf.DTYPE_F16):
            return False
        itemsize = ITEMSIZE[ctx.dtype(view)]
        if (k * itemsize) % 16 or (int(view.element_offset) * itemsize) % 16:
            return False
    return True


def _prologue(
    ctx: LoweringContext,
    node: mf.Node,
    x: mf.BufferView,
    out: mf.BufferView,
    norm: mf.BufferView | None,
    gated: bool,
    rows: int,
    k: int,
) -> list[mf.KernelLaunch]:
    """The launch that writes ``rmsnorm(x)``, SwiGLU of the packed ``[gate | up]`` rows, or ``x`` itself
    (rounded to ``out``'s type) into ``out``."""
    if norm is not None:
        step = mf.Node(name=node.name)
        step.op.name, step.op.version = "rmsnorm", 1
        step.args.add(name="x", view=x)
        step.args.add(name="weight", view=norm)
        step.args.add(name="out", view=out)
        step.attributes.add(name="eps", float_value=float(ctx.attribute(node, "eps", 0.0)))
        from ignition.kernels.lowering import LOWERINGS

        return LOWERINGS[("rmsnorm", 1)](ctx, step)
    block = min(1024, next_power_of_two(k))
    return [
        ctx.launch(
            stage_rows_kernel,
            {"x_ptr": ctx.pointer(x), "out_ptr": ctx.pointer(out)},
            {"WIDTH": k, "BLOCK": block, "GATED": gated},
            (rows, cdiv(k, block)),
            num_warps=4,
            num_stages=1,
        )
    ]


@triton.jit  # type: ignore[misc, untyped-decorator]
def stage_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr
):
    """out[r, c] = x[r, c], or with ``GATED`` silu(x[r, c]) * x[r, WIDTH + c] of packed ``[gate | up]`` rows
    (as silu_mul computes it), rounded to out's type at the store (to nearest even, as the tensor cores'
    inputs are rounded)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if GATED:
        gate = tl.load(x_ptr + row * 2 * WIDTH + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * 2 * WIDTH + WIDTH + cols, mask=ok, other=0.0)
        values = silu_times(gate, up)
    else:
        values = tl.load(x_ptr + row * WIDTH + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * WIDTH + cols, values, mask=ok)


@lowering("linear")
def lower_linear(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    return project(ctx, node, ctx.need(node, "x"), ctx.need(node, "weight"), ctx.need(node, "out"))


@lowering("rmsnorm_linear")
def lower_rmsnorm_linear(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    return project(
        ctx,
        node,
        ctx.need(node, "x"),
        ctx.need(node, "weight"),
        ctx.need(node, "out"),
        norm=ctx.need(node, "norm_weight"),
    )


@lowering("linear_add")
def lower_linear_add(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    return project(
        ctx,
        node,
        ctx.need(node, "x"),
        ctx.need(node, "weight"),
        ctx.need(node, "out"),
        residual=ctx.need(node, "residual"),
    )


@lowering("silu_mul_linear_add")
def lower_silu_mul_linear_add(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    return project(
        ctx,
        node,
        ctx.need(node, "gate_up"),
        ctx.need(node, "weight"),
        ctx.need(node, "out"),
        residual=ctx.need(node, "residual"),
        gated=True,
    )


_ACTIVATION_KEYS: dict[int, str] = {
    mf.DTYPE_BF16: "swiglu_activation_bf16",
    mf.DTYPE_F16: "swiglu_activation_f16",
    mf.DTYPE_F32: "swiglu_activation",
}
"""The workspace of a SwiGLU MLP's activation, per type (see :func:`lower_rmsnorm_swiglu_mlp_add`)."""


@lowering("rmsnorm_swiglu_mlp_add")
def lower_rmsnorm_swiglu_mlp_add(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """Two projections through a workspace: ``silu(xn @ gate.T) * (xn @ up.T)`` of the normalised rows
    (their norm staged first from three rows on), then the down projection of that activation added to
    the residual. The activation is stored in the weights' 16-bit type from three rows on (the down
    projection's tensor-core products round it to that type anyway, so the results are those of
    rounding it there) and in float32 for one or two rows (the FMA kernels multiply in float32)."""
    x, norm, gate_up = ctx.need(node, "x"), ctx.need(node, "norm_weight"), ctx.need(node, "gate_up_weight")
    down = ctx.need(node, "down_weight")
    rows, two_f, _k = check_projection(ctx, x, gate_up, None, norm=norm, swiglu=True)
    width = two_f // 2
    down_shape = ctx.shape(down)
    if len(down_shape) != 2 or down_shape[1] != width:
        raise ctx.fail(
            f"down_weight must be [N, {width}] for a [gate | up] weight of {two_f} rows, got {list(down_shape)}"
        )
    weight_dtype = ctx.dtype(gate_up)  # bf16, f16 or f32: check_projection refused any other
    dtype = weight_dtype if rows > 2 and weight_dtype == ctx.dtype(down) else mf.DTYPE_F32
    staged = ctx.workspace(_ACTIVATION_KEYS[dtype], dtype, rows * width)
    activation = mf.BufferView(buffer=staged.buffer, element_offset=0, shape=[rows, width])
    first = project(ctx, node, x, gate_up, activation, norm=norm, swiglu=True)
    second = project(
        ctx, node, activation, down, ctx.need(node, "out"), residual=ctx.need(node, "residual"), follows_own_launch=True
    )
    return [*first, *second]
