"""Sampling kernels: seeded per-request sampling, the grammar mask and prompt log-probabilities.

Owns the Triton kernels and the lowerings of the ``sample``, ``apply_grammar_mask`` and
``log_softmax_gather`` operators. The semantics are those of
:mod:`helios_core.backends.reference_kernels` (``sample``, ``apply_grammar_mask``,
``log_softmax_gather``) as adapted by the reference backend.

``sample`` lowers to three launches (four with ``top_n > 0``) that split the vocabulary into chunks
of ``CHUNK`` ids:

1. grid ``(B, G)`` (``G <= C`` programs a row, each taking every ``G``-th chunk of its row: see
   :func:`choose_sample_layout`): for each chunk of one row, a program applies the vocabulary limit,
   the penalties and the grammar mask and writes the chunk's maximum, its lowest arg-maximum (one
   reduction of int64 keys that order values with their ids) and its sum of ``exp(l - max)`` to
   workspaces; rows with ``temperature > 0`` also write their processed logits (workspace ``[B, V]``
   float32).
1b. with ``top_n > 0``, grid ``(B, G)``: every program finds the row's ``top_n``-th largest chunk
   maximum; only the chunks whose maximum reaches it can hold one of the row's top ``top_n`` ids
   (those maxima are ``top_n`` distinct ids), so only they process their logits again and write
   their top ``top_n`` ``(value desc, id asc)``, one key reduction an entry. The finishing launch
   reads the entries of those chunks alone.
2. grid ``(B, G)``, rows with ``temperature > 0`` only (the others return at once): every program
   merges the chunk maxima into the row maximum ``M``, writes its chunks' float64 weights
   ``w = exp((l - M) / T)`` (workspace ``[B, V]``) and per-chunk counts and masses: of positive
   weights, of weights ``>= min_p`` and of *heavy* weights, those at or above a per-row threshold
   read from a fixed sample of the row so that about ``HEAVY_TARGET`` ids qualify; the ids of the
   heavy weights go, in id order, to the chunk's stretch of a ``[B, V]`` list.
3. grid ``(B,)``: merges the partials into the argmax, the log-sum-exp and the top-N. Greedy rows
   take the argmax. Rows with ``temperature > 0`` run the reference's filtered draw over the order
   ``(w desc, id asc)``: the top-k cut, the top-p cut and the draw are each a *search* for the first
   id of that order at which a running count (top-k) or running weight (top-p: ``>=`` its target,
   the draw: ``>``) reaches a target, and the min-p cut is a count of the weights launch. The heavy
   ids are sorted once per row (at most ``REGISTER_CANDIDATES`` of them, staged in a workspace); a
   search whose answer lies among them is one vectorized scan. Other searches narrow a range of
   weights: each step samples the candidates, places a window of weights around the estimated
   answer and makes one pass over the candidates that counts and sums the weights above and inside
   it and compacts the window's ids (in id order, into one of two ``[B, V]`` lists), until the
   candidates fit in registers or share one weight (then the answer is found by position).
   Equal weights are ordered by id as the reference does. Finally the row writes its outputs
   (inactive rows: id -1, logprob 0, top ids -1, top logprobs 0) and adds 1 to
   ``output_counts[rows[i], id]``.

Arithmetic follows the reference: penalties in float32 with correctly rounded division and
products (no fused multiply-add), weights in float64 from the same formula, ``counter_uniform``
bit for bit in uint64 arithmetic. Running weights are float64 sums in a parallel order rather than
the reference's sequential one, so a draw or a top-p cut can differ from the reference only where
its target lies within float64 rounding of a cumulative boundary. Reported log-probabilities are
``(l - M) - log(sum exp(l - M))`` combined in float64 from float32 ``exp`` terms summed per chunk in
float64 (about 1e-6 from the reference); top-N entries are ranked by their float32 log-probability,
then id. Every result of a row depends only on that row's inputs and every reduction has a fixed
order, so results repeat exactly from run to run.

Where the reference raises, the kernels do not fault: an active row naming a negative state row,
or left without a finite logit, reads like an inactive row; ``log_softmax_gather`` scores a target
at or above ``vocab_limit`` as ``-inf``. The number of state rows is never compiled in (state rows
are trusted to lie in range); output counts are assumed below ``2**24`` (the reference rounds them
to float32 before the frequency penalty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from helios_core.wire import manifest_pb2 as mf
from ignition.kernels.linear import MULTIPROCESSORS
from ignition.kernels.lowering import KernelArg, LoweringContext, cdiv, lowering, next_power_of_two

__all__ = [
    "CHUNK",
    "HEAVY_TARGET",
    "REGISTER_CANDIDATES",
    "SampleLayout",
    "choose_sample_layout",
    "lower_apply_grammar_mask",
    "lower_log_softmax_gather",
    "lower_sample",
]

CHUNK = 2048
"""Vocabulary ids per program of the chunked ``sample`` launches (smaller vocabularies: one chunk)."""
REGISTER_CANDIDATES = 2048
"""Candidates a search sorts in registers."""
HEAVY_TARGET = 1024
"""Heavy ids the per-row weight threshold aims at (a search among them needs no pass over the row)."""
THRESHOLD_SAMPLES = 512
"""Processed logits sampled (at fixed positions) to choose the heavy-weight threshold."""
WINDOW_SAMPLES = 2048
"""Candidates sampled to place a search window."""
WINDOW_HALF_WIDTH = 48
"""Sampled candidates on each side of a search's estimated answer that its window spans."""
PASS_BLOCK = 1024
"""Candidates per step of a pass over a row or a candidate list."""
MAX_TOP_N = 64
"""Largest supported ``top_n``."""
PROGRAMS_PER_MULTIPROCESSOR = 8
"""Programs of a chunked ``sample`` launch a multiprocessor gets when rows share their chunks out."""
MASK_BLOCK = 1024
SOFTMAX_BLOCK = 4096

_FLOATS = (mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16, mf.DTYPE_F64)
_INTS = (mf.DTYPE_I32, mf.DTYPE_I64)
_FLAGS = (mf.DTYPE_U8, mf.DTYPE_I32)
_WORDS = (mf.DTYPE_I32, mf.DTYPE_U32)


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` with a type for the checker (Triton itself is untyped)."""
    return triton.jit(fn)


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@_jit
def _pdl_prologue(USE_PDL: tl.constexpr) -> None:
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@_jit
def _counter_uniform(seed: tl.tensor, step: tl.tensor) -> Any:
    """``(splitmix64(seed, step) >> 11) * 2**-53`` in uint64 arithmetic (float64 in [0, 1))."""
    z = seed.to(tl.uint64, bitcast=True) + (step.to(tl.int64).to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 11).to(tl.float64) * 1.1102230246251565e-16


@_jit
def _reached(
    mode: tl.tensor, target_count: tl.tensor, target_mass: tl.tensor, count: tl.tensor, mass: tl.tensor
) -> Any:
    """Whether a running (count, weight) has reached a search's target.

    mode 0: ``count >= target_count`` (rank); 1: ``mass >= target_mass`` (top-p); 2: ``mass >
    target_mass`` (the draw).
    """
    return tl.where(mode == 0, count >= target_count, tl.where(mode == 1, mass >= target_mass, mass > target_mass))


@_jit
def _next_up(x: tl.tensor) -> Any:
    """The next float64 above ``x >= 0``."""
    return (x.to(tl.int64, bitcast=True) + 1).to(tl.float64, bitcast=True)


@_jit
def _next_down(x: tl.tensor) -> Any:
    """The next float64 below ``x > 0``."""
    return (x.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)


@_jit
def _order_key(lg: tl.tensor, offs: tl.tensor) -> Any:
    """int64 keys ordered as (value desc, id asc) by their own order: the largest key is the largest
    value at its lowest id. Both zeros share one key; the value and id come back through
    :func:`_key_value` and :func:`_key_id`."""
    bits = tl.where(lg == 0.0, 0.0, lg).to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of the float
    return (mono.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)


@_jit
def _key_value(key: tl.tensor) -> Any:
    mono = (key >> 32).to(tl.int32)
    return (mono ^ ((mono >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@_jit
def _key_id(key: tl.tensor) -> Any:
    return 2147483647 - key.to(tl.int32)


@_jit
def _sort_candidates(
    lists: tl.tensor,
    src: tl.tensor,
    heavy: tl.tensor,
    ends: tl.tensor,
    from_heavy: tl.tensor,
    n: tl.tensor,
    proc: tl.tensor,
    wts: tl.tensor,
    rowv: tl.tensor,
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    CH: tl.constexpr,
    LOG_C: tl.constexpr,
    REG: tl.constexpr,
) -> None:
    """Sort ``n <= REG`` candidate ids by (logit desc, id asc), the weight order up to weight ties.

    The candidates are ``lists[src:src+n]``, or with ``from_heavy`` the heavy ids of the row (chunk
    ``c``'s stretch of ``heavy`` holds its heavy ids and ends at position ``ends[c]`` of their
    concatenation). Writes the sorted ids and their logit keys to ``sorted_ids[:REG]`` and
    ``sorted_ids[REG:2*REG]``, their weights and running weights to ``sorted_w`` likewise.
    """
    tl.debug_barrier()  # earlier readers of these slots are done
    j = tl.arange(0, REG)
    valid = j < n
    # heavy position j lies in chunk #(ends <= j): a binary search over the sorted ends
    chunk = tl.zeros([REG], tl.int32)
    for level in tl.static_range(LOG_C):
        step = 1 << (LOG_C - 1 - level)
        probe = tl.gather(ends, chunk + step - 1, 0)
        chunk = tl.where(probe <= j, chunk + step, chunk)
    first = tl.where(chunk > 0, tl.gather(ends, tl.maximum(chunk - 1, 0), 0), 0)
    from_list = tl.load(lists + src + j, mask=valid & (from_heavy == 0), other=0)
    from_chunk = tl.load(heavy + rowv + chunk * CH + (j - first), mask=valid & from_heavy, other=0)
    cid = tl.where(from_heavy, from_chunk, from_list)
    logit = tl.load(proc + rowv + cid, mask=valid, other=0.0)
    key = tl.where(valid, _order_key(logit, cid), -9223372036854775807 - 1)
    ordered = tl.sort(key, descending=True)
    sid = _key_id(ordered)
    smono = (ordered >> 32).to(tl.int32)
    sw = tl.load(wts + rowv + sid, mask=valid, other=0.0)
    tl.store(sorted_ids + j, sid)
    tl.store(sorted_ids + REG + j, smono)
    tl.store(sorted_w + j, sw)
    tl.store(sorted_w + REG + j, tl.cumsum(sw, axis=0))
    tl.debug_barrier()


@_jit
def _pick(
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    n: tl.tensor,
    base_count: tl.tensor,
    base_mass: tl.tensor,
    mode: tl.tensor,
    target_count: tl.tensor,
    target_mass: tl.tensor,
    REG: tl.constexpr,
) -> Any:
    """Search ``n`` candidates sorted by :func:`_sort_candidates`: a stretch of the order after
    ``base_count`` ids of weight ``base_mass``.

    Returns (id, rank, running weight up to and including it) of the first candidate at which the
    search's target is reached, or of the last candidate when rounding leaves none. Equal weights
    are ordered by id (distinct logits whose float64 weights coincide are re-ordered here).
    """
    j = tl.arange(0, REG)
    valid = j < n
    running = tl.load(sorted_w + REG + j)
    hit = valid & _reached(mode, target_count, target_mass, base_count + j + 1, base_mass + running)
    first = tl.min(tl.where(hit, j, REG), axis=0)
    first = tl.where(first < REG, first, tl.maximum(n - 1, 0).to(tl.int32))
    pid = tl.load(sorted_ids + first)
    pw = tl.load(sorted_w + first)
    prun = tl.load(sorted_w + REG + first)
    pmono = tl.load(sorted_ids + REG + first)
    sw = tl.load(sorted_w + j)
    smono = tl.load(sorted_ids + REG + j)
    tie = valid & (sw == pw)
    if tl.sum((tie & (smono != pmono)).to(tl.int32), axis=0) > 0:
        start = tl.min(tl.where(tie, j, REG), axis=0)
        tied = tl.sort(tl.where(tie, tl.load(sorted_ids + j), 2147483647))
        pid = tl.sum(tl.where(j == first - start, tied, 0), axis=0)
    return pid, base_count + first.to(tl.int64), base_mass + prun


@_jit
def _window(
    lists: tl.tensor,
    src: tl.tensor,
    src_is_row: tl.tensor,
    n_src: tl.tensor,
    wts: tl.tensor,
    rowv: tl.tensor,
    lo: tl.tensor,
    hi: tl.tensor,
    n_range: tl.tensor,
    mass_range: tl.tensor,
    base_count: tl.tensor,
    base_mass: tl.tensor,
    mode: tl.tensor,
    target_count: tl.tensor,
    target_mass: tl.tensor,
    S: tl.constexpr,
    HALF: tl.constexpr,
) -> Any:
    """A window ``[t_lo, t_hi]`` of weights likely to hold a search's answer, from a sample.

    Samples ``S`` candidates of the source with weights in ``[lo, hi]`` (``n_range`` of them, of
    total weight ``mass_range``), estimates the answer's place among them and spans ``HALF`` sampled
    candidates on each side. Returns ``(t_lo, t_hi, sparse)``; ``sparse`` when too few sampled
    candidates fall in the range to place a window.
    """
    j = tl.arange(0, S)
    jj = j.to(tl.int64)
    take = jj < n_src
    pos = tl.where(n_src > S, (jj * n_src) // S, jj)
    cid = tl.where(src_is_row, pos, tl.load(lists + src + pos, mask=take & (src_is_row == 0), other=0).to(tl.int64))
    w = tl.load(wts + rowv + cid, mask=take, other=-1.0)
    ok = take & (w >= lo) & (w <= hi)
    sw = tl.sort(tl.where(ok, w, -1.0), descending=True)
    sampled = tl.sum(ok.to(tl.int64), axis=0)
    svalid = jj < sampled
    running = tl.cumsum(tl.where(svalid, sw, 0.0), axis=0)
    smass = tl.sum(tl.where(svalid, sw, 0.0), axis=0)
    estimate = running * (mass_range / tl.where(smass > 0.0, smass, 1.0))
    left = target_mass - base_mass
    by_rank = ((target_count - base_count - 1) * sampled) // tl.where(n_range > 0, n_range, 1)
    by_ge = tl.sum((svalid & (estimate < left)).to(tl.int64), axis=0)
    by_gt = tl.sum((svalid & (estimate <= left)).to(tl.int64), axis=0)
    at = tl.where(mode == 0, by_rank, tl.where(mode == 1, by_ge, by_gt))
    upper = at - HALF
    lower = at + HALF
    t_hi = tl.where(upper > 0, tl.sum(tl.where(jj == upper, sw, 0.0), axis=0), hi)
    t_lo = tl.where(lower < sampled - 1, tl.sum(tl.where(jj == lower, sw, 0.0), axis=0), lo)
    # a window holding every sampled weight (few distinct weights) may hold the whole range: take the
    # single weight at the estimate instead, so the range shrinks unless it has one weight only
    widest = tl.max(sw, axis=0)
    narrowest = tl.min(tl.where(svalid, sw, widest), axis=0)
    whole = (t_hi >= widest) & (t_lo <= narrowest)
    at_w = tl.sum(tl.where(jj == tl.minimum(tl.maximum(at, 0), sampled - 1), sw, 0.0), axis=0)
    t_hi = tl.where(whole, at_w, t_hi)
    t_lo = tl.where(whole, at_w, t_lo)
    sparse = sampled < 2 * HALF + 2
    return t_lo, t_hi, sparse


@_jit
def _partition(
    lists: tl.tensor,
    src: tl.tensor,
    src_is_row: tl.tensor,
    n_src: tl.tensor,
    dst: tl.tensor,
    wts: tl.tensor,
    rowv: tl.tensor,
    lo: tl.tensor,
    hi: tl.tensor,
    t_lo: tl.tensor,
    t_hi: tl.tensor,
    BLK: tl.constexpr,
) -> Any:
    """One pass over the candidates with weights in ``[lo, hi]``: split at the window ``[t_lo, t_hi]``.

    Writes the window's ids, in source (id) order, to ``lists[dst:]``. Returns the counts and masses
    above the window, in it, and the count below it.
    """
    c_in = tl.zeros([], tl.int32)
    n_above = tl.zeros([BLK], tl.int32)
    n_below = tl.zeros([BLK], tl.int32)
    w_above = tl.zeros([BLK], tl.float64)
    w_in = tl.zeros([BLK], tl.float64)
    start = tl.zeros([], tl.int64)
    while start < n_src:
        p = start + tl.arange(0, BLK).to(tl.int64)
        start += BLK
        live = p < n_src
        cid = tl.where(src_is_row, p, tl.load(lists + src + p, mask=live & (src_is_row == 0), other=0).to(tl.int64))
        w = tl.load(wts + rowv + cid, mask=live, other=-1.0)
        inside = live & (w >= lo) & (w <= hi)
        above = inside & (w > t_hi)
        below = inside & (w < t_lo)
        window = inside & (w <= t_hi) & (w >= t_lo)
        flags = window.to(tl.int32)
        tl.store(lists + dst + c_in + tl.cumsum(flags, axis=0) - 1, cid.to(tl.int32), mask=window)
        c_in += tl.sum(flags, axis=0)
        n_above += above.to(tl.int32)
        n_below += below.to(tl.int32)
        w_above += tl.where(above, w, 0.0)
        w_in += tl.where(window, w, 0.0)
    return (
        tl.sum(n_above, axis=0).to(tl.int64),
        tl.sum(w_above, axis=0),
        c_in.to(tl.int64),
        tl.sum(w_in, axis=0),
        tl.sum(n_below, axis=0).to(tl.int64),
    )


@_jit
def _row_totals(r: tl.tensor, agg_count: tl.tensor, agg_mass: tl.tensor, C: tl.constexpr, C_PAD: tl.constexpr) -> Any:
    """A row's totals over the weights launch's per-chunk partials: ``(positive, min_count, n_heavy,
    ends, mass_all, min_mass, m_heavy, tau)``, ``ends`` the running counts of heavy ids by chunk and
    ``tau`` the heavy-weight threshold."""
    ci = tl.arange(0, C_PAD)
    live = ci < C
    base = (r * C + ci) * 4
    positive = tl.sum(tl.load(agg_count + base + 0, mask=live, other=0).to(tl.int64), axis=0)
    min_count = tl.sum(tl.load(agg_count + base + 1, mask=live, other=0).to(tl.int64), axis=0)
    hcv = tl.load(agg_count + base + 2, mask=live, other=0)
    n_heavy = tl.sum(hcv.to(tl.int64), axis=0)
    ends = tl.cumsum(hcv, axis=0)
    mass_all = tl.sum(tl.load(agg_mass + base + 0, mask=live, other=0.0), axis=0)
    min_mass = tl.sum(tl.load(agg_mass + base + 1, mask=live, other=0.0), axis=0)
    m_heavy = tl.sum(tl.load(agg_mass + base + 2, mask=live, other=0.0), axis=0)
    tau = tl.load(agg_mass + r * C * 4 + 3)
    return positive, min_count, n_heavy, ends, mass_all, min_mass, m_heavy, tau


@_jit
def _search(
    r: tl.tensor,
    rowv: tl.tensor,
    mode: tl.tensor,
    target_count: tl.tensor,
    target_mass: tl.tensor,
    run: tl.tensor,
    positive: tl.tensor,
    mass_all: tl.tensor,
    n_heavy: tl.tensor,
    m_heavy: tl.tensor,
    tau: tl.tensor,
    small_h: tl.tensor,
    ends: tl.tensor,
    proc: tl.tensor,
    wts: tl.tensor,
    heavy: tl.tensor,
    lists: tl.tensor,
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    V: tl.constexpr,
    CH: tl.constexpr,
    REG: tl.constexpr,
    SAMPLES: tl.constexpr,
    HALF: tl.constexpr,
    BLK: tl.constexpr,
    LOG_C: tl.constexpr,
) -> Any:
    """One search of the draw over the order ``(w desc, id asc)`` of a row's positive weights:
    ``(exists, id, rank, running weight)`` of the first id whose running count or weight reaches the
    target (``mode`` as for :func:`_reached`); ``run`` false skips it (id -1, rank 0, weight 0).

    The heavy ids, when they fit in registers (``small_h``), are already sorted into slot 0 of the
    row's ``sorted_ids``/``sorted_w``; a search ending among them picks from there. Other searches
    narrow the range of weights by windows over the row, then sort the remaining candidates into
    slot 1.
    """
    tiny = tl.full([], 1, tl.int64).to(tl.float64, bitcast=True)
    no = positive < 0
    yes = positive >= 0
    region0 = r.to(tl.int64) * (2 * V)
    slot_h = r.to(tl.int64) * (4 * REG)  # sorted heavy ids (slot 0) and a search's candidates (slot 1)
    slot_c = slot_h + 2 * REG
    exists = _reached(mode, target_count, target_mass, positive, mass_all)
    res_id = tl.full([], -1, tl.int32)
    res_rank = tl.zeros([], tl.int64)
    res_run = tl.zeros([], tl.float64)
    in_heavy = _reached(mode, target_count, target_mass, n_heavy, m_heavy)
    if run & exists & in_heavy & small_h:
        res_id, res_rank, res_run = _pick(
            sorted_ids + slot_h, sorted_w + slot_h, n_heavy, 0, 0.0, mode, target_count, target_mass, REG
        )
    elif run & exists:
        lo = tiny
        hi = tl.full([], 1.0, tl.float64)
        bc = tl.zeros([], tl.int64)
        bm = tl.zeros([], tl.float64)
        n_range = n_heavy
        mass_range = m_heavy
        if in_heavy:  # more heavy ids than fit in registers
            lo = tl.maximum(tau, tiny)
        else:
            hi = _next_down(tau)
            bc = n_heavy
            bm = m_heavy
            n_range = positive - n_heavy
            mass_range = mass_all - m_heavy
        # the first source is the row itself (ids 0..V-1); windows are compacted into two lists
        src = region0
        src_is_row = yes
        n_src = tl.full([], V, tl.int64)
        exact = no
        direct = no
        go = ~(exact & (n_range <= REG))
        while go:
            t_lo = lo
            t_hi = hi
            if n_range > REG:
                w_lo, w_hi, sparse = _window(
                    lists, src, src_is_row, n_src, wts, rowv, lo, hi, n_range, mass_range, bc, bm, mode,
                    target_count, target_mass, SAMPLES, HALF,
                )  # fmt: skip
                if ~sparse:
                    t_lo = w_lo
                    t_hi = w_hi
            dst = tl.where(src == region0, region0 + V, region0)
            c0, m0, c1, m1, c2 = _partition(lists, src, src_is_row, n_src, dst, wts, rowv, lo, hi, t_lo, t_hi, BLK)
            tl.debug_barrier()
            if (c0 > 0) & _reached(mode, target_count, target_mass, bc + c0, bm + m0):
                lo = _next_up(t_hi)
                n_range = c0
                mass_range = m0
                exact = no
            elif _reached(mode, target_count, target_mass, bc + c0 + c1, bm + m0 + m1) | (c2 == 0):
                bc = bc + c0
                bm = bm + m0
                lo = t_lo
                hi = t_hi
                n_range = c1
                mass_range = m1
                src = dst
                src_is_row = no
                n_src = c1
                exact = yes
                if (t_lo == t_hi) & (c1 > REG):
                    # one weight value: the answer is the j-th id of the window (id order)
                    need = tl.minimum(tl.maximum((target_mass - bm) / t_hi, 0.0), c1.to(tl.float64))
                    whole = need.to(tl.int64)
                    by_ge = tl.where(need == whole.to(tl.float64), whole - 1, whole)
                    at = tl.where(mode == 0, target_count - 1 - bc, tl.where(mode == 1, by_ge, whole))
                    at = tl.minimum(tl.maximum(at, 0), c1 - 1)
                    res_id = tl.load(lists + dst + at)
                    res_rank = bc + at
                    res_run = bm + (at + 1).to(tl.float64) * t_hi
                    direct = yes
            else:
                bc = bc + c0 + c1
                bm = bm + m0 + m1
                hi = _next_down(t_lo)
                n_range = c2
                mass_range = mass_range - m0 - m1
                exact = no
            go = (~direct) & (~(exact & (n_range <= REG)))
        if ~direct:
            _sort_candidates(
                lists, src, heavy, ends, no, n_range, proc, wts, rowv, sorted_ids + slot_c, sorted_w + slot_c,
                CH, LOG_C, REG,
            )  # fmt: skip
            res_id, res_rank, res_run = _pick(
                sorted_ids + slot_c, sorted_w + slot_c, n_range, bc, bm, mode, target_count, target_mass, REG
            )
    return exists, res_id, res_rank, res_run


# ----------------------------------------------------------------------------------------------
# sample: launch 1, per (row, program)
# ----------------------------------------------------------------------------------------------


@_jit
def _processed(
    lg: tl.tensor,
    offs: tl.tensor,
    valid: tl.tensor,
    r: tl.tensor,
    state: tl.tensor,
    rep: tl.tensor,
    freq: tl.tensor,
    pres: tl.tensor,
    prompt_presence: tl.tensor,
    output_counts: tl.tensor,
    allowed_mask: tl.tensor,
    constrained: tl.tensor,
    V: tl.constexpr,
    VL: tl.constexpr,
    MASK_WORDS: tl.constexpr,
    HAS_MASK: tl.constexpr,
) -> Any:
    """One chunk of a row's logits (float32) after the vocabulary limit, the penalties and the mask."""
    lg = tl.where(offs < VL, lg, float("-inf"))
    if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
        seen = tl.load(prompt_presence + state * V + offs, mask=valid, other=0)
        count = tl.load(output_counts + state * V + offs, mask=valid, other=0)
        produced = count > 0
        if rep != 1.0:
            scaled = tl.where(lg > 0.0, tl.math.div_rn(lg, rep), lg * rep)
            # an extreme penalty saturates at the largest finite float32 (a masked -inf stays -inf)
            saturated = tl.minimum(tl.maximum(scaled, -3.4028234663852886e38), 3.4028234663852886e38)
            scaled = tl.where(lg > float("-inf"), saturated, lg)
            lg = tl.where((seen != 0) | produced, scaled, lg)
        # the product is rounded to float32 before the subtraction (no fused multiply-add)
        lg = lg - (freq.to(tl.float64) * count.to(tl.float64)).to(tl.float32)
        lg = lg - pres * produced.to(tl.float32)
    if HAS_MASK:  # noqa: SIM102 (the constant prunes the load)
        if tl.load(constrained + r) != 0:
            word = tl.load(allowed_mask + r.to(tl.int64) * MASK_WORDS + offs // 32, mask=valid, other=0)
            lg = tl.where(((word >> (offs % 32)) & 1) != 0, lg, float("-inf"))
    return lg


@_jit
def _top_threshold(
    chunk_max: tl.tensor, chunk_arg: tl.tensor, r: tl.tensor, C: tl.constexpr, C_PAD: tl.constexpr, TOP_N: tl.constexpr
) -> Any:
    """The key of the row's ``TOP_N``-th largest chunk maximum (the smallest key where the row has
    fewer chunks). Those ``TOP_N`` maxima are distinct ids, so every id of the row's top ``TOP_N`` has
    a key at least this one, and so has the maximum of its chunk: only chunks whose maximum reaches it
    can hold one."""
    ci = tl.arange(0, C_PAD)
    here = ci < C
    cm = tl.load(chunk_max + r * C + ci, mask=here, other=0.0)
    ca = tl.load(chunk_arg + r * C + ci, mask=here, other=0)
    keys = tl.where(here, _order_key(cm, ca), -9223372036854775807 - 1)
    threshold = tl.max(keys, axis=0)
    for _ in tl.static_range(1, TOP_N):
        keys = tl.where(keys == threshold, -9223372036854775807 - 1, keys)
        threshold = tl.max(keys, axis=0)
    return threshold


@_jit
def _sample_chunk_kernel(
    logits: tl.tensor,
    active: tl.tensor,
    rows: tl.tensor,
    temperature: tl.tensor,
    repetition_penalty: tl.tensor,
    frequency_penalty: tl.tensor,
    presence_penalty: tl.tensor,
    prompt_presence: tl.tensor,
    output_counts: tl.tensor,
    allowed_mask: tl.tensor,
    constrained: tl.tensor,
    proc: tl.tensor,
    chunk_max: tl.tensor,
    chunk_arg: tl.tensor,
    chunk_sum: tl.tensor,
    V: tl.constexpr,
    VL: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    MASK_WORDS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    state = tl.load(rows + r).to(tl.int64)
    if (tl.load(active + r) != 0) & (state >= 0):
        rowv = r.to(tl.int64) * V
        rep = tl.load(repetition_penalty + r).to(tl.float32)
        freq = tl.load(frequency_penalty + r).to(tl.float32)
        pres = tl.load(presence_penalty + r).to(tl.float32)
        keep = tl.load(temperature + r).to(tl.float64) > 0.0
        # the row's chunks are shared out over the programs of grid dimension 1; each step loads the
        # program's next chunk before reducing this one
        first = tl.program_id(1)
        stride = tl.num_programs(1)
        ahead = first * CH + tl.arange(0, CH)
        upcoming = tl.load(logits + rowv + ahead, mask=ahead < V, other=float("-inf"))
        for c in range(first, C, stride):
            offs = c * CH + tl.arange(0, CH)
            valid = offs < V
            raw = upcoming.to(tl.float32)
            ahead = offs + stride * CH
            upcoming = tl.load(logits + rowv + ahead, mask=ahead < V, other=float("-inf"))
            lg = _processed(
                raw, offs, valid, r, state, rep, freq, pres, prompt_presence, output_counts, allowed_mask,
                constrained, V, VL, MASK_WORDS, HAS_MASK,
            )  # fmt: skip
            if keep:
                tl.store(proc + rowv + offs, lg, mask=valid)
            # one reduction of keys finds the maximum at its lowest id (a chunk always holds a valid id)
            top = tl.max(tl.where(valid, _order_key(lg, offs), -9223372036854775807 - 1), axis=0)
            best = _key_value(top)
            shifted = tl.where(lg > float("-inf"), tl.exp(lg - best), 0.0)
            slot = r * C + c
            tl.store(chunk_max + slot, best)
            tl.store(chunk_arg + slot, _key_id(top))
            tl.store(chunk_sum + slot, tl.sum(shifted.to(tl.float64), axis=0))


# ----------------------------------------------------------------------------------------------
# sample: launch 2 (with top_n > 0), per (row, program), the chunks that can hold a top entry
# ----------------------------------------------------------------------------------------------


@_jit
def _sample_top_kernel(
    logits: tl.tensor,
    active: tl.tensor,
    rows: tl.tensor,
    repetition_penalty: tl.tensor,
    frequency_penalty: tl.tensor,
    presence_penalty: tl.tensor,
    prompt_presence: tl.tensor,
    output_counts: tl.tensor,
    allowed_mask: tl.tensor,
    constrained: tl.tensor,
    chunk_max: tl.tensor,
    chunk_arg: tl.tensor,
    top_values: tl.tensor,
    top_ids: tl.tensor,
    V: tl.constexpr,
    VL: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    MASK_WORDS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    TOP_N: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    state = tl.load(rows + r).to(tl.int64)
    if (tl.load(active + r) != 0) & (state >= 0):
        rowv = r.to(tl.int64) * V
        rep = tl.load(repetition_penalty + r).to(tl.float32)
        freq = tl.load(frequency_penalty + r).to(tl.float32)
        pres = tl.load(presence_penalty + r).to(tl.float32)
        threshold = _top_threshold(chunk_max, chunk_arg, r, C, C_PAD, TOP_N)
        for c in range(tl.program_id(1), C, tl.num_programs(1)):
            slot = r * C + c
            if _order_key(tl.load(chunk_max + slot), tl.load(chunk_arg + slot)) >= threshold:
                offs = c * CH + tl.arange(0, CH)
                valid = offs < V
                raw = tl.load(logits + rowv + offs, mask=valid, other=float("-inf")).to(tl.float32)
                lg = _processed(
                    raw, offs, valid, r, state, rep, freq, pres, prompt_presence, output_counts, allowed_mask,
                    constrained, V, VL, MASK_WORDS, HAS_MASK,
                )  # fmt: skip
                key = tl.where(valid, _order_key(lg, offs), -9223372036854775807 - 1)
                for k in tl.static_range(TOP_N):
                    top = tl.max(key, axis=0)
                    found = top != -9223372036854775807 - 1
                    tl.store(top_values + slot * TOP_N + k, tl.where(found, _key_value(top), float("-inf")))
                    tl.store(top_ids + slot * TOP_N + k, tl.where(found, _key_id(top), -1))
                    key = tl.where(key == top, -9223372036854775807 - 1, key)  # keys are unique: drops one


# ----------------------------------------------------------------------------------------------
# sample: the weights launch, per (row, program), rows that draw at random
# ----------------------------------------------------------------------------------------------


@_jit
def _sample_weight_kernel(
    active: tl.tensor,
    rows: tl.tensor,
    temperature: tl.tensor,
    min_p: tl.tensor,
    proc: tl.tensor,
    chunk_max: tl.tensor,
    wts: tl.tensor,
    heavy: tl.tensor,
    agg_count: tl.tensor,
    agg_mass: tl.tensor,
    V: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    SAMPLES: tl.constexpr,
    SAMPLE_AT: tl.constexpr,
    ALL_HEAVY: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    state = tl.load(rows + r).to(tl.int64)
    t64 = tl.load(temperature + r).to(tl.float64)
    if (tl.load(active + r) != 0) & (state >= 0) & (t64 > 0.0):
        ci = tl.arange(0, C_PAD)
        peak = tl.max(tl.load(chunk_max + r * C + ci, mask=ci < C, other=float("-inf")), axis=0)
        if peak > float("-inf"):
            m64 = peak.to(tl.float64)
            rowv = r.to(tl.int64) * V
            if ALL_HEAVY:
                tau = tl.zeros([], tl.float64)
            else:  # the same fixed sample in every program of the row
                si = tl.arange(0, SAMPLES)
                sl = tl.load(proc + rowv + (si.to(tl.int64) * V) // SAMPLES)
                ordered = tl.sort(sl, descending=True)
                pick = tl.sum(tl.where(si == SAMPLE_AT, ordered, 0.0), axis=0)
                tau = tl.exp((pick.to(tl.float64) - m64) / t64)
            mp = tl.load(min_p + r).to(tl.float64)
            # the row's chunks are shared out over the programs of grid dimension 1
            for c in range(tl.program_id(1), C, tl.num_programs(1)):
                offs = c * CH + tl.arange(0, CH)
                valid = offs < V
                lg = tl.load(proc + rowv + offs, mask=valid, other=float("-inf"))
                w = tl.exp((lg.to(tl.float64) - m64) / t64)
                w = tl.where(valid, w, 0.0)
                tl.store(wts + rowv + offs, w, mask=valid)
                positive = w > 0.0
                above_min = positive & (w >= mp)
                is_heavy = positive & (w >= tau)
                slot = c * CH + tl.cumsum(is_heavy.to(tl.int32), axis=0) - 1
                tl.store(heavy + rowv + slot, offs, mask=is_heavy)
                base = (r * C + c) * 4
                tl.store(agg_count + base + 0, tl.sum(positive.to(tl.int32), axis=0))
                tl.store(agg_count + base + 1, tl.sum(above_min.to(tl.int32), axis=0))
                tl.store(agg_count + base + 2, tl.sum(is_heavy.to(tl.int32), axis=0))
                tl.store(agg_mass + base + 0, tl.sum(w, axis=0))
                tl.store(agg_mass + base + 1, tl.sum(tl.where(above_min, w, 0.0), axis=0))
                tl.store(agg_mass + base + 2, tl.sum(tl.where(is_heavy, w, 0.0), axis=0))
                tl.store(agg_mass + base + 3, tau)


# ----------------------------------------------------------------------------------------------
# sample: the finishing launch, per row
# ----------------------------------------------------------------------------------------------


@_jit
def _sample_finish_kernel(
    active: tl.tensor,
    rows: tl.tensor,
    temperature: tl.tensor,
    top_k: tl.tensor,
    top_p: tl.tensor,
    min_p: tl.tensor,
    seed: tl.tensor,
    step: tl.tensor,
    output_counts: tl.tensor,
    proc: tl.tensor,
    chunk_max: tl.tensor,
    chunk_arg: tl.tensor,
    chunk_sum: tl.tensor,
    top_values: tl.tensor,
    top_idx: tl.tensor,
    wts: tl.tensor,
    heavy: tl.tensor,
    lists: tl.tensor,
    sorted_ids: tl.tensor,
    sorted_w: tl.tensor,
    agg_count: tl.tensor,
    agg_mass: tl.tensor,
    ids: tl.tensor,
    logprob: tl.tensor,
    top_ids: tl.tensor,
    top_logprobs: tl.tensor,
    V: tl.constexpr,
    CH: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    TOP_N: tl.constexpr,
    TOP_PAD: tl.constexpr,
    ID_COLS: tl.constexpr,
    LP_COLS: tl.constexpr,
    COL_PAD: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    HAS_TOP_IDS: tl.constexpr,
    HAS_TOP_LOGPROBS: tl.constexpr,
    REG: tl.constexpr,
    SAMPLES: tl.constexpr,
    HALF: tl.constexpr,
    BLK: tl.constexpr,
    LOG_C: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    state = tl.load(rows + r).to(tl.int64)
    col = tl.arange(0, COL_PAD)
    out_id = tl.full([], -1, tl.int32)
    out_lp = tl.zeros([], tl.float32)
    col_ids = tl.full([COL_PAD], -1, tl.int32)
    col_lps = tl.zeros([COL_PAD], tl.float32)
    ci = tl.arange(0, C_PAD)
    cm = tl.load(chunk_max + r * C + ci, mask=ci < C, other=float("-inf"))
    peak = tl.max(cm, axis=0)
    if (tl.load(active + r) != 0) & (state >= 0) & (peak > float("-inf")):
        rowv = r.to(tl.int64) * V
        m64 = peak.to(tl.float64)
        argmax = tl.min(tl.where((cm == peak) & (ci < C), tl.load(chunk_arg + r * C + ci, mask=ci < C, other=0), V))
        cs = tl.load(chunk_sum + r * C + ci, mask=ci < C, other=0.0)
        scale = tl.exp(cm.to(tl.float64) - m64)
        log_z = tl.log(tl.sum(tl.where(cm > float("-inf"), cs * scale, 0.0), axis=0))
        if TOP_N > 0:
            ti = tl.arange(0, TOP_PAD)
            there = ti < C * TOP_N
            # only chunks whose maximum reaches the threshold wrote their entries this step
            owner = r * C + ti // TOP_N
            owned = _order_key(
                tl.load(chunk_max + owner, mask=there, other=0.0), tl.load(chunk_arg + owner, mask=there, other=0)
            )
            there = there & (owned >= _top_threshold(chunk_max, chunk_arg, r, C, C_PAD, TOP_N))
            tv = tl.load(top_values + r * C * TOP_N + ti, mask=there, other=float("-inf"))
            tid = tl.load(top_idx + r * C * TOP_N + ti, mask=there, other=-1)
            there = there & (tid >= 0)
            # ranked like the reference: by float32 log-probability desc, then id asc
            tlp = ((tv.to(tl.float64) - m64) - log_z).to(tl.float32)
            taken = ti < 0
            for k in tl.static_range(TOP_N):
                cur = tl.where(taken | (~there), float("-inf"), tlp)
                best = tl.max(cur, axis=0)
                pick = tl.min(tl.where((cur == best) & there & (~taken), tid, 2147483647), axis=0)
                found = pick < 2147483647
                taken = taken | (tid == pick)
                col_ids = tl.where(col == k, tl.where(found, pick, -1), col_ids)
                col_lps = tl.where(col == k, tl.where(found, best, 0.0), col_lps)
        out_id = argmax
        if tl.load(temperature + r).to(tl.float64) > 0.0:
            out_id = _draw(
                r,
                rowv,
                top_k,
                top_p,
                min_p,
                seed,
                step,
                proc,
                wts,
                heavy,
                lists,
                sorted_ids,
                sorted_w,
                agg_count,
                agg_mass,
                V,
                CH,
                C,
                C_PAD,
                REG,
                SAMPLES,
                HALF,
                BLK,
                LOG_C,
            )
            out_id = tl.where((out_id >= 0) & (out_id < V), out_id, argmax)  # never outside the row
            chosen = tl.load(proc + rowv + out_id)
            out_lp = ((chosen.to(tl.float64) - m64) - log_z).to(tl.float32)
        else:
            out_lp = (-log_z).to(tl.float32)
        tl.atomic_add(output_counts + state * V + out_id, 1)  # one add per active row
    tl.store(ids + r, out_id)
    if HAS_LOGPROB:
        tl.store(logprob + r, out_lp)
    if HAS_TOP_IDS:
        tl.store(top_ids + r * ID_COLS + col, col_ids, mask=col < ID_COLS)
    if HAS_TOP_LOGPROBS:
        tl.store(top_logprobs + r * LP_COLS + col, col_lps, mask=col < LP_COLS)


@_jit
def _draw(
    r: tl.tensor,
    rowv: tl.tensor,
    top_k: tl.tensor,
    top_p: tl.tensor,
    min_p: tl.tensor,
    seed: tl.tensor,
    step: tl.tensor,
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
    """The reference's filtered draw for one row with temperature > 0; returns the id."""
    positive, min_count, n_heavy, ends, mass_all, min_mass, m_heavy, tau = _row_totals(r, agg_count, agg_mass, C, C_PAD)
    k = tl.load(top_k + r).to(tl.int64)
    tp = tl.load(top_p + r).to(tl.float64)
    mp = tl.load(min_p + r).to(tl.float64)
    u = _counter_uniform(tl.load(seed + r), tl.load(step + r))
    k_on = (k > 0) & (k < positive)
    p_on = tp < 1.0
    m_on = mp > 0.0
    region0 = r.to(tl.int64) * (2 * V)
    mass_k = mass_all
    keep = positive
    total = mass_all
    last_id = tl.full([], -1, tl.int32)
    no = positive < 0
    yes = positive >= 0
    have_last = no
    need_last = no
    draw_id = tl.full([], -1, tl.int32)
    draw_ok = no
    small_h = n_heavy <= REG
    slot_h = r.to(tl.int64) * (4 * REG)  # the sorted heavy ids: slot 0 of the row's sorted lists
    if small_h:  # every search that ends among the heavy ids shares one sort of them
        _sort_candidates(
            lists, region0, heavy, ends, yes, n_heavy, proc, wts, rowv, sorted_ids + slot_h, sorted_w + slot_h,
            CH, LOG_C, REG,
        )  # fmt: skip
    for s in range(4):
        # search s: 0 the top-k cut, 1 the top-p cut, 2 the draw, 3 the last kept id (rare)
        mode = tl.where(s == 1, 1, tl.where(s == 2, 2, 0))
        target_count = tl.where(s == 0, k, keep)
        target_mass = tl.where(s == 1, tp * mass_k, u * total)
        run = tl.where(s == 0, k_on, tl.where(s == 1, p_on, tl.where(s == 2, True, need_last)))
        exists, res_id, res_rank, res_run = _search(
            r, rowv, mode, target_count, target_mass, run, positive, mass_all, n_heavy, m_heavy, tau, small_h, ends,
            proc, wts, heavy, lists, sorted_ids, sorted_w, V, CH, REG, SAMPLES, HALF, BLK, LOG_C,
        )  # fmt: skip
        if (s == 0) & run:
            mass_k = res_run
            keep = k
            total = res_run
            last_id = res_id
            have_last = yes
        if s == 1:
            if run:
                cut = tl.where(exists, res_rank + 1, positive)
                if cut < keep:
                    keep = cut
                    total = res_run
                    last_id = res_id
                    have_last = yes
            if m_on & (min_count < keep):
                keep = min_count
                total = min_mass
                have_last = no
        if s == 2:
            draw_ok = exists & (res_rank < keep)
            draw_id = res_id
            need_last = (~draw_ok) & (~have_last)
        if (s == 3) & run:
            last_id = res_id
    return tl.where(draw_ok, draw_id, last_id)


# ----------------------------------------------------------------------------------------------
# apply_grammar_mask and log_softmax_gather
# ----------------------------------------------------------------------------------------------


@_jit
def _grammar_mask_kernel(
    logits: tl.tensor,
    allowed_mask: tl.tensor,
    constrained: tl.tensor,
    out: tl.tensor,
    V: tl.constexpr,
    MASK_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    r = tl.program_id(0)
    b = tl.program_id(1)
    _pdl_prologue(USE_PDL)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    rowv = r.to(tl.int64) * V
    lg = tl.load(logits + rowv + offs, mask=valid, other=0.0).to(tl.float32)
    if tl.load(constrained + r) != 0:
        word = tl.load(allowed_mask + r.to(tl.int64) * MASK_WORDS + offs // 32, mask=valid, other=0)
        lg = tl.where(((word >> (offs % 32)) & 1) != 0, lg, float("-inf"))
    tl.store(out + rowv + offs, lg.to(out.dtype.element_ty), mask=valid)


@_jit
def _log_softmax_gather_kernel(
    logits: tl.tensor,
    targets: tl.tensor,
    out: tl.tensor,
    V: tl.constexpr,
    VL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
) -> None:
    r = tl.program_id(0)
    _pdl_prologue(USE_PDL)
    target = tl.load(targets + r).to(tl.int64)
    score = tl.zeros([], tl.float32)
    if target >= 0:
        rowv = r.to(tl.int64) * V
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, VL, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(logits + rowv + offs, mask=offs < VL, other=float("-inf")).to(tl.float32)
            grown = tl.maximum(lane_max, x)
            keep = tl.where(lane_max > float("-inf"), tl.exp(lane_max - grown), 0.0)
            add = tl.where(x > float("-inf"), tl.exp(x - grown), 0.0)
            lane_sum = lane_sum * keep + add
            lane_max = grown
        peak = tl.max(lane_max, axis=0)
        m64 = peak.to(tl.float64)
        scale = tl.where(lane_max > float("-inf"), tl.exp(lane_max.to(tl.float64) - m64), 0.0)
        log_z = tl.log(tl.sum(lane_sum.to(tl.float64) * scale, axis=0))
        if target < VL:
            picked = tl.load(logits + rowv + target).to(tl.float32)
            score = ((picked.to(tl.float64) - m64) - log_z).to(tl.float32)
        else:  # ids at or above the limit are outside the distribution
            score = tl.full([], float("-inf"), tl.float32)
    tl.store(out + r, score)


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


def _per_row(ctx: LoweringContext, node: mf.Node, name: str, rows: int, allowed: tuple[int, ...]) -> KernelArg:
    view = ctx.need(node, name)
    if _numel(ctx.shape(view)) != rows:
        raise ctx.fail(f"{name}: expected {rows} elements, got shape {list(ctx.shape(view))}")
    return _typed(ctx, view, name, allowed)


def _logits(ctx: LoweringContext, node: mf.Node) -> tuple[mf.BufferView, int, int]:
    view = ctx.need(node, "logits")
    shape = ctx.shape(view)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ctx.fail(f"logits: expected [rows, V], got shape {list(shape)}")
    if ctx.dtype(view) not in (mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16):
        raise ctx.fail(f"logits: dtype {mf.DType.Name(ctx.dtype(view))} is not a 16- or 32-bit float")
    return view, shape[0], shape[1]


def _vocab_limit(ctx: LoweringContext, node: mf.Node, vocab: int) -> int:
    limit = ctx.attribute(node, "vocab_limit")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= vocab:
        raise ctx.fail(f"vocab_limit: expected an int in [1, {vocab}], got {limit!r}")
    return limit


def _mask_words(ctx: LoweringContext, view: mf.BufferView, rows: int, vocab: int) -> int:
    shape = ctx.shape(view)
    if len(shape) != 2 or shape[0] != rows or shape[1] * 32 < vocab:
        raise ctx.fail(f"allowed_mask: expected [{rows}, >= {cdiv(vocab, 32)}] words, got shape {list(shape)}")
    return shape[1]


def _state_tables(ctx: LoweringContext, node: mf.Node, vocab: int) -> dict[str, KernelArg]:
    """The per-state-row tables of the penalties, ``prompt_presence`` and ``output_counts`` (``[S, V]``)."""
    state: dict[str, KernelArg] = {}
    for name, allowed in (("prompt_presence", (mf.DTYPE_U8, mf.DTYPE_I32)), ("output_counts", (mf.DTYPE_I32,))):
        view = ctx.need(node, name)
        shape = ctx.shape(view)
        if len(shape) != 2 or shape[1] != vocab:
            raise ctx.fail(f"{name}: expected [state rows, {vocab}], got shape {list(shape)}")
        state[name] = _typed(ctx, view, name, allowed)
    return state


@dataclass(frozen=True)
class SampleLayout:
    """How ``sample``'s chunked launches cover the vocabulary."""

    chunk: int
    """Vocabulary ids a program takes in one step (a power of two)."""
    programs: int
    """Programs per row of the chunked launches; program ``p`` of a row takes chunks ``p``,
    ``p + programs``, ... in turn."""
    warps: int
    """Warps of a program of the first chunked launch."""


def choose_sample_layout(rows: int, vocab: int, *, multiprocessors: int = MULTIPROCESSORS) -> SampleLayout:
    """The layout of ``sample``'s chunked launches for ``rows`` rows of ``vocab`` logits.

    Chunks of ``CHUNK`` ids on four warps; a row's chunks are shared out over just enough programs
    that the launch has about ``PROGRAMS_PER_MULTIPROCESSOR`` programs a multiprocessor (every
    chunk its own program where the rows are few). A program then reduces its chunks one after
    another, loading the next while it reduces one, instead of many short programs each paying the
    row's prologue and the launch of a program (the registers of the chunked launches leave room for
    only a few programs of each on a multiprocessor at once).
    """
    chunk = min(CHUNK, next_power_of_two(vocab))
    chunks = cdiv(vocab, chunk)
    programs = min(chunks, cdiv(PROGRAMS_PER_MULTIPROCESSOR * multiprocessors, rows))
    return SampleLayout(chunk=chunk, programs=programs, warps=4)


@lowering("sample")
def lower_sample(ctx: LoweringContext, node: mf.Node, layout: SampleLayout | None = None) -> list[mf.KernelLaunch]:
    """Three or four launches: per-chunk processing, the top entries of the chunks that can hold one
    (``top_n > 0``), per-chunk weights (random rows), per-row finish.

    ``layout`` overrides :func:`choose_sample_layout` (the tile benchmark compares layouts).
    """
    logits, rows, vocab = _logits(ctx, node)
    if layout is None:
        layout = choose_sample_layout(rows, vocab)
    if layout.chunk < 1 or layout.chunk & (layout.chunk - 1) or layout.programs < 1 or layout.warps < 1:
        raise ctx.fail(f"sample layout {layout} is not a power-of-two chunk with positive programs and warps")
    limit = _vocab_limit(ctx, node, vocab)
    top_n = ctx.attribute(node, "top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or not 0 <= top_n <= min(vocab, MAX_TOP_N):
        raise ctx.fail(f"top_n: expected an int in [0, {min(vocab, MAX_TOP_N)}], got {top_n!r}")
    ids_view = ctx.need(node, "ids")
    if _numel(ctx.shape(ids_view)) != rows:
        raise ctx.fail(f"ids: expected {rows} elements, got shape {list(ctx.shape(ids_view))}")
    ids = _typed(ctx, ids_view, "ids", (mf.DTYPE_I32,))
    active = _per_row(ctx, node, "active", rows, _FLAGS)
    state_rows = _per_row(ctx, node, "rows", rows, _INTS)
    temperature = _per_row(ctx, node, "temperature", rows, _FLOATS)
    top_k = _per_row(ctx, node, "top_k", rows, _INTS)
    top_p = _per_row(ctx, node, "top_p", rows, _FLOATS)
    min_p = _per_row(ctx, node, "min_p", rows, _FLOATS)
    repetition = _per_row(ctx, node, "repetition_penalty", rows, _FLOATS)
    frequency = _per_row(ctx, node, "frequency_penalty", rows, _FLOATS)
    presence_pen = _per_row(ctx, node, "presence_penalty", rows, _FLOATS)
    seed = _per_row(ctx, node, "seed", rows, (mf.DTYPE_U64, mf.DTYPE_I64))
    step = _per_row(ctx, node, "step", rows, _INTS)
    state = _state_tables(ctx, node, vocab)
    mask_view = ctx.arg(node, "allowed_mask")
    constrained_view = ctx.arg(node, "constrained")
    if (mask_view is None) != (constrained_view is None):
        raise ctx.fail("allowed_mask and constrained must be given together")
    chunk = layout.chunk
    chunks = cdiv(vocab, chunk)
    chunk_pad = next_power_of_two(chunks)
    programs = min(layout.programs, chunks)
    slots = rows * chunks
    proc = ctx.pointer(ctx.workspace("sample.processed", mf.DTYPE_F32, rows * vocab))
    wts = ctx.pointer(ctx.workspace("sample.weights", mf.DTYPE_F64, rows * vocab))
    heavy = ctx.pointer(ctx.workspace("sample.heavy", mf.DTYPE_I32, rows * vocab))
    lists = ctx.pointer(ctx.workspace("sample.candidates", mf.DTYPE_I32, 2 * rows * vocab))
    chunk_max = ctx.pointer(ctx.workspace("sample.chunk_max", mf.DTYPE_F32, slots))
    chunk_arg = ctx.pointer(ctx.workspace("sample.chunk_arg", mf.DTYPE_I32, slots))
    chunk_sum = ctx.pointer(ctx.workspace("sample.chunk_sum", mf.DTYPE_F64, slots))
    top_values = ctx.pointer(ctx.workspace("sample.top_values", mf.DTYPE_F32, slots * max(top_n, 1)))
    top_idx = ctx.pointer(ctx.workspace("sample.top_ids", mf.DTYPE_I32, slots * max(top_n, 1)))
    agg_count = ctx.pointer(ctx.workspace("sample.chunk_counts", mf.DTYPE_I32, slots * 4))
    agg_mass = ctx.pointer(ctx.workspace("sample.chunk_masses", mf.DTYPE_F64, slots * 4))
    if mask_view is not None and constrained_view is not None:
        mask_words = _mask_words(ctx, mask_view, rows, vocab)
        mask = _typed(ctx, mask_view, "allowed_mask", _WORDS)
        constrained = _per_row(ctx, node, "constrained", rows, _FLAGS)
    else:  # never read
        mask_words, mask, constrained = 1, chunk_arg, active
    row_tables = {
        "repetition_penalty": repetition,
        "frequency_penalty": frequency,
        "presence_penalty": presence_pen,
        "prompt_presence": state["prompt_presence"],
        "output_counts": state["output_counts"],
        "allowed_mask": mask,
        "constrained": constrained,
    }
    masking = {"V": vocab, "VL": limit, "CH": chunk, "C": chunks, "MASK_WORDS": mask_words}
    masking["HAS_MASK"] = mask_view is not None
    launches = [
        ctx.launch(
            _sample_chunk_kernel,
            {
                "logits": ctx.pointer(logits),
                "active": active,
                "rows": state_rows,
                "temperature": temperature,
                **row_tables,
                "proc": proc,
                "chunk_max": chunk_max,
                "chunk_arg": chunk_arg,
                "chunk_sum": chunk_sum,
            },
            masking,
            (rows, programs),
            num_warps=layout.warps,
        )
    ]
    if top_n > 0:
        launches.append(
            ctx.launch(
                _sample_top_kernel,
                {
                    "logits": ctx.pointer(logits),
                    "active": active,
                    "rows": state_rows,
                    **row_tables,
                    "chunk_max": chunk_max,
                    "chunk_arg": chunk_arg,
                    "top_values": top_values,
                    "top_ids": top_idx,
                },
                {**masking, "C_PAD": chunk_pad, "TOP_N": top_n},
                (rows, programs),
                num_warps=layout.warps,
            )
        )
    all_heavy = vocab <= REGISTER_CANDIDATES
    weights = ctx.launch(
        _sample_weight_kernel,
        {
            "active": active,
            "rows": state_rows,
            "temperature": temperature,
            "min_p": min_p,
            "proc": proc,
            "chunk_max": chunk_max,
            "wts": wts,
            "heavy": heavy,
            "agg_count": agg_count,
            "agg_mass": agg_mass,
        },
        {
            "V": vocab,
            "CH": chunk,
            "C": chunks,
            "C_PAD": chunk_pad,
            "SAMPLES": THRESHOLD_SAMPLES,
            "SAMPLE_AT": 0 if all_heavy else THRESHOLD_SAMPLES * HEAVY_TARGET // vocab,
            "ALL_HEAVY": all_heavy,
        },
        (rows, programs),
        num_warps=8,
    )
    outputs: dict[str, KernelArg] = {}
    columns: dict[str, int] = {}
    for name, dtype in (("logprob", mf.DTYPE_F32), ("top_ids", mf.DTYPE_I32), ("top_logprobs", mf.DTYPE_F32)):
        given = ctx.arg(node, name)
        if given is None:
            outputs[name], columns[name] = ids, 1  # never written
            continue
        shape = ctx.shape(given)
        if name == "logprob":
            if _numel(shape) != rows:
                raise ctx.fail(f"logprob: expected {rows} elements, got shape {list(shape)}")
            columns[name] = 1
        else:
            if len(shape) != 2 or shape[0] != rows or shape[1] < top_n:
                raise ctx.fail(f"{name}: shape {list(shape)} cannot hold {rows} rows of top_n={top_n}")
            columns[name] = shape[1]
        outputs[name] = _typed(ctx, given, name, (dtype,))
    finish = ctx.launch(
        _sample_finish_kernel,
        {
            "active": active,
            "rows": state_rows,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "seed": seed,
            "step": step,
            "output_counts": state["output_counts"],
            "proc": proc,
            "chunk_max": chunk_max,
            "chunk_arg": chunk_arg,
            "chunk_sum": chunk_sum,
            "top_values": top_values,
            "top_idx": top_idx,
            "wts": wts,
            "heavy": heavy,
            "lists": lists,
            "sorted_ids": ctx.pointer(ctx.workspace("sample.sorted_ids", mf.DTYPE_I32, rows * 4 * REGISTER_CANDIDATES)),
            "sorted_w": ctx.pointer(
                ctx.workspace("sample.sorted_weights", mf.DTYPE_F64, rows * 4 * REGISTER_CANDIDATES)
            ),
            "agg_count": agg_count,
            "agg_mass": agg_mass,
            "ids": ids,
            "logprob": outputs["logprob"],
            "top_ids": outputs["top_ids"],
            "top_logprobs": outputs["top_logprobs"],
        },
        {
            "V": vocab,
            "CH": chunk,
            "C": chunks,
            "C_PAD": chunk_pad,
            "TOP_N": top_n,
            "TOP_PAD": next_power_of_two(max(chunks * top_n, 1)),
            "ID_COLS": columns["top_ids"],
            "LP_COLS": columns["top_logprobs"],
            "COL_PAD": next_power_of_two(max(columns["top_ids"], columns["top_logprobs"])),
            "HAS_LOGPROB": ctx.arg(node, "logprob") is not None,
            "HAS_TOP_IDS": ctx.arg(node, "top_ids") is not None,
            "HAS_TOP_LOGPROBS": ctx.arg(node, "top_logprobs") is not None,
            "REG": REGISTER_CANDIDATES,
            "SAMPLES": WINDOW_SAMPLES,
            "HALF": WINDOW_HALF_WIDTH,
            "BLK": PASS_BLOCK,
            "LOG_C": chunk_pad.bit_length() - 1,
        },
        (rows,),
        num_warps=8,
    )
    return [*launches, weights, finish]


@lowering("apply_grammar_mask")
def lower_apply_grammar_mask(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One launch, grid (rows, V / MASK_BLOCK)."""
    logits, rows, vocab = _logits(ctx, node)
    mask_view = ctx.need(node, "allowed_mask")
    mask_words = _mask_words(ctx, mask_view, rows, vocab)
    out_view = ctx.need(node, "out")
    if _numel(ctx.shape(out_view)) != rows * vocab:
        raise ctx.fail(f"out: expected {rows * vocab} elements, got shape {list(ctx.shape(out_view))}")
    return [
        ctx.launch(
            _grammar_mask_kernel,
            {
                "logits": ctx.pointer(logits),
                "allowed_mask": _typed(ctx, mask_view, "allowed_mask", _WORDS),
                "constrained": _per_row(ctx, node, "constrained", rows, _FLAGS),
                "out": _typed(ctx, out_view, "out", (mf.DTYPE_F32, mf.DTYPE_BF16, mf.DTYPE_F16)),
            },
            {"V": vocab, "MASK_WORDS": mask_words, "BLOCK": MASK_BLOCK},
            (rows, cdiv(vocab, MASK_BLOCK)),
            num_warps=4,
        )
    ]


@lowering("log_softmax_gather")
def lower_log_softmax_gather(ctx: LoweringContext, node: mf.Node) -> list[mf.KernelLaunch]:
    """One launch, grid (rows,): an online log-sum-exp over the row, then the target's entry."""
    logits, rows, vocab = _logits(ctx, node)
    limit = _vocab_limit(ctx, node, vocab)
    out_view = ctx.need(node, "out")
    if _numel(ctx.shape(out_view)) != rows:
        raise ctx.fail(f"out: expected {rows} elements, got shape {list(ctx.shape(out_view))}")
    return [
        ctx.launch(
            _log_softmax_gather_kernel,
            {
                "logits": ctx.pointer(logits),
                "targets": _per_row(ctx, node, "targets", rows, _INTS),
                "out": _typed(ctx, out_view, "out", (mf.DTYPE_F32,)),
            },
            {"V": vocab, "VL": limit, "BLOCK": min(SOFTMAX_BLOCK, next_power_of_two(limit))},
            (rows,),
            num_warps=8,
        )
    ]
