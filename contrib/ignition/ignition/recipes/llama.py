"""The Llama-family text recipe: weights, paged KV cache and every program variant.

Owns the dataflow of a Llama decoder (embedding, per-layer attention over a
paged KV cache and a SiLU-gated MLP, final norm, LM head, sampling) written as
op-catalogue nodes, and the graph contracts that bind each program to the
shared declarations of :mod:`ignition.preparation.contract`. Weight sources
(a GGUF file or seeded random shapes) live in other recipes; this module only
needs arrays named as below. The steps every text recipe shares (graph contracts,
sampling and completion, prompt scores, the ``initialize``, prompt and decode
programs) belong to :class:`~ignition.recipes.common.TextProgramWriter`, its base.

Programs: ``initialize`` (admission state), ``prefill_p{P}`` (chunked prompt
processing; also serves mixed rounds), ``mixed_p{P}``, ``scored_prefill_p{P}``
(prompt scores), ``resume_p{P}`` (continuing after a restore),
``decode_b{B}`` (one token per row, device-owned pending token),
``speculative_w{W}_b{B}`` when speculative widths are declared (each lane's
pending token and up to W - 1 copied proposals verified in one round; the
completion record then holds W ids a lane for the widest W), or instead
``selfdraft_w{W}_b{B}`` (the target's first layers draft in the graph, the
device allocates each lane's verified prefix from the draft's confidence
within the host's ceilings, and computes positions and cache slots) and, when
snapshots are declared, ``snapshot`` and ``restore``: a snapshot copies the
partial last page of every plane into continuation storage and the sampling
state into snapshot rows (complete pages stay shared, immutable, in the
cache); a restore copies them back into the request's private tail page and
state row.

Tensor parallelism (``tensor_parallel`` N >= 1): every rank runs the same programs over its shard of
each layer (:class:`RankPartition`). Q, K and V are column-parallel (each rank holds ceil(KV/N) whole
key-value heads and the query heads that read them, so its cache planes hold its key-value heads); the
output projection is row-parallel, its partial product summed by ``all_reduce`` before the residual
add; the MLP's gate and up projections are column-parallel (ceil(F/N) rows each), the down projection
row-parallel, then ``all_reduce`` and the residual add. Where N does not divide the heads or the
feed-forward width, the last ranks' surplus heads and rows are zeros: a zero head's scores are all
zero, its softmax finite and its values zero, so its output is zero, and its zero output-projection
columns (as the zero down-projection columns of zero rows, silu(0) x 0 = 0) add exactly zero to the
partial product. The embedding, every norm and the LM head are replicated, so
every rank computes the whole logits and samples the same tokens. With N = 1 the programs carry the
collective nodes (identity on one rank). In a kernel graph the MLP's partial product comes from
``rmsnorm_swiglu_mlp_add`` over a replicated zero residual (``tensor_parallel.zero_residual``), the
output projection's from ``linear``; each is followed by ``all_reduce`` and ``add``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from ignition.preparation import contract as decl
from ignition.preparation.program import CatalogPart, ManifestBuilder, ProgramBuilder, View, prefix
from ignition.recipes.common import TextProgramWriter
from ignition.recipes.engram import EngramViews, add_engram, declare_engram, engram_shape

Weights = Mapping[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class LlamaShape:
    """Hyperparameters of a Llama-family decoder."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rms_eps: float
    rope_style: str = "half"
    """"half" (pairs i, i + d/2) or "interleaved" (adjacent pairs, as GGUF stores Llama Q/K)."""
    frequency_band_scaling: tuple[float, float, float, int] | None = None
    """(factor, low_freq_factor, high_freq_factor, original_max_position) or None."""
    context: int = 2048

    def parameter_count(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        return self.vocab * self.hidden * 2 + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden


@dataclass(frozen=True)
class Capacities:
    """Captured extents of the programs."""

    max_rows: int = 8
    prefill_tokens: tuple[int, ...] = (16, 64)
    decode_rows: tuple[int, ...] = (1, 2, 4, 8)
    page_tokens: int = 16
    cache_pages: int = 256
    context: int = 512
    top_logprobs: int = 5
    snapshots: int = 8
    """Snapshot rows (working set); 0 declares no snapshot or restore programs."""
    speculative_widths: tuple[int, ...] = ()
    """Widths W of the speculative programs (one per decode row count each); () for none."""
    speculation: str = "history"
    """The proposal source of the speculative programs (one of :data:`SPECULATION_KINDS`): ``history``
    builds ``speculative_w{W}_b{B}`` (copied proposals), ``self-draft`` builds ``selfdraft_w{W}_b{B}``."""
    draft_tokens: int = 0
    """N: with ``self-draft``, the proposals every program wider than one drafts (D = N)."""
    draft_layers: int = 0
    """K: with ``self-draft``, the target's first K layers draft (0: every layer but the last)."""
    window: int = 0
    """N: every attention layer attends only to the last N positions, the query's own included (sliding-
    window attention; the cache declares a sliding-window history of N tokens); 0 for unlimited."""
    proposal_budget: str = "half"
    """With ``self-draft``, P of each program (one of :data:`PROPOSAL_BUDGETS`): ``half`` verifies every
    lane's pending token plus half of the proposal rows, so the device allocation chooses; ``full`` has
    room for every lane's whole ceiling (P = B x W: fixed-width speculation, nothing to choose)."""
    draft_sampling: str = "greedy"
    """With ``self-draft``, how the draft chooses its tokens (one of :data:`DRAFT_SAMPLING_KINDS`):
    ``greedy`` (``draft_argmax``, verified by ``sample_verify``) or ``sampled`` (``draft_sample`` from the
    draft's distribution at the request's settings, verified by ``sample_verify_sampled``)."""
    cache_dtype: str = "f32"
    """Storage type of the key and value cache planes and their snapshot rows (one of
    :data:`CACHE_DTYPES`): ``f32``, or ``bf16`` (half the bytes a decode step reads per cached token;
    keys and values are rounded to nearest even when written)."""
    engram: bool = False
    """A hashed n-gram memory table (:mod:`ignition.recipes.engram`) staged by the host each round and
    added to the residual stream after the embedding; the decode programs then take host-fed pending
    tokens."""

    def __post_init__(self) -> None:
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {self.cache_dtype!r}")
        for name in ("max_rows", "page_tokens", "cache_pages", "context"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"Capacities.{name} must be at least 1, got {value}")
        if self.page_tokens > self.context:
            raise ValueError(f"Capacities.page_tokens must be at most context {self.context}, got {self.page_tokens}")
        for name in ("prefill_tokens", "decode_rows"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"Capacities.{name} must be positive extents, got {values}")

    @property
    def self_drafting(self) -> bool:
        """Whether the speculative programs draft in the graph (``self-draft``)."""
        return bool(self.speculative_widths) and self.speculation == "self-draft"

    @property
    def draft_capacity(self) -> int:
        """The widest D of any self-drafting program (the confidence storage's width), else 0."""
        if not self.self_drafting:
            return 0
        return max(self_draft_draws(w, self.draft_tokens) for w in self.speculative_widths)

    @property
    def widest_speculation(self) -> int:
        """The widest speculative W, 1 without speculative programs (the completion record's width)."""
        return max(self.speculative_widths, default=1)

    @property
    def pages_per_row(self) -> int:
        """Pages of a lane's page-table row: the context, plus the W - 1 positions a widest speculative
        round may reach past the last context position (every lane's full ceiling fits its row)."""
        return -(-(self.context + self.widest_speculation - 1) // self.page_tokens)

    @property
    def speculative_packed(self) -> int:
        """P of the largest speculative program (B x W; :func:`self_draft_packed` for self-drafting
        programs), 0 without speculative programs."""
        if not self.speculative_widths:
            return 0
        if self.self_drafting:
            return self_draft_packed(max(self.decode_rows), self.widest_speculation, self.proposal_budget)
        return max(self.decode_rows) * self.widest_speculation

    @property
    def max_packed(self) -> int:
        return max(max(self.prefill_tokens), max(self.decode_rows), self.speculative_packed)


SPECULATIVE_WIDTHS = (1, 2, 4, 8)
"""The widths speculative programs are built at (those of at most N + 1 for N draft tokens)."""

DRAFT_SAMPLING_KINDS = ("greedy", "sampled")
"""How a self-drafting program's draft chooses its tokens: ``greedy`` takes the draft's argmax, ``sampled``
draws from the draft's distribution (exact speculative sampling at any temperature)."""

CACHE_DTYPES = {"f32": mf.DTYPE_F32, "bf16": mf.DTYPE_BF16}
"""Storage types of the key and value cache planes, by their ``--cache-dtype`` names."""

SPECULATION_KINDS = ("history", "self-draft")
"""Proposal sources a core's speculative programs are built for: ``history`` verifies copied proposals,
``self-draft`` drafts them in the graph with the target's first layers (early exit)."""


PROPOSAL_BUDGETS = ("half", "full")
"""P of self-drafting programs: half of the proposal rows (allocation by confidence) or all of them."""

CONFIDENCE_BROADCAST = "confidence_broadcast"
"""The node of a tensor-parallel self-drafting program that broadcasts rank 0's draft confidences to every
rank right before ``draft_allocate`` (a program that draws proposals; width one allocates without them)."""


def self_draft_packed(rows: int, width: int, budget: str = "half") -> int:
    """P of ``selfdraft_w{W}_b{B}``: every lane's pending token plus half of the B x (W - 1) proposal
    rows (rounded up), so the device allocation chooses which proposals to verify (P = B at width one);
    with the ``full`` budget all of them, B x W (every lane verifies its whole ceiling)."""
    if budget == "full":
        return rows * width
    return rows + (rows * (width - 1) + 1) // 2


def self_draft_draws(width: int, draft_tokens: int) -> int:
    """D of ``selfdraft_w{W}_b{B}``: N above width one (a narrower program drafts the full block and
    verifies a shorter prefix), 0 at width one."""
    return draft_tokens if width > 1 else 0


def speculative_widths(draft_tokens: int) -> tuple[int, ...]:
    """The widths W in :data:`SPECULATIVE_WIDTHS` with W <= ``draft_tokens`` + 1.

    Raises:
        ValueError: ``draft_tokens`` below 1.
    """
    if draft_tokens < 1:
        raise ValueError(f"--draft-tokens must be at least 1 (the proposals a round verifies), got {draft_tokens}")
    return tuple(w for w in SPECULATIVE_WIDTHS if w <= draft_tokens + 1)


@dataclass
class _Scratch:
    h: View
    xn: View
    q: View
    k: View
    v: View
    attn: View
    o: View
    gate: View
    up: View
    act: View
    last_index: View
    last_h: View
    logits: View
    all_logits: View
    ids: View
    sampled_ids: View | None = None
    """[B, 1] ids a non-speculative program samples, when the completion record is wider than one id."""
    sampled_logprob: View | None = None
    """[B, 1] their logprobs (as ``sampled_ids``)."""


@dataclass(frozen=True)
class _TokenLayout:
    """Where the decoder reads each packed token's position, lane row and cache slot: the host-fed
    transport entries, or device-computed scratch (self-drafting programs)."""

    positions: View
    token_rows: View
    cache_slots: View


@dataclass
class _SelfDraftScratch:
    """Activations of self-drafting programs: draft steps, allocation and the device packed layout."""

    step_ids: View
    """[D x B] draft ids, step-major (step i's lanes at i x B: the next step's embedding input)."""
    step_confidence: View
    """[D x B] their confidences, step-major."""
    candidate_ids: View
    """[B x (R - 1)] the draft ids a program verifies, lane-major ([B, W - 1] for width W)."""
    confidence: View
    """[B x D] draft confidences, lane-major ([B, D])."""
    step_positions: View
    step_token_rows: View
    step_cache_slots: View
    """[B] one draft step's positions, lane rows and cache slots."""
    query_length: View
    """[B] the allocated target rows of each lane."""
    positions: View
    token_rows: View
    cache_slots: View
    """[P] the verification's packed positions, lane rows and cache slots."""
    draft_probabilities: View | None = None
    """[B x D, V] the sampled draft's distribution of each drafted token, lane-major ([B, D, V]); only
    for ``--draft-sampling sampled``."""


@dataclass
class _SpeculativeScratch:
    """Activations of speculative programs (packed ids, verification results before the record)."""

    ids: View
    """[P] packed ids: each lane's pending token, then its copied candidates."""
    verify_ids: View
    """[B x W] emitted ids of a verification narrower than the record."""
    verify_logprob: View
    """[B x W] their logprobs."""
    accepted: View
    emitted: View
    pending: View
    """[B, 1] each lane's last emitted token, the next pending token."""


TENSOR_PARALLEL_SPLITS = {"wq": 0, "wk": 0, "wv": 0, "w_gate": 0, "w_up": 0, "wo": 1, "w_down": 1}
"""The axis each sharded layer weight is cut along (0: rows, column-parallel; 1: columns, row-parallel)."""

_SPLIT_EXTENTS = {
    "wq": "heads",
    "wo": "heads",
    "wk": "kv_heads",
    "wv": "kv_heads",
    "w_gate": "ffn",
    "w_up": "ffn",
    "w_down": "ffn",
}
"""Which per-rank extent each sharded layer weight's split axis holds (heads count ``head_dim`` each)."""


@dataclass(frozen=True)
class RankPartition:
    """How ``ranks`` tensor-parallel ranks share a model's attention heads and feed-forward rows.

    Every rank holds ``kv_heads`` = ceil(KV / N) key-value heads, the ``heads`` = ``kv_heads`` x (H / KV)
    query heads that read them, and ``ffn`` = ceil(F / N) feed-forward rows, so every rank's shapes are
    the same. Rank r holds the model's key-value heads from r x ``kv_heads`` (with their query heads)
    and its feed-forward rows from r x ``ffn``; where the model's run out, the rank's last heads and rows
    are zero padding (zero q, k, v rows and output columns; zero gate and up rows and down columns),
    whose contribution to every partial product is exactly zero.
    """

    model: LlamaShape
    ranks: int
    kv_heads: int
    heads: int
    ffn: int

    @property
    def padded(self) -> bool:
        """Whether any rank holds padding (N does not divide the key-value heads or the feed-forward width)."""
        return self.kv_heads * self.ranks != self.model.kv_heads or self.ffn * self.ranks != self.model.ffn

    def extent(self, key: str) -> int:
        """The rows (axis 0) or columns (axis 1) of sharded weight ``key`` (:data:`TENSOR_PARALLEL_SPLITS`)
        that each rank stores, padding included."""
        return self._extent(key, self.heads, self.kv_heads, self.ffn)

    def whole(self, key: str) -> int:
        """The model's extent along the split axis of ``key``."""
        m = self.model
        return self._extent(key, m.heads, m.kv_heads, m.ffn)

    def real(self, key: str, rank: int) -> int:
        """How many of rank ``rank``'s stored rows (or columns) of ``key`` are the model's; the rest are zeros."""
        return min(max(self.whole(key) - rank * self.extent(key), 0), self.extent(key))

    def shards(self, key: str, array: npt.NDArray[np.float32]) -> list[npt.NDArray[np.float32]]:
        """``array`` (the model's weight ``key``) zero-padded along its split axis to N x :meth:`extent`,
        cut into the N ranks' shards."""
        axis = TENSOR_PARALLEL_SPLITS[key]
        whole = np.asarray(array)
        if whole.shape[axis] != self.whole(key):
            raise ValueError(f"{key} has {whole.shape[axis]} along axis {axis}, the shape says {self.whole(key)}")
        widths = [(0, 0)] * whole.ndim
        widths[axis] = (0, self.extent(key) * self.ranks - self.whole(key))
        return np.split(np.pad(whole, widths), self.ranks, axis=axis)

    def real_shape(self, key: str, rank: int) -> tuple[int, int]:
        """The shape of the model's part of rank ``rank``'s shard of ``key``: its first :meth:`real` rows
        (of ``hidden`` columns) or columns (of ``hidden`` rows)."""
        real = self.real(key, rank)
        return (real, self.model.hidden) if TENSOR_PARALLEL_SPLITS[key] == 0 else (self.model.hidden, real)

    def _extent(self, key: str, heads: int, kv_heads: int, ffn: int) -> int:
        kind = _SPLIT_EXTENTS[key]
        if kind == "ffn":
            return ffn
        return (heads if kind == "heads" else kv_heads) * self.model.head_dim


def partition_ranks(shape: LlamaShape, ranks: int, model: str = "the model") -> RankPartition:
    """Share ``shape`` among ``ranks`` tensor-parallel ranks (:class:`RankPartition`).

    Raises:
        ValueError: ``ranks`` below 1, or so many ranks that the last would hold padding only (no
            key-value head and no feed-forward row of the model's).
    """
    if ranks < 1:
        raise ValueError(f"--tensor-parallel must be at least 1 (the ranks), got {ranks}")
    if shape.kv_heads < 1 or shape.heads % shape.kv_heads:
        raise ValueError(
            f"the attention heads ({shape.heads}) of {model} are not a multiple of its key-value heads "
            f"({shape.kv_heads})"
        )
    kv_heads, ffn = -(-shape.kv_heads // ranks), -(-shape.ffn // ranks)
    attention_ranks, feed_forward_ranks = -(-shape.kv_heads // kv_heads), -(-shape.ffn // ffn)
    used = max(attention_ranks, feed_forward_ranks)
    if used < ranks:
        idle = f"rank {used}" if used == ranks - 1 else f"ranks {used}..{ranks - 1}"
        raise ValueError(
            f"--tensor-parallel {ranks} would leave {idle} of {model} with zero padding only: a rank holds "
            f"{kv_heads} of the {shape.kv_heads} key-value heads, which {_first_ranks(attention_ranks)}, and "
            f"{ffn} of the {shape.ffn} feed-forward rows, which {_first_ranks(feed_forward_ranks)}"
        )
    group = shape.heads // shape.kv_heads
    return RankPartition(model=shape, ranks=ranks, kv_heads=kv_heads, heads=kv_heads * group, ffn=ffn)


def _first_ranks(count: int) -> str:
    return "rank 0 holds" if count == 1 else f"ranks 0..{count - 1} hold"


def check_tensor_parallel(shape: LlamaShape, ranks: int, model: str = "the model") -> None:
    """Refuse a rank count :func:`partition_ranks` refuses (below 1, or leaving a rank padding only).

    Raises:
        ValueError: as :func:`partition_ranks`.
    """
    partition_ranks(shape, ranks, model)


def rank_shape(shape: LlamaShape, ranks: int) -> LlamaShape:
    """The shape one of ``ranks`` tensor-parallel ranks computes: ceil(KV/N) key-value heads, as many
    groups of query heads, ceil(F/N) feed-forward rows, padding included (:class:`RankPartition`)."""
    partition = partition_ranks(shape, ranks)
    return dataclasses.replace(shape, heads=partition.heads, kv_heads=partition.kv_heads, ffn=partition.ffn)


def _moved(part: CatalogPart, start: int) -> CatalogPart:
    """``part`` starting at element ``start`` of a packed shard."""
    return dataclasses.replace(part, start=start)


def tensor_names(layer: int) -> dict[str, str]:
    """Array names the recipe expects for one layer."""
    return {
        "attn_norm": f"blk.{layer}.attn_norm.weight",
        "wq": f"blk.{layer}.attn_q.weight",
        "wk": f"blk.{layer}.attn_k.weight",
        "wv": f"blk.{layer}.attn_v.weight",
        "wo": f"blk.{layer}.attn_output.weight",
        "ffn_norm": f"blk.{layer}.ffn_norm.weight",
        "w_gate": f"blk.{layer}.ffn_gate.weight",
        "w_up": f"blk.{layer}.ffn_up.weight",
        "w_down": f"blk.{layer}.ffn_down.weight",
    }


class LlamaProgramWriter(TextProgramWriter):
    """Writes the Llama programs into a ManifestBuilder."""

    shape: LlamaShape
    scratch: _Scratch

    def __init__(
        self,
        builder: ManifestBuilder,
        shape: LlamaShape,
        caps: Capacities,
        weights: Weights,
        *,
        sampled_size: int,
        bf16: bool,
        fused: bool = False,
        tensor_parallel: int = 0,
    ) -> None:
        """``tensor_parallel`` N >= 1 writes the programs of N ranks with collectives (module docstring);
        ``shape`` is then the whole model's and :attr:`shape` one rank's."""
        if not 0 < sampled_size <= shape.vocab:
            raise ValueError(f"sampled_size {sampled_size} must lie in (0, {shape.vocab}]")
        if tensor_parallel != builder.tensor_parallel:
            raise ValueError(
                f"the writer has tensor_parallel {tensor_parallel}, its manifest builder {builder.tensor_parallel}"
            )
        self.sampled_size = sampled_size
        self.fused = fused
        self.bf16 = bf16
        self.builder = builder
        self.tensor_parallel = tensor_parallel
        self.model_shape = shape
        """The whole model's shape (the weights' shapes)."""
        self.partition = partition_ranks(shape, tensor_parallel) if tensor_parallel else None
        """How the ranks share the heads and feed-forward rows (None without ``tensor_parallel``)."""
        self.shape = rank_shape(shape, tensor_parallel) if tensor_parallel else shape
        self.caps = caps
        self.text_caps = decl.TextCapacities(
            max_rows=caps.max_rows,
            max_packed_tokens=caps.max_packed,
            pages_per_row=caps.pages_per_row,
            vocab_width=shape.vocab,
            top_logprobs=caps.top_logprobs,
            emitted_capacity=caps.widest_speculation,
        )
        self.shared = decl.declare_paged_text(builder, self.text_caps)
        self.speculative: decl.SpeculativeViews | None = None
        self.self_draft: decl.SelfDraftViews | None = None
        self.draft_layers = self._draft_layers() if caps.self_drafting else 0
        self.record_rows: dict[int, View] = {}
        self._draft_tables: dict[tuple[int, int, int], View] = {}
        self.zero_residual: View | None = None
        """A tensor-parallel kernel graph's [P, hidden] zeros (the down projection's residual)."""
        if caps.speculative_widths:
            self._declare_speculative()
        self._declare_weights(weights, bf16)
        self.engram: EngramViews | None = None
        if caps.engram:
            self.host_pending = True  # the host hashes every input id, the pending token included
            self.engram = declare_engram(builder, engram_shape(shape.hidden), shape.hidden, caps.max_packed, bf16=bf16)
        self._declare_cache()
        self.snapshots: decl.SnapshotViews | None = None
        self.continuation_k: list[View] = []
        self.continuation_v: list[View] = []
        if caps.snapshots > 0:
            self._declare_continuation()
        if caps.self_drafting:
            endpoint = self.snapshots.consumed if self.snapshots is not None else None
            self.self_draft = decl.declare_self_draft(builder, self.text_caps, caps.draft_capacity, consumed=endpoint)
        self.scratch = self._declare_scratch()
        speculating = self.speculative is not None or self.self_draft is not None
        self.speculative_scratch = self._declare_speculative_scratch() if speculating else None
        self.self_draft_scratch = self._declare_self_draft_scratch() if self.self_draft is not None else None

    # -- declarations --------------------------------------------------------
    def _declare_weights(self, weights: Weights, bf16: bool) -> None:
        if self.tensor_parallel:
            self._declare_rank_weights(weights, bf16)
            return
        w = self.builder.weight
        s = self.shape
        self.tok_embd = w("tok_embd", weights["token_embd.weight"], "weights.embed", bf16=bf16)
        self.layer_weights: list[dict[str, View]] = []
        for layer in range(s.layers):
            names = tensor_names(layer)
            rid = f"weights.layer{layer}"
            views = {}
            if self.fused:
                # Kernel graphs read one packed [q | k | v] and one [gate | up] matrix per layer.
                qkv = np.concatenate([weights[names["wq"]], weights[names["wk"]], weights[names["wv"]]])
                gate_up = np.concatenate([weights[names["w_gate"]], weights[names["w_up"]]])
                packed = {
                    "attn_norm": (names["attn_norm"], weights[names["attn_norm"]], False),
                    "wqkv": (f"blk.{layer}.attn_qkv.weight", qkv, bf16),
                    "wo": (names["wo"], weights[names["wo"]], bf16),
                    "ffn_norm": (names["ffn_norm"], weights[names["ffn_norm"]], False),
                    "w_gate_up": (f"blk.{layer}.ffn_gate_up.weight", gate_up, bf16),
                    "w_down": (names["w_down"], weights[names["w_down"]], bf16),
                }
                for key, (name, array, as_bf16) in packed.items():
                    views[key] = w(name, array, rid, bf16=as_bf16)
            else:
                for key, name in names.items():
                    views[key] = w(name, weights[name], rid, bf16=bf16 and key not in ("attn_norm", "ffn_norm"))
            self.layer_weights.append(views)
        self.out_norm = w("output_norm.weight", weights["output_norm.weight"], "weights.head")
        head = weights.get("output.weight")
        self.lm_head = w("output.weight", head, "weights.head", bf16=bf16) if head is not None else self.tok_embd

    def _declare_rank_weights(self, weights: Weights, bf16: bool) -> None:
        """Tensor-parallel weights: the embedding, norms and LM head once (every rank loads them), each
        layer's projections per rank (:data:`TENSOR_PARALLEL_SPLITS`, zero-padded by
        :class:`RankPartition`), rank r's in the resource ``weights.layer{L}.rank{r}``; a kernel graph packs
        each rank's [q | k | v] and [gate | up] shards and reads a zero residual (module docstring).

        Rank r's weight catalog lists each source tensor's real part of its shard: the shard's first
        rows (or columns) that are the model's, its padding left out; a packed shard as its parts."""
        w, per_rank = self.builder.weight, self.builder.rank_weight
        partition = self.partition
        if partition is None:
            raise ValueError("tensor-parallel weights need the rank partition")
        ranks = range(partition.ranks)
        self.tok_embd = w(
            "tok_embd", weights["token_embd.weight"], "weights.embed", bf16=bf16, source="token_embd.weight"
        )
        self.layer_weights = []
        for layer in range(self.model_shape.layers):
            names = tensor_names(layer)
            rid = f"weights.layer{layer}"
            shards = {key: partition.shards(key, weights[names[key]]) for key in TENSOR_PARALLEL_SPLITS}
            real = {
                key: [CatalogPart(names[key], 0, partition.real_shape(key, r)) for r in ranks]
                for key in TENSOR_PARALLEL_SPLITS
            }
            views = {
                "attn_norm": w(names["attn_norm"], weights[names["attn_norm"]], rid),
                "ffn_norm": w(names["ffn_norm"], weights[names["ffn_norm"]], rid),
            }
            if self.fused:
                qkv = [np.concatenate(parts) for parts in zip(shards["wq"], shards["wk"], shards["wv"], strict=True)]
                gate_up = [np.concatenate(parts) for parts in zip(shards["w_gate"], shards["w_up"], strict=True)]
                q_size, k_size, gate_size = (shards[key][0].size for key in ("wq", "wk", "w_gate"))
                qkv_parts = [
                    [real["wq"][r], _moved(real["wk"][r], q_size), _moved(real["wv"][r], q_size + k_size)]
                    for r in ranks
                ]
                gate_up_parts = [[real["w_gate"][r], _moved(real["w_up"][r], gate_size)] for r in ranks]
                views["wqkv"] = per_rank(f"blk.{layer}.attn_qkv.weight", qkv, rid, bf16=bf16, parts=qkv_parts)
                views["w_gate_up"] = per_rank(
                    f"blk.{layer}.ffn_gate_up.weight", gate_up, rid, bf16=bf16, parts=gate_up_parts
                )
                sharded: tuple[str, ...] = ("wo", "w_down")
            else:
                sharded = tuple(TENSOR_PARALLEL_SPLITS)
            for key in sharded:
                parts = [[part] for part in real[key]]
                views[key] = per_rank(names[key], shards[key], rid, bf16=bf16, parts=parts)
            self.layer_weights.append(views)
        self.out_norm = w("output_norm.weight", weights["output_norm.weight"], "weights.head")
        head = weights.get("output.weight")
        self.lm_head = w("output.weight", head, "weights.head", bf16=bf16) if head is not None else self.tok_embd
        if self.fused:
            zeros = np.zeros((self.caps.max_packed, self.shape.hidden), dtype=np.float32)
            self.zero_residual = w("tensor_parallel.zero_residual", zeros, "constants")

    def _declare_speculative(self) -> None:
        """Copied-proposal inputs, and the row tables that place narrower results in the wide record.

        The record holds ``R = caps.widest_speculation`` ids a lane. A program whose lanes yield W < R
        ids (decode and prefill: 1; a narrower speculative program: its W) writes them to scratch, then
        copies lane i's W values to row ``i x R / W`` of the record viewed as ``[B x R / W, W]`` (W
        divides R: widths are powers of two). ``record_rows[W]`` holds those row numbers (an immutable
        int32 table in the ``constants`` resource).
        """
        caps = self.caps
        widths = caps.speculative_widths
        widest = caps.widest_speculation
        unknown = sorted(set(widths) - set(SPECULATIVE_WIDTHS))
        if unknown:
            raise ValueError(f"speculative widths {unknown} are not among {SPECULATIVE_WIDTHS}")
        if caps.speculation not in SPECULATION_KINDS:
            raise ValueError(f"speculation {caps.speculation!r} is not among {SPECULATION_KINDS}")
        if caps.self_drafting:
            too_wide = [w for w in widths if w > caps.draft_tokens + 1]
            if too_wide:
                raise ValueError(f"self-drafting widths {too_wide} exceed draft_tokens + 1 = {caps.draft_tokens + 1}")
        else:
            self.speculative = decl.declare_speculative(self.builder, self.text_caps, widths)
        for width in sorted({1, *widths}):
            if width < widest:
                rows = np.arange(caps.max_rows, dtype=np.int32) * np.int32(widest // width)  # [B]
                self.record_rows[width] = self.builder.weight(f"layout.record_rows_w{width}", rows, "constants")
        if caps.self_drafting:
            draws = caps.draft_tokens
            for lanes in caps.decode_rows:
                for width in widths:
                    if width > 1:
                        self._draft_table(lanes, draws, draws)  # confidences: every step
                        self._draft_table(lanes, draws, width - 1)  # candidates: the first W - 1 steps

    def _draft_layers(self) -> int:
        """K, the layers that draft: ``caps.draft_layers``, or every layer but the last when it is 0."""
        layers = self.shape.layers
        chosen = self.caps.draft_layers or max(layers - 1, 1)
        if not 1 <= chosen <= layers:
            raise ValueError(f"--draft-layers must lie in [1, {layers}] (the target's layers), got {chosen}")
        return chosen

    def _draft_table(self, rows: int, draws: int, columns: int) -> View:
        """The rows a step-major ``[D, B]`` draft result moves to in a lane-major ``[B, C]`` table.

        Entry ``i x B + r`` (step ``i``, lane ``r``) holds ``r x C + i`` when ``i < C``, else -1 (the
        step is not copied): ``copy_rows`` over ``[D x B, 1]`` and ``[B x C, 1]`` views transposes.
        """
        key = (rows, draws, columns)
        table = self._draft_tables.get(key)
        if table is None:
            steps = np.arange(draws, dtype=np.int64)[:, None]
            lanes = np.arange(rows, dtype=np.int64)[None, :]
            values = np.where(steps < columns, lanes * columns + steps, -1).astype(np.int32).reshape(-1)
            table = self.builder.weight(f"layout.draft_rows_b{rows}_d{draws}_c{columns}", values, "constants")
            self._draft_tables[key] = table
        return table

    def _declare_cache(self) -> None:
        s, c = self.shape, self.caps
        plane_shape = [c.cache_pages, c.page_tokens, s.kv_heads, s.head_dim]
        self.k_planes: list[View] = []
        self.v_planes: list[View] = []
        for layer in range(s.layers):
            for kind, planes in (("k", self.k_planes), ("v", self.v_planes)):
                planes.append(
                    self.builder.buffer(
                        f"cache.{kind}{layer}",
                        mf.BUFFER_ROLE_CACHE_PLANE,
                        CACHE_DTYPES[c.cache_dtype],
                        plane_shape,
                        leading_symbol=mf.DIM_SYMBOL_CACHE_PAGES,
                    )
                )

    def _declare_continuation(self) -> None:
        """Snapshot rows: the partial page of each plane and the sampling-state copies."""
        s, c = self.shape, self.caps
        self.snapshots = decl.declare_snapshots(self.builder, self.text_caps, c.snapshots)
        self.tail_page = self.builder.buffer("scratch.tail_page", mf.BUFFER_ROLE_SCRATCH, mf.DTYPE_I32, [1])
        row_shape = [c.snapshots, c.page_tokens, s.kv_heads, s.head_dim]
        for layer in range(s.layers):
            for kind, rows in (("k", self.continuation_k), ("v", self.continuation_v)):
                rows.append(
                    self.builder.buffer(
                        f"continuation.{kind}{layer}",
                        mf.BUFFER_ROLE_PERSISTENT_STATE,
                        CACHE_DTYPES[c.cache_dtype],
                        row_shape,
                        leading_symbol=mf.DIM_SYMBOL_SNAPSHOT_ROWS,
                    )
                )

    def _declare_scratch(self) -> _Scratch:
        s, c = self.shape, self.caps
        p, b = c.max_packed, c.max_rows
        scratch = mf.BUFFER_ROLE_SCRATCH
        f32 = mf.DTYPE_F32

        def buf(name: str, shape: Sequence[int], dtype: int = f32) -> View:
            return self.builder.buffer(f"scratch.{name}", scratch, dtype, shape)

        return _Scratch(
            h=buf("h", [p, s.hidden]),
            xn=buf("xn", [p, s.hidden]),
            q=buf("q", [p, s.heads, s.head_dim]),
            k=buf("k", [p, s.kv_heads, s.head_dim]),
            v=buf("v", [p, s.kv_heads, s.head_dim]),
            attn=buf("attn", [p, s.heads, s.head_dim], self._attention_output_dtype()),
            o=buf("o", [p, s.hidden]),
            gate=buf("gate", [p, s.ffn]),
            up=buf("up", [p, s.ffn]),
            act=buf("act", [p, s.ffn]),
            last_index=buf("last_index", [b], mf.DTYPE_I32),
            last_h=buf("last_h", [b, s.hidden]),
            logits=buf("logits", [b, s.vocab]),
            all_logits=buf("all_logits", [max(max(c.prefill_tokens), c.speculative_packed), s.vocab]),
            ids=buf("ids", [b, 1], mf.DTYPE_I32),
            sampled_ids=buf("sampled_ids", [b, 1], mf.DTYPE_I32) if c.widest_speculation > 1 else None,
            sampled_logprob=buf("sampled_logprob", [b, 1]) if c.widest_speculation > 1 else None,
        )

    def _attention_output_dtype(self) -> int:
        """The type attention writes its rows in: bf16 in a kernel graph over bf16 weights, whose output
        projection is their only reader and rounds them to bf16 for its tensor-core products anyway (it then
        reads half the bytes, and no launch rounds them first; the FMA kernels of one or two rows read the
        same rounded rows); float32 in operator graphs and over float32 weights."""
        return mf.DTYPE_BF16 if self.fused and self.bf16 else mf.DTYPE_F32

    def _declare_speculative_scratch(self) -> _SpeculativeScratch:
        c = self.caps
        b, widest = c.max_rows, c.widest_speculation

        def buf(name: str, shape: Sequence[int], dtype: int = mf.DTYPE_I32) -> View:
            return self.builder.buffer(f"scratch.speculative.{name}", mf.BUFFER_ROLE_SCRATCH, dtype, shape)

        return _SpeculativeScratch(
            ids=buf("ids", [c.speculative_packed]),
            verify_ids=buf("verify_ids", [b * widest]),
            verify_logprob=buf("verify_logprob", [b * widest], mf.DTYPE_F32),
            accepted=buf("accepted", [b]),
            emitted=buf("emitted", [b]),
            pending=buf("pending", [b, 1]),
        )

    def _declare_self_draft_scratch(self) -> _SelfDraftScratch:
        c = self.caps
        b, draws, p = c.max_rows, c.draft_capacity, c.speculative_packed

        def buf(name: str, shape: Sequence[int], dtype: int = mf.DTYPE_I32) -> View:
            return self.builder.buffer(f"scratch.self_draft.{name}", mf.BUFFER_ROLE_SCRATCH, dtype, shape)

        return _SelfDraftScratch(
            step_ids=buf("step_ids", [max(draws, 1) * b]),
            step_confidence=buf("step_confidence", [max(draws, 1) * b], mf.DTYPE_F32),
            candidate_ids=buf("candidate_ids", [b * max(c.widest_speculation - 1, 1)]),
            confidence=buf("confidence", [b * max(draws, 1)], mf.DTYPE_F32),
            step_positions=buf("step_positions", [b]),
            step_token_rows=buf("step_token_rows", [b]),
            step_cache_slots=buf("step_cache_slots", [b], mf.DTYPE_I64),
            query_length=buf("query_length", [b]),
            positions=buf("positions", [p]),
            token_rows=buf("token_rows", [p]),
            cache_slots=buf("cache_slots", [p], mf.DTYPE_I64),
            draft_probabilities=(
                buf("draft_probabilities", [b * max(draws, 1), self.shape.vocab], mf.DTYPE_F32)
                if c.draft_sampling == "sampled"
                else None
            ),
        )

    # -- dataflow --------------------------------------------------------------
    def _rope_attributes(self) -> dict[str, float | str | list[float]]:
        s = self.shape
        attrs: dict[str, float | str | list[float]] = {"theta": s.rope_theta, "style": s.rope_style}
        if s.frequency_band_scaling is not None:
            attrs["frequency_band_scaling"] = [float(x) for x in s.frequency_band_scaling]
        return attrs

    def _host_layout(self) -> _TokenLayout:
        sh = self.shared
        return _TokenLayout(positions=sh.positions, token_rows=sh.token_rows, cache_slots=sh.cache_slots)

    def _attention(
        self,
        prog: ProgramBuilder,
        layer: int,
        rows: int,
        tokens: int,
        q: View,
        attn: View,
        layout: _TokenLayout | None = None,
        label: str = "",
    ) -> None:
        s, sh = self.shape, self.shared
        where = layout or self._host_layout()
        attributes: dict[str, float | int] = {"scale": float(s.head_dim) ** -0.5}
        if self.caps.window:
            attributes["window"] = self.caps.window
        prog.node(
            "paged_attention",
            {
                "q": q,
                "k_plane": self.k_planes[layer],
                "v_plane": self.v_planes[layer],
                "page_table": prefix(sh.page_table, rows),
                "token_row": prefix(where.token_rows, tokens),
                "token_position": prefix(where.positions, tokens),
                "out": attn,
            },
            attributes,
            name=f"{label}l{layer}.attention",
        )

    def _embed(self, prog: ProgramBuilder, ids: View, h: View, label: str) -> None:
        """The decoder's input rows: the token embedding of ``ids`` into the residual stream ``h`` (a
        recipe whose inputs are more than token ids adds its own rows here)."""
        prog.node("embedding", {"table": self.tok_embd, "ids": ids, "out": h}, name=f"{label}embedding")
        if self.engram is not None:
            add_engram(prog, self.engram, h, label)

    def _fused_decoder(
        self,
        prog: ProgramBuilder,
        rows: int,
        tokens: int,
        ids: View,
        layout: _TokenLayout | None = None,
        layers: int | None = None,
        label: str = "",
    ) -> None:
        """The kernel graph of every layer: four nodes, the residual stream updated in place.

        rmsnorm + [q|k|v] projection + rope + cache write, attention, output projection + residual,
        rmsnorm + [gate|up] projection + SwiGLU + down projection + residual.
        """
        s, sc = self.shape, self.scratch
        where = layout or self._host_layout()
        p = tokens
        h = prefix(sc.h, p)
        q = prefix(sc.q, p)
        attn2 = View(sc.attn.buffer, (p, s.heads * s.head_dim))
        self._embed(prog, ids, h, label)
        for layer, lw in enumerate(self.layer_weights[:layers]):
            prog.node(
                "rmsnorm_linear_rope_kv_cache_write",
                {
                    "x": h,
                    "norm_weight": lw["attn_norm"],
                    "weight": lw["wqkv"],
                    "positions": prefix(where.positions, p),
                    "slots": prefix(where.cache_slots, p),
                    "q": q,
                    "k_plane": self.k_planes[layer],
                    "v_plane": self.v_planes[layer],
                },
                {"eps": s.rms_eps, **self._rope_attributes()},
                name=f"{label}l{layer}.attention_input",
            )
            self._attention(prog, layer, rows, p, q, View(sc.attn.buffer, (p, s.heads, s.head_dim)), where, label)
            if self.tensor_parallel:
                self._fused_rank_tail(prog, layer, p, label)
                continue
            self._fused_residual_tail(prog, layer, h, attn2, label, all_reduce=False)

    def _fused_residual_tail(
        self, prog: ProgramBuilder, layer: int, h: View, attn2: View, label: str, *, all_reduce: bool
    ) -> None:
        """A kernel graph's layer after attention: output projection + residual, then the MLP (RMSNorm,
        [gate|up] projection, SwiGLU, down projection) + residual; with ``all_reduce``, each residual add is
        followed by an in-place ``all_reduce`` of the residual stream ``h`` (an identity on one rank)."""
        lw = self.layer_weights[layer]
        prog.node(
            "linear_add",
            {"x": attn2, "weight": lw["wo"], "residual": h, "out": h},
            name=f"{label}l{layer}.o_residual",
        )
        if all_reduce:
            self._all_reduce(prog, h, f"{label}l{layer}.o_all_reduce")
        self._mlp(prog, layer, h, h, h, f"{label}l{layer}.mlp_residual")
        if all_reduce:
            self._all_reduce(prog, h, f"{label}l{layer}.down_all_reduce")

    def _mlp(self, prog: ProgramBuilder, layer: int, x: View, residual: View, out: View, name: str) -> None:
        """``out = residual + down(silu(gate(xn)) * up(xn))`` with ``xn`` the FFN norm of ``x``: one node."""
        lw = self.layer_weights[layer]
        prog.node(
            "rmsnorm_swiglu_mlp_add",
            {
                "x": x,
                "norm_weight": lw["ffn_norm"],
                "gate_up_weight": lw["w_gate_up"],
                "down_weight": lw["w_down"],
                "residual": residual,
                "out": out,
            },
            {"eps": self.shape.rms_eps},
            name=name,
        )

    def _fused_rank_tail(self, prog: ProgramBuilder, layer: int, tokens: int, label: str) -> None:
        """A tensor-parallel kernel graph's layer after attention: the output projection's partial
        product, ``all_reduce``, residual add; the MLP's partial product over this rank's [gate | up] and
        down shards (``rmsnorm_swiglu_mlp_add`` over the zero residual), ``all_reduce``, residual add. With
        one rank, the fused residual kernels followed by an in-place ``all_reduce`` of the residual stream."""
        s, sc, lw = self.shape, self.scratch, self.layer_weights[layer]
        if self.zero_residual is None:
            raise ValueError("the tensor-parallel kernel graph needs the zero residual")
        p = tokens
        h, o = prefix(sc.h, p), prefix(sc.o, p)
        attn2 = View(sc.attn.buffer, (p, s.heads * s.head_dim))
        if self.tensor_parallel == 1:
            # One rank: the sum over the ranks of (residual + partial product) is residual + partial product,
            # so the fused residual kernels of the single-rank graph stay and each all_reduce sums the residual
            # stream in place (an identity on one rank): the core differs from a core without collectives by
            # its collectives alone.
            self._fused_residual_tail(prog, layer, h, attn2, label, all_reduce=True)
            return
        prog.node("linear", {"x": attn2, "weight": lw["wo"], "out": o}, name=f"{label}l{layer}.o")
        self._all_reduce(prog, o, f"{label}l{layer}.o_all_reduce")
        prog.node("add", {"a": h, "b": o, "out": h}, name=f"{label}l{layer}.attn_residual")
        self._mlp(prog, layer, h, prefix(self.zero_residual, p), o, f"{label}l{layer}.mlp")
        self._all_reduce(prog, o, f"{label}l{layer}.down_all_reduce")
        prog.node("add", {"a": h, "b": o, "out": h}, name=f"{label}l{layer}.ffn_residual")

    @staticmethod
    def _all_reduce(prog: ProgramBuilder, partial: View, name: str) -> None:
        """Sum ``partial`` over the ranks, in place (every rank then holds the whole product)."""
        prog.node("all_reduce", {"x": partial, "out": partial}, name=name)

    def _decoder(
        self,
        prog: ProgramBuilder,
        rows: int,
        tokens: int,
        ids: View,
        layout: _TokenLayout | None = None,
        layers: int | None = None,
        label: str = "",
    ) -> None:
        """Embedding and the first ``layers`` layers (all by default) over ``tokens`` packed tokens of
        ``rows`` lanes, reading positions, lane rows and cache slots from ``layout`` (the host-fed
        transport entries by default); node names start with ``label``."""
        if self.fused:
            self._fused_decoder(prog, rows, tokens, ids, layout, layers, label)
            return
        s, sc = self.shape, self.scratch
        where = layout or self._host_layout()
        p = tokens
        h = prefix(sc.h, p)
        xn = prefix(sc.xn, p)
        q = prefix(sc.q, p)
        k = prefix(sc.k, p)
        v = prefix(sc.v, p)
        attn = prefix(sc.attn, p)
        q2 = View(q.buffer, (p, s.heads * s.head_dim))
        k2 = View(k.buffer, (p, s.kv_heads * s.head_dim))
        v2 = View(v.buffer, (p, s.kv_heads * s.head_dim))
        positions = prefix(where.positions, p)
        rope_attrs = self._rope_attributes()
        self._embed(prog, ids, h, label)
        for layer, lw in enumerate(self.layer_weights[:layers]):
            prog.node(
                "rmsnorm",
                {"x": h, "weight": lw["attn_norm"], "out": xn},
                {"eps": s.rms_eps},
                name=f"{label}l{layer}.attn_norm",
            )
            prog.node("linear", {"x": xn, "weight": lw["wq"], "out": q2}, name=f"{label}l{layer}.q")
            prog.node("linear", {"x": xn, "weight": lw["wk"], "out": k2}, name=f"{label}l{layer}.k")
            prog.node("linear", {"x": xn, "weight": lw["wv"], "out": v2}, name=f"{label}l{layer}.v")
            prog.node("rope", {"x": q, "positions": positions, "out": q}, rope_attrs, name=f"{label}l{layer}.rope_q")
            prog.node("rope", {"x": k, "positions": positions, "out": k}, rope_attrs, name=f"{label}l{layer}.rope_k")
            prog.node(
                "kv_cache_write",
                {
                    "k": k,
                    "v": v,
                    "slots": prefix(where.cache_slots, p),
                    "k_plane": self.k_planes[layer],
                    "v_plane": self.v_planes[layer],
                },
                name=f"{label}l{layer}.cache_write",
            )
            self._attention(prog, layer, rows, p, q, attn, where, label)
            self._output_and_feed_forward(prog, layer, p, label)

    def _output_and_feed_forward(self, prog: ProgramBuilder, layer: int, tokens: int, label: str) -> None:
        """The rest of layer ``layer`` once attention has written ``scratch.attn``: output projection and
        residual, then RMSNorm, the SwiGLU feed-forward and its residual (operator graphs)."""
        s, sc, lw = self.shape, self.scratch, self.layer_weights[layer]
        p = tokens
        h, xn, o = prefix(sc.h, p), prefix(sc.xn, p), prefix(sc.o, p)
        gate, up, act = prefix(sc.gate, p), prefix(sc.up, p), prefix(sc.act, p)
        attn2 = View(sc.attn.buffer, (p, s.heads * s.head_dim))
        prog.node("linear", {"x": attn2, "weight": lw["wo"], "out": o}, name=f"{label}l{layer}.o")
        if self.tensor_parallel:
            self._all_reduce(prog, o, f"{label}l{layer}.o_all_reduce")
        prog.node("add", {"a": h, "b": o, "out": h}, name=f"{label}l{layer}.attn_residual")
        prog.node(
            "rmsnorm",
            {"x": h, "weight": lw["ffn_norm"], "out": xn},
            {"eps": s.rms_eps},
            name=f"{label}l{layer}.ffn_norm",
        )
        prog.node("linear", {"x": xn, "weight": lw["w_gate"], "out": gate}, name=f"{label}l{layer}.gate")
        prog.node("linear", {"x": xn, "weight": lw["w_up"], "out": up}, name=f"{label}l{layer}.up")
        prog.node("silu_mul", {"gate": gate, "up": up, "out": act}, name=f"{label}l{layer}.silu_mul")
        prog.node("linear", {"x": act, "weight": lw["w_down"], "out": o}, name=f"{label}l{layer}.down")
        if self.tensor_parallel:
            self._all_reduce(prog, o, f"{label}l{layer}.down_all_reduce")
        prog.node("add", {"a": h, "b": o, "out": h}, name=f"{label}l{layer}.ffn_residual")

    # -- programs --------------------------------------------------------------
    def write(self) -> list[ct.GraphContract]:
        """Write every program; returns their graph contracts."""
        graphs = self._write_generating_programs()
        if self.speculative is not None:
            graphs.extend(self._speculative_programs(self.speculative))
        if self.self_draft is not None:
            graphs.extend(self._self_draft_programs(self.self_draft))
        if self.snapshots is not None:
            graphs.extend(self._snapshot_programs(self.snapshots))
        return graphs

    def _speculative_programs(self, spec: decl.SpeculativeViews) -> list[ct.GraphContract]:
        """``speculative_w{W}_b{B}``: verify copied proposals, W tokens a lane, for each decode B.

        Each lane's packed block is its device-owned pending token and then its copied candidates
        (QUERY_LENGTH, chosen by the host, says how many); the decoder runs over all P = B x W packed
        tokens (causal within each lane's block), the LM head over every packed row, and
        ``sample_verify`` samples each lane's positions in order while they match its candidates, a
        constrained lane's position j under its grammar mask row (``candidate_grammar_mask``,
        CANDIDATE_GRAMMAR_MASKS: one row a packed token, -1 padding; CONSTRAINED says which lanes).
        The last emitted token becomes the pending token. A width-one program has no candidate inputs: its
        ``candidate_ids`` argument is an empty [B, 0] view.
        """
        graphs: list[ct.GraphContract] = []
        for rows in self.caps.decode_rows:
            for width in self.caps.speculative_widths:
                name = f"speculative_w{width}_b{rows}"
                prog = ProgramBuilder(name, ct.OPERATION_SPECULATIVE)
                self._speculative_body(prog, spec, rows, width)
                self.builder.add_program(prog)
                bindings = (
                    decl.lane_bindings()
                    + decl.packed_token_bindings(host_tokens=False)
                    + decl.sampling_bindings()
                    + decl.speculative_bindings(width)
                )
                graph = self._graph(
                    name,
                    ct.OPERATION_SPECULATIVE,
                    rows,
                    rows * width,
                    bindings,
                    decl.sampling_state_accesses(),
                    pending=True,
                )
                graph.extents.token_capacity = width
                graph.extents.verify_tokens = width
                graph.extents.draft_tokens = width - 1
                graph.confidence_width = 0
                graph.cursor.reports_draft_cursor = False
                del graph.rng_reservations[:]
                graph.rng_reservations.extend(decl.target_rng(draws_per_row=width))
                graph.logprobs.top_n = 0
                graphs.append(graph)
        return graphs

    def _speculative_body(self, prog: ProgramBuilder, spec: decl.SpeculativeViews, rows: int, width: int) -> None:
        sh, sc = self.shared, self.scratch
        sp = self.speculative_scratch
        if sp is None:
            raise ValueError("speculative programs need the speculative scratch buffers")
        r, p = rows, rows * width
        widest = self.caps.widest_speculation
        packed_ids = prefix(sp.ids, p)  # [P]
        candidates = prefix(spec.candidate_ids[width], r) if width > 1 else View(sp.accepted.buffer, (r, 0))
        query_length = prefix(sh.query_length, r)
        state_rows = prefix(sh.state_rows, r)
        prog.node(
            "speculative_inputs",
            {
                "pending_tokens": sh.pending_tokens,
                "rows": state_rows,
                "candidate_ids": candidates,
                "query_length": query_length,
                "ids": packed_ids,
            },
        )
        self._decoder(prog, r, p, packed_ids)
        logits = prefix(sc.all_logits, p)  # [P, V]: every packed row is verified
        self._head(prog, p, logits, "")
        # The widest program writes the record directly; a narrower one through scratch (see _into_record).
        if width == widest:
            ids, logprob = prefix(sh.out_sampled_ids, r), prefix(sh.out_logprobs, r)
        else:
            ids, logprob = View(sp.verify_ids.buffer, (r, width)), View(sp.verify_logprob.buffer, (r, width))
        pending = prefix(sp.pending, r)  # [B, 1]
        prog.node(
            "sample_verify",
            {
                "logits": logits,
                "query_length": query_length,
                "candidate_ids": candidates,
                **self._sampling_inputs(r, state_rows),
                "allowed_mask": prefix(spec.candidate_grammar_mask, p),
                "constrained": prefix(sh.constrained, r),
                "ids": ids,
                "accepted": prefix(sp.accepted, r),
                "emitted": prefix(sp.emitted, r),
                "pending": View(pending.buffer, (r,)),
                "logprob": logprob,
            },
            {"vocab_limit": self.sampled_size},
        )
        if width < widest:
            self._into_record(prog, ids, sh.out_sampled_ids, "record_ids")
            self._into_record(prog, logprob, sh.out_logprobs, "record_logprobs")
        prog.node(
            "copy_rows",
            {"src": pending, "dst_rows": state_rows, "when": prefix(sh.sample_active, r), "dst": sh.pending_tokens},
            name="store_pending_token",
        )
        prog.node(
            "completion_speculative",
            {
                "generation": prefix(sh.generation, r),
                "query_length": query_length,
                "accepted": prefix(sp.accepted, r),
                "emitted": prefix(sp.emitted, r),
                "positions": prefix(sh.positions, p),
                "submission_sequence": sh.submission_sequence,
                "out_generation": prefix(sh.out_generation, r),
                "out_offers": prefix(spec.out_offers, r),
                "out_accepted": prefix(spec.out_accepted, r),
                "out_emitted": prefix(sh.out_emitted, r),
                "out_consumed": prefix(sh.out_consumed, r),
                "out_draft_cursor": prefix(sh.out_draft_cursor, r),
                "out_reserved": prefix(sh.out_reserved, r),
                "out_sequence": sh.out_sequence,
            },
        )

    def _self_draft_programs(self, views: decl.SelfDraftViews) -> list[ct.GraphContract]:
        """``selfdraft_w{W}_b{B}``: draft in the graph, allocate prefixes by confidence, verify, commit.

        The target's first K layers (shared final norm and head) draft D tokens, one step a token:
        greedily (``draft_argmax``), or with ``--draft-sampling sampled`` drawn from the draft's
        distribution (``draft_sample``); ``draft_allocate`` turns their confidences and the host's
        ceilings (SPECULATIVE_PREFIX_LIMIT, the only length source) into lane lengths within P;
        ``speculative_layout`` places them; the full decoder verifies every packed row and
        ``sample_verify`` samples them as plain decode would (``sample_verify_sampled`` accepts a sampled
        draft's tokens by speculative sampling, so the emitted tokens follow the target's distribution
        exactly). Positions and cache slots are computed
        on the device from the consumed endpoints and page tables. A tensor-parallel program that draws
        proposals broadcasts rank 0's confidences right before ``draft_allocate``
        (:data:`CONFIDENCE_BROADCAST`, :meth:`_broadcast_confidence`), so every rank allocates the same
        prefixes; history programs (``speculative_w{W}_b{B}``) take their lane lengths from the host, the
        same staged values on every rank.
        """
        caps = self.caps
        graphs: list[ct.GraphContract] = []
        for rows in caps.decode_rows:
            for width in caps.speculative_widths:
                name = f"selfdraft_w{width}_b{rows}"
                draws = self_draft_draws(width, caps.draft_tokens)
                packed = self_draft_packed(rows, width, caps.proposal_budget)
                prog = ProgramBuilder(name, ct.OPERATION_SPECULATIVE)
                self._self_draft_body(prog, views, rows, width, draws, packed)
                self.builder.add_program(prog)
                graph = self._graph(
                    name,
                    ct.OPERATION_SPECULATIVE,
                    rows,
                    packed,
                    decl.self_draft_bindings() + decl.sampling_bindings(),
                    decl.sampling_state_accesses(),
                    pending=True,
                )
                graph.extents.token_capacity = width
                graph.extents.verify_tokens = width
                graph.extents.draft_tokens = draws
                graph.extents.draft_capacity = caps.draft_capacity
                graph.confidence_width = draws
                graph.cursor.reports_draft_cursor = True
                graph.cursor.lag_tokens = 0
                del graph.rng_reservations[:]
                if caps.draft_sampling == "sampled":
                    graph.rng_reservations.extend(decl.sampled_self_draft_rng(width, draws))
                else:
                    graph.rng_reservations.extend(decl.self_draft_rng(width))
                graph.logprobs.top_n = 0
                graphs.append(graph)
        return graphs

    def _head(self, prog: ProgramBuilder, tokens: int, logits: View, label: str) -> None:
        """The final norm and LM head over the first ``tokens`` rows of the residual stream."""
        self._norm_and_head(prog, tokens, logits, f"{label}final_norm", f"{label}lm_head")

    def _draft_choice(
        self, prog: ProgramBuilder, rows: int, draws: int, index: int, logits: View, token_rows: View, label: str
    ) -> None:
        """Draft step ``index``'s token choice: ``draft_argmax`` (greedy), or ``draft_sample`` drawing from the
        draft's distribution with the request's settings and proposal stream, its row of q kept in
        ``draft_probabilities`` for verification (``--draft-sampling sampled``)."""
        sh, sd = self.shared, self.self_draft_scratch
        if sd is None:
            raise ValueError("self-drafting programs need the self-draft scratch buffers")
        r = rows
        outputs = {
            "logits": logits,
            "token_rows": token_rows,
            "ids": View(sd.step_ids.buffer, (r,), index * r),
            "confidence": View(sd.step_confidence.buffer, (r,), index * r),
        }
        if sd.draft_probabilities is None:
            prog.node("draft_argmax", outputs, {"vocab_limit": self.sampled_size}, name=f"{label}choose")
            return
        settings = {name: prefix(getattr(sh, name), r) for name in ("temperature", "top_k", "top_p", "min_p", "seed")}
        prog.node(
            "draft_sample",
            {
                **outputs,
                **settings,
                "step": prefix(sh.sampling_step, r),
                "draft_probabilities": View(sd.draft_probabilities.buffer, (r, draws, self.shape.vocab)),
            },
            {"vocab_limit": self.sampled_size, "draft_index": index},
            name=f"{label}choose",
        )

    def _verifier(self, rows: int, draws: int) -> tuple[str, dict[str, View]]:
        """The verifying operator of a self-drafting program and its draft-specific arguments:
        ``sample_verify_sampled`` with the drafted distributions for a sampled draft that drafts,
        ``sample_verify`` otherwise (a greedy draft, or width one: nothing to verify but the bonus)."""
        sd = self.self_draft_scratch
        if sd is None or sd.draft_probabilities is None or not draws:
            return "sample_verify", {}
        view = View(sd.draft_probabilities.buffer, (rows, draws, self.shape.vocab))
        return "sample_verify_sampled", {"draft_probabilities": view}

    @staticmethod
    def _broadcast_confidence(prog: ProgramBuilder, confidence: View) -> None:
        """Give every tensor-parallel rank rank 0's draft confidences, in place, right before
        ``draft_allocate`` reads them.

        Every rank computes the draft's logits from the same all-reduced sums, but a collective's
        floating-point sum may differ between ranks in its last bits where the reduction order does (a
        device collective need not add in rank order on every rank), and a confidence that differs in its
        last bit can change which frontier the allocation admits. Ranks that allocate differently lay out,
        verify and commit different rows, and rank agreement then rejects the whole cohort. Broadcasting
        rank 0's confidences makes the allocation identical on every rank by construction, whatever the
        reductions did (``docs/ignition.md``, "Tensor-parallel speculation")."""
        prog.node("broadcast", {"x": confidence, "out": confidence}, {"root": 0}, name=CONFIDENCE_BROADCAST)

    def _self_draft_body(
        self, prog: ProgramBuilder, views: decl.SelfDraftViews, rows: int, width: int, draws: int, packed: int
    ) -> None:
        sh, sc = self.shared, self.scratch
        sp, sd = self.speculative_scratch, self.self_draft_scratch
        if sp is None or sd is None:
            raise ValueError("self-drafting programs need the speculative and self-draft scratch buffers")
        r, p = rows, packed
        widest = self.caps.widest_speculation
        page_tokens = self.caps.page_tokens
        state_rows = prefix(sh.state_rows, r)
        ceilings = prefix(views.prefix_limit, r)
        consumed = prefix(views.consumed, r)
        page_table = prefix(sh.page_table, r)
        confidence = View(sd.confidence.buffer, (r, draws))  # [B, D] lane-major
        candidates = View(sd.candidate_ids.buffer, (r, width - 1))  # [B, W - 1]: the proposals verified
        query_length = prefix(sd.query_length, r)
        if draws:
            pending_ids = prefix(sc.ids, r)  # [B, 1]
            prog.node(
                "gather_rows",
                {"x": sh.pending_tokens, "index": state_rows, "out": pending_ids},
                name="load_pending_token",
            )
            step = _TokenLayout(
                positions=prefix(sd.step_positions, r),
                token_rows=prefix(sd.step_token_rows, r),
                cache_slots=prefix(sd.step_cache_slots, r),
            )
            logits = prefix(sc.logits, r)  # [B, V]
            for i in range(draws):
                label = f"draft{i}."
                fed = View(pending_ids.buffer, (r,)) if i == 0 else View(sd.step_ids.buffer, (r,), (i - 1) * r)
                prog.node(
                    "lane_positions",
                    {
                        "consumed": consumed,
                        "page_table": page_table,
                        "limit": ceilings,
                        "positions": step.positions,
                        "token_rows": step.token_rows,
                        "cache_slots": step.cache_slots,
                    },
                    {"offset": i, "page_tokens": page_tokens},
                    name=f"{label}positions",
                )
                self._decoder(prog, r, r, fed, step, self.draft_layers, label)
                self._head(prog, r, logits, label)
                self._draft_choice(prog, r, draws, i, logits, step.token_rows, label)
            prog.node(
                "copy_rows",
                {
                    "src": View(sd.step_confidence.buffer, (draws * r, 1)),
                    "dst_rows": self._draft_table(r, draws, draws),
                    "dst": View(sd.confidence.buffer, (r * draws, 1)),
                },
                name="draft_confidence",
            )
            prog.node(
                "copy_rows",
                {
                    "src": View(sd.step_ids.buffer, (draws * r, 1)),
                    "dst_rows": self._draft_table(r, draws, width - 1),
                    "dst": View(sd.candidate_ids.buffer, (r * (width - 1), 1)),
                },
                name="draft_candidates",
            )
            if self.tensor_parallel:
                self._broadcast_confidence(prog, confidence)
        prog.node(
            "draft_allocate",
            {"confidence": confidence, "ceilings": ceilings, "query_length": query_length},
            {"packed_capacity": p, "token_capacity": width},
        )
        verify = _TokenLayout(
            positions=prefix(sd.positions, p),
            token_rows=prefix(sd.token_rows, p),
            cache_slots=prefix(sd.cache_slots, p),
        )
        prog.node(
            "speculative_layout",
            {
                "query_length": query_length,
                "consumed": consumed,
                "page_table": page_table,
                "positions": verify.positions,
                "token_rows": verify.token_rows,
                "cache_slots": verify.cache_slots,
            },
            {"page_tokens": page_tokens},
        )
        packed_ids = prefix(sp.ids, p)
        prog.node(
            "speculative_inputs",
            {
                "pending_tokens": sh.pending_tokens,
                "rows": state_rows,
                "candidate_ids": candidates,
                "query_length": query_length,
                "ids": packed_ids,
            },
        )
        self._decoder(prog, r, p, packed_ids, verify)
        all_logits = prefix(sc.all_logits, p)  # [P, V]: every packed row is verified
        self._head(prog, p, all_logits, "")
        if width == widest:
            ids, logprob = prefix(sh.out_sampled_ids, r), prefix(sh.out_logprobs, r)
        else:
            ids, logprob = View(sp.verify_ids.buffer, (r, width)), View(sp.verify_logprob.buffer, (r, width))
        pending = prefix(sp.pending, r)  # [B, 1]
        verifier, drafted = self._verifier(r, draws)
        prog.node(
            verifier,
            {
                "logits": all_logits,
                "query_length": query_length,
                "candidate_ids": candidates,
                **drafted,
                **self._sampling_inputs(r, state_rows),
                "ids": ids,
                "accepted": prefix(sp.accepted, r),
                "emitted": prefix(sp.emitted, r),
                "pending": View(pending.buffer, (r,)),
                "logprob": logprob,
            },
            {"vocab_limit": self.sampled_size},
        )
        if width < widest:
            self._into_record(prog, ids, sh.out_sampled_ids, "record_ids")
            self._into_record(prog, logprob, sh.out_logprobs, "record_logprobs")
        prog.node(
            "copy_rows",
            {"src": pending, "dst_rows": state_rows, "when": prefix(sh.sample_active, r), "dst": sh.pending_tokens},
            name="store_pending_token",
        )
        record = {
            "generation": prefix(sh.generation, r),
            "query_length": query_length,
            "accepted": prefix(sp.accepted, r),
            "emitted": prefix(sp.emitted, r),
            "consumed": consumed,
            "submission_sequence": sh.submission_sequence,
            "out_generation": prefix(sh.out_generation, r),
            "out_offers": prefix(views.out_offers, r),
            "out_accepted": prefix(views.out_accepted, r),
            "out_emitted": prefix(sh.out_emitted, r),
            "out_consumed": prefix(sh.out_consumed, r),
            "out_draft_cursor": prefix(sh.out_draft_cursor, r),
            "out_reserved": prefix(sh.out_reserved, r),
            "out_sequence": sh.out_sequence,
        }
        if draws:
            record.update(
                confidence=confidence, frame_index=views.frame_index, out_confidence=views.proposal_confidence
            )
        prog.node("completion_self_draft", record, {"lag_tokens": 0})

    def _snapshot_programs(self, snap: decl.SnapshotViews) -> list[ct.GraphContract]:
        """``snapshot`` and ``restore``: one request per round, no sampling."""
        sh = self.shared
        tail = self.tail_page
        state_row = prefix(sh.state_rows, 1)
        consumed = prefix(snap.consumed, 1)
        state_copies = (
            ("pending_tokens", sh.pending_tokens, snap.pending_tokens),
            ("prompt_presence", sh.prompt_presence, snap.prompt_presence),
            ("output_counts", sh.output_counts, snap.output_counts),
        )
        planes = [
            (f"{kind}{layer}", plane, rows)
            for layer in range(self.shape.layers)
            for kind, plane, rows in (
                ("k", self.k_planes[layer], self.continuation_k[layer]),
                ("v", self.v_planes[layer], self.continuation_v[layer]),
            )
        ]
        graphs: list[ct.GraphContract] = []
        for name, operation, bindings, accesses in (
            ("snapshot", ct.OPERATION_SNAPSHOT, decl.snapshot_bindings(), decl.snapshot_state_accesses()),
            ("restore", ct.OPERATION_RESTORE, decl.restore_bindings(), decl.restore_state_accesses()),
        ):
            prog = ProgramBuilder(name, operation)
            # The page holding the endpoint's partial page (-1 when the endpoint ends a page: then
            # every copy below skips it, and complete pages stay shared in the cache).
            prog.node(
                "tail_page",
                {"page_table": prefix(sh.page_table, 1), "consumed": consumed, "out": tail},
                {"page_tokens": self.caps.page_tokens},
            )
            if operation == ct.OPERATION_SNAPSHOT:
                rows = snap.snapshot_rows
                for label, plane, continuation in planes:
                    prog.node(
                        "copy_rows",
                        {"src": plane, "src_rows": tail, "dst_rows": rows, "dst": continuation},
                        name=f"save_{label}",
                    )
                for label, live, saved in state_copies:
                    prog.node(
                        "copy_rows",
                        {"src": live, "src_rows": state_row, "dst_rows": rows, "dst": saved},
                        name=f"save_{label}",
                    )
            else:
                rows = snap.restore_rows
                for label, plane, continuation in planes:
                    prog.node(
                        "copy_rows",
                        {"src": continuation, "src_rows": rows, "dst_rows": tail, "dst": plane},
                        name=f"restore_{label}",
                    )
                for label, live, saved in state_copies:
                    prog.node(
                        "copy_rows",
                        {"src": saved, "src_rows": rows, "dst_rows": state_row, "dst": live},
                        name=f"restore_{label}",
                    )
            self._completion_copy_lanes(prog, consumed)
            self.builder.add_program(prog)
            graphs.append(self._graph(name, operation, 1, 1, bindings, accesses, generating=False))
        return graphs
