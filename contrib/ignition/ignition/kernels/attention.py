"""Attention kernels: paged attention, the fused rotary-embedding + cache write, and the attention input.

Owns the lowering of ``paged_attention``, ``rope_kv_cache_write`` and
``rmsnorm_linear_rope_kv_cache_write``.

``paged_attention`` runs in one launch (split-position attention): every (token, KV head, position
split) gets one program that attends the group of query heads sharing that KV head to its split's
positions ``[s * SPLIT, (s + 1) * SPLIT)`` up to the token's own position, reading keys and values
through the page table. Cache planes hold float32 or bfloat16 (:data:`CACHE_PLANE_DTYPES`); the cache
writes round to the plane's type, and attention takes bfloat16 rows as they are (see the products
below). A token's context reaches ``ceil((position + 1) / SPLIT)`` active splits; the programs of the
other splits return at once. With one active split (a context of at most ``SPLIT`` positions, or of at
most ``SHORT`` where ``SHORT`` is longer: split 0 then walks it whole) the program writes the output
itself. Otherwise each active program writes its split's running maximum, sum and unnormalised output to
workspaces, and the last of them to finish (an atomic count of finished splits, which it resets) merges
the active splits of that group's query heads. A decode step therefore spreads a long context over many
programs instead of walking it in one, without a second launch. The group's query heads are padded to a
16-row tile and both products (``q @ K.T`` and ``p @ V``) run on the matrix units as three TF32 products
each over float32 planes (float32 accuracy; see ``benchmarks/attention_splits.py`` for the measured
choice against float32 FMAs), and over bfloat16 planes, whose keys and values are exact in bfloat16, as
two bfloat16 products each: the float32 operand (queries, softmax weights) split into its bfloat16
rounding and the bfloat16 rounding of the remainder, accumulated in float32 (16 mantissa bits of that
operand; half the registers and a third of the matrix instructions of the TF32 form, so more programs
fit a multiprocessor). Softmax is computed online in float32 (the reference subtracts the exact maximum
first; the two agree to float32 rounding). With a ``window`` ``N`` (the ``WINDOW`` constant; 0 attends
every earlier position) a token attends positions ``lowest = max(position - N + 1, 0) .. position``, as
the reference: its splits start at ``lowest`` rather than 0, so the launch needs only the splits ``N``
positions reach, and no page-table entry or key and value row of a position before ``lowest`` is read
(pages wholly before a window may already be released and hold another request's tokens). Tokens whose
row is negative (padding) get zero output. The output rows are float32, or bf16 or f16 rounded to nearest even
at the store (:data:`OUTPUT_DTYPES`). When the rows, positions and page table are settled (no
earlier node of the program writes them, see ``lowering.py``), a program reads them and its first
block's pages before ``gdc_wait``; each block loads the next block's pages ahead.

A node of at least ``TILE_MIN_TOKENS`` tokens and two a page-table row (prompt chunks) runs as query tiles
(:func:`attention_tile_kernel`): a tile's tokens attend their rows one row after another, reading a row's keys
and values once for all of its tokens. In a mixed program (operation ``MIXED``: decode lanes beside prompt
chunks) the tokens alone in their row among their neighbours (the decode lanes) are left out of the tiles and
attended by a split launch right after them (``ALONE_ONLY``), each by its own programs, instead of a tile
walking its decode lanes' rows in turn.

``rope_kv_cache_write`` gives each program a few consecutive tokens (:func:`rope_tokens`): it splits a token's packed
``[q | k | v]`` projection, rotates the query and key heads (both pair layouts; inverse frequencies
with optional frequency-band scaling, angles, cos and sin in float64 as the reference, the rotation
in float32), writes the
rotated queries and the key and value heads into the cache planes at the token's slot (a negative
slot writes no cache, the queries are still written).

``rmsnorm_linear_rope_kv_cache_write`` at one or two rows (decode) is one launch of
:func:`attention_input_kernel`, which streams the weights as the streaming projection does (see
``linear.py``: a fixed grid, each program over several tiles of whole rows), with each tile's rows
chosen as whole rotation pairs (``PAIRS`` first members and their partners, ``D / 2`` apart in the
half layout, adjacent in the interleaved one), so the rotation, the query store and the cache
writes happen on the program's own sums and the packed ``[q | k | v]`` rows never reach memory.
Value rows are taken ``2 * PAIRS`` at a time and written to the value plane as they are. At more
rows, where the projection takes matrix tiles (:func:`~ignition.kernels.linear.rotary_tiles`),
:func:`rotary_input_kernel` stages the norm as ``rmsnorm`` does and writes each row's rotation factors
(cos and sin of every pair's angle, computed once a row), and :func:`rotary_projection_kernel` computes
the projection's tiles on the matrix units, each tile's columns as pairs (fed by per-thread loads, the
first members' weight rows, then the partners'; through tensor descriptors, the tile's consecutive
weight rows, whole heads in the half layout: value heads pair their rows as the layout pairs a rotated
head's), its reduction split as ``linear.py``'s, and rotates and stores in the epilogue: two launches,
as the norm and the projection were before, and no ``rope_kv_cache_write`` after them. Prefill chunks
whose projection takes tensor descriptors, and one or two rows of more than ``FUSED_INPUTS`` inputs,
lower to the projection into a workspace, then ``rope_kv_cache_write``.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.elementwise import rmsnorm_blocks, rmsnorm_row
from ignition.kernels.linear import (
    MULTIPROCESSORS,
    NARROW_TILE_ROWS,
    Tiles,
    check_projection,
    choose_tiles,
    describes,
    project,
    rotary_tiles,
    staged_input,
    waits_programmatically,
)
from ignition.kernels.lowering import LoweringContext, cdiv, lowering, next_power_of_two
from ignition.kernels.rotary import frequency_args, inverse_frequencies

SPLIT_POSITIONS = 64
"""Positions one attention program covers when a context is split."""

FUSED_INPUTS = 2048
"""The longest input rows the attention input projects, rotates and writes in one launch. Longer
rows (the 8B shape's 4096) were slower fused than apart on an H200 (docs/benchmarks.md)."""

MATRIX_PAIRS = 64
"""Column pairs of the rotating projection's matrix tiles of 128 columns (the ones ``choose_tiles`` hands out
from 65 rows on)."""

MIN_DOT_COLUMNS = 16
"""The fewest columns of a matrix-unit product (``tl.dot``): the rotating projection's column tiles are
``block_n / 2`` pairs, each half a product."""

TF32X3_PRODUCTS = True
"""Attention's two matrix products as three TF32 products each (float32 accuracy on the matrix
units), else as float32 FMAs (1.5 to 2.4 times slower on an H200, docs/benchmarks.md)."""

WIDE_SPLIT_POSITIONS = 256
"""Positions one attention program covers in a wide launch: one whose tokens and KV heads already give
every multiprocessor at least two programs (decode at 64 rows and more on the 1B shape, prefill
chunks). Splitting such a launch's usual contexts into 64-position programs only adds merges and
idle programs; 256-position splits still spread a long context over several programs."""

TILE_MIN_TOKENS = 64
"""The fewest tokens for which a node with at least two tokens a page-table row (prompt chunks, verified
proposals) runs as query tiles (:func:`attention_tile_kernel`) rather than per token."""

TILE_QUERY_ROWS = 64
"""Query rows of one tile for heads of up to 64 values: consecutive tokens times the KV head's query group
(padded to a power of two). Heads of more values take half as many (:func:`tile_kernel_config`)."""

OUTPUT_DTYPES = (mf.DTYPE_F32, mf.DTYPE_BF16, mf.DTYPE_F16)
"""Types attention may write its output rows in: float32, or rounded to nearest even at the store (a bf16 kernel
graph's output projection reads them in its weights' type)."""

SHORT_POSITIONS = 64
"""Contexts of at most this many positions are attended by one program per (token, KV head), unsplit.
Measured on an H200 (``benchmarks/attention_splits.py``, docs/benchmarks.md): each further block of
64 positions walked in one program costs about what a merge of splits costs, so contexts longer than
one split are split."""


@triton.jit  # type: ignore[misc, untyped-decorator]
def _split_extent(  # type: ignore[no-untyped-def]
    table_ptr,
    row_ptr,
    position_ptr,
    token,
    split,
    PAGE_TOKENS: tl.constexpr,
    TABLE_WIDTH: tl.constexpr,
    SPLIT: tl.constexpr,
    SHORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """(the token's row, the token's active splits, this split's
    positions ``start .. stop - 1`` (none for an idle split), the pages of its first block).

    With a window ``N`` the token attends positions ``max(position - N + 1, 0) .. position`` and its
    splits start at the first of them, so no page wholly before the window is named or read. A
    context of at most ``SHORT`` positions, and a padding token, is attended by split 0 alone; a longer
    one by the splits its positions reach. An idle split reads no page-table entry.
    """
    row = tl.load(row_ptr + token)
    position = tl.load(position_ptr + token)
    lowest = position * 0
    if WINDOW > 0:
        lowest = tl.maximum(position - (WINDOW - 1), 0)
    start = lowest + split * SPLIT
    short = (row < 0) | (position - lowest < SHORT)
    active = tl.cdiv(position + 1 - lowest, SPLIT)
    stop = position + 1
    if short:
        active = 1
    elif stop > start + SPLIT:
        stop = start + SPLIT
    if (row < 0) | (split >= active):
        stop = start
    offs = start + tl.arange(0, BLOCK_N)
    page = tl.load(table_ptr + row * TABLE_WIDTH + offs // PAGE_TOKENS, mask=offs < stop, other=0)
    return row, active, start, stop, page


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
    SHORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS_M: tl.constexpr,
    D_P: tl.constexpr,
    TF32X3: tl.constexpr,
    BF16_PLANES: tl.constexpr,
    WINDOW: tl.constexpr,
    SETTLED: tl.constexpr,
    ALONE_ONLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    if SETTLED:  # rows, positions and the page table: read before the wait (module docstring)
        row, active, start, stop, page = _split_extent(
            table_ptr, row_ptr, position_ptr, token, split, PAGE_TOKENS, TABLE_WIDTH, SPLIT, SHORT, BLOCK_N, WINDOW
        )
        if ALONE_ONLY:
            active = tl.where(_alone(row_ptr, token, row, tl.num_programs(0)), active, 0)
        # An idle split exits without waiting: split 0 of every token waits, so this launch still
        # completes only after its predecessor did.
        if USE_PDL:  # noqa: SIM102 (a compile-time constant and a tensor do not combine with ``and``)
            if (split < active) | (split == 0):
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row, active, start, stop, page = _split_extent(
            table_ptr, row_ptr, position_ptr, token, split, PAGE_TOKENS, TABLE_WIDTH, SPLIT, SHORT, BLOCK_N, WINDOW
        )
        if ALONE_ONLY:
            active = tl.where(_alone(row_ptr, token, row, tl.num_programs(0)), active, 0)
    if split < active:
        heads = tl.arange(0, HEADS_M)  # the group's query heads, padded to a matrix-product tile
        head_ok = heads < GROUP
        dims = tl.arange(0, D_P)
        dim_ok = dims < D
        q_rows = token * HEADS + kv * GROUP + heads
        q = tl.load(
            q_ptr + q_rows[:, None] * D + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :], other=0.0
        )  # [HEADS_M, D_P]
        q = q * scale
        running_max = tl.full([HEADS_M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([HEADS_M], dtype=tl.float32)
        acc = tl.zeros([HEADS_M, D_P], dtype=tl.float32)
        for block in range(0, tl.cdiv(stop - start, BLOCK_N)):
            offs = start + block * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = offs < stop
            following = offs + BLOCK_N  # the next block's pages, loaded ahead
            next_page = tl.load(
                table_ptr + row * TABLE_WIDTH + following // PAGE_TOKENS, mask=following < stop, other=0
            )
            slot = page.to(tl.int64) * PAGE_TOKENS + (offs % PAGE_TOKENS)
            address = (slot * KV_HEADS + kv)[:, None] * D + dims[None, :]
            kv_ok = ok[:, None] & dim_ok[None, :]
            keys = _plane_rows(k_ptr + address, kv_ok, BF16_PLANES)  # [BLOCK_N, D_P]
            values = _plane_rows(v_ptr + address, kv_ok, BF16_PLANES)
            scores = _product(q, tl.trans(keys), TF32X3, BF16_PLANES)  # [HEADS_M, BLOCK_N]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            running_max, running_sum, acc = _online_softmax(
                running_max, running_sum, acc, scores, values, TF32X3, BF16_PLANES
            )
            page = next_page
        mine = head_ok[:, None] & dim_ok[None, :]
        if active == 1:  # one split: its sums are the result
            total = tl.where(running_sum > 0.0, running_sum, 1.0)
            result = tl.where(running_sum[:, None] > 0.0, acc / total[:, None], 0.0)
            tl.store(out_ptr + q_rows[:, None] * D + dims[None, :], result.to(out_ptr.dtype.element_ty), mask=mine)
        else:
            out_index = q_rows * SPLITS + split
            tl.store(max_ws + out_index, running_max, mask=head_ok)
            tl.store(sum_ws + out_index, running_sum, mask=head_ok)
            tl.store(acc_ws + out_index[:, None] * D + dims[None, :], acc, mask=mine)
            # The last active split of this (token, KV head) to finish merges them: every program's
            # partials are stored before its counter increment (barrier, then a release), the merger
            # reads them after its acquire, past L1, and resets the counter for the next launch.
            tl.debug_barrier()
            counter = count_ws + token * KV_HEADS + kv
            finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if finished == active - 1:
                _merge_splits(
                    max_ws, sum_ws, acc_ws, out_ptr, token * HEADS + kv * GROUP, active, GROUP, GROUP_P2, D, SPLITS,
                    SPLITS_P2,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit  # type: ignore[misc, untyped-decorator]
def _alone(row_ptr, token, row, tokens):  # type: ignore[no-untyped-def]
    """Whether ``token`` (of ``tokens``, its row ``row``) is the only one of its row among its neighbours: a
    decode lane beside prompt chunks, whose tokens lie one after another. Padding (a negative row) is not."""
    before = tl.load(row_ptr + token - 1, mask=(token > 0) & (token - 1 < tokens), other=-2)
    after = tl.load(row_ptr + token + 1, mask=token + 1 < tokens, other=-2)
    return (row >= 0) & (before != row) & (after != row)


@triton.jit  # type: ignore[misc, untyped-decorator]
def _plane_rows(pointers, mask, BF16_PLANES: tl.constexpr):  # type: ignore[no-untyped-def]
    """Key or value rows of a cache plane: bfloat16 planes' rows as they are (the products take them
    exactly), float32 ones as float32."""
    rows = tl.load(pointers, mask=mask, other=0.0)
    if not BF16_PLANES:
        rows = rows.to(tl.float32)
    return rows


@triton.jit  # type: ignore[misc, untyped-decorator]
def _product(a, b, TF32X3: tl.constexpr, BF16_B: tl.constexpr):  # type: ignore[no-untyped-def]
    """``a @ b`` for float32 ``a`` on the matrix units. With ``BF16_B`` (``b`` holds bfloat16 values, which
    are exact): ``a`` split into a bfloat16 head and the bfloat16 rounding of its remainder, two bfloat16
    products accumulated in float32 (16 of ``a``'s mantissa bits, a relative error of at most about
    ``2**-16`` a product, against float32 rounding for the other forms); else three TF32 products
    (float32 accuracy), or FMAs."""
    if BF16_B:
        head = a.to(tl.bfloat16)
        tail = (a - head.to(tl.float32)).to(tl.bfloat16)
        product = tl.dot(tail, b, tl.dot(head, b))
    elif TF32X3:
        product = tl.dot(a, b, input_precision="tf32x3")
    else:
        product = tl.dot(a, b, input_precision="ieee")
    return product


@triton.jit  # type: ignore[misc, untyped-decorator]
def _online_softmax(running_max, running_sum, acc, scores, values, TF32X3: tl.constexpr, BF16_PLANES: tl.constexpr):  # type: ignore[no-untyped-def]
    """One block of keys folded into the running (maximum, sum, unnormalised output) of each query row;
    masked scores are ``-inf`` (a row with none yet keeps zero sums)."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.exp(running_max - safe_max)
    weights = tl.exp(scores - safe_max[:, None])
    running_sum = running_sum * correction + tl.sum(weights, axis=1)
    acc = acc * correction[:, None] + _product(weights, values, TF32X3, BF16_PLANES)
    return new_max, running_sum, acc


@triton.jit  # type: ignore[misc, untyped-decorator]
def _merge_splits(  # type: ignore[no-untyped-def]
    max_ws,
    sum_ws,
    acc_ws,
    out_ptr,
    first_row,
    active,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Writes the group's output rows ``first_row ..`` from the partials of its ``active`` splits."""
    heads = tl.arange(0, GROUP_P2)
    head_ok = heads < GROUP
    dims = tl.arange(0, D)
    rows = first_row + heads
    splits = tl.arange(0, SPLITS_P2)
    both = head_ok[:, None] & (splits < active)[None, :]
    index = rows[:, None] * SPLITS + splits[None, :]  # [GROUP_P2, SPLITS_P2]
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
    tl.store(out_ptr + rows[:, None] * D + dims[None, :], result.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit  # type: ignore[misc, untyped-decorator]
def attention_tile_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    row_ptr,
    position_ptr,
    out_ptr,
    scale,
    TOKENS: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    TABLE_WIDTH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_P: tl.constexpr,
    TF32X3: tl.constexpr,
    BF16_PLANES: tl.constexpr,
    WINDOW: tl.constexpr,
    SETTLED: tl.constexpr,
    SKIP_ALONE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Attention of ``BLOCK_T`` consecutive tokens and one KV head's query group in one program.

    The tile's ``BLOCK_T * GROUP_P2`` query rows (token-major) attend each cache row of the block's
    tokens in turn: for the lowest row not yet done, every token of that row attends the positions
    from the lowest first position to the highest position among them, each masked to its own
    ``lowest .. position``, so the keys and values of a prompt chunk's positions are read once per
    tile rather than once per token. Padding tokens (negative row) get zero output. With ``SKIP_ALONE`` a
    token alone in its row among its neighbours (:func:`_alone`) is left to the split kernel's launch
    beside this one.
    """
    # KV heads vary fastest and the tiles run last first: a prompt's later tokens attend the most positions,
    # so the longest programs start first and the short ones fill in behind them.
    kv = tl.program_id(0)
    block = tl.num_programs(1) - 1 - tl.program_id(1)
    M: tl.constexpr = BLOCK_T * GROUP_P2
    lanes = tl.arange(0, M)
    token = block * BLOCK_T + lanes // GROUP_P2
    head = lanes % GROUP_P2
    valid = (token < TOKENS) & (head < GROUP)
    if SETTLED:
        rows = tl.load(row_ptr + token, mask=valid, other=-1)
        positions = tl.load(position_ptr + token, mask=valid, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not SETTLED:
        rows = tl.load(row_ptr + token, mask=valid, other=-1)
        positions = tl.load(position_ptr + token, mask=valid, other=0)
    lowest = positions * 0
    if WINDOW > 0:
        lowest = tl.maximum(positions - (WINDOW - 1), 0)
    dims = tl.arange(0, D_P)
    dim_ok = dims < D
    q_rows = token * HEADS + kv * GROUP + head
    addresses = q_rows[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + addresses, mask=valid[:, None] & dim_ok[None, :], other=0.0) * scale  # [M, D_P]
    padding = (valid & (rows < 0))[:, None] & dim_ok[None, :]
    tl.store(out_ptr + addresses, tl.zeros([M, D_P], dtype=out_ptr.dtype.element_ty), mask=padding)
    done = rows < 0
    if SKIP_ALONE:
        done = done | (valid & _alone(row_ptr, token, rows, TOKENS))
    none = 2147483647
    current = tl.min(tl.where(done, none, rows), axis=0)
    while current != none:
        mine = (rows == current) & (~done)
        first = tl.min(tl.where(mine, lowest, none), axis=0)
        last = tl.max(tl.where(mine, positions, -1), axis=0)
        running_max = tl.full([M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([M], dtype=tl.float32)
        acc = tl.zeros([M, D_P], dtype=tl.float32)
        table_row = table_ptr + current * TABLE_WIDTH
        leading = first + tl.arange(0, BLOCK_N)
        page = tl.load(table_row + leading // PAGE_TOKENS, mask=leading <= last, other=0)
        for start in range(first, last + 1, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            ok = offs <= last
            following = offs + BLOCK_N  # the next block's pages, loaded ahead
            next_page = tl.load(table_row + following // PAGE_TOKENS, mask=following <= last, other=0)
            slot = page.to(tl.int64) * PAGE_TOKENS + (offs % PAGE_TOKENS)
            kv_address = (slot * KV_HEADS + kv)[:, None] * D + dims[None, :]
            kv_ok = ok[:, None] & dim_ok[None, :]
            keys = _plane_rows(k_ptr + kv_address, kv_ok, BF16_PLANES)  # [BLOCK_N, D_P]
            values = _plane_rows(v_ptr + kv_address, kv_ok, BF16_PLANES)
            scores = _product(q, tl.trans(keys), TF32X3, BF16_PLANES)  # [M, BLOCK_N]
            allowed = (
                mine[:, None] & ok[None, :] & (offs[None, :] <= positions[:, None]) & (offs[None, :] >= lowest[:, None])
            )
            scores = tl.where(allowed, scores, float("-inf"))
            running_max, running_sum, acc = _online_softmax(
                running_max, running_sum, acc, scores, values, TF32X3, BF16_PLANES
            )
            page = next_page
        total = tl.where(running_sum > 0.0, running_sum, 1.0)
        result = tl.where(running_sum[:, None] > 0.0, acc / total[:, None], 0.0)
        stored = (mine & valid)[:, None] & dim_ok[None, :]
        tl.store(out_ptr + addresses, result.to(out_ptr.dtype.element_ty), mask=stored)
        done = done | mine
        current = tl.min(tl.where(done, none, rows), axis=0)


@lowering("paged_attention")
def lower_paged_attention(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    return attention_launches(ctx, node)


def attention_launches(
    ctx: LoweringContext,
    node: mf.Node,
    *,
    short_positions: int | None = None,
    tf32x3: bool | None = None,
    split_positions: int | None = None,
    tiled: bool | None = None,
    split_config: tuple[int, int, int] | None = None,
    tile_config: tuple[int, int, int, int] | None = None,
) -> list[mf.KernelLaunch]:
    """The launch of one ``paged_attention`` node; ``short_positions`` (default :data:`SHORT_POSITIONS`)
    is the longest context one program per (token, KV head) attends unsplit, ``tf32x3`` (default
    :data:`TF32X3_PRODUCTS`) how its two matrix products run, ``split_positions`` the positions of one
    split (default :data:`SPLIT_POSITIONS`, :data:`WIDE_SPLIT_POSITIONS` for a wide launch), ``tiled``
    whether the query tiles of :func:`attention_tile_kernel` run instead (default: when the node has at
    least :data:`TILE_MIN_TOKENS` tokens and two a page-table row, as a prompt chunk has), ``split_config``
    the split kernel's ``(num_warps, num_stages, BLOCK_N)`` (default :func:`split_kernel_config`),
    ``tile_config`` the tile kernel's ``(BLOCK_T, BLOCK_N, num_warps, num_stages)`` (default
    :func:`tile_kernel_config`)."""
    short = SHORT_POSITIONS if short_positions is None else short_positions
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
    if ctx.dtype(q) != mf.DTYPE_F32:
        raise ctx.fail("q must be float32")
    if ctx.dtype(out) not in OUTPUT_DTYPES:
        raise ctx.fail("out must be float32, bf16 or f16 (rounded to nearest even at the store)")
    _check_plane_dtypes(ctx, k_plane, v_plane)
    for view, name in ((table, "page_table"), (rows, "token_row"), (positions, "token_position")):
        if ctx.dtype(view) != mf.DTYPE_I32:
            raise ctx.fail(f"{name} must be int32")
    window = ctx.attribute(node, "window", 0)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ctx.fail(f"window must be 0 (unlimited) or a positive integer, got {window!r}")
    group = heads // kv_heads
    scale = float(ctx.attribute(node, "scale", 1.0 / math.sqrt(head_dim)))
    pointers = {
        "q_ptr": ctx.pointer(q),
        "k_ptr": ctx.pointer(k_plane),
        "v_ptr": ctx.pointer(v_plane),
        "table_ptr": ctx.pointer(table),
        "row_ptr": ctx.pointer(rows),
        "position_ptr": ctx.pointer(positions),
    }
    constants = {
        "HEADS": heads,
        "KV_HEADS": kv_heads,
        "GROUP": group,
        "GROUP_P2": next_power_of_two(group),
        "D": head_dim,
        "PAGE_TOKENS": page_tokens,
        "TABLE_WIDTH": width,
        "D_P": max(16, head_dim),
        "TF32X3": TF32X3_PRODUCTS if tf32x3 is None else tf32x3,
        "BF16_PLANES": ctx.dtype(k_plane) == mf.DTYPE_BF16,
        "WINDOW": window,
        "SETTLED": ctx.settled(table, rows, positions),
    }
    if tiled is None:
        tiled = tokens >= max(TILE_MIN_TOKENS, 2 * table_shape[0])
    span = width * page_tokens
    reach = min(span, window) if window else span  # the most positions one token attends

    def split_launch(alone_only: bool) -> mf.KernelLaunch:
        """The split kernel's launch; with ``alone_only`` only the tokens alone in their row among their
        neighbours attend (the tile launch before it takes the others)."""
        wide = tokens * kv_heads >= 2 * MULTIPROCESSORS
        positions_a_split = split_positions
        if positions_a_split is None:
            positions_a_split = WIDE_SPLIT_POSITIONS if wide else SPLIT_POSITIONS
        split = min(positions_a_split, next_power_of_two(reach))
        splits = cdiv(reach, split)
        max_ws = ctx.workspace("attention_max", mf.DTYPE_F32, tokens * heads * splits)
        sum_ws = ctx.workspace("attention_sum", mf.DTYPE_F32, tokens * heads * splits)
        acc_ws = ctx.workspace("attention_acc", mf.DTYPE_F32, tokens * heads * splits * head_dim)
        # zero at allocation; every launch leaves each counter at zero again
        count_ws = ctx.workspace("attention_splits_done", mf.DTYPE_I32, tokens * kv_heads)
        arguments = {
            **pointers,
            "max_ws": ctx.pointer(max_ws),
            "sum_ws": ctx.pointer(sum_ws),
            "acc_ws": ctx.pointer(acc_ws),
            "count_ws": ctx.pointer(count_ws),
            "out_ptr": ctx.pointer(out),
            "scale": ctx.f32(scale),
        }
        warps, stages, block_n = split_config or split_kernel_config(split, head_dim, wide=wide)
        split_constants = constants | {
            "SPLITS": splits,
            "SPLITS_P2": next_power_of_two(splits),
            "SPLIT": split,
            "SHORT": max(split, min(short, reach)),
            "HEADS_M": max(16, next_power_of_two(group)),
            "BLOCK_N": block_n,
            "ALONE_ONLY": alone_only,
        }
        grid = (tokens, kv_heads, splits)
        return ctx.launch(attention_split_kernel, arguments, split_constants, grid, num_warps=warps, num_stages=stages)

    if not tiled:
        return [split_launch(alone_only=False)]
    block_t, block_n, warps, stages = tile_config or tile_kernel_config(group, head_dim)
    arguments = {**pointers, "out_ptr": ctx.pointer(out), "scale": ctx.f32(scale)}
    # A mixed program's decode lanes (one token of a row each) go to the split kernel: a tile of them would
    # attend their rows one after another.
    mixed = ctx.operation == ct.OPERATION_MIXED
    tile_constants = constants | {"TOKENS": tokens, "BLOCK_T": block_t, "BLOCK_N": block_n, "SKIP_ALONE": mixed}
    grid = (kv_heads, cdiv(tokens, block_t))
    tile = ctx.launch(attention_tile_kernel, arguments, tile_constants, grid, num_warps=warps, num_stages=stages)
    return [tile, split_launch(alone_only=True)] if mixed else [tile]


def tile_kernel_config(group: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_N, num_warps, num_stages)`` of the tile kernel: ``TILE_QUERY_ROWS`` query rows (tokens
    times the group padded to a power of two; half as many for heads over 64 values), blocks of 64 positions,
    four warps, three stages. Measured on an H200 (``benchmarks/attention_splits.py --chunk 512``,
    docs/benchmarks.md), a 512-token chunk a layer: the 1B shape 23.4 us (32.0 with the eight warps and, for
    heads over 64 values, 32-position blocks taken before), the 8B shape 31.8 us (51.4 before). Tiles of 128
    query rows on eight warps ran level for the 1B shape (22.7 us) and are not taken: the fewer tokens a tile
    has, the shorter the walk of a tile whose tokens belong to several rows (decode lanes beside a prompt
    chunk), which attends one row after another."""
    rows = TILE_QUERY_ROWS if head_dim <= 64 else TILE_QUERY_ROWS // 2
    return max(1, rows // next_power_of_two(group)), 64, 4, 3


def split_kernel_config(split: int, head_dim: int, *, wide: bool = False) -> tuple[int, int, int]:
    """``(num_warps, num_stages, BLOCK_N)`` of the split kernel: two stages, blocks of up to 64 positions (32
    for heads over 64), at least 16 and at most the split; four warps, two for a ``wide`` launch (tokens and KV
    heads giving every multiprocessor at least two programs before any split). Measured on an H200
    (``benchmarks/attention_splits.py --rows 64,256 --cache-dtype bf16``, docs/benchmarks.md), a wide launch's
    programs are short walks that many programs run side by side: two warps each took the 8B shape at 64 rows
    from 12.0 / 17.8 / 49.2 us a layer (contexts 96 / 160 / 512) to 10.6 / 15.0 / 42.9, the 1B shape at 256 rows
    from 26.1 / 35.3 / 93.9 to 23.8 / 32.8 / 86.8, and left the 1B shape at 64 rows (8.3 / 11.4 / 28.6 against
    8.6 / 11.5 / 27.0) and the 8B shape at 256 rows (36.8 / 55.5 / 162.6 against 38.3 / 54.9 / 163.2) level."""
    return 2 if wide else 4, 2, max(16, min(split, 64 if head_dim <= 64 else 32))


CACHE_PLANE_DTYPES = (mf.DTYPE_F32, mf.DTYPE_BF16)
"""Storage types of key and value cache planes: the cache writes round the rotated keys and the values to
the plane's type (nearest, ties to even, as the reference); attention multiplies bfloat16 rows as they are
and float32 rows as float32 (module docstring)."""


def _check_plane_dtypes(ctx: LoweringContext, k_plane: mf.BufferView, v_plane: mf.BufferView) -> None:
    dtypes = (ctx.dtype(k_plane), ctx.dtype(v_plane))
    if dtypes[0] != dtypes[1] or dtypes[0] not in CACHE_PLANE_DTYPES:
        raise ctx.fail("k_plane and v_plane must both be float32 or both bfloat16")


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
    TOKENS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    D: tl.constexpr,
    HALF_PAIRS: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``BLOCK_T`` consecutive tokens a program, as ``[tokens, heads, pairs]`` tensors: the float64 angles,
    cosines and sines of all of them at once rather than one token's after another's; then the query heads,
    the key heads and the value heads each in a tensor of their own count (padded to a power of two), so no
    lanes go to the padding of their sum."""
    # Inverse frequencies, angles, cos and sin in float64 (the ``*_bits`` are float64 bit patterns),
    # the rotation in float32, as the reference computes them.
    pairs = tl.arange(0, D // 2)
    inv_freq = inverse_frequencies(pairs, D, log2_theta_bits, factor_bits, low_bits, high_bits, original_bits, SCALED)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < TOKENS
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    position = tl.load(position_ptr + tokens, mask=token_ok, other=0)
    angle = position.to(tl.float64)[:, None] * inv_freq[None, :]  # [BLOCK_T, D / 2]
    cos = tl.cos(angle).to(tl.float32)[:, None, :]
    sin = tl.sin(angle).to(tl.float32)[:, None, :]
    slot = tl.load(slot_ptr + tokens, mask=token_ok, other=-1)[:, None, None]
    rows = tokens.to(tl.int64)[:, None, None]
    packed = qkv_ptr + rows * ((HEADS + 2 * KV_HEADS) * D)
    if HALF_PAIRS:
        first_index = pairs[None, None, :]
        second_index = pairs[None, None, :] + D // 2
    else:
        first_index = 2 * pairs[None, None, :]
        second_index = 2 * pairs[None, None, :] + 1
    heads = tl.arange(0, HEADS_P2)[None, :, None]
    is_q = token_ok[:, None, None] & (heads < HEADS)
    q_in = packed + heads * D
    q_out = q_ptr + rows * (HEADS * D) + heads * D
    _rotate_pairs(q_in, q_out, first_index, second_index, cos, sin, is_q)
    # a negative slot writes no cache
    kv_heads = tl.arange(0, KV_HEADS_P2)[None, :, None]
    is_k = token_ok[:, None, None] & (kv_heads < KV_HEADS) & (slot >= 0)
    k_in = packed + (HEADS + kv_heads) * D
    k_out = k_ptr + (slot * KV_HEADS + kv_heads) * D
    _rotate_pairs(k_in, k_out, first_index, second_index, cos, sin, is_k)
    dims = tl.arange(0, D)[None, None, :]
    values = tl.load(packed + (HEADS + KV_HEADS + kv_heads) * D + dims, mask=is_k, other=0.0)
    tl.store(v_ptr + (slot * KV_HEADS + kv_heads) * D + dims, values, mask=is_k)


@triton.jit  # type: ignore[misc, untyped-decorator]
def _rotate_pairs(src, dst, first_index, second_index, cos, sin, ok):  # type: ignore[no-untyped-def]
    """Rotate the pairs ``(src[first_index], src[second_index])`` by the angles of ``cos`` and ``sin`` into
    the same places of ``dst`` (rounded to ``dst``'s type at the store) where ``ok``."""
    first = tl.load(src + first_index, mask=ok, other=0.0)
    second = tl.load(src + second_index, mask=ok, other=0.0)
    tl.store(dst + first_index, first * cos - second * sin, mask=ok)
    tl.store(dst + second_index, first * sin + second * cos, mask=ok)


ROPE_ELEMENTS = 8192
"""Rotated values (tokens x heads padded to a power of two x pairs) one ``rope_kv_cache_write`` program
takes (see :func:`rope_tokens`)."""


def rope_tokens(tokens: int, rotated_heads: int, head_dim: int) -> int:
    """Tokens one ``rope_kv_cache_write`` program rotates: as many as keep its tensors within
    ``ROPE_ELEMENTS`` values (a power of two, at least one, at most the node's tokens rounded up to one)."""
    per_token = next_power_of_two(rotated_heads) * max(1, head_dim // 2)
    return max(1, min(next_power_of_two(tokens), ROPE_ELEMENTS // per_token))


def _rope_cache_geometry(ctx: LoweringContext, node: mf.Node, packed_width: int) -> tuple[int, int, int, int]:
    """(tokens, heads, kv heads, head dim) of a rope + cache-write node whose packed rows hold
    ``packed_width`` values; checks the query, plane, position and slot views and the style.

    Raises:
        the context's lowering error for a shape, dtype or style the kernels do not take.
    """
    positions, slots = ctx.need(node, "positions"), ctx.need(node, "slots")
    q, k_plane, v_plane = ctx.need(node, "q"), ctx.need(node, "k_plane"), ctx.need(node, "v_plane")
    tokens, heads, head_dim = _three(ctx, q, "q")
    plane = ctx.buffer_shape(k_plane)
    if len(plane) != 4 or ctx.buffer_shape(v_plane) != plane or plane[3] != head_dim:
        raise ctx.fail(f"cache planes {list(plane)} do not hold heads of {head_dim}")
    kv_heads = plane[2]
    if packed_width != (heads + 2 * kv_heads) * head_dim:
        raise ctx.fail(f"packed rows hold {packed_width} values, not {(heads + 2 * kv_heads) * head_dim}")
    if head_dim != next_power_of_two(head_dim) or head_dim < 2:
        raise ctx.fail(f"head_dim {head_dim} must be a power of two")
    if ctx.dtype(q) != mf.DTYPE_F32:
        raise ctx.fail("q must be float32")
    _check_plane_dtypes(ctx, k_plane, v_plane)
    if ctx.dtype(positions) != mf.DTYPE_I32 or ctx.dtype(slots) != mf.DTYPE_I64:
        raise ctx.fail("positions must be int32 and slots int64")
    style = ctx.attribute(node, "style", "")
    if style not in ("half", "interleaved"):
        raise ctx.fail(f"rope style must be 'half' or 'interleaved', got {style!r}")
    return tokens, heads, kv_heads, head_dim


@lowering("rope_kv_cache_write")
def lower_rope_kv_cache_write(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    qkv, positions, slots = ctx.need(node, "qkv"), ctx.need(node, "positions"), ctx.need(node, "slots")
    q, k_plane, v_plane = ctx.need(node, "q"), ctx.need(node, "k_plane"), ctx.need(node, "v_plane")
    qkv_shape = ctx.shape(qkv)
    tokens, heads, kv_heads, head_dim = _rope_cache_geometry(ctx, node, math.prod(qkv_shape[1:]))
    if qkv_shape[0] != tokens:
        raise ctx.fail(f"qkv {list(qkv_shape)} must hold {tokens} rows")
    if ctx.dtype(qkv) != mf.DTYPE_F32:
        raise ctx.fail("qkv must be float32")
    style = ctx.attribute(node, "style", "")
    frequencies, scaled = frequency_args(ctx, node)
    block_t = rope_tokens(tokens, heads + kv_heads, head_dim)
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
            "TOKENS": tokens,
            "BLOCK_T": block_t,
            "HEADS": heads,
            "KV_HEADS": kv_heads,
            "HEADS_P2": next_power_of_two(heads),
            "KV_HEADS_P2": next_power_of_two(kv_heads),
            "D": head_dim,
            "HALF_PAIRS": style == "half",
            "SCALED": scaled,
        },
        (cdiv(tokens, block_t),),
        num_warps=8 if block_t > 1 else 4,
        num_stages=1,
    )
    return [launch]


@triton.jit  # type: ignore[misc, untyped-decorator]
def _attention_input_rows(  # type: ignore[no-untyped-def]
    tile,
    lanes,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    PAIRS: tl.constexpr,
    ROTATING: tl.constexpr,
    HALF_PAIRS: tl.constexpr,
):
    """(first rows, partner rows, pair index within the head) of column tile ``tile``."""
    pair = tile * PAIRS + lanes
    within = pair % (D // 2)
    if HALF_PAIRS:
        rotated_first = (pair // (D // 2)) * D + within
        rotated_second = rotated_first + D // 2
    else:
        rotated_first = (pair // (D // 2)) * D + 2 * within
        rotated_second = rotated_first + 1
    value_first = (HEADS + KV_HEADS) * D + (tile - ROTATING) * 2 * PAIRS + lanes
    first = tl.where(tile < ROTATING, rotated_first, value_first)
    second = tl.where(tile < ROTATING, rotated_second, value_first + PAIRS)
    return first, second, within


@triton.jit  # type: ignore[misc, untyped-decorator]
def attention_input_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    norm_ptr,
    position_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    eps,
    rows,
    log2_theta_bits,
    factor_bits,
    low_bits,
    high_bits,
    original_bits,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    ROWS_P2: tl.constexpr,
    PAIRS: tl.constexpr,
    ROTATING: tl.constexpr,
    TILES: tl.constexpr,
    PROGRAMS: tl.constexpr,
    HALF_PAIRS: tl.constexpr,
    SCALED: tl.constexpr,
    SETTLED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """rmsnorm, the packed projection, rotation and cache write of one or two tokens (module docstring).

    Column tiles below ``ROTATING`` hold ``PAIRS`` rotation pairs of the query and key rows, the
    others ``2 * PAIRS`` value rows; program ``p`` computes tiles ``p, p + PROGRAMS, ...`` over whole
    weight rows, as the streaming projection does (``linear.py``): its first tile loads before
    ``gdc_wait``, each next tile before the current one is reduced. Settled positions and slots are
    read before the wait too.
    """
    pid = tl.program_id(0)
    lanes = tl.arange(0, PAIRS)
    ks = tl.arange(0, K_P2)
    k_ok = ks[None, :] < K
    first, second, within = _attention_input_rows(pid, lanes, HEADS, KV_HEADS, D, PAIRS, ROTATING, HALF_PAIRS)
    w_first = tl.load(w_ptr + first[:, None] * K + ks[None, :], mask=k_ok, other=0.0)
    w_second = tl.load(w_ptr + second[:, None] * K + ks[None, :], mask=k_ok, other=0.0)
    offs_r = tl.arange(0, ROWS_P2)
    r_ok = offs_r < rows
    # PROGRAMS * PAIRS is a multiple of D / 2 (or each program has one tile): every tile of this program
    # rotates the same pairs, so its factors are computed once.
    inv_freq = inverse_frequencies(within, D, log2_theta_bits, factor_bits, low_bits, high_bits, original_bits, SCALED)
    if SETTLED:
        cos, sin, slot = _rotation(position_ptr, slot_ptr, offs_r, r_ok, inv_freq)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not SETTLED:
        cos, sin, slot = _rotation(position_ptr, slot_ptr, offs_r, r_ok, inv_freq)
    xs = tl.load(x_ptr + offs_r[:, None] * K + ks[None, :], mask=r_ok[:, None] & k_ok, other=0.0)
    scale = (1.0 / tl.sqrt(tl.sum(xs * xs, axis=1) / K + eps))[:, None]
    xs = xs * tl.load(norm_ptr + ks, mask=ks < K, other=0.0)[None, :]
    cached = r_ok[:, None] & (slot >= 0)[:, None]
    slot_base = slot[:, None] * (KV_HEADS * D)
    q_rows = q_ptr + offs_r[:, None] * (HEADS * D)
    for step in range(0, tl.cdiv(TILES, PROGRAMS)):  # past the last tile: all masked
        tile = pid + step * PROGRAMS
        live = tile < TILES
        next_first, next_second, _ = _attention_input_rows(
            tile + PROGRAMS, lanes, HEADS, KV_HEADS, D, PAIRS, ROTATING, HALF_PAIRS
        )
        ahead = k_ok & (tile + PROGRAMS < TILES)
        following_first = tl.load(w_ptr + next_first[:, None] * K + ks[None, :], mask=ahead, other=0.0)
        following_second = tl.load(w_ptr + next_second[:, None] * K + ks[None, :], mask=ahead, other=0.0)
        a = tl.sum(w_first.to(tl.float32)[None, :, :] * xs[:, None, :], axis=2) * scale  # [ROWS_P2, PAIRS]
        b = tl.sum(w_second.to(tl.float32)[None, :, :] * xs[:, None, :], axis=2) * scale
        _store_rotated(
            a, b, cos, sin, tile < ROTATING, first, second, r_ok[:, None] & live, q_rows, cached & live, slot_base,
            k_ptr, v_ptr, HEADS, KV_HEADS, D,
        )  # fmt: skip
        w_first, w_second = following_first, following_second
        first, second = next_first, next_second


@triton.jit  # type: ignore[misc, untyped-decorator]
def _store_rotated(  # type: ignore[no-untyped-def]
    a,
    b,
    cos,
    sin,
    rotating,
    first,
    second,
    rows_ok,
    q_rows,
    cached,
    slot_base,
    k_ptr,
    v_ptr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
):
    """Rotate the sums ``a`` (columns ``first``) and ``b`` (their partners ``second``) of a tile of rows when
    ``rotating`` (query and key pairs; value rows are stored as they are), then store the query columns to
    the rows at ``q_rows`` and the key and value columns to the planes at ``slot_base`` where ``cached``."""
    out_first, out_second = _rotated(a, b, cos, sin, rotating)
    is_value = first >= (HEADS + KV_HEADS) * D
    q_mask = rows_ok & (first < HEADS * D)[None, :]
    tl.store(q_rows + first[None, :], out_first, mask=q_mask)
    tl.store(q_rows + second[None, :], out_second, mask=q_mask)
    k_mask = cached & ((first >= HEADS * D) & ~is_value)[None, :]
    tl.store(k_ptr + slot_base + (first - HEADS * D)[None, :], out_first, mask=k_mask)
    tl.store(k_ptr + slot_base + (second - HEADS * D)[None, :], out_second, mask=k_mask)
    v_mask = cached & is_value[None, :]
    tl.store(v_ptr + slot_base + (first - (HEADS + KV_HEADS) * D)[None, :], out_first, mask=v_mask)
    tl.store(v_ptr + slot_base + (second - (HEADS + KV_HEADS) * D)[None, :], out_second, mask=v_mask)


@triton.jit  # type: ignore[misc, untyped-decorator]
def _rotated(a, b, cos, sin, rotating):  # type: ignore[no-untyped-def]
    """The pairs ``(a, b)`` rotated by the angles of ``cos`` and ``sin`` where ``rotating``, else as they are."""
    return tl.where(rotating, a * cos - b * sin, a), tl.where(rotating, a * sin + b * cos, b)


@triton.jit  # type: ignore[misc, untyped-decorator]
def _store_columns(  # type: ignore[no-untyped-def]
    out, column, rows_ok, q_rows, cached, slot_base, k_ptr, v_ptr,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Store a tile of rows' packed ``[q | k | v]`` columns ``column`` (rotated already): the query columns to
    the rows at ``q_rows`` where ``rows_ok``, the key and value columns to the planes at ``slot_base`` where
    ``cached``; columns past the value heads are not stored."""
    is_key = (column >= HEADS * D) & (column < (HEADS + KV_HEADS) * D)
    is_value = (column >= (HEADS + KV_HEADS) * D) & (column < (HEADS + 2 * KV_HEADS) * D)
    tl.store(q_rows + column[None, :], out, mask=rows_ok & (column < HEADS * D)[None, :])
    tl.store(k_ptr + slot_base + (column - HEADS * D)[None, :], out, mask=cached & is_key[None, :])
    tl.store(v_ptr + slot_base + (column - (HEADS + KV_HEADS) * D)[None, :], out, mask=cached & is_value[None, :])


@triton.jit  # type: ignore[misc, untyped-decorator]
def _rotation(position_ptr, slot_ptr, offs_r, r_ok, inv_freq):  # type: ignore[no-untyped-def]
    """(cos, sin, slot) of each token: angles, cos and sin in float64, as the reference, then float32."""
    angle = tl.load(position_ptr + offs_r, mask=r_ok, other=0).to(tl.float64)[:, None] * inv_freq[None, :]
    slot = tl.load(slot_ptr + offs_r, mask=r_ok, other=-1)
    return tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32), slot


@triton.jit  # type: ignore[misc, untyped-decorator]
def rotary_input_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    norm_ptr,
    out_ptr,
    position_ptr,
    factor_ptr,
    eps,
    log2_theta_bits,
    factor_bits,
    low_bits,
    high_bits,
    original_bits,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    WEIGHT_EARLY: tl.constexpr,
    D: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Row ``program_id(0)`` of the rotating projection's inputs: its RMS norm staged as ``rmsnorm``
    stages it (:func:`rmsnorm_row`), and its rotation factors, the cos of each pair's angle then its sin
    (``D`` values; angles, cos and sin in float64 as the reference, stored in float32)."""
    row = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, D // 2)
    inv_freq = inverse_frequencies(pairs, D, log2_theta_bits, factor_bits, low_bits, high_bits, original_bits, SCALED)
    rmsnorm_row(
        x_ptr + row * HIDDEN, norm_ptr, out_ptr + row * HIDDEN, eps, HIDDEN, BLOCK, SINGLE, WEIGHT_EARLY, USE_PDL
    )
    angle = tl.load(position_ptr + row).to(tl.float64) * inv_freq
    tl.store(factor_ptr + row * D + pairs, tl.cos(angle).to(tl.float32))
    tl.store(factor_ptr + row * D + D // 2 + pairs, tl.sin(angle).to(tl.float32))


@triton.jit  # type: ignore[misc, untyped-decorator]
def rotary_projection_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    partial_ptr,
    counter_ptr,
    factor_ptr,
    rows,
    K: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    K_SPLIT: tl.constexpr,
    HALF_PAIRS: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The packed ``[q | k | v]`` projection of a ``BLOCK_M``-row tile of staged inputs on the matrix units,
    rotated and written to the query rows and the cache planes in its epilogue (module docstring).

    Column tile ``program_id(1)`` holds ``PAIRS`` column pairs (:func:`_rotary_pairs`: rotation pairs of
    the query and key heads, however many heads that spans, then pairs of value rows). Fed by per-thread
    loads, each reduction step loads the weight rows of the first members, then those of their partners,
    as one ``2 * PAIRS``-row block and multiplies it with the input tile in one product, whose accumulator
    is then split into the first members' and the partners' sums. With ``DESCRIPTORS`` the copy engine
    moves the input tile and the tile's ``2 * PAIRS`` consecutive weight rows into shared memory (whole heads
    in the half layout: ``D`` divides ``2 * PAIRS``), one product a step, and the epilogue takes each
    pair's two columns out of the accumulator as the layout orders them. Either way each pair's sums meet
    in one thread; in the interleaved layout the tile's pairs are its ``2 * PAIRS`` consecutive columns, so
    the rotated results are joined back in order and stored as runs of columns. With ``SPLIT`` > 1 the
    reduction is split as ``projection_kernel``'s (``linear.py``): each split stores its partial sums, and
    the last of a tile to finish adds them in split order, rotates and stores. Each row's cos and sin
    come from ``factor_ptr`` (:func:`rotary_input_kernel`), computed once a row rather than once a column
    tile.
    """
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if DESCRIPTORS:
        # Tensor descriptors (written to this program's global scratch, after gdc_wait: see the lowering
        # module); the copy engine zero-fills rows past the inputs and the weight.
        x_tiles = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        # A tile's pairs are the 2 * PAIRS consecutive weight rows from tile * 2 * PAIRS (whole heads in the
        # half layout, adjacent rows in the interleaved one, see _rotary_pairs): one block a step, one product.
        w_tiles = tl.make_tensor_descriptor(
            w_ptr, shape=[(HEADS + 2 * KV_HEADS) * D, K], strides=[K, 1], block_shape=[2 * PAIRS, BLOCK_K]
        )
        acc = tl.zeros([BLOCK_M, 2 * PAIRS], dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            xs = x_tiles.load([pid_m * BLOCK_M, pid_k * K_SPLIT + k0])
            w = w_tiles.load([tile * 2 * PAIRS, pid_k * K_SPLIT + k0])
            acc = tl.dot(xs, tl.trans(w), acc)
        if HALF_PAIRS:  # column c: head c // D, its first half or its second, pair c % (D / 2) of that head
            halves = tl.permute(tl.reshape(acc, [BLOCK_M, 2 * PAIRS // D, 2, D // 2]), (0, 1, 3, 2))
            acc_first, acc_second = tl.split(halves)
            acc_first = tl.reshape(acc_first, [BLOCK_M, PAIRS])
            acc_second = tl.reshape(acc_second, [BLOCK_M, PAIRS])
        else:  # column c: pair c // 2, its first member or its partner
            acc_first, acc_second = tl.split(tl.reshape(acc, [BLOCK_M, PAIRS, 2]))
    else:
        column = tl.arange(0, 2 * PAIRS)
        column_first, column_second, _, _, column_valid = _rotary_pairs(
            tile * PAIRS + column % PAIRS, HEADS, KV_HEADS, D, HALF_PAIRS
        )
        weight_row = tl.where(column < PAIRS, column_first, column_second)
        acc = tl.zeros([BLOCK_M, 2 * PAIRS], dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            offs_k = pid_k * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_ok = (offs_k < K)[None, :]
            xs = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_ptr + weight_row[:, None] * K + offs_k[None, :], mask=column_valid[:, None] & k_ok, other=0.0)
            acc = tl.dot(xs.to(w.dtype), tl.trans(w), acc)
        acc_first, acc_second = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, PAIRS]), (0, 2, 1)))
    last = True
    if SPLIT > 1:
        split_tile = tile * tl.num_programs(0) + pid_m
        area = BLOCK_M * PAIRS
        block = tl.arange(0, BLOCK_M)[:, None] * PAIRS + tl.arange(0, PAIRS)[None, :]
        own = partial_ptr + (split_tile * SPLIT + pid_k) * (2 * area)
        tl.store(own + block, acc_first)
        tl.store(own + area + block, acc_second)
        # every thread's partials are stored before the count (barrier, then a release); the last split
        # reads them after its acquire, past L1
        tl.debug_barrier()
        counter = counter_ptr + split_tile
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            acc_first = tl.zeros([BLOCK_M, PAIRS], dtype=tl.float32)
            acc_second = tl.zeros([BLOCK_M, PAIRS], dtype=tl.float32)
            for split in range(SPLIT):
                part = partial_ptr + (split_tile * SPLIT + split) * (2 * area)
                acc_first += tl.load(part + block, cache_modifier=".cg")
                acc_second += tl.load(part + area + block, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    if last:
        pair = tile * PAIRS + tl.arange(0, PAIRS)
        first, second, within, rotating, valid = _rotary_pairs(pair, HEADS, KV_HEADS, D, HALF_PAIRS)
        factors = factor_ptr + offs_m[:, None] * D + within[None, :]
        cos = tl.load(factors, mask=m_ok[:, None], other=1.0)
        sin = tl.load(factors + D // 2, mask=m_ok[:, None], other=0.0)
        slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1)
        q_rows = q_ptr + offs_m[:, None] * (HEADS * D)
        slot_base = slot[:, None] * (KV_HEADS * D)
        if HALF_PAIRS:
            stored = m_ok[:, None] & valid[None, :]
            cached = stored & (slot >= 0)[:, None]
            _store_rotated(
                acc_first, acc_second, cos, sin, rotating[None, :], first, second, stored, q_rows, cached, slot_base,
                k_ptr, v_ptr, HEADS, KV_HEADS, D,
            )  # fmt: skip
        else:
            # The tile's pairs are its 2 * PAIRS consecutive columns from tile * 2 * PAIRS: each pair's two results
            # go back side by side and are stored as one run of columns, which the compiler sees as contiguous
            # only when the columns come from one range (not from 2 * pair and 2 * pair + 1).
            out_first, out_second = _rotated(acc_first, acc_second, cos, sin, rotating[None, :])
            out = tl.reshape(tl.join(out_first, out_second), [BLOCK_M, 2 * PAIRS])
            column = tile * 2 * PAIRS + tl.arange(0, 2 * PAIRS)
            _store_columns(out, column, m_ok[:, None], q_rows, (slot >= 0)[:, None] & m_ok[:, None], slot_base,
                           k_ptr, v_ptr, HEADS, KV_HEADS, D)  # fmt: skip


@triton.jit  # type: ignore[misc, untyped-decorator]
def _rotary_pairs(pair, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, HALF_PAIRS: tl.constexpr):  # type: ignore[no-untyped-def]
    """(first rows, partner rows, index within the head, rotating, valid) of the packed projection's column
    pairs ``pair``: the rotation pairs of the query and key heads in order, then pairs of value rows (stored
    as they are); pairs past the last are not valid. Value heads pair their rows as the layout pairs a
    rotated head's: in the half layout each head's row ``i`` with its row ``i + D / 2``, in the interleaved
    one every pair two adjacent rows (``2 * pair`` and the row after). Pairs ``P * t`` to ``P * t + P - 1``
    are then the ``2 * P`` weight rows from ``2 * P * t`` (in the half layout where ``D`` divides
    ``2 * P``)."""
    rotated = (HEADS + KV_HEADS) * (D // 2)
    rotating = pair < rotated
    within = pair % (D // 2)
    if HALF_PAIRS:
        first = (pair // (D // 2)) * D + within
        second = first + D // 2
    else:
        first = 2 * pair
        second = first + 1
    return first, second, within, rotating, pair < rotated + KV_HEADS * D // 2


@lowering("rmsnorm_linear_rope_kv_cache_write")
def lower_attention_input(
    ctx: LoweringContext, node: mf.Node, *, multiprocessors: int = MULTIPROCESSORS
) -> list[mf.KernelLaunch]:
    x, norm, weight = ctx.need(node, "x"), ctx.need(node, "norm_weight"), ctx.need(node, "weight")
    rows, n, k = check_projection(ctx, x, weight, None, norm=norm)
    tokens, heads, kv_heads, head_dim = _rope_cache_geometry(ctx, node, n)
    if rows != tokens:
        raise ctx.fail(f"x holds {rows} rows and q {tokens}")
    describable = describes(ctx, weight, weight, k)  # matrix tiles read the norm staged in the weight's type
    # Prefill chunks (over NARROW_TILE_ROWS rows) project into a workspace with the plain projection's tiles,
    # warp-specialised ones included; decode batches keep the tiles the rotating kernels take.
    chunk = rows > NARROW_TILE_ROWS
    tiles = choose_tiles(rows, n, k, multiprocessors=multiprocessors, describable=describable, specialised=chunk)
    half = ctx.attribute(node, "style") == "half"
    rotary = rotary_tiles(
        tiles, rows, n, k, multiprocessors=multiprocessors,
        describable=rotary_describes(ctx, weight, k, head_dim, MATRIX_PAIRS, half=half),
    )  # fmt: skip
    if (
        rotary is not None
        and rotary.descriptors
        and not rotary_describes(ctx, weight, k, head_dim, rotary.block_n // 2, half=half)
    ):
        rotary = None  # (tiles of other than MATRIX_PAIRS pairs that descriptors cannot serve)
    if rotary is not None and rotary.block_n // 2 >= MIN_DOT_COLUMNS:
        # Matrix tiles: the norm staged, then the rotating projection.
        return rotary_projection(ctx, node, rotary, (rows, n, k), (heads, kv_heads, head_dim))
    if not tiles.per_sm or next_power_of_two(k) > FUSED_INPUTS:
        # Tiles through tensor descriptors (prefill chunks, see rotary_tiles), or longer input rows at decode:
        # the projection into a workspace, then the rope + cache-write kernel reads it.
        staged = ctx.workspace("packed_qkv", mf.DTYPE_F32, rows * n)
        packed = mf.BufferView(buffer=staged.buffer, element_offset=0, shape=[rows, n])
        rope = mf.Node(name=node.name)
        rope.op.name, rope.op.version = "rope_kv_cache_write", 1
        rope.args.add(name="qkv", view=packed)
        for name in ("positions", "slots", "q", "k_plane", "v_plane"):
            rope.args.add(name=name, view=ctx.need(node, name))
        rope.attributes.extend(a for a in node.attributes if a.name != "eps")
        projection = project(ctx, node, x, weight, packed, norm=norm, tiles=tiles, multiprocessors=multiprocessors)
        return [*projection, *lower_rope_kv_cache_write(ctx, rope)]
    # The streaming projection's tiles: half its rows first members of rotation pairs, half partners.
    pairs = min(tiles.block_n // 2, head_dim // 2)
    rotating = (heads + kv_heads) * (head_dim // 2) // pairs
    count = rotating + kv_heads * head_dim // (2 * pairs)
    programs = min(count, tiles.per_sm * multiprocessors)
    if programs < count:  # a multiple of the tiles a head's pairs take: a program's tiles share their pairs
        programs -= programs % max(1, head_dim // 2 // pairs)
    positions, slots = ctx.need(node, "positions"), ctx.need(node, "slots")
    frequencies, scaled = frequency_args(ctx, node)
    launch = ctx.launch(
        attention_input_kernel,
        {
            "x_ptr": ctx.pointer(x),
            "w_ptr": ctx.pointer(weight),
            "norm_ptr": ctx.pointer(norm),
            "position_ptr": ctx.pointer(positions),
            "slot_ptr": ctx.pointer(slots),
            "q_ptr": ctx.pointer(ctx.need(node, "q")),
            "k_ptr": ctx.pointer(ctx.need(node, "k_plane")),
            "v_ptr": ctx.pointer(ctx.need(node, "v_plane")),
            "eps": ctx.f32(float(ctx.attribute(node, "eps", 0.0))),
            "rows": ctx.i32(rows),
            **frequencies,
        },
        {
            "K": k,
            "K_P2": next_power_of_two(k),
            "HEADS": heads,
            "KV_HEADS": kv_heads,
            "D": head_dim,
            "ROWS_P2": next_power_of_two(rows),
            "PAIRS": pairs,
            "ROTATING": rotating,
            "TILES": count,
            "PROGRAMS": programs,
            "HALF_PAIRS": ctx.attribute(node, "style") == "half",
            "SCALED": scaled,
            "SETTLED": ctx.settled(positions, slots),
        },
        (programs,),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return [launch]


def rotary_describes(
    ctx: LoweringContext, weight: mf.BufferView, k: int, head_dim: int, pairs: int, *, half: bool
) -> bool:
    """Whether tensor descriptors can serve the rotating projection's column tiles of ``pairs`` pairs: the
    projection's conditions (:func:`~ignition.kernels.linear.describes`: 16-bit weights, 16-byte aligned
    rows), and :func:`whole_heads_a_tile`."""
    return describes(ctx, weight, weight, k) and whole_heads_a_tile(pairs, head_dim, half=half)


def whole_heads_a_tile(pairs: int, head_dim: int, *, half: bool) -> bool:
    """Whether a column tile of ``pairs`` pairs is consecutive weight rows, as a descriptor block must be:
    always in the interleaved layout, in the half layout where ``head_dim`` divides ``2 * pairs``."""
    return not half or (2 * pairs) % head_dim == 0


def rotary_projection(
    ctx: LoweringContext,
    node: mf.Node,
    tiles: Tiles,
    dims: tuple[int, int, int],
    geometry: tuple[int, int, int],
) -> list[mf.KernelLaunch]:
    """One :func:`rotary_input_kernel` launch (the staged norm and every row's rotation factors), then one
    :func:`rotary_projection_kernel` launch over ``tiles`` (matrix tiles fed by per-thread loads, or through
    tensor descriptors where :func:`rotary_describes`), each column tile ``block_n / 2`` column pairs;
    ``dims`` are the projection's (rows, N, K), ``geometry`` its (heads, kv heads, head dim)."""
    x, norm, weight = ctx.need(node, "x"), ctx.need(node, "norm_weight"), ctx.need(node, "weight")
    rows, n, k = dims
    heads, kv_heads, head_dim = geometry
    half = ctx.attribute(node, "style") == "half"
    if tiles.block_m <= 1 or tiles.persistent or tiles.per_sm or tiles.block_n // 2 < MIN_DOT_COLUMNS:
        raise ctx.fail(
            f"the rotating projection takes matrix tiles of at least {2 * MIN_DOT_COLUMNS} columns, one program "
            f"a tile, not {tiles}"
        )
    if tiles.descriptors and not rotary_describes(ctx, weight, k, head_dim, tiles.block_n // 2, half=half):
        raise ctx.fail(
            f"tensor descriptors cannot serve the rotating projection's {tiles.block_n // 2} pairs a tile (16-bit "
            f"weights, 16-byte aligned rows, and in the half layout whole heads of {head_dim} rows a tile)"
        )
    staged_view = staged_input(ctx, weight, rows)
    eps = ctx.attribute(node, "eps")
    if not isinstance(eps, int | float) or not float(eps) > 0.0:
        raise ctx.fail(f"attribute 'eps' must be a number > 0, got {eps!r}")
    factors = ctx.workspace("rotary_factors", mf.DTYPE_F32, rows * head_dim)
    frequencies, scaled = frequency_args(ctx, node)
    single, block, warps = rmsnorm_blocks(k)
    stage = ctx.launch(
        rotary_input_kernel,
        {
            "x_ptr": ctx.pointer(x),
            "norm_ptr": ctx.pointer(norm),
            "out_ptr": ctx.pointer(staged_view),
            "position_ptr": ctx.pointer(ctx.need(node, "positions")),
            "factor_ptr": ctx.pointer(factors),
            "eps": ctx.f32(float(eps)),
            **frequencies,
        },
        {
            "HIDDEN": k,
            "BLOCK": block,
            "SINGLE": single,
            "WEIGHT_EARLY": ctx.is_weights(norm),
            "D": head_dim,
            "SCALED": scaled,
        },
        (rows,),
        num_warps=warps,
    )
    pairs = tiles.block_n // 2
    tiles_n, tiles_m = cdiv(n // 2, pairs), cdiv(rows, tiles.block_m)
    partials, counters = staged_view, staged_view  # never touched without a split
    if tiles.split > 1:
        area = tiles_n * tiles_m * tiles.split * tiles.block_m * tiles.block_n
        partials = ctx.workspace("projection_partials", mf.DTYPE_F32, area)
        counters = ctx.workspace("projection_splits_done", mf.DTYPE_I32, tiles_n * tiles_m)
    launch = ctx.launch(
        rotary_projection_kernel,
        {
            "x_ptr": ctx.pointer(staged_view),
            "w_ptr": ctx.pointer(weight),
            "slot_ptr": ctx.pointer(ctx.need(node, "slots")),
            "q_ptr": ctx.pointer(ctx.need(node, "q")),
            "k_ptr": ctx.pointer(ctx.need(node, "k_plane")),
            "v_ptr": ctx.pointer(ctx.need(node, "v_plane")),
            "partial_ptr": ctx.pointer(partials),
            "counter_ptr": ctx.pointer(counters),
            "factor_ptr": ctx.pointer(factors),
            "rows": ctx.i32(rows),
        },
        {
            "K": k,
            "HEADS": heads,
            "KV_HEADS": kv_heads,
            "D": head_dim,
            "BLOCK_M": tiles.block_m,
            "PAIRS": pairs,
            "BLOCK_K": tiles.block_k,
            "SPLIT": tiles.split,
            "K_SPLIT": cdiv(cdiv(k, tiles.block_k), tiles.split) * tiles.block_k,
            "HALF_PAIRS": half,
            "DESCRIPTORS": tiles.descriptors,
        },
        (tiles_m, tiles_n, tiles.split),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        programmatic=waits_programmatically(rows, follows_own_launch=True),
    )
    return [stage, launch]
