"""Warp-specialised projection tiles for Hopper, written in Gluon.

Owns :func:`specialised_projection_kernel`, the form of :func:`ignition.kernels.linear.projection_kernel`
whose warps split the work: one copy warp moves each reduction step's input and weight tiles into a ring
of shared-memory stages through tensor descriptors (Hopper's copy engine), and the kernel's own warps
issue the warpgroup matrix products on each stage as it lands, handing the stage back as soon as the
products that read it have finished. The copies of later steps never wait for a product's result, only
for a free stage. Same parameters, partial tiles, split order and epilogue as the one-loop kernel, so a
lowering swaps one for the other (``Tiles.specialised``, chosen in :mod:`ignition.kernels.linear`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

COPY_WARP_REGISTERS = gl.constexpr(40)
"""Registers a thread of the copy warp keeps (the rest go to the product warps)."""


@gluon.jit  # type: ignore[misc, untyped-decorator]
def _programmatic_wait():  # type: ignore[no-untyped-def]
    """Wait for the launch before (programmatic dependent launch), then let the next one start."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit  # type: ignore[misc, untyped-decorator]
def _copy_steps(  # type: ignore[no-untyped-def]
    x_tiles, w_tiles, x_stages, w_stages, up_stages, landed, free, first_tile, tiles, tile_stride, tiles_m,
    k_begin, steps, N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, SWIGLU: gl.constexpr,
):  # fmt: skip
    """The copy warp: over this program's tiles, reduction step ``i`` (counted across its tiles) into stage
    ``i % STAGES`` once the products of the step before it in that stage have released it."""
    step_bytes: gl.constexpr = x_tiles.block_type.nbytes + w_tiles.block_type.nbytes * (2 if SWIGLU else 1)
    i = 0
    for tile in range(first_tile, tiles, tile_stride):
        off_m = (tile % tiles_m) * BLOCK_M
        off_n = (tile // tiles_m) * BLOCK_N
        for step in range(steps):
            stage = i % STAGES
            # a fresh barrier counts as released in the phase before its first (parity 1)
            mbarrier.wait(free.index(stage), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(landed.index(stage), step_bytes)
            k = k_begin + step * BLOCK_K
            tma.async_copy_global_to_shared(x_tiles, [off_m, k], landed.index(stage), x_stages.index(stage))
            tma.async_copy_global_to_shared(w_tiles, [off_n, k], landed.index(stage), w_stages.index(stage))
            if SWIGLU:
                tma.async_copy_global_to_shared(w_tiles, [N + off_n, k], landed.index(stage), up_stages.index(stage))
            i += 1


@gluon.jit  # type: ignore[misc, untyped-decorator]
def _multiply_steps(  # type: ignore[no-untyped-def]
    x_stages, w_stages, up_stages, landed, free, first_tile, tiles, tile_stride, tiles_m, steps, rows,
    out_ptr, residual_ptr, N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    SWIGLU: gl.constexpr, RESIDUAL: gl.constexpr, STORE: gl.constexpr, LAYOUT: gl.constexpr,
):  # fmt: skip
    """The product warps: over this program's tiles, each landed stage into the accumulators (the up block's
    too with ``SWIGLU``); a stage is released once the products of the step after it are issued and its
    own have finished, a tile's last stage once its products are done. With ``STORE`` each finished tile
    is stored here (while the copy warp already fills the stages of the next); the accumulators of the
    last tile are returned."""
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, LAYOUT)
    acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, LAYOUT)
    i = 0
    for tile in range(first_tile, tiles, tile_stride):
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, LAYOUT)
        acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, LAYOUT)
        for step in range(steps):
            stage = i % STAGES
            mbarrier.wait(landed.index(stage), (i // STAGES) & 1)
            acc = warpgroup_mma(x_stages.index(stage), w_stages.index(stage).permute((1, 0)), acc, is_async=True)
            if SWIGLU:
                up = up_stages.index(stage).permute((1, 0))
                acc_up = warpgroup_mma(x_stages.index(stage), up, acc_up, is_async=True)
                acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(free.index((i + STAGES - 1) % STAGES), pred=step > 0)
            i += 1
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
        mbarrier.arrive(free.index((i + STAGES - 1) % STAGES))
        if STORE:
            out_offsets, out_mask, _ = _tile_place(tile, tiles_m, rows, N, BLOCK_M, BLOCK_N, LAYOUT)
            _store_tile(acc, acc_up, out_ptr, residual_ptr, out_offsets, out_mask, RESIDUAL, SWIGLU)
    return acc, acc_up


@gluon.jit  # type: ignore[misc, untyped-decorator]
def _tile_place(  # type: ignore[no-untyped-def]
    tile, tiles_m, rows, N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr
):
    """Where tile ``tile`` (row tile fastest) of the ``rows x N`` output lies: its elements' offsets in the
    output, which of them are inside it, and their offsets within a ``BLOCK_M x BLOCK_N`` tile."""
    tile_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    tile_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LAYOUT))
    offs_m = (tile % tiles_m) * BLOCK_M + tile_rows
    offs_n = (tile // tiles_m) * BLOCK_N + tile_cols
    inside = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
    return offs_m[:, None] * N + offs_n[None, :], inside, tile_rows[:, None] * BLOCK_N + tile_cols[None, :]


@gluon.jit  # type: ignore[misc, untyped-decorator]
def _store_tile(  # type: ignore[no-untyped-def]
    acc, acc_up, out_ptr, residual_ptr, out_offsets, out_mask, RESIDUAL: gl.constexpr, SWIGLU: gl.constexpr
):
    """A finished tile's epilogue: ``silu(acc) * acc_up`` with ``SWIGLU`` (as ``silu_mul`` computes it), plus
    the residual with ``RESIDUAL``, stored."""
    if SWIGLU:
        acc = acc / (1.0 + gl.exp(-acc)) * acc_up
    if RESIDUAL:
        acc += gl.load(residual_ptr + out_offsets, mask=out_mask, other=0.0)
    gl.store(out_ptr + out_offsets, acc, mask=out_mask)


@gluon.jit  # type: ignore[misc, untyped-decorator]
def specialised_projection_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    residual_ptr,
    partial_ptr,
    counter_ptr,
    rows,
    N: gl.constexpr,
    K: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    SPLIT: gl.constexpr,
    K_SPLIT: gl.constexpr,
    STAGES: gl.constexpr,
    RESIDUAL: gl.constexpr,
    SWIGLU: gl.constexpr,
    USE_PDL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``BLOCK_M x BLOCK_N`` tiles of ``x @ weight.T (+ residual)`` (or, with ``SWIGLU``, of
    ``silu(x @ gate.T) * (x @ up.T)`` over a ``[gate | up]`` weight of ``2N`` rows) over the reduction steps
    of split ``program_id(2)``; partial tiles, the split order and the epilogue as
    :func:`ignition.kernels.linear.projection_kernel`. Inputs and weights have one 16-bit type; the
    tensor descriptors live in this program's global scratch, written after the wait on the launch before.

    The tiles are numbered row tile fastest, and program ``(p, q)`` of a ``P x Q`` grid takes tiles
    ``q * P + p`` and every ``P * Q``-th after it: a grid of one program a tile (``cdiv(rows, BLOCK_M) x
    cdiv(N, BLOCK_N)``, each split a layer of it) computes one tile a program; a grid of ``P x 1`` unsplit
    programs is persistent, each program over several tiles without filling its pipeline again between
    them (the copy warp loads the next tile's first stages while the last one's products finish)."""
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    if USE_PDL:
        _programmatic_wait()
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_tiles = tma.make_tensor_descriptor(
        x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K], layout=swizzled
    )
    w_rows: gl.constexpr = 2 * N if SWIGLU else N
    w_tiles = tma.make_tensor_descriptor(
        w_ptr, shape=[w_rows, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K], layout=swizzled
    )
    x_stages = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], swizzled)
    w_stages = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], swizzled)
    up_stages = gl.allocate_shared_memory(dtype, [STAGES if SWIGLU else 1, BLOCK_N, BLOCK_K], swizzled)
    landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(landed.index(stage), count=1)
        mbarrier.init(free.index(stage), count=1)
    fence_async_shared()
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    tiles_m = gl.cdiv(rows, BLOCK_M)
    tiles = tiles_m * gl.cdiv(N, BLOCK_N)
    first_tile = pid_n * gl.num_programs(0) + pid_m
    tile_stride = gl.num_programs(0) * gl.num_programs(1)
    k_begin = pid_k * K_SPLIT
    steps = gl.cdiv(gl.minimum(K_SPLIT, K - k_begin), BLOCK_K)
    acc, acc_up = gl.warp_specialize(
        [
            (_multiply_steps, (x_stages, w_stages, up_stages, landed, free, first_tile, tiles, tile_stride, tiles_m,
                               steps, rows, out_ptr, residual_ptr, N, BLOCK_M, BLOCK_N, STAGES, SWIGLU, RESIDUAL,
                               SPLIT == 1, layout)),
            (_copy_steps, (x_tiles, w_tiles, x_stages, w_stages, up_stages, landed, free, first_tile, tiles,
                           tile_stride, tiles_m, k_begin, steps, N, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, SWIGLU)),
        ],
        [1],
        [COPY_WARP_REGISTERS],
    )  # fmt: skip
    if SPLIT > 1:  # one tile a program (first_tile: pid_m, pid_n); unsplit tiles were stored as they finished
        tile = first_tile
        out_offsets, out_mask, block = _tile_place(tile, tiles_m, rows, N, BLOCK_M, BLOCK_N, layout)
        area: gl.constexpr = BLOCK_M * BLOCK_N
        parts: gl.constexpr = 2 if SWIGLU else 1  # partial tiles a split stores: the gate's and the up's
        gl.store(partial_ptr + (tile * SPLIT + pid_k) * (parts * area) + block, acc)
        if SWIGLU:
            gl.store(partial_ptr + (tile * SPLIT + pid_k) * (parts * area) + area + block, acc_up)
        # every thread's partial is stored before the count; the last split reads them after its acquire
        gl.thread_barrier()
        counter = counter_ptr + tile
        finished = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == SPLIT - 1:
            total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
            total_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
            for split in range(SPLIT):
                part = partial_ptr + (tile * SPLIT + split) * (parts * area)
                total += gl.load(part + block, cache_modifier=".cg")
                if SWIGLU:
                    total_up += gl.load(part + area + block, cache_modifier=".cg")
            _store_tile(total, total_up, out_ptr, residual_ptr, out_offsets, out_mask, RESIDUAL, SWIGLU)
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
