"""The sampling kernels on the GPU match the reference adapters.

``sample``: every case draws fresh random logits and poisons the outputs beforehand (-7 for ids,
NaN for log-probabilities) so a value the kernels fail to write shows up. Greedy rows must give the
reference's ids exactly; rows that draw at random must give the reference's ids on at least 99% of
rows (a draw whose target lands within rounding of a cumulative boundary may go either way). On
every active row ``output_counts[rows[i]]`` must gain exactly one count, at the returned id, and the
reported log-probabilities must lie within 1e-4 of the reference's log-softmax of the processed
logits. Inactive rows must read -1 / 0 / -1 / 0 and touch no count.

``apply_grammar_mask`` must match exactly; ``log_softmax_gather`` within 1e-4.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.cuda_driver import Context
from tests.gpu.harness import bf16_bits, bf16_values, reference_node, run_node

pytestmark = pytest.mark.gpu

POISON = -7
LOGPROB_TOL = 1e-4
Arrays = dict[str, np.ndarray]


def _rng(*key: Any) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _sample_arrays(
    rng: np.random.Generator,
    rows: int,
    vocab: int,
    *,
    scale: float = 3.0,
    temperature: np.ndarray | None = None,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
    penalties: bool = False,
    mask: bool = False,
    active: np.ndarray | None = None,
    bf16: bool = False,
    quantize: bool = False,
    top_n: int = 5,
    outputs: bool = True,
) -> Arrays:
    state_rows = rows + 3
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    if quantize:
        logits = (np.round(logits * 4) / 4).astype(np.float32)
    arrays: Arrays = {
        "logits": bf16_bits(logits) if bf16 else logits,
        "temperature": np.ones(rows, np.float32) if temperature is None else temperature.astype(np.float32),
        "top_k": np.zeros(rows, np.int32) if top_k is None else top_k.astype(np.int32),
        "top_p": np.ones(rows, np.float32) if top_p is None else top_p.astype(np.float32),
        "min_p": np.zeros(rows, np.float32) if min_p is None else min_p.astype(np.float32),
        "repetition_penalty": np.ones(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32),
        "presence_penalty": np.zeros(rows, np.float32),
        "prompt_presence": np.zeros((state_rows, vocab), np.uint8),
        "output_counts": rng.integers(0, 3, (state_rows, vocab)).astype(np.int32),  # neutral rows ignore them
        "rows": rng.permutation(state_rows)[:rows].astype(np.int32),
        "seed": rng.integers(0, 2**64, rows, dtype=np.uint64),
        "step": rng.integers(0, 5000, rows).astype(np.int64),
        "active": np.ones(rows, np.uint8) if active is None else active.astype(np.uint8),
        "ids": np.full((rows, 1), POISON, np.int32),
    }
    if penalties:
        arrays["repetition_penalty"] = rng.choice([1.0, 1.25, 0.8], rows).astype(np.float32)
        arrays["frequency_penalty"] = rng.choice([0.0, 0.3, -0.2], rows).astype(np.float32)
        arrays["presence_penalty"] = rng.choice([0.0, 0.7, 1.5], rows).astype(np.float32)
        arrays["prompt_presence"] = (rng.random((state_rows, vocab)) < 0.05).astype(np.uint8)
        counts = rng.integers(1, 6, (state_rows, vocab))
        arrays["output_counts"] = np.where(rng.random((state_rows, vocab)) < 0.02, counts, 0).astype(np.int32)
    if mask:
        words = rng.integers(-(2**31), 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
        words[:, 0] |= 1  # id 0 stays allowed, so every row keeps a finite logit
        arrays["allowed_mask"] = words
        arrays["constrained"] = (rng.random(rows) < 0.6).astype(np.uint8)
    if outputs:
        arrays["logprob"] = np.full((rows, 1), np.nan, np.float32)
        arrays["top_ids"] = np.full((rows, max(top_n, 1)), POISON, np.int32)
        arrays["top_logprobs"] = np.full((rows, max(top_n, 1)), np.nan, np.float32)
    return arrays


def _reference_logprobs(arrays: Arrays, vocab_limit: int) -> np.ndarray:
    """The reference's log-softmax of every row's processed logits (inactive rows: NaN)."""
    logits = arrays["logits"]
    values = bf16_values(logits) if logits.dtype == np.uint16 else logits
    out = np.full(values.shape, np.nan, np.float32)
    active = np.flatnonzero(arrays["active"] != 0)
    state = arrays["rows"][active].astype(np.int64)
    limited = values[active].copy()
    limited[:, vocab_limit:] = -np.inf
    processed = rk.apply_penalties(
        limited,
        arrays["repetition_penalty"][active],
        arrays["frequency_penalty"][active],
        arrays["presence_penalty"][active],
        arrays["prompt_presence"][state],
        arrays["output_counts"][state],
    )
    if "allowed_mask" in arrays:
        processed = rk.apply_grammar_mask(processed, arrays["allowed_mask"][active], arrays["constrained"][active])
    out[active] = rk.log_softmax(processed)
    return out


def _check_sample(got: Arrays, want: Arrays, arrays: Arrays, attributes: dict[str, Any]) -> tuple[int, int]:
    """Assert everything but the random draws; returns (rows drawn at random, of which differ)."""
    limit = attributes["vocab_limit"]
    top_n = attributes.get("top_n", 0)
    active = arrays["active"] != 0
    ids = got["ids"].reshape(-1)
    want_ids = want["ids"].reshape(-1)
    assert np.all(ids[~active] == -1), "inactive rows must read id -1"
    assert np.all((ids[active] >= 0) & (ids[active] < limit)), "an active row got an id outside [0, vocab_limit)"
    greedy = active & (arrays["temperature"] == 0)
    np.testing.assert_array_equal(ids[greedy], want_ids[greedy], err_msg="greedy ids")
    expected_counts = arrays["output_counts"].astype(np.int64)
    np.add.at(expected_counts, (arrays["rows"][active].astype(np.int64), ids[active].astype(np.int64)), 1)
    np.testing.assert_array_equal(got["output_counts"], expected_counts, err_msg="output_counts increments")
    logprobs = _reference_logprobs(arrays, limit)
    if "logprob" in arrays:
        lp = got["logprob"].reshape(-1)
        assert np.all(lp[~active] == 0), "inactive rows must read logprob 0"
        where = np.flatnonzero(active)
        error = np.abs(lp[where].astype(np.float64) - logprobs[where, ids[where]])
        assert float(error.max(initial=0.0)) <= LOGPROB_TOL, f"logprob error {error.max():.3g}"
    if "top_ids" in arrays:
        assert np.all(got["top_ids"][~active] == -1) and np.all(got["top_logprobs"][~active] == 0)
        assert np.all(got["top_ids"][:, top_n:] == -1) and np.all(got["top_logprobs"][:, top_n:] == 0)
        tg, tw = got["top_ids"][active, :top_n], want["top_ids"][active, :top_n]
        lg, lw = got["top_logprobs"][active, :top_n], want["top_logprobs"][active, :top_n]
        np.testing.assert_array_equal(np.isfinite(lg), np.isfinite(lw), err_msg="top_logprobs finiteness")
        error = np.abs(np.where(np.isfinite(lw), lg.astype(np.float64) - lw, 0.0))
        assert float(error.max(initial=0.0)) <= LOGPROB_TOL, f"top_logprobs error {error.max():.3g}"
        # ids may differ only between alternatives of (nearly) equal log-probability
        rows_idx = np.flatnonzero(active)
        reported = np.take_along_axis(logprobs[rows_idx], np.maximum(tg, 0).astype(np.int64), axis=1)
        np.testing.assert_allclose(np.where(np.isfinite(lw), reported, 0), np.where(np.isfinite(lw), lw, 0), atol=1e-4)
        assert np.all((tg == tw) | (np.abs(lg.astype(np.float64) - lw) <= LOGPROB_TOL)), "top ids"
    drawn = active & (arrays["temperature"] > 0)
    return int(drawn.sum()), int(np.sum(drawn & (ids != want_ids)))


def _run_sample(cuda: Context, arrays: Arrays, attributes: dict[str, Any]) -> tuple[int, int]:
    got = run_node(cuda, "sample", arrays, attributes)
    want = reference_node("sample", arrays, attributes)
    return _check_sample(got, want, arrays, attributes)


def _assert_draws(drawn: int, differ: int) -> None:
    assert drawn > 0
    assert differ <= 0.01 * drawn, f"{differ} of {drawn} random draws differ from the reference"


def _filters(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {
        "temperature": rng.choice([0.0, 0.0, 0.3, 0.7, 1.0, 1.0, 1.6], rows),
        "top_k": rng.choice([0, 0, 1, 5, 40, 400, 5000], rows),
        "top_p": rng.choice([1.0, 1.0, 0.95, 0.8, 0.5], rows),
        "min_p": rng.choice([0.0, 0.0, 0.0, 0.02, 0.2], rows),
    }


# -- sample -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [128256, 49152])
def test_sample_batch_one(cuda_context: Context, vocab: int) -> None:
    drawn = differ = 0
    for trial in range(24):
        rng = _rng("batch-one", vocab, trial)
        temperature = np.array([0.0 if trial % 6 == 0 else 1.0], np.float32)
        arrays = _sample_arrays(rng, 1, vocab, temperature=temperature, top_p=np.array([(1.0, 0.9, 0.6)[trial % 3]]))
        d, x = _run_sample(cuda_context, arrays, {"vocab_limit": vocab - 5, "top_n": 5})
        drawn, differ = drawn + d, differ + x
    _assert_draws(drawn, differ)


@pytest.mark.parametrize(("rows", "vocab"), [(64, 128256), (64, 49152), (256, 4096)])
def test_sample_mixed_filters(cuda_context: Context, rows: int, vocab: int) -> None:
    rng = _rng("mixed", rows, vocab)
    arrays = _sample_arrays(rng, rows, vocab, **_filters(rng, rows))
    _assert_draws(*_run_sample(cuda_context, arrays, {"vocab_limit": vocab, "top_n": 5}))


@pytest.mark.parametrize("scale", [0.02, 0.3])
def test_sample_flat_rows(cuda_context: Context, scale: float) -> None:
    """Near-uniform rows (a randomly initialised model): the draw searches far beyond the heavy ids."""
    rng = _rng("flat", scale)
    rows, vocab = 32, 128256
    arrays = _sample_arrays(
        rng,
        rows,
        vocab,
        scale=scale,
        temperature=rng.choice([0.5, 1.0, 2.0], rows),
        top_k=rng.choice([0, 0, 3000, 60000], rows),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.4], rows),
    )
    _assert_draws(*_run_sample(cuda_context, arrays, {"vocab_limit": vocab, "top_n": 5}))


def test_sample_penalties_mask_and_limit(cuda_context: Context) -> None:
    rng = _rng("penalties")
    rows, vocab = 48, 49152
    arrays = _sample_arrays(rng, rows, vocab, penalties=True, mask=True, **_filters(rng, rows))
    _assert_draws(*_run_sample(cuda_context, arrays, {"vocab_limit": vocab - 1000, "top_n": 5}))


def test_sample_inactive_rows(cuda_context: Context) -> None:
    rng = _rng("inactive")
    rows, vocab = 16, 49152
    active = (np.arange(rows) % 3 != 0).astype(np.uint8)
    arrays = _sample_arrays(rng, rows, vocab, active=active, penalties=True, **_filters(rng, rows))
    arrays["rows"][active == 0] = -1  # padding lanes name no state row
    _assert_draws(*_run_sample(cuda_context, arrays, {"vocab_limit": vocab, "top_n": 3}))


def test_sample_ties_bf16_and_small_vocab(cuda_context: Context) -> None:
    drawn = differ = 0
    for case, (rows, vocab, limit, kwargs) in enumerate(
        [
            (32, 49152, 49152, {"quantize": True, "scale": 1.0}),
            (32, 32000, 31990, {"bf16": True}),
            (8, 320, 259, {"mask": True}),
        ]
    ):
        rng = _rng("ties", case)
        arrays = _sample_arrays(rng, rows, vocab, **_filters(rng, rows), **kwargs)
        d, x = _run_sample(cuda_context, arrays, {"vocab_limit": limit, "top_n": 5})
        drawn, differ = drawn + d, differ + x
    _assert_draws(drawn, differ)


def test_sample_constant_rows(cuda_context: Context) -> None:
    """Every weight equal: the draw picks an id by position among ties (id order)."""
    rng = _rng("constant")
    rows, vocab = 8, 128256
    arrays = _sample_arrays(rng, rows, vocab, top_k=np.array([0, 0, 0, 7, 3000, 100000, 0, 0]))
    arrays["logits"][:] = 0.5
    _assert_draws(*_run_sample(cuda_context, arrays, {"vocab_limit": vocab, "top_n": 5}))


def test_sample_ids_only(cuda_context: Context) -> None:
    rng = _rng("ids-only")
    rows, vocab = 8, 49152
    arrays = _sample_arrays(rng, rows, vocab, outputs=False, **_filters(rng, rows))
    _assert_draws(*_run_sample(cuda_context, arrays, {"vocab_limit": vocab}))


def test_sample_repeats_exactly(cuda_context: Context) -> None:
    rng = _rng("repeat")
    rows, vocab = 16, 128256
    arrays = _sample_arrays(rng, rows, vocab, **_filters(rng, rows))
    first = run_node(cuda_context, "sample", arrays, {"vocab_limit": vocab, "top_n": 5})
    second = run_node(cuda_context, "sample", arrays, {"vocab_limit": vocab, "top_n": 5})
    for name in ("ids", "logprob", "top_ids", "top_logprobs", "output_counts"):
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    # a row's result does not depend on the rest of the batch
    alone = {name: (value[3:4] if value.shape[:1] == (rows,) else value) for name, value in arrays.items()}
    single = run_node(cuda_context, "sample", alone, {"vocab_limit": vocab, "top_n": 5})
    assert single["ids"][0, 0] == first["ids"][3, 0]
    assert single["logprob"][0, 0] == first["logprob"][3, 0]


@pytest.mark.parametrize(("programs", "top_n"), [(1, 5), (3, 1), (7, 5)])
def test_sample_layouts_give_the_same_results(
    cuda_context: Context, monkeypatch: pytest.MonkeyPatch, programs: int, top_n: int
) -> None:
    """A row's chunks shared out over fewer programs than chunks (each reducing several in turn) give
    the bits of one program a chunk, and the reference's results."""
    from ignition.kernels import sampling  # Triton: imported by the test, so the module collects without it

    rng = _rng("layouts", programs, top_n)
    rows, vocab = 12, 49152  # 24 chunks: every chunk its own program at 12 rows
    arrays = _sample_arrays(rng, rows, vocab, penalties=True, mask=True, top_n=top_n, **_filters(rng, rows))
    # a greedy row whose maximum is zero twice, negative zero at the lower id; a chunk's last ids cut off
    arrays["logits"][0] = -np.abs(arrays["logits"][0]) - 1.0
    arrays["logits"][0, [5000, 7000]] = [-0.0, 0.0]
    arrays["temperature"][0] = 0.0
    arrays["repetition_penalty"][0], arrays["frequency_penalty"][0], arrays["presence_penalty"][0] = 1.0, 0.0, 0.0
    arrays["constrained"][0] = 0
    attributes = {"vocab_limit": vocab - 100, "top_n": top_n}
    assert sampling.choose_sample_layout(rows, vocab).programs == 24
    every = run_node(cuda_context, "sample", arrays, attributes)
    layout = sampling.SampleLayout(chunk=sampling.CHUNK, programs=programs, warps=4)
    monkeypatch.setattr(sampling, "choose_sample_layout", lambda *_args, **_kwargs: layout)
    shared = run_node(cuda_context, "sample", arrays, attributes)
    for name in ("ids", "logprob", "top_ids", "top_logprobs", "output_counts"):
        np.testing.assert_array_equal(shared[name], every[name], err_msg=name)
    assert shared["ids"][0, 0] == 5000
    _assert_draws(*_check_sample(shared, reference_node("sample", arrays, attributes), arrays, attributes))


# -- apply_grammar_mask and log_softmax_gather -------------------------------------------------------


@pytest.mark.parametrize(("rows", "vocab", "bf16"), [(8, 49152, False), (3, 128256, True), (5, 320, False)])
def test_apply_grammar_mask(cuda_context: Context, rows: int, vocab: int, bf16: bool) -> None:
    rng = _rng("mask", rows, vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    arrays = {
        "logits": bf16_bits(logits) if bf16 else logits,
        "allowed_mask": rng.integers(-(2**31), 2**31, (rows, -(-vocab // 32) + 1), dtype=np.int64).astype(np.int32),
        "constrained": (np.arange(rows) % 2).astype(np.uint8),
        "out": np.full((rows, vocab), np.nan, np.float32),
    }
    got = run_node(cuda_context, "apply_grammar_mask", arrays)
    want = reference_node("apply_grammar_mask", arrays)
    np.testing.assert_array_equal(got["out"], want["out"])


@pytest.mark.parametrize(("rows", "vocab", "limit"), [(37, 128256, 128256), (19, 49152, 49000), (4, 320, 259)])
def test_log_softmax_gather(cuda_context: Context, rows: int, vocab: int, limit: int) -> None:
    rng = _rng("gather", rows, vocab)
    targets = rng.integers(0, limit, rows).astype(np.int32)
    targets[::5] = -1  # padding and the last prompt token score 0
    arrays = {
        "logits": (rng.standard_normal((rows, vocab)) * 4).astype(np.float32),
        "targets": targets,
        "out": np.full(rows, np.nan, np.float32),
    }
    got = run_node(cuda_context, "log_softmax_gather", arrays, {"vocab_limit": limit})
    want = reference_node("log_softmax_gather", arrays, {"vocab_limit": limit})
    assert np.all(got["out"][targets < 0] == 0)
    np.testing.assert_allclose(got["out"], want["out"], rtol=0, atol=LOGPROB_TOL)
