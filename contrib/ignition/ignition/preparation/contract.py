"""Reusable contract declarations: admission, sampling, state transfer and paged text.

Owns the transport entries, persistent state and completion buffers that every
paged text model shares, and the value bindings that feed them. A recipe binds
its programs to these declarations by name; it cannot install scheduling or
state-update code: everything here is data (bindings, views, buffers) that
Helios' shared packing and scheduler interpret. Speculative programs add
copied-proposal entries (:func:`declare_speculative`) and a completion record
as wide as their widest verification; self-drafting programs add ceilings,
endpoints and framed confidence storage instead (:func:`declare_self_draft`). The bindings of the request
sampling settings follow Helios' sampling parameter declaration
(:data:`helios_core.sampling.SAMPLING_PARAMETERS`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from helios_core.sampling import SAMPLING_PARAMETERS, SamplingParameter
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from ignition.preparation.program import ManifestBuilder, View, binding

SUB = ct.INDEXING_SUBMISSION_ROW
ACTIVE = ct.INDEXING_ACTIVE_ROW
PACKED = ct.INDEXING_PACKED_TOKEN
SCALAR = ct.INDEXING_SCALAR

PENDING_TOKEN_VIEW = "pending_token"
PROMPT_PRESENCE_VIEW = "prompt_presence"
OUTPUT_COUNTS_VIEW = "output_counts"


@dataclass(frozen=True)
class TextCapacities:
    """Capacities shared by every program of a paged text core."""

    max_rows: int
    """B_max: the most request rows any program holds."""
    max_packed_tokens: int
    """P_max: the most packed tokens any program holds."""
    pages_per_row: int
    vocab_width: int
    top_logprobs: int = 5
    emitted_capacity: int = 1
    """Sampled ids (and their logprobs) per lane in the completion record: 1, or the widest speculative
    program's W when the core has speculative programs (one record layout for every program)."""


@dataclass(frozen=True)
class SharedViews:
    """Views of the shared declarations, for recipes to wire nodes to."""

    input_ids: View
    positions: View
    token_rows: View
    cache_slots: View
    query_length: View
    page_table: View
    state_rows: View
    sample_active: View
    generation: View
    temperature: View
    top_p: View
    top_k: View
    min_p: View
    repetition_penalty: View
    frequency_penalty: View
    presence_penalty: View
    seed: View
    sampling_step: View
    grammar_mask: View
    constrained: View
    prompt_histogram: View
    score_targets: View
    submission_sequence: View
    pending_tokens: View
    prompt_presence: View
    output_counts: View
    out_sampled_ids: View
    out_logprobs: View
    out_top_ids: View
    out_top_logprobs: View
    out_generation: View
    out_emitted: View
    out_consumed: View
    out_draft_cursor: View
    out_reserved: View
    out_sequence: View
    out_prompt_scores: View


def declare_paged_text(builder: ManifestBuilder, caps: TextCapacities) -> SharedViews:
    """Declare the transport, persistent state and completion buffers of a paged text core."""
    b, p, v = caps.max_rows, caps.max_packed_tokens, caps.vocab_width
    words = -(-v // 32)
    t = builder.transport_entry
    views = {
        "input_ids": t("input_ids", mf.DTYPE_I32, [p]),
        "positions": t("positions", mf.DTYPE_I32, [p]),
        "token_rows": t("token_rows", mf.DTYPE_I32, [p]),
        "cache_slots": t("cache_slots", mf.DTYPE_I64, [p]),
        "score_targets": t("score_targets", mf.DTYPE_I32, [p]),
        "query_length": t("query_length", mf.DTYPE_I32, [b]),
        "page_table": t("page_table", mf.DTYPE_I32, [b, caps.pages_per_row]),
        "state_rows": t("state_rows", mf.DTYPE_I32, [b]),
        "sample_active": t("sample_active", mf.DTYPE_U8, [b]),
        "generation": t("generation", mf.DTYPE_I32, [b]),
        "temperature": t("temperature", mf.DTYPE_F32, [b]),
        "top_p": t("top_p", mf.DTYPE_F32, [b]),
        "top_k": t("top_k", mf.DTYPE_I32, [b]),
        "min_p": t("min_p", mf.DTYPE_F32, [b]),
        "repetition_penalty": t("repetition_penalty", mf.DTYPE_F32, [b]),
        "frequency_penalty": t("frequency_penalty", mf.DTYPE_F32, [b]),
        "presence_penalty": t("presence_penalty", mf.DTYPE_F32, [b]),
        "seed": t("seed", mf.DTYPE_U64, [b]),
        "sampling_step": t("sampling_step", mf.DTYPE_I64, [b]),
        "grammar_mask": t("grammar_mask", mf.DTYPE_I32, [b, words]),
        "constrained": t("constrained", mf.DTYPE_U8, [b]),
        "prompt_histogram": t("prompt_histogram", mf.DTYPE_U8, [b, v]),
        "submission_sequence": t("submission_sequence", mf.DTYPE_I64, [1]),
    }
    t("frame_index", mf.DTYPE_I32, [1])
    builder.manifest.transport.frame_index_entry = "frame_index"
    builder.manifest.transport.submission_sequence_entry = "submission_sequence"

    state = mf.BUFFER_ROLE_PERSISTENT_STATE
    rows_symbol = mf.DIM_SYMBOL_STATE_ROWS
    views["pending_tokens"] = builder.buffer("pending_tokens", state, mf.DTYPE_I32, [b, 1], leading_symbol=rows_symbol)
    views["prompt_presence"] = builder.buffer("prompt_presence", state, mf.DTYPE_U8, [b, v], leading_symbol=rows_symbol)
    views["output_counts"] = builder.buffer("output_counts", state, mf.DTYPE_I32, [b, v], leading_symbol=rows_symbol)

    done = mf.BUFFER_ROLE_COMPLETION
    n = max(caps.top_logprobs, 1)
    e = caps.emitted_capacity
    if e < 1:
        raise ValueError(f"emitted_capacity must be positive, got {e}")
    completion = {
        "out_sampled_ids": ("out_sampled_ids", mf.DTYPE_I32, [b, e], mf.COMPLETION_FIELD_SAMPLED_IDS),
        "out_logprobs": ("out_logprobs", mf.DTYPE_F32, [b, e], mf.COMPLETION_FIELD_SAMPLED_LOGPROBS),
        "out_top_ids": ("out_top_ids", mf.DTYPE_I32, [b, n], mf.COMPLETION_FIELD_TOP_IDS),
        "out_top_logprobs": ("out_top_logprobs", mf.DTYPE_F32, [b, n], mf.COMPLETION_FIELD_TOP_LOGPROBS),
        "out_generation": ("out_generation", mf.DTYPE_I32, [b], mf.COMPLETION_FIELD_GENERATION),
        "out_emitted": ("out_emitted", mf.DTYPE_I32, [b], mf.COMPLETION_FIELD_EMITTED_TOKENS),
        "out_consumed": ("out_consumed", mf.DTYPE_I32, [b], mf.COMPLETION_FIELD_CONSUMED_TOKENS),
        "out_draft_cursor": ("out_draft_cursor", mf.DTYPE_I32, [b], mf.COMPLETION_FIELD_DRAFT_CURSOR),
        "out_reserved": ("out_reserved", mf.DTYPE_I32, [b], mf.COMPLETION_FIELD_RESERVED),
        "out_sequence": ("out_sequence", mf.DTYPE_I64, [1], mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE),
        "out_prompt_scores": ("out_prompt_scores", mf.DTYPE_F32, [p], mf.COMPLETION_FIELD_PROMPT_SCORES),
    }
    for key, (name, dtype, shape, field_id) in completion.items():
        views[key] = builder.buffer(name, done, dtype, shape)
        builder.completion(field_id, name)
    return SharedViews(**views)


@dataclass(frozen=True)
class SnapshotViews:
    """Views of the snapshot declarations: transport rows and the sampling-state copies."""

    snapshot_rows: View
    restore_rows: View
    consumed: View
    pending_tokens: View
    prompt_presence: View
    output_counts: View


def declare_snapshots(builder: ManifestBuilder, caps: TextCapacities, snapshots: int) -> SnapshotViews:
    """Declare snapshot transport entries and snapshot copies of the sampling state.

    The copies are persistent state whose leading extent is DIM_SYMBOL_SNAPSHOT_ROWS (``snapshots``
    is preparation's working-set count; the runtime fixes the physical count at load). A recipe adds
    its own continuation storage (partial-page history payloads) beside them.
    """
    if snapshots <= 0:
        raise ValueError(f"snapshots must be positive, got {snapshots}")
    b, v = caps.max_rows, caps.vocab_width
    t = builder.transport_entry
    state = mf.BUFFER_ROLE_PERSISTENT_STATE
    rows = mf.DIM_SYMBOL_SNAPSHOT_ROWS
    return SnapshotViews(
        snapshot_rows=t("snapshot_rows", mf.DTYPE_I32, [1]),
        restore_rows=t("restore_rows", mf.DTYPE_I32, [1]),
        consumed=t("consumed", mf.DTYPE_I32, [b]),
        pending_tokens=builder.buffer(
            "snapshot.pending_tokens", state, mf.DTYPE_I32, [snapshots, 1], leading_symbol=rows
        ),
        prompt_presence=builder.buffer(
            "snapshot.prompt_presence", state, mf.DTYPE_U8, [snapshots, v], leading_symbol=rows
        ),
        output_counts=builder.buffer(
            "snapshot.output_counts", state, mf.DTYPE_I32, [snapshots, v], leading_symbol=rows
        ),
    )


def snapshot_bindings() -> list[ct.ValueBinding]:
    """What a snapshot needs: the request's state row and page table, its endpoint and destination row."""
    return [
        binding("state_rows", ct.VALUE_SOURCE_LIVE_STATE_ROWS, SUB, padding=-1),
        binding("generation", ct.VALUE_SOURCE_GENERATION, SUB, padding=-1),
        binding("snapshot_rows", ct.VALUE_SOURCE_SNAPSHOT_DESTINATION, SUB, padding=-1),
        binding("page_table", ct.VALUE_SOURCE_PAGE_TABLE, SUB, padding=0),
        binding("consumed", ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT, SUB, padding=0),
    ]


def restore_bindings() -> list[ct.ValueBinding]:
    """What a restore needs: the new state row and private page table, the endpoint and source row."""
    return [
        binding("state_rows", ct.VALUE_SOURCE_LIVE_STATE_ROWS, SUB, padding=-1),
        binding("generation", ct.VALUE_SOURCE_GENERATION, SUB, padding=-1),
        binding("restore_rows", ct.VALUE_SOURCE_RESTORE_SOURCE, SUB, padding=-1),
        binding("page_table", ct.VALUE_SOURCE_PAGE_TABLE, SUB, padding=0),
        binding("consumed", ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT, SUB, padding=0),
    ]


def snapshot_state_accesses() -> list[ct.StateAccess]:
    """A snapshot reads the sampling state and the pending token."""
    return [
        ct.StateAccess(view=view, mode=ct.ACCESS_MODE_READ)
        for view in (PENDING_TOKEN_VIEW, PROMPT_PRESENCE_VIEW, OUTPUT_COUNTS_VIEW)
    ]


def restore_state_accesses() -> list[ct.StateAccess]:
    """A restore writes the sampling state and produces the pending token."""
    return [
        ct.StateAccess(view=view, mode=ct.ACCESS_MODE_WRITE)
        for view in (PENDING_TOKEN_VIEW, PROMPT_PRESENCE_VIEW, OUTPUT_COUNTS_VIEW)
    ]


def state_views(caps: TextCapacities) -> list[ct.StateView]:
    """Named views of the persistent state rows."""
    v = caps.vocab_width
    return [
        ct.StateView(name=PENDING_TOKEN_VIEW, buffer="pending_tokens", byte_offset=0, row_stride=4, byte_extent=4),
        ct.StateView(name=PROMPT_PRESENCE_VIEW, buffer="prompt_presence", byte_offset=0, row_stride=v, byte_extent=v),
        ct.StateView(
            name=OUTPUT_COUNTS_VIEW, buffer="output_counts", byte_offset=0, row_stride=4 * v, byte_extent=4 * v
        ),
    ]


def lane_bindings() -> list[ct.ValueBinding]:
    """Request identity and lane geometry of a submission."""
    return [
        binding("state_rows", ct.VALUE_SOURCE_LIVE_STATE_ROWS, SUB, padding=-1),
        binding("generation", ct.VALUE_SOURCE_GENERATION, SUB, padding=-1),
        binding("query_length", ct.VALUE_SOURCE_QUERY_LENGTH, SUB, padding=0),
    ]


def packed_token_bindings(*, host_tokens: bool) -> list[ct.ValueBinding]:
    """Positions, lane membership and cache slots of packed tokens (and host tokens when fed)."""
    found = [
        binding("positions", ct.VALUE_SOURCE_PROMPT_POSITIONS, PACKED, padding=0),
        binding("token_rows", ct.VALUE_SOURCE_TOKEN_ROW, PACKED, padding=-1),
        binding("cache_slots", ct.VALUE_SOURCE_CACHE_SLOT, PACKED, padding=-1),
        binding("page_table", ct.VALUE_SOURCE_PAGE_TABLE, SUB, padding=0),
    ]
    if host_tokens:
        found.insert(0, binding("input_ids", ct.VALUE_SOURCE_PROMPT_TOKENS, PACKED, padding=0))
    return found


def sampling_value_bindings(parameters: Iterable[SamplingParameter] = SAMPLING_PARAMETERS) -> list[ct.ValueBinding]:
    """Each declared sampling setting into the transport entry of its name, one per submission row.

    Rows past the submission are padded with a value the sample kernel accepts: the neutral value of a
    setting for which zero means nothing (``top_p``, ``repetition_penalty``: 1), zero for the others.
    """
    return [
        binding(parameter.name, parameter.source, SUB, padding=int(parameter.default) if parameter.nonzero else 0)
        for parameter in parameters
    ]


def sampling_bindings() -> list[ct.ValueBinding]:
    """Admission sampling parameters, seeds, steps and the grammar mask."""
    return [
        binding("sample_active", ct.VALUE_SOURCE_SAMPLING_DECISION, SUB, padding=0),
        *sampling_value_bindings(),
        binding("sampling_step", ct.VALUE_SOURCE_SAMPLING_STEP, SUB),
        binding("grammar_mask", ct.VALUE_SOURCE_GRAMMAR_MASK, SUB, padding=-1),
        binding("constrained", ct.VALUE_SOURCE_CONSTRAINED, SUB, padding=0),
    ]


def admission_bindings() -> list[ct.ValueBinding]:
    """What initialization of newly admitted requests needs: rows and prompt histograms."""
    return [
        binding("state_rows", ct.VALUE_SOURCE_LIVE_STATE_ROWS, SUB, padding=-1),
        binding("generation", ct.VALUE_SOURCE_GENERATION, SUB, padding=-1),
        binding("prompt_histogram", ct.VALUE_SOURCE_PROMPT_HISTOGRAM, ACTIVE),
    ]


def sampling_state_accesses() -> list[ct.StateAccess]:
    """Generating programs read and update the sampling state and write the pending token."""
    return [
        ct.StateAccess(view=PROMPT_PRESENCE_VIEW, mode=ct.ACCESS_MODE_READ),
        ct.StateAccess(view=OUTPUT_COUNTS_VIEW, mode=ct.ACCESS_MODE_READ_WRITE),
        ct.StateAccess(view=PENDING_TOKEN_VIEW, mode=ct.ACCESS_MODE_READ_WRITE),
    ]


def target_rng(draws_per_row: int = 1) -> list[ct.RngReservation]:
    """Target draws per sampled row per round: one, or W for a speculative program of width W."""
    return [ct.RngReservation(stream="target", draws_per_row=draws_per_row)]


@dataclass(frozen=True)
class SpeculativeViews:
    """Views of the copied-proposal declarations of speculative programs and their record fields."""

    candidate_ids: dict[int, View]
    """Per width W above one: ``candidate_ids_w{W}`` [B, W - 1], one row of copied proposals a lane."""
    candidate_count: View
    candidate_generation: View
    candidate_consumed: View
    candidate_grammar_mask: View
    """``candidate_grammar_mask`` [B x W_max, mask words]: one grammar mask a packed token
    (CANDIDATE_GRAMMAR_MASKS), the mask each position of a constrained lane samples under."""
    out_offers: View
    out_accepted: View


def declare_speculative(builder: ManifestBuilder, caps: TextCapacities, widths: Iterable[int]) -> SpeculativeViews:
    """Declare the copied-proposal transport entries and the offers/accepted completion fields.

    Each width W above one gets its own ``candidate_ids_w{W}`` entry of W - 1 columns, so a program of
    that width reads its lanes' proposals as contiguous ``[B, W - 1]`` rows. Count, generation and
    consumed endpoint are one value a lane, shared by every width; ``candidate_grammar_mask`` holds one
    int32 mask row a packed token of the widest program (``B x W`` rows). The completion record's sampled ids
    and logprobs must already be declared ``caps.emitted_capacity`` wide (:func:`declare_paged_text`).
    """
    b = caps.max_rows
    ordered = sorted(set(widths))
    if not ordered or ordered[0] < 1:
        raise ValueError(f"speculative widths must be positive, got {ordered}")
    if ordered[-1] > caps.emitted_capacity:
        raise ValueError(
            f"the widest speculative program (W = {ordered[-1]}) emits more than the completion record's "
            f"{caps.emitted_capacity} ids a lane"
        )
    t = builder.transport_entry
    done = mf.BUFFER_ROLE_COMPLETION
    words = -(-caps.vocab_width // 32)
    views = SpeculativeViews(
        candidate_ids={w: t(f"candidate_ids_w{w}", mf.DTYPE_I32, [b, w - 1]) for w in ordered if w > 1},
        candidate_count=t("candidate_count", mf.DTYPE_I32, [b]),
        candidate_generation=t("candidate_generation", mf.DTYPE_I32, [b]),
        candidate_consumed=t("candidate_consumed", mf.DTYPE_I32, [b]),
        candidate_grammar_mask=t("candidate_grammar_mask", mf.DTYPE_I32, [b * ordered[-1], words]),
        out_offers=builder.buffer("out_offers", done, mf.DTYPE_I32, [b]),
        out_accepted=builder.buffer("out_accepted", done, mf.DTYPE_I32, [b]),
    )
    builder.completion(mf.COMPLETION_FIELD_OFFERS, "out_offers")
    builder.completion(mf.COMPLETION_FIELD_ACCEPTED_DRAFTS, "out_accepted")
    return views


def speculative_bindings(width: int) -> list[ct.ValueBinding]:
    """The copied proposals of a speculative program of width W (exact lengths come from QUERY_LENGTH).

    ``candidate_ids_w{W}`` (-1 padding) is bound only above width one; count (0 padding), generation and
    consumed endpoint (-1 padding) are always bound, so the runtime can check what it copied. The
    per-position grammar masks (CANDIDATE_GRAMMAR_MASKS, one row a packed token) pad with -1, every id
    allowed, as GRAMMAR_MASK does; ``constrained`` (CONSTRAINED, from :func:`sampling_bindings`) says
    which lanes they apply to.
    """
    found = [
        binding("candidate_count", ct.VALUE_SOURCE_CANDIDATE_COUNT, SUB, padding=0),
        binding("candidate_generation", ct.VALUE_SOURCE_CANDIDATE_GENERATION, SUB, padding=-1),
        binding("candidate_consumed", ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT, SUB, padding=-1),
        binding("candidate_grammar_mask", ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS, PACKED, padding=-1),
    ]
    if width > 1:
        found.insert(0, binding(f"candidate_ids_w{width}", ct.VALUE_SOURCE_CANDIDATE_IDS, SUB, padding=-1))
    return found


PROPOSAL_RNG_STREAM = "proposal"
"""The RNG stream of proposal draws (a greedy in-graph draft reserves none)."""


@dataclass(frozen=True)
class SelfDraftViews:
    """Views of the declarations of self-drafting speculative programs and their record fields."""

    prefix_limit: View
    """[B] each lane's immutable ceiling (SPECULATIVE_PREFIX_LIMIT): the most target rows it may take."""
    consumed: View
    """[B] each lane's consumed endpoint (CONSUMED_TOKEN_ENDPOINT): its pending token's position."""
    frame_index: View
    """[1] the transport-owned frame index (selects the half of ``proposal_confidence``)."""
    out_offers: View
    out_accepted: View
    proposal_confidence: View
    """[2, B, draft_capacity] FP32 framed confidence storage (COMPLETION_FIELD_PROPOSAL_CONFIDENCE)."""


def declare_self_draft(
    builder: ManifestBuilder, caps: TextCapacities, draft_capacity: int, *, consumed: View | None = None
) -> SelfDraftViews:
    """Declare the ceilings, endpoints and the offers/accepted/confidence completion fields.

    ``consumed`` reuses an already declared ``[B]`` endpoint entry (snapshots declare one); without it
    the entry ``consumed`` is declared here. ``proposal_confidence`` is ``[2, B, draft_capacity]``: one
    half per execution frame, one row per submission lane, ``draft_capacity`` the widest D.
    """
    b = caps.max_rows
    if draft_capacity < 1:
        raise ValueError(f"draft_capacity must be positive, got {draft_capacity}")
    frame_entry = builder.manifest.transport.frame_index_entry
    if not frame_entry:
        raise ValueError("the transport declares no frame index entry (declare_paged_text first)")
    t = builder.transport_entry
    done = mf.BUFFER_ROLE_COMPLETION
    views = SelfDraftViews(
        prefix_limit=t("prefix_limit", mf.DTYPE_I32, [b]),
        consumed=consumed if consumed is not None else t("consumed", mf.DTYPE_I32, [b]),
        frame_index=View(frame_entry, (1,)),
        out_offers=builder.buffer("out_offers", done, mf.DTYPE_I32, [b]),
        out_accepted=builder.buffer("out_accepted", done, mf.DTYPE_I32, [b]),
        proposal_confidence=builder.buffer("proposal_confidence", done, mf.DTYPE_F32, [2, b, draft_capacity]),
    )
    builder.completion(mf.COMPLETION_FIELD_OFFERS, "out_offers")
    builder.completion(mf.COMPLETION_FIELD_ACCEPTED_DRAFTS, "out_accepted")
    builder.completion(mf.COMPLETION_FIELD_PROPOSAL_CONFIDENCE, "proposal_confidence")
    return views


def self_draft_bindings() -> list[ct.ValueBinding]:
    """What a self-drafting program reads from the host: identity, ceilings, endpoints and pages.

    ``prefix_limit`` (SPECULATIVE_PREFIX_LIMIT, 0 padding) is the program's only length source: the
    program allocates its lanes' lengths and computes positions and cache slots from ``consumed``
    (CONSUMED_TOKEN_ENDPOINT, 0 padding) and ``page_table`` on the device.
    """
    return [
        binding("state_rows", ct.VALUE_SOURCE_LIVE_STATE_ROWS, SUB, padding=-1),
        binding("generation", ct.VALUE_SOURCE_GENERATION, SUB, padding=-1),
        binding("prefix_limit", ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT, SUB, padding=0),
        binding("consumed", ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT, SUB, padding=0),
        binding("page_table", ct.VALUE_SOURCE_PAGE_TABLE, SUB, padding=0),
    ]


def self_draft_rng(width: int) -> list[ct.RngReservation]:
    """W target draws a row (verification) and no proposal draws (the draft is greedy)."""
    return [*target_rng(draws_per_row=width), ct.RngReservation(stream=PROPOSAL_RNG_STREAM, draws_per_row=0)]


def sampled_self_draft_rng(width: int, draws: int) -> list[ct.RngReservation]:
    """A sampled draft's reservations: 2W - 1 target draws a row (a verified position's acceptance draw
    and its residual draw, W - 1 of each, and the bonus token's draw) and D proposal draws (one a
    drafted token), none for width one."""
    if width <= 1:
        return self_draft_rng(width)
    return [
        *target_rng(draws_per_row=2 * width - 1),
        ct.RngReservation(stream=PROPOSAL_RNG_STREAM, draws_per_row=draws),
    ]
