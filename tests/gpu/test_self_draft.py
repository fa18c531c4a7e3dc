"""Self-drafting programs (greedy drafts) on the CUDA backend against the reference backend.

Two cores are built by Ignition (``llama-synthetic --shape tiny``, two layers, bf16 weights, ``--targets
reference,sm_90a``, ``--speculative self-draft --draft-tokens 3``: widths 1, 2 and 4): one whose draft is
every layer (``--draft-layers 2``: the draft is the target) and one whose draft is the first layer.

(a) Every ``selfdraft_w{W}_b{B}`` program runs one round on both backends from identical random state
and staging, with lanes of different ceilings (the full width, one less, one: no proposal) and, above
one row, a last lane without tokens (ceiling 0). On the GPU's own intermediate buffers the kernels are
checked exactly against the reference kernels: the last draft step's ids and confidences against
``draft_argmax`` of its logits (confidence within a relative 1e-5: the GPU sums in float32), the query
lengths against ``draft_allocate`` of its confidences, the packed layout against
``speculative_layout``, the record against ``completion_self_draft``'s rules, and the confidences in the
frame's half of the framed storage. Against the reference: where every lane drafted the same tokens,
the confidences agree within bf16 noise and the query lengths exactly unless two frontiers' survival
probabilities were closer than that noise could reorder; the emitted tokens agree at every position
the reference decided by more than twice the largest difference between the two backends' logits of
that row (a near tie may pick the other token; what follows depends on it); a lane decided at every
position with the same drafts and lengths agrees in accepted, emitted and consumed tokens and cursor.

(b) Greedy requests served by the CUDA backend with self-drafting give the tokens the CUDA backend gives
at width one, and both agree with the reference backend up to a near tie (as in ``test_speculative.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import LoadOptions, PreparedContract
from helios_core.loading import TrustSettings, VerifiedCore
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.packing import GraphPacker, Lane, Submission
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .harness import build_gpu_core

NAMESPACE = "helios-tests/gpu-self-draft"
GREEDY = SamplingParams(temperature=0.0)
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
CACHE_PAGES = 64
STATE_ROWS = 8
PAGE_TOKENS = 16
DRAFT_TOKENS = 3
NEAR_TIE = 0.05
"""Top-2 log-probability gap below which bf16 GPU arithmetic may legitimately pick the other token."""
CONFIDENCE_NOISE = 0.05
"""Largest difference of a draft confidence between the backends (bf16 logits) for the same drafts."""

IDS, LOGPROBS = mf.COMPLETION_FIELD_SAMPLED_IDS, mf.COMPLETION_FIELD_SAMPLED_LOGPROBS
OFFERS, ACCEPTED = mf.COMPLETION_FIELD_OFFERS, mf.COMPLETION_FIELD_ACCEPTED_DRAFTS
EMITTED, CONSUMED = mf.COMPLETION_FIELD_EMITTED_TOKENS, mf.COMPLETION_FIELD_CONSUMED_TOKENS
CURSOR, CONFIDENCE = mf.COMPLETION_FIELD_DRAFT_CURSOR, mf.COMPLETION_FIELD_PROPOSAL_CONFIDENCE

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[2, 1], ids=["draft-is-target", "one-layer-draft"])
def gpu_core(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cuda_context: Context
) -> tuple[Path, TrustSettings, int]:
    layers: int = request.param
    core, trust = build_gpu_core(
        tmp_path_factory, cuda_context, f"gpu-self-draft-{layers}", NAMESPACE,
        "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "128", "--page-tokens", str(PAGE_TOKENS),
        "--speculative", "self-draft", "--draft-tokens", str(DRAFT_TOKENS), "--draft-layers", str(layers),
        core_name="tiny-self-draft.core",
    )  # fmt: skip
    return core, trust, layers


# ----------------------------------------------------------------------------------------------
# (a) each self-drafting program once, from identical state and staging
# ----------------------------------------------------------------------------------------------


def _randomize_state(
    contract: PreparedContract, ref: ReferenceBackend, gpu: CudaBackend, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """The same random cache and state on both backends (output counts zero); returns it."""
    state = {}
    for decl in contract.execution.buffers:
        if decl.role not in (mf.BUFFER_ROLE_CACHE_PLANE, mf.BUFFER_ROLE_PERSISTENT_STATE):
            continue
        target = ref.buffers[decl.name]
        if decl.name == "output_counts":
            values = np.zeros(target.shape, target.dtype)
        elif target.dtype.kind == "f":
            values = (rng.standard_normal(target.shape) * 0.5).astype(target.dtype)
        elif decl.dtype == mf.DTYPE_BF16:
            values = (rng.standard_normal(target.shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        else:
            values = rng.integers(0, min(contract.sampled_size, 200), target.shape).astype(target.dtype)
        state[decl.name] = values
    return state


def _ceiling(row: int, rows: int, width: int) -> int:
    """Lane ``row``'s ceiling: the full width, one less, one (no proposal), the full width; the last of
    several lanes has none (no tokens)."""
    if rows > 1 and row == rows - 1:
        return 0
    return [width, max(width - 1, 1), 1, width][row % 4]


def _lane(row: int, ceiling: int, sampling: SamplingParams) -> Lane:
    consumed = 5 + 3 * row
    pages = [row * 8 + j for j in range((consumed + 4) // PAGE_TOKENS + 1)]
    return Lane(
        slot=row,
        generation=row + 1,
        state_row=row,
        positions=[],
        cache_slots=[],
        page_table=pages,
        sample=ceiling > 0,
        sampling=sampling,
        sampling_step=consumed,
        consumed=consumed,
        prefix_limit=ceiling,
    )


SCRATCH = (
    "scratch.logits",
    "scratch.all_logits",
    "scratch.self_draft.step_ids",
    "scratch.self_draft.step_confidence",
    "scratch.self_draft.step_token_rows",
    "scratch.self_draft.confidence",
    "scratch.self_draft.candidate_ids",
    "scratch.self_draft.query_length",
    "scratch.self_draft.positions",
    "scratch.self_draft.token_rows",
    "scratch.self_draft.cache_slots",
    "pending_tokens",
)


def _round(
    contract: PreparedContract,
    backend: Any,
    name: str,
    lanes: list[Lane],
    frame: int,
    sequence: int,
    state: dict[str, np.ndarray],
) -> tuple[dict[int, np.ndarray], dict[str, np.ndarray]]:
    """One round of ``name`` on ``frame`` from ``state``; returns copies of the record and of the buffers
    in :data:`SCRATCH`."""
    for buffer, values in state.items():
        if isinstance(backend, ReferenceBackend):
            backend.buffers[buffer][...] = values
        else:
            backend.upload(buffer, values)
    staging = backend.transport(frame)
    GraphPacker(contract.graphs[name], staging).pack(Submission(lanes, sequence), frame, staging)
    transport = contract.execution.transport
    staging[transport.frame_index_entry].reshape(-1)[0] = frame
    staging[transport.submission_sequence_entry].reshape(-1)[0] = sequence
    record = backend.completion(frame)
    for values in record.values():  # stale values: the program must overwrite what it reports
        values[...] = 7
    backend.run(name, frame)
    record = {field: np.array(values, copy=True) for field, values in backend.completion(frame).items()}
    if isinstance(backend, ReferenceBackend):
        buffers = {buffer: np.array(backend.buffers[buffer], copy=True) for buffer in SCRATCH}
    else:
        buffers = {buffer: backend.download(buffer) for buffer in SCRATCH}
    return record, buffers


def _allocation_margin(confidence: np.ndarray, ceilings: np.ndarray, packed: int, width: int) -> float:
    """The smallest gap, over ``draft_allocate``'s steps, between the winning frontier's survival and the
    best other frontier's (0 where two frontiers tie): noise below it cannot change the allocation."""
    lanes, drafts = confidence.shape
    lengths = (ceilings > 0).astype(np.int64)
    caps = np.minimum(ceilings, min(drafts + 1, width))
    survival = np.ones(lanes)
    margin = np.inf
    while int(lengths.sum()) < packed:
        frontiers = sorted(
            (survival[lane] * float(confidence[lane, lengths[lane] - 1]), lane)
            for lane in np.flatnonzero(lengths < caps).tolist()
        )
        if not frontiers:
            break
        if len(frontiers) > 1:
            margin = min(margin, frontiers[-1][0] - frontiers[-2][0])
        value, lane = max(frontiers, key=lambda f: (f[0], -lengths[f[1]], -f[1]))
        survival[lane] = value
        lengths[lane] += 1
    return float(margin)


def _check_kernels_on_the_gpu_s_own_buffers(
    name: str, got: dict[int, np.ndarray], buffers: dict[str, np.ndarray], lanes: list[Lane], frame: int, sizes: Any
) -> None:
    """Each self-drafting kernel's output is exactly the reference kernel's on the GPU's own inputs."""
    rows, width, draws, packed, sampled = sizes
    ceilings = np.array([lane.prefix_limit for lane in lanes], np.int32)
    consumed = np.array([lane.consumed for lane in lanes], np.int32)
    table = np.zeros((rows, 16), np.int32)
    for row, lane in enumerate(lanes):
        table[row, : len(lane.page_table)] = lane.page_table
    confidence = buffers["scratch.self_draft.confidence"][: rows * max(draws, 1)].reshape(rows, -1)[:, :draws]
    if draws:
        last = draws - 1  # the last draft step's choice, from its logits (still in scratch.logits)
        drafting = buffers["scratch.self_draft.step_token_rows"][:rows]
        np.testing.assert_array_equal(drafting, np.where(ceilings > last, np.arange(rows), -1), name)
        choice = rk.draft_argmax(buffers["scratch.logits"][:rows].astype(np.float32), sampled, drafting)
        ids = buffers["scratch.self_draft.step_ids"][last * rows : (last + 1) * rows]
        step_confidence = buffers["scratch.self_draft.step_confidence"][last * rows : (last + 1) * rows]
        np.testing.assert_array_equal(ids, choice.ids, name)
        np.testing.assert_allclose(step_confidence, choice.confidence, rtol=1e-5, atol=0, err_msg=name)
        np.testing.assert_array_equal(confidence[:, last], step_confidence, name)
    lengths = buffers["scratch.self_draft.query_length"][:rows]
    expected = rk.draft_allocate(confidence.astype(np.float32), ceilings, packed_capacity=packed, token_capacity=width)
    np.testing.assert_array_equal(lengths, expected, name)
    layout = rk.speculative_layout(lengths, consumed, table, packed_capacity=packed, page_tokens=PAGE_TOKENS)
    np.testing.assert_array_equal(buffers["scratch.self_draft.positions"][:packed], layout.positions, name)
    np.testing.assert_array_equal(buffers["scratch.self_draft.token_rows"][:packed], layout.token_rows, name)
    np.testing.assert_array_equal(buffers["scratch.self_draft.cache_slots"][:packed], layout.cache_slots, name)
    offers = got[OFFERS].reshape(-1)[:rows]
    np.testing.assert_array_equal(offers, np.maximum(lengths - 1, 0), name)
    accepted, emitted = got[ACCEPTED].reshape(-1)[:rows], got[EMITTED].reshape(-1)[:rows]
    has_tokens = lengths > 0
    np.testing.assert_array_equal(emitted, np.where(has_tokens, accepted + 1, 0), name)
    endpoint = np.where(has_tokens, consumed + accepted + 1, 0)
    np.testing.assert_array_equal(got[CONSUMED].reshape(-1)[:rows], endpoint, name)
    np.testing.assert_array_equal(got[CURSOR].reshape(-1)[:rows], np.where(has_tokens, endpoint, -1), name)
    if draws:  # the frame's half of the framed confidence storage holds the round's confidences
        np.testing.assert_array_equal(got[CONFIDENCE][frame, :rows, :draws], confidence, name)


def test_every_self_drafting_program_matches_the_reference(verified: VerifiedCore) -> None:
    contract = verified.contract
    ref = ReferenceBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    gpu = CudaBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, frames=2)
    try:
        names = sorted(n for n, g in contract.graphs.items() if g.operation == ct.OPERATION_SPECULATIVE)
        assert names and all(n.startswith("selfdraft_") for n in names)
        assert {contract.graphs[n].extents.token_capacity for n in names} == {1, 2, 4}
        sampled = contract.sampled_size
        compared = allocations = decided_positions = 0
        for sequence, name in enumerate(names, 1):
            graph = contract.graphs[name]
            extents = graph.extents
            rows, width, draws = extents.batch_capacity, extents.token_capacity, extents.draft_tokens
            packed = rows + (rows * (width - 1) + 1) // 2
            frame = sequence % 2
            rng = np.random.default_rng(sequence)
            state = _randomize_state(contract, ref, gpu, rng)
            settings = [PENALIZED if row % 3 == 2 else SamplingParams(temperature=0.0, seed=row) for row in range(rows)]
            lanes = [_lane(row, _ceiling(row, rows, width), settings[row]) for row in range(rows)]
            want, want_buffers = _round(contract, ref, name, lanes, frame, sequence, state)
            got, got_buffers = _round(contract, gpu, name, lanes, frame, sequence, state)
            _check_kernels_on_the_gpu_s_own_buffers(
                name, got, got_buffers, lanes, frame, (rows, width, draws, packed, sampled)
            )
            np.testing.assert_array_equal(
                got[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[:rows], np.arange(1, rows + 1)
            )
            assert int(got[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1)[0]) == sequence

            # the drafts: the same tokens at every step a lane drafts, then confidences within bf16 noise
            ceilings = np.array([lane.prefix_limit for lane in lanes])
            same_drafts = True
            for step in range(draws):
                drafting = ceilings > step
                here = slice(step * rows, (step + 1) * rows)
                got_ids = got_buffers["scratch.self_draft.step_ids"][here][drafting]
                want_ids = want_buffers["scratch.self_draft.step_ids"][here][drafting]
                same_drafts &= bool((got_ids == want_ids).all())
            want_lengths = want_buffers["scratch.self_draft.query_length"][:rows]
            got_lengths = got_buffers["scratch.self_draft.query_length"][:rows]
            same_lengths = bool((want_lengths == got_lengths).all())
            if same_drafts and draws:
                size = rows * draws
                want_confidence = want_buffers["scratch.self_draft.confidence"][:size].reshape(rows, draws)
                got_confidence = got_buffers["scratch.self_draft.confidence"][:size].reshape(rows, draws)
                deviation = float(np.abs(got_confidence - want_confidence).max())
                assert deviation <= CONFIDENCE_NOISE, (name, got_confidence, want_confidence)
                margin = _allocation_margin(want_confidence, ceilings, packed, width)
                if margin > 2 * draws * deviation:
                    allocations += 1
                    assert same_lengths, (name, got_lengths, want_lengths, margin, deviation)
            elif same_drafts:  # width one: every lane with a ceiling verifies its pending token only
                assert same_lengths and (got_lengths == (ceilings > 0)).all(), name

            # the emitted tokens, position by position, up to the first near tie of the target's logits
            want_logits, got_logits = want_buffers["scratch.all_logits"], got_buffers["scratch.all_logits"]
            want_start = got_start = 0
            for row, lane in enumerate(lanes):
                want_emitted, got_emitted = int(want[EMITTED][row]), int(got[EMITTED][row])
                want_ids = want[IDS][row, :width].tolist()
                got_ids = got[IDS][row, :width].tolist()
                if not lane.sample:
                    assert want_emitted == got_emitted == 0 and got_ids == [-1] * width, (name, row)
                    continue
                decided = True
                for position in range(min(want_emitted, got_emitted)):
                    expected = want_logits[want_start + position, :sampled]
                    found = got_logits[got_start + position, :sampled]
                    deviation = float(np.abs(found.astype(np.float64) - expected).max())
                    top_two = np.sort(expected)[-2:]
                    if float(top_two[1] - top_two[0]) <= 2 * deviation:
                        decided = False
                        break  # a near tie: this position and what follows may differ
                    decided_positions += 1
                    assert got_ids[position] == want_ids[position], (name, row, position, got_ids, want_ids)
                if decided and same_drafts and same_lengths:
                    compared += 1
                    assert got_ids == want_ids, (name, row)
                    for field in (ACCEPTED, EMITTED, CONSUMED, CURSOR, OFFERS):
                        assert int(got[field].reshape(-1)[row]) == int(want[field].reshape(-1)[row]), (name, row, field)
                    logprobs = got[LOGPROBS][row, :got_emitted]
                    assert np.isfinite(logprobs).all() and (logprobs <= 0.0).all(), (name, row)
                    assert int(got_buffers["pending_tokens"][row, 0]) == want_ids[want_emitted - 1], (name, row)
                want_start += int(want_lengths[row])
                got_start += int(got_lengths[row])
        assert compared >= len(names)  # most lanes draft, allocate and decide as the reference does
        assert allocations >= len(names) // 4  # most allocations are not decided by a near tie
        assert decided_positions > 0
    finally:
        gpu.close()
        ref.close()


# ----------------------------------------------------------------------------------------------
# (b) the engine: self-drafting changes nothing but the speed
# ----------------------------------------------------------------------------------------------

REPEATING = [
    [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [7, 7, 8, 7, 7, 8, 7, 7, 8],
    [100, 3, 100, 3, 100, 3, 100],
]
MAX_TOKENS = 40


def _start(gpu_core: tuple[Path, TrustSettings, int], backend: str, **options: Any) -> RunningModel:
    return start(gpu_core[0], gpu_core[1], LoadOptions(max_active=4, **options), backend=backend)


def _generate(running: RunningModel, prompts: list[list[int]], *, top_logprobs: int = 0) -> list[list[Any]]:
    streams = [
        running.engine.submit(
            PreparedRequest(f"g{i}", prompt, MAX_TOKENS, GREEDY, ignore_eos=True, top_logprobs=top_logprobs)
        )
        for i, prompt in enumerate(prompts)
    ]
    outcomes = [list(stream) for stream in streams]
    assert all(isinstance(events[-1], Finished) for events in outcomes), [events[-1] for events in outcomes]
    return [[e for e in events if isinstance(e, TokenEvent)] for events in outcomes]


def _agrees_until_a_near_tie(got: list[int], want: list[tuple[int, float]]) -> bool:
    for token, (expected, gap) in zip(got, want, strict=False):
        if token != expected:
            return gap < NEAR_TIE
    return len(got) == len(want)


def test_self_drafting_gives_the_tokens_of_width_one(gpu_core: tuple[Path, TrustSettings, int]) -> None:
    reference = _start(gpu_core, "reference", speculative_width=1)
    try:
        expected = [
            [(e.token_id, e.top[0][1] - e.top[1][1]) for e in events]
            for events in _generate(reference, REPEATING, top_logprobs=2)
        ]
    finally:
        reference.close()
    plain_model = _start(gpu_core, "cuda", speculative_width=1)
    try:
        plain = [[e.token_id for e in events] for events in _generate(plain_model, REPEATING)]
    finally:
        plain_model.close()
    drafting_model = _start(gpu_core, "cuda")
    try:
        drafted = [[e.token_id for e in events] for events in _generate(drafting_model, REPEATING)]
        stats = drafting_model.engine.statistics()
    finally:
        drafting_model.close()
    assert sum(stats.speculative_lanes.values()) > 0
    assert sum(stats.proposals_offered.values()) > 0
    if gpu_core[2] == 2:  # the draft is the target: most greedy proposals hold
        assert sum(stats.drafts_accepted.values()) > 0
    assert all(len(tokens) == MAX_TOKENS for tokens in drafted)
    for tokens, want in zip(plain, expected, strict=True):
        assert _agrees_until_a_near_tie(tokens, want), (tokens, want)
    for tokens, want in zip(drafted, expected, strict=True):
        assert _agrees_until_a_near_tie(tokens, want), (tokens, want)
    # Where no step was decided by a near tie, self-drafting and width one agree exactly.
    for drafted_tokens, plain_tokens, want in zip(drafted, plain, expected, strict=True):
        if min(gap for _, gap in want) >= NEAR_TIE:
            assert drafted_tokens == plain_tokens
    assert sum(d == p for d, p in zip(drafted, plain, strict=True)) >= len(REPEATING) // 2
