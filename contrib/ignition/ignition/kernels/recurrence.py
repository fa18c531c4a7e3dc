"""Gated linear recurrence kernels: the prefill scan and the one-step decode update.

Owns the Triton kernels, and the registered lowering functions, of ``gated_recurrence_scan`` and
``gated_recurrence_step`` (recurrent histories, ``HISTORY_KIND_RECURRENT``). Both reproduce the
reference semantics of :mod:`helios_core.backends.reference_kernels` in float32:

* the gate is ``sigmoid(g)`` without overflow: with ``e = exp(-|g|)``, ``1 / (1 + e)`` where ``g >= 0``
  and ``e / (1 + e)`` elsewhere, both divisions correctly rounded and ``exp`` the device's (a few ulp);
* one token: ``d = (1 - a) * x`` rounded to float32, then ``s = a * s + d``. Both kernels run this
  update through one helper (:func:`_recurrence_update`), so a lane's state after a packed block equals
  its state after the same tokens one a round, bit for bit between the two kernels; against the
  reference the only difference is the device ``exp`` and a possible fused multiply-add.

``gated_recurrence_scan`` has one program per (lane, block of ``BLOCK_D`` state channels). It loads
its lane's state row, walks the packed tokens in order, updates the state with each token of its lane
and writes that token's output row, then writes the state row back. The programs of lane 0 also write
zero rows for padding tokens (a negative lane, or one at or past the lane count); a lane whose state
row is negative writes zero rows for its tokens and leaves every state row alone.

``gated_recurrence_step`` has one program per (lane, channel block): one update of the lane's state row
and its output row; a negative state row gives a zero output row.

State rows are a runtime extent, so a row past the state buffer is not checked (it is trusted as
every runtime-sized index is, see ``lowering.py``). Every kernel calls ``gdc_wait()`` before its first
access to any buffer (``USE_PDL``), then ``gdc_launch_dependents()``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import LoweringContext, cdiv, lowering, next_power_of_two

INDEX_DTYPES = frozenset({mf.DTYPE_I32, mf.DTYPE_I64})
"""Integer dtypes accepted for lanes and state rows."""

MAX_BLOCK_D = 256
"""The most state channels one program carries."""


@triton.jit  # type: ignore[misc, untyped-decorator]
def _recurrence_update(state, gate, x):  # type: ignore[no-untyped-def]
    """One token of the recurrence: ``a = sigmoid(gate)``, ``state * a + (1 - a) * x`` in float32."""
    e = tl.exp(-tl.abs(gate))
    decay = tl.where(gate >= 0.0, tl.div_rn(1.0, 1.0 + e), tl.div_rn(e, 1.0 + e))
    drive = (1.0 - decay) * x
    return decay * state + drive


@triton.jit  # type: ignore[misc, untyped-decorator]
def recurrence_scan_kernel(  # type: ignore[no-untyped-def]
    gate_ptr,
    x_ptr,
    token_row_ptr,
    rows_ptr,
    state_ptr,
    out_ptr,
    TOKENS: tl.constexpr,
    LANES: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    lane = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.load(rows_ptr + lane).to(tl.int64)
    live = row >= 0
    state_row = state_ptr + tl.where(live, row, 0) * D + cols
    s = tl.load(state_row, mask=col_ok & live, other=0.0)
    zeros = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t in range(TOKENS):
        token_lane = tl.load(token_row_ptr + t)
        mine = token_lane == lane
        padding = (lane == 0) & ((token_lane < 0) | (token_lane >= LANES))
        offset = t * D + cols
        if mine & live:
            gate = tl.load(gate_ptr + offset, mask=col_ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offset, mask=col_ok, other=0.0).to(tl.float32)
            s = _recurrence_update(s, gate, x)
            tl.store(out_ptr + offset, s, mask=col_ok)
        elif mine | padding:
            tl.store(out_ptr + offset, zeros, mask=col_ok)
    if live:
        tl.store(state_row, s, mask=col_ok)


@triton.jit  # type: ignore[misc, untyped-decorator]
def recurrence_step_kernel(  # type: ignore[no-untyped-def]
    gate_ptr,
    x_ptr,
    rows_ptr,
    state_ptr,
    out_ptr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    lane = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.load(rows_ptr + lane).to(tl.int64)
    offset = lane * D + cols
    if row >= 0:
        state_row = state_ptr + row * D + cols
        s = tl.load(state_row, mask=col_ok, other=0.0)
        gate = tl.load(gate_ptr + offset, mask=col_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offset, mask=col_ok, other=0.0).to(tl.float32)
        s = _recurrence_update(s, gate, x)
        tl.store(state_row, s, mask=col_ok)
        tl.store(out_ptr + offset, s, mask=col_ok)
    else:
        tl.store(out_ptr + offset, tl.zeros([BLOCK_D], dtype=tl.float32), mask=col_ok)


def _checked_inputs(ctx: LoweringContext, node: mf.Node) -> tuple[int, int, int]:
    """(tokens, state width, lanes) of a recurrence node; checks shapes and dtypes."""
    gate, x, out = ctx.need(node, "gate"), ctx.need(node, "x"), ctx.need(node, "out")
    rows, state = ctx.need(node, "rows"), ctx.need(node, "state")
    shape = ctx.shape(gate)
    if len(shape) != 2:
        raise ctx.fail(f"gate must be [tokens, D], got {list(shape)}")
    if ctx.shape(x) != shape or ctx.shape(out) != shape:
        raise ctx.fail(f"x {list(ctx.shape(x))} and out {list(ctx.shape(out))} must match gate {list(shape)}")
    tokens, width = shape
    state_shape = ctx.buffer_shape(state)
    if len(state_shape) != 2 or state_shape[1] != width:
        raise ctx.fail(f"state must be [rows, {width}], got {list(state_shape)}")
    for view, name in ((gate, "gate"), (x, "x")):
        if ctx.dtype(view) not in (mf.DTYPE_F32, mf.DTYPE_BF16, mf.DTYPE_F16):
            raise ctx.fail(f"{name} must be a float buffer")
    for view, name in ((state, "state"), (out, "out")):
        if ctx.dtype(view) != mf.DTYPE_F32:
            raise ctx.fail(f"{name} must be float32")
    if ctx.dtype(rows) not in INDEX_DTYPES:
        raise ctx.fail("rows must be int32 or int64")
    lanes = 1
    for extent in ctx.shape(rows):
        lanes *= int(extent)
    if lanes < 1 or tokens < 1:
        raise ctx.fail("a recurrence node needs at least one token and one lane")
    return tokens, width, lanes


def _block_d(width: int) -> int:
    return min(MAX_BLOCK_D, max(32, next_power_of_two(width)))


@lowering("gated_recurrence_scan")
def lower_gated_recurrence_scan(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    tokens, width, lanes = _checked_inputs(ctx, node)
    token_row = ctx.need(node, "token_row")
    if ctx.dtype(token_row) not in INDEX_DTYPES:
        raise ctx.fail("token_row must be int32 or int64")
    count = 1
    for extent in ctx.shape(token_row):
        count *= int(extent)
    if count != tokens:
        raise ctx.fail(f"token_row holds {count} lanes for {tokens} tokens")
    block_d = _block_d(width)
    launch = ctx.launch(
        recurrence_scan_kernel,
        {
            "gate_ptr": ctx.pointer(ctx.need(node, "gate")),
            "x_ptr": ctx.pointer(ctx.need(node, "x")),
            "token_row_ptr": ctx.pointer(token_row),
            "rows_ptr": ctx.pointer(ctx.need(node, "rows")),
            "state_ptr": ctx.pointer(ctx.need(node, "state")),
            "out_ptr": ctx.pointer(ctx.need(node, "out")),
        },
        {"TOKENS": tokens, "LANES": lanes, "D": width, "BLOCK_D": block_d},
        (lanes, cdiv(width, block_d)),
        num_warps=1 if block_d <= 64 else 2,
        num_stages=1,
    )
    return [launch]


@lowering("gated_recurrence_step")
def lower_gated_recurrence_step(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    tokens, width, lanes = _checked_inputs(ctx, node)
    if lanes != tokens:
        raise ctx.fail(f"rows names {lanes} lanes for {tokens} rows of gate (one token a lane)")
    block_d = _block_d(width)
    launch = ctx.launch(
        recurrence_step_kernel,
        {
            "gate_ptr": ctx.pointer(ctx.need(node, "gate")),
            "x_ptr": ctx.pointer(ctx.need(node, "x")),
            "rows_ptr": ctx.pointer(ctx.need(node, "rows")),
            "state_ptr": ctx.pointer(ctx.need(node, "state")),
            "out_ptr": ctx.pointer(ctx.need(node, "out")),
        },
        {"D": width, "BLOCK_D": block_d},
        (lanes, cdiv(width, block_d)),
        num_warps=1 if block_d <= 64 else 2,
        num_stages=1,
    )
    return [launch]
