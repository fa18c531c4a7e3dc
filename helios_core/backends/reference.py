"""The reference backend: captured programs executed on the CPU with numpy.

Owns the device-buffer stand-ins of one loaded core (every ``BufferDecl`` allocated once as a numpy
array, symbolic leading dimensions fixed at construction), the weights (numpy views over the
decoded WEIGHTS resources, read once each, a few at once through
:mod:`~helios_core.backends.weights_loading`), the per-frame transport staging arrays and completion
records, the tuning producers (each run once at construction, before any serving program can
run), and program execution: each program's nodes are resolved once into closures over bound
views and the operator implementations of :mod:`helios_core.backends.reference_kernels`, so
:meth:`ReferenceBackend.run` only calls them in list order.

Views: a ``TensorArg`` view is ``flat[element_offset : element_offset + prod(shape)]`` reshaped to
its row-major shape, over the C-contiguous array. A view with offset 0 whose shape equals the
*declared* shape of a buffer with a symbolic leading dimension names the whole buffer, whatever
extent the symbol received at load. bfloat16 stays uint16 bit patterns in the buffers; inputs are
widened to float32 when read and float32 results are rounded to nearest even when stored.

Ranks: ``ReferenceBackend(..., rank=r, communicator=c)`` allocates rank r's declaration of each
per-rank buffer (the replicated ones as declared) and runs the collective operators (``all_reduce``,
``all_gather``, ``broadcast``) through the communicator; without one (a single rank) they are copies. A
program that fails on a rank aborts its communicator, so its peers stop waiting for it.

Its size: buffer allocation, program resolution, execution, transport staging and snapshots of one
backend, which share its buffer table; the operator kernels themselves live in
:mod:`~helios_core.backends.reference_kernels`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from helios_core.backends import reference_kernels as rk
from helios_core.backends.buffers import SYMBOLIC, numpy_dtype, paged_buffers, rank_declarations, runtime_shape
from helios_core.backends.ranks import Communicator, RankError
from helios_core.backends.weights_loading import DecodedResource, decode_resources
from helios_core.container.reader import CoreFile
from helios_core.contract.prepared import PreparedContract
from helios_core.errors import ContractError, StartupError, UnsupportedFeatureError
from helios_core.ops.catalogue import CATALOGUE, known_versions
from helios_core.sampling import SAMPLING_PARAMETERS
from helios_core.wire import container_pb2 as cb
from helios_core.wire import manifest_pb2 as mf

__all__ = ["ReferenceBackend"]

AnyArray = NDArray[Any]
Step = Callable[[], None]
AttrValue = int | float | str | tuple[int, ...] | tuple[float, ...]


@dataclass(frozen=True)
class _Bound:
    """A resolved tensor argument: the numpy view and the wire dtype of its buffer."""

    array: AnyArray
    dtype: int


class _Node:
    """One node's bound arguments and attributes, as the operator adapters read them."""

    def __init__(
        self,
        where: str,
        args: Mapping[str, _Bound],
        attributes: Mapping[str, AttrValue],
        communicator: Communicator | None = None,
    ) -> None:
        self.where = where
        self._args = args
        self._attributes = attributes
        self.communicator = communicator
        """The rank's communicator (collective operators); None: one rank, collectives are copies."""

    def fail(self, message: str) -> ContractError:
        return ContractError(f"{self.where}: {message}")

    # -- tensors -------------------------------------------------------------
    def tensor(self, name: str) -> AnyArray:
        bound = self._args.get(name)
        if bound is None:
            raise self.fail(f"lacks the tensor argument {name!r}")
        return bound.array

    def optional(self, name: str) -> AnyArray | None:
        bound = self._args.get(name)
        return None if bound is None else bound.array

    def floats(self, name: str) -> Callable[[], AnyArray]:
        """A reader of a float input; bfloat16 buffers are widened on each read."""
        bound = self._args.get(name)
        if bound is None:
            raise self.fail(f"lacks the tensor argument {name!r}")
        array = bound.array
        if bound.dtype == mf.DTYPE_BF16:
            return lambda: rk.bf16_bits_to_float32(array)
        return lambda: array

    def cache_planes(self) -> tuple[AnyArray, AnyArray]:
        """The ``k_plane`` and ``v_plane`` arrays: float32, float16 or bfloat16 (uint16 bit patterns, which
        the reference kernels round to on write and widen on read), both of one dtype."""
        planes = []
        for name in ("k_plane", "v_plane"):
            bound = self._args.get(name)
            if bound is None:
                raise self.fail(f"lacks the tensor argument {name!r}")
            if bound.dtype not in (mf.DTYPE_F32, mf.DTYPE_F16, mf.DTYPE_BF16):
                raise self.fail(f"cache plane {name!r} must be float32, float16 or bfloat16")
            planes.append(bound.array)
        if planes[0].dtype != planes[1].dtype:
            raise self.fail(f"cache planes differ in dtype: {planes[0].dtype} and {planes[1].dtype}")
        return planes[0], planes[1]

    def store(self, name: str) -> Callable[[AnyArray], None]:
        """A writer into an output view (shape checked at each write, bfloat16 rounded)."""
        bound = self._args.get(name)
        if bound is None:
            raise self.fail(f"lacks the tensor argument {name!r}")
        out = bound.array
        where = f"{self.where} output {name!r}"
        bf16 = bound.dtype == mf.DTYPE_BF16

        def write(value: AnyArray) -> None:
            if value.size != out.size:
                raise ValueError(f"{where}: result of shape {value.shape} does not fit the view {out.shape}")
            result = value.reshape(out.shape)
            out[...] = rk.float32_to_bf16_bits(result) if bf16 else result

        return write

    # -- attributes ------------------------------------------------------------
    def _attribute(self, name: str, default: AttrValue | None = None) -> AttrValue:
        value = self._attributes.get(name, default)
        if value is None:
            raise self.fail(f"lacks the attribute {name!r}")
        return value

    def attr_float(self, name: str) -> float:
        value = self._attribute(name)
        if isinstance(value, str | tuple):
            raise self.fail(f"attribute {name!r} must be a number, got {value!r}")
        return float(value)

    def attr_int(self, name: str, default: int | None = None) -> int:
        value = self._attribute(name, default)
        if not isinstance(value, int):
            raise self.fail(f"attribute {name!r} must be an integer, got {value!r}")
        return value

    def attr_str(self, name: str) -> str:
        value = self._attribute(name)
        if not isinstance(value, str):
            raise self.fail(f"attribute {name!r} must be a string, got {value!r}")
        return value

    def attr_floats(self, name: str) -> tuple[float, ...] | None:
        value = self._attributes.get(name)
        if value is None:
            return None
        if not isinstance(value, tuple):
            raise self.fail(f"attribute {name!r} must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)


# ----------------------------------------------------------------------------------------------
# operator adapters: bind a node once, return the closure that runs it
# ----------------------------------------------------------------------------------------------


def _embedding(n: _Node) -> Step:
    table, ids, out = n.tensor("table"), n.tensor("ids"), n.store("out")
    return lambda: out(rk.embedding(table, ids.reshape(-1)))


def _rmsnorm(n: _Node) -> Step:
    x, weight, out, eps = n.floats("x"), n.floats("weight"), n.store("out"), n.attr_float("eps")
    return lambda: out(rk.rmsnorm(x(), weight(), eps))


def _linear(n: _Node) -> Step:
    x, weight, out = n.floats("x"), n.floats("weight"), n.store("out")
    return lambda: out(rk.linear(x(), weight()))


def _rope(n: _Node) -> Step:
    x, positions, out = n.floats("x"), n.tensor("positions"), n.store("out")
    theta = n.attr_float("theta")
    style, scaling = _rope_scaling(n)
    return lambda: out(rk.rope(x(), positions.reshape(-1), theta, style, scaling))


def _kv_cache_write(n: _Node) -> Step:
    k, v, slots = n.floats("k"), n.floats("v"), n.tensor("slots")
    k_plane, v_plane = n.cache_planes()
    return lambda: rk.kv_cache_write(k_plane, v_plane, k(), v(), slots.reshape(-1))


def _paged_attention(n: _Node) -> Step:
    q, (k_plane, v_plane) = n.floats("q"), n.cache_planes()
    page_table, token_row, token_position = n.tensor("page_table"), n.tensor("token_row"), n.tensor("token_position")
    out, scale, window = n.store("out"), n.attr_float("scale"), n.attr_int("window", 0)
    if window < 0:
        raise n.fail(f"window must be 0 (unlimited) or positive, got {window}")
    rows, positions = token_row.reshape(-1), token_position.reshape(-1)
    return lambda: out(rk.paged_attention(q(), k_plane, v_plane, page_table, rows, positions, scale, window=window))


def _latent_cache_write(n: _Node) -> Step:
    latent, slots, plane = n.floats("latent"), n.tensor("slots"), n.tensor("plane")
    ratio = n.attr_int("tokens_per_record")
    if plane.dtype.kind != "f" or plane.ndim != 3:
        raise n.fail(f"the latent plane must be a float [pages, records, d_c] array, got {plane.dtype} {plane.shape}")
    if ratio < 1:
        raise n.fail(f"tokens_per_record must be at least 1, got {ratio}")
    return lambda: rk.latent_cache_write(plane, latent(), slots.reshape(-1), ratio)


def _latent_attention(n: _Node) -> Step:
    q, plane, w_uk, w_uv = n.floats("q"), n.tensor("plane"), n.floats("w_uk"), n.floats("w_uv")
    page_table, token_row, token_position = n.tensor("page_table"), n.tensor("token_row"), n.tensor("token_position")
    out, scale, ratio = n.store("out"), n.attr_float("scale"), n.attr_int("tokens_per_record")
    page_offset = n.attr_int("page_offset", 0)
    if ratio < 1:
        raise n.fail(f"tokens_per_record must be at least 1, got {ratio}")
    if page_offset < 0:
        raise n.fail(f"page_offset must be 0 or positive, got {page_offset}")
    rows, positions = token_row.reshape(-1), token_position.reshape(-1)

    def step() -> None:
        out(
            rk.latent_attention(
                q(), plane, w_uk(), w_uv(), page_table, rows, positions, scale, ratio, page_offset=page_offset
            )
        )

    return step


def _rmsnorm_linear(n: _Node) -> Step:
    x, norm_weight, weight, out = n.floats("x"), n.floats("norm_weight"), n.floats("weight"), n.store("out")
    eps = n.attr_float("eps")
    return lambda: out(rk.linear(rk.rmsnorm(x(), norm_weight(), eps), weight()))


def _linear_add(n: _Node) -> Step:
    x, weight, residual, out = n.floats("x"), n.floats("weight"), n.floats("residual"), n.store("out")
    return lambda: out(rk.add(residual(), rk.linear(x(), weight())))


def _silu_mul_linear_add(n: _Node) -> Step:
    gate_up, weight, residual, out = n.floats("gate_up"), n.floats("weight"), n.floats("residual"), n.store("out")
    width = int(n.tensor("weight").shape[1])
    if int(n.tensor("gate_up").shape[-1]) != 2 * width:
        raise n.fail(f"gate_up must hold 2 x {width} columns for a weight of input width {width}")

    def step() -> None:
        both = gate_up()
        out(rk.add(residual(), rk.linear(rk.silu_mul(both[:, :width], both[:, width:]), weight())))

    return step


def _rmsnorm_swiglu_mlp_add(n: _Node) -> Step:
    x, norm_weight, gate_up_weight = n.floats("x"), n.floats("norm_weight"), n.floats("gate_up_weight")
    down_weight, residual, out = n.floats("down_weight"), n.floats("residual"), n.store("out")
    eps = n.attr_float("eps")
    rows, width = n.tensor("gate_up_weight").shape[0], int(n.tensor("down_weight").shape[1])
    if int(rows) != 2 * width:
        raise n.fail(f"gate_up_weight must hold 2 x {width} rows for a down_weight of input width {width}")

    def step() -> None:
        both = rk.linear(rk.rmsnorm(x(), norm_weight(), eps), gate_up_weight())
        out(rk.add(residual(), rk.linear(rk.silu_mul(both[:, :width], both[:, width:]), down_weight())))

    return step


def _rope_scaling(n: _Node) -> tuple[rk.RopeStyle, rk.FrequencyBandScaling | None]:
    style = n.attr_str("style")
    if style not in ("interleaved", "half"):
        raise n.fail(f"rope style must be 'interleaved' or 'half', got {style!r}")
    band = n.attr_floats("frequency_band_scaling")
    scaling = None
    if band is not None:
        if len(band) != 4:
            raise n.fail(f"frequency_band_scaling needs 4 values, got {len(band)}")
        scaling = rk.FrequencyBandScaling(band[0], band[1], band[2], round(band[3]))
    return ("interleaved" if style == "interleaved" else "half"), scaling


def _rope_cache_step(n: _Node, qkv: Callable[[], AnyArray]) -> Step:
    """The step that rotates and splits the packed rows ``qkv()`` (the ``rope_kv_cache_write`` part)."""
    positions, slots = n.tensor("positions"), n.tensor("slots")
    q_out, (k_plane, v_plane) = n.store("q"), n.cache_planes()
    theta = n.attr_float("theta")
    style, scaling = _rope_scaling(n)
    tokens, heads, head_dim = n.tensor("q").shape
    kv_heads = int(k_plane.shape[2])

    def step() -> None:
        packed = qkv().reshape(tokens, heads + 2 * kv_heads, head_dim)
        pos = positions.reshape(-1)
        q_out(rk.rope(packed[:, :heads], pos, theta, style, scaling))
        keys = rk.rope(packed[:, heads : heads + kv_heads], pos, theta, style, scaling)
        rk.kv_cache_write(k_plane, v_plane, keys, packed[:, heads + kv_heads :], slots.reshape(-1))

    return step


def _rope_kv_cache_write(n: _Node) -> Step:
    return _rope_cache_step(n, n.floats("qkv"))


def _rmsnorm_linear_rope_kv_cache_write(n: _Node) -> Step:
    x, norm_weight, weight = n.floats("x"), n.floats("norm_weight"), n.floats("weight")
    eps = n.attr_float("eps")
    return _rope_cache_step(n, lambda: rk.linear(rk.rmsnorm(x(), norm_weight(), eps), weight()))


def _silu_mul(n: _Node) -> Step:
    gate, up, out = n.floats("gate"), n.floats("up"), n.store("out")
    return lambda: out(rk.silu_mul(gate(), up()))


def _add(n: _Node) -> Step:
    a, b, out = n.floats("a"), n.floats("b"), n.store("out")
    return lambda: out(rk.add(a(), b()))


def _gather_rows(n: _Node) -> Step:
    x_bound = n.tensor("x")
    index, out = n.tensor("index"), n.store("out")
    if x_bound.dtype.kind == "f" or x_bound.dtype == np.uint16:
        x = n.floats("x")
        return lambda: out(rk.gather_rows(x(), index.reshape(-1)))

    def step() -> None:  # integer rows (pending tokens): same semantics, dtype kept
        idx = index.reshape(-1).astype(np.int64)
        if idx.size and int(idx.max()) >= x_bound.shape[0]:
            raise ValueError(f"{n.where}: index {int(idx.max())} is out of range for {x_bound.shape[0]} rows")
        rows = np.zeros((idx.size, *x_bound.shape[1:]), dtype=x_bound.dtype)
        keep = idx >= 0
        rows[keep] = x_bound[idx[keep]]
        out(rows)

    return step


def _lane_last_index(n: _Node) -> Step:
    query_length, out = n.tensor("query_length"), n.store("out")

    def step() -> None:
        lengths = query_length.reshape(-1).astype(np.int64)
        ends = np.cumsum(np.maximum(lengths, 0)) - 1
        out(np.where(lengths > 0, ends, -1).astype(np.int32))

    return step


def _sample(n: _Node) -> Step:
    logits = n.floats("logits")
    per_row = {name: n.tensor(name) for name in (*(p.kernel_input for p in SAMPLING_PARAMETERS), "step")}
    presence, counts = n.tensor("prompt_presence"), n.tensor("output_counts")
    rows, active = n.tensor("rows").reshape(-1), n.tensor("active").reshape(-1)
    mask, constrained = n.optional("allowed_mask"), n.optional("constrained")
    if (mask is None) != (constrained is None):
        raise n.fail("allowed_mask and constrained must be given together")
    ids = n.tensor("ids").reshape(-1)
    logprob = n.optional("logprob")
    top_ids, top_logprobs = n.optional("top_ids"), n.optional("top_logprobs")
    vocab_limit = n.attr_int("vocab_limit")
    top_n = n.attr_int("top_n", 0)
    lanes = ids.size
    for name, array in (("top_ids", top_ids), ("top_logprobs", top_logprobs)):
        if array is not None and (array.ndim != 2 or array.shape[0] != lanes or array.shape[1] < top_n):
            raise n.fail(f"{name} of shape {array.shape} cannot hold {lanes} rows of top_n={top_n}")
    if counts.ndim != 2 or presence.shape != counts.shape:
        raise n.fail(f"prompt_presence {presence.shape} and output_counts {counts.shape} must be equal [rows, V]")
    if logprob is not None and logprob.size != lanes:
        raise n.fail(f"logprob of shape {logprob.shape} does not match {lanes} rows")
    logprob_flat = None if logprob is None else logprob.reshape(-1)
    state_rows = counts.shape[0]
    where = n.where

    def step() -> None:
        ids[...] = -1
        if logprob_flat is not None:
            logprob_flat[...] = 0.0
        if top_ids is not None:
            top_ids[...] = -1
        if top_logprobs is not None:
            top_logprobs[...] = 0.0
        which = np.flatnonzero(active != 0)
        if which.size == 0:
            return
        state = rows[which].astype(np.int64)
        if int(state.min()) < 0 or int(state.max()) >= state_rows:
            raise ValueError(f"{where}: an active lane names a state row outside [0, {state_rows})")
        picked = {name: array.reshape(-1)[which] for name, array in per_row.items()}  # by kernel input name
        result = rk.sample(
            logits()[which],
            **picked,
            prompt_presence=presence[state],
            output_counts=counts[state],
            vocab_limit=vocab_limit,
            allowed_mask=None if mask is None else mask[which],
            constrained=None if constrained is None else constrained.reshape(-1)[which],
            top_n=top_n,
            allow_empty_rows=True,  # a row the grammar leaves nothing fails its request, not the round
        )
        ids[which] = result.ids
        if logprob_flat is not None:
            logprob_flat[which] = result.logprobs
        if top_ids is not None:
            top_ids[which, :top_n] = result.top_ids
        if top_logprobs is not None:
            top_logprobs[which, :top_n] = result.top_logprobs
        sampled = result.ids >= 0  # a row the mask left nothing samples no id and counts none
        np.add.at(counts, (state[sampled], result.ids[sampled].astype(np.int64)), 1)

    return step


def _speculative_inputs(n: _Node) -> Step:
    pending, rows = n.tensor("pending_tokens"), n.tensor("rows").reshape(-1)
    candidates, query_length = n.tensor("candidate_ids"), n.tensor("query_length").reshape(-1)
    ids = n.tensor("ids").reshape(-1)
    lanes = query_length.size
    if candidates.ndim != 2 or candidates.shape[0] != lanes:
        raise n.fail(f"candidate_ids {candidates.shape} must be [lanes, capacity] for {lanes} lanes")
    if rows.size != lanes:
        raise n.fail(f"rows holds {rows.size} elements, the node has {lanes} lanes")
    if not (pending.ndim == 1 or (pending.ndim == 2 and pending.shape[1] == 1)):
        raise n.fail(f"pending_tokens {pending.shape} must be [rows] or [rows, 1]")
    where = n.where

    def step() -> None:
        try:
            rk.speculative_inputs(ids, pending, rows, candidates, query_length)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error

    return step


@dataclass
class _Verify:
    """What both verification nodes read and write (their shapes checked), and how they store a result."""

    node: _Node
    logits: Callable[[], AnyArray]
    settings: dict[str, AnyArray]
    query_length: AnyArray
    candidates: AnyArray
    presence: AnyArray
    counts: AnyArray
    per_lane: dict[str, AnyArray]
    ids: AnyArray
    results: dict[str, AnyArray]
    logprob_out: AnyArray | None
    vocab_limit: int

    @property
    def lanes(self) -> int:
        return int(self.query_length.size)

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def check(self) -> None:
        """The shape rules every verification node shares (after its own input checks)."""
        n, lanes, candidates, ids = self.node, self.lanes, self.candidates, self.ids
        if ids.ndim != 2 or ids.shape[0] != lanes or ids.shape[1] < candidates.shape[1] + 1:
            raise n.fail(
                f"ids {ids.shape} must be [{lanes}, W] with W >= {candidates.shape[1] + 1} (the pending token and "
                f"{candidates.shape[1]} candidates)"
            )
        logprob = n.optional("logprob")
        if logprob is not None and logprob.size != ids.size:
            raise n.fail(f"logprob of shape {logprob.shape} does not match ids {ids.shape}")
        for name, array in {**self.settings, **self.per_lane, **self.results}.items():
            if array.size != lanes:
                raise n.fail(f"{name} holds {array.size} elements, the node has {lanes} lanes")
        if self.counts.ndim != 2 or self.presence.shape != self.counts.shape:
            raise n.fail(
                f"prompt_presence {self.presence.shape} and output_counts {self.counts.shape} must be equal [rows, V]"
            )
        self.logprob_out = None if logprob is None else logprob.reshape(ids.shape)

    def store(self, result: rk.VerifyResult) -> None:
        self.ids[...] = result.ids
        self.results["accepted"][...] = result.accepted
        self.results["emitted"][...] = result.emitted
        self.results["pending"][...] = result.pending
        if self.logprob_out is not None:
            self.logprob_out[...] = result.logprobs


def _verify_node(n: _Node) -> _Verify:
    """The inputs and outputs both verification nodes share; checks the candidates' rows."""
    verify = _Verify(
        node=n,
        logits=n.floats("logits"),
        settings={p.kernel_input: n.tensor(p.kernel_input).reshape(-1) for p in SAMPLING_PARAMETERS},
        query_length=n.tensor("query_length").reshape(-1),
        candidates=n.tensor("candidate_ids"),
        presence=n.tensor("prompt_presence"),
        counts=n.tensor("output_counts"),
        per_lane={name: n.tensor(name).reshape(-1) for name in ("rows", "step", "active")},
        ids=n.tensor("ids"),
        results={name: n.tensor(name).reshape(-1) for name in ("accepted", "emitted", "pending")},
        logprob_out=None,
        vocab_limit=n.attr_int("vocab_limit"),
    )
    candidates, lanes = verify.candidates, verify.lanes
    if candidates.ndim != 2 or candidates.shape[0] != lanes:
        raise n.fail(f"candidate_ids {candidates.shape} must be [lanes, capacity] for {lanes} lanes")
    return verify


def _sample_verify(n: _Node) -> Step:
    mask, constrained = n.optional("allowed_mask"), n.optional("constrained")
    if (mask is None) != (constrained is None):
        raise n.fail("allowed_mask and constrained must be given together")
    v = _verify_node(n)
    if mask is not None and mask.ndim != 2:
        raise n.fail(f"allowed_mask {mask.shape} must be [packed rows, words]")
    if constrained is not None and constrained.size != v.lanes:
        raise n.fail(f"constrained holds {constrained.size} elements, the node has {v.lanes} lanes")
    v.check()
    lane_flags = None if constrained is None else constrained.reshape(-1)
    where = n.where

    def step() -> None:
        try:
            result = rk.sample_verify(
                v.logits(),
                query_length=v.query_length,
                candidate_ids=v.candidates,
                settings=v.settings,
                prompt_presence=v.presence,
                output_counts=v.counts,
                vocab_limit=v.vocab_limit,
                width=v.width,
                allowed_mask=mask,
                constrained=lane_flags,
                allow_empty_rows=True,  # a position the grammar leaves nothing fails its request, not the round
                **v.per_lane,
            )
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        v.store(result)

    return step


def _apply_grammar_mask(n: _Node) -> Step:
    logits, mask, out = n.floats("logits"), n.tensor("allowed_mask"), n.store("out")
    constrained = n.tensor("constrained")
    return lambda: out(rk.apply_grammar_mask(logits(), mask, constrained.reshape(-1)))


def _copy_rows(n: _Node) -> Step:
    src, dst_rows, dst = n.tensor("src"), n.tensor("dst_rows").reshape(-1), n.tensor("dst")
    src_rows = n.optional("src_rows")
    if src.dtype != dst.dtype:
        raise n.fail(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")
    pairs = None if src_rows is None else src_rows.reshape(-1)
    when = n.optional("when")
    if when is None:
        return lambda: rk.copy_rows(dst, dst_rows, src=src, src_rows=pairs)
    flags = when.reshape(-1)

    def step() -> None:
        # Pairs whose flag is zero are skipped: their destination index is masked to -1.
        masked = np.where(flags[: dst_rows.size] != 0, dst_rows, -1)
        rk.copy_rows(dst, masked, src=src, src_rows=pairs)

    return step


def _init_sampling_state(n: _Node) -> Step:
    histogram, rows = n.tensor("prompt_histogram"), n.tensor("rows").reshape(-1)
    presence, counts = n.tensor("prompt_presence"), n.tensor("output_counts")
    if histogram.ndim != 2 or histogram.shape[0] != rows.size or histogram.shape[1] != presence.shape[-1]:
        raise n.fail(
            f"prompt_histogram {histogram.shape} does not match rows {rows.shape} and presence {presence.shape}"
        )
    state_rows = presence.shape[0]
    where = n.where

    def step() -> None:
        index = rows.astype(np.int64)
        keep = index >= 0
        targets = index[keep]
        if targets.size and int(targets.max()) >= state_rows:
            raise ValueError(f"{where}: row {int(targets.max())} is outside [0, {state_rows})")
        presence[targets] = histogram[keep] > 0
        counts[targets] = 0

    return step


def _lane_record_writer(n: _Node, inputs: Mapping[str, AnyArray]) -> Callable[[AnyArray, AnyArray], None]:
    """The writer of the fields every completion record shares: echoes, emitted counts, consumed endpoints.

    Checks once that every per-lane input and output holds one element per lane.
    """
    generation = n.tensor("generation").reshape(-1)
    sequence = n.tensor("submission_sequence")
    out_generation, out_emitted = n.tensor("out_generation"), n.tensor("out_emitted")
    out_consumed, out_draft = n.tensor("out_consumed"), n.tensor("out_draft_cursor")
    out_reserved, out_sequence = n.tensor("out_reserved"), n.tensor("out_sequence")
    lanes = generation.size
    checked = {
        **inputs,
        "out_generation": out_generation,
        "out_emitted": out_emitted,
        "out_consumed": out_consumed,
        "out_draft_cursor": out_draft,
        "out_reserved": out_reserved,
    }
    for name, array in checked.items():
        if array.size != lanes:
            raise n.fail(f"{name} holds {array.size} elements, the node has {lanes} lanes")
    if sequence.size != out_sequence.size:
        raise n.fail(f"submission_sequence {sequence.shape} and out_sequence {out_sequence.shape} differ")

    def write(consumed: AnyArray, emitted: AnyArray) -> None:
        out_generation.reshape(-1)[...] = generation
        out_emitted.reshape(-1)[...] = emitted
        out_consumed.reshape(-1)[...] = consumed
        out_draft[...] = -1
        out_reserved[...] = -1
        out_sequence.reshape(-1)[...] = sequence.reshape(-1)

    return write


def _completion_lanes(n: _Node) -> Step:
    sample_active = n.tensor("sample_active").reshape(-1)
    last_index, positions = n.tensor("last_index").reshape(-1), n.tensor("positions").reshape(-1)
    write = _lane_record_writer(n, {"sample_active": sample_active, "last_index": last_index})

    def step() -> None:
        index = last_index.astype(np.int64)
        consumed = np.zeros(index.size, dtype=np.int64)
        valid = index >= 0
        consumed[valid] = positions[index[valid]].astype(np.int64) + 1
        write(consumed, sample_active != 0)

    return step


def _completion_speculative(n: _Node) -> Step:
    query_length = n.tensor("query_length").reshape(-1)
    accepted, emitted = n.tensor("accepted").reshape(-1), n.tensor("emitted").reshape(-1)
    positions = n.tensor("positions").reshape(-1)
    out_offers, out_accepted = n.tensor("out_offers").reshape(-1), n.tensor("out_accepted").reshape(-1)
    write = _lane_record_writer(
        n,
        {
            "query_length": query_length,
            "accepted": accepted,
            "emitted": emitted,
            "out_offers": out_offers,
            "out_accepted": out_accepted,
        },
    )
    where = n.where

    def step() -> None:
        try:
            lengths, starts = rk.packed_lane_starts(query_length)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        total = int(lengths.sum())
        if total > positions.size:
            raise ValueError(f"{where}: query_length: {total} packed tokens exceed the {positions.size} positions")
        has_tokens = lengths > 0
        sampled = has_tokens & (emitted != 0)
        unsampled = has_tokens & ~sampled
        consumed = np.zeros(lengths.size, dtype=np.int64)
        consumed[sampled] = positions[starts[sampled]].astype(np.int64) + accepted[sampled].astype(np.int64) + 1
        consumed[unsampled] = positions[starts[unsampled] + lengths[unsampled] - 1].astype(np.int64) + 1
        out_offers[...] = np.where(has_tokens, lengths - 1, 0)
        out_accepted[...] = accepted
        write(consumed, emitted)

    return step


def _completion_copy_lanes(n: _Node) -> Step:
    consumed = n.tensor("consumed").reshape(-1)
    write = _lane_record_writer(n, {"consumed": consumed})
    no_tokens = np.zeros(consumed.size, dtype=np.int64)
    return lambda: write(consumed, no_tokens)


def _tail_page(n: _Node) -> Step:
    page_table, consumed, out = n.tensor("page_table"), n.tensor("consumed").reshape(-1), n.store("out")
    page_tokens = n.attr_int("page_tokens")
    if page_tokens <= 0:
        raise n.fail(f"page_tokens must be positive, got {page_tokens}")
    if page_table.ndim != 2 or page_table.shape[0] != consumed.size:
        raise n.fail(f"page_table {page_table.shape} does not hold one row per consumed endpoint {consumed.shape}")
    return lambda: out(rk.tail_page(page_table, consumed, page_tokens))


def _log_softmax_gather(n: _Node) -> Step:
    logits, targets, out = n.floats("logits"), n.tensor("targets").reshape(-1), n.store("out")
    vocab_limit = n.attr_int("vocab_limit")

    def step() -> None:  # a negative target (padding, the last prompt token) scores 0
        ids = targets.astype(np.int64)
        scores = np.zeros(ids.size, dtype=np.float32)
        valid = np.flatnonzero(ids >= 0)
        if valid.size:
            scores[valid] = rk.log_softmax_gather(logits()[valid], ids[valid], vocab_limit)
        out(scores)

    return step


def _lane_positions(n: _Node) -> Step:
    consumed, page_table, limit = n.tensor("consumed").reshape(-1), n.tensor("page_table"), n.tensor("limit")
    outputs = {name: n.tensor(name).reshape(-1) for name in ("positions", "token_rows", "cache_slots")}
    offset, page_tokens = n.attr_int("offset"), n.attr_int("page_tokens")
    if page_table.ndim != 2:
        raise n.fail(f"page_table {page_table.shape} must be [lanes, pages]")
    lanes = page_table.shape[0]
    for name, array in {"consumed": consumed, "limit": limit, **outputs}.items():
        if array.size != lanes:
            raise n.fail(f"{name} holds {array.size} elements, the node has {lanes} lanes")
    where = n.where

    def step() -> None:
        try:
            found = rk.lane_positions(consumed, page_table, limit.reshape(-1), offset=offset, page_tokens=page_tokens)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        outputs["positions"][...] = found.positions
        outputs["token_rows"][...] = found.token_rows
        outputs["cache_slots"][...] = found.cache_slots

    return step


def _draft_argmax(n: _Node) -> Step:
    logits = n.floats("logits")
    ids, confidence = n.tensor("ids").reshape(-1), n.tensor("confidence").reshape(-1)
    rows = n.optional("token_rows")
    token_rows = None if rows is None else rows.reshape(-1)
    vocab_limit = n.attr_int("vocab_limit")
    lanes = n.tensor("logits").shape[0]
    for name, array in {"ids": ids, "confidence": confidence, "token_rows": token_rows}.items():
        if array is not None and array.size != lanes:
            raise n.fail(f"{name} holds {array.size} elements, the node has {lanes} lanes")
    where = n.where

    def step() -> None:
        try:
            choice = rk.draft_argmax(logits(), vocab_limit, token_rows)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        ids[...] = choice.ids
        confidence[...] = choice.confidence

    return step


def _draft_sample(n: _Node) -> Step:
    logits = n.floats("logits")
    per_lane = {name: n.tensor(name).reshape(-1) for name in ("temperature", "top_k", "top_p", "min_p", "seed", "step")}
    ids, confidence = n.tensor("ids").reshape(-1), n.tensor("confidence").reshape(-1)
    draft_probabilities = n.tensor("draft_probabilities")
    rows = n.optional("token_rows")
    token_rows = None if rows is None else rows.reshape(-1)
    vocab_limit, draft_index = n.attr_int("vocab_limit"), n.attr_int("draft_index")
    lanes, vocab = n.tensor("logits").shape
    for name, array in {**per_lane, "ids": ids, "confidence": confidence, "token_rows": token_rows}.items():
        if array is not None and array.size != lanes:
            raise n.fail(f"{name} holds {array.size} elements, the node has {lanes} lanes")
    if draft_probabilities.ndim != 3 or draft_probabilities.shape[0] != lanes or draft_probabilities.shape[2] != vocab:
        raise n.fail(f"draft_probabilities {draft_probabilities.shape} must be [{lanes}, D, {vocab}]")
    if not 0 <= draft_index < draft_probabilities.shape[1]:
        raise n.fail(f"draft_index {draft_index} lies outside the {draft_probabilities.shape[1]} draft rows")
    where = n.where

    def step() -> None:
        try:
            choice = rk.draft_sample(
                logits(), **per_lane, draft_index=draft_index, vocab_limit=vocab_limit, token_rows=token_rows
            )
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        ids[...] = choice.ids
        confidence[...] = choice.confidence
        draft_probabilities[:, draft_index, :] = choice.probabilities

    return step


def _sample_verify_sampled(n: _Node) -> Step:
    draft_probabilities = n.tensor("draft_probabilities")
    v = _verify_node(n)
    if draft_probabilities.ndim != 3 or draft_probabilities.shape[0] != v.lanes:
        raise n.fail(f"draft_probabilities {draft_probabilities.shape} must be [{v.lanes}, D, V]")
    v.check()
    where = n.where

    def step() -> None:
        try:
            result = rk.sample_verify_sampled(
                v.logits(),
                query_length=v.query_length,
                candidate_ids=v.candidates,
                draft_probabilities=draft_probabilities,
                settings=v.settings,
                prompt_presence=v.presence,
                output_counts=v.counts,
                vocab_limit=v.vocab_limit,
                width=v.width,
                **v.per_lane,
            )
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        v.store(result)

    return step


def _draft_allocate(n: _Node) -> Step:
    confidence, ceilings = n.tensor("confidence"), n.tensor("ceilings").reshape(-1)
    query_length = n.tensor("query_length").reshape(-1)
    packed, width = n.attr_int("packed_capacity"), n.attr_int("token_capacity")
    if confidence.ndim != 2 or confidence.shape[0] != ceilings.size or query_length.size != ceilings.size:
        raise n.fail(
            f"confidence {confidence.shape}, ceilings {ceilings.shape} and query_length {query_length.shape} "
            "must describe the same lanes"
        )
    where = n.where

    def step() -> None:
        try:
            query_length[...] = rk.draft_allocate(confidence, ceilings, packed_capacity=packed, token_capacity=width)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error

    return step


def _speculative_layout(n: _Node) -> Step:
    query_length, consumed = n.tensor("query_length").reshape(-1), n.tensor("consumed").reshape(-1)
    page_table = n.tensor("page_table")
    outputs = {name: n.tensor(name).reshape(-1) for name in ("positions", "token_rows", "cache_slots")}
    page_tokens = n.attr_int("page_tokens")
    packed = outputs["positions"].size
    if outputs["token_rows"].size != packed or outputs["cache_slots"].size != packed:
        raise n.fail("positions, token_rows and cache_slots must hold the same packed rows")
    if page_table.ndim != 2 or page_table.shape[0] != query_length.size or consumed.size != query_length.size:
        raise n.fail(
            f"query_length {query_length.shape}, consumed {consumed.shape} and page_table {page_table.shape} "
            "must describe the same lanes"
        )
    where = n.where

    def step() -> None:
        try:
            found = rk.speculative_layout(
                query_length, consumed, page_table, packed_capacity=packed, page_tokens=page_tokens
            )
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        outputs["positions"][...] = found.positions
        outputs["token_rows"][...] = found.token_rows
        outputs["cache_slots"][...] = found.cache_slots

    return step


def _completion_self_draft(n: _Node) -> Step:
    query_length = n.tensor("query_length").reshape(-1)
    accepted, emitted = n.tensor("accepted").reshape(-1), n.tensor("emitted").reshape(-1)
    consumed_before = n.tensor("consumed").reshape(-1)
    out_offers, out_accepted = n.tensor("out_offers").reshape(-1), n.tensor("out_accepted").reshape(-1)
    out_draft = n.tensor("out_draft_cursor").reshape(-1)
    lag = n.attr_int("lag_tokens")
    if lag < 0:
        raise n.fail(f"lag_tokens must be non-negative, got {lag}")
    write = _lane_record_writer(
        n,
        {
            "query_length": query_length,
            "accepted": accepted,
            "emitted": emitted,
            "consumed": consumed_before,
            "out_offers": out_offers,
            "out_accepted": out_accepted,
        },
    )
    framed = {name: n.optional(name) for name in ("confidence", "frame_index", "out_confidence")}
    given = [name for name, array in framed.items() if array is not None]
    if given and len(given) != len(framed):
        raise n.fail("confidence, frame_index and out_confidence are given together or not at all")
    confidence, frame_index, out_confidence = framed["confidence"], framed["frame_index"], framed["out_confidence"]
    lanes = query_length.size
    if confidence is not None and out_confidence is not None and frame_index is not None:
        if confidence.ndim != 2 or confidence.shape[0] != lanes:
            raise n.fail(f"confidence {confidence.shape} must be [{lanes}, D]")
        if out_confidence.ndim != 3 or out_confidence.shape[1] < lanes or out_confidence.shape[2] < confidence.shape[1]:
            raise n.fail(
                f"out_confidence {out_confidence.shape} must be [frames, request_slots >= {lanes}, "
                f"capacity >= {confidence.shape[1]}]"
            )
        if frame_index.size != 1:
            raise n.fail(f"frame_index {frame_index.shape} must hold one value")
    where = n.where

    def step() -> None:
        try:
            lengths, _starts = rk.packed_lane_starts(query_length)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        has_tokens = lengths > 0
        sampled = has_tokens & (emitted != 0)
        unsampled = has_tokens & ~sampled
        before = consumed_before.astype(np.int64)
        consumed = np.zeros(lengths.size, dtype=np.int64)
        consumed[sampled] = before[sampled] + accepted[sampled].astype(np.int64) + 1
        consumed[unsampled] = before[unsampled] + lengths[unsampled]
        if confidence is not None and out_confidence is not None and frame_index is not None:
            frame = int(frame_index.reshape(-1)[0])
            if not 0 <= frame < out_confidence.shape[0]:
                raise ValueError(f"{where}: frame_index {frame} is outside [0, {out_confidence.shape[0]})")
            out_confidence[frame, :lanes, : confidence.shape[1]] = confidence
        out_offers[...] = np.where(has_tokens, lengths - 1, 0)
        out_accepted[...] = accepted
        write(consumed, emitted)
        out_draft[...] = np.where(has_tokens, np.maximum(consumed - lag, 0), -1)

    return step


def _recurrence_state(n: _Node) -> AnyArray:
    state = n.tensor("state")
    if state.dtype != np.float32 or state.ndim != 2:
        raise n.fail(f"state must be a float32 [rows, width] buffer, got {state.dtype} {state.shape}")
    return state


def _gated_recurrence_scan(n: _Node) -> Step:
    gate, x, out = n.floats("gate"), n.floats("x"), n.store("out")
    token_row, rows, state = n.tensor("token_row").reshape(-1), n.tensor("rows").reshape(-1), _recurrence_state(n)
    return lambda: out(rk.gated_recurrence_scan(gate(), x(), token_row, rows, state))


def _gated_recurrence_step(n: _Node) -> Step:
    gate, x, out = n.floats("gate"), n.floats("x"), n.store("out")
    rows, state = n.tensor("rows").reshape(-1), _recurrence_state(n)
    return lambda: out(rk.gated_recurrence_step(gate(), x(), rows, state))


def _all_reduce(n: _Node) -> Step:
    x, out, communicator = n.floats("x"), n.store("out"), n.communicator
    if communicator is None:
        return lambda: out(x())
    return lambda: out(communicator.all_reduce(x()))


def _all_gather(n: _Node) -> Step:
    x, out, communicator = n.floats("x"), n.store("out"), n.communicator
    axis = n.attr_int("axis")
    shape = n.tensor("x").shape
    ranks = 1 if communicator is None else communicator.size
    if not -len(shape) <= axis < len(shape):
        raise n.fail(f"axis {axis} is outside x of shape {shape}")
    if n.tensor("out").size != ranks * n.tensor("x").size:
        raise n.fail(f"out of shape {n.tensor('out').shape} cannot hold {ranks} ranks' x of shape {shape}")
    if communicator is None:
        return lambda: out(x())
    return lambda: out(communicator.all_gather(x(), axis))


def _broadcast(n: _Node) -> Step:
    x, out, communicator = n.floats("x"), n.store("out"), n.communicator
    root = n.attr_int("root", 0)
    ranks = 1 if communicator is None else communicator.size
    if not 0 <= root < ranks:
        raise n.fail(f"root {root} is outside the ranks [0, {ranks})")
    if communicator is None:
        return lambda: out(x())
    return lambda: out(communicator.broadcast(x(), root))


_ADAPTERS: dict[tuple[str, int], Callable[[_Node], Step]] = {
    ("embedding", 1): _embedding,
    ("rmsnorm", 1): _rmsnorm,
    ("linear", 1): _linear,
    ("rope", 1): _rope,
    ("kv_cache_write", 1): _kv_cache_write,
    ("paged_attention", 1): _paged_attention,
    ("latent_cache_write", 1): _latent_cache_write,
    ("latent_attention", 1): _latent_attention,
    ("silu_mul", 1): _silu_mul,
    ("rmsnorm_linear", 1): _rmsnorm_linear,
    ("linear_add", 1): _linear_add,
    ("silu_mul_linear_add", 1): _silu_mul_linear_add,
    ("rmsnorm_swiglu_mlp_add", 1): _rmsnorm_swiglu_mlp_add,
    ("rope_kv_cache_write", 1): _rope_kv_cache_write,
    ("rmsnorm_linear_rope_kv_cache_write", 1): _rmsnorm_linear_rope_kv_cache_write,
    ("add", 1): _add,
    ("gather_rows", 1): _gather_rows,
    ("lane_last_index", 1): _lane_last_index,
    ("sample", 1): _sample,
    ("apply_grammar_mask", 1): _apply_grammar_mask,
    ("copy_rows", 1): _copy_rows,
    ("init_sampling_state", 1): _init_sampling_state,
    ("completion_lanes", 1): _completion_lanes,
    ("completion_copy_lanes", 1): _completion_copy_lanes,
    ("speculative_inputs", 1): _speculative_inputs,
    ("sample_verify", 1): _sample_verify,
    ("completion_speculative", 1): _completion_speculative,
    ("tail_page", 1): _tail_page,
    ("log_softmax_gather", 1): _log_softmax_gather,
    ("lane_positions", 1): _lane_positions,
    ("draft_argmax", 1): _draft_argmax,
    ("draft_sample", 1): _draft_sample,
    ("sample_verify_sampled", 1): _sample_verify_sampled,
    ("draft_allocate", 1): _draft_allocate,
    ("speculative_layout", 1): _speculative_layout,
    ("completion_self_draft", 1): _completion_self_draft,
    ("gated_recurrence_scan", 1): _gated_recurrence_scan,
    ("gated_recurrence_step", 1): _gated_recurrence_step,
    ("all_reduce", 1): _all_reduce,
    ("all_gather", 1): _all_gather,
    ("broadcast", 1): _broadcast,
}


def _attribute_value(attribute: mf.Attribute) -> AttrValue:
    kind = attribute.WhichOneof("value")
    if kind == "int_value":
        return int(attribute.int_value)
    if kind == "float_value":
        return float(attribute.float_value)
    if kind == "string_value":
        return str(attribute.string_value)
    if kind == "ints":
        return tuple(int(v) for v in attribute.ints.values)
    if kind == "floats":
        return tuple(float(v) for v in attribute.floats.values)
    raise ContractError(f"attribute {attribute.name!r} has no value")


# ----------------------------------------------------------------------------------------------
# the backend
# ----------------------------------------------------------------------------------------------


class ReferenceBackend:
    """Buffers, weights and program execution of one core on the CPU."""

    def __init__(
        self,
        contract: PreparedContract,
        core: CoreFile,
        *,
        cache_pages: int,
        state_rows: int,
        frames: int = 2,
        snapshot_rows: int = 0,
        rank: int = 0,
        communicator: Communicator | None = None,
        resources: dict[str, DecodedResource] | None = None,
    ) -> None:
        if cache_pages <= 0 or state_rows <= 0 or frames <= 0:
            raise ValueError(
                f"cache_pages, state_rows and frames must be positive, got {cache_pages}, {state_rows}, {frames}"
            )
        if snapshot_rows < 0:
            raise ValueError(f"snapshot_rows must not be negative, got {snapshot_rows}")
        execution = contract.execution
        self._frames = frames
        self._symbols = {mf.DIM_SYMBOL_CACHE_PAGES: cache_pages, mf.DIM_SYMBOL_STATE_ROWS: state_rows}
        self._snapshot_rows = snapshot_rows
        if not 0 <= rank < max(contract.ranks, 1):
            raise ValueError(f"rank {rank} is not one of the core's {contract.ranks} ranks")
        if communicator is not None and (communicator.rank != rank or communicator.size != contract.ranks):
            raise ValueError(
                f"the communicator is rank {communicator.rank} of {communicator.size}; this backend is rank {rank} "
                f"of the core's {contract.ranks}"
            )
        self._rank = rank
        self._communicator = communicator
        self._decls: dict[str, mf.BufferDecl] = rank_declarations(execution, rank)
        self._resources: dict[str, DecodedResource] = {} if resources is None else resources
        """Decoded weights resources by id (ranks of one process may share it: replicated weights once)."""
        self._load_weights(core)
        shared: dict[str, AnyArray] = {}
        completion_decls: list[mf.BufferDecl] = []
        for decl in self._decls.values():
            if decl.role == mf.BUFFER_ROLE_COMPLETION:
                completion_decls.append(decl)
            elif decl.role == mf.BUFFER_ROLE_WEIGHTS:
                shared[decl.name] = self._weights(decl)
            else:
                shared[decl.name] = np.zeros(self._runtime_shape(decl), dtype=numpy_dtype(decl.name, decl.dtype))
        self._shared = shared
        self._transport_entries = {e.name: e for e in execution.transport.entries}
        self._transport: list[dict[str, AnyArray]] = []
        self._completion_buffers: list[dict[str, AnyArray]] = []
        self._records: dict[int, Mapping[int, AnyArray]] = {}
        """Per frame: the read-only completion record :meth:`completion` returns."""
        for frame in range(frames):
            staging = {
                e.name: np.zeros(tuple(int(s) for s in e.shape), dtype=numpy_dtype(e.name, e.dtype))
                for e in execution.transport.entries
            }
            frame_entry = execution.transport.frame_index_entry
            if frame_entry and frame_entry in staging:
                staging[frame_entry][...] = frame
            self._transport.append(staging)
            self._completion_buffers.append(
                {d.name: np.zeros(self._runtime_shape(d), dtype=numpy_dtype(d.name, d.dtype)) for d in completion_decls}
            )
        self._completion_fields: dict[int, str] = {}
        for record in execution.completion:
            if record.buffer not in self._completion_buffers[0]:
                raise ContractError(
                    f"completion field {mf.CompletionField.Name(record.field)} names {record.buffer!r}, "
                    "which is not a COMPLETION buffer"
                )
            self._completion_fields[int(record.field)] = record.buffer
        self._paged = paged_buffers(execution.buffers)
        self._host_pages: dict[str, AnyArray] = {}
        """The host tier's page slots, per paged buffer (:meth:`reserve_host_pages`)."""
        self._host_page_count = 0
        self._snapshot_planes = [
            d.name for d in execution.buffers if d.shape and d.shape[0].symbol == mf.DIM_SYMBOL_SNAPSHOT_ROWS
        ]
        self._host_snapshots: dict[str, AnyArray] = {}
        """The checkpoint host tier's slots, per snapshot buffer (:meth:`reserve_host_snapshots`)."""
        self._host_snapshot_count = 0
        self._snapshot_row_span = 0
        """Buffer rows of one snapshot row (a request's rows)."""
        self._programs: dict[str, list[list[Step]]] = {}
        for program in list(execution.programs) + list(execution.tuning_programs):
            self._programs[program.name] = [self._resolve(program, frame) for frame in range(frames)]
        self._run_tuning(execution)

    # -- public surface ---------------------------------------------------------
    @property
    def frames(self) -> int:
        """Execution frames (each has its own transport and completion arrays)."""
        return self._frames

    @property
    def rank(self) -> int:
        """The tensor-parallel rank whose buffers this backend holds (0 for a one-rank core)."""
        return self._rank

    @property
    def buffers(self) -> Mapping[str, AnyArray]:
        """Frame-independent buffers (weights, cache planes, state, scratch, tuned) by name."""
        return MappingProxyType(self._shared)

    @property
    def programs(self) -> tuple[str, ...]:
        """Names of the runnable programs."""
        return tuple(self._programs)

    def transport(self, frame: int) -> dict[str, AnyArray]:
        """The frame's staging arrays by transport entry name (the packer writes into them)."""
        return self._transport[self._frame(frame)]

    def completion(self, frame: int) -> Mapping[int, AnyArray]:
        """The frame's completion arrays keyed by ``CompletionField`` value (the same read-only mapping
        every time, so a reader may keep views of it)."""
        index = self._frame(frame)
        record = self._records.get(index)
        if record is None:
            buffers = self._completion_buffers[index]
            record = self._records[index] = MappingProxyType(
                {field: buffers[name] for field, name in self._completion_fields.items()}
            )
        return record

    def run(self, program: str, frame: int) -> None:
        """Execute ``program``'s nodes in order against the frame's transport and completion arrays."""
        variants = self._programs.get(program)
        if variants is None:
            raise ValueError(f"unknown program {program!r}; known: {', '.join(self._programs)}")
        try:
            for step in variants[self._frame(frame)]:
                step()
        except RankError:
            raise  # a peer's failure, already known to every rank
        except BaseException as exc:
            if self._communicator is not None:  # the peers stop waiting for this rank at their next collective
                self._communicator.abort(f"rank {self._rank} failed {program!r}: {type(exc).__name__}: {exc}")
            raise

    # -- the host tier of cache pages ---------------------------------------------
    def reserve_host_pages(self, count: int) -> None:
        """Host slots for ``count`` pages of every buffer with a ``CACHE_PAGES`` leading dimension (plain
        numpy memory), once, at load."""
        if count <= 0 or self._host_page_count:
            raise ValueError(f"host pages are reserved once, a positive count; got {count}")
        self._host_pages = {
            name: np.zeros((count, *self._shared[name].shape[1:]), dtype=self._shared[name].dtype)
            for name in self._paged
        }
        self._host_page_count = count

    def copy_page_to_host(self, page: int, slot: int) -> None:
        """Copy device page ``page`` of every paged buffer into host slot ``slot`` (at once)."""
        self._check_page_copy(page, slot)
        for name, host in self._host_pages.items():
            host[slot] = self._shared[name][page]

    def copy_page_to_device(self, slot: int, page: int) -> None:
        """Copy host slot ``slot`` into device page ``page`` of every paged buffer (at once)."""
        self._check_page_copy(page, slot)
        for name, host in self._host_pages.items():
            self._shared[name][page] = host[slot]

    def _check_page_copy(self, page: int, slot: int) -> None:
        if not self._host_page_count:
            raise ValueError("no host pages are reserved")
        pages = self._symbols[mf.DIM_SYMBOL_CACHE_PAGES]
        if not (0 <= page < pages and 0 <= slot < self._host_page_count):
            raise ValueError(f"page {page} or host slot {slot} is outside [0, {pages}) or [0, {self._host_page_count})")

    # -- the host tier of checkpoints ----------------------------------------------
    def reserve_host_snapshots(self, count: int, rows: int) -> None:
        """Host slots for ``count`` checkpoints of ``rows`` rows of every buffer with a ``SNAPSHOT_ROWS``
        leading dimension (plain numpy memory), once, at load."""
        if count <= 0 or rows <= 0 or self._host_snapshot_count:
            raise ValueError(f"host checkpoint slots are reserved once, a positive count and rows; got {count}, {rows}")
        if not self._snapshot_rows:
            raise ValueError("the core has no snapshot rows to copy (its prefix reuse keeps no checkpoints)")
        self._host_snapshots = {
            name: np.zeros((count, rows, *self._shared[name].shape[1:]), dtype=self._shared[name].dtype)
            for name in self._snapshot_planes
        }
        self._host_snapshot_count = count
        self._snapshot_row_span = rows

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        """Copy snapshot row ``row`` (a request's rows) of every snapshot buffer into host slot ``slot``."""
        rows = self._check_snapshot_copy(row, slot)
        for name, host in self._host_snapshots.items():
            host[slot] = self._shared[name][rows]

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        """Copy host slot ``slot`` into snapshot row ``row`` of every snapshot buffer."""
        rows = self._check_snapshot_copy(row, slot)
        for name, host in self._host_snapshots.items():
            self._shared[name][rows] = host[slot]

    def _check_snapshot_copy(self, row: int, slot: int) -> slice:
        if not self._host_snapshot_count:
            raise ValueError("no host checkpoint slots are reserved")
        span = self._snapshot_row_span
        rows = self._snapshot_rows // span
        if not (0 <= row < rows and 0 <= slot < self._host_snapshot_count):
            raise ValueError(
                f"snapshot row {row} or host slot {slot} is outside [0, {rows}) or [0, {self._host_snapshot_count})"
            )
        return slice(row * span, (row + 1) * span)

    def close(self) -> None:
        """Release every array and resource buffer (nothing is in flight on the CPU)."""
        self._host_pages.clear()
        self._host_snapshots.clear()
        self._programs.clear()
        self._transport.clear()
        self._completion_buffers.clear()
        self._records.clear()
        self._shared.clear()
        self._resources.clear()

    # -- construction -----------------------------------------------------------
    def _run_tuning(self, execution: mf.ExecutionManifest) -> None:
        """Run each tuning producer once on frame 0, in catalog order: the tuned buffers hold their values
        before the constructor returns, so before any serving program that binds them can run."""
        tuning = {p.name for p in execution.tuning_programs}
        for producer in execution.tuning:
            if producer.program not in tuning:
                raise ContractError(f"tuning producer {producer.program!r} has no program in the tuning catalog")
            missing = [name for name in producer.outputs if name not in self._shared]
            if missing:
                raise ContractError(f"tuning producer {producer.program!r} fills unknown buffers {missing}")
            try:
                self.run(producer.program, 0)
            except (ValueError, FloatingPointError, IndexError) as exc:
                raise StartupError(f"tuning producer {producer.program!r}: {exc}") from exc

    def _frame(self, frame: int) -> int:
        if not 0 <= frame < self._frames:
            raise ValueError(f"frame {frame} is outside [0, {self._frames})")
        return frame

    def _runtime_shape(self, decl: mf.BufferDecl) -> tuple[int, ...]:
        return runtime_shape(
            decl,
            cache_pages=self._symbols[mf.DIM_SYMBOL_CACHE_PAGES],
            state_rows=self._symbols[mf.DIM_SYMBOL_STATE_ROWS],
            snapshot_rows=self._snapshot_rows,
        )

    def _load_weights(self, core: CoreFile) -> None:
        """Decode the WEIGHTS resources this rank's buffers name that no rank sharing the table decoded yet,
        a few at once (:func:`~helios_core.backends.weights_loading.decode_resources`); they join the table
        only once all of them decoded, so a failure leaves nothing behind."""
        wanted: list[str] = []
        for decl in self._decls.values():
            if decl.role != mf.BUFFER_ROLE_WEIGHTS:
                continue
            if any(dim.symbol in SYMBOLIC for dim in decl.shape):
                raise ContractError(f"weights buffer {decl.name!r} has a symbolic dimension")
            if decl.resource_id not in self._resources:
                wanted.append(decl.resource_id)
        decoded: dict[str, DecodedResource] = {}
        decode_resources(core, wanted, cb.RESOURCE_KIND_WEIGHTS, decoded.__setitem__)
        self._resources.update(decoded)

    def _weights(self, decl: mf.BufferDecl) -> AnyArray:
        data = self._resources[decl.resource_id]  # decoded by _load_weights
        dtype = numpy_dtype(decl.name, decl.dtype)
        shape = self._runtime_shape(decl)
        count = math.prod(shape)
        offset = int(decl.resource_offset)
        if offset + count * dtype.itemsize > len(data):
            raise ContractError(
                f"weights buffer {decl.name!r} needs bytes [{offset}, {offset + count * dtype.itemsize}) of "
                f"resource {decl.resource_id!r}, which holds {len(data)}"
            )
        array: AnyArray = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
        array.flags.writeable = False
        return array

    def _view(self, where: str, view: mf.BufferView, frame: int) -> _Bound:
        name = view.buffer
        decl = self._decls.get(name)
        if decl is not None:
            if decl.role == mf.BUFFER_ROLE_COMPLETION:
                base = self._completion_buffers[frame][name]
            else:
                base = self._shared[name]
            declared = tuple(int(d.size) for d in decl.shape)
            dtype = int(decl.dtype)
        elif name in self._transport_entries:
            base = self._transport[frame][name]
            declared = base.shape
            dtype = int(self._transport_entries[name].dtype)
        else:
            raise ContractError(f"{where} names unknown buffer {name!r}")
        offset = int(view.element_offset)
        shape = tuple(int(s) for s in view.shape)
        if not shape or (offset == 0 and shape == declared):
            if offset == 0:
                return _Bound(base, dtype)  # the whole buffer, at its runtime extent
            shape = (base.size - offset,)
        count = math.prod(shape)
        if offset + count > base.size:
            raise ContractError(
                f"{where} views elements [{offset}, {offset + count}) of {name!r}, which holds {base.size} here"
            )
        return _Bound(base.reshape(-1)[offset : offset + count].reshape(shape), dtype)

    def _resolve(self, program: mf.ProgramDecl, frame: int) -> list[Step]:
        steps: list[Step] = []
        for node in program.nodes:
            key = (node.op.name, int(node.op.version))
            where = f"program {program.name!r} node {node.name!r} ({node.op.name} v{node.op.version})"
            adapter = _ADAPTERS.get(key)
            if adapter is None:
                versions = known_versions(node.op.name)
                if key in CATALOGUE:
                    known = "the reference backend has no implementation of it"
                elif versions:
                    known = f"known versions: {list(versions)}"
                else:
                    known = "unknown operator"
                raise UnsupportedFeatureError(
                    f"program {program.name!r} node {node.name!r} uses operator {node.op.name} version "
                    f"{node.op.version} ({known})"
                )
            args = {arg.name: self._view(f"{where} argument {arg.name!r}", arg.view, frame) for arg in node.args}
            attributes = {attr.name: _attribute_value(attr) for attr in node.attributes}
            steps.append(adapter(_Node(where, args, attributes, self._communicator)))
        return steps
