"""The versioned op catalogue: which operators exist and what a node must give them.

Owns the *names, versions and signatures* of operators. Backends own their
implementations (the reference backend's numpy functions are the semantic
definition). A core naming an operator or version missing here fails startup.
Documented operator by operator in ``docs/ops.md``. The ``sample`` operator's per-request inputs
come from the sampling parameter declaration (:data:`helios_core.sampling.SAMPLING_PARAMETERS`),
the only part of Helios the catalogue reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from helios_core.sampling import SAMPLING_PARAMETERS, SamplingParameter


@dataclass(frozen=True)
class OperatorSpec:
    """The signature of one operator version."""

    name: str
    version: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    optional_attributes: tuple[str, ...] = ()
    summary: str = ""
    updated_inputs: tuple[str, ...] = ()
    """Inputs the operator also writes (updated in place)."""

    @property
    def tensor_args(self) -> frozenset[str]:
        """Every tensor argument name a node may give."""
        return frozenset(self.inputs + self.outputs + self.optional_inputs)

    @property
    def written_args(self) -> frozenset[str]:
        """Every argument whose buffer a node may write: outputs, updated inputs, and the optional
        arguments (some of which are outputs)."""
        return frozenset(self.outputs + self.updated_inputs + self.optional_inputs)


def sample_inputs(parameters: Iterable[SamplingParameter] = SAMPLING_PARAMETERS) -> tuple[str, ...]:
    """The ``sample`` operator's inputs: the logits, each per-request setting's kernel input (declaration
    order), the sampling state and its rows, then the seed inputs, the step and the active flags."""
    declared = tuple(parameters)
    settings = tuple(p.kernel_input for p in declared if p.kind != "seed")
    seeds = tuple(p.kernel_input for p in declared if p.kind == "seed")
    return ("logits", *settings, "prompt_presence", "output_counts", "rows", *seeds, "step", "active")


def _spec(
    name: str,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    summary: str,
    *,
    optional_inputs: tuple[str, ...] = (),
    attributes: tuple[str, ...] = (),
    optional_attributes: tuple[str, ...] = (),
    updated_inputs: tuple[str, ...] = (),
    version: int = 1,
) -> OperatorSpec:
    return OperatorSpec(
        name=name,
        version=version,
        inputs=inputs,
        outputs=outputs,
        optional_inputs=optional_inputs,
        attributes=attributes,
        optional_attributes=optional_attributes,
        summary=summary,
        updated_inputs=updated_inputs,
    )


_SPECS: Final[tuple[OperatorSpec, ...]] = (
    _spec("embedding", ("table", "ids"), ("out",), "Gather rows of an embedding table."),
    _spec("rmsnorm", ("x", "weight"), ("out",), "Root-mean-square normalisation.", attributes=("eps",)),
    _spec("linear", ("x", "weight"), ("out",), "x @ weight.T with [out, in] weights; row independent."),
    _spec(
        "rope",
        ("x", "positions"),
        ("out",),
        "Rotary position embedding (interleaved or half pairs; optional frequency-band scaling).",
        attributes=("theta", "style"),
        optional_attributes=("frequency_band_scaling",),
    ),
    _spec(
        "kv_cache_write",
        ("k", "v", "slots"),
        ("k_plane", "v_plane"),
        "Write keys and values of packed tokens into paged cache planes.",
    ),
    _spec(
        "paged_attention",
        ("q", "k_plane", "v_plane", "page_table", "token_row", "token_position"),
        ("out",),
        "Causal grouped-query attention over paged cache planes (optionally limited to a sliding window).",
        attributes=("scale",),
        optional_attributes=("window",),
    ),
    _spec("silu_mul", ("gate", "up"), ("out",), "silu(gate) * up."),
    _spec(
        "rmsnorm_linear",
        ("x", "norm_weight", "weight"),
        ("out",),
        "linear(rmsnorm(x, norm_weight, eps), weight): the normalised rows never leave the kernel.",
        attributes=("eps",),
    ),
    _spec(
        "linear_add",
        ("x", "weight", "residual"),
        ("out",),
        "residual + linear(x, weight) (out may be residual itself: a residual stream update).",
    ),
    _spec(
        "silu_mul_linear_add",
        ("gate_up", "weight", "residual"),
        ("out",),
        "residual + linear(silu_mul(gate_up[:, :F], gate_up[:, F:]), weight) with F the weight's input "
        "width (a SwiGLU MLP's down projection with its activation and residual).",
    ),
    _spec(
        "rmsnorm_swiglu_mlp_add",
        ("x", "norm_weight", "gate_up_weight", "down_weight", "residual"),
        ("out",),
        "residual + linear(silu_mul(g, u), down_weight) with [g | u] = rmsnorm_linear(x, norm_weight, "
        "gate_up_weight, eps), gate_up_weight's gate rows first (a SwiGLU MLP with its norm and residual; out "
        "may be residual itself).",
        attributes=("eps",),
    ),
    _spec(
        "rope_kv_cache_write",
        ("qkv", "positions", "slots"),
        ("q", "k_plane", "v_plane"),
        "Split packed [q | k | v] projections per token, rotate q and k (as rope), write k and v into "
        "the paged cache planes at slots (as kv_cache_write) and the rotated queries to q.",
        attributes=("theta", "style"),
        optional_attributes=("frequency_band_scaling",),
    ),
    _spec(
        "rmsnorm_linear_rope_kv_cache_write",
        ("x", "norm_weight", "weight", "positions", "slots"),
        ("q", "k_plane", "v_plane"),
        "rope_kv_cache_write of rmsnorm_linear(x, norm_weight, weight): a decoder layer's attention "
        "input (norm, packed [q | k | v] projection, rotation, cache write) as one operator; the packed "
        "projection never reaches memory.",
        attributes=("eps", "theta", "style"),
        optional_attributes=("frequency_band_scaling",),
    ),

    _spec("add", ("a", "b"), ("out",), "Elementwise sum (residual add)."),
    _spec(
        "gather_rows",
        ("x", "index"),
        ("out",),
        "Select rows of x by index (e.g. the last token of each lane); index < 0 gives zeros.",
    ),
    _spec(
        "sample",
        sample_inputs(),
        ("ids",),
        "Per-request seeded sampling with penalties, filters and an optional grammar mask; "
        "increments output_counts[rows[i]] at each sampled id of an active row.",
        optional_inputs=("allowed_mask", "constrained", "logprob", "top_ids", "top_logprobs"),
        updated_inputs=("output_counts",),
        attributes=("vocab_limit",),
        optional_attributes=("top_n",),
    ),
    _spec(
        "apply_grammar_mask",
        ("logits", "allowed_mask", "constrained"),
        ("out",),
        "Set logits of disallowed ids to -inf on constrained rows.",
    ),
    _spec(
        "copy_rows",
        ("src", "dst_rows"),
        ("dst",),
        "dst[dst_rows[i]] = src[src_rows[i]] along the leading axis; a negative index skips the pair "
        "(page copies, state snapshots and restores, pending-token updates). Without src_rows, "
        "source row i pairs with dst_rows[i]; with when, pairs whose flag is zero are skipped.",
        optional_inputs=("src_rows", "when"),
    ),
    _spec(
        "init_sampling_state",
        ("prompt_histogram", "rows"),
        ("prompt_presence", "output_counts"),
        "At admission: prompt_presence[rows[i]] = prompt_histogram[i] > 0 and output_counts[rows[i]] = 0.",
    ),
    _spec(
        "completion_lanes",
        ("generation", "sample_active", "last_index", "positions", "submission_sequence"),
        ("out_generation", "out_emitted", "out_consumed", "out_draft_cursor", "out_reserved", "out_sequence"),
        "Write the per-lane completion record of a non-speculative round: echoed generation, emitted "
        "tokens (1 where a token was sampled), consumed endpoint (last position + 1), draft cursor -1, "
        "reserved -1, echoed submission sequence.",
    ),
    _spec(
        "completion_copy_lanes",
        ("generation", "consumed", "submission_sequence"),
        ("out_generation", "out_emitted", "out_consumed", "out_draft_cursor", "out_reserved", "out_sequence"),
        "Write the per-lane completion record of a round that samples nothing (snapshot, restore): echoed "
        "generation, emitted tokens 0, consumed endpoint copied from consumed, draft cursor -1, reserved -1, "
        "echoed submission sequence.",
    ),
    _spec(
        "tail_page",
        ("page_table", "consumed"),
        ("out",),
        "out[r] = page_table[r, consumed[r] // page_tokens] when consumed[r] % page_tokens != 0 (the page "
        "holding a partial page's tokens), else -1 (no partial page; also for consumed[r] <= 0): the page "
        "a snapshot copies into continuation storage and a restore copies back into.",
        attributes=("page_tokens",),
    ),
    _spec(
        "lane_last_index",
        ("query_length",),
        ("out",),
        "out[i] = (sum of query_length[0..i]) - 1 where query_length[i] > 0, else -1: the packed index "
        "of each lane's last token.",
    ),
    _spec(
        "speculative_inputs",
        ("pending_tokens", "rows", "candidate_ids", "query_length"),
        ("ids",),
        "Pack each lane's block of a speculative round: ids[start] = pending_tokens[rows[r]] and "
        "ids[start + 1 + j] = candidate_ids[r, j] for j < query_length[r] - 1, with start the sum of the "
        "earlier lanes' query lengths; entries past the total are left as they are.",
    ),
    _spec(
        "sample_verify",
        ("logits", "query_length", "candidate_ids", *sample_inputs()[1:]),
        ("ids", "accepted", "emitted", "pending"),
        "Sample each active lane's packed positions in order exactly as sample does one row (step "
        "step[r] + j, counts as they are then), continuing while the token equals the copied candidate; "
        "writes the emitted tokens, accepted candidates, emitted count and last token, and increments "
        "output_counts[rows[r]] at each emitted token. With allowed_mask ([P, words], a row a packed "
        "token) and constrained ([B]), position j of a constrained lane samples under mask row start + j.",
        optional_inputs=("allowed_mask", "constrained", "logprob"),
        updated_inputs=("output_counts",),
        attributes=("vocab_limit",),
    ),
    _spec(
        "completion_speculative",
        ("generation", "query_length", "accepted", "emitted", "positions", "submission_sequence"),
        (
            "out_generation",
            "out_offers",
            "out_accepted",
            "out_emitted",
            "out_consumed",
            "out_draft_cursor",
            "out_reserved",
            "out_sequence",
        ),
        "Write the per-lane completion record of a speculative round: echoed generation, offers "
        "(query_length - 1), accepted and emitted counts, consumed endpoint (first position + accepted + 1 "
        "on a lane that emitted), draft cursor -1, reserved -1, echoed submission sequence.",
    ),
    _spec(
        "lane_positions",
        ("consumed", "page_table", "limit"),
        ("positions", "token_rows", "cache_slots"),
        "Per lane, the token offset past its consumed endpoint: position consumed[r] + offset, token row "
        "r and that position's cache slot (page_table[r, position // page_tokens] x page_tokens + "
        "position % page_tokens) where offset < limit[r]; else position 0, token row -1, slot -1.",
        attributes=("offset", "page_tokens"),
    ),
    _spec(
        "draft_argmax",
        ("logits",),
        ("ids", "confidence"),
        "Greedy draft: ids[r] = the lowest index of the largest logits[r, :vocab_limit], confidence[r] its "
        "softmax probability over the first vocab_limit logits (float64, rounded to float32); a lane "
        "whose optional token_rows entry is negative gets id 0 and confidence 0.",
        optional_inputs=("token_rows",),
        attributes=("vocab_limit",),
    ),
    _spec(
        "draft_sample",
        ("logits", "temperature", "top_k", "top_p", "min_p", "seed", "step", "draft_probabilities"),
        ("ids", "confidence"),
        "Sampled draft: lane r's draft distribution q (softmax of logits[r, :vocab_limit] at its temperature "
        "with its top_k/top_p/min_p, no penalties, rounded to float32) goes to draft_probabilities[r, "
        "draft_index]; ids[r] is drawn from q with the proposal stream's counter step[r] + draft_index, "
        "confidence[r] = q[ids[r]]; temperature 0 drafts greedily as draft_argmax (one-hot q, no draw); a "
        "lane whose optional token_rows entry is negative gets id 0, confidence 0 and a zero row.",
        optional_inputs=("token_rows",),
        updated_inputs=("draft_probabilities",),
        attributes=("vocab_limit", "draft_index"),
    ),
    _spec(
        "sample_verify_sampled",
        ("logits", "query_length", "candidate_ids", "draft_probabilities", *sample_inputs()[1:]),
        ("ids", "accepted", "emitted", "pending"),
        "Verify sampled drafts: per active lane, position j < n accepts candidate x_j with probability "
        "min(1, p_j(x_j) / q_j(x_j)) (p_j the distribution sample draws from with the counts then, q_j "
        "draft_probabilities[r, j] normalised; target counter step[r] + j), else emits a draw from "
        "max(0, p_j - q_j) (the counter's second draw) and stops; position n emits sample's bonus token; "
        "temperature 0 matches the argmax exactly. Writes tokens, accepted and emitted counts and the last "
        "token, and increments output_counts[rows[r]] at each emitted token.",
        optional_inputs=("logprob",),
        updated_inputs=("output_counts",),
        attributes=("vocab_limit",),
    ),
    _spec(
        "draft_allocate",
        ("confidence", "ceilings"),
        ("query_length",),
        "Target rows per lane from draft confidence: one row per lane with a positive ceiling, then one "
        "row at a time to the frontier (next proposal) of highest survival probability (the float64 "
        "product of its float32 confidences; ties to the shorter prefix, then the lower lane), each lane "
        "capped at min(ceiling, D + 1, token_capacity), until packed_capacity rows or no frontier remain.",
        attributes=("packed_capacity", "token_capacity"),
    ),
    _spec(
        "speculative_layout",
        ("query_length", "consumed", "page_table"),
        ("positions", "token_rows", "cache_slots"),
        "Packed layout of device-chosen lane lengths: row start_r + j of lane r gets position consumed[r] + "
        "j, token row r and that position's cache slot; rows past the total get position 0, token row -1, "
        "slot -1.",
        attributes=("page_tokens",),
    ),
    _spec(
        "completion_self_draft",
        ("generation", "query_length", "accepted", "emitted", "consumed", "submission_sequence"),
        (
            "out_generation",
            "out_offers",
            "out_accepted",
            "out_emitted",
            "out_consumed",
            "out_draft_cursor",
            "out_reserved",
            "out_sequence",
        ),
        "Write the completion record of a self-drafting round: echoed generation, offers (query_length - "
        "1), accepted and emitted counts, consumed endpoint (consumed + accepted + 1 on a lane that "
        "emitted), draft cursor max(consumed endpoint - lag_tokens, 0), reserved -1, echoed submission "
        "sequence; with confidence, frame_index and out_confidence, lane r's confidences go to "
        "out_confidence[frame_index, r, :D].",
        optional_inputs=("confidence", "frame_index", "out_confidence"),
        attributes=("lag_tokens",),
    ),
    _spec(
        "gated_recurrence_scan",
        ("gate", "x", "token_row", "rows", "state"),
        ("out",),
        "A gated linear recurrence over each lane's packed tokens, in order: a = sigmoid(gate), "
        "s = a * s + (1 - a) * x, out = s, starting from state[rows[lane]] and written back there "
        "(prefill over a packed block); tokens with token_row < 0 and lanes with rows < 0 are skipped.",
        updated_inputs=("state",),
    ),
    _spec(
        "gated_recurrence_step",
        ("gate", "x", "rows", "state"),
        ("out",),
        "One token a lane of the gated linear recurrence (decode): a = sigmoid(gate[i]), "
        "state[rows[i]] = a * state[rows[i]] + (1 - a) * x[i], out[i] = the new state row; rows < 0 "
        "are skipped (their out row is zero).",
        updated_inputs=("state",),
    ),
    _spec(
        "latent_cache_write",
        ("latent", "slots"),
        ("plane",),
        "Store each packed token's latent [T, d_c] into a paged-latent plane [pages, page_tokens / R, d_c] "
        "(R = tokens_per_record): record slot // R holds the mean of its R tokens' latents, accumulated in "
        "position order (the token at slot % R == 0 starts it); slot < 0 is skipped.",
        attributes=("tokens_per_record",),
    ),
    _spec(
        "latent_attention",
        ("q", "plane", "w_uk", "w_uv", "page_table", "token_row", "token_position"),
        ("out",),
        "Causal attention over a paged-latent history: keys c @ w_uk^T and values c @ w_uv^T of each "
        "complete record c a token may see (records whose R tokens all lie at or before its position), "
        "read through the lane's page table starting at column page_offset; a token that sees no record "
        "gets zeros.",
        attributes=("scale", "tokens_per_record"),
        optional_attributes=("page_offset",),
    ),
    _spec(
        "log_softmax_gather",
        ("logits", "targets"),
        ("out",),
        "Log-probability of each target id under log_softmax(logits) (prompt scores).",
        attributes=("vocab_limit",),
    ),
    _spec(
        "all_reduce",
        ("x",),
        ("out",),
        "Collective over the tensor-parallel ranks: out = the elementwise sum of every rank's x, added in rank "
        "order 0..N-1 in float32 (same shape and dtype as x; out may be x). One rank: a copy.",
    ),
    _spec(
        "all_gather",
        ("x",),
        ("out",),
        "Collective over the tensor-parallel ranks: out = the concatenation of x of ranks 0..N-1 along axis "
        "(out's extent along axis is N times x's). One rank: a copy.",
        attributes=("axis",),
    ),
    _spec(
        "broadcast",
        ("x",),
        ("out",),
        "Collective over the tensor-parallel ranks: out = x of rank root (default 0) on every rank. One rank: "
        "a copy.",
        optional_attributes=("root",),
    ),
)

COLLECTIVE_OPERATORS: Final[frozenset[str]] = frozenset({"all_reduce", "all_gather", "broadcast"})
"""Operators every rank must reach in the same order (each is a rendezvous of the ranks)."""

CATALOGUE: Final[MappingProxyType[tuple[str, int], OperatorSpec]] = MappingProxyType(
    {(spec.name, spec.version): spec for spec in _SPECS}
)
"""Every known operator version, keyed by ``(name, version)``."""


def known_versions(name: str) -> tuple[int, ...]:
    """The versions of ``name`` this catalogue knows, oldest first."""
    return tuple(sorted(version for (op, version) in CATALOGUE if op == name))


def lookup(name: str, version: int) -> OperatorSpec | None:
    """The spec of ``name`` at ``version``, or None when unknown."""
    return CATALOGUE.get((name, version))
