"""Sampled drafts on the GPU (``draft_sample``, ``sample_verify_sampled``) against the reference backend.

(a) ``draft_sample`` nodes on random logits with greedy, sampled (with and without top-k, top-p and
min-p) and non-drafting lanes; the outputs are poisoned beforehand so a value the kernels fail to write
shows up. Non-drafting lanes read id 0, confidence 0 and a zero row; greedy lanes give the reference's
id, a one-hot row and its confidence within a relative 1e-5 (``draft_argmax``'s tolerance); sampled
lanes give the reference's row of q within two float32 rounding steps (the kept mass is summed in
another order), and its id wherever the reference's draw does not land within 1e-6 of a cumulative
boundary of q (relative to the row's sum), with ``confidence = q[id]``. Only row ``draft_index`` of
``draft_probabilities`` is written. A drafting lane with a non-finite logit drafts nothing.

(b) ``sample_verify_sampled`` nodes on random logits, drafts close to the target and candidates drawn
from them, with greedy, sampled, penalised, bonus-only and inactive lanes. The reference's decisions are
replayed position by position (the target distribution with the counts of that moment, the stream
uniforms): a lane every one of whose decisions (an acceptance test, a residual draw, ``sample``'s draw)
lies farther than 1e-9 from its boundary must give the reference's ids, accepted, emitted and pending
exactly, its log-probabilities within 1e-4 and its row of ``output_counts``; most lanes must be decided
so. A verified lane whose draft row sums to zero ends without a token instead of raising.

(c) A tiny self-drafting core with sampled drafts built for ``reference,sm_90a`` gives, on the CUDA
backend at temperature 0, the reference backend's greedy tokens (up to a near tie), and serves sampled
requests with drafts.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.cuda_driver import Context
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start

from .harness import assert_cuda_matches_reference, build_gpu_core, reference_node, run_node

pytestmark = pytest.mark.gpu

NAMESPACE = "helios-tests/gpu-sampled-draft"
POISON = -7
ROW_POISON = 5.0
DRAFTS = 3
CONFIDENCE_TOL = 1e-5
PROBABILITY_RTOL = 2.5e-7
"""Two float32 rounding steps: an entry of q from a kept mass summed in another order."""
DRAW_MARGIN = 1e-6
"""A draft draw whose target lies closer than this (relative) to a boundary of q may go either way."""
DECISION_MARGIN = 1e-9
"""A verification decision closer than this (relative) to its boundary may go either way."""
LOGPROB_TOL = 1e-4
Arrays = dict[str, np.ndarray]


def _rng(*key: Any) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ----------------------------------------------------------------------------------------------
# (a) draft_sample
# ----------------------------------------------------------------------------------------------

DRAFT_SETTINGS = [
    # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 40, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (0.9, 0, 1.0, 0.05),
    (1.1, 25, 0.8, 0.02),
    (0.0, 10, 0.5, 0.1),  # greedy: the filters cannot change the argmax
    (2.0, 0, 0.3, 0.0),
]


def _draft_arrays(rng: np.random.Generator, vocab: int, *, scale: float = 3.0) -> Arrays:
    lanes = len(DRAFT_SETTINGS)
    temperature, top_k, top_p, min_p = (np.array(column) for column in zip(*DRAFT_SETTINGS, strict=True))
    token_rows = np.arange(lanes, dtype=np.int32)
    token_rows[rng.integers(0, lanes)] = -1  # one lane drafts nothing
    return {
        "logits": (rng.standard_normal((lanes, vocab)) * scale).astype(np.float32),
        "temperature": temperature.astype(np.float32),
        "top_k": top_k.astype(np.int32),
        "top_p": top_p.astype(np.float32),
        "min_p": min_p.astype(np.float32),
        "seed": rng.integers(0, 2**63, lanes, dtype=np.int64).astype(np.uint64),
        "step": rng.integers(0, 1000, lanes).astype(np.int32),
        "draft_probabilities": np.full((lanes, DRAFTS, vocab), ROW_POISON, np.float32),
        "token_rows": token_rows,
        "ids": np.full(lanes, POISON, np.int32),
        "confidence": np.full(lanes, np.nan, np.float32),
    }


def _draw_margin(q: np.ndarray, u: float) -> float:
    """How far (relative to the row's sum) the draw ``u`` of float32 row ``q`` lies from the nearest
    cumulative boundary around the id it picks."""
    cumulative = np.cumsum(q.astype(np.float64))
    total = float(cumulative[-1])
    target = u * total
    index = int(np.searchsorted(cumulative, target, side="right"))
    below = target - (float(cumulative[index - 1]) if index > 0 else 0.0)
    above = float(cumulative[index]) - target if index < cumulative.size else 0.0
    return min(below, above) / total


def _check_draft(got: Arrays, want: Arrays, arrays: Arrays, index: int, skipped: list[int]) -> tuple[int, int]:
    """Compare one draft_sample node; returns (sampled lanes compared, sampled lanes decided)."""
    sampled = decided = 0
    others = [d for d in range(DRAFTS) if d != index]
    assert (got["draft_probabilities"][:, others] == ROW_POISON).all()  # only row draft_index is written
    for lane, (temperature, *_) in enumerate(DRAFT_SETTINGS):
        got_row, want_row = got["draft_probabilities"][lane, index], want["draft_probabilities"][lane, index]
        got_id, want_id = int(got["ids"][lane]), int(want["ids"][lane])
        if arrays["token_rows"][lane] < 0 or lane in skipped:
            assert got_id == 0 and float(got["confidence"][lane]) == 0.0, lane
            assert not got_row.any(), lane
            continue
        if temperature == 0.0:
            assert got_id == want_id, lane
            np.testing.assert_allclose(got["confidence"][lane], want["confidence"][lane], rtol=CONFIDENCE_TOL)
            assert got_row[got_id] == 1.0 and np.count_nonzero(got_row) == 1, lane
            continue
        sampled += 1
        assert ((got_row > 0) == (want_row > 0)).all(), lane  # the same kept set
        np.testing.assert_allclose(got_row, want_row, rtol=PROBABILITY_RTOL, atol=1e-40)  # subnormal steps
        assert got_row[got_id] > 0.0 and float(got["confidence"][lane]) == float(got_row[got_id]), lane
        seed, step = arrays["seed"][lane : lane + 1], arrays["step"][lane : lane + 1].astype(np.int64) + index
        u = float(rk.stream_uniform(seed, step, rk.PROPOSAL_STREAM_KEY)[0])
        if _draw_margin(want_row, u) > DRAW_MARGIN:
            decided += 1
            assert got_id == want_id, (lane, got_id, want_id)
            np.testing.assert_allclose(got["confidence"][lane], want["confidence"][lane], rtol=PROBABILITY_RTOL)
    return sampled, decided


@pytest.mark.parametrize("vocab", [320, 5000, 49152])
def test_draft_sample_matches_the_reference(cuda_context: Context, vocab: int) -> None:
    sampled = decided = 0
    for case in range(6):
        rng = _rng("draft", vocab, case)
        arrays = _draft_arrays(rng, vocab, scale=1.0 + case)
        index = case % DRAFTS
        attributes = {"vocab_limit": vocab - 7 * (case % 2), "draft_index": index}
        got = run_node(cuda_context, "draft_sample", arrays, attributes)
        want = reference_node("draft_sample", arrays, attributes)
        lanes, lanes_decided = _check_draft(got, want, arrays, index, [])
        sampled, decided = sampled + lanes, decided + lanes_decided
    assert decided >= 0.95 * sampled


def test_draft_sample_without_token_rows_drafts_every_lane(cuda_context: Context) -> None:
    arrays = _draft_arrays(_rng("draft-all", 2048), 2048)
    arrays["token_rows"] = np.arange(len(DRAFT_SETTINGS), dtype=np.int32)  # every lane drafts
    plain = {name: value for name, value in arrays.items() if name != "token_rows"}
    got = run_node(cuda_context, "draft_sample", plain, {"vocab_limit": 2048, "draft_index": 2})
    want = reference_node("draft_sample", plain, {"vocab_limit": 2048, "draft_index": 2})
    _check_draft(got, want, arrays, 2, [])


def test_a_drafting_lane_with_a_non_finite_logit_drafts_nothing(cuda_context: Context) -> None:
    rng = _rng("draft-broken", 700)
    arrays = _draft_arrays(rng, 700)
    arrays["token_rows"] = np.arange(len(DRAFT_SETTINGS), dtype=np.int32)
    arrays["logits"][1, 17] = np.inf  # sampled lane
    arrays["logits"][0, 699 - 50] = np.nan  # greedy lane
    arrays["logits"][2, 699] = -np.inf  # past the limit: never drafted
    attributes = {"vocab_limit": 690, "draft_index": 0}
    got = run_node(cuda_context, "draft_sample", arrays, attributes)
    # the reference raises for those lanes: compare the others with the broken lanes not drafting
    rows = arrays["token_rows"].copy()
    rows[[0, 1]] = -1
    want = reference_node("draft_sample", {**arrays, "token_rows": rows}, attributes)
    _check_draft(got, want, arrays, 0, [0, 1])
    assert int(got["ids"][2]) == int(want["ids"][2])


# ----------------------------------------------------------------------------------------------
# (b) sample_verify_sampled
# ----------------------------------------------------------------------------------------------

WIDTH = 4
CANDIDATES = WIDTH - 1
VERIFY_LANES = [
    # temperature, top_k, top_p, min_p, penalised, query_length, active
    (0.0, 0, 1.0, 0.0, False, 4, True),
    (1.0, 0, 1.0, 0.0, False, 4, True),
    (0.7, 20, 0.9, 0.0, False, 4, True),
    (1.3, 0, 1.0, 0.05, True, 3, True),
    (1.0, 0, 1.0, 0.0, False, 4, False),
    (0.8, 0, 1.0, 0.0, False, 1, True),
    (0.9, 0, 0.5, 0.0, True, 2, True),
    (0.0, 0, 1.0, 0.0, True, 4, True),
]


def _verify_arrays(rng: np.random.Generator, vocab: int, limit: int) -> Arrays:
    lanes = len(VERIFY_LANES)
    columns = list(zip(*VERIFY_LANES, strict=True))
    temperature, top_k, top_p, min_p = (np.array(columns[i]) for i in range(4))
    penalised = np.array(columns[4])
    lengths = np.array(columns[5], dtype=np.int32)
    packed = int(lengths.sum())
    logits = (rng.standard_normal((packed, vocab)) * 2.0).astype(np.float32)
    state_rows = lanes + 2
    rows = rng.permutation(state_rows)[:lanes].astype(np.int32)
    counts = np.zeros((state_rows, vocab), np.int32)
    presence = np.zeros((state_rows, vocab), np.uint8)
    counts[:, :limit] = rng.integers(0, 3, (state_rows, limit)) * (rng.random((state_rows, limit)) < 0.02)
    presence[:, :limit] = rng.random((state_rows, limit)) < 0.02
    drafts = np.zeros((lanes, CANDIDATES, vocab), np.float32)
    candidates = np.zeros((lanes, CANDIDATES), np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for lane, (t, k, p, m, *_rest) in enumerate(VERIFY_LANES):
        for j in range(int(lengths[lane]) - 1):
            row = logits[starts[lane] + j : starts[lane] + j + 1]
            if t == 0.0:  # greedy: the argmax at first, so the lane goes on, then another id
                candidates[lane, j] = int(np.argmax(row[0, :limit])) if j < 2 else int(rng.integers(0, limit))
                drafts[lane, j, candidates[lane, j]] = 1.0
                continue
            noisy = row + (rng.standard_normal(row.shape) * 0.3).astype(np.float32)
            q = rk.sample_probabilities(
                noisy, temperature=[t], top_k=[k], top_p=[p], min_p=[m], repetition_penalty=[1.0],
                frequency_penalty=[0.0], presence_penalty=[0.0], prompt_presence=presence[:1],
                output_counts=np.zeros_like(counts[:1]), vocab_limit=limit,
            )[0]  # fmt: skip
            drafts[lane, j] = q.astype(np.float32)
            drawn = int(np.searchsorted(np.cumsum(q), rng.random() * q.sum(), side="right"))
            candidates[lane, j] = min(drawn, int(np.flatnonzero(q > 0)[-1]))
    return {
        "logits": logits,
        "query_length": lengths,
        "candidate_ids": candidates,
        "draft_probabilities": drafts,
        "temperature": temperature.astype(np.float32),
        "top_p": top_p.astype(np.float32),
        "top_k": top_k.astype(np.int32),
        "min_p": min_p.astype(np.float32),
        "repetition_penalty": np.where(penalised, 1.3, 1.0).astype(np.float32),
        "frequency_penalty": np.where(penalised, 0.4, 0.0).astype(np.float32),
        "presence_penalty": np.where(penalised, 0.2, 0.0).astype(np.float32),
        "prompt_presence": presence,
        "output_counts": counts,
        "rows": rows,
        "seed": rng.integers(0, 2**63, lanes, dtype=np.int64).astype(np.uint64),
        "step": rng.integers(0, 500, lanes).astype(np.int64),
        "active": np.array(columns[6], dtype=np.uint8),
        "ids": np.full((lanes, WIDTH), POISON, np.int32),
        "logprob": np.full((lanes, WIDTH), np.nan, np.float32),
        "accepted": np.full(lanes, POISON, np.int32),
        "emitted": np.full(lanes, POISON, np.int32),
        "pending": np.full(lanes, POISON, np.int32),
    }


def _boundary_distance(cumulative: np.ndarray, target: float) -> float:
    index = int(np.searchsorted(cumulative, target, side="right"))
    below = target - (float(cumulative[index - 1]) if index > 0 else 0.0)
    above = float(cumulative[index]) - target if index < cumulative.size else 0.0
    return min(below, above)


def _lane_decided(arrays: Arrays, want: Arrays, lane: int, limit: int) -> bool:
    """Whether every decision the reference took for ``lane`` lies farther than DECISION_MARGIN from its
    boundary (replayed with the counts of each moment)."""
    temperature, top_k, top_p, min_p = (float(arrays[n][lane]) for n in ("temperature", "top_k", "top_p", "min_p"))
    start = int(arrays["query_length"][:lane].sum())
    offers = int(arrays["query_length"][lane]) - 1
    state = int(arrays["rows"][lane])
    counts = arrays["output_counts"][state : state + 1].copy()
    seed = arrays["seed"][lane : lane + 1]
    emitted = int(want["emitted"][lane])
    for j in range(emitted):
        token = int(want["ids"][lane, j])
        counter = np.array([int(arrays["step"][lane]) + j], np.int64)
        p = rk.sample_probabilities(
            arrays["logits"][start + j : start + j + 1], temperature=[temperature], top_k=[int(top_k)], top_p=[top_p],
            min_p=[min_p], repetition_penalty=arrays["repetition_penalty"][lane : lane + 1],
            frequency_penalty=arrays["frequency_penalty"][lane : lane + 1],
            presence_penalty=arrays["presence_penalty"][lane : lane + 1],
            prompt_presence=arrays["prompt_presence"][state : state + 1], output_counts=counts, vocab_limit=limit,
        )[0]  # fmt: skip
        if temperature == 0.0:
            pass  # the argmax of bit-exact processed logits, ties to the lowest id on both
        elif j == offers:  # sample's draw over (p desc, id asc)
            order = np.lexsort((np.arange(p.size), -p))
            order = order[p[order] > 0]
            u = float(rk.counter_uniform(seed, counter)[0])
            if _boundary_distance(np.cumsum(p[order]), u * float(p[order].sum())) <= DECISION_MARGIN:
                return False
        else:
            draft = arrays["draft_probabilities"][lane, j].astype(np.float64)
            q = draft / draft.sum()
            x = int(arrays["candidate_ids"][lane, j])
            u = float(rk.counter_uniform(seed, counter)[0])
            if abs(u * q[x] - p[x]) <= DECISION_MARGIN * max(p[x], u * q[x]):
                return False
            if not u * q[x] < p[x]:
                residual = np.maximum(p - q, 0.0)
                if not residual.sum() > 0.0:
                    residual = p
                cumulative = np.cumsum(residual)
                u2 = float(rk.stream_uniform(seed, counter, rk.RESIDUAL_STREAM_KEY)[0])
                if _boundary_distance(cumulative, u2 * cumulative[-1]) <= DECISION_MARGIN * cumulative[-1]:
                    return False
        counts[0, token] += 1
    return True


@pytest.mark.parametrize("vocab", [320, 4096])
def test_sample_verify_sampled_matches_the_reference(cuda_context: Context, vocab: int) -> None:
    lanes = decided = accepted_any = rejected_any = 0
    for case in range(8):
        rng = _rng("verify", vocab, case)
        limit = vocab - 5 * (case % 2)
        arrays = _verify_arrays(rng, vocab, limit)
        attributes = {"vocab_limit": limit}
        got = run_node(cuda_context, "sample_verify_sampled", arrays, attributes)
        want = reference_node("sample_verify_sampled", arrays, attributes)
        for lane, (*_settings, length, active) in enumerate(VERIFY_LANES):
            if not active:
                assert got["ids"][lane].tolist() == [-1] * WIDTH
                assert (int(got["accepted"][lane]), int(got["emitted"][lane]), int(got["pending"][lane])) == (0, 0, -1)
                assert not got["logprob"][lane].any()
                continue
            lanes += 1
            if not _lane_decided(arrays, want, lane, limit):
                continue
            decided += 1
            assert got["ids"][lane].tolist() == want["ids"][lane].tolist(), (case, lane)
            for name in ("accepted", "emitted", "pending"):
                assert int(got[name][lane]) == int(want[name][lane]), (case, lane, name)
            emitted = int(want["emitted"][lane])
            np.testing.assert_allclose(
                got["logprob"][lane, :emitted], want["logprob"][lane, :emitted], atol=LOGPROB_TOL
            )
            assert not got["logprob"][lane, emitted:].any()
            state = int(arrays["rows"][lane])
            np.testing.assert_array_equal(got["output_counts"][state], want["output_counts"][state])
            accepted_any += int(want["accepted"][lane]) > 0
            rejected_any += int(want["accepted"][lane]) < length - 1
    assert decided >= 0.8 * lanes
    assert accepted_any > 0 and rejected_any > 0


def test_a_draft_row_without_mass_ends_the_lane(cuda_context: Context) -> None:
    rng = _rng("verify-empty", 320)
    arrays = _verify_arrays(rng, 320, 320)
    arrays["draft_probabilities"][1, 0] = 0.0  # lane 1 (sampled) verifies candidate 0 against nothing
    before = arrays["output_counts"][int(arrays["rows"][1])].copy()
    got = run_node(cuda_context, "sample_verify_sampled", arrays, {"vocab_limit": 320})
    assert got["ids"][1].tolist() == [-1] * WIDTH
    assert (int(got["accepted"][1]), int(got["emitted"][1]), int(got["pending"][1])) == (0, 0, -1)
    np.testing.assert_array_equal(got["output_counts"][int(arrays["rows"][1])], before)
    # the greedy lane next to it is unaffected
    others = arrays["active"].copy()
    others[1] = 0
    want = reference_node("sample_verify_sampled", {**arrays, "active": others}, {"vocab_limit": 320})
    assert got["ids"][0].tolist() == want["ids"][0].tolist()


# ----------------------------------------------------------------------------------------------
# (c) a sampled self-drafting core
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-sampled-draft", NAMESPACE,
        "--max-rows", "4", "--prefill-tokens", "16", "--context", "128", "--page-tokens", "16",
        "--cache-pages", "64", "--speculative", "self-draft", "--draft-tokens", str(DRAFTS),
        "--draft-sampling", "sampled",
        core_name="tiny-sampled-draft.core",
    )  # fmt: skip


def test_sampled_draft_core_on_cuda_gives_the_reference_greedy_tokens(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    assert_cuda_matches_reference(gpu_core, reference_running)


def test_sampled_draft_core_serves_sampled_requests_with_drafts(gpu_core: tuple[Path, TrustSettings]) -> None:
    running = start(gpu_core[0], gpu_core[1], LoadOptions(max_active=4), backend="cuda")
    try:
        prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41], [7, 7, 8, 7, 7, 8], [100, 3, 100, 3]]
        streams = [
            running.engine.submit(
                PreparedRequest(f"s{i}", prompt, 24, SamplingParams(temperature=0.8, seed=i), ignore_eos=True)
            )
            for i, prompt in enumerate(prompts)
        ]
        outcomes = [list(stream) for stream in streams]
        stats = running.engine.statistics()
    finally:
        running.close()
    assert all(isinstance(events[-1], Finished) for events in outcomes), [events[-1] for events in outcomes]
    for events in outcomes:
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) == 24
        assert all(np.isfinite(e.logprob) and e.logprob <= 0.0 for e in tokens)
    assert sum(stats.speculative_lanes.values()) > 0
    assert sum(stats.proposals_offered.values()) > 0
