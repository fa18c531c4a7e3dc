"""Speculative programs (history drafting) on the CUDA backend against the reference backend.

The core is built once per module by Ignition (``llama-synthetic --shape tiny``, bf16 weights,
``--targets reference,sm_90a``, ``--speculative history --draft-tokens 3``: widths 1, 2 and 4).

(a) Every speculative program runs one round on both backends from identical random state and
staging, with lanes that accept every proposal (proposals are the reference's own greedy tokens),
refuse one in the middle, offer fewer proposals than the width, or are inactive; the first lane of each
program is constrained (one random grammar mask a packed position, as history drafting stages a
request with a grammar). The records must
agree exactly, except that from the first position where the reference decided its greedy token by
less than twice the largest difference between the two backends' logits of that row, a lane may
differ (bf16 arithmetic may then pick the other token; what follows depends on it).

(b) Greedy requests served by the CUDA backend with history drafting give the tokens the CUDA backend
gives without it, on prompts that repeat themselves so that proposals are accepted, and both agree
with the reference backend up to a near tie (as in ``test_backend.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

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

NAMESPACE = "helios-tests/gpu-speculative"
GREEDY = SamplingParams(temperature=0.0)
CACHE_PAGES = 64
STATE_ROWS = 8
PAGE_TOKENS = 16
NEAR_TIE = 0.05
"""Top-2 log-probability gap below which bf16 GPU arithmetic may legitimately pick the other token."""

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-speculative", NAMESPACE,
        "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "128", "--page-tokens", str(PAGE_TOKENS),
        "--speculative", "history", "--draft-tokens", "3", core_name="tiny-speculative.core",
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# (a) each speculative program once, from identical state and staging
# ----------------------------------------------------------------------------------------------


def _randomize_state(
    contract: PreparedContract, ref: ReferenceBackend, gpu: CudaBackend, rng: np.random.Generator
) -> None:
    """The same random cache and state on both backends; output counts zero (penalty lanes then see
    only the counts this round adds)."""
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
        target[...] = values
        gpu.upload(decl.name, values)


def _random_masks(rng: np.random.Generator, count: int, words: int, sampled: int) -> list[np.ndarray]:
    """``count`` int32 grammar masks of ``words`` words, each allowing about half of the sampled ids."""
    allowed = rng.random((count, words * 32)) < 0.5
    allowed[:, sampled:] = False
    packed = np.packbits(allowed, axis=1, bitorder="little")  # bit b of byte k: id 8k + b
    return [np.ascontiguousarray(row).view("<u4").astype(np.uint32).view(np.int32) for row in packed]


def _allowed(mask: np.ndarray, sampled: int) -> np.ndarray:
    bits = np.unpackbits(mask.astype("<u4").view(np.uint8), bitorder="little")
    return bits[:sampled].astype(bool)


def _lane(
    row: int,
    candidates: list[int],
    sampling: SamplingParams,
    *,
    sample: bool = True,
    masks: list[np.ndarray] | None = None,
) -> Lane:
    start = 5 + 3 * row
    positions = list(range(start, start + 1 + len(candidates)))
    pages = [row * 8 + j for j in range(positions[-1] // PAGE_TOKENS + 1)]
    return Lane(
        slot=row,
        generation=row + 1,
        state_row=row,
        positions=positions,
        cache_slots=[pages[p // PAGE_TOKENS] * PAGE_TOKENS + p % PAGE_TOKENS for p in positions],
        page_table=pages,
        sample=sample,
        sampling=sampling,
        sampling_step=start,
        consumed=start,
        candidates=candidates,
        candidate_masks=masks[: len(positions)] if masks is not None else (),
    )


def _stage(contract: PreparedContract, graph_name: str, staging: Any, lanes: list[Lane], sequence: int) -> None:
    GraphPacker(contract.graphs[graph_name], staging).pack(Submission(lanes, sequence), 0, staging)
    transport = contract.execution.transport
    staging[transport.frame_index_entry].reshape(-1)[0] = 0
    staging[transport.submission_sequence_entry].reshape(-1)[0] = sequence


def _round(
    contract: PreparedContract, backend: Any, name: str, lanes: list[Lane], sequence: int, state: dict[str, Any]
) -> dict[int, np.ndarray]:
    """One round of ``name`` from ``state`` (uploaded first); returns a copy of the record."""
    for buffer, values in state.items():
        if isinstance(backend, ReferenceBackend):
            backend.buffers[buffer][...] = values
        else:
            backend.upload(buffer, values)
    _stage(contract, name, backend.transport(0), lanes, sequence)
    backend.run(name, 0)
    return {field: np.array(values, copy=True) for field, values in backend.completion(0).items()}


PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)


def test_every_speculative_program_matches_the_reference(verified: VerifiedCore) -> None:
    contract = verified.contract
    ref = ReferenceBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    gpu = CudaBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, frames=2)
    try:
        names = [n for n, g in contract.graphs.items() if g.operation == ct.OPERATION_SPECULATIVE]
        assert {contract.graphs[n].extents.token_capacity for n in names} == {1, 2, 4}
        compared = decided_positions = 0
        for sequence, name in enumerate(sorted(names), 1):
            graph = contract.graphs[name]
            rows, width = graph.extents.batch_capacity, graph.extents.token_capacity
            rng = np.random.default_rng(sequence)
            _randomize_state(contract, ref, gpu, rng)
            persistent = [
                d.name
                for d in contract.execution.buffers
                if d.role in (mf.BUFFER_ROLE_CACHE_PLANE, mf.BUFFER_ROLE_PERSISTENT_STATE)
            ]
            state = {buffer: np.array(ref.buffers[buffer], copy=True) for buffer in persistent}
            settings = [PENALIZED if row % 3 == 2 else SamplingParams(temperature=0.0, seed=row) for row in range(rows)]
            words = ref.transport(0)["candidate_grammar_mask"].shape[1]
            masks = [
                _random_masks(rng, width, words, contract.sampled_size) if row == 0 else None for row in range(rows)
            ]
            # Proposals: the reference's own greedy tokens, found one position at a time.
            proposals = [[int(t) for t in rng.integers(0, 200, width - 1)] for _ in range(rows)]
            for position in range(width - 1):
                lanes = [_lane(row, proposals[row], settings[row], masks=masks[row]) for row in range(rows)]
                record = _round(contract, ref, name, lanes, sequence, state)
                for row in range(rows):
                    proposals[row][position] = int(record[mf.COMPLETION_FIELD_SAMPLED_IDS][row, position])
            lanes = []
            for row in range(rows):
                offered = list(proposals[row])
                if row % 4 == 1 and width > 2:
                    offered[1] = (offered[1] + 1) % 200  # refused in the middle
                if row % 4 == 3:
                    offered = offered[: (width - 1) // 2]  # fewer proposals than the width
                sample = not (rows > 1 and row == rows - 1)
                lanes.append(_lane(row, offered, settings[row], sample=sample, masks=masks[row]))
            want = _round(contract, ref, name, lanes, sequence, state)
            want_logits = np.array(ref.buffers["scratch.all_logits"], copy=True)
            got = _round(contract, gpu, name, lanes, sequence, state)
            got_logits = gpu.download("scratch.all_logits")
            for field in (mf.COMPLETION_FIELD_GENERATION, mf.COMPLETION_FIELD_OFFERS):
                np.testing.assert_array_equal(got[field].reshape(-1)[:rows], want[field].reshape(-1)[:rows], name)
            assert int(got[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1)[0]) == sequence
            sampled = contract.sampled_size
            start = 0
            for row, lane in enumerate(lanes):
                want_ids = want[mf.COMPLETION_FIELD_SAMPLED_IDS][row, :width].tolist()
                got_ids = got[mf.COMPLETION_FIELD_SAMPLED_IDS][row, :width].tolist()
                emitted = int(want[mf.COMPLETION_FIELD_EMITTED_TOKENS][row])
                if not lane.sample:
                    assert emitted == 0 and got_ids == [-1] * width, name
                    assert int(got[mf.COMPLETION_FIELD_EMITTED_TOKENS][row]) == 0, name
                    start += lane.query_length
                    continue
                same = True
                for position in range(emitted):
                    # a constrained position decides among the ids its mask allows
                    allowed = (
                        _allowed(lane.candidate_masks[position], sampled)  # type: ignore[arg-type]
                        if lane.candidate_masks
                        else np.ones(sampled, dtype=bool)
                    )
                    expected = want_logits[start + position, :sampled][allowed]
                    deviation = float(np.abs(got_logits[start + position, :sampled][allowed] - expected).max())
                    top_two = np.sort(expected)[-2:]
                    if float(top_two[1] - top_two[0]) <= 2 * deviation:
                        break  # a near tie: this position and what follows may differ
                    decided_positions += 1
                    if got_ids[position] != want_ids[position]:
                        same = False
                        break
                else:
                    compared += 1
                    assert got_ids == want_ids, (name, row)
                    for field in (
                        mf.COMPLETION_FIELD_ACCEPTED_DRAFTS,
                        mf.COMPLETION_FIELD_EMITTED_TOKENS,
                        mf.COMPLETION_FIELD_CONSUMED_TOKENS,
                    ):
                        assert int(got[field].reshape(-1)[row]) == int(want[field].reshape(-1)[row]), (name, row, field)
                    logprobs = got[mf.COMPLETION_FIELD_SAMPLED_LOGPROBS][row, :emitted]
                    assert np.isfinite(logprobs).all() and (logprobs <= 0.0).all(), (name, row)
                    assert int(gpu.download("pending_tokens")[row, 0]) == want_ids[emitted - 1], name
                    if lane.candidate_masks:  # every emitted token is one its position's mask allows
                        for position, token in enumerate(got_ids[:emitted]):
                            assert _allowed(lane.candidate_masks[position], sampled)[token], (name, position)  # type: ignore[arg-type]
                assert same, (name, row, got_ids, want_ids)
                start += lane.query_length
        assert compared >= len(names)  # most lanes are decided at every position
        assert decided_positions > 0
    finally:
        gpu.close()
        ref.close()


# ----------------------------------------------------------------------------------------------
# (b) the engine: history drafting changes nothing but the speed
# ----------------------------------------------------------------------------------------------

REPEATING = [
    [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [7, 7, 8, 7, 7, 8, 7, 7, 8],
    [100, 3, 100, 3, 100, 3, 100],
]
MAX_TOKENS = 40


def _start(gpu_core: tuple[Path, TrustSettings], backend: str, **options: Any) -> RunningModel:
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


def test_history_drafting_gives_the_tokens_of_plain_decode(gpu_core: tuple[Path, TrustSettings]) -> None:
    reference = _start(gpu_core, "reference")
    try:
        expected = [
            [(e.token_id, e.top[0][1] - e.top[1][1]) for e in events]
            for events in _generate(reference, REPEATING, top_logprobs=2)
        ]
    finally:
        reference.close()
    plain_model = _start(gpu_core, "cuda")
    try:
        plain = [[e.token_id for e in events] for events in _generate(plain_model, REPEATING)]
    finally:
        plain_model.close()
    drafting_model = _start(gpu_core, "cuda", history_drafting=True)
    try:
        drafted = [[e.token_id for e in events] for events in _generate(drafting_model, REPEATING)]
        stats = drafting_model.engine.statistics()
    finally:
        drafting_model.close()
    assert sum(stats.speculative_lanes.values()) > 0
    assert sum(stats.drafts_accepted.values()) > 0  # the prompts repeat: proposals hold
    assert all(len(tokens) == MAX_TOKENS for tokens in drafted)
    for tokens, want in zip(plain, expected, strict=True):
        assert _agrees_until_a_near_tie(tokens, want), (tokens, want)
    for tokens, want in zip(drafted, expected, strict=True):
        assert _agrees_until_a_near_tie(tokens, want), (tokens, want)
    # Where no step was decided by a near tie, drafting and plain decode agree exactly.
    for drafted_tokens, plain_tokens, want in zip(drafted, plain, expected, strict=True):
        if min(gap for _, gap in want) >= NEAR_TIE:
            assert drafted_tokens == plain_tokens
    assert sum(d == p for d, p in zip(drafted, plain, strict=True)) >= len(REPEATING) // 2
