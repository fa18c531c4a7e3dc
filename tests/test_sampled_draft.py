"""Sampled in-graph drafts: ``draft_sample``, ``sample_verify_sampled`` and ``--draft-sampling sampled``.

The operators are pinned on hand-made inputs (draws computed from the documented RNG streams), then
checked statistically: over thousands of independently seeded lanes the emitted tokens follow the
target's distribution exactly as plain sampling would give them, and a draft is accepted as often as
speculative sampling predicts (``sum min(p, q)``). A tiny ``--draft-sampling sampled`` build then runs
its programs on the reference backend: the contract declares the draws honestly, a round's record is
consistent, and its first emitted token follows plain decode's distribution across seeds.

Every statistical check compares each observed count with its expectation by Bernstein's inequality
(a bound for sums of independent Bernoulli variables that needs no normal approximation): the margin
of each count is chosen so that a correct implementation exceeds it with probability below
``1e-6 / m`` for ``m`` checked counts, so by the union bound a test fails by chance less than once in a
million runs. The seeds are fixed, so the outcome is the same every run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from ignition.cli import main as ignition_main

from helios_core.backends import reference_kernels as rk
from helios_core.backends.reference import ReferenceBackend
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.ops.catalogue import lookup
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

FALSE_FAILURE_BOUND = 1e-6
"""The chance that a statistical test below fails although the implementation is exact (union bound)."""


def _bernstein_margin(trials: int, probability: float, alpha: float) -> float:
    """The deviation t with P(|X - n p| >= t) <= alpha for X a sum of n independent Bernoulli(p):
    Bernstein's inequality 2 exp(-t^2 / (2 (n p (1 - p) + t / 3))) solved for t."""
    log_term = math.log(2.0 / alpha)
    variance = trials * probability * (1.0 - probability)
    return log_term / 3.0 + math.sqrt((log_term / 3.0) ** 2 + 2.0 * variance * log_term)


def _check_counts(observed: Mapping[str, tuple[int, int, float]]) -> None:
    """``observed[name] = (count, trials, probability)``; every count within its Bernstein margin at
    ``FALSE_FAILURE_BOUND / len(observed)`` each."""
    alpha = FALSE_FAILURE_BOUND / len(observed)
    failures = {
        name: (count, trials * probability, _bernstein_margin(trials, probability, alpha))
        for name, (count, trials, probability) in observed.items()
        if abs(count - trials * probability) >= _bernstein_margin(trials, probability, alpha)
    }
    assert not failures, failures


def _settings(lanes: int, **overrides: npt.NDArray[Any]) -> dict[str, npt.NDArray[Any]]:
    settings: dict[str, npt.NDArray[Any]] = {
        "temperature": np.ones(lanes, np.float32),
        "top_k": np.zeros(lanes, np.int32),
        "top_p": np.ones(lanes, np.float32),
        "min_p": np.zeros(lanes, np.float32),
        "repetition_penalty": np.ones(lanes, np.float32),
        "frequency_penalty": np.zeros(lanes, np.float32),
        "presence_penalty": np.zeros(lanes, np.float32),
        "seed": np.arange(1, lanes + 1, dtype=np.uint64) * np.uint64(7919),
    }
    settings.update(overrides)
    return settings


def _draft_settings(settings: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
    return {name: settings[name] for name in ("temperature", "top_k", "top_p", "min_p", "seed")}


def _softmax(logits: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    wide = np.asarray(logits, dtype=np.float64)
    weights = np.exp(wide - wide.max())
    result: npt.NDArray[np.float64] = weights / weights.sum()
    return result


def _first_over(weights: npt.NDArray[Any], u: float) -> int:
    """The first id whose running sum (in id order) exceeds u times the total."""
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64))
    return int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))


# ----------------------------------------------------------------------------------------------
# the RNG streams
# ----------------------------------------------------------------------------------------------


def test_the_proposal_and_residual_streams_are_keyed_seeds_of_the_counter_uniform() -> None:
    seeds = np.array([0, 1, 2**63 + 5], dtype=np.uint64)
    steps = np.array([0, 7, 3], dtype=np.int64)
    for key, ascii_name in ((rk.PROPOSAL_STREAM_KEY, b"proposal"), (rk.RESIDUAL_STREAM_KEY, b"residual")):
        assert key == int.from_bytes(ascii_name, "big")
        keyed = rk.splitmix64(seeds, np.full(3, key, dtype=np.uint64))
        np.testing.assert_array_equal(rk.stream_uniform(seeds, steps, key), rk.counter_uniform(keyed, steps))
        assert not np.isin(rk.stream_uniform(seeds, steps, key), rk.counter_uniform(seeds, steps)).any()
    assert float(rk.stream_uniform(np.array([0], np.uint64), np.array([0]), rk.PROPOSAL_STREAM_KEY)[0]) == float(
        rk.counter_uniform(rk.splitmix64(np.array([0], np.uint64), np.array([rk.PROPOSAL_STREAM_KEY], np.uint64)), 0)[0]
    )


def test_sample_probabilities_is_the_distribution_sample_draws_from() -> None:
    logits = np.array([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5], [0.3, 0.2, 0.9, 0.9, -2.0, 0.0]], dtype=np.float32)
    counts = np.zeros((2, 6), np.int32)
    counts[0, 5] = 2
    common = {
        "repetition_penalty": np.ones(2, np.float32),
        "frequency_penalty": np.array([0.5, 0.0], np.float32),
        "presence_penalty": np.zeros(2, np.float32),
        "prompt_presence": np.zeros((2, 6), np.uint8),
        "output_counts": counts,
        "vocab_limit": 5,
    }
    filtered = rk.sample_probabilities(
        logits,
        temperature=np.array([0.5, 0.0], np.float32),
        top_k=np.array([3, 0], np.int32),
        top_p=np.ones(2, np.float32),
        min_p=np.zeros(2, np.float32),
        **common,
    )
    # Row 0: id 5 is past vocab_limit; top 3 of [2, 1, 0.5, -1, 0] at temperature 0.5 are ids 0, 1, 2.
    expected = np.zeros(6)
    expected[:3] = _softmax(np.array([2.0, 1.0, 0.5]) / 0.5)
    np.testing.assert_allclose(filtered[0], expected, rtol=1e-12)
    # Row 1 is greedy: one-hot at sample's choice (the lowest of the tied maxima).
    assert filtered[1].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    drawn = rk.sample(
        logits[1:],
        **{name: value[1:] for name, value in _settings(2, temperature=np.zeros(2, np.float32)).items()},
        prompt_presence=np.zeros((1, 6), np.uint8),
        output_counts=counts[1:],
        step=np.zeros(1, np.int64),
        vocab_limit=5,
    )
    assert int(drawn.ids[0]) == 2


# ----------------------------------------------------------------------------------------------
# draft_sample
# ----------------------------------------------------------------------------------------------

DRAFT_LOGITS = np.array([[0.5, 2.0, -1.0, 1.0, 0.0], [3.0, 1.0, 3.0, -2.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0]], np.float32)


def test_draft_sample_draws_from_the_draft_distribution_with_the_proposal_stream() -> None:
    settings = _draft_settings(_settings(3, temperature=np.array([0.7, 0.0, 1.0], np.float32)))
    settings["top_k"] = np.array([0, 0, 2], np.int32)
    step = np.array([4, 9, 0], np.int64)
    choice = rk.draft_sample(DRAFT_LOGITS, **settings, step=step, draft_index=2, vocab_limit=5)
    u = rk.stream_uniform(settings["seed"], step + 2, rk.PROPOSAL_STREAM_KEY)
    # Lane 0: the softmax at temperature 0.7, rounded to float32, drawn in id order.
    q0 = _softmax(DRAFT_LOGITS[0] / 0.7).astype(np.float32)
    np.testing.assert_allclose(choice.probabilities[0], q0, rtol=1e-6)
    token = _first_over(choice.probabilities[0], float(u[0]))
    assert int(choice.ids[0]) == token
    assert float(choice.confidence[0]) == float(choice.probabilities[0, token])
    # Lane 1 is greedy: the lowest of the tied maxima, one-hot, draft_argmax's confidence, no draw.
    assert int(choice.ids[1]) == 0
    assert choice.probabilities[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    greedy = rk.draft_argmax(DRAFT_LOGITS[1:2], 5)
    assert float(choice.confidence[1]) == float(greedy.confidence[0])
    # Lane 2: top_k 2 of five equal logits keeps ids 0 and 1 (ties by id), half each.
    assert choice.probabilities[2].tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]
    assert int(choice.ids[2]) == (0 if float(u[2]) < 0.5 else 1)
    assert choice.ids.dtype == np.int32 and choice.confidence.dtype == np.float32
    assert choice.probabilities.dtype == np.float32 and choice.probabilities.shape == (3, 5)


def test_draft_sample_uses_one_proposal_counter_per_drafted_token() -> None:
    settings = _draft_settings(_settings(1))
    logits = np.zeros((1, 64), np.float32)  # uniform: the drawn id is floor(64 u)
    for step, index in ((0, 0), (0, 3), (5, 1)):
        choice = rk.draft_sample(logits, **settings, step=np.array([step]), draft_index=index, vocab_limit=64)
        u = float(rk.stream_uniform(settings["seed"], np.array([step + index]), rk.PROPOSAL_STREAM_KEY)[0])
        assert int(choice.ids[0]) == _first_over(np.full(64, 1 / 64, np.float32), u)
    target = float(rk.counter_uniform(settings["seed"], np.array([0]))[0])
    proposal = float(rk.stream_uniform(settings["seed"], np.array([0]), rk.PROPOSAL_STREAM_KEY)[0])
    assert target != proposal


def test_a_lane_without_a_token_row_drafts_nothing_and_is_not_read() -> None:
    logits = DRAFT_LOGITS.copy()
    logits[1] = np.nan
    settings = _draft_settings(_settings(3))
    settings["temperature"] = np.array([1.0, -5.0, 1.0], np.float32)  # lane 1's settings are not read either
    choice = rk.draft_sample(
        logits, **settings, step=np.zeros(3, np.int64), draft_index=0, vocab_limit=5, token_rows=np.array([0, -1, 2])
    )
    assert int(choice.ids[1]) == 0 and float(choice.confidence[1]) == 0.0
    assert choice.probabilities[1].tolist() == [0.0] * 5
    assert (choice.probabilities[[0, 2]].sum(axis=1) > 0.99).all()


def test_ids_past_the_vocab_limit_are_never_drafted() -> None:
    logits = np.array([[0.0, 0.0, 50.0, 50.0]], np.float32)
    settings = _draft_settings(_settings(1))
    choice = rk.draft_sample(logits, **settings, step=np.zeros(1, np.int64), draft_index=0, vocab_limit=2)
    assert choice.probabilities[0, 2:].tolist() == [0.0, 0.0] and int(choice.ids[0]) in (0, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_limit": 6}, "vocab_limit: 6 must lie in [1, 5]"),
        ({"draft_index": -1}, "draft_index: must be non-negative, got -1"),
        ({"logits": np.full((3, 5), np.inf, np.float32)}, "logits: a drafting lane has a non-finite logit"),
        ({"temperature": np.full(3, -1.0, np.float32)}, "temperature: must be finite and >= 0"),
        ({"top_p": np.zeros(3, np.float32)}, "top_p: must lie in (0, 1]"),
        ({"seed": np.zeros(2, np.uint64)}, "seed: expected shape (3,), got (2,)"),
        ({"step": np.full(3, -1)}, "step: must be >= 0"),
    ],
)
def test_draft_sample_refuses_bad_input(change: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {
        "logits": DRAFT_LOGITS,
        **_draft_settings(_settings(3)),
        "step": np.zeros(3, np.int64),
        "draft_index": 0,
        "vocab_limit": 5,
    }
    arguments.update(change)
    with pytest.raises(ValueError) as raised:
        rk.draft_sample(**arguments)
    assert str(raised.value) == message


# ----------------------------------------------------------------------------------------------
# sample_verify_sampled
# ----------------------------------------------------------------------------------------------

TARGET_ROW = np.array([1.2, 0.3, -0.4, 0.9, -1.5, 0.0], np.float32)
DRAFT_ROW = np.array([-0.5, 1.0, 0.2, 0.1, 0.8, -1.0], np.float32)


def _verify(
    logits: npt.NDArray[Any],
    candidates: npt.NDArray[Any],
    drafts: npt.NDArray[Any],
    settings: Mapping[str, npt.NDArray[Any]],
    *,
    query_length: npt.NDArray[Any],
    step: npt.NDArray[Any] | None = None,
    counts: npt.NDArray[Any] | None = None,
    active: npt.NDArray[Any] | None = None,
    width: int = 3,
) -> rk.VerifyResult:
    lanes, vocab = candidates.shape[0], logits.shape[1]
    return rk.sample_verify_sampled(
        logits,
        query_length=query_length,
        candidate_ids=candidates,
        draft_probabilities=drafts,
        settings=settings,
        prompt_presence=np.zeros((lanes, vocab), np.uint8),
        output_counts=np.zeros((lanes, vocab), np.int32) if counts is None else counts,
        rows=np.arange(lanes, dtype=np.int32),
        step=np.zeros(lanes, np.int64) if step is None else step,
        active=np.ones(lanes, np.uint8) if active is None else active,
        vocab_limit=vocab,
        width=width,
    )


def _seed_with(predicate: Any, step: int = 0) -> int:
    """The first seed whose target uniform at ``step`` satisfies ``predicate``."""
    for seed in range(1, 10_000):
        if predicate(float(rk.counter_uniform(np.array([seed], np.uint64), np.array([step]))[0])):
            return seed
    raise AssertionError("no seed found")


def test_a_candidate_the_target_gives_more_than_the_draft_is_always_accepted() -> None:
    p = _softmax(TARGET_ROW)
    q_row = np.full(6, 1 / 6, np.float32)
    (candidate,) = np.flatnonzero(p >= 1 / 6)[:1]  # p(x) >= q(x): ratio >= 1
    seed = _seed_with(lambda u: u > 0.999)  # even the largest uniform accepts
    settings = _settings(1, seed=np.array([seed], np.uint64))
    counts = np.zeros((1, 6), np.int32)
    result = _verify(
        np.tile(TARGET_ROW, (2, 1)),
        np.array([[candidate, 0]], np.int32),
        np.tile(q_row, (1, 2, 1)),
        settings,
        query_length=np.array([2]),
        counts=counts,
    )
    bonus = rk.sample(
        TARGET_ROW[None],
        **{k: v for k, v in settings.items()},
        prompt_presence=np.zeros((1, 6), np.uint8),
        output_counts=np.eye(6, dtype=np.int32)[candidate : candidate + 1],
        step=np.array([1]),
        vocab_limit=6,
    )
    assert result.ids[0].tolist() == [candidate, int(bonus.ids[0]), -1]
    assert (int(result.accepted[0]), int(result.emitted[0]), int(result.pending[0])) == (1, 2, int(bonus.ids[0]))
    assert counts[0, candidate] == 1 + (candidate == int(bonus.ids[0]))
    logprobs = rk.log_softmax(TARGET_ROW[None])[0]
    assert float(result.logprobs[0, 0]) == float(logprobs[candidate])


def test_a_rejection_emits_the_residual_draw_of_the_same_counter() -> None:
    p = _softmax(TARGET_ROW)
    q = _softmax(DRAFT_ROW).astype(np.float32)
    candidate = 4  # q(4) ~ 0.22 > p(4) ~ 0.025: accepted with probability p/q ~ 0.11
    ratio = p[candidate] / (q[candidate] / q.astype(np.float64).sum())
    seed = _seed_with(lambda u: u > ratio + 0.05, step=3)
    settings = _settings(1, seed=np.array([seed], np.uint64))
    result = _verify(
        np.tile(TARGET_ROW, (3, 1)),
        np.array([[candidate, 1]], np.int32),
        np.tile(q, (1, 2, 1)),
        settings,
        query_length=np.array([3]),
        step=np.array([3]),
    )
    residual = np.maximum(p - q.astype(np.float64) / q.astype(np.float64).sum(), 0.0)
    u = float(rk.stream_uniform(settings["seed"], np.array([3]), rk.RESIDUAL_STREAM_KEY)[0])
    expected = _first_over(residual, u)
    assert residual[candidate] == 0.0 and expected != candidate
    assert result.ids[0].tolist() == [expected, -1, -1]
    assert (int(result.accepted[0]), int(result.emitted[0]), int(result.pending[0])) == (0, 1, expected)


def test_a_candidate_the_target_cannot_emit_is_always_rejected() -> None:
    logits = np.array([[0.0, 1.0, -np.inf, 0.5]], np.float32)
    q = np.array([0.0, 0.0, 1.0, 0.0], np.float32)
    for seed in range(1, 30):
        result = _verify(
            np.tile(logits, (2, 1)),
            np.array([[2]], np.int32),
            q[None, None],
            _settings(1, seed=np.array([seed], np.uint64)),
            query_length=np.array([2]),
            width=2,
        )
        assert int(result.accepted[0]) == 0 and int(result.ids[0, 0]) != 2


def test_a_draft_equal_to_the_target_is_accepted_in_full() -> None:
    p = _softmax(TARGET_ROW).astype(np.float32)
    lanes = 50
    candidates = np.random.default_rng(3).integers(0, 6, (lanes, 2)).astype(np.int32)
    result = _verify(
        np.tile(TARGET_ROW, (lanes * 3, 1)),
        candidates,
        np.tile(p, (lanes, 2, 1)),
        _settings(lanes),
        query_length=np.full(lanes, 3),
    )
    assert result.accepted.tolist() == [2] * lanes
    np.testing.assert_array_equal(result.ids[:, :2], candidates)


def test_greedy_lanes_verify_exactly_as_sample_verify_whatever_the_draft_rows() -> None:
    rng = np.random.default_rng(11)
    lanes, vocab = 8, 7
    logits = rng.standard_normal((lanes * 3, vocab)).astype(np.float32)
    settings = _settings(
        lanes, temperature=np.zeros(lanes, np.float32), presence_penalty=np.full(lanes, 0.3, np.float32)
    )
    argmax = np.argmax(logits.reshape(lanes, 3, vocab), axis=2).astype(np.int32)
    candidates = argmax[:, :2].copy()
    candidates[::2, 1] = (candidates[::2, 1] + 1) % vocab  # even lanes: the second candidate is wrong
    candidates[::4, 0] = (candidates[::4, 0] + 1) % vocab  # every fourth lane: the first is wrong too
    drafts = rng.random((lanes, 2, vocab)).astype(np.float32)
    counts_sampled, counts_plain = np.zeros((lanes, vocab), np.int32), np.zeros((lanes, vocab), np.int32)
    query_length = np.full(lanes, 3)
    sampled = _verify(logits, candidates, drafts, settings, query_length=query_length, counts=counts_sampled)
    plain = rk.sample_verify(
        logits,
        query_length=query_length,
        candidate_ids=candidates,
        settings=settings,
        prompt_presence=np.zeros((lanes, vocab), np.uint8),
        output_counts=counts_plain,
        rows=np.arange(lanes),
        step=np.zeros(lanes, np.int64),
        active=np.ones(lanes, np.uint8),
        vocab_limit=vocab,
        width=3,
    )
    for got, want in zip(sampled, plain, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(counts_sampled, counts_plain)
    assert set(sampled.accepted.tolist()) == {0, 1, 2}  # rejections at either position and full acceptance


def test_inactive_lanes_are_untouched() -> None:
    counts = np.zeros((2, 6), np.int32)
    result = _verify(
        np.tile(TARGET_ROW, (6, 1)),
        np.zeros((2, 2), np.int32),
        np.full((2, 2, 6), 1 / 6, np.float32),
        _settings(2),
        query_length=np.array([3, 3]),
        counts=counts,
        active=np.array([0, 1], np.uint8),
    )
    assert result.ids[0].tolist() == [-1, -1, -1] and result.logprobs[0].tolist() == [0.0, 0.0, 0.0]
    assert (int(result.accepted[0]), int(result.emitted[0]), int(result.pending[0])) == (0, 0, -1)
    assert counts[0].tolist() == [0] * 6 and int(counts[1].sum()) == int(result.emitted[1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drafts": np.zeros((1, 1, 6), np.float32)}, "draft_probabilities: expected [1, >= 2, 6], got (1, 1, 6)"),
        ({"candidates": np.array([[6, 0]], np.int32)}, "candidate_ids: lane 0 offers an id outside [0, 6)"),
        ({"query_length": np.array([4])}, "query_length: lane 0 offers 3 candidates, candidate_ids holds 2"),
        (
            {"drafts": np.full((1, 2, 6), -0.1, np.float32)},
            "draft_probabilities: a verified row is not finite and non-negative with a positive sum",
        ),
    ],
)
def test_sample_verify_sampled_refuses_bad_input_and_restores_the_counts(change: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {
        "logits": np.tile(TARGET_ROW, (4, 1)),
        "candidates": np.array([[4, 0]], np.int32),
        "drafts": np.full((1, 2, 6), 1 / 6, np.float32),
        "query_length": np.array([3]),
    }
    arguments.update(change)
    counts = np.zeros((1, 6), np.int32)
    counts[0, 1] = 5
    with pytest.raises(ValueError) as raised:
        _verify(
            arguments["logits"],
            arguments["candidates"],
            arguments["drafts"],
            _settings(1, seed=np.array([_seed_with(lambda u: u > 0.99)], np.uint64)),
            query_length=arguments["query_length"],
            counts=counts,
        )
    assert str(raised.value) == message
    assert counts[0].tolist() == [0, 5, 0, 0, 0, 0]


def test_the_catalogue_declares_both_operators() -> None:
    draft = lookup("draft_sample", 1)
    verify = lookup("sample_verify_sampled", 1)
    plain = lookup("sample_verify", 1)
    assert draft is not None and verify is not None and plain is not None
    assert draft.inputs == ("logits", "temperature", "top_k", "top_p", "min_p", "seed", "step", "draft_probabilities")
    assert (draft.outputs, draft.optional_inputs, draft.updated_inputs) == (
        ("ids", "confidence"),
        ("token_rows",),
        ("draft_probabilities",),
    )
    assert draft.attributes == ("vocab_limit", "draft_index")
    assert verify.inputs == ("logits", "query_length", "candidate_ids", "draft_probabilities", *plain.inputs[3:])
    assert (verify.outputs, verify.optional_inputs, verify.updated_inputs, verify.attributes) == (
        ("ids", "accepted", "emitted", "pending"),
        ("logprob",),
        ("output_counts",),
        ("vocab_limit",),
    )


@pytest.mark.parametrize("op", ["draft_sample", "sample_verify_sampled"])
def test_the_summary_table_documents_the_signature(op: str) -> None:
    lines = (Path(__file__).resolve().parents[1] / "docs" / "ops.md").read_text().splitlines()
    cells = next(line for line in lines if line.startswith(f"| `{op}` |")).split("|")
    spec = lookup(op, 1)
    assert spec is not None
    names = [tuple(re.findall(r"`([a-z_]+)`", cell)) for cell in cells[2:6]]
    assert names == [spec.inputs, spec.outputs, spec.optional_inputs, spec.attributes]
    assert f"## {op} v1" in lines


# ----------------------------------------------------------------------------------------------
# exactness, statistically
# ----------------------------------------------------------------------------------------------


def test_sampled_drafts_emit_tokens_distributed_as_plain_sampling() -> None:
    """6000 independently seeded lanes at temperature 1 with a presence penalty of 0.8 (so the second
    token's distribution depends on the first), target logits TARGET_ROW at every position and a
    different draft distribution q (DRAFT_ROW). Round one drafts two tokens with ``draft_sample`` and
    verifies them; a lane that emitted one token runs round two (step 1, one fresh draft). Checked
    counts: the first token against p (6), each (first, second) pair against p(a) p(b | a) as plain
    sampling gives it with the penalty (36), and round one's accepted drafts (0, 1, 2) against speculative
    sampling's sum min(p, q) terms (3): 45 counts, each outside its Bernstein margin with probability
    below 1e-6 / 45, so the test fails by chance less than once in a million runs."""
    lanes, vocab = 6000, 6
    presence = np.full(lanes, 0.8, np.float32)
    settings = _settings(lanes, presence_penalty=presence)
    draft_logits = np.tile(DRAFT_ROW, (lanes, 1))
    counts = np.zeros((lanes, vocab), np.int32)

    def draft(step: int, index: int) -> rk.DraftSample:
        return rk.draft_sample(
            draft_logits, **_draft_settings(settings), step=np.full(lanes, step), draft_index=index, vocab_limit=vocab
        )

    drafted = [draft(0, 0), draft(0, 1)]
    first_round = _verify(
        np.tile(TARGET_ROW, (lanes * 3, 1)),
        np.stack([d.ids for d in drafted], axis=1),
        np.stack([d.probabilities for d in drafted], axis=1),
        settings,
        query_length=np.full(lanes, 3),
        counts=counts,
    )
    again = first_round.emitted == 1
    second_draft = draft(1, 0)
    second_round = _verify(
        np.tile(TARGET_ROW, (lanes * 2, 1)),
        second_draft.ids[:, None],
        second_draft.probabilities[:, None],
        settings,
        query_length=np.where(again, 2, 0),
        step=np.ones(lanes, np.int64),
        counts=counts,
        active=again.astype(np.uint8),
        width=2,
    )
    first = first_round.ids[:, 0]
    second = np.where(again, second_round.ids[:, 0], first_round.ids[:, 1])
    assert (first >= 0).all() and (second >= 0).all()
    assert (counts.sum(axis=1) == np.where(again, 1 + second_round.emitted, first_round.emitted)).all()

    no_counts = np.zeros((1, vocab), np.int32)

    def target(counted: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
        one = _settings(1, presence_penalty=presence[:1])
        del one["seed"]
        return rk.sample_probabilities(
            TARGET_ROW[None],
            **one,
            prompt_presence=np.zeros((1, vocab), np.uint8),
            output_counts=counted,
            vocab_limit=vocab,
        )[0]

    p = target(no_counts)
    given = [target(np.eye(vocab, dtype=np.int32)[a : a + 1]) for a in range(vocab)]
    q = drafted[0].probabilities[0].astype(np.float64)
    q /= q.sum()
    observed: dict[str, tuple[int, int, float]] = {}
    for a in range(vocab):
        observed[f"first={a}"] = (int((first == a).sum()), lanes, float(p[a]))
        for b in range(vocab):
            observed[f"pair={a},{b}"] = (int(((first == a) & (second == b)).sum()), lanes, float(p[a] * given[a][b]))
    accept_first = float(np.minimum(p, q).sum())
    accept_both = float(sum(min(p[a], q[a]) * np.minimum(given[a], q).sum() for a in range(vocab)))
    accepted = first_round.accepted
    observed["accepted=0"] = (int((accepted == 0).sum()), lanes, 1 - accept_first)
    observed["accepted=1"] = (int((accepted == 1).sum()), lanes, accept_first - accept_both)
    observed["accepted=2"] = (int((accepted == 2).sum()), lanes, accept_both)
    assert len(observed) == 45
    _check_counts(observed)
    assert 0.2 < accept_first < 0.8  # the draft differs from the target: both branches are exercised


# ----------------------------------------------------------------------------------------------
# a --draft-sampling sampled build on the reference backend
# ----------------------------------------------------------------------------------------------

NAMESPACE = "helios-tests/sampled-draft"
MAX_ROWS, PAGE_TOKENS, CONTEXT, DRAFT_TOKENS, VOCAB = 2, 4, 32, 3, 320
WIDTHS = (1, 2, 4)
BUILD_ARGS = [
    "--shape", "tiny", "--max-rows", str(MAX_ROWS), "--prefill-tokens", "8", "--page-tokens", str(PAGE_TOKENS),
    "--cache-pages", "32", "--context", str(CONTEXT), "--namespace", NAMESPACE, "--quiet",
    "--speculative", "self-draft", "--draft-tokens", str(DRAFT_TOKENS),
]  # fmt: skip
IDS, LOGPROBS = mf.COMPLETION_FIELD_SAMPLED_IDS, mf.COMPLETION_FIELD_SAMPLED_LOGPROBS
OFFERS, ACCEPTED = mf.COMPLETION_FIELD_OFFERS, mf.COMPLETION_FIELD_ACCEPTED_DRAFTS
EMITTED, CONSUMED = mf.COMPLETION_FIELD_EMITTED_TOKENS, mf.COMPLETION_FIELD_CONSUMED_TOKENS
CURSOR, CONFIDENCE = mf.COMPLETION_FIELD_DRAFT_CURSOR, mf.COMPLETION_FIELD_PROPOSAL_CONFIDENCE
PROMPT = (11, 200, 37, 5, 150, 99)
PAGES = (5, 9, 1, 14, 3, 20, 7, 11, 2)
STATE_ROW = 2
PADDING = {"state_rows": -1, "generation": -1, "token_rows": -1, "cache_slots": -1, "top_p": 1,
           "repetition_penalty": 1, "grammar_mask": -1}  # fmt: skip


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerifiedCore]:
    """A tiny core whose self-drafting programs sample their drafts (the first of two layers drafts)."""
    directory = tmp_path_factory.mktemp("sampled-draft")
    out = directory / "sampled.core"
    assert (
        ignition_main(["build", "llama-synthetic", "--out", str(out), *BUILD_ARGS, "--draft-sampling", "sampled"]) == 0
    )
    public = directory / "sampled.core.keys" / "signing.pub.pem"
    verified = open_core(out, TrustSettings(trust_keys=(public,), acceptance=NAMESPACE, core_key_path=None))
    yield verified
    verified.close()


def _graphs(core: VerifiedCore) -> dict[str, ct.GraphContract]:
    return {g.name: g for g in core.contract.model.graphs}


def _ops(core: VerifiedCore, program: str) -> list[str]:
    return [n.op.name for n in next(p for p in core.contract.execution.programs if p.name == program).nodes]


@pytest.mark.parametrize(("width", "rows"), [(w, b) for w in WIDTHS for b in (1, 2)])
def test_the_contract_reserves_the_sampled_draws(sampled: VerifiedCore, width: int, rows: int) -> None:
    graph = _graphs(sampled)[f"selfdraft_w{width}_b{rows}"]
    reservations = [(r.stream, r.draws_per_row) for r in graph.rng_reservations]
    if width == 1:
        assert reservations == [("target", 1), ("proposal", 0)]
    else:
        assert reservations == [("target", 2 * width - 1), ("proposal", DRAFT_TOKENS)]
    ops = _ops(sampled, graph.name)
    drafts = DRAFT_TOKENS if width > 1 else 0
    assert ops.count("draft_sample") == drafts and "draft_argmax" not in ops
    assert ops.count("sample_verify_sampled") == (1 if width > 1 else 0)
    assert ops.count("sample_verify") == (0 if width > 1 else 1)
    assert graph.extents.draft_tokens == drafts


def test_the_draft_steps_write_their_rows_of_the_draft_probabilities(sampled: VerifiedCore) -> None:
    program = next(p for p in sampled.contract.execution.programs if p.name == "selfdraft_w4_b2")
    steps = [n for n in program.nodes if n.op.name == "draft_sample"]
    assert [{a.name: a.int_value for a in n.attributes}["draft_index"] for n in steps] == [0, 1, 2]
    buffers = {b.name: [d.size for d in b.shape] for b in sampled.contract.execution.buffers}
    assert buffers["scratch.self_draft.draft_probabilities"] == [MAX_ROWS * DRAFT_TOKENS, VOCAB]


def _transport(backend: ReferenceBackend, frame: int, sequence: int) -> dict[str, npt.NDArray[Any]]:
    transport = backend.transport(frame)
    for name, array in transport.items():
        if name != "frame_index":
            array[...] = PADDING.get(name, 0)
    transport["submission_sequence"][0] = sequence
    transport["state_rows"][0] = STATE_ROW
    transport["generation"][0] = 17
    transport["page_table"][0, : len(PAGES)] = PAGES
    transport["sample_active"][0] = 1
    return transport


def _slot(position: int) -> int:
    return PAGES[position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS


def _prefilled(core: VerifiedCore) -> ReferenceBackend:
    """A backend with the prompt admitted and prefilled (greedy: the pending token is fixed)."""
    backend = ReferenceBackend(core.contract, core.core, cache_pages=40, state_rows=4)
    transport = _transport(backend, 0, 1)
    transport["prompt_histogram"][0] = np.bincount(PROMPT, minlength=VOCAB)
    backend.run("initialize", 0)
    transport = _transport(backend, 0, 1)
    transport["query_length"][0] = len(PROMPT)
    for index, token in enumerate(PROMPT):
        transport["input_ids"][index], transport["positions"][index] = token, index
        transport["token_rows"][index], transport["cache_slots"][index] = 0, _slot(index)
    backend.run("prefill_p8", 0)
    return backend


def _sampled_round(backend: ReferenceBackend, seed: int, frame: int, *, top_k: int) -> Mapping[int, npt.NDArray[Any]]:
    """One selfdraft_w4_b1 round of the prefilled request at temperature 1 with ``seed``."""
    record = backend.completion(frame)
    for array in record.values():
        array[...] = 7  # stale values: the program must overwrite what it reports
    transport = _transport(backend, frame, 40 + frame)
    transport["consumed"][0], transport["prefix_limit"][0] = len(PROMPT), 4
    transport["sampling_step"][0] = 1
    transport["temperature"][0], transport["top_k"][0], transport["seed"][0] = 1.0, top_k, seed
    backend.run("selfdraft_w4_b1", frame)
    return record


def test_a_sampled_round_reports_a_consistent_record(sampled: VerifiedCore) -> None:
    backend = _prefilled(sampled)
    record = _sampled_round(backend, seed=5, frame=1, top_k=0)
    offers, accepted, emitted = int(record[OFFERS][0]), int(record[ACCEPTED][0]), int(record[EMITTED][0])
    assert emitted == accepted + 1 and 0 <= accepted <= offers <= 2  # P = 1 + ceil(3 / 2) = 3 rows
    tokens = record[IDS][0].tolist()
    assert all(0 <= t < VOCAB for t in tokens[:emitted]) and tokens[emitted:] == [-1] * (4 - emitted)
    assert int(record[CONSUMED][0]) == int(record[CURSOR][0]) == len(PROMPT) + emitted
    assert int(backend.buffers["pending_tokens"][STATE_ROW, 0]) == tokens[emitted - 1]
    # The record's confidence is the draft's probability of each drafted token (its q row's entry).
    drafted = backend.buffers["scratch.self_draft.step_ids"][:DRAFT_TOKENS]
    q_rows = backend.buffers["scratch.self_draft.draft_probabilities"][:DRAFT_TOKENS]
    confidence = record[CONFIDENCE][1, 0, :DRAFT_TOKENS]
    np.testing.assert_array_equal(confidence, q_rows[np.arange(DRAFT_TOKENS), drafted])
    assert ((confidence > 0) & (confidence <= 1)).all()
    np.testing.assert_allclose(q_rows.sum(axis=1), 1.0, rtol=1e-5)
    assert (record[CONFIDENCE][0] == 7).all()  # the other frame's half is untouched


def test_a_sampled_round_emits_plain_decode_s_first_token_distribution(sampled: VerifiedCore) -> None:
    """The first token a sampled round emits (sampling step 1) against the distribution plain decode
    samples that token from (``decode_b1``'s logits, temperature 1, top_k 4), over 400 seeds: the four
    kept ids' counts, each outside its Bernstein margin with probability below 1e-6 / 4, so the test
    fails by chance less than once in a million runs. The draft (the first layer, top_k 4 of its own
    logits) keeps different ids than the target, so acceptances and residual draws both occur."""
    backend = _prefilled(sampled)
    pending = int(backend.buffers["pending_tokens"][STATE_ROW, 0])
    transport = _transport(backend, 1, 2)
    transport["query_length"][0], transport["sampling_step"][0] = 1, 1
    transport["positions"][0], transport["token_rows"][0] = len(PROMPT), 0
    transport["cache_slots"][0] = _slot(len(PROMPT))
    transport["temperature"][0], transport["top_k"][0] = 1.0, 4
    backend.run("decode_b1", 1)
    decode_logits = backend.buffers["scratch.logits"][:1].copy()
    one = _settings(1, top_k=np.array([4], np.int32))
    del one["seed"]
    p = rk.sample_probabilities(
        decode_logits,
        **one,
        prompt_presence=np.zeros((1, decode_logits.shape[1]), np.uint8),
        output_counts=np.zeros((1, decode_logits.shape[1]), np.int32),
        vocab_limit=VOCAB,
    )[0]
    kept = np.flatnonzero(p)
    assert kept.size == 4
    rounds, first, accepted = 400, [], []
    for seed in range(1, rounds + 1):
        backend.buffers["pending_tokens"][STATE_ROW, 0] = pending  # every round starts from the same state
        record = _sampled_round(backend, seed=seed * 104729, frame=seed % 2, top_k=4)
        first.append(int(record[IDS][0, 0]))
        accepted.append(int(record[ACCEPTED][0]))
    np.testing.assert_allclose(backend.buffers["scratch.all_logits"][0], decode_logits[0], rtol=1e-5, atol=1e-5)
    tokens = np.array(first)
    assert set(tokens.tolist()) <= set(kept.tolist())
    _check_counts({f"token={t}": (int((tokens == t).sum()), rounds, float(p[t])) for t in kept})
    assert 0 < sum(a > 0 for a in accepted) < rounds  # both branches occurred


def test_draft_sampling_needs_self_drafting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "refused.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet", "--draft-sampling", "sampled"]
    assert ignition_main(argv) == 1
    assert capsys.readouterr().err == "ignition: error: --draft-sampling needs --speculative self-draft\n"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# served by the engine
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrustSettings]:
    """A tiny two-layer core whose one-layer draft samples its tokens, widths 1, 2 and 4."""
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities, speculative_widths
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    directory = tmp_path_factory.mktemp("sampled-draft-serving")
    keys = generate_keys(directory / "keys")
    core = directory / "sampled-draft.core"
    caps = Capacities(
        max_rows=4, prefill_tokens=(32,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=96, context=160,
        snapshots=0, speculative_widths=speculative_widths(3), speculation="self-draft", draft_tokens=3,
        draft_layers=1, draft_sampling="sampled",
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=5), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace="tests/sampled-draft",
    )  # fmt: skip
    return core, TrustSettings((keys["public"],), "tests/sampled-draft", None)


def _serve_outputs(
    served_core: tuple[Path, TrustSettings], sampling: Any, **options: Any
) -> tuple[dict[str, list[Any]], Any]:
    from helios_core.contract import LoadOptions
    from helios_core.runtime.messages import PreparedRequest, TokenEvent
    from helios_core.runtime.startup import start

    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41], [7, 7, 8, 7, 7, 8, 7]]
    model = start(*served_core, LoadOptions(**options), backend="reference")
    try:
        requests = [PreparedRequest(f"r{i}", prompt, 24, sampling, ignore_eos=True) for i, prompt in enumerate(prompts)]
        streams = [model.engine.submit(request) for request in requests]
        outputs = {
            stream.request_id: [e.token_id if isinstance(e, TokenEvent) else e for e in stream] for stream in streams
        }
        return outputs, model.engine.statistics()
    finally:
        model.close()


def test_served_greedy_requests_emit_plain_decode_s_tokens(served_core: tuple[Path, TrustSettings]) -> None:
    from helios_core.runtime.messages import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    expected, _ = _serve_outputs(served_core, greedy, speculative_width=1)  # no speculative rounds
    drafted, stats = _serve_outputs(served_core, greedy)
    assert drafted == expected
    assert sum(stats.proposals_offered.values()) > 0


def test_served_sampled_requests_finish_with_accepted_drafts(served_core: tuple[Path, TrustSettings]) -> None:
    from helios_core.runtime.messages import Finished, SamplingParams

    outputs, stats = _serve_outputs(served_core, SamplingParams(temperature=1.0, top_k=4, seed=5))
    again, _ = _serve_outputs(served_core, SamplingParams(temperature=1.0, top_k=4, seed=5))
    assert outputs == again  # seeded: serving the same requests again emits the same tokens
    for events in outputs.values():
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 24
        assert all(0 <= token < VOCAB for token in events[:-1])
    offered, accepted = sum(stats.proposals_offered.values()), sum(stats.drafts_accepted.values())
    assert 0 < accepted < offered
