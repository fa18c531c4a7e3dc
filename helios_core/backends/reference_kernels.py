"""Numpy reference implementations of the Helios operator catalogue.

These functions are the semantic definition of every operator, the CPU backend, and the oracle
that accelerator kernels are tested against.

Conventions
-----------
* Pure functions over numpy arrays, no global state. The in-place operators
  (:func:`kv_cache_write`, :func:`copy_rows` and its wrappers, :func:`update_output_counts`,
  :func:`speculative_inputs`, and :func:`sample_verify` and :func:`sample_verify_sampled` on their
  ``output_counts``) mutate only the buffers they are given.
* Arithmetic is float32 unless a docstring says otherwise; float outputs are float32, id outputs int32.
* Bad shapes, dtypes or out-of-range indices raise ``ValueError`` naming the argument.
* Row independence: every per-token operator computes a token's output from that token's own inputs
  (and, for attention, its request's cache) along an arithmetic path that does not depend on how
  many other tokens share the batch or what they hold, so a request's greedy tokens do not depend
  on its batch. :func:`linear` documents why this needs care with BLAS.

Shape letters: T packed tokens, H hidden size, K/N linear in/out features, F feed-forward size,
V vocabulary, R request rows (lanes), h/kvh query/KV heads, hd head dim.

Its size: one numpy function per catalogue operator, each the executable statement of that
operator's semantics in docs/ops.md; they share dtype and layout helpers, and splitting them by
operator would scatter one specification over many files.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, NoReturn

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "PROPOSAL_STREAM_KEY",
    "RESIDUAL_STREAM_KEY",
    "DraftChoice",
    "DraftSample",
    "FrequencyBandScaling",
    "LanePositions",
    "RopeStyle",
    "SampleResult",
    "VerifyResult",
    "add",
    "apply_grammar_mask",
    "apply_penalties",
    "argmax_rows",
    "bf16_bits_to_float32",
    "copy_pages",
    "copy_rows",
    "copy_state_rows",
    "counter_uniform",
    "draft_allocate",
    "draft_argmax",
    "draft_sample",
    "embedding",
    "gated_recurrence_scan",
    "gated_recurrence_step",
    "gather_rows",
    "kv_cache_write",
    "lane_positions",
    "latent_attention",
    "latent_cache_write",
    "linear",
    "log_softmax",
    "log_softmax_gather",
    "packed_lane_starts",
    "paged_attention",
    "recurrence_gate",
    "rmsnorm",
    "rope",
    "rope_inv_freq",
    "sample",
    "sample_probabilities",
    "sample_verify",
    "sample_verify_sampled",
    "silu_mul",
    "speculative_inputs",
    "speculative_layout",
    "splitmix64",
    "stream_uniform",
    "unpack_allowed_mask",
    "update_output_counts",
]

F32 = NDArray[np.float32]
F64 = NDArray[np.float64]
I32 = NDArray[np.int32]
I64 = NDArray[np.int64]
U64 = NDArray[np.uint64]
Bool = NDArray[np.bool_]
AnyArray = NDArray[Any]

RopeStyle = Literal["interleaved", "half"]


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------


_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
"""Where a penalised logit saturates."""


def _fail(message: str) -> NoReturn:
    raise ValueError(message)


def _float_array(name: str, value: AnyArray, ndim: int | None = None) -> F32:
    """``value`` as a C-contiguous float32 array (no copy when it already is one)."""
    arr = np.asarray(value)
    if arr.dtype.kind != "f":
        _fail(f"{name}: expected a floating-point array, got dtype {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        _fail(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _int_array(name: str, value: AnyArray, ndim: int) -> I64:
    """``value`` (any integer dtype) as int64."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        _fail(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        _fail(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        _fail(f"{name}: values exceed the int64 range")
    return arr.astype(np.int64, copy=False)


def _flag_array(name: str, value: AnyArray, shape: tuple[int, ...]) -> Bool:
    """An integer or boolean flag array as bool (nonzero = set)."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "biu":
        _fail(f"{name}: expected a boolean or integer array, got dtype {arr.dtype}")
    if arr.shape != shape:
        _fail(f"{name}: expected shape {shape}, got {arr.shape}")
    flags: Bool = np.not_equal(arr, 0)
    return flags


def _per_row(name: str, value: AnyArray, rows: int, kind: str) -> AnyArray:
    arr = np.asarray(value)
    if arr.dtype.kind not in kind:
        _fail(f"{name}: unexpected dtype {arr.dtype}")
    if arr.shape != (rows,):
        _fail(f"{name}: expected shape ({rows},), got {arr.shape}")
    return arr


def _in_place_target(name: str, value: AnyArray) -> AnyArray:
    if not isinstance(value, np.ndarray):
        _fail(f"{name}: expected a numpy array (it is updated in place), got {type(value).__name__}")
    if not value.flags.writeable:
        _fail(f"{name}: the array is read-only")
    return value


# ----------------------------------------------------------------------------------------------
# embedding, normalisation, elementwise
# ----------------------------------------------------------------------------------------------


def float32_to_bf16_bits(values: AnyArray) -> NDArray[np.uint16]:
    """Round float values to bfloat16 (round to nearest, ties to even), as uint16 bit patterns.

    Args:
        values: float array of any shape (widened to float32 first).
    Returns:
        uint16 array of the same shape; :func:`bf16_bits_to_float32` widens it back exactly.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    out: NDArray[np.uint16] = rounded.astype(np.uint16)
    return out


def bf16_bits_to_float32(bits: AnyArray) -> F32:
    """Widen bfloat16 values stored as uint16 bit patterns to float32 (exact).

    Args:
        bits: uint16 array of any shape holding bfloat16 bit patterns.
    Returns:
        float32 array of the same shape.
    """
    arr = np.asarray(bits)
    if arr.dtype != np.uint16:
        _fail(f"bits: expected uint16 bfloat16 bit patterns, got dtype {arr.dtype}")
    return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)


def embedding(table: AnyArray, ids: AnyArray) -> F32:
    """Gather rows of an embedding table.

    Args:
        table: ``[V, H]`` float32, float16, or bfloat16 stored as uint16 bit patterns.
        ids: ``[T]`` integer token ids (int32 on the wire), each in ``[0, V)``.
    Returns:
        ``[T, H]`` float32: ``table[ids]`` widened exactly to float32.
    """
    tab = np.asarray(table)
    if tab.ndim != 2:
        _fail(f"table: expected [V, H], got shape {tab.shape}")
    if tab.dtype not in (np.float32, np.float16, np.uint16):
        _fail(f"table: expected float32, float16 or bfloat16-as-uint16, got dtype {tab.dtype}")
    idx = _int_array("ids", ids, 1)
    vocab = tab.shape[0]
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
        _fail(f"ids: every id must lie in [0, {vocab}); got range [{int(idx.min())}, {int(idx.max())}]")
    rows = tab[idx]  # [T, H]
    if rows.dtype == np.uint16:
        return bf16_bits_to_float32(rows)
    return np.ascontiguousarray(rows, dtype=np.float32)


def rmsnorm(x: AnyArray, weight: AnyArray, eps: float) -> F32:
    """Root-mean-square normalisation, with a float64 row sum.

    Args:
        x: ``[T, H]`` float.
        weight: ``[H]`` float gain.
        eps: added to the mean square, > 0.
    Returns:
        ``[T, H]`` float32 ``x * (1 / sqrt(mean(x**2) + eps)) * weight``.

    Exactly: squares in float32, summed per row in float64 (a float64 accumulator), the
    mean rounded to float32, ``scale = 1.0f / sqrtf(mean + eps)`` in float32, then
    ``(x * scale) * weight`` in float32. Each row is reduced on its own (row independent).
    """
    x32 = _float_array("x", x, 2)
    w32 = _float_array("weight", weight, 1)
    hidden = x32.shape[1]
    if w32.shape != (hidden,):
        _fail(f"weight: expected shape ({hidden},) to match x {x32.shape}, got {w32.shape}")
    if not eps > 0.0:
        _fail(f"eps: must be > 0, got {eps}")
    squares = (x32 * x32).astype(np.float64)  # [T, H]
    mean = (np.sum(squares, axis=1) / hidden).astype(np.float32)  # [T]
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))  # [T] float32
    out: F32 = (x32 * scale[:, None]) * w32[None, :]
    return out


def silu_mul(gate: AnyArray, up: AnyArray) -> F32:
    """SwiGLU activation: ``silu(gate) * up`` with ``silu(g) = g / (1 + exp(-g))`` in float32.

    Args:
        gate, up: ``[T, F]`` float, same shape.
    Returns:
        ``[T, F]`` float32. Very negative gates give ``-0.0`` (``exp`` overflows to inf, silently).
    """
    g = _float_array("gate", gate, 2)
    u = _float_array("up", up, 2)
    if g.shape != u.shape:
        _fail(f"gate and up must have the same shape, got {g.shape} and {u.shape}")
    with np.errstate(over="ignore"):
        silu = (g / (np.float32(1.0) + np.exp(-g))).astype(np.float32, copy=False)
    out: F32 = silu * u
    return out


def add(a: AnyArray, b: AnyArray) -> F32:
    """Elementwise float32 sum (residual add, bias add).

    Args:
        a: float array of any shape.
        b: float array broadcastable to ``a.shape`` (the result always has ``a``'s shape).
    Returns:
        float32 array shaped like ``a``.
    """
    a32 = _float_array("a", a)
    b32 = _float_array("b", b)
    try:
        shape = np.broadcast_shapes(a32.shape, b32.shape)
    except ValueError:
        _fail(f"b: shape {b32.shape} does not broadcast to a's shape {a32.shape}")
    if shape != a32.shape:
        _fail(f"b: shape {b32.shape} would change a's shape {a32.shape}")
    out: F32 = a32 + b32
    return out


def gather_rows(x: AnyArray, index: AnyArray) -> F32:
    """Select rows of ``x`` (e.g. the last token of each lane); a negative index gives a zero row.

    Args:
        x: ``[T, ...]`` float.
        index: ``[n]`` integer, each ``< T``.
    Returns:
        ``[n, ...]`` float32.
    """
    x32 = _float_array("x", x)
    if x32.ndim < 1:
        _fail("x: expected at least one dimension")
    idx = _int_array("index", index, 1)
    if idx.size and int(idx.max()) >= x32.shape[0]:
        _fail(f"index: {int(idx.max())} is out of range for {x32.shape[0]} rows")
    out = np.zeros((idx.size, *x32.shape[1:]), dtype=np.float32)
    keep = idx >= 0
    out[keep] = x32[idx[keep]]
    return out


# ----------------------------------------------------------------------------------------------
# linear
# ----------------------------------------------------------------------------------------------

_LINEAR_TILE_BYTES = 8 * 1024 * 1024
"""Weight bytes per sgemv call in :func:`linear` (a tile stays in the L3 cache across tokens)."""


def _linear_tile_rows(k: int) -> int:
    rows = _LINEAR_TILE_BYTES // (4 * max(k, 1))
    return max(64, rows - rows % 64)


def linear(x: AnyArray, weight: AnyArray) -> F32:
    """``x @ weight.T`` with weights stored ``[out, in]``, row independent bit for bit.

    Args:
        x: ``[T, K]`` float (computed in float32).
        weight: ``[N, K]`` float32 (other float dtypes are converted on every call: slow).
    Returns:
        ``[T, N]`` float32. Row ``t`` is exactly ``weight @ x[t]`` as one BLAS ``sgemv`` computes
        it, whatever the other rows are and whatever ``T`` is.

    Why not ``x @ weight.T``: numpy hands ``T == 1`` to ``sgemv`` and ``T >= 2`` to ``sgemm``, and
    the two accumulate the K products in different orders. Measured with numpy 2.4 / OpenBLAS
    0.3.31 (Zen, AVX-512) at K=576/N=576, 576/1536, 1536/576 and 576/49152, T in
    {1, 2, 3, 7, 16, 64, 256}: the T=1 row differs from the same row inside any T>=2 batch by up to
    ~2e-6 at every shape, and at 576x576 T=2 also differs from T>=3 (OpenBLAS's small-matrix sgemm
    path), so "pad to a minimum row count" is not safe either. Bit-identical alternatives measured
    for the 49152x576 LM head (2 cores, best of several runs):

    * fixed 8-row blocks through sgemm (zero padding): identical across T but 12-15 ms at T=1
      (sgemm repacks the whole weight on every call) and ~115 ms at T=64;
    * float64 accumulation: the weight must be widened on every call (~320 ms at T=1);
    * ``np.vecdot`` (one ``sdot`` per output element): identical across T, 3.7 ms at T=1, but single
      threaded: ~120 ms at T=64 even with cache tiling;
    * **one sgemv per token and weight tile** (chosen): ``np.matmul(weight[tile], x[:, :, None])``
      is a stack of matrix-vector products, which numpy's matmul loop runs as one ``sgemv`` each.
      ~4.4 ms at T=1 (same as plain numpy: memory bound, two OpenBLAS threads) and ~56 ms at T=64
      (plain sgemm: ~29 ms). The weight is walked in tiles of ``_LINEAR_TILE_BYTES`` so a tile is
      reused from cache by every token (without tiling T=64 takes ~900 ms). The sgemv results do
      not depend on the tile size, the memory alignment of x, or the OpenBLAS thread count (1, 2
      and 8 checked), and equal plain ``weight @ x[t]``.

    Prefill is therefore ~2-3x slower than sgemm on the larger matrices; decode is unaffected.
    """
    x32 = _float_array("x", x, 2)
    w32 = _float_array("weight", weight, 2)
    tokens, k = x32.shape
    n, k_w = w32.shape
    if k_w != k:
        _fail(f"weight: expected [N, {k}] to match x {x32.shape}, got {w32.shape}")
    out = np.empty((tokens, n, 1), dtype=np.float32)  # [T, N, 1]: one column per token
    if tokens == 0 or n == 0:
        return out[:, :, 0]
    columns = x32[:, :, None]  # [T, K, 1]
    tile = _linear_tile_rows(k)
    for start in range(0, n, tile):
        # [tile, K] @ [T, K, 1] -> [T, tile, 1]: T independent sgemv calls
        np.matmul(w32[start : start + tile], columns, out=out[:, start : start + tile])
    return out[:, :, 0]


# ----------------------------------------------------------------------------------------------
# rotary position embedding
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrequencyBandScaling:
    """Frequency-band RoPE scaling: long wavelengths divided by ``factor``, short ones kept, a smooth band between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


def rope_inv_freq(rotary_dim: int, theta: float, scaling: FrequencyBandScaling | None = None) -> F64:
    """The per-pair inverse frequencies of RoPE, in float64.

    Args:
        rotary_dim: rotated dims per head (even).
        theta: the base (``rope_theta`` / ``rope.freq_base``), > 0.
        scaling: optional frequency-band scaling.
    Returns:
        ``[rotary_dim // 2]`` float64 ``inv_freq[i] = theta ** (-2i / rotary_dim)``, then with
        Frequency-band scaling as published with its reference ``apply_scaling``: with
        ``wavelen = 2*pi / f``, ``low_wl = original_max_position / low_freq_factor`` and
        ``high_wl = original_max_position / high_freq_factor``: ``f`` if ``wavelen < high_wl``;
        ``f / factor`` if ``wavelen > low_wl``; otherwise ``(1 - s) * f / factor + s * f`` with
        ``s = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor -
        low_freq_factor)``. (Meta and Hugging Face compute this in float32; float64 here.)
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        _fail(f"rotary_dim: must be a positive even number, got {rotary_dim}")
    if not theta > 0.0:
        _fail(f"theta: must be > 0, got {theta}")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq: F64 = 1.0 / np.power(np.float64(theta), exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling.factor)
    low = float(scaling.low_freq_factor)
    high = float(scaling.high_freq_factor)
    old = float(scaling.original_max_position)
    if not (factor > 0.0 and old > 0.0 and high > low > 0.0):
        _fail(f"scaling: need factor > 0, original_max_position > 0, high > low > 0; got {scaling}")
    low_wavelen = old / low
    high_wavelen = old / high
    wavelen = 2.0 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    medium = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled: F64 = np.where(wavelen < high_wavelen, inv_freq, np.where(wavelen > low_wavelen, inv_freq / factor, medium))
    return scaled


def rope(
    x: AnyArray,
    positions: AnyArray,
    theta: float,
    style: RopeStyle = "interleaved",
    scaling: FrequencyBandScaling | None = None,
    *,
    rotary_dim: int | None = None,
) -> F32:
    """Rotary position embedding.

    Args:
        x: ``[T, heads, hd]`` float (queries or keys of packed tokens).
        positions: ``[T]`` integer position of each token in its sequence.
        theta: the RoPE base.
        style: ``"interleaved"`` rotates adjacent pairs ``(x[2i], x[2i+1])`` (the layout of
            GGUF-converted weights, whose converter permutes Q/K rows);
            ``"half"`` rotates ``(x[i], x[i + rotary_dim/2])`` (GPT-NeoX / Hugging Face
            ``rotate_half``).
        scaling: optional frequency-band scaling (see :func:`rope_inv_freq`).
        rotary_dim: rotate only the first ``rotary_dim`` dims (default ``hd``); the rest pass
            through.
    Returns:
        ``[T, heads, hd]`` float32. Pair ``i`` of token ``t`` rotates by
        ``angle = positions[t] * inv_freq[i]``: the angle, its cos and its sin are computed in
        float64 and cos/sin rounded to float32; then in float32
        ``(a, b) -> (a*cos - b*sin, a*sin + b*cos)``.
    """
    x32 = _float_array("x", x, 3)
    tokens, _heads, head_dim = x32.shape
    pos = _int_array("positions", positions, 1)
    if pos.shape != (tokens,):
        _fail(f"positions: expected shape ({tokens},) to match x {x32.shape}, got {pos.shape}")
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot <= 0 or rot % 2 or rot > head_dim:
        _fail(f"rotary_dim: must be even and in (0, {head_dim}], got {rot}")
    if style not in ("interleaved", "half"):
        _fail(f"style: expected 'interleaved' or 'half', got {style!r}")
    inv_freq = rope_inv_freq(rot, theta, scaling)  # [rot/2] float64
    angles = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, rot/2]
    cos = np.cos(angles).astype(np.float32)[:, None, :]  # [T, 1, rot/2]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    out = x32.copy()
    if style == "interleaved":
        first, second = x32[..., 0:rot:2], x32[..., 1:rot:2]  # [T, heads, rot/2] each
        out[..., 0:rot:2] = first * cos - second * sin
        out[..., 1:rot:2] = first * sin + second * cos
    else:
        half = rot // 2
        first, second = x32[..., :half], x32[..., half:rot]
        out[..., :half] = first * cos - second * sin
        out[..., half:rot] = first * sin + second * cos
    return out


# ----------------------------------------------------------------------------------------------
# paged KV cache and attention
# ----------------------------------------------------------------------------------------------


def _packed_token_rows(token_row: AnyArray, token_position: AnyArray, tokens: int, rows: int) -> tuple[I64, I64, Bool]:
    """The request row and position of each of ``tokens`` packed tokens over a page table of ``rows`` rows,
    checked (one entry a token, every active token's row in range and its position not negative), and the
    mask of active tokens (row >= 0; the rest are padding)."""
    row_of = _int_array("token_row", token_row, 1)
    pos_of = _int_array("token_position", token_position, 1)
    if row_of.shape != (tokens,) or pos_of.shape != (tokens,):
        _fail(f"token_row/token_position: expected shape ({tokens},), got {row_of.shape}, {pos_of.shape}")
    active = row_of >= 0
    if active.any():
        if int(row_of[active].max()) >= rows:
            _fail(f"token_row: {int(row_of[active].max())} is out of range for {rows} page-table rows")
        if int(pos_of[active].min()) < 0:
            _fail("token_position: an active token has a negative position")
    return row_of, pos_of, active


def _check_planes(k_plane: AnyArray, v_plane: AnyArray) -> tuple[int, int, int, int]:
    if k_plane.ndim != 4:
        _fail(f"k_plane: expected [num_pages, page_tokens, kvh, hd], got shape {k_plane.shape}")
    if v_plane.shape != k_plane.shape:
        _fail(f"v_plane: shape {v_plane.shape} differs from k_plane {k_plane.shape}")
    if k_plane.dtype != v_plane.dtype or not (k_plane.dtype.kind == "f" or k_plane.dtype == np.uint16):
        _fail(
            f"k_plane/v_plane: expected equal float (or uint16 bfloat16-bit) dtypes, got {k_plane.dtype} and "
            f"{v_plane.dtype}"
        )
    pages, page_tokens, kv_heads, head_dim = k_plane.shape
    return int(pages), int(page_tokens), int(kv_heads), int(head_dim)


def kv_cache_write(k_plane: AnyArray, v_plane: AnyArray, k: AnyArray, v: AnyArray, slot: AnyArray) -> None:
    """Write the keys and values of packed tokens into paged cache planes, in place.

    Args:
        k_plane, v_plane: ``[num_pages, page_tokens, kvh, hd]`` float, or uint16 holding bfloat16 bit
            patterns, C-contiguous, writable.
        k, v: ``[T, kvh, hd]`` float (cast to the plane dtype; rounded to nearest even for bfloat16).
        slot: ``[T]`` integer (int64 on the wire): ``page_id * page_tokens + offset``, or < 0 to
            skip the token (padding). Two tokens may not share a slot.
    """
    k_plane = _in_place_target("k_plane", k_plane)
    v_plane = _in_place_target("v_plane", v_plane)
    pages, page_tokens, kv_heads, head_dim = _check_planes(k_plane, v_plane)
    if not (k_plane.flags.c_contiguous and v_plane.flags.c_contiguous):
        _fail("k_plane/v_plane: must be C-contiguous")
    k32 = _float_array("k", k, 3)
    v32 = _float_array("v", v, 3)
    tokens = k32.shape[0]
    if k32.shape != (tokens, kv_heads, head_dim) or v32.shape != k32.shape:
        _fail(f"k/v: expected [T, {kv_heads}, {head_dim}], got {k32.shape} and {v32.shape}")
    slots = _int_array("slot", slot, 1)
    if slots.shape != (tokens,):
        _fail(f"slot: expected shape ({tokens},), got {slots.shape}")
    keep = slots >= 0
    targets = slots[keep]
    capacity = pages * page_tokens
    if targets.size and int(targets.max()) >= capacity:
        _fail(f"slot: {int(targets.max())} is out of range for {pages} pages of {page_tokens} tokens")
    if np.unique(targets).size != targets.size:
        _fail("slot: two tokens write the same slot")
    bf16 = k_plane.dtype == np.uint16
    k_rows = float32_to_bf16_bits(k32[keep]) if bf16 else k32[keep]
    v_rows = float32_to_bf16_bits(v32[keep]) if bf16 else v32[keep]
    k_plane.reshape(capacity, kv_heads, head_dim)[targets] = k_rows
    v_plane.reshape(capacity, kv_heads, head_dim)[targets] = v_rows


def _heads_major(plane: AnyArray, pages: I64, length: int) -> F32:
    """Positions ``0..length-1`` of a paged sequence as float32 ``[kvh, length, hd]``.

    One gather pass; each head's ``[length, hd]`` block is a contiguous row-major matrix. A uint16 plane
    holds bfloat16 bit patterns, widened exactly after the gather.
    """
    _, page_tokens, kv_heads, head_dim = plane.shape
    # Gather whole pages first (contiguous copies of the few pages needed), then move heads to the front.
    # Gathering along a transposed view of the whole plane is ~30x slower.
    seq = plane[pages].reshape(pages.size * page_tokens, kv_heads, head_dim)[:length]  # [length, kvh, hd]
    if seq.dtype == np.uint16:
        seq = bf16_bits_to_float32(seq)
    out: F32 = np.ascontiguousarray(seq.transpose(1, 0, 2), dtype=np.float32)  # [kvh, length, hd]
    return out


def _attend_one(query: F32, keys: F32, values: F32, scale: np.float32) -> F32:
    """One token: ``query [kvh, g, hd]``, ``keys/values [kvh, n, hd]`` -> ``[kvh, g, hd]``."""
    scores = np.matmul(query, keys.transpose(0, 2, 1)) * scale  # [kvh, g, n]
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    probs = weights / weights.sum(axis=-1, keepdims=True)
    out: F32 = np.matmul(probs, values)  # [kvh, g, hd]
    return out


def paged_attention(
    q: AnyArray,
    k_plane: AnyArray,
    v_plane: AnyArray,
    page_table: AnyArray,
    token_row: AnyArray,
    token_position: AnyArray,
    scale: float,
    *,
    window: int = 0,
) -> F32:
    """Causal grouped-query attention over paged KV cache planes (prefill, decode or mixed).

    Args:
        q: ``[T, h, hd]`` float queries of the packed tokens (RoPE already applied).
        k_plane, v_plane: ``[num_pages, page_tokens, kvh, hd]`` float (or uint16 bfloat16 bit patterns,
            widened exactly); ``h`` must be a multiple of ``kvh``; query head ``j`` reads KV head ``j // (h // kvh)``.
        page_table: ``[R, max_pages]`` integer: position ``p`` of request row ``r`` lives at page
            ``page_table[r, p // page_tokens]``, offset ``p % page_tokens``. Only the entries a
            token needs are read (and must be valid page ids); with a window, entries of pages wholly
            before every token's window are never read (they may hold anything, such as -1).
        token_row: ``[T]`` integer request row of each token; < 0 marks padding (output zeros).
        token_position: ``[T]`` integer position of each token; it attends to positions
            ``0..token_position[t]`` of its row (its own K/V must already be written).
        scale: multiplies ``q . k`` (usually ``1/sqrt(hd)``).
        window: 0 for unlimited causal attention; a positive ``N`` limits each token to positions
            ``max(token_position[t] - N + 1, 0)..token_position[t]`` (the last ``N`` positions, its own
            included: sliding-window attention).
    Returns:
        ``[T, h, hd]`` float32.

    Per token, in float32: ``s = (q @ K^T) * scale``; ``p = exp(s - max s) / sum``; ``out = p @ V``
    (softmax with max subtraction). Every token is computed on its own from contiguous copies of
    its row's first ``position + 1`` keys and values, so its result depends only on its query, its
    row's cache and its position: a mixed prefill/decode batch equals separate runs bit for bit,
    and the physical page layout does not matter.
    """
    q32 = _float_array("q", q, 3)
    tokens, heads, head_dim = q32.shape
    _pages, page_tokens, kv_heads, plane_head_dim = _check_planes(np.asarray(k_plane), np.asarray(v_plane))
    if plane_head_dim != head_dim:
        _fail(f"q: head dim {head_dim} differs from the planes' {plane_head_dim}")
    if heads % kv_heads:
        _fail(f"q: {heads} query heads is not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    table = _int_array("page_table", page_table, 2)
    rows, max_pages = table.shape
    row_of, pos_of, active = _packed_token_rows(token_row, token_position, tokens, rows)
    if active.any() and int(pos_of[active].max()) >= max_pages * page_tokens:
        _fail(
            f"token_position: {int(pos_of[active].max())} exceeds the page table's "
            f"{max_pages} pages of {page_tokens} tokens"
        )
    if window < 0:
        _fail(f"window: must be 0 (unlimited) or positive, got {window}")
    k_arr, v_arr = np.asarray(k_plane), np.asarray(v_plane)
    num_pages = k_arr.shape[0]
    scale32 = np.float32(scale)
    out = np.zeros((tokens, heads, head_dim), dtype=np.float32)
    queries = q32.reshape(tokens, kv_heads, group, head_dim)  # head j = kv * group + (j % group)
    for row in np.unique(row_of[active]):
        members = np.flatnonzero(row_of == row)
        length = int(pos_of[members].max()) + 1
        lowest = max(int(pos_of[members].min()) - window + 1, 0) if window else 0
        first_page = lowest // page_tokens  # pages before it lie outside every member's window
        base = first_page * page_tokens
        pages = table[row, first_page : -(-length // page_tokens)]
        if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
            _fail(f"page_table: row {int(row)} names a page outside [0, {num_pages})")
        keys = _heads_major(k_arr, pages, length - base)  # [kvh, length - base, hd]: positions base..length-1
        values = _heads_major(v_arr, pages, length - base)
        for t in members:
            n = int(pos_of[t]) + 1
            start = max(n - window, 0) if window else 0
            # each [start:n, hd] slice is a contiguous matrix whatever `length` is
            out[t] = _attend_one(
                queries[t], keys[:, start - base : n - base], values[:, start - base : n - base], scale32
            ).reshape(heads, head_dim)
    return out


# ----------------------------------------------------------------------------------------------
# paged-latent histories
# ----------------------------------------------------------------------------------------------


def _check_latent_plane(plane: AnyArray, tokens_per_record: int) -> tuple[int, int, int]:
    if tokens_per_record < 1:
        _fail(f"tokens_per_record: must be at least 1, got {tokens_per_record}")
    if plane.ndim != 3 or plane.dtype.kind != "f":
        _fail(f"plane: expected float [num_pages, records_per_page, d_c], got {plane.dtype} {plane.shape}")
    pages, records, width = plane.shape
    return int(pages), int(records), int(width)


def latent_cache_write(plane: AnyArray, latent: AnyArray, slot: AnyArray, tokens_per_record: int) -> None:
    """Store packed tokens' latents into a paged-latent plane, in place.

    Args:
        plane: ``[num_pages, page_tokens / R, d_c]`` float, C-contiguous, writable (``R`` =
            ``tokens_per_record``; a page holds ``page_tokens`` logical tokens as ``page_tokens / R``
            records).
        latent: ``[T, d_c]`` float.
        slot: ``[T]`` integer token slot ``page_id * page_tokens + offset``, or < 0 to skip the token.
        tokens_per_record: R >= 1.

    Record ``slot // R`` holds the mean of the latents of its R tokens: the token at ``slot % R == 0``
    sets it to ``latent / R``, each later token adds its ``latent / R``, in packed order (positions
    ascend within a lane), in float32. With R = 1 each record is its token's latent.
    """
    target = _in_place_target("plane", plane)
    pages, records, width = _check_latent_plane(target, tokens_per_record)
    if not target.flags.c_contiguous:
        _fail("plane: must be C-contiguous")
    values = _float_array("latent", latent, 2)
    tokens = values.shape[0]
    if values.shape != (tokens, width):
        _fail(f"latent: expected [T, {width}], got {values.shape}")
    slots = _int_array("slot", slot, 1)
    if slots.shape != (tokens,):
        _fail(f"slot: expected shape ({tokens},), got {slots.shape}")
    keep = np.flatnonzero(slots >= 0)
    capacity = pages * records * tokens_per_record
    if keep.size and int(slots[keep].max()) >= capacity:
        page_tokens = records * tokens_per_record
        _fail(f"slot: {int(slots[keep].max())} is out of range for {pages} pages of {page_tokens} tokens")
    if np.unique(slots[keep]).size != keep.size:
        _fail("slot: two tokens write the same slot")
    flat = target.reshape(pages * records, width)
    if tokens_per_record == 1:
        flat[slots[keep]] = values[keep]
        return
    share = np.float32(1.0 / tokens_per_record)
    for token in keep.tolist():
        record, within = divmod(int(slots[token]), tokens_per_record)
        part = values[token] * share
        flat[record] = part if within == 0 else flat[record] + part


def latent_attention(
    q: AnyArray,
    plane: AnyArray,
    w_uk: AnyArray,
    w_uv: AnyArray,
    page_table: AnyArray,
    token_row: AnyArray,
    token_position: AnyArray,
    scale: float,
    tokens_per_record: int,
    *,
    page_offset: int = 0,
) -> F32:
    """Causal attention over a paged-latent history (compressed latent keys and values).

    Args:
        q: ``[T, h, hd]`` float queries.
        plane: ``[num_pages, page_tokens / R, d_c]`` float latent records (see :func:`latent_cache_write`).
        w_uk, w_uv: ``[h * hd, d_c]`` float up-projections: record ``c`` has keys ``linear(c, w_uk)``
            and values ``linear(c, w_uv)``, viewed ``[h, hd]``.
        page_table: ``[R_rows, columns]`` integer: record ``i`` of request row ``r`` lives in page
            ``page_table[r, page_offset + i // (page_tokens / R)]`` (a view shifted by ``page_offset``
            columns); only the entries a token needs are read.
        token_row: ``[T]`` integer request row; < 0 marks padding (output zeros).
        token_position: ``[T]`` integer position; a token at position ``p`` attends to the records
            ``0 .. (p + 1) // R - 1`` of its row: those whose R tokens all lie at or before ``p``. A token
            that sees no record (``p + 1 < R``) gets zeros.
        scale: multiplies ``q . k``.
        tokens_per_record: R >= 1.
        page_offset: the page-table column of the lane's first page (>= 0).
    Returns:
        ``[T, h, hd]`` float32.

    Per token, in float32, from contiguous copies of its row's visible records: keys and values are
    up-projected with :func:`linear` (row independent), then ``softmax(q . k * scale) @ v`` per head as
    :func:`paged_attention` computes it, so a token's result does not depend on its batch.
    """
    q32 = _float_array("q", q, 3)
    tokens, heads, head_dim = q32.shape
    latent_plane = np.asarray(plane)
    pages, records, width = _check_latent_plane(latent_plane, tokens_per_record)
    up_k = _float_array("w_uk", w_uk, 2)
    up_v = _float_array("w_uv", w_uv, 2)
    if up_k.shape != (heads * head_dim, width) or up_v.shape != up_k.shape:
        _fail(f"w_uk/w_uv: expected [{heads * head_dim}, {width}], got {up_k.shape} and {up_v.shape}")
    if page_offset < 0:
        _fail(f"page_offset: must be 0 or positive, got {page_offset}")
    table = _int_array("page_table", page_table, 2)
    rows, columns = table.shape
    row_of, pos_of, active = _packed_token_rows(token_row, token_position, tokens, rows)
    if active.any():
        visible = (int(pos_of[active].max()) + 1) // tokens_per_record
        if page_offset + -(-visible // records) > columns:
            _fail(
                f"token_position: {int(pos_of[active].max())} needs more than the page table's "
                f"{columns - page_offset} pages after column {page_offset}"
            )
    scale32 = np.float32(scale)
    out = np.zeros((tokens, heads, head_dim), dtype=np.float32)
    flat = latent_plane.reshape(pages * records, width)
    for row in np.unique(row_of[active]):
        members = np.flatnonzero(row_of == row)
        count = (int(pos_of[members].max()) + 1) // tokens_per_record
        if count == 0:
            continue
        page_ids = table[row, page_offset : page_offset + -(-count // records)]
        if int(page_ids.min()) < 0 or int(page_ids.max()) >= pages:
            _fail(f"page_table: row {int(row)} names a page outside [0, {pages})")
        index = (page_ids[:, None] * records + np.arange(records)[None, :]).reshape(-1)[:count]
        latents = np.ascontiguousarray(flat[index], dtype=np.float32)  # [count, d_c]
        keys = np.ascontiguousarray(linear(latents, up_k).reshape(count, heads, head_dim).transpose(1, 0, 2))
        values = np.ascontiguousarray(linear(latents, up_v).reshape(count, heads, head_dim).transpose(1, 0, 2))
        for t in members:
            n = (int(pos_of[t]) + 1) // tokens_per_record
            if n == 0:
                continue
            query = q32[t].reshape(heads, 1, head_dim)
            out[t] = _attend_one(query, keys[:, :n], values[:, :n], scale32).reshape(heads, head_dim)
    return out


# ----------------------------------------------------------------------------------------------
# row copies (page copies, state snapshots and restores)
# ----------------------------------------------------------------------------------------------


def copy_rows(
    dst: AnyArray, dst_rows: AnyArray, *, src: AnyArray | None = None, src_rows: AnyArray | None = None
) -> None:
    """``dst[dst_rows[i]] = source[src_rows[i]]`` along the leading axis, in place.

    Args:
        dst: ``[rows, ...]`` writable array.
        dst_rows: ``[n]`` integer destination rows.
        src: ``[m, ...]`` source array (same trailing shape); default ``dst`` itself.
        src_rows: ``[n]`` integer source rows; default ``0..n-1``.

    A pair with a negative source or destination index is skipped. All sources are read before
    any destination is written (so overlapping copies behave like copies from a snapshot).
    Duplicate destinations raise.
    """
    target = _in_place_target("dst", dst)
    if target.ndim < 1:
        _fail("dst: expected at least one dimension")
    source: AnyArray = target if src is None else np.asarray(src)
    if source.shape[1:] != target.shape[1:]:
        _fail(f"src: trailing shape {source.shape[1:]} differs from dst's {target.shape[1:]}")
    d_idx = _int_array("dst_rows", dst_rows, 1)
    s_idx = np.arange(d_idx.size, dtype=np.int64) if src_rows is None else _int_array("src_rows", src_rows, 1)
    if s_idx.shape != d_idx.shape:
        _fail(f"src_rows/dst_rows: lengths differ ({s_idx.size} and {d_idx.size})")
    keep = (s_idx >= 0) & (d_idx >= 0)
    s_keep, d_keep = s_idx[keep], d_idx[keep]
    if s_keep.size and int(s_keep.max()) >= source.shape[0]:
        _fail(f"src_rows: {int(s_keep.max())} is out of range for {source.shape[0]} rows")
    if d_keep.size and int(d_keep.max()) >= target.shape[0]:
        _fail(f"dst_rows: {int(d_keep.max())} is out of range for {target.shape[0]} rows")
    if np.unique(d_keep).size != d_keep.size:
        _fail("dst_rows: a destination row appears twice")
    target[d_keep] = source[s_keep]  # fancy indexing reads every source before writing


def copy_pages(plane: AnyArray, src_pages: AnyArray, dst_pages: AnyArray) -> None:
    """Copy whole KV pages inside one plane: ``plane[dst_pages[i]] = plane[src_pages[i]]``.

    Args:
        plane: ``[num_pages, page_tokens, kvh, hd]``, updated in place.
        src_pages, dst_pages: ``[n]`` integer page ids (negative skips the pair).
    See :func:`copy_rows` for the read-before-write and duplicate rules.
    """
    copy_rows(plane, dst_pages, src_rows=src_pages)


def copy_state_rows(buffer: AnyArray, src_rows: AnyArray, dst_rows: AnyArray) -> None:
    """Snapshot/restore per-request state rows: ``buffer[dst_rows[i]] = buffer[src_rows[i]]``.

    Args:
        buffer: ``[rows, ...]``, updated in place.
        src_rows, dst_rows: ``[n]`` integer rows (negative skips the pair).
    See :func:`copy_rows` for the read-before-write and duplicate rules.
    """
    copy_rows(buffer, dst_rows, src_rows=src_rows)


def tail_page(page_table: AnyArray, consumed: AnyArray, page_tokens: int) -> I32:
    """The page holding each row's partial last page, or -1 when the endpoint ends a page.

    Args:
        page_table: ``[rows, pages]`` integer page ids.
        consumed: ``[rows]`` consumed token endpoints.
        page_tokens: tokens per page (positive).

    ``out[r] = page_table[r, consumed[r] // page_tokens]`` when ``consumed[r] % page_tokens != 0``
    and ``consumed[r] > 0``; otherwise -1 (no partial page: nothing for a snapshot or restore to copy).
    """
    if page_tokens <= 0:
        _fail(f"page_tokens: must be positive, got {page_tokens}")
    table = _int_array("page_table", page_table, 2)
    ends = _int_array("consumed", consumed, 1)
    if ends.size != table.shape[0]:
        _fail(f"consumed: {ends.size} rows, page_table has {table.shape[0]}")
    out = np.full(ends.size, -1, dtype=np.int32)
    partial = np.flatnonzero((ends > 0) & (ends % page_tokens != 0))
    if partial.size:
        index = ends[partial] // page_tokens
        if int(index.max()) >= table.shape[1]:
            _fail(f"consumed: endpoint {int(ends[partial].max())} lies past the page table's {table.shape[1]} pages")
        out[partial] = table[partial, index]
    return out


# ----------------------------------------------------------------------------------------------
# gated linear recurrence (recurrent histories)
# ----------------------------------------------------------------------------------------------


def recurrence_gate(gate: AnyArray) -> F32:
    """``sigmoid(gate)`` in float32, evaluated without overflow: with ``e = exp(-|gate|)``, ``1 / (1 + e)``
    where ``gate >= 0`` and ``e / (1 + e)`` elsewhere."""
    g = _float_array("gate", gate)
    e = np.exp(-np.abs(g))
    one = np.float32(1.0)
    result: F32 = np.where(g >= 0, one / (one + e), e / (one + e)).astype(np.float32)
    return result


def _recurrence_state(state: AnyArray, width: int) -> AnyArray:
    target = _in_place_target("state", state)
    if target.dtype != np.float32 or target.ndim != 2 or target.shape[1] != width:
        _fail(f"state: expected a float32 [rows, {width}] array, got {target.dtype} {target.shape}")
    return target


def _recurrence_rows(rows: AnyArray, lanes: int, state_rows: int) -> I64:
    index = _int_array("rows", rows, 1)
    if index.size != lanes:
        _fail(f"rows: expected {lanes} lanes, got {index.size}")
    used = index[index >= 0]
    if used.size and int(used.max()) >= state_rows:
        _fail(f"rows: {int(used.max())} is out of range for {state_rows} state rows")
    if np.unique(used).size != used.size:
        _fail("rows: a state row appears twice")
    return index


def gated_recurrence_scan(gate: AnyArray, x: AnyArray, token_row: AnyArray, rows: AnyArray, state: AnyArray) -> F32:
    """A gated linear recurrence over packed tokens, each lane's tokens in packed order; ``state`` in place.

    Args:
        gate: ``[T, D]`` gate pre-activations.
        x: ``[T, D]`` inputs.
        token_row: ``[T]`` each token's lane (negative: a padding token, skipped).
        rows: ``[R]`` each lane's state row (negative: the lane is skipped).
        state: ``[S, D]`` float32 recurrent state rows, read and written in place.

    For each lane ``r`` with ``rows[r] >= 0`` and its tokens ``t`` (``token_row[t] == r``) in increasing
    ``t``: ``a = recurrence_gate(gate[t])``, ``s = a * s + (1 - a) * x[t]`` (float32; the product
    ``(1 - a) * x[t]`` is rounded before the sum), ``out[t] = s``, starting from ``s = state[rows[r]]``;
    the last ``s`` is written back to ``state[rows[r]]``. Every other output row is zero.
    """
    g = _float_array("gate", gate, 2)
    inputs = _float_array("x", x, 2)
    if inputs.shape != g.shape:
        _fail(f"x: shape {inputs.shape} differs from gate's {g.shape}")
    tokens, width = g.shape
    lanes_of = _int_array("token_row", token_row, 1)
    if lanes_of.size != tokens:
        _fail(f"token_row: expected {tokens} tokens, got {lanes_of.size}")
    target = _recurrence_state(state, width)
    index = _recurrence_rows(rows, int(np.asarray(rows).size), target.shape[0])
    if lanes_of.size and int(lanes_of.max()) >= index.size:
        _fail(f"token_row: lane {int(lanes_of.max())} is out of range for {index.size} lanes")
    decay = recurrence_gate(g)  # [T, D]
    drive = ((np.float32(1.0) - decay) * inputs).astype(np.float32)  # [T, D]
    out = np.zeros((tokens, width), dtype=np.float32)
    for lane in np.unique(lanes_of[lanes_of >= 0]).tolist():
        row = int(index[lane])
        if row < 0:
            continue
        s = target[row].copy()  # [D]
        for t in np.flatnonzero(lanes_of == lane).tolist():
            s = decay[t] * s + drive[t]
            out[t] = s
        target[row] = s
    return out


def gated_recurrence_step(gate: AnyArray, x: AnyArray, rows: AnyArray, state: AnyArray) -> F32:
    """One token a lane of the gated linear recurrence (decode); ``state`` in place.

    Args:
        gate: ``[R, D]`` gate pre-activations, one row a lane.
        x: ``[R, D]`` inputs.
        rows: ``[R]`` each lane's state row (negative: the lane is skipped, its output row is zero).
        state: ``[S, D]`` float32 recurrent state rows.

    ``a = recurrence_gate(gate[i])``, ``state[rows[i]] = a * state[rows[i]] + (1 - a) * x[i]`` and
    ``out[i]`` the new row: the arithmetic of one :func:`gated_recurrence_scan` token, so a lane's state
    does not depend on whether its tokens came one a round or in a packed block.
    """
    g = _float_array("gate", gate, 2)
    inputs = _float_array("x", x, 2)
    if inputs.shape != g.shape:
        _fail(f"x: shape {inputs.shape} differs from gate's {g.shape}")
    lanes, width = g.shape
    target = _recurrence_state(state, width)
    index = _recurrence_rows(rows, lanes, target.shape[0])
    decay = recurrence_gate(g)
    drive = ((np.float32(1.0) - decay) * inputs).astype(np.float32)
    out = np.zeros((lanes, width), dtype=np.float32)
    live = np.flatnonzero(index >= 0)
    if live.size:
        state_rows = index[live]
        updated = (decay[live] * target[state_rows] + drive[live]).astype(np.float32)
        target[state_rows] = updated
        out[live] = updated
    return out


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)

_SAMPLE_PREFIX = 64
"""Tokens first sorted per sampled row; the prefix grows 16x while it cannot decide (speed only)."""


def splitmix64(seed: AnyArray, step: AnyArray) -> U64:
    """Counter-based 64-bit hash of ``(seed, step)``: output number ``step`` of SplitMix64.

    Args:
        seed: integer array (uint64 on the wire; other integer dtypes are reinterpreted mod 2**64).
        step: integer array broadcastable with ``seed``, ``>= 0``.
    Returns:
        uint64 ``mix(seed + (step + 1) * 0x9E3779B97F4A7C15 mod 2**64)`` where ``mix`` is Vigna's
        SplitMix64 finaliser ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
        z *= 0x94D049BB133111EB; z ^= z >> 31``. This is exactly the ``step``-th (0-based) output
        of the SplitMix64 generator whose state starts at ``seed``, but computable directly.
    """
    seeds = np.asarray(seed)
    steps = np.asarray(step)
    if seeds.dtype.kind not in "iu" or steps.dtype.kind not in "iu":
        _fail(f"seed/step: expected integer arrays, got {seeds.dtype} and {steps.dtype}")
    if steps.size and int(steps.min()) < 0:
        _fail("step: must be >= 0")
    with np.errstate(over="ignore"):  # arithmetic is mod 2**64 by design
        z = seeds.astype(np.uint64) + (steps.astype(np.uint64) + np.uint64(1)) * _GOLDEN_GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
    mixed: U64 = np.asarray(z ^ (z >> np.uint64(31)), dtype=np.uint64)
    return mixed


def counter_uniform(seed: AnyArray, step: AnyArray) -> F64:
    """The per-request uniform of ``(seed, step)``: ``(splitmix64(seed, step) >> 11) * 2**-53``.

    Returns float64 in ``[0, 1)`` with 53 random bits. It depends on nothing but ``(seed, step)``:
    not on other rows, row order or call order.
    """
    bits = splitmix64(seed, step) >> np.uint64(11)
    uniform: F64 = bits.astype(np.float64) * (2.0**-53)
    return uniform


class SampleResult(NamedTuple):
    """What :func:`sample` returns."""

    ids: I32
    """``[R]`` sampled token ids."""
    logprobs: F32
    """``[R]`` log-probability of each sampled id under the raw distribution (see :func:`sample`)."""
    top_ids: I32
    """``[R, N]`` the N most likely ids of the raw distribution (desc, ties by id asc)."""
    top_logprobs: F32
    """``[R, N]`` their log-probabilities."""


def unpack_allowed_mask(allowed_mask: AnyArray, vocab: int) -> Bool:
    """Unpack a grammar bitmask: ``[R, W]`` int32 words -> ``[R, vocab]`` bool.

    Bit ``b`` (LSB first) of word ``w`` allows id ``32*w + b``; ``W >= ceil(vocab / 32)``.
    """
    words = np.asarray(allowed_mask)
    if words.dtype not in (np.int32, np.uint32):
        _fail(f"allowed_mask: expected int32 words, got dtype {words.dtype}")
    if words.ndim != 2 or words.shape[1] * 32 < vocab:
        _fail(f"allowed_mask: expected [R, >= {-(-vocab // 32)}] words for {vocab} ids, got {words.shape}")
    as_bytes = np.ascontiguousarray(words.astype("<u4", copy=False)).view(np.uint8)  # [R, 4W]
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")  # [R, 32W]
    allowed: Bool = bits[:, :vocab].astype(np.bool_)
    return allowed


def apply_grammar_mask(logits: AnyArray, allowed_mask: AnyArray, constrained: AnyArray) -> F32:
    """Set the logits of disallowed ids to ``-inf`` on constrained rows.

    Args:
        logits: ``[R, V]`` float.
        allowed_mask: ``[R, ceil(V/32)]`` int32 bitmask (bit ``b`` of word ``w`` allows id
            ``32*w + b``, LSB first).
        constrained: ``[R]`` uint8/bool; the mask applies only where set.
    Returns:
        ``[R, V]`` float32 copy.
    """
    out = np.array(_float_array("logits", logits, 2), dtype=np.float32, copy=True)
    rows, vocab = out.shape
    flags = _flag_array("constrained", constrained, (rows,))
    allowed = unpack_allowed_mask(allowed_mask, vocab)
    if allowed.shape[0] != rows:
        _fail(f"allowed_mask: expected {rows} rows, got {allowed.shape[0]}")
    out[flags[:, None] & ~allowed] = -np.inf
    return out


def apply_penalties(
    logits: AnyArray,
    repetition_penalty: AnyArray,
    frequency_penalty: AnyArray,
    presence_penalty: AnyArray,
    prompt_presence: AnyArray,
    output_counts: AnyArray,
) -> F32:
    """Repetition, frequency and presence penalties, in that order, in float32.

    Args:
        logits: ``[R, V]`` float.
        repetition_penalty: ``[R]`` float > 0 (1 = off). Hugging Face semantics on every id present
            in the prompt or the output: a positive logit is divided by it, others multiplied; a
            finite result beyond float32's range saturates at its largest finite value (signed).
        frequency_penalty, presence_penalty: ``[R]`` float (0 = off). OpenAI semantics on output
            counts only: ``logit -= frequency * count``, then ``logit -= presence * (count > 0)``.
        prompt_presence: ``[R, V]`` uint8/bool, nonzero where the id occurs in the prompt.
        output_counts: ``[R, V]`` integer occurrences of each id in the output so far.
    Returns:
        ``[R, V]`` float32 penalised logits (a copy).
    """
    out = np.array(_float_array("logits", logits, 2), dtype=np.float32, copy=True)
    rows, vocab = out.shape
    rep = _per_row("repetition_penalty", repetition_penalty, rows, "fiu").astype(np.float32)
    freq = _per_row("frequency_penalty", frequency_penalty, rows, "fiu").astype(np.float32)
    pres = _per_row("presence_penalty", presence_penalty, rows, "fiu").astype(np.float32)
    if not (np.all(np.isfinite(rep)) and np.all(rep > 0)):
        _fail("repetition_penalty: must be finite and > 0")
    if not (np.all(np.isfinite(freq)) and np.all(np.isfinite(pres))):
        _fail("frequency_penalty/presence_penalty: must be finite")
    presence_arr = np.asarray(prompt_presence)
    if presence_arr.dtype.kind not in "biu" or presence_arr.shape != (rows, vocab):
        _fail(f"prompt_presence: expected [{rows}, {vocab}], got {presence_arr.dtype} {presence_arr.shape}")
    counts_arr = np.asarray(output_counts)
    if counts_arr.dtype.kind not in "iu" or counts_arr.shape != (rows, vocab):
        _fail(f"output_counts: expected integer [{rows}, {vocab}], got {counts_arr.dtype} {counts_arr.shape}")
    # neutral rows (1, 0, 0) are left untouched: exactly what the formulas give them
    touched = np.flatnonzero((rep != np.float32(1.0)) | (freq != 0) | (pres != 0))
    if touched.size == 0:
        return out
    sub = out[touched]  # [n, V]
    counts_sub = counts_arr[touched]
    in_output = counts_sub > 0
    rep_col = rep[touched, None]
    with np.errstate(over="ignore"):  # an extreme penalty saturates at the largest finite float32
        scaled = np.where(sub > 0, sub / rep_col, sub * rep_col)
    penalised = np.where(np.isfinite(sub), np.clip(scaled, -_FLOAT32_MAX, _FLOAT32_MAX), sub)
    sub = np.where(((presence_arr[touched] != 0) | in_output) & (rep_col != np.float32(1.0)), penalised, sub)
    sub = sub - freq[touched, None] * counts_sub.astype(np.float32)
    sub = sub - pres[touched, None] * in_output.astype(np.float32)
    out[touched] = sub
    return out


def log_softmax(logits: AnyArray, vocab_limit: int | None = None) -> F32:
    """Row-wise log-softmax over ids ``< vocab_limit`` (others get ``-inf``).

    Args:
        logits: ``[R, V]`` float; every row needs a finite logit below ``vocab_limit``.
        vocab_limit: default ``V``.
    Returns:
        ``[R, V]`` float32, computed in float64: ``z = l - max(l)``, ``z - log(sum(exp(z)))``.
    """
    l32 = _float_array("logits", logits, 2)
    vocab = l32.shape[1]
    limit = vocab if vocab_limit is None else vocab_limit
    if not 1 <= limit <= vocab:
        _fail(f"vocab_limit: must be in [1, {vocab}], got {limit}")
    l64 = l32.astype(np.float64)
    l64[:, limit:] = -np.inf
    peak = l64.max(axis=1, keepdims=True)  # [R, 1]
    if np.isnan(l64).any() or not np.all(np.isfinite(peak)):
        _fail("logits: every row needs a finite maximum and no NaN")
    z = l64 - peak
    out: F32 = (z - np.log(np.sum(np.exp(z), axis=1, keepdims=True))).astype(np.float32)
    return out


def log_softmax_gather(logits: AnyArray, targets: AnyArray, vocab_limit: int) -> F32:
    """Log-probability of ``targets[r]`` under ``log_softmax(logits[r])`` (prompt scoring).

    Args:
        logits: ``[R, V]`` float.
        targets: ``[R]`` integer ids in ``[0, vocab_limit)``.
        vocab_limit: ids at or above it are excluded from the distribution.
    Returns:
        ``[R]`` float32 (same arithmetic as :func:`log_softmax`).
    """
    lp = log_softmax(logits, vocab_limit)
    ids = _int_array("targets", targets, 1)
    if ids.shape != (lp.shape[0],):
        _fail(f"targets: expected shape ({lp.shape[0]},), got {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_limit):
        _fail(f"targets: ids must lie in [0, {vocab_limit})")
    out: F32 = lp[np.arange(ids.size), ids]
    return out


def argmax_rows(x: AnyArray) -> I32:
    """``[R, V]`` float -> ``[R]`` int32 index of each row's maximum (lowest index on ties)."""
    x32 = _float_array("x", x, 2)
    if x32.shape[1] == 0:
        _fail("x: rows are empty")
    if np.isnan(x32).any():
        _fail("x: contains NaN")
    best: I32 = np.argmax(x32, axis=1).astype(np.int32)
    return best


def _weights_prefix(weights: F64, count: int, positive: int) -> NDArray[np.intp]:
    """Ids of the ``count`` largest weights and all ties with the last, sorted by (weight desc, id asc).

    Always an exact prefix of that order over all positive weights (``positive`` of them).
    """
    if count >= positive:
        candidates = np.flatnonzero(weights > 0.0)
    else:
        kth = weights.size - count
        threshold = np.partition(weights, kth)[kth]  # the count-th largest, > 0
        candidates = np.flatnonzero(weights >= threshold)
    ordered: NDArray[np.intp] = candidates[np.argsort(-weights[candidates], kind="stable")]
    return ordered


def _top_n(values: F32, n: int) -> NDArray[np.intp]:
    """Ids of the ``n`` largest values sorted by (value desc, id asc)."""
    size = values.size
    if n >= size:
        candidates = np.arange(size)
    else:
        kth = size - n
        candidates = np.flatnonzero(values >= np.partition(values, kth)[kth])
    ordered: NDArray[np.intp] = candidates[np.argsort(-values[candidates], kind="stable")][:n]
    return ordered


class _KeptRow(NamedTuple):
    """The ids one processed row keeps after temperature and the filters (step 5 of :func:`sample`)."""

    weights: F64
    """``[V]`` ``exp((l - max l) / temperature)`` in float64 (the top id weighs exactly 1.0)."""
    positive: int
    """How many weights are positive."""
    order: NDArray[np.intp]
    """A prefix of the (weight desc, id asc) order long enough to decide the cut."""
    prefix_count: int
    """The prefix length asked of :func:`_weights_prefix` for ``order``."""
    keep: int
    """Kept ids: ``order[:keep]``, or every positive id when ``keep == positive``."""
    total: float
    """The kept weights summed in id order."""

    def kept_weights(self) -> F64:
        """``[V]`` the kept weights, 0 elsewhere."""
        if self.keep == self.positive:
            return self.weights.copy()
        kept = np.zeros_like(self.weights)
        kept[self.order[: self.keep]] = self.weights[self.order[: self.keep]]
        return kept


def _kept_row(logits: F32, temperature: float, top_k: int, top_p: float, min_p: float) -> _KeptRow:
    """Apply temperature, top_k, top_p and min_p to one row of processed logits (temperature > 0)."""
    l64 = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # a tiny temperature may push (l - max) / t to -inf
        weights: F64 = np.exp((l64 - l64.max()) / temperature)  # the top id weighs exactly 1.0
    positive = int(np.count_nonzero(weights))
    k_on = 0 < top_k < positive
    p_on = top_p < 1.0
    m_on = min_p > 0.0
    if k_on:
        kept_k = np.zeros_like(weights)
        top = _weights_prefix(weights, top_k, positive)[:top_k]
        kept_k[top] = weights[top]
        mass_k = float(kept_k.sum())  # top-k mass, summed in id order
    else:
        mass_k = float(weights.sum())
    count = min(positive, max(_SAMPLE_PREFIX, top_k if k_on else 0))
    while True:
        order = _weights_prefix(weights, count, positive)
        size = order.size
        complete = size >= positive
        ordered = weights[order]
        cumulative = np.cumsum(ordered)  # sequential, so every prefix is path independent
        cuts: list[int] = []  # cut points that this prefix decides
        if k_on:
            cuts.append(top_k)
        if p_on:
            j = int(np.searchsorted(cumulative, top_p * mass_k, side="left"))
            if j < size:
                cuts.append(j + 1)
            elif complete:
                cuts.append(size)
        if m_on:
            above = int(np.count_nonzero(ordered >= min_p))
            if above < size or complete:
                cuts.append(above)
        if not (k_on or p_on or m_on):
            keep = positive
        elif cuts:
            keep = min(cuts)  # with a filter on, keep <= size: the prefix holds every kept id
        else:
            count = min(positive, count * 16)
            continue
        if keep == positive:
            total = float(weights.sum())
        else:
            kept = np.zeros_like(weights)
            kept[order[:keep]] = ordered[:keep]
            total = float(kept.sum())  # kept mass, summed in id order
        return _KeptRow(weights=weights, positive=positive, order=order, prefix_count=count, keep=keep, total=total)


def _sample_row(logits: F32, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """Draw one id from one row of processed logits (temperature > 0); see :func:`sample`."""
    row = _kept_row(logits, temperature, top_k, top_p, min_p)
    order, count, keep, positive = row.order, row.prefix_count, row.keep, row.positive
    while True:
        size = order.size
        complete = size >= positive
        cumulative = np.cumsum(row.weights[order])  # sequential, so every prefix is path independent
        within = min(keep, size)
        index = int(np.searchsorted(cumulative[:within], u * row.total, side="right"))
        if index < within:
            return int(order[index])
        if keep <= size or complete:
            return int(order[within - 1])  # rounding left the target past the last kept id
        count = min(positive, count * 16)  # no filter: a longer prefix of every positive id
        order = _weights_prefix(row.weights, count, positive)


class _Filters(NamedTuple):
    """Validated per-row temperature and filters of :func:`sample` (float64 / int64)."""

    temperature: F64
    top_k: I64
    top_p: F64
    min_p: F64


def _sampling_filters(
    l32: F32, temperature: AnyArray, top_k: AnyArray, top_p: AnyArray, min_p: AnyArray, *, vocab_limit: int, top_n: int
) -> _Filters:
    """Check the logits, vocab_limit, top_n and the per-row settings as :func:`sample` does, in its order."""
    rows, vocab = l32.shape
    if not np.all(l32 < np.inf):
        _fail("logits: contains NaN or +inf")
    if not 1 <= vocab_limit <= vocab:
        _fail(f"vocab_limit: must be in [1, {vocab}], got {vocab_limit}")
    if not 0 <= top_n <= vocab:
        _fail(f"top_n: must be in [0, {vocab}], got {top_n}")
    temps = _per_row("temperature", temperature, rows, "fiu").astype(np.float64)
    ks = _per_row("top_k", top_k, rows, "iu").astype(np.int64)
    ps = _per_row("top_p", top_p, rows, "fiu").astype(np.float64)
    mins = _per_row("min_p", min_p, rows, "fiu").astype(np.float64)
    if not (np.all(np.isfinite(temps)) and np.all(temps >= 0)):
        _fail("temperature: must be finite and >= 0")
    if np.any(ks < 0):
        _fail("top_k: must be >= 0")
    if not (np.all(ps > 0) and np.all(ps <= 1)):
        _fail("top_p: must lie in (0, 1]")
    if not (np.all(mins >= 0) and np.all(mins <= 1)):
        _fail("min_p: must lie in [0, 1]")
    return _Filters(temperature=temps, top_k=ks, top_p=ps, min_p=mins)


def _processed_logits(
    l32: F32,
    penalties: tuple[AnyArray, AnyArray, AnyArray],
    prompt_presence: AnyArray,
    output_counts: AnyArray,
    *,
    vocab_limit: int,
    allowed_mask: AnyArray | None,
    constrained: AnyArray | None,
    allow_empty_rows: bool = False,
) -> F32:
    """Steps 0-2 of :func:`sample`: the vocabulary limit, the penalties (repetition, frequency,
    presence) and the grammar mask; raises when a row is left without a finite logit, unless
    ``allow_empty_rows`` (then such a row is all ``-inf``)."""
    limited = l32.copy()
    limited[:, vocab_limit:] = -np.inf
    processed = apply_penalties(limited, *penalties, prompt_presence, output_counts)
    if (allowed_mask is None) != (constrained is None):
        _fail("allowed_mask and constrained must be given together")
    if allowed_mask is not None and constrained is not None:
        processed = apply_grammar_mask(processed, allowed_mask, constrained)
    finite = np.isfinite(processed.max(axis=1))
    if not finite.all() and not allow_empty_rows:
        _fail(f"sample: row {int(np.flatnonzero(~finite)[0])} has no sampleable id after masking")
    return processed


def _distribution_row(processed: F32, temperature: float, top_k: int, top_p: float, min_p: float) -> F64:
    """``[V]`` float64: the probability of each id of one processed row under steps 4-5 of :func:`sample`
    (one-hot at the argmax at temperature 0, else the kept weights over their id-order sum)."""
    if temperature == 0.0:
        one_hot = np.zeros(processed.size, dtype=np.float64)
        one_hot[int(np.argmax(processed))] = 1.0
        return one_hot
    row = _kept_row(processed, temperature, top_k, top_p, min_p)
    probabilities: F64 = row.kept_weights() / row.total
    return probabilities


def sample(
    logits: AnyArray,
    *,
    temperature: AnyArray,
    top_k: AnyArray,
    top_p: AnyArray,
    min_p: AnyArray,
    repetition_penalty: AnyArray,
    frequency_penalty: AnyArray,
    presence_penalty: AnyArray,
    prompt_presence: AnyArray,
    output_counts: AnyArray,
    seed: AnyArray,
    step: AnyArray,
    vocab_limit: int,
    allowed_mask: AnyArray | None = None,
    constrained: AnyArray | None = None,
    top_n: int = 0,
    allow_empty_rows: bool = False,
) -> SampleResult:
    """Per-request seeded sampling: one token id per row of logits.

    Args:
        logits: ``[R, V]`` float32 (NaN or +inf raises; -inf marks an impossible id).
        temperature: ``[R]`` float >= 0; 0 = greedy.
        top_k: ``[R]`` integer >= 0; 0 = off.
        top_p: ``[R]`` float in ``(0, 1]``; 1 = off.
        min_p: ``[R]`` float in ``[0, 1]``; 0 = off.
        repetition_penalty, frequency_penalty, presence_penalty: ``[R]`` float; see
            :func:`apply_penalties`.
        prompt_presence: ``[R, V]`` uint8 (nonzero: id occurs in the prompt).
        output_counts: ``[R, V]`` int32 counts of each id in the output so far.
        seed: ``[R]`` uint64; step: ``[R]`` int64 >= 0 (the index of the token being sampled).
        vocab_limit: ids ``>= vocab_limit`` (padding of the logits) are never sampled nor counted.
        allowed_mask: ``[R, ceil(V/32)]`` int32 grammar bitmask (see :func:`apply_grammar_mask`).
        constrained: ``[R]`` uint8; the mask applies only where set (both or neither given).
        top_n: how many top alternatives to report per row (0 = none).
    Returns:
        :class:`SampleResult` with ``ids [R]`` int32, ``logprobs [R]`` float32,
        ``top_ids [R, top_n]`` int32 and ``top_logprobs [R, top_n]`` float32.

    Exact order per row:

    0. ids ``>= vocab_limit`` get ``-inf``;
    1. penalties (repetition, then frequency, then presence; float32);
    2. grammar mask (``-inf`` where disallowed on constrained rows). A row left without a finite
       logit raises ``ValueError``; with ``allow_empty_rows`` it samples nothing instead: its id is
       -1, its logprob 0, its top ids -1 and top logprobs 0, and the other rows sample as they
       would without it (the GPU kernel's behaviour; the request of that row alone fails).
    3. Reported log-probabilities: ``log_softmax`` of these penalised, masked logits *before*
       temperature and truncation (what OpenAI-compatible servers report as the model's
       distribution), float64 then rounded to float32. ``logprobs`` is the entry of the sampled
       id; ``top_ids``/``top_logprobs`` the ``top_n`` largest (desc, ties by id asc).
    4. ``temperature == 0``: the id of the largest processed logit (lowest id on ties); the
       filters below cannot change it.
    5. Otherwise weights ``w = exp((l - max l) / temperature)`` in float64 (the top id weighs 1)
       and the candidates are sorted by (w desc, id asc). Then, as prefixes of that order:
       top_k keeps the first ``top_k``; top_p keeps the shortest prefix whose cumulative weight
       (sequential float64 sums) reaches ``top_p`` times the top-k mass (the sum in id order of
       the weights top_k kept); min_p keeps ids with ``w >= min_p`` (probability at least
       ``min_p`` times the top probability; renormalising after top_k/top_p does not change
       that ratio, so its place in the order is immaterial). The most restrictive cut wins, and
       at least one id always survives.
    6. Draw: ``u = counter_uniform(seed, step)``; ``target = u * W`` with ``W`` the kept weights
       summed in id order; the sampled id is the first kept id (in the sorted order) whose
       running sequential sum of weights exceeds ``target``, or the last kept id if rounding
       leaves none. The same ``(seed, step)`` and row inputs give the same id whatever else
       shares the batch.
    """
    l32 = _float_array("logits", logits, 2)
    rows = l32.shape[0]
    filters = _sampling_filters(l32, temperature, top_k, top_p, min_p, vocab_limit=vocab_limit, top_n=top_n)
    temps, ks, ps, mins = filters
    seeds = _per_row("seed", seed, rows, "iu")
    steps = _per_row("step", step, rows, "iu")
    uniforms = counter_uniform(seeds, steps)  # [R]

    processed = _processed_logits(
        l32,
        (repetition_penalty, frequency_penalty, presence_penalty),
        prompt_presence,
        output_counts,
        vocab_limit=vocab_limit,
        allowed_mask=allowed_mask,
        constrained=constrained,
        allow_empty_rows=allow_empty_rows,
    )
    empty = ~np.isfinite(processed.max(axis=1))  # rows the mask left nothing: id -1, logprob 0
    raw_logprobs = log_softmax(np.where(empty[:, None], np.float32(0.0), processed))  # [R, V]

    ids = np.full(rows, -1, dtype=np.int32)
    top_ids = np.full((rows, top_n), -1, dtype=np.int32)
    top_logprobs = np.zeros((rows, top_n), dtype=np.float32)
    logprobs = np.zeros(rows, dtype=np.float32)
    for r in range(rows):
        if empty[r]:
            continue
        row = processed[r]
        if temps[r] == 0.0:
            ids[r] = int(np.argmax(row))
        else:
            ids[r] = _sample_row(row, float(temps[r]), int(ks[r]), float(ps[r]), float(mins[r]), float(uniforms[r]))
        if top_n:
            best = _top_n(raw_logprobs[r], top_n)
            top_ids[r] = best
            top_logprobs[r] = raw_logprobs[r, best]
        logprobs[r] = raw_logprobs[r, ids[r]]
    return SampleResult(ids=ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)


def update_output_counts(output_counts: AnyArray, ids: AnyArray, active_rows: AnyArray) -> None:
    """``output_counts[r, ids[r]] += 1`` for every active row, in place.

    Args:
        output_counts: ``[R, V]`` integer, writable.
        ids: ``[R]`` integer sampled ids (ignored on inactive rows; in ``[0, V)`` on active ones).
        active_rows: ``[R]`` uint8/bool.
    """
    counts = _in_place_target("output_counts", output_counts)
    if counts.ndim != 2 or counts.dtype.kind not in "iu":
        _fail(f"output_counts: expected an integer [R, V] array, got {counts.dtype} {counts.shape}")
    rows, vocab = counts.shape
    sampled = _int_array("ids", ids, 1)
    if sampled.shape != (rows,):
        _fail(f"ids: expected shape ({rows},), got {sampled.shape}")
    active = _flag_array("active_rows", active_rows, (rows,))
    which = np.flatnonzero(active)
    chosen = sampled[which]
    if chosen.size and (int(chosen.min()) < 0 or int(chosen.max()) >= vocab):
        _fail(f"ids: active rows must hold ids in [0, {vocab})")
    counts[which, chosen] += 1


# ----------------------------------------------------------------------------------------------
# speculative generation with copied proposals
# ----------------------------------------------------------------------------------------------


def packed_lane_starts(query_length: AnyArray) -> tuple[I64, I64]:
    """Each lane's token count and the packed index of its first token.

    Args:
        query_length: ``[B]`` integer tokens per lane, each ``>= 0`` (a negative length raises).
    Returns:
        ``(lengths, starts)``, both ``[B]`` int64: ``starts[r] = lengths[0] + ... + lengths[r-1]``.
    """
    lengths = _int_array("query_length", query_length, 1)
    if lengths.size and int(lengths.min()) < 0:
        _fail(f"query_length: lane {int(np.flatnonzero(lengths < 0)[0])} has a negative length")
    starts: I64 = np.cumsum(lengths) - lengths
    return lengths, starts


def _lane_vector(name: str, value: AnyArray, lanes: int) -> I64:
    values = _int_array(name, value, 1)
    if values.shape != (lanes,):
        _fail(f"{name}: expected shape ({lanes},), got {values.shape}")
    return values


def _check_offers(lanes_with_tokens: I64, lengths: I64, capacity: int) -> None:
    offers = lengths[lanes_with_tokens] - 1
    if offers.size and int(offers.max()) > capacity:
        lane = int(lanes_with_tokens[int(np.argmax(offers))])
        _fail(f"query_length: lane {lane} offers {int(lengths[lane]) - 1} candidates, candidate_ids holds {capacity}")


def _check_state_rows(state: I64, lanes: I64, state_rows: int) -> None:
    named = state[lanes]
    if named.size and (int(named.min()) < 0 or int(named.max()) >= state_rows):
        _fail(f"rows: a lane with tokens names a state row outside [0, {state_rows})")


def speculative_inputs(
    ids: AnyArray, pending_tokens: AnyArray, rows: AnyArray, candidate_ids: AnyArray, query_length: AnyArray
) -> None:
    """Pack each lane's pending token and its copied candidates into ``ids``, in place.

    Args:
        ids: ``[P]`` writable integer packed token ids.
        pending_tokens: ``[S]`` or ``[S, 1]`` integer state: each state row's pending token.
        rows: ``[B]`` integer state row of each lane (read only for lanes with tokens).
        candidate_ids: ``[B, C]`` integer copied candidates, ``C >= 0``.
        query_length: ``[B]`` integer packed tokens of each lane (>= 0).

    Lane ``r``'s block starts at ``start = query_length[0] + ... + query_length[r-1]``:
    ``ids[start] = pending_tokens[rows[r]]`` and ``ids[start + 1 + j] = candidate_ids[r, j]`` for
    ``j < query_length[r] - 1``. A lane of length 0 writes nothing and entries past the total are left
    as they are. Raises (before writing anything) when a lane offers more than ``C`` candidates, the
    total exceeds ``P``, or a lane with tokens names a state row outside ``[0, S)``.
    """
    out = _in_place_target("ids", ids)
    if out.ndim != 1 or out.dtype.kind not in "iu":
        _fail(f"ids: expected a one-dimensional integer array, got {out.dtype} {out.shape}")
    pending = np.asarray(pending_tokens)
    if pending.dtype.kind not in "iu" or not (pending.ndim == 1 or (pending.ndim == 2 and pending.shape[1] == 1)):
        _fail(f"pending_tokens: expected integer [S] or [S, 1], got {pending.dtype} {pending.shape}")
    pending_flat = pending.reshape(-1)
    candidates = _int_array("candidate_ids", candidate_ids, 2)
    lanes, capacity = candidates.shape
    lengths, starts = packed_lane_starts(query_length)
    if lengths.shape != (lanes,):
        _fail(f"query_length: expected shape ({lanes},) for {lanes} candidate rows, got {lengths.shape}")
    state = _lane_vector("rows", rows, lanes)
    live = np.flatnonzero(lengths > 0)
    _check_offers(live, lengths, capacity)
    total = int(lengths.sum())
    if total > out.size:
        _fail(f"query_length: {total} packed tokens exceed the {out.size} entries of ids")
    _check_state_rows(state, live, pending_flat.size)
    for lane in live.tolist():
        start, offers = int(starts[lane]), int(lengths[lane]) - 1
        out[start] = pending_flat[state[lane]]
        out[start + 1 : start + 1 + offers] = candidates[lane, :offers]


class VerifyResult(NamedTuple):
    """What :func:`sample_verify` returns."""

    ids: I32
    """``[B, W]`` emitted tokens of each lane, -1 past them."""
    logprobs: F32
    """``[B, W]`` log-probability of each emitted token (as :func:`sample` reports it), 0 past them."""
    accepted: I32
    """``[B]`` candidates each lane accepted."""
    emitted: I32
    """``[B]`` tokens each lane emitted: accepted + 1 on an active lane, else 0."""
    pending: I32
    """``[B]`` each lane's last emitted token (its next pending token), -1 on an inactive lane."""


_VERIFY_SETTINGS: frozenset[str] = frozenset(
    name
    for name, parameter in inspect.signature(sample).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    and name
    not in (
        "prompt_presence", "output_counts", "step", "vocab_limit", "allowed_mask", "constrained", "top_n",
        "allow_empty_rows",
    )
)  # fmt: skip
"""The per-lane settings :func:`sample_verify` passes through to :func:`sample` (and the seed)."""


def sample_verify(
    logits: AnyArray,
    *,
    query_length: AnyArray,
    candidate_ids: AnyArray,
    settings: Mapping[str, AnyArray],
    prompt_presence: AnyArray,
    output_counts: AnyArray,
    rows: AnyArray,
    step: AnyArray,
    active: AnyArray,
    vocab_limit: int,
    width: int,
    allowed_mask: AnyArray | None = None,
    constrained: AnyArray | None = None,
    allow_empty_rows: bool = False,
) -> VerifyResult:
    """Sample each lane's packed positions in order, accepting copied candidates while they match.

    Args:
        logits: ``[P, V]`` float, one row per packed token (lanes packed as :func:`speculative_inputs`).
        query_length: ``[B]`` integer packed tokens of each lane: the pending token and
            ``query_length[r] - 1`` candidates.
        candidate_ids: ``[B, C]`` integer copied candidates.
        settings: every other per-lane keyword input of :func:`sample` (temperature, top_k, top_p,
            min_p, the penalties, seed), each ``[B]``, by :func:`sample`'s keyword name.
        prompt_presence: ``[S, V]`` the whole state buffer, read at ``rows``.
        output_counts: ``[S, V]`` the whole writable integer state buffer, updated in place.
        rows: ``[B]`` integer state row of each lane (read only on active lanes).
        step: ``[B]`` integer >= 0: the index of each lane's first token of the round.
        active: ``[B]`` flags: lanes that sample this round.
        vocab_limit: as :func:`sample`.
        width: ``W >= C + 1`` columns of the per-token results.
        allowed_mask: ``[P, words]`` int32 grammar bitmasks, one per packed row (as :func:`sample`
            takes them); position ``j`` of lane ``r`` samples with row ``start_r + j``.
        constrained: ``[B]`` flags: the masks apply to the lanes where set (both or neither given).
        allow_empty_rows: a position left without a sampleable id (its mask allows nothing) ends its
            lane instead of raising: that position's id is -1 (logprob 0, nothing counted), ``accepted``
            the position, ``emitted`` one more, ``pending`` -1; the other lanes verify as they would
            without it (as :func:`sample`'s ``allow_empty_rows``).
    Returns:
        :class:`VerifyResult`.

    For each active lane ``r`` with ``n = query_length[r] - 1`` candidates, positions ``j = 0..n`` in
    order: token ``t_j`` is what :func:`sample` draws from ``logits[start_r + j]`` for one row with the
    lane's settings, ``prompt_presence[rows[r]]``, ``output_counts[rows[r]]`` as it is at that moment,
    and ``step[r] + j``; then ``output_counts[rows[r], t_j] += 1``. The lane continues to ``j + 1`` only
    while ``j < n`` and ``t_j == candidate_ids[r, j]``. So the emitted tokens are exactly those of
    ``accepted + 1`` one-token :func:`sample` calls at steps ``step[r]..``, and a candidate is accepted
    with exactly the probability the target gives it. Logit rows past the last position a lane reaches
    are never read. Inactive lanes get ids -1, logprob 0, accepted 0, emitted 0, pending -1 and leave the
    counts untouched. With ``allowed_mask``, position ``j`` of a lane whose ``constrained`` flag is set
    samples under mask row ``start_r + j`` exactly as one-token :func:`sample` with that mask; the
    other lanes sample unmasked.

    Shapes, ranges and settings are checked before anything is sampled; when sampling itself raises
    (NaN logits, a row without a sampleable id, an invalid setting) ``output_counts`` is restored.
    """
    l32 = _float_array("logits", logits, 2)
    packed = l32.shape[0]
    candidates = _int_array("candidate_ids", candidate_ids, 2)
    lanes, capacity = candidates.shape
    lengths, starts = packed_lane_starts(query_length)
    if lengths.shape != (lanes,):
        _fail(f"query_length: expected shape ({lanes},) for {lanes} candidate rows, got {lengths.shape}")
    if width < capacity + 1:
        _fail(f"width: {width} cannot hold a pending token and {capacity} candidates")
    state = _lane_vector("rows", rows, lanes)
    steps = _lane_vector("step", step, lanes)
    flags = _flag_array("active", active, (lanes,))
    if set(settings) != _VERIFY_SETTINGS:
        missing, unknown = sorted(_VERIFY_SETTINGS - set(settings)), sorted(set(settings) - _VERIFY_SETTINGS)
        _fail(f"settings: expected exactly {sorted(_VERIFY_SETTINGS)}; missing {missing}, unknown {unknown}")
    lane_settings = {name: _per_row(name, value, lanes, "fiu") for name, value in settings.items()}
    counts = _in_place_target("output_counts", output_counts)
    if counts.ndim != 2 or counts.dtype.kind not in "iu":
        _fail(f"output_counts: expected an integer [S, V] array, got {counts.dtype} {counts.shape}")
    presence = np.asarray(prompt_presence)
    if presence.shape != counts.shape:
        _fail(f"prompt_presence {presence.shape} and output_counts {counts.shape} must be equal [S, V]")
    total = int(lengths.sum())
    if total > packed:
        _fail(f"query_length: {total} packed tokens exceed the {packed} rows of logits")
    live = np.flatnonzero(flags)
    if live.size and int(lengths[live].min()) < 1:
        _fail(f"query_length: active lane {int(live[np.argmin(lengths[live])])} has no packed token")
    _check_offers(live, lengths, capacity)
    _check_state_rows(state, live, counts.shape[0])
    if live.size and int(steps[live].min()) < 0:
        _fail("step: must be >= 0")
    if (allowed_mask is None) != (constrained is None):
        _fail("allowed_mask and constrained must be given together")
    masks: NDArray[Any] | None = None
    mask_flags = np.zeros(lanes, dtype=np.bool_)
    if allowed_mask is not None and constrained is not None:
        masks = np.asarray(allowed_mask)
        words = -(-l32.shape[1] // 32)
        if masks.dtype not in (np.int32, np.uint32):
            _fail(f"allowed_mask: expected int32 words, got dtype {masks.dtype}")
        if masks.ndim != 2 or masks.shape[0] < total or masks.shape[1] < words:
            _fail(f"allowed_mask: expected [>= {total}, >= {words}] words (a row a packed token), got {masks.shape}")
        mask_flags = _flag_array("constrained", constrained, (lanes,))

    ids = np.full((lanes, width), -1, dtype=np.int32)
    logprobs = np.zeros((lanes, width), dtype=np.float32)
    accepted = np.zeros(lanes, dtype=np.int32)
    emitted = np.zeros(lanes, dtype=np.int32)
    pending = np.full(lanes, -1, dtype=np.int32)
    touched = np.unique(state[live])
    saved = counts[touched].copy()
    try:
        for lane in live.tolist():
            row, start, offers = int(state[lane]), int(starts[lane]), int(lengths[lane]) - 1
            per_lane: dict[str, Any] = {name: value[lane : lane + 1] for name, value in lane_settings.items()}
            grammar = masks is not None and bool(mask_flags[lane])
            position = 0
            while True:
                here = start + position
                drawn = sample(
                    l32[here : here + 1],
                    **per_lane,
                    prompt_presence=presence[row : row + 1],
                    output_counts=counts[row : row + 1],
                    step=np.array([steps[lane] + position], dtype=np.int64),
                    vocab_limit=vocab_limit,
                    allowed_mask=masks[here : here + 1] if grammar and masks is not None else None,
                    constrained=np.ones(1, dtype=np.uint8) if grammar else None,
                    allow_empty_rows=allow_empty_rows,
                )
                token = int(drawn.ids[0])
                ids[lane, position] = token
                logprobs[lane, position] = drawn.logprobs[0]
                if token < 0:  # nothing sampleable here (allow_empty_rows): the lane ends on it
                    break
                counts[row, token] += 1
                if position == offers or token != int(candidates[lane, position]):
                    break
                position += 1
            accepted[lane] = position
            emitted[lane] = position + 1
            pending[lane] = token
    except ValueError:
        counts[touched] = saved
        raise
    return VerifyResult(ids=ids, logprobs=logprobs, accepted=accepted, emitted=emitted, pending=pending)


# ----------------------------------------------------------------------------------------------
# self-drafting speculation (device positions, greedy drafts, confidence allocation)
# ----------------------------------------------------------------------------------------------


class LanePositions(NamedTuple):
    """Per-token positions, lane rows and cache slots (:func:`lane_positions`, :func:`speculative_layout`)."""

    positions: I32
    token_rows: I32
    cache_slots: I64


def _page_slots(table: I64, lanes: I64, positions: I64, page_tokens: int) -> I64:
    """Cache slots of ``positions`` of ``lanes`` (page id x page_tokens + offset); raises past the table."""
    index = positions // page_tokens
    if index.size and int(index.max()) >= table.shape[1]:
        _fail(f"page_table: position {int(positions.max())} lies past the row's {table.shape[1]} pages")
    pages = table[lanes, index]
    if pages.size and int(pages.min()) < 0:
        _fail("page_table: a position's page id is negative")
    slots: I64 = pages * page_tokens + positions % page_tokens
    return slots


def lane_positions(
    consumed: AnyArray, page_table: AnyArray, limit: AnyArray, *, offset: int, page_tokens: int
) -> LanePositions:
    """Position, token row and cache slot of each lane's token ``offset`` past its consumed endpoint.

    Args:
        consumed: ``[B]`` integer consumed endpoints (the position of each lane's pending token).
        page_table: ``[B, pages]`` integer page ids.
        limit: ``[B]`` integer: the positions ``consumed[r] .. consumed[r] + limit[r] - 1`` have pages.
        offset: tokens past the endpoint (``>= 0``).
        page_tokens: tokens per page (positive).

    A lane with ``offset < limit[r]`` gets position ``consumed[r] + offset``, token row ``r`` and
    the slot of that position in its page-table row; every other lane gets position 0, token row -1
    and slot -1 (the padding the decoder skips). Raises on a negative endpoint of an active lane or a
    position whose page lies past the table or is negative.
    """
    if page_tokens <= 0:
        _fail(f"page_tokens: must be positive, got {page_tokens}")
    if offset < 0:
        _fail(f"offset: must be non-negative, got {offset}")
    table = _int_array("page_table", page_table, 2)
    lanes = table.shape[0]
    ends = _lane_vector("consumed", consumed, lanes)
    limits = _lane_vector("limit", limit, lanes)
    active = np.flatnonzero(limits > offset)
    if active.size and int(ends[active].min()) < 0:
        _fail("consumed: an active lane has a negative endpoint")
    positions = np.zeros(lanes, dtype=np.int32)
    rows = np.full(lanes, -1, dtype=np.int32)
    slots = np.full(lanes, -1, dtype=np.int64)
    where = ends[active] + offset
    slots[active] = _page_slots(table, active, where, page_tokens)
    positions[active] = where
    rows[active] = active
    return LanePositions(positions=positions, token_rows=rows, cache_slots=slots)


class DraftChoice(NamedTuple):
    """The result of :func:`draft_argmax`."""

    ids: I32
    """``[B]`` the greedy draft token of each lane."""
    confidence: F32
    """``[B]`` its softmax probability under the draft (FP64 softmax rounded to FP32)."""


def draft_argmax(logits: AnyArray, vocab_limit: int, token_rows: AnyArray | None = None) -> DraftChoice:
    """Greedy draft tokens and the draft's probability of each.

    Args:
        logits: ``[B, V]`` float draft logits.
        vocab_limit: ids at or past it are never chosen (``1 <= vocab_limit <= V``).
        token_rows: optional ``[B]`` integer; a lane whose row is negative drafted nothing: its id is
            0 (a valid embedding input) and its confidence 0.

    ``ids[r]`` is the index of the largest of ``logits[r, :vocab_limit]`` (the lowest on ties) and
    ``confidence[r] = 1 / sum_v exp(logits[r, v] - logits[r, ids[r]])`` over ``v < vocab_limit``,
    computed in float64 from the float32 logits and rounded to float32. A drafting lane whose logits
    below ``vocab_limit`` are not all finite raises.
    """
    l32 = _float_array("logits", logits, 2)
    lanes, vocab = l32.shape
    if not 1 <= vocab_limit <= vocab:
        _fail(f"vocab_limit: {vocab_limit} must lie in [1, {vocab}]")
    drafting = np.ones(lanes, dtype=bool)
    if token_rows is not None:
        drafting = _lane_vector("token_rows", token_rows, lanes) >= 0
    ids = np.zeros(lanes, dtype=np.int32)
    confidence = np.zeros(lanes, dtype=np.float32)
    live = np.flatnonzero(drafting)
    if live.size:
        window = l32[live, :vocab_limit]
        if not np.isfinite(window).all():
            _fail("logits: a drafting lane has a non-finite logit")
        best = np.argmax(window, axis=1)
        wide = window.astype(np.float64)
        top = wide[np.arange(live.size), best]
        total = np.exp(wide - top[:, None]).sum(axis=1)
        ids[live] = best.astype(np.int32)
        confidence[live] = (1.0 / total).astype(np.float32)
    return DraftChoice(ids=ids, confidence=confidence)


def draft_allocate(confidence: AnyArray, ceilings: AnyArray, *, packed_capacity: int, token_capacity: int) -> I32:
    """Each lane's target rows of a self-drafting round, chosen from draft confidence within P.

    Args:
        confidence: ``[B, D]`` float32: ``confidence[r, j]`` is the draft's probability of proposal
            ``j`` of lane ``r`` (the token after its pending token and ``j`` earlier proposals).
        ceilings: ``[B]`` integer: the most target rows lane ``r`` may take (its pending token
            included); 0 for a lane without tokens.
        packed_capacity: P, the most rows in total.
        token_capacity: W, the most rows of one lane.

    Every lane with a positive ceiling starts with one row (its pending token). Then rows are added
    one at a time: a lane of length ``n`` below its cap ``min(ceiling, D + 1, W)`` offers its frontier,
    proposal ``j = n - 1``, whose survival probability is ``confidence[r, 0] x ... x
    confidence[r, j]`` multiplied in float64 from the float32 values. The frontier with the highest
    survival wins, ties going to the shorter prefix and then to the lower lane; this repeats until the
    total reaches P or no frontier remains. Only frontiers compete, so a position is never admitted
    before its predecessor, and nothing is random. Raises on a negative ceiling, a negative or
    non-finite confidence, a non-positive P or W, or when the lanes with tokens alone exceed P.
    """
    conf = _float_array("confidence", confidence, 2)
    lanes, drafts = conf.shape
    limits = _lane_vector("ceilings", ceilings, lanes)
    if packed_capacity <= 0 or token_capacity <= 0:
        _fail(f"packed_capacity {packed_capacity} and token_capacity {token_capacity} must be positive")
    if lanes and int(limits.min()) < 0:
        _fail(f"ceilings: lane {int(np.flatnonzero(limits < 0)[0])} has a negative ceiling")
    if not np.isfinite(conf).all() or (conf < 0).any():
        _fail("confidence: values must be finite and non-negative")
    lengths = (limits > 0).astype(np.int64)
    total = int(lengths.sum())
    if total > packed_capacity:
        _fail(f"ceilings: {total} lanes with tokens exceed the {packed_capacity} packed rows")
    caps = np.minimum(limits, min(drafts + 1, token_capacity))
    survival = np.ones(lanes, dtype=np.float64)  # of each lane's admitted prefix
    while total < packed_capacity:
        best: tuple[float, int, int] | None = None
        for lane in np.flatnonzero(lengths < caps).tolist():
            n = int(lengths[lane])
            frontier = survival[lane] * np.float64(conf[lane, n - 1])
            key = (-float(frontier), n, lane)
            if best is None or key < best:
                best = key
        if best is None:
            break
        _, n, lane = best
        survival[lane] *= np.float64(conf[lane, n - 1])
        lengths[lane] += 1
        total += 1
    return lengths.astype(np.int32)


def speculative_layout(
    query_length: AnyArray, consumed: AnyArray, page_table: AnyArray, *, packed_capacity: int, page_tokens: int
) -> LanePositions:
    """Packed positions, token rows and cache slots of a round whose lane lengths the device chose.

    Args:
        query_length: ``[B]`` integer rows of each lane (``>= 0``).
        consumed: ``[B]`` integer consumed endpoints.
        page_table: ``[B, pages]`` integer page ids.
        packed_capacity: P, the packed rows to fill.
        page_tokens: tokens per page (positive).

    Lane ``r``'s block starts at ``start_r = query_length[0] + ... + query_length[r-1]``; its row
    ``start_r + j`` gets position ``consumed[r] + j``, token row ``r`` and that position's slot (as a
    prefill program's host layout packs lanes). Rows past the total get position 0, token row -1 and
    slot -1 (the padding the decoder skips). Raises when the total exceeds P, an endpoint of a lane with
    rows is negative, or a position's page lies past the table or is negative.
    """
    if page_tokens <= 0:
        _fail(f"page_tokens: must be positive, got {page_tokens}")
    table = _int_array("page_table", page_table, 2)
    lanes = table.shape[0]
    lengths, starts = packed_lane_starts(query_length)
    if lengths.shape != (lanes,):
        _fail(f"query_length: expected shape ({lanes},), got {lengths.shape}")
    ends = _lane_vector("consumed", consumed, lanes)
    total = int(lengths.sum())
    if total > packed_capacity:
        _fail(f"query_length: {total} packed rows exceed the {packed_capacity} rows")
    live = lengths > 0
    if live.any() and int(ends[live].min()) < 0:
        _fail("consumed: a lane with rows has a negative endpoint")
    lane_of = np.repeat(np.arange(lanes, dtype=np.int64), lengths)
    within = np.arange(total, dtype=np.int64) - starts[lane_of]
    where = ends[lane_of] + within
    positions = np.zeros(packed_capacity, dtype=np.int32)
    rows = np.full(packed_capacity, -1, dtype=np.int32)
    slots = np.full(packed_capacity, -1, dtype=np.int64)
    slots[:total] = _page_slots(table, lane_of, where, page_tokens)
    positions[:total] = where
    rows[:total] = lane_of
    return LanePositions(positions=positions, token_rows=rows, cache_slots=slots)


# ----------------------------------------------------------------------------------------------
# self-drafting speculation with sampled drafts
# ----------------------------------------------------------------------------------------------

PROPOSAL_STREAM_KEY = 0x70726F706F73616C
"""The ASCII bytes of ``proposal``: the proposal stream of seed ``s`` is keyed by ``splitmix64(s, key)``."""
RESIDUAL_STREAM_KEY = 0x726573696475616C
"""The ASCII bytes of ``residual``: the target stream's second draw of a verified position."""


def stream_uniform(seed: AnyArray, step: AnyArray, stream_key: int) -> F64:
    """``counter_uniform(splitmix64(seed, stream_key), step)``: the uniform of counter ``step`` on the stream
    of ``seed`` that ``stream_key`` names (a counter-based stream of its own, like ``counter_uniform``'s)."""
    keyed = splitmix64(np.asarray(seed), np.asarray(stream_key, dtype=np.uint64))
    return counter_uniform(keyed, step)


def sample_probabilities(
    logits: AnyArray,
    *,
    temperature: AnyArray,
    top_k: AnyArray,
    top_p: AnyArray,
    min_p: AnyArray,
    repetition_penalty: AnyArray,
    frequency_penalty: AnyArray,
    presence_penalty: AnyArray,
    prompt_presence: AnyArray,
    output_counts: AnyArray,
    vocab_limit: int,
    allowed_mask: AnyArray | None = None,
    constrained: AnyArray | None = None,
) -> F64:
    """``[R, V]`` float64: the distribution :func:`sample` draws each row's id from.

    The same inputs (less the seed, step and top_n) and the same checks, processing (vocabulary limit,
    penalties, grammar mask) and filters as :func:`sample`: at temperature 0 one-hot at the id
    :func:`sample` picks; otherwise each kept id's weight ``exp((l - max l) / temperature)`` over the kept
    weights summed in id order, 0 for every other id. :func:`sample`'s draw gives each kept id exactly
    this probability up to the float64 rounding of its running sums.
    """
    l32 = _float_array("logits", logits, 2)
    filters = _sampling_filters(l32, temperature, top_k, top_p, min_p, vocab_limit=vocab_limit, top_n=0)
    processed = _processed_logits(
        l32,
        (repetition_penalty, frequency_penalty, presence_penalty),
        prompt_presence,
        output_counts,
        vocab_limit=vocab_limit,
        allowed_mask=allowed_mask,
        constrained=constrained,
    )
    out = np.empty(l32.shape, dtype=np.float64)
    for r in range(l32.shape[0]):
        out[r] = _distribution_row(
            processed[r],
            float(filters.temperature[r]),
            int(filters.top_k[r]),
            float(filters.top_p[r]),
            float(filters.min_p[r]),
        )
    return out


def _draw_in_id_order(weights: F64, u: float) -> int:
    """The first id whose running sum (in id order, float64) of non-negative ``weights`` exceeds ``u``
    times their total, or the last id of positive weight when rounding leaves none."""
    cumulative = np.cumsum(weights)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    if index < weights.size:
        return index
    return int(np.flatnonzero(weights > 0)[-1])


class DraftSample(NamedTuple):
    """The result of :func:`draft_sample`."""

    ids: I32
    """``[B]`` the sampled draft token of each lane."""
    confidence: F32
    """``[B]`` the draft's probability of it (see :func:`draft_sample`)."""
    probabilities: F32
    """``[B, V]`` each lane's draft distribution q, the row verification reads."""


def draft_sample(
    logits: AnyArray,
    *,
    temperature: AnyArray,
    top_k: AnyArray,
    top_p: AnyArray,
    min_p: AnyArray,
    seed: AnyArray,
    step: AnyArray,
    draft_index: int,
    vocab_limit: int,
    token_rows: AnyArray | None = None,
) -> DraftSample:
    """Sampled draft tokens: draft token ``draft_index`` of each lane drawn from the draft's distribution.

    Args:
        logits: ``[B, V]`` float draft logits.
        temperature, top_k, top_p, min_p: ``[B]`` the lanes' settings, as :func:`sample` takes them.
        seed: ``[B]`` uint64; step: ``[B]`` integer >= 0, the index of each lane's first token of the round.
        draft_index: which draft token of the round this is (``>= 0``).
        vocab_limit: ids at or past it are never drafted (``1 <= vocab_limit <= V``).
        token_rows: optional ``[B]`` integer; a lane whose row is negative drafted nothing: id 0,
            confidence 0 and a zero probability row (its logits and settings are not read).

    Lane ``r``'s draft distribution ``q`` is :func:`sample_probabilities` of its logits with its
    temperature and filters but no penalties and no grammar mask, rounded to float32: that float32 row
    is both what the id is drawn from and what ``probabilities[r]`` hands to
    :func:`sample_verify_sampled`. At temperature > 0 the id is the first whose running float64 sum of
    ``q`` (in id order) exceeds ``u`` times the row's sum, with ``u = stream_uniform(seed[r], step[r] +
    draft_index, PROPOSAL_STREAM_KEY)`` (one proposal draw per drafted token; the target stream is not
    touched), and ``confidence[r] = q[id]``. At temperature 0 the draft is greedy: ``id`` the lowest
    index of the largest of ``logits[r, :vocab_limit]``, ``q`` one-hot at it, no draw, and the
    confidence is :func:`draft_argmax`'s (the temperature-one softmax probability of the id), since a
    one-hot row says nothing about how likely the target is to agree. A drafting lane whose logits
    below ``vocab_limit`` are not all finite, or whose settings are invalid, raises.
    """
    l32 = _float_array("logits", logits, 2)
    lanes, vocab = l32.shape
    if not 1 <= vocab_limit <= vocab:
        _fail(f"vocab_limit: {vocab_limit} must lie in [1, {vocab}]")
    if draft_index < 0:
        _fail(f"draft_index: must be non-negative, got {draft_index}")
    per_lane = {
        "temperature": _per_row("temperature", temperature, lanes, "fiu"),
        "top_k": _per_row("top_k", top_k, lanes, "iu"),
        "top_p": _per_row("top_p", top_p, lanes, "fiu"),
        "min_p": _per_row("min_p", min_p, lanes, "fiu"),
    }
    seeds = _per_row("seed", seed, lanes, "iu")
    steps = _per_row("step", step, lanes, "iu")
    drafting = np.ones(lanes, dtype=bool)
    if token_rows is not None:
        drafting = _lane_vector("token_rows", token_rows, lanes) >= 0
    ids = np.zeros(lanes, dtype=np.int32)
    confidence = np.zeros(lanes, dtype=np.float32)
    probabilities = np.zeros((lanes, vocab), dtype=np.float32)
    live = np.flatnonzero(drafting)
    if live.size == 0:
        return DraftSample(ids=ids, confidence=confidence, probabilities=probabilities)
    if not np.isfinite(l32[live, :vocab_limit]).all():
        _fail("logits: a drafting lane has a non-finite logit")
    if int(steps[live].min()) < 0:
        _fail("step: must be >= 0")
    window = l32[live]
    chosen = [value[live] for value in per_lane.values()]
    filters = _sampling_filters(window, *chosen, vocab_limit=vocab_limit, top_n=0)
    uniforms = stream_uniform(seeds[live], steps[live].astype(np.int64) + draft_index, PROPOSAL_STREAM_KEY)
    limited = window.copy()
    limited[:, vocab_limit:] = -np.inf
    for k, lane in enumerate(live.tolist()):
        temperature_k = float(filters.temperature[k])
        if temperature_k == 0.0:
            greedy = draft_argmax(l32[lane : lane + 1], vocab_limit)
            ids[lane], confidence[lane] = greedy.ids[0], greedy.confidence[0]
            probabilities[lane, int(greedy.ids[0])] = 1.0
            continue
        q = _distribution_row(
            limited[k], temperature_k, int(filters.top_k[k]), float(filters.top_p[k]), float(filters.min_p[k])
        ).astype(np.float32)
        token = _draw_in_id_order(q.astype(np.float64), float(uniforms[k]))
        ids[lane], confidence[lane] = token, q[token]
        probabilities[lane] = q
    return DraftSample(ids=ids, confidence=confidence, probabilities=probabilities)


def sample_verify_sampled(
    logits: AnyArray,
    *,
    query_length: AnyArray,
    candidate_ids: AnyArray,
    draft_probabilities: AnyArray,
    settings: Mapping[str, AnyArray],
    prompt_presence: AnyArray,
    output_counts: AnyArray,
    rows: AnyArray,
    step: AnyArray,
    active: AnyArray,
    vocab_limit: int,
    width: int,
) -> VerifyResult:
    """Verify sampled drafts: accept each candidate with probability ``min(1, p/q)``, else emit a residual draw.

    Args:
        logits: ``[P, V]`` float, one row per packed token (lanes packed as :func:`speculative_inputs`).
        query_length: ``[B]`` integer: each lane's pending token and ``query_length[r] - 1`` candidates.
        candidate_ids: ``[B, C]`` integer drafted candidates (in ``[0, V)`` where offered).
        draft_probabilities: ``[B, D >= C, V]`` float: row ``[r, j]`` is the distribution candidate ``j``
            of lane ``r`` was drawn from (:func:`draft_sample`'s probabilities); it is used as
            ``q_j = row / sum(row)`` in float64 and must be finite, non-negative and of positive sum
            where read.
        settings, prompt_presence, output_counts, rows, step, active, vocab_limit, width: as
            :func:`sample_verify`.
    Returns:
        :class:`VerifyResult`.

    For each active lane ``r`` with ``n = query_length[r] - 1`` candidates ``x_j``, positions ``j =
    0..n`` in order, with ``p_j`` :func:`sample_probabilities` of ``logits[start_r + j]`` (the lane's
    settings, ``output_counts[rows[r]]`` as it is at that moment):

    * ``j == n`` (every candidate accepted; or no candidate): the bonus token is what :func:`sample`
      draws for that row at step ``step[r] + n``.
    * temperature 0: the token is what :func:`sample` draws (the argmax), accepted iff it equals
      ``x_j``. The rule below degenerates to exactly this with a one-hot ``q``.
    * otherwise, with ``u = counter_uniform(seed, step[r] + j)`` (the target stream's draw of that
      token): ``x_j`` is accepted iff ``u * q_j(x_j) < p_j(x_j)``, that is with probability ``min(1,
      p_j(x_j) / q_j(x_j))``. At a rejection the token is drawn in id order from ``max(0, p_j - q_j)``
      (from ``p_j`` should rounding leave that zero) with the second draw of the same counter,
      ``stream_uniform(seed, step[r] + j, RESIDUAL_STREAM_KEY)``, and the lane stops.

    Each emitted token is written to ``ids[r, j]``, its log-probability as :func:`sample` reports it to
    ``logprobs[r, j]``, and counted in ``output_counts[rows[r]]``. With ``x_j ~ q_j`` every emitted token
    is distributed exactly as plain sampling from ``p_j`` would give it. Inactive lanes and the checks
    before sampling are as :func:`sample_verify`'s; a failure while sampling restores ``output_counts``.
    """
    l32 = _float_array("logits", logits, 2)
    packed, vocab = l32.shape
    candidates = _int_array("candidate_ids", candidate_ids, 2)
    lanes, capacity = candidates.shape
    lengths, starts = packed_lane_starts(query_length)
    if lengths.shape != (lanes,):
        _fail(f"query_length: expected shape ({lanes},) for {lanes} candidate rows, got {lengths.shape}")
    if width < capacity + 1:
        _fail(f"width: {width} cannot hold a pending token and {capacity} candidates")
    drafts = _float_array("draft_probabilities", draft_probabilities, 3)
    if drafts.shape[0] != lanes or drafts.shape[1] < capacity or drafts.shape[2] != vocab:
        _fail(f"draft_probabilities: expected [{lanes}, >= {capacity}, {vocab}], got {drafts.shape}")
    state = _lane_vector("rows", rows, lanes)
    steps = _lane_vector("step", step, lanes)
    flags = _flag_array("active", active, (lanes,))
    if set(settings) != _VERIFY_SETTINGS:
        missing, unknown = sorted(_VERIFY_SETTINGS - set(settings)), sorted(set(settings) - _VERIFY_SETTINGS)
        _fail(f"settings: expected exactly {sorted(_VERIFY_SETTINGS)}; missing {missing}, unknown {unknown}")
    lane_settings = {name: _per_row(name, value, lanes, "fiu") for name, value in settings.items()}
    counts = _in_place_target("output_counts", output_counts)
    if counts.ndim != 2 or counts.dtype.kind not in "iu":
        _fail(f"output_counts: expected an integer [S, V] array, got {counts.dtype} {counts.shape}")
    presence = np.asarray(prompt_presence)
    if presence.shape != counts.shape:
        _fail(f"prompt_presence {presence.shape} and output_counts {counts.shape} must be equal [S, V]")
    if int(lengths.sum()) > packed:
        _fail(f"query_length: {int(lengths.sum())} packed tokens exceed the {packed} rows of logits")
    live = np.flatnonzero(flags)
    if live.size and int(lengths[live].min()) < 1:
        _fail(f"query_length: active lane {int(live[np.argmin(lengths[live])])} has no packed token")
    _check_offers(live, lengths, capacity)
    _check_state_rows(state, live, counts.shape[0])
    if live.size and int(steps[live].min()) < 0:
        _fail("step: must be >= 0")
    for lane in live.tolist():
        offered = candidates[lane, : int(lengths[lane]) - 1]
        if offered.size and (int(offered.min()) < 0 or int(offered.max()) >= vocab):
            _fail(f"candidate_ids: lane {lane} offers an id outside [0, {vocab})")

    ids = np.full((lanes, width), -1, dtype=np.int32)
    logprobs = np.zeros((lanes, width), dtype=np.float32)
    accepted = np.zeros(lanes, dtype=np.int32)
    emitted = np.zeros(lanes, dtype=np.int32)
    pending = np.full(lanes, -1, dtype=np.int32)
    touched = np.unique(state[live])
    saved = counts[touched].copy()
    penalty_names = ("repetition_penalty", "frequency_penalty", "presence_penalty")
    try:
        for lane in live.tolist():
            row, start, offers = int(state[lane]), int(starts[lane]), int(lengths[lane]) - 1
            per_lane: dict[str, Any] = {name: value[lane : lane + 1] for name, value in lane_settings.items()}
            greedy = float(per_lane["temperature"][0]) == 0.0
            position = 0
            while True:
                here = l32[start + position : start + position + 1]
                counter = np.array([steps[lane] + position], dtype=np.int64)
                state_row: dict[str, Any] = {
                    "prompt_presence": presence[row : row + 1],
                    "output_counts": counts[row : row + 1],
                }
                if position == offers or greedy:
                    drawn = sample(here, **per_lane, **state_row, step=counter, vocab_limit=vocab_limit)
                    token, logprob = int(drawn.ids[0]), float(drawn.logprobs[0])
                    taken = position < offers and token == int(candidates[lane, position])
                else:
                    token, logprob, taken = _verify_sampled_position(
                        here,
                        per_lane,
                        tuple(per_lane[name] for name in penalty_names),
                        state_row,
                        drafts[lane, position].astype(np.float64),
                        int(candidates[lane, position]),
                        int(counter[0]),
                        vocab_limit,
                    )
                ids[lane, position] = token
                logprobs[lane, position] = logprob
                counts[row, token] += 1
                if not taken:
                    break
                position += 1
            accepted[lane] = position
            emitted[lane] = position + 1
            pending[lane] = token
    except ValueError:
        counts[touched] = saved
        raise
    return VerifyResult(ids=ids, logprobs=logprobs, accepted=accepted, emitted=emitted, pending=pending)


def _verify_sampled_position(
    logits: F32,
    per_lane: Mapping[str, AnyArray],
    penalties: tuple[AnyArray, ...],
    state_row: Mapping[str, AnyArray],
    draft: F64,
    candidate: int,
    counter: int,
    vocab_limit: int,
) -> tuple[int, float, bool]:
    """One position of :func:`sample_verify_sampled` at temperature > 0: (token, its logprob, accepted)."""
    filters = _sampling_filters(
        logits,
        per_lane["temperature"],
        per_lane["top_k"],
        per_lane["top_p"],
        per_lane["min_p"],
        vocab_limit=vocab_limit,
        top_n=0,
    )
    processed = _processed_logits(
        logits,
        (penalties[0], penalties[1], penalties[2]),
        state_row["prompt_presence"],
        state_row["output_counts"],
        vocab_limit=vocab_limit,
        allowed_mask=None,
        constrained=None,
    )
    target = _distribution_row(
        processed[0],
        float(filters.temperature[0]),
        int(filters.top_k[0]),
        float(filters.top_p[0]),
        float(filters.min_p[0]),
    )
    mass = float(draft.sum()) if np.isfinite(draft).all() and (draft >= 0).all() else 0.0
    if not mass > 0.0:
        _fail("draft_probabilities: a verified row is not finite and non-negative with a positive sum")
    proposal = draft / mass
    seed = per_lane["seed"]
    if float(counter_uniform(seed, np.array([counter]))[0]) * proposal[candidate] < target[candidate]:
        token, taken = candidate, True
    else:
        residual = np.maximum(target - proposal, 0.0)
        if not residual.sum() > 0.0:
            residual = target  # p = q up to rounding: a rejection has probability 0 in exact arithmetic
        u = float(stream_uniform(seed, np.array([counter]), RESIDUAL_STREAM_KEY)[0])
        token, taken = _draw_in_id_order(residual, u), False
    logprob = float(log_softmax(processed)[0, token])
    return token, logprob, taken
