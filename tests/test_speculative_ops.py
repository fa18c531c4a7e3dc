"""The speculative-generation operators: packing copied candidates, sampling-based verification, completion.

``sample_verify`` is checked against its definition: the tokens (and sampling state) of repeated
one-row ``sample`` nodes at consecutive steps, for candidates that all match, match partly or not at
all, greedy and at temperature 0.8. The operators run through the reference backend's node builders
(``_ADAPTERS``) and the kernel functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.reference import _ADAPTERS, _Bound, _Node
from helios_core.errors import ContractError
from helios_core.ops.catalogue import lookup, sample_inputs
from helios_core.sampling import SAMPLING_PARAMETERS
from helios_core.wire import manifest_pb2 as mf

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 24
STATE_ROWS = 4
SETTINGS = tuple(p.kernel_input for p in SAMPLING_PARAMETERS)

_WIRE_DTYPES = {
    np.dtype(np.float32): mf.DTYPE_F32,
    np.dtype(np.int32): mf.DTYPE_I32,
    np.dtype(np.int64): mf.DTYPE_I64,
    np.dtype(np.uint8): mf.DTYPE_U8,
    np.dtype(np.uint64): mf.DTYPE_U64,
}


def _node(op: str, arrays: Mapping[str, np.ndarray], **attributes: int) -> Any:
    """The step of one reference node of ``op`` over ``arrays`` (bound as whole buffers)."""
    args = {name: _Bound(array, _WIRE_DTYPES[array.dtype]) for name, array in arrays.items()}
    return _ADAPTERS[(op, 1)](_Node(f"node {op}", args, attributes))


def _lane_settings(lanes: int, temperature: float) -> dict[str, np.ndarray]:
    """Per-lane sampling settings with penalties, so each token depends on the counts before it."""
    return {
        "temperature": np.full(lanes, temperature, np.float32),
        "top_p": np.full(lanes, 0.95, np.float32),
        "top_k": np.full(lanes, 12, np.int32),
        "min_p": np.zeros(lanes, np.float32),
        "repetition_penalty": np.full(lanes, 1.3, np.float32),
        "frequency_penalty": np.full(lanes, 0.9, np.float32),
        "presence_penalty": np.full(lanes, 0.4, np.float32),
        "seed": np.arange(11, 11 + lanes, dtype=np.uint64) * np.uint64(7919),
    }


def _state() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    presence = (rng.random((STATE_ROWS, VOCAB)) < 0.2).astype(np.uint8)
    counts = rng.integers(0, 2, size=(STATE_ROWS, VOCAB)).astype(np.int32)
    return presence, counts


def _lane_logits(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Rows that share one strong preference: without the penalties greedy would repeat one token."""
    base = rng.standard_normal(VOCAB).astype(np.float32) * 2.0
    return (base + 0.3 * rng.standard_normal((tokens, VOCAB))).astype(np.float32)


def _plain_decode(
    logits: np.ndarray,
    settings: Mapping[str, np.ndarray],
    lane: int,
    presence: np.ndarray,
    counts: np.ndarray,
    row: int,
    step: int,
) -> tuple[list[int], list[float]]:
    """One-token ``sample`` nodes, one per logits row, at steps ``step, step + 1, ...`` (updates counts)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for offset in range(logits.shape[0]):
        ids, logprob = np.zeros((1, 1), np.int32), np.zeros((1, 1), np.float32)
        arrays = {
            "logits": logits[offset : offset + 1].copy(),
            **{name: settings[name][lane : lane + 1].copy() for name in SETTINGS},
            "prompt_presence": presence,
            "output_counts": counts,
            "rows": np.array([row], np.int32),
            "step": np.array([step + offset], np.int64),
            "active": np.ones(1, np.uint8),
            "ids": ids,
            "logprob": logprob,
        }
        _node("sample", arrays, vocab_limit=VOCAB - 2)()
        tokens.append(int(ids[0, 0]))
        logprobs.append(float(logprob[0, 0]))
    return tokens, logprobs


class Round:
    """A packed speculative round of three lanes: rows, steps, logits, and each lane's plain tokens."""

    capacity = 4
    width = 5

    def __init__(self, temperature: float, offers: tuple[int, ...]) -> None:
        rng = np.random.default_rng(int(temperature * 10) + 3)
        self.lanes = len(offers)
        self.query_length = np.array([n + 1 for n in offers], np.int32)
        self.rows = np.array([2, 0, 3][: self.lanes], np.int32)
        self.step = np.array([0, 7, 3][: self.lanes], np.int64)
        self.settings = _lane_settings(self.lanes, temperature)
        self.presence, self.counts = _state()
        blocks = [_lane_logits(rng, int(length)) for length in self.query_length]
        self.logits = np.concatenate([*blocks, rng.standard_normal((2, VOCAB)).astype(np.float32)])
        self.starts = np.concatenate([[0], np.cumsum(self.query_length)[:-1]]).astype(int)
        # what plain decode emits from every row of each lane (the candidates decide how far it gets)
        self.plain = [self.decode(lane, int(length))[0] for lane, length in enumerate(self.query_length)]

    def decode(self, lane: int, tokens: int) -> tuple[list[int], list[float], np.ndarray]:
        """Plain decode of ``tokens`` tokens of ``lane`` from the round's state: tokens, logprobs, counts."""
        counts = self.counts.copy()
        start = self.starts[lane]
        ids, logprobs = _plain_decode(
            self.logits[start : start + tokens],
            self.settings,
            lane,
            self.presence,
            counts,
            int(self.rows[lane]),
            int(self.step[lane]),
        )
        return ids, logprobs, counts

    def verify(self, candidates: np.ndarray, active: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Run a ``sample_verify`` node; the outputs and the updated counts."""
        outputs = {
            "ids": np.full((self.lanes, self.width), 99, np.int32),
            "accepted": np.full(self.lanes, 99, np.int32),
            "emitted": np.full(self.lanes, 99, np.int32),
            "pending": np.full(self.lanes, 99, np.int32),
            "logprob": np.full((self.lanes, self.width), 99.0, np.float32),
        }
        counts = self.counts.copy()
        arrays = {
            "logits": self.logits,
            "query_length": self.query_length,
            "candidate_ids": candidates,
            **self.settings,
            "prompt_presence": self.presence,
            "output_counts": counts,
            "rows": self.rows,
            "step": self.step,
            "active": np.ones(self.lanes, np.uint8) if active is None else active,
            **outputs,
        }
        _node("sample_verify", arrays, vocab_limit=VOCAB - 2)()
        return {**outputs, "output_counts": counts}


def _mismatch(token: int) -> int:
    return (token + 5) % (VOCAB - 2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_emits_the_plain_decode_tokens_for_full_partial_and_no_matches(temperature: float) -> None:
    plan = Round(temperature, offers=(4, 3, 2))
    full, partial, none = plan.plain
    candidates = np.full((3, plan.capacity), -7, np.int32)
    candidates[0, :4] = full[:4]  # every candidate matches: the fifth token is the bonus
    candidates[1, :3] = [partial[0], _mismatch(partial[1]), partial[2]]  # the second differs
    candidates[2, :2] = [_mismatch(none[0]), none[1]]  # the first differs
    got = plan.verify(candidates)

    emitted = [5, 2, 1]
    assert got["accepted"].tolist() == [4, 1, 0]
    assert got["emitted"].tolist() == emitted
    expected_counts = plan.counts.copy()
    for lane, count in enumerate(emitted):
        tokens, logprobs, counts = plan.decode(lane, count)
        assert got["ids"][lane].tolist() == tokens + [-1] * (plan.width - count)
        assert got["logprob"][lane].tolist() == logprobs + [0.0] * (plan.width - count)
        assert got["pending"][lane] == tokens[-1]
        row = plan.rows[lane]
        expected_counts[row] = counts[row]
    assert np.array_equal(got["output_counts"], expected_counts)
    # The penalties make the counts matter: the greedy lane does not repeat one token.
    assert len(set(full)) > 1


def test_verify_draws_token_k_of_a_request_with_counter_k() -> None:
    plan = Round(0.8, offers=(4,))
    candidates = np.array([plan.plain[0][:4]], np.int32)
    got = plan.verify(candidates)
    assert got["ids"][0].tolist() == plan.plain[0]
    # One row at a time, from step 7 instead of step 0, gives other tokens: the counter is step + j.
    moved = _plain_decode(plan.logits[:5], plan.settings, 0, plan.presence, plan.counts.copy(), 2, 7)[0]
    assert moved != plan.plain[0]


def test_verify_reads_no_logits_past_the_last_position_a_lane_reaches() -> None:
    plan = Round(0.0, offers=(3,))
    plan.logits[1:4] = np.nan  # rows of candidates after a mismatch at the first one
    candidates = np.array([[_mismatch(plan.plain[0][0]), 1, 2, 3]], np.int32)
    got = plan.verify(candidates)
    assert got["ids"][0].tolist() == [plan.plain[0][0], -1, -1, -1, -1]
    assert (got["accepted"][0], got["emitted"][0]) == (0, 1)


def test_inactive_lanes_emit_nothing_and_keep_their_counts() -> None:
    plan = Round(0.8, offers=(2, 3))
    candidates = np.zeros((2, plan.capacity), np.int32)
    candidates[0, :2] = plan.plain[0][:2]
    got = plan.verify(candidates, active=np.array([1, 0], np.uint8))
    assert got["ids"][1].tolist() == [-1] * plan.width
    assert got["logprob"][1].tolist() == [0.0] * plan.width
    assert (got["accepted"][1], got["emitted"][1], got["pending"][1]) == (0, 0, -1)
    assert np.array_equal(got["output_counts"][plan.rows[1]], plan.counts[plan.rows[1]])
    # the active lane's packed block still starts after its own three tokens
    assert got["ids"][0].tolist() == plan.plain[0] + [-1, -1]


def test_a_lane_without_candidates_samples_one_token() -> None:
    plan = Round(0.8, offers=(0,))
    got = plan.verify(np.zeros((1, plan.capacity), np.int32))
    assert got["ids"][0].tolist() == plan.plain[0] + [-1] * 4
    assert (got["accepted"][0], got["emitted"][0], got["pending"][0]) == (0, 1, plan.plain[0][0])


def _masks(rng: np.random.Generator, rows: int) -> np.ndarray:
    """``[rows, 1]`` int32 grammar masks allowing about half of the sampled ids (always at least two)."""
    allowed = rng.random((rows, VOCAB)) < 0.5
    allowed[:, VOCAB - 2 :] = False
    allowed[np.arange(rows), rng.integers(0, VOCAB - 2, rows)] = True
    allowed[np.arange(rows), rng.integers(0, VOCAB - 2, rows)] = True
    bits = (allowed.astype(np.uint64) << np.arange(VOCAB, dtype=np.uint64)).sum(axis=1)
    words: np.ndarray = bits.astype(np.uint32).view(np.int32).reshape(rows, 1)
    return words


def _masked_decode(plan: Round, lane: int, masks: np.ndarray, tokens: int) -> tuple[list[int], list[float]]:
    """One-token ``sample`` nodes of ``lane`` under its packed rows' masks, as constrained decode runs."""
    counts, start = plan.counts.copy(), int(plan.starts[lane])
    found: tuple[list[int], list[float]] = ([], [])
    for offset in range(tokens):
        ids, logprob = np.zeros((1, 1), np.int32), np.zeros((1, 1), np.float32)
        arrays = {
            "logits": plan.logits[start + offset : start + offset + 1].copy(),
            **{name: plan.settings[name][lane : lane + 1].copy() for name in SETTINGS},
            "prompt_presence": plan.presence,
            "output_counts": counts,
            "rows": plan.rows[lane : lane + 1].copy(),
            "step": np.array([plan.step[lane] + offset], np.int64),
            "active": np.ones(1, np.uint8),
            "allowed_mask": masks[start + offset : start + offset + 1].copy(),
            "constrained": np.ones(1, np.uint8),
            "ids": ids,
            "logprob": logprob,
        }
        _node("sample", arrays, vocab_limit=VOCAB - 2)()
        found[0].append(int(ids[0, 0]))
        found[1].append(float(logprob[0, 0]))
    return found


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_samples_each_position_of_a_constrained_lane_under_its_mask_row(temperature: float) -> None:
    """Lanes 0 and 2 are constrained (lane 0 accepts every candidate, lane 2 stops at its second), lane 1
    is not: its rows of the mask (which would change its tokens) are never applied."""
    plan = Round(temperature, offers=(4, 3, 2))
    masks = _masks(np.random.default_rng(17), plan.logits.shape[0])
    constrained = np.array([1, 0, 1], np.uint8)
    full = _masked_decode(plan, 0, masks, 5)[0]
    stopping = _masked_decode(plan, 2, masks, 3)[0]
    candidates = np.full((3, plan.capacity), -7, np.int32)
    candidates[0, :4] = full[:4]
    candidates[1, :3] = plan.plain[1][:3]
    candidates[2, :2] = [stopping[0], _mismatch(stopping[1])]
    outputs = {
        "ids": np.full((3, plan.width), 99, np.int32),
        "accepted": np.full(3, 99, np.int32),
        "emitted": np.full(3, 99, np.int32),
        "pending": np.full(3, 99, np.int32),
        "logprob": np.full((3, plan.width), 99.0, np.float32),
    }
    counts = plan.counts.copy()
    arrays = {
        "logits": plan.logits,
        "query_length": plan.query_length,
        "candidate_ids": candidates,
        **plan.settings,
        "prompt_presence": plan.presence,
        "output_counts": counts,
        "rows": plan.rows,
        "step": plan.step,
        "active": np.ones(3, np.uint8),
        "allowed_mask": masks,
        "constrained": constrained,
        **outputs,
    }
    _node("sample_verify", arrays, vocab_limit=VOCAB - 2)()
    assert outputs["accepted"].tolist() == [4, 3, 1]
    for lane, expected in ((0, _masked_decode(plan, 0, masks, 5)), (2, _masked_decode(plan, 2, masks, 2))):
        emitted = len(expected[0])
        assert outputs["ids"][lane].tolist() == expected[0] + [-1] * (plan.width - emitted)
        assert outputs["logprob"][lane].tolist() == expected[1] + [0.0] * (plan.width - emitted)
    assert outputs["ids"][1].tolist() == plan.plain[1] + [-1]
    # the masks matter: the constrained lanes' tokens are not those of unmasked decode
    assert full != plan.plain[0]
    # every emitted token of a constrained lane is allowed by its position's mask row
    for lane in (0, 2):
        for position, token in enumerate(outputs["ids"][lane][: outputs["emitted"][lane]].tolist()):
            word = int(masks[plan.starts[lane] + position, 0]) & 0xFFFFFFFF
            assert (word >> token) & 1


def test_verify_checks_its_grammar_inputs() -> None:
    plan = Round(0.0, offers=(2, 1))
    masks = np.full((plan.logits.shape[0], 1), -1, np.int32)
    with pytest.raises(ValueError, match="allowed_mask and constrained must be given together"):
        _verify_kernel(plan, allowed_mask=masks)
    flags = np.ones(2, np.uint8)
    with pytest.raises(ValueError, match=r"allowed_mask: expected \[>= 5, >= 1\] words"):
        _verify_kernel(plan, allowed_mask=masks[:4], constrained=flags)
    with pytest.raises(ValueError, match="allowed_mask: expected int32 words, got dtype uint8"):
        _verify_kernel(plan, allowed_mask=masks.astype(np.uint8), constrained=flags)
    no_token = np.zeros_like(masks)
    before = plan.counts.copy()
    with pytest.raises(ValueError, match="row 0 has no sampleable id after masking"):
        _verify_kernel(plan, allowed_mask=no_token, constrained=flags)
    assert np.array_equal(plan.counts, before)


def test_a_position_the_grammar_leaves_nothing_ends_its_lane_alone_with_allow_empty_rows() -> None:
    """Lane 0 copies its plain tokens, so it reaches position 1, whose mask allows nothing: that position's id
    is -1 and the lane ends there (accepted 1, emitted 2, pending -1, only position 0's token counted). Lane 1,
    unconstrained, verifies exactly as it does with no masks at all."""
    plan = Round(0.0, offers=(2, 1))
    candidates = np.zeros((plan.lanes, plan.capacity), np.int32)
    candidates[0, :2] = plan.plain[0][:2]
    masks = np.full((plan.logits.shape[0], 1), -1, np.int32)
    masks[plan.starts[0] + 1] = 0  # lane 0's position 1: nothing allowed
    flags = np.array([1, 0], np.uint8)
    unmasked_counts = plan.counts.copy()
    unmasked = _verify_kernel(plan, candidate_ids=candidates, output_counts=unmasked_counts)
    counts = plan.counts.copy()
    result = _verify_kernel(
        plan, candidate_ids=candidates, output_counts=counts, allowed_mask=masks, constrained=flags,
        allow_empty_rows=True,
    )  # fmt: skip
    assert result.ids[0].tolist() == [plan.plain[0][0], -1, -1, -1, -1]
    assert (int(result.accepted[0]), int(result.emitted[0]), int(result.pending[0])) == (1, 2, -1)
    assert float(result.logprobs[0, 1]) == 0.0
    row = int(plan.rows[0])
    want = plan.counts[row].copy()
    want[plan.plain[0][0]] += 1
    assert np.array_equal(counts[row], want)
    for field in ("ids", "logprobs", "accepted", "emitted", "pending"):
        assert np.array_equal(getattr(result, field)[1], getattr(unmasked, field)[1]), field
    other = int(plan.rows[1])
    assert np.array_equal(counts[other], unmasked_counts[other])


def _verify_kernel(plan: Round, **overrides: Any) -> rk.VerifyResult:
    arguments: dict[str, Any] = {
        "query_length": plan.query_length,
        "candidate_ids": np.zeros((plan.lanes, plan.capacity), np.int32),
        "settings": plan.settings,
        "prompt_presence": plan.presence,
        "output_counts": plan.counts,
        "rows": plan.rows,
        "step": plan.step,
        "active": np.ones(plan.lanes, np.uint8),
        "vocab_limit": VOCAB,
        "width": plan.width,
    }
    arguments.update(overrides)
    logits = arguments.pop("logits", plan.logits)
    return rk.sample_verify(logits, **arguments)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"query_length": np.array([6, 1], np.int32)}, "lane 0 offers 5 candidates, candidate_ids holds 4"),
        ({"query_length": np.array([5, 4], np.int32)}, "9 packed tokens exceed the 7 rows of logits"),
        ({"query_length": np.array([0, 1], np.int32)}, "active lane 0 has no packed token"),
        ({"query_length": np.array([-1, 1], np.int32)}, "lane 0 has a negative length"),
        ({"rows": np.array([4, 0], np.int32)}, r"a lane with tokens names a state row outside \[0, 4\)"),
        ({"width": 4}, "width: 4 cannot hold a pending token and 4 candidates"),
        ({"candidate_ids": np.zeros((3, 4), np.int32)}, r"query_length: expected shape \(3,\)"),
        ({"step": np.array([0], np.int64)}, r"step: expected shape \(2,\)"),
        ({"settings": {"temperature": np.ones(2, np.float32)}}, "settings: expected exactly"),
    ],
)
def test_verify_rejects_bad_input_before_sampling(overrides: dict[str, Any], message: str) -> None:
    plan = Round(0.8, offers=(2, 1))
    before = plan.counts.copy()
    with pytest.raises(ValueError, match=message):
        _verify_kernel(plan, **overrides)
    assert np.array_equal(plan.counts, before)


def test_verify_restores_the_counts_when_sampling_fails() -> None:
    plan = Round(0.0, offers=(2, 1))
    candidates = np.zeros((2, plan.capacity), np.int32)
    candidates[0, :2] = plan.plain[0][:2]
    plan.logits[plan.starts[1]] = np.nan  # the second lane's only row; the first lane sampled three tokens
    before = plan.counts.copy()
    with pytest.raises(ValueError, match="logits: contains NaN"):
        _verify_kernel(plan, candidate_ids=candidates)
    assert np.array_equal(plan.counts, before)


def test_verify_node_checks_its_shapes_at_load() -> None:
    plan = Round(0.8, offers=(2, 1))
    base: dict[str, np.ndarray] = {
        "logits": plan.logits,
        "query_length": plan.query_length,
        "candidate_ids": np.zeros((2, 4), np.int32),
        **plan.settings,
        "prompt_presence": plan.presence,
        "output_counts": plan.counts,
        "rows": plan.rows,
        "step": plan.step,
        "active": np.ones(2, np.uint8),
        "ids": np.zeros((2, 5), np.int32),
        "accepted": np.zeros(2, np.int32),
        "emitted": np.zeros(2, np.int32),
        "pending": np.zeros(2, np.int32),
    }
    cases: list[tuple[dict[str, np.ndarray], str]] = [
        ({"ids": np.zeros((2, 4), np.int32)}, r"ids \(2, 4\) must be \[2, W\] with W >= 5"),
        ({"candidate_ids": np.zeros((3, 4), np.int32)}, r"candidate_ids \(3, 4\) must be \[lanes, capacity\]"),
        ({"logprob": np.zeros((2, 4), np.float32)}, r"logprob of shape \(2, 4\) does not match ids \(2, 5\)"),
        ({"pending": np.zeros(3, np.int32)}, "pending holds 3 elements, the node has 2 lanes"),
        ({"top_k": np.zeros(1, np.int32)}, "top_k holds 1 elements, the node has 2 lanes"),
        ({"prompt_presence": np.zeros((3, VOCAB), np.uint8)}, "prompt_presence .* must be equal"),
        ({"allowed_mask": np.zeros((7, 1), np.int32)}, "allowed_mask and constrained must be given together"),
        (
            {"allowed_mask": np.zeros((7, 1), np.int32), "constrained": np.zeros(3, np.uint8)},
            "constrained holds 3 elements, the node has 2 lanes",
        ),
    ]
    for change, message in cases:
        with pytest.raises(ContractError, match=f"node sample_verify: {message}"):
            _node("sample_verify", {**base, **change}, vocab_limit=VOCAB)
    with pytest.raises(ContractError, match="lacks the attribute 'vocab_limit'"):
        _node("sample_verify", base)


# ------------------------------------------------------------------------------------------------
# speculative_inputs
# ------------------------------------------------------------------------------------------------


def _inputs_arrays(query_length: list[int], rows: list[int], packed: int = 9) -> dict[str, np.ndarray]:
    return {
        "pending_tokens": np.array([[40], [41], [42], [43]], np.int32),
        "rows": np.array(rows, np.int32),
        "candidate_ids": np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]], np.int32),
        "query_length": np.array(query_length, np.int32),
        "ids": np.full(packed, -5, np.int32),
    }


def test_speculative_inputs_packs_pending_tokens_and_candidates() -> None:
    arrays = _inputs_arrays([3, 0, 4], [2, -1, 0])
    _node("speculative_inputs", arrays)()
    assert arrays["ids"].tolist() == [42, 10, 11, 40, 30, 31, 32, -5, -5]
    flat = {**_inputs_arrays([1, 2, 0], [3, 1, -1], packed=4), "pending_tokens": np.array([50, 51, 52, 53], np.int32)}
    _node("speculative_inputs", flat)()
    assert flat["ids"].tolist() == [53, 51, 20, -5]


@pytest.mark.parametrize(
    ("query_length", "rows", "message"),
    [
        ([5, 0, 0], [0, 0, 0], "lane 0 offers 4 candidates, candidate_ids holds 3"),
        ([4, 4, 2], [0, 1, 2], "10 packed tokens exceed the 9 entries of ids"),
        ([1, 1, 0], [0, 4, -1], r"a lane with tokens names a state row outside \[0, 4\)"),
        ([1, 1, 0], [-1, 0, 0], r"a lane with tokens names a state row outside \[0, 4\)"),
        ([1, -1, 0], [0, 0, 0], "lane 1 has a negative length"),
    ],
)
def test_speculative_inputs_rejects_bad_rounds_without_writing(
    query_length: list[int], rows: list[int], message: str
) -> None:
    arrays = _inputs_arrays(query_length, rows)
    with pytest.raises(ValueError, match=f"node speculative_inputs: .*{message}"):
        _node("speculative_inputs", arrays)()
    assert arrays["ids"].tolist() == [-5] * 9


def test_speculative_inputs_node_checks_its_shapes_at_load() -> None:
    arrays = _inputs_arrays([1, 1, 1], [0, 1, 2])
    with pytest.raises(ContractError, match=r"candidate_ids \(2, 3\) must be \[lanes, capacity\] for 3 lanes"):
        _node("speculative_inputs", {**arrays, "candidate_ids": np.zeros((2, 3), np.int32)})
    with pytest.raises(ContractError, match=r"pending_tokens \(4, 2\) must be \[rows\] or \[rows, 1\]"):
        _node("speculative_inputs", {**arrays, "pending_tokens": np.zeros((4, 2), np.int32)})
    with pytest.raises(ContractError, match="rows holds 2 elements, the node has 3 lanes"):
        _node("speculative_inputs", {**arrays, "rows": np.zeros(2, np.int32)})


# ------------------------------------------------------------------------------------------------
# completion_speculative
# ------------------------------------------------------------------------------------------------


def _completion_arrays(lanes: int = 4) -> dict[str, np.ndarray]:
    return {
        "generation": np.array([5, 6, 7, 8][:lanes], np.int32),
        # lane 0 emitted 3 of 4, lane 1 idle, lane 2 all 2 offers accepted, lane 3 has tokens but sampled none
        "query_length": np.array([4, 0, 3, 2][:lanes], np.int32),
        "accepted": np.array([2, 0, 2, 0][:lanes], np.int32),
        "emitted": np.array([3, 0, 3, 0][:lanes], np.int32),
        "positions": np.array([10, 11, 12, 13, 30, 31, 32, 50, 51, 0], np.int32),
        "submission_sequence": np.array([77], np.int64),
        **{
            name: np.full(lanes, 99, np.int32)
            for name in (
                "out_generation",
                "out_offers",
                "out_accepted",
                "out_emitted",
                "out_consumed",
                "out_draft_cursor",
                "out_reserved",
            )
        },
        "out_sequence": np.zeros(1, np.int64),
    }


def test_completion_speculative_writes_the_record() -> None:
    arrays = _completion_arrays()
    _node("completion_speculative", arrays)()
    assert arrays["out_generation"].tolist() == [5, 6, 7, 8]
    assert arrays["out_offers"].tolist() == [3, 0, 2, 1]
    assert arrays["out_accepted"].tolist() == [2, 0, 2, 0]
    assert arrays["out_emitted"].tolist() == [3, 0, 3, 0]
    assert arrays["out_consumed"].tolist() == [13, 0, 33, 52]
    assert arrays["out_draft_cursor"].tolist() == [-1] * 4
    assert arrays["out_reserved"].tolist() == [-1] * 4
    assert arrays["out_sequence"].tolist() == [77]


def test_completion_speculative_checks_sizes() -> None:
    arrays = _completion_arrays()
    with pytest.raises(ContractError, match="out_offers holds 3 elements, the node has 4 lanes"):
        _node("completion_speculative", {**arrays, "out_offers": np.zeros(3, np.int32)})
    with pytest.raises(ContractError, match="accepted holds 5 elements, the node has 4 lanes"):
        _node("completion_speculative", {**arrays, "accepted": np.zeros(5, np.int32)})
    step = _node("completion_speculative", {**arrays, "query_length": np.array([4, 4, 3, 2], np.int32)})
    with pytest.raises(ValueError, match="13 packed tokens exceed the 10 positions"):
        step()


# ------------------------------------------------------------------------------------------------
# the catalogue and its documentation
# ------------------------------------------------------------------------------------------------


def test_catalogue_signatures() -> None:
    inputs = lookup("speculative_inputs", 1)
    verify = lookup("sample_verify", 1)
    completion = lookup("completion_speculative", 1)
    assert inputs is not None and verify is not None and completion is not None
    assert (inputs.inputs, inputs.outputs) == (("pending_tokens", "rows", "candidate_ids", "query_length"), ("ids",))
    assert verify.inputs == ("logits", "query_length", "candidate_ids", *sample_inputs()[1:])
    assert verify.outputs == ("ids", "accepted", "emitted", "pending")
    assert verify.optional_inputs == ("allowed_mask", "constrained", "logprob")
    assert (verify.updated_inputs, verify.attributes) == (("output_counts",), ("vocab_limit",))
    assert completion.inputs == (
        "generation",
        "query_length",
        "accepted",
        "emitted",
        "positions",
        "submission_sequence",
    )
    assert completion.outputs == (
        "out_generation",
        "out_offers",
        "out_accepted",
        "out_emitted",
        "out_consumed",
        "out_draft_cursor",
        "out_reserved",
        "out_sequence",
    )


@pytest.mark.parametrize("op", ["speculative_inputs", "sample_verify", "completion_speculative"])
def test_the_summary_table_documents_the_signature(op: str) -> None:
    lines = (ROOT / "docs" / "ops.md").read_text().splitlines()
    cells = next(line for line in lines if line.startswith(f"| `{op}` |")).split("|")
    spec = lookup(op, 1)
    assert spec is not None
    names = [tuple(re.findall(r"`([a-z_]+)`", cell)) for cell in cells[2:6]]
    assert names == [spec.inputs, spec.outputs, spec.optional_inputs, spec.attributes]
    assert f"## {op} v1" in lines


def test_copied_proposals_are_accepted_with_their_target_probability() -> None:
    """A statistical check over 6000 independently seeded lanes (temperature 1, no filters or penalties,
    the same six logits at every position): the first emitted token follows the target distribution p,
    a copied proposal x0 is accepted with probability p(x0), and two proposals are both accepted with
    p(x0) p(x1). Each of the 9 frequencies is compared with its expectation by a z-test at |z| < 5.6
    (two-sided 2.1e-8 each); by the union bound the test fails by chance less than once in five million
    runs. The seeds are fixed, so the outcome is the same every run."""
    lanes, vocab = 6000, 6
    logit_row = np.array([1.2, 0.3, -0.4, 0.9, -1.5, 0.0], dtype=np.float32)
    target = np.exp(logit_row.astype(np.float64) - logit_row.max())
    target /= target.sum()
    first, second = 0, 3
    logits = np.tile(logit_row, (lanes * 3, 1))
    settings = {
        "temperature": np.ones(lanes, np.float32),
        "top_k": np.zeros(lanes, np.int32),
        "top_p": np.ones(lanes, np.float32),
        "min_p": np.zeros(lanes, np.float32),
        "repetition_penalty": np.ones(lanes, np.float32),
        "frequency_penalty": np.zeros(lanes, np.float32),
        "presence_penalty": np.zeros(lanes, np.float32),
        "seed": np.arange(1, lanes + 1, dtype=np.uint64) * np.uint64(7919),
    }
    result = rk.sample_verify(
        logits,
        query_length=np.full(lanes, 3, np.int32),
        candidate_ids=np.tile(np.array([first, second], np.int32), (lanes, 1)),
        settings=settings,
        prompt_presence=np.zeros((lanes, vocab), np.uint8),
        output_counts=np.zeros((lanes, vocab), np.int32),
        rows=np.arange(lanes, dtype=np.int32),
        step=np.zeros(lanes, np.int32),
        active=np.ones(lanes, np.uint8),
        vocab_limit=vocab,
        width=3,
    )

    def z(observed: int, probability: float) -> float:
        return float((observed - lanes * probability) / np.sqrt(lanes * probability * (1 - probability)))

    first_tokens = np.bincount(result.ids[:, 0], minlength=vocab)
    scores = [z(int(first_tokens[token]), float(target[token])) for token in range(vocab)]
    accepted = np.bincount(result.accepted, minlength=3)
    p0, p1 = float(target[first]), float(target[second])
    scores += [z(int(accepted[0]), 1 - p0), z(int(accepted[1]), p0 * (1 - p1)), z(int(accepted[2]), p0 * p1)]
    assert max(abs(score) for score in scores) < 5.6, scores
    assert (result.emitted == result.accepted + 1).all()
    # The emitted token after a rejection is never the rejected proposal.
    rejected_first = result.accepted == 0
    assert not (result.ids[rejected_first, 0] == first).any()
