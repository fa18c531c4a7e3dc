"""Kernels of self-drafting rounds with sampled drafts: the sampled draft token and its verification.

Owns the Triton kernels and the lowerings of ``draft_sample`` and ``sample_verify_sampled``. The
semantics are those of :mod:`helios_core.backends.reference_kernels` (``draft_sample``,
``sample_verify_sampled``, ``stream_uniform`` with ``PROPOSAL_STREAM_KEY`` and ``RESIDUAL_STREAM_KEY``).
Both reuse the ``sample`` kernels of :mod:`ignition.kernels.sampling` and their workspaces: the
per-chunk weights launch unchanged, and the kept set of a row (temperature, ``top_k``, ``top_p``,
``min_p``) found by ``sample``'s own search helper (as the draw's top-k and top-p cuts are). A kept
set is a prefix of the order ``(w desc, id asc)``, recorded as a *cut* ``(w_c, id_c)``: id ``i`` is
kept iff ``w_i > w_c``, or ``w_i == w_c`` and ``i <= id_c`` (the min-p cut is ``w_c`` just below
``min_p``, no id; no cut is ``w_c = 0``).

``draft_sample``, launches in order:

1. ``draft_argmax``'s launch (:mod:`ignition.kernels.self_draft`) over every lane, so a greedy lane
   (temperature 0) gets exactly ``draft_argmax``'s id and confidence;
2. grid ``(B, C)``: each drafting lane's chunk of ``logits[r, :vocab_limit]`` (``-inf`` past it) into
   the processed-logits workspace, the chunk's maximum and its count of non-finite logits;
3. grid ``(B,)``: each lane's status: none (not drafting, or a non-finite logit, an invalid setting or
   a negative step), greedy or sampled; a drafting lane of status none gets id 0 and confidence 0;
4. ``sample``'s weights launch over the sampled lanes: float64 weights, counts and masses;
5. grid ``(B,)``: each sampled lane's cut and its kept mass ``W``;
6. grid ``(B, C)``: row ``draft_index`` of ``draft_probabilities``: ``float32(w_i / W)`` on kept ids
   (sampled), one-hot at the id (greedy), zeros (none); and each chunk's float64 sum of that row and
   its last positive id;
7. grid ``(B,)``: each sampled lane's draw ``u = stream_uniform(seed, step + draft_index,
   PROPOSAL_STREAM_KEY)``: the chunk whose running sum of chunk sums first exceeds ``u`` times the
   row's sum, then the id within it (a running float64 sum over the chunk); ``confidence = q[id]``.

``sample_verify_sampled`` runs as ``sample_verify``'s kernels do (:mod:`ignition.kernels.speculative`:
a begin launch copying each active lane's first logits row into a ``[B, V]`` workspace, then per
position ``j`` a lane may reach, ``C + 1`` for ``C`` candidate columns, the position's launches and a
record-and-copy launch). At each position an active lane is *sampled* (temperature 0, or ``j`` at its
candidate count: the token is what ``sample`` draws, accepted iff it equals ``x_j``) or *verified*
(temperature > 0 and ``j`` below its candidate count). The position's launches:

1. the three ``sample`` launches over the sampled lanes (the finishing launch adds the token to
   ``output_counts``);
2. ``sample``'s per-chunk processing and weights launches over the verified lanes (penalties with the
   counts as they are then, no grammar mask);
3. grid ``(B,)``: each verified lane's cut and kept mass ``W`` (``p_j = w / W`` on kept ids), one pass
   over its draft row ``draft_probabilities[r, j]`` for its float64 sum ``Q`` and finiteness, and the
   acceptance ``u * (d_x / Q) < p_j(x)`` with ``u = counter_uniform(seed, step[r] + j)``;
4. grid ``(B, C)``, rejected lanes: each chunk's float64 sums of ``max(0, p_j - d / Q)`` and of
   ``p_j`` and their last positive ids;
5. grid ``(B,)``: each verified lane's token: the candidate, or the residual draw in id order with
   ``stream_uniform(seed, step[r] + j, RESIDUAL_STREAM_KEY)`` (from ``p_j`` when the residual sums to
   0); its log-probability ``(l - M) - log sum exp(l - M)`` as ``sample`` reports it, a verdict, and 1
   added to ``output_counts[rows[r], token]``;
6. grid ``(B, V / GATHER_BLOCK)`` (``(B, 1)`` at the last position): records the token of every lane
   active at ``j`` (``ids[r, j]``, ``logprob[r, j]``, ``accepted = j``, ``emitted = j + 1``,
   ``pending``), and lets the lane go on to ``j + 1`` when ``j`` is below its candidate count and the
   token was accepted (a sampled lane: equal to ``x_j``; a verified lane: its verdict), copying logits
   row ``start_r + j + 1`` for it.

Arithmetic: the stream uniforms are the reference's bit for bit (SplitMix64 in uint64: ``stream_uniform
(s, k, key) = counter_uniform(splitmix64(s, key), k)``); weights, probabilities, the acceptance test and
the residual in float64 from the reference's formulas (``w_i / W`` and ``d_i / Q`` correctly rounded
divisions). Kept masses, the draft row's sum and the running sums of the draws are float64 sums in a
parallel, fixed order rather than the reference's sequential one, so ``W`` and ``Q`` are within float64
rounding of the reference's: a probability ``float32(w_i / W)`` can differ from the reference's by one
float32 rounding step (relative ``1.2e-7``), a drawn id only where the draw's target lies within float64
rounding of a cumulative boundary (then a neighbouring id of positive probability), and an acceptance
only where ``u * q_j(x)`` lies within float64 rounding of ``p_j(x)``. Weights use the device's float64
``exp``, as ``sample``'s kernels do. Every result of a lane depends only on that lane's inputs and every
reduction has a fixed order, so results repeat exactly from run to run.

Where the reference raises, the kernels do not fault: a drafting lane of ``draft_sample`` with a
non-finite logit below ``vocab_limit``, an invalid setting or a negative step drafts nothing (id 0,
confidence 0, a zero row); in ``sample_verify_sampled`` a verified position whose draft row is not
finite and non-negative with a positive sum, or whose row of logits has no finite logit, ends the lane
with what it emitted before; an offered candidate outside ``[0, V)`` is rejected (the lane emits the
residual draw and stops); and the rules of ``sample_verify``'s kernels hold (an active lane with no
packed token, a negative state row or a block past the end of the logits is inactive; a lane offering
more than ``C`` candidates verifies the first ``C``). Lanes sharing a state row see each other's
counts position by position (the reference finishes one lane before the next). State rows are
trusted to lie in range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from helios_core.backends.reference_kernels import PROPOSAL_STREAM_KEY, RESIDUAL_STREAM_KEY
from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.lowering import KernelArg, LoweringContext, cdiv, lowering, next_power_of_two
from ignition.kernels.sampling import (
    CHUNK,
    HEAVY_TARGET,
    PASS_BLOCK,
    REGISTER_CANDIDATES,
    THRESHOLD_SAMPLES,
    WINDOW_HALF_WIDTH,
    WINDOW_SAMPLES,
    _counter_uniform,
    _next_down,
    _pdl_prologue,
    _row_totals,
    _sample_chunk_kernel,
    _sample_weight_kernel,
    _search,
    _sort_candidates,
    _state_tables,
)
from ignition.kernels.self_draft import lower_draft_argmax
from ignition.kernels.speculative import (
    _FLAGS,
    _INTS,
    GATHER_BLOCK,
    ROW_ALIGN,
    _candidates,
    _copy_next_row,
    _lane_walk,
    _numel,
    _per_lane,
    _position_sample,
    _position_token,
    _record_token,
    _row_view,
    _typed,
    _verify_begin_kernel,
    _verify_ids,
    _verify_logits,
    _verify_outputs,
)

__all__ = ["DRAFT_MASS_BLOCK", "lower_draft_sample", "lower_sample_verify_sampled"]

DRAFT_MASS_BLOCK = 2048
"""Draft probabilities per step of a verified lane's pass over its draft row."""

_SEEDS = (mf.DTYPE_U64, mf.DTYPE_I64)
_SETTING_FLOATS = (mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16, mf.DTYPE_F64)


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` with a type for the checker (Triton itself is untyped)."""
    return triton.jit(fn)


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@_jit
def _stream_uniform(seed: tl.tensor, step: tl.tensor, KEY: tl.constexpr) -> Any:
    """``counter_uniform(splitmix64(seed, KEY), step)`` in uint64 arithmetic (the reference's
    ``stream_uniform``): the keyed seed is SplitMix64 output number ``KEY`` of ``seed``."""
    key = tl.full([], KEY, tl.int64).to(tl.uint64, bitcast=True)
    z = seed.to(tl.uint64, bitcast=True) + (key + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return _counter_uniform(z.to(tl.int64, bitcast=True), step)


@_jit
def _kept_cut(
    r: tl.tensor,
    rowv: tl.tensor,
    top_k: tl.tensor,
    top_p: tl.tensor,
    min_p: tl.tensor,
    proc: tl.tensor,
    wts: tl.tensor,
    heavy: tl.tensor,
    lists: tl.tensor,
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    agg_count: tl.tensor,
    agg_mass: tl.tensor,
    V: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    REG: tl.constexpr,
    SAMPLES: tl.constexpr,
    HALF: tl.constexpr,
    BLK: tl.constexpr,
    LOG_C: tl.constexpr,
) -> Any:
    """The kept set of one row with temperature > 0 (after ``sample``'s weights launch), as ``sample``'s
    draw cuts it: returns the cut ``(w_c, id_c)`` and the kept mass."""
    positive, min_count, n_heavy, ends, mass_all, min_mass, m_heavy, tau = _row_totals(r, agg_count, agg_mass, C, C_PAD)
    k = tl.load(top_k + r).to(tl.int64)
    tp = tl.load(top_p + r).to(tl.float64)
    mp = tl.load(min_p + r).to(tl.float64)
    k_on = (k > 0) & (k < positive)
    p_on = tp < 1.0
    m_on = mp > 0.0
    yes = positive >= 0
    small_h = n_heavy <= REG
    mass_k = mass_all
    keep = positive
    total = mass_all
    cut_w = tl.zeros([], tl.float64)
    cut_id = tl.full([], -1, tl.int32)
    if small_h & (k_on | p_on):  # every search that ends among the heavy ids shares one sort of them
        _sort_candidates(
            lists, r.to(tl.int64) * (2 * V), heavy, ends, yes, n_heavy, proc, wts, rowv,
            sorted_ids + r.to(tl.int64) * (4 * REG), sorted_w + r.to(tl.int64) * (4 * REG), CH, LOG_C, REG,
        )  # fmt: skip
    for s in range(2):
        # search s: 0 the top-k cut, 1 the top-p cut
        mode = tl.where(s == 1, 1, 0)
        run = tl.where(s == 0, k_on, p_on)
        exists, res_id, res_rank, res_run = _search(
            r, rowv, mode, k, tp * mass_k, run, positive, mass_all, n_heavy, m_heavy, tau, small_h, ends,
            proc, wts, heavy, lists, sorted_ids, sorted_w, V, CH, REG, SAMPLES, HALF, BLK, LOG_C,
        )  # fmt: skip
        if (s == 0) & run:
            mass_k = res_run
            keep = k
            total = res_run
            cut_id = res_id
            cut_w = tl.load(wts + rowv + tl.maximum(res_id, 0))
        if s == 1:
            if run:
                cut = tl.where(exists, res_rank + 1, positive)
                if cut < keep:
                    keep = cut
                    total = res_run
                    cut_id = res_id
                    cut_w = tl.load(wts + rowv + tl.maximum(res_id, 0))
            if m_on & (min_count < keep):
                keep = min_count
                total = min_mass
                cut_w = _next_down(mp)  # w > cut_w: w >= min_p
                cut_id = tl.full([], -1, tl.int32)
    return cut_w, cut_id, total


@_jit
def _kept(w: tl.tensor, ids: tl.tensor, cut_w: tl.tensor, cut_id: tl.tensor) -> Any:
    """Whether ids of weights ``w`` lie in the kept prefix the cut ``(cut_w, cut_id)`` ends."""
    return (w > 0.0) & ((w > cut_w) | ((w == cut_w) & (ids <= cut_id)))


# ----------------------------------------------------------------------------------------------
# draft_sample
# ----------------------------------------------------------------------------------------------


@_jit
def _draft_chunk_kernel(
    logits: tl.tensor,
    token_rows: tl.tensor,
    proc: tl.tensor,
    chunk_max: tl.tensor,
    chunk_bad: tl.tensor,
    V: tl.constexpr,
    VL: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program ``(r, c)``: chunk c of drafting lane r's logits limited to ``VL`` into ``proc``, its
    maximum and its count of non-finite logits below ``VL``."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    _pdl_prologue(USE_PDL)
    drafting = r >= 0
    if HAS_ROWS:
        drafting = tl.load(token_rows + r) >= 0
    if drafting:
        offs = c * CH + tl.arange(0, CH)
        valid = offs < V
        inside = offs < VL
        rowv = r.to(tl.int64) * V
        x = tl.load(logits + rowv + offs, mask=inside, other=float("-inf")).to(tl.float32)
        bad = inside & ((x != x) | (tl.abs(x) == float("inf")))
        lg = tl.where(inside & (~bad), x, float("-inf"))
        tl.store(proc + rowv + offs, lg, mask=valid)
        tl.store(chunk_max + r * C + c, tl.max(lg, axis=0))
        tl.store(chunk_bad + r * C + c, tl.sum(bad.to(tl.int32), axis=0))


@_jit
def _draft_status_kernel(
    token_rows: tl.tensor,
    temperature: tl.tensor,
    top_k: tl.tensor,
    top_p: tl.tensor,
    min_p: tl.tensor,
    step: tl.tensor,
    chunk_bad: tl.tensor,
    status: tl.tensor,
    sampled: tl.tensor,
    ids: tl.tensor,
    confidence: tl.tensor,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r: lane r's status (0 none, 1 greedy, 2 sampled) and sampled flag; a drafting lane that
    cannot draft gets id 0 and confidence 0."""
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    drafting = r >= 0
    if HAS_ROWS:
        drafting = tl.load(token_rows + r) >= 0
    ci = tl.arange(0, C_PAD)
    bad = tl.sum(tl.load(chunk_bad + r * C + ci, mask=(ci < C) & drafting, other=0), axis=0)
    t = tl.load(temperature + r).to(tl.float64)
    tp = tl.load(top_p + r).to(tl.float64)
    mp = tl.load(min_p + r).to(tl.float64)
    valid = (bad == 0) & (t >= 0.0) & (t < float("inf")) & (tl.load(top_k + r) >= 0)
    valid = valid & (tp > 0.0) & (tp <= 1.0) & (mp >= 0.0) & (mp <= 1.0) & (tl.load(step + r) >= 0)
    state = tl.where(drafting & valid, tl.where(t > 0.0, 2, 1), 0)
    tl.store(status + r, state.to(tl.int32))
    tl.store(sampled + r, (state == 2).to(tl.uint8))
    if drafting & (state == 0):
        tl.store(ids + r, tl.zeros([], tl.int32).to(ids.dtype.element_ty))
        tl.store(confidence + r, tl.zeros([], tl.float32))


@_jit
def _draft_cut_kernel(
    status: tl.tensor,
    top_k: tl.tensor,
    top_p: tl.tensor,
    min_p: tl.tensor,
    proc: tl.tensor,
    wts: tl.tensor,
    heavy: tl.tensor,
    lists: tl.tensor,
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    agg_count: tl.tensor,
    agg_mass: tl.tensor,
    cut_w: tl.tensor,
    cut_id: tl.tensor,
    cut_total: tl.tensor,
    V: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    REG: tl.constexpr,
    SAMPLES: tl.constexpr,
    HALF: tl.constexpr,
    BLK: tl.constexpr,
    LOG_C: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r: sampled lane r's cut and kept mass."""
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    if tl.load(status + r) == 2:
        w_c, id_c, total = _kept_cut(
            r, r.to(tl.int64) * V, top_k, top_p, min_p, proc, wts, heavy, lists, sorted_ids, sorted_w,
            agg_count, agg_mass, V, CH, C, C_PAD, REG, SAMPLES, HALF, BLK, LOG_C,
        )  # fmt: skip
        tl.store(cut_w + r, w_c)
        tl.store(cut_id + r, id_c)
        tl.store(cut_total + r, total)


@_jit
def _draft_row_kernel(
    status: tl.tensor,
    ids: tl.tensor,
    wts: tl.tensor,
    cut_w: tl.tensor,
    cut_id: tl.tensor,
    cut_total: tl.tensor,
    probabilities: tl.tensor,
    row_sum: tl.tensor,
    row_last: tl.tensor,
    index: tl.tensor,
    V: tl.constexpr,
    D: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program ``(r, c)``: chunk c of ``probabilities[r, index]`` (q, one-hot or zeros by status), its
    float64 sum and its last positive id."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    _pdl_prologue(USE_PDL)
    state = tl.load(status + r)
    offs = c * CH + tl.arange(0, CH)
    valid = offs < V
    rowv = r.to(tl.int64) * V
    q = tl.zeros([CH], tl.float32)
    if state == 2:
        w = tl.load(wts + rowv + offs, mask=valid, other=0.0)
        kept = valid & _kept(w, offs, tl.load(cut_w + r), tl.load(cut_id + r))
        q = tl.where(kept, (w / tl.load(cut_total + r)).to(tl.float32), 0.0)
    elif state == 1:
        q = tl.where(offs == tl.load(ids + r).to(tl.int32), 1.0, 0.0)
    row = (r.to(tl.int64) * D + index) * V
    tl.store(probabilities + row + offs, q, mask=valid)
    tl.store(row_sum + r * C + c, tl.sum(q.to(tl.float64), axis=0))
    tl.store(row_last + r * C + c, tl.max(tl.where(q > 0.0, offs, -1), axis=0))


@_jit
def _draw_chunk(sums: tl.tensor, lasts: tl.tensor, u: tl.tensor, C: tl.constexpr, C_PAD: tl.constexpr) -> Any:
    """Where a draw in id order lands among chunks of float64 sums ``sums`` (last positive ids
    ``lasts``): ``(chunk, running sum before it, target, fallback id)``; ``chunk == C_PAD`` when rounding
    leaves the target past the last chunk (the fallback is then the last positive id)."""
    ci = tl.arange(0, C_PAD)
    target = u * tl.sum(sums, axis=0)
    running = tl.cumsum(sums, axis=0)
    chunk = tl.min(tl.where((running > target) & (ci < C), ci, C_PAD), axis=0)
    before = tl.sum(tl.where(ci == chunk - 1, running, 0.0), axis=0)
    fallback = tl.where(chunk < C, tl.sum(tl.where(ci == chunk, lasts, 0), axis=0), tl.max(lasts, axis=0))
    return chunk, before, target, fallback


@_jit
def _draw_within(values: tl.tensor, offs: tl.tensor, valid: tl.tensor, before: tl.tensor, target: tl.tensor) -> Any:
    """The first id of a chunk whose running sum (``before`` plus the chunk's float64 ``values`` in id
    order) exceeds ``target``, or -1."""
    inner = before + tl.cumsum(tl.where(valid, values, 0.0), axis=0)
    hit = tl.min(tl.where((inner > target) & valid, offs, 2147483647), axis=0)
    return tl.where(hit < 2147483647, hit, -1)


@_jit
def _draft_draw_kernel(
    status: tl.tensor,
    seed: tl.tensor,
    step: tl.tensor,
    probabilities: tl.tensor,
    row_sum: tl.tensor,
    row_last: tl.tensor,
    ids: tl.tensor,
    confidence: tl.tensor,
    index: tl.tensor,
    V: tl.constexpr,
    D: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    KEY: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r: sampled lane r's id, the first whose running sum of q (id order) exceeds ``u`` times
    the row's sum, and its confidence ``q[id]``."""
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    if tl.load(status + r) == 2:
        row = probabilities + (r.to(tl.int64) * D + index) * V
        u = _stream_uniform(tl.load(seed + r), tl.load(step + r).to(tl.int64) + index, KEY)
        ci = tl.arange(0, C_PAD)
        sums = tl.load(row_sum + r * C + ci, mask=ci < C, other=0.0)
        lasts = tl.load(row_last + r * C + ci, mask=ci < C, other=-1)
        chunk, before, target, token = _draw_chunk(sums, lasts, u, C, C_PAD)
        if chunk < C:
            offs = chunk * CH + tl.arange(0, CH)
            valid = offs < V
            q = tl.load(row + offs, mask=valid, other=0.0).to(tl.float64)
            hit = _draw_within(q, offs, valid, before, target)
            token = tl.where(hit >= 0, hit, token)
        token = tl.maximum(token, 0)
        tl.store(ids + r, token.to(ids.dtype.element_ty))
        tl.store(confidence + r, tl.load(row + token))


# ----------------------------------------------------------------------------------------------
# sample_verify_sampled
# ----------------------------------------------------------------------------------------------


@_jit
def _verify_split_kernel(
    query_length: tl.tensor,
    temperature: tl.tensor,
    flags: tl.tensor,
    sample_flags: tl.tensor,
    verify_flags: tl.tensor,
    CAPACITY: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r: lane r's position-0 flag split into sampled (``sample``'s launches) and verified."""
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    live = tl.load(flags + r) != 0
    offers = tl.minimum(tl.load(query_length + r).to(tl.int64) - 1, CAPACITY)
    verified = live & (offers > 0) & (tl.load(temperature + r).to(tl.float64) > 0.0)
    tl.store(sample_flags + r, (live & (~verified)).to(tl.uint8))
    tl.store(verify_flags + r, verified.to(tl.uint8))


@_jit
def _target_and_residual(
    w: tl.tensor,
    d: tl.tensor,
    offs: tl.tensor,
    valid: tl.tensor,
    cut_w: tl.tensor,
    cut_id: tl.tensor,
    total: tl.tensor,
    mass: tl.tensor,
) -> Any:
    """``p = w / W`` on kept ids (else 0) and ``max(0, p - d / Q)``, float64, as the reference forms them."""
    p = tl.where(valid & _kept(w, offs, cut_w, cut_id), w / total, 0.0)
    residual = tl.where(valid, tl.maximum(p - d.to(tl.float64) / mass, 0.0), 0.0)
    return p, residual


@_jit
def _verify_accept_kernel(
    verify_flags: tl.tensor,
    steps: tl.tensor,
    top_k: tl.tensor,
    top_p: tl.tensor,
    min_p: tl.tensor,
    seed: tl.tensor,
    candidates: tl.tensor,
    drafts: tl.tensor,
    proc: tl.tensor,
    chunk_max: tl.tensor,
    wts: tl.tensor,
    heavy: tl.tensor,
    lists: tl.tensor,
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    agg_count: tl.tensor,
    agg_mass: tl.tensor,
    cut_w: tl.tensor,
    cut_id: tl.tensor,
    cut_total: tl.tensor,
    draft_mass: tl.tensor,
    verdict: tl.tensor,
    position: tl.tensor,
    V: tl.constexpr,
    D: tl.constexpr,
    CAPACITY: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    REG: tl.constexpr,
    SAMPLES: tl.constexpr,
    HALF: tl.constexpr,
    BLK: tl.constexpr,
    LOG_C: tl.constexpr,
    DBLK: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r: verified lane r's cut, kept mass and draft-row sum at position j, and its verdict
    (0: the lane ends, 1: the candidate is accepted, 2: rejected)."""
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    j = position.to(tl.int64)
    state = tl.zeros([], tl.int32)
    if tl.load(verify_flags + r) != 0:
        ci = tl.arange(0, C_PAD)
        peak = tl.max(tl.load(chunk_max + r * C + ci, mask=ci < C, other=float("-inf")), axis=0)
        if peak > float("-inf"):
            rowv = r.to(tl.int64) * V
            w_c, id_c, total = _kept_cut(
                r, rowv, top_k, top_p, min_p, proc, wts, heavy, lists, sorted_ids, sorted_w, agg_count, agg_mass,
                V, CH, C, C_PAD, REG, SAMPLES, HALF, BLK, LOG_C,
            )  # fmt: skip
            row = drafts + (r.to(tl.int64) * D + j) * V
            acc = tl.zeros([DBLK], tl.float64)
            bad = tl.zeros([DBLK], tl.int32)
            for first in range(0, V, DBLK):
                offs = first + tl.arange(0, DBLK)
                inside = offs < V
                d = tl.load(row + offs, mask=inside, other=0.0).to(tl.float64)
                bad += (inside & ((d != d) | (d < 0.0) | (d == float("inf")))).to(tl.int32)
                acc += tl.where(inside, d, 0.0)
            mass = tl.sum(acc, axis=0)
            if (tl.sum(bad, axis=0) == 0) & (mass > 0.0):
                x = tl.load(candidates + r.to(tl.int64) * CAPACITY + j).to(tl.int64)
                offered = (x >= 0) & (x < V)
                xs = tl.where(offered, x, 0)
                wx = tl.load(wts + rowv + xs)
                px = tl.where(_kept(wx, xs, w_c, id_c), wx / total, 0.0)
                qx = tl.load(row + xs).to(tl.float64) / mass
                u = _counter_uniform(tl.load(seed + r), tl.load(steps + r))
                state = tl.where(offered & (u * qx < px), 1, 2).to(tl.int32)
                tl.store(cut_w + r, w_c)
                tl.store(cut_id + r, id_c)
                tl.store(cut_total + r, total)
                tl.store(draft_mass + r, mass)
    tl.store(verdict + r, state)


@_jit
def _verify_residual_kernel(
    verdict: tl.tensor,
    drafts: tl.tensor,
    wts: tl.tensor,
    cut_w: tl.tensor,
    cut_id: tl.tensor,
    cut_total: tl.tensor,
    draft_mass: tl.tensor,
    sums: tl.tensor,
    lasts: tl.tensor,
    position: tl.tensor,
    V: tl.constexpr,
    D: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program ``(r, c)``, a rejected lane: chunk c's float64 sums of the residual and of p (``sums[r, c,
    0:2]``) and their last positive ids."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    _pdl_prologue(USE_PDL)
    if tl.load(verdict + r) == 2:
        offs = c * CH + tl.arange(0, CH)
        valid = offs < V
        rowv = r.to(tl.int64) * V
        w = tl.load(wts + rowv + offs, mask=valid, other=0.0)
        d = tl.load(drafts + (r.to(tl.int64) * D + position) * V + offs, mask=valid, other=0.0)
        p, residual = _target_and_residual(
            w, d, offs, valid, tl.load(cut_w + r), tl.load(cut_id + r), tl.load(cut_total + r), tl.load(draft_mass + r)
        )
        slot = (r * C + c) * 2
        tl.store(sums + slot, tl.sum(residual, axis=0))
        tl.store(sums + slot + 1, tl.sum(p, axis=0))
        tl.store(lasts + slot, tl.max(tl.where(residual > 0.0, offs, -1), axis=0))
        tl.store(lasts + slot + 1, tl.max(tl.where(p > 0.0, offs, -1), axis=0))


@_jit
def _verify_finish_kernel(
    verify_flags: tl.tensor,
    rows: tl.tensor,
    steps: tl.tensor,
    seed: tl.tensor,
    candidates: tl.tensor,
    drafts: tl.tensor,
    output_counts: tl.tensor,
    proc: tl.tensor,
    chunk_max: tl.tensor,
    chunk_sum: tl.tensor,
    wts: tl.tensor,
    cut_w: tl.tensor,
    cut_id: tl.tensor,
    cut_total: tl.tensor,
    draft_mass: tl.tensor,
    verdict: tl.tensor,
    sums: tl.tensor,
    lasts: tl.tensor,
    drawn: tl.tensor,
    drawn_logprob: tl.tensor,
    taken: tl.tensor,
    position: tl.tensor,
    V: tl.constexpr,
    D: tl.constexpr,
    CAPACITY: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    KEY: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program r, a verified lane: its token (the candidate, or the residual draw), its log-probability,
    whether it was accepted, and the token counted in ``output_counts``."""
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    if tl.load(verify_flags + r) != 0:
        j = position.to(tl.int64)
        state = tl.load(verdict + r)
        token = tl.full([], -1, tl.int32)
        out_lp = tl.zeros([], tl.float32)
        if state != 0:
            token = tl.load(candidates + r.to(tl.int64) * CAPACITY + j).to(tl.int32)
            rowv = r.to(tl.int64) * V
            if state == 2:
                ci = tl.arange(0, C_PAD)
                live = ci < C
                slot = (r * C + ci) * 2
                residual_sums = tl.load(sums + slot, mask=live, other=0.0)
                residual_lasts = tl.load(lasts + slot, mask=live, other=-1)
                use_residual = tl.sum(residual_sums, axis=0) > 0.0  # else p = q up to rounding: draw from p
                chosen = tl.where(use_residual, residual_sums, tl.load(sums + slot + 1, mask=live, other=0.0))
                chosen_lasts = tl.where(use_residual, residual_lasts, tl.load(lasts + slot + 1, mask=live, other=-1))
                u = _stream_uniform(tl.load(seed + r), tl.load(steps + r), KEY)
                chunk, before, target, token = _draw_chunk(chosen, chosen_lasts, u, C, C_PAD)
                if chunk < C:
                    offs = chunk * CH + tl.arange(0, CH)
                    valid = offs < V
                    w = tl.load(wts + rowv + offs, mask=valid, other=0.0)
                    d = tl.load(drafts + (r.to(tl.int64) * D + j) * V + offs, mask=valid, other=0.0)
                    p, residual = _target_and_residual(
                        w, d, offs, valid, tl.load(cut_w + r), tl.load(cut_id + r), tl.load(cut_total + r),
                        tl.load(draft_mass + r),
                    )  # fmt: skip
                    hit = _draw_within(tl.where(use_residual, residual, p), offs, valid, before, target)
                    token = tl.where(hit >= 0, hit, token)
                token = tl.minimum(tl.maximum(token, 0), V - 1)
            ci = tl.arange(0, C_PAD)
            cm = tl.load(chunk_max + r * C + ci, mask=ci < C, other=float("-inf"))
            m64 = tl.max(cm, axis=0).to(tl.float64)
            cs = tl.load(chunk_sum + r * C + ci, mask=ci < C, other=0.0)
            log_z = tl.log(tl.sum(tl.where(cm > float("-inf"), cs * tl.exp(cm.to(tl.float64) - m64), 0.0), axis=0))
            out_lp = ((tl.load(proc + rowv + token).to(tl.float64) - m64) - log_z).to(tl.float32)
            tl.atomic_add(output_counts + tl.load(rows + r).to(tl.int64) * V + token, 1)
        tl.store(drawn + r, token)
        if HAS_LOGPROB:
            tl.store(drawn_logprob + r, out_lp)
        tl.store(taken + r, (state == 1).to(tl.uint8))


@_jit
def _verify_record_kernel(
    logits: tl.tensor,
    query_length: tl.tensor,
    temperature: tl.tensor,
    candidates: tl.tensor,
    starts: tl.tensor,
    flags: tl.tensor,
    sample_flags: tl.tensor,
    verify_flags: tl.tensor,
    taken: tl.tensor,
    drawn: tl.tensor,
    drawn_logprob: tl.tensor,
    scratch: tl.tensor,
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
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    """Program ``(r, c)`` after position ``j``: c == 0 records lane r's token and its flags for j + 1
    (sampled or verified); a lane that goes on copies chunk c of logits row ``start + j + 1``."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    _pdl_prologue(USE_PDL)
    j = position.to(tl.int64)
    here = j * STRIDE + r
    token, reached, offers, more, offered = _position_token(
        drawn, flags, query_length, candidates, r, j, here, CAPACITY
    )
    verified = tl.load(verify_flags + here) != 0
    go_on = more & tl.where(verified, tl.load(taken + here) != 0, token.to(tl.int64) == offered)
    if c == 0:
        if reached:
            _record_token(
                ids, logprob, drawn_logprob, accepted, emitted, pending, token, r, j, here, WIDTH, HAS_LOGPROB
            )
        if HAS_NEXT:
            next_verified = go_on & (j + 1 < offers) & (tl.load(temperature + r).to(tl.float64) > 0.0)
            tl.store(flags + here + STRIDE, go_on.to(tl.uint8))
            tl.store(sample_flags + here + STRIDE, (go_on & (~next_verified)).to(tl.uint8))
            tl.store(verify_flags + here + STRIDE, next_verified.to(tl.uint8))
    if HAS_NEXT:
        _copy_next_row(logits, starts, scratch, go_on, r, c, j, V, BLOCK_V)


# ----------------------------------------------------------------------------------------------
# lowerings
# ----------------------------------------------------------------------------------------------


def _sample_workspaces(ctx: LoweringContext, rows: int, vocab: int) -> dict[str, KernelArg]:
    """The workspaces of ``sample``'s launches (the same keys and dtypes as ``lower_sample``'s)."""
    chunks = cdiv(vocab, min(CHUNK, next_power_of_two(vocab)))
    slots = rows * chunks
    spaces = {
        "proc": ("sample.processed", mf.DTYPE_F32, rows * vocab),
        "wts": ("sample.weights", mf.DTYPE_F64, rows * vocab),
        "heavy": ("sample.heavy", mf.DTYPE_I32, rows * vocab),
        "lists": ("sample.candidates", mf.DTYPE_I32, 2 * rows * vocab),
        "chunk_max": ("sample.chunk_max", mf.DTYPE_F32, slots),
        "chunk_arg": ("sample.chunk_arg", mf.DTYPE_I32, slots),
        "chunk_sum": ("sample.chunk_sum", mf.DTYPE_F64, slots),
        "agg_count": ("sample.chunk_counts", mf.DTYPE_I32, slots * 4),
        "agg_mass": ("sample.chunk_masses", mf.DTYPE_F64, slots * 4),
        "sorted_ids": ("sample.sorted_ids", mf.DTYPE_I32, rows * 4 * REGISTER_CANDIDATES),
        "sorted_w": ("sample.sorted_weights", mf.DTYPE_F64, rows * 4 * REGISTER_CANDIDATES),
    }
    return {name: ctx.pointer(ctx.workspace(key, dtype, size)) for name, (key, dtype, size) in spaces.items()}


def _chunking(vocab: int) -> dict[str, int]:
    """``sample``'s chunking of a vocabulary and the search constants of its finishing launch."""
    chunk = min(CHUNK, next_power_of_two(vocab))
    chunk_pad = next_power_of_two(cdiv(vocab, chunk))
    return {
        "CH": chunk,
        "C": cdiv(vocab, chunk),
        "C_PAD": chunk_pad,
        "REG": REGISTER_CANDIDATES,
        "SAMPLES": WINDOW_SAMPLES,
        "HALF": WINDOW_HALF_WIDTH,
        "BLK": PASS_BLOCK,
        "LOG_C": chunk_pad.bit_length() - 1,
    }


def _weights_launch(
    ctx: LoweringContext,
    flags: KernelArg,
    temperature: KernelArg,
    min_p: KernelArg,
    spaces: dict[str, KernelArg],
    rows: int,
    vocab: int,
) -> mf.KernelLaunch:
    """``sample``'s weights launch over the flagged rows (whose state row is never negative)."""
    consts = _chunking(vocab)
    all_heavy = vocab <= REGISTER_CANDIDATES
    return ctx.launch(
        _sample_weight_kernel,
        {
            "active": flags,
            "rows": flags,
            "temperature": temperature,
            "min_p": min_p,
            "proc": spaces["proc"],
            "chunk_max": spaces["chunk_max"],
            "wts": spaces["wts"],
            "heavy": spaces["heavy"],
            "agg_count": spaces["agg_count"],
            "agg_mass": spaces["agg_mass"],
        },
        {
            "V": vocab,
            "CH": consts["CH"],
            "C": consts["C"],
            "C_PAD": consts["C_PAD"],
            "SAMPLES": THRESHOLD_SAMPLES,
            "SAMPLE_AT": 0 if all_heavy else THRESHOLD_SAMPLES * HEAVY_TARGET // vocab,
            "ALL_HEAVY": all_heavy,
        },
        (rows, consts["C"]),
        num_warps=8,
    )


def _search_spaces(spaces: dict[str, KernelArg]) -> dict[str, KernelArg]:
    """The workspaces a kept-set search reads and sorts into, in the order the kernels take them."""
    return {name: spaces[name] for name in ("wts", "heavy", "lists", "sorted_ids", "sorted_w", "agg_count", "agg_mass")}


def _cut_spaces(ctx: LoweringContext, lanes: int) -> dict[str, KernelArg]:
    """Each lane's cut ``(w_c, id_c)`` and kept mass: ``cut_w``, ``cut_id`` and ``cut_total``."""
    return {
        "cut_w": ctx.pointer(ctx.workspace("sampled.cut_weight", mf.DTYPE_F64, lanes)),
        "cut_id": ctx.pointer(ctx.workspace("sampled.cut_id", mf.DTYPE_I32, lanes)),
        "cut_total": ctx.pointer(ctx.workspace("sampled.cut_total", mf.DTYPE_F64, lanes)),
    }


def _chunk_spaces(ctx: LoweringContext, lanes: int, chunks: int) -> tuple[KernelArg, KernelArg]:
    """Each lane's per-chunk float64 sums and last positive ids of a draw (two of each a chunk)."""
    sums = ctx.pointer(ctx.workspace("sampled.chunk_sums", mf.DTYPE_F64, lanes * chunks * 2))
    lasts = ctx.pointer(ctx.workspace("sampled.chunk_lasts", mf.DTYPE_I32, lanes * chunks * 2))
    return sums, lasts


def _int_attribute(ctx: LoweringContext, node: mf.Node, name: str, low: int, high: int) -> int:
    value = ctx.attribute(node, name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ctx.fail(f"attribute {name}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _draft_rows(ctx: LoweringContext, node: mf.Node, lanes: int, vocab: int) -> tuple[KernelArg, int]:
    view = ctx.need(node, "draft_probabilities")
    shape = ctx.shape(view)
    if len(shape) != 3 or shape[0] != lanes or shape[2] != vocab or shape[1] < 1:
        raise ctx.fail(f"draft_probabilities: expected [{lanes}, D, {vocab}], got shape {list(shape)}")
    return _typed(ctx, view, "draft_probabilities", (mf.DTYPE_F32,)), int(shape[1])


@lowering("draft_sample")
def lower_draft_sample(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """``draft_argmax``'s launch, then per-chunk logits, status, weights, cut, the q row and the draw."""
    logits_view = ctx.need(node, "logits")
    shape = ctx.shape(logits_view)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ctx.fail(f"logits: expected [B, V], got shape {list(shape)}")
    lanes, vocab = int(shape[0]), int(shape[1])
    limit = _int_attribute(ctx, node, "vocab_limit", 1, vocab)
    probabilities, drafts = _draft_rows(ctx, node, lanes, vocab)
    index = _int_attribute(ctx, node, "draft_index", 0, drafts - 1)
    ids = _per_lane(ctx, node, "ids", lanes, _INTS)
    confidence = _per_lane(ctx, node, "confidence", lanes, (mf.DTYPE_F32,))
    settings = {
        "temperature": _per_lane(ctx, node, "temperature", lanes, _SETTING_FLOATS),
        "top_k": _per_lane(ctx, node, "top_k", lanes, _INTS),
        "top_p": _per_lane(ctx, node, "top_p", lanes, _SETTING_FLOATS),
        "min_p": _per_lane(ctx, node, "min_p", lanes, _SETTING_FLOATS),
    }
    seed = _per_lane(ctx, node, "seed", lanes, _SEEDS)
    step = _per_lane(ctx, node, "step", lanes, _INTS)
    has_rows = ctx.arg(node, "token_rows") is not None
    # without token_rows the kernels never read the parameter (given the ids)
    token_rows = _per_lane(ctx, node, "token_rows", lanes, _INTS) if has_rows else ids
    consts = _chunking(vocab)
    chunk, chunks, chunk_pad = consts["CH"], consts["C"], consts["C_PAD"]
    spaces = _sample_workspaces(ctx, lanes, vocab)
    status = ctx.pointer(ctx.workspace("draft_sample.status", mf.DTYPE_I32, lanes))
    sampled = ctx.pointer(ctx.workspace("draft_sample.sampled", mf.DTYPE_U8, lanes))
    chunk_bad = ctx.pointer(ctx.workspace("draft_sample.chunk_bad", mf.DTYPE_I32, lanes * chunks))
    cut = _cut_spaces(ctx, lanes)
    row_sum, row_last = _chunk_spaces(ctx, lanes, chunks)
    launches = lower_draft_argmax(ctx, node)
    launches.append(
        ctx.launch(
            _draft_chunk_kernel,
            {
                "logits": ctx.pointer(logits_view),
                "token_rows": token_rows,
                "proc": spaces["proc"],
                "chunk_max": spaces["chunk_max"],
                "chunk_bad": chunk_bad,
            },
            {"V": vocab, "VL": limit, "CH": chunk, "C": chunks, "HAS_ROWS": has_rows},
            (lanes, chunks),
            num_warps=4,
        )
    )
    launches.append(
        ctx.launch(
            _draft_status_kernel,
            {
                "token_rows": token_rows,
                **settings,
                "step": step,
                "chunk_bad": chunk_bad,
                "status": status,
                "sampled": sampled,
                "ids": ids,
                "confidence": confidence,
            },
            {"C": chunks, "C_PAD": chunk_pad, "HAS_ROWS": has_rows},
            (lanes,),
            num_warps=1,
        )
    )
    launches.append(_weights_launch(ctx, sampled, settings["temperature"], settings["min_p"], spaces, lanes, vocab))
    launches.append(
        ctx.launch(
            _draft_cut_kernel,
            {
                "status": status,
                "top_k": settings["top_k"],
                "top_p": settings["top_p"],
                "min_p": settings["min_p"],
                "proc": spaces["proc"],
                **_search_spaces(spaces),
                **cut,
            },
            {"V": vocab, **consts},
            (lanes,),
            num_warps=8,
        )
    )
    launches.append(
        ctx.launch(
            _draft_row_kernel,
            {
                "status": status,
                "ids": ids,
                "wts": spaces["wts"],
                **cut,
                "probabilities": probabilities,
                "row_sum": row_sum,
                "row_last": row_last,
                "index": ctx.i32(index),
            },
            {"V": vocab, "D": drafts, "CH": chunk, "C": chunks},
            (lanes, chunks),
            num_warps=4,
        )
    )
    launches.append(
        ctx.launch(
            _draft_draw_kernel,
            {
                "status": status,
                "seed": seed,
                "step": step,
                "probabilities": probabilities,
                "row_sum": row_sum,
                "row_last": row_last,
                "ids": ids,
                "confidence": confidence,
                "index": ctx.i32(index),
            },
            {"V": vocab, "D": drafts, "CH": chunk, "C": chunks, "C_PAD": chunk_pad, "KEY": PROPOSAL_STREAM_KEY},
            (lanes,),
            num_warps=4,
        )
    )
    return launches


@lowering("sample_verify_sampled")
def lower_sample_verify_sampled(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """A begin and a split launch, then per position the ``sample`` launches over the sampled lanes,
    the verified lanes' launches and a record-and-copy launch."""
    logits_view, packed, vocab, logits_dtype = _verify_logits(ctx, node)
    limit = _int_attribute(ctx, node, "vocab_limit", 1, vocab)
    lengths = ctx.need(node, "query_length")
    lanes = _numel(ctx.shape(lengths))
    if lanes < 1:
        raise ctx.fail("query_length: no lanes")
    candidates, capacity = _candidates(ctx, node, lanes)
    drafts, depth = _draft_rows(ctx, node, lanes, vocab)
    if depth < capacity:
        raise ctx.fail(f"draft_probabilities: {depth} draft rows cannot cover {capacity} candidates")
    ids_view, width, logprob_view = _verify_ids(ctx, node, lanes, capacity)
    has_logprob = logprob_view is not None
    positions = capacity + 1
    outputs = _verify_outputs(ctx, node, ids_view, logprob_view, lanes)
    lane_args = {
        name: _per_lane(ctx, node, name, lanes, allowed)
        for name, allowed in (
            ("rows", _INTS),
            ("step", _INTS),
            ("active", _FLAGS),
            ("temperature", _SETTING_FLOATS),
            ("top_k", _INTS),
            ("top_p", _SETTING_FLOATS),
            ("min_p", _SETTING_FLOATS),
            ("repetition_penalty", _SETTING_FLOATS),
            ("frequency_penalty", _SETTING_FLOATS),
            ("presence_penalty", _SETTING_FLOATS),
            ("seed", _SEEDS),
        )
    }
    state = _state_tables(ctx, node, vocab)
    query_length = _typed(ctx, lengths, "query_length", _INTS)
    scratch_view = ctx.workspace("verify.logits", logits_dtype, lanes * vocab)
    scratch = ctx.pointer(scratch_view)
    starts = ctx.pointer(ctx.workspace("verify.starts", mf.DTYPE_I64, lanes))
    stride = cdiv(lanes, ROW_ALIGN) * ROW_ALIGN  # every position's row starts 16-byte aligned
    rows_of = {
        "steps": ctx.workspace("verify.steps", mf.DTYPE_I64, positions * stride),
        "flags": ctx.workspace("verify.active", mf.DTYPE_U8, positions * stride),
        "drawn": ctx.workspace("verify.ids", mf.DTYPE_I32, positions * stride),
        "drawn_logprob": ctx.workspace("verify.logprob", mf.DTYPE_F32, positions * stride),
        "sample_flags": ctx.workspace("verify.sampled", mf.DTYPE_U8, positions * stride),
        "verify_flags": ctx.workspace("verify.verified", mf.DTYPE_U8, positions * stride),
        "taken": ctx.workspace("verify.taken", mf.DTYPE_U8, positions * stride),
    }
    whole = {name: ctx.pointer(view) for name, view in rows_of.items()}
    consts = _chunking(vocab)
    chunk, chunks, chunk_pad = consts["CH"], consts["C"], consts["C_PAD"]
    spaces = _sample_workspaces(ctx, lanes, vocab)
    lane_space = {
        **_cut_spaces(ctx, lanes),
        "draft_mass": ctx.pointer(ctx.workspace("sampled.draft_mass", mf.DTYPE_F64, lanes)),
        "verdict": ctx.pointer(ctx.workspace("sampled.verdict", mf.DTYPE_I32, lanes)),
    }
    sums, lasts = _chunk_spaces(ctx, lanes, chunks)
    block_v = min(GATHER_BLOCK, next_power_of_two(vocab))
    copies = cdiv(vocab, block_v)
    block_l, _ = _lane_walk(lanes)
    launches = [
        ctx.launch(
            _verify_begin_kernel,
            {
                "logits": ctx.pointer(logits_view),
                "query_length": query_length,
                "rows": lane_args["rows"],
                "step": lane_args["step"],
                "active": lane_args["active"],
                "starts": starts,
                "steps": whole["steps"],
                "flags": whole["flags"],
                "scratch": scratch,
                # no grammar mask: never read
                "masks": outputs["ids"],
                "constrained": outputs["ids"],
                "mask_scratch": outputs["ids"],
                **outputs,
            },
            {
                "HAS_MASK": False,
                "WORDS": 1,
                "BLOCK_W": 1,
                "LANES": lanes,
                "STRIDE": stride,
                "V": vocab,
                "WIDTH": width,
                "POSITIONS": positions,
                "PACKED": packed,
                "HAS_LOGPROB": has_logprob,
                "BLOCK_L": block_l,
                "COL_PAD": next_power_of_two(max(width, positions)),
                "BLOCK_V": block_v,
            },
            (lanes, copies),
            num_warps=4,
        ),
        ctx.launch(
            _verify_split_kernel,
            {
                "query_length": query_length,
                "temperature": lane_args["temperature"],
                "flags": whole["flags"],
                "sample_flags": whole["sample_flags"],
                "verify_flags": whole["verify_flags"],
            },
            {"CAPACITY": capacity},
            (lanes,),
            num_warps=1,
        ),
    ]
    for position in range(positions):
        row = {name: ctx.pointer(_row_view(view, position, stride, [lanes])) for name, view in rows_of.items()}
        views = {
            "active": _row_view(rows_of["sample_flags"], position, stride, [lanes]),
            "step": _row_view(rows_of["steps"], position, stride, [lanes]),
            "ids": _row_view(rows_of["drawn"], position, stride, [lanes, 1]),
        }
        if has_logprob:
            views["logprob"] = _row_view(rows_of["drawn_logprob"], position, stride, [lanes, 1])
        launches.extend(_position_sample(ctx, node, scratch_view, lanes, vocab, views))
        last = position == positions - 1
        if position < capacity:  # a position at which a lane may verify a candidate
            launches.append(
                ctx.launch(
                    _sample_chunk_kernel,
                    {
                        "logits": scratch,
                        "active": row["verify_flags"],
                        "rows": lane_args["rows"],
                        "temperature": lane_args["temperature"],
                        "repetition_penalty": lane_args["repetition_penalty"],
                        "frequency_penalty": lane_args["frequency_penalty"],
                        "presence_penalty": lane_args["presence_penalty"],
                        "prompt_presence": state["prompt_presence"],
                        "output_counts": state["output_counts"],
                        "allowed_mask": spaces["chunk_arg"],  # no grammar mask: never read
                        "constrained": row["verify_flags"],
                        "proc": spaces["proc"],
                        "chunk_max": spaces["chunk_max"],
                        "chunk_arg": spaces["chunk_arg"],
                        "chunk_sum": spaces["chunk_sum"],
                    },
                    {"V": vocab, "VL": limit, "CH": chunk, "C": chunks, "MASK_WORDS": 1, "HAS_MASK": False},
                    (lanes, chunks),
                    num_warps=4,
                )
            )
            launches.append(
                _weights_launch(
                    ctx, row["verify_flags"], lane_args["temperature"], lane_args["min_p"], spaces, lanes, vocab
                )
            )
            launches.append(
                ctx.launch(
                    _verify_accept_kernel,
                    {
                        "verify_flags": row["verify_flags"],
                        "steps": row["steps"],
                        "top_k": lane_args["top_k"],
                        "top_p": lane_args["top_p"],
                        "min_p": lane_args["min_p"],
                        "seed": lane_args["seed"],
                        "candidates": candidates,
                        "drafts": drafts,
                        "proc": spaces["proc"],
                        "chunk_max": spaces["chunk_max"],
                        **_search_spaces(spaces),
                        **lane_space,
                        "position": ctx.i32(position),
                    },
                    {
                        "V": vocab,
                        "D": depth,
                        "CAPACITY": capacity,
                        **consts,
                        "DBLK": min(DRAFT_MASS_BLOCK, next_power_of_two(vocab)),
                    },
                    (lanes,),
                    num_warps=8,
                )
            )
            launches.append(
                ctx.launch(
                    _verify_residual_kernel,
                    {
                        "verdict": lane_space["verdict"],
                        "drafts": drafts,
                        "wts": spaces["wts"],
                        "cut_w": lane_space["cut_w"],
                        "cut_id": lane_space["cut_id"],
                        "cut_total": lane_space["cut_total"],
                        "draft_mass": lane_space["draft_mass"],
                        "sums": sums,
                        "lasts": lasts,
                        "position": ctx.i32(position),
                    },
                    {"V": vocab, "D": depth, "CH": chunk, "C": chunks},
                    (lanes, chunks),
                    num_warps=4,
                )
            )
            launches.append(
                ctx.launch(
                    _verify_finish_kernel,
                    {
                        "verify_flags": row["verify_flags"],
                        "rows": lane_args["rows"],
                        "steps": row["steps"],
                        "seed": lane_args["seed"],
                        "candidates": candidates,
                        "drafts": drafts,
                        "output_counts": state["output_counts"],
                        "proc": spaces["proc"],
                        "chunk_max": spaces["chunk_max"],
                        "chunk_sum": spaces["chunk_sum"],
                        "wts": spaces["wts"],
                        "cut_w": lane_space["cut_w"],
                        "cut_id": lane_space["cut_id"],
                        "cut_total": lane_space["cut_total"],
                        "draft_mass": lane_space["draft_mass"],
                        "verdict": lane_space["verdict"],
                        "sums": sums,
                        "lasts": lasts,
                        "drawn": row["drawn"],
                        "drawn_logprob": row["drawn_logprob"],
                        "taken": row["taken"],
                        "position": ctx.i32(position),
                    },
                    {
                        "V": vocab,
                        "D": depth,
                        "CAPACITY": capacity,
                        "CH": chunk,
                        "C": chunks,
                        "C_PAD": chunk_pad,
                        "KEY": RESIDUAL_STREAM_KEY,
                        "HAS_LOGPROB": has_logprob,
                    },
                    (lanes,),
                    num_warps=4,
                )
            )
        launches.append(
            ctx.launch(
                _verify_record_kernel,
                {
                    "logits": ctx.pointer(logits_view),
                    "query_length": query_length,
                    "temperature": lane_args["temperature"],
                    "candidates": candidates,
                    "starts": starts,
                    "flags": whole["flags"],
                    "sample_flags": whole["sample_flags"],
                    "verify_flags": whole["verify_flags"],
                    "taken": whole["taken"],
                    "drawn": whole["drawn"],
                    "drawn_logprob": whole["drawn_logprob"],
                    "scratch": scratch,
                    **outputs,
                    "position": ctx.i32(position),
                },
                {
                    "STRIDE": stride,
                    "V": vocab,
                    "WIDTH": width,
                    "CAPACITY": capacity,
                    "HAS_NEXT": not last,
                    "HAS_LOGPROB": has_logprob,
                    "BLOCK_V": block_v,
                },
                (lanes, 1 if last else copies),
                num_warps=4,
            )
        )
    return launches
