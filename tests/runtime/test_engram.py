"""Engram: the hashed n-gram table staged by the host, end to end, and the staging frames' reuse rules.

An ``--engram`` tiny core (orders 2..3, two heads an order, its rows added to the residual stream after the
embedding) must generate exactly the greedy tokens of an independent numpy forward pass: the Llama oracle of
``tests/oracles/llama_numpy.py``, its embedding rows plus the projection of the rows this file's own hash
selects from the table the core declares. The same core with its table zeroed generates other tokens (the
table matters). Staging: a frame is refilled only after every rank retired the round that read it; an
early refill raises and leaves the staged rows as they were, also when the engine meets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.contract import LoadOptions
from helios_core.runtime.engram import (
    EngramFrameBusy,
    EngramHash,
    EngramStaging,
    EngramStagingError,
    HostEngramTable,
    engram_rows,
)
from helios_core.runtime.messages import ExecutionFailed, Finished
from helios_core.runtime.packing import Lane
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import container_pb2 as cb
from helios_core.wire import manifest_pb2 as mf
from tests.oracles.llama_numpy import LlamaHParams, LlamaNumpy

from .engine_harness import SignedCore, build_signed_core, request, submit_all, token_ids, tokens_and_end

NAMESPACE = "helios-tests/engram"
CAPS = Capacities(
    max_rows=2, prefill_tokens=(16,), decode_rows=(1, 2), page_tokens=4, cache_pages=32, context=64, engram=True
)
PROMPT = [11, 200, 37, 5, 150, 99, 250, 3, 71, 18, 42, 7, 201, 64, 9, 120, 33, 17, 88, 240]
"""20 tokens: two prefill chunks of at most 16, so the second chunk hashes ids of the first."""
NEW_TOKENS = 10
MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class EngramCore:
    signed: SignedCore
    weights: dict[str, npt.NDArray[np.float32]]
    hparams: LlamaHParams


@pytest.fixture(scope="module")
def engram_core(tmp_path_factory: pytest.TempPathFactory) -> EngramCore:
    declaration = synthetic_declaration("tiny", seed=7)
    shape = dataclasses.replace(declaration.shape, rope_style="interleaved")  # the oracle's rotation pairs
    declaration = dataclasses.replace(declaration, shape=shape)
    signed = build_signed_core(build_core, declaration, CAPS, tmp_path_factory.mktemp("engram"), NAMESPACE)
    hparams = LlamaHParams(
        n_layer=shape.layers,
        n_head=shape.heads,
        n_head_kv=shape.kv_heads,
        n_embd=shape.hidden,
        rms_eps=shape.rms_eps,
        rope_freq_base=shape.rope_theta,
        context_length=CAPS.context,
        n_rot=shape.head_dim,
    )
    return EngramCore(signed, dict(declaration.weights), hparams)


@pytest.fixture
def running(engram_core: EngramCore) -> Iterator[RunningModel]:
    model = start(engram_core.signed.path, engram_core.signed.trust, LoadOptions(), backend="reference")
    yield model
    model.close()


# ----------------------------------------------------------------------------------------------------------
# the independent forward pass
# ----------------------------------------------------------------------------------------------------------


def wrap64(value: int) -> int:
    """``value`` as a wrapping signed 64-bit integer."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def hashed_rows(table: mf.EngramTable, ids: Sequence[int], position: int) -> list[int]:
    """The table rows of the token at ``position`` of ``ids``: per order n = 2..max_order, mix = XOR of
    t_{-i} * m_i (i < n, pad id before the start), then for each head its band offset + mix mod prime."""
    rows: list[int] = []
    band = 0
    column = 0
    for order in range(2, table.max_order + 1):
        mix = 0
        for back in range(order):
            token = ids[position - back] if position - back >= 0 else table.pad_id
            mix ^= wrap64(token * table.multipliers[back])
        for _head in range(table.heads_per_order):
            prime = table.primes[column]
            rows.append(band + mix % prime)
            band += prime
            column += 1
    return rows


class EngramOracle:
    """The numpy Llama with each token's embedding row plus ``projection @ concat(hashed table rows)``."""

    def __init__(self, core: EngramCore, running: RunningModel, sampled_size: int) -> None:
        execution = running.verified.core.execution
        (self.table,) = execution.engram_tables
        raw = running.verified.core.read_resource(self.table.resource_id, cb.RESOURCE_KIND_WEIGHTS)
        self.rows = np.frombuffer(bytes(raw), dtype="<f4").reshape(self.table.table_rows, self.table.row_width)
        (proj,) = [b for b in execution.buffers if b.name == "engram.proj"]
        data = running.verified.core.read_resource(proj.resource_id, cb.RESOURCE_KIND_WEIGHTS)
        shape = tuple(d.size for d in proj.shape)
        count = int(np.prod(shape))
        self.projection = np.frombuffer(bytes(data), dtype="<f4", count=count, offset=proj.resource_offset).reshape(
            shape
        )
        self.llama = LlamaNumpy(core.weights, core.hparams)
        self.embedding = self.llama.tok_embd
        self.sampled_size = sampled_size

    def _forward(self, ids: list[int], start: int, end: int) -> npt.NDArray[np.float32]:
        """Logits of positions start..end-1 (the oracle's cache holds the positions before)."""
        inputs = []
        for position in range(start, end):
            memory = np.concatenate([self.rows[r] for r in hashed_rows(self.table, ids, position)])
            inputs.append(self.embedding[ids[position]] + self.projection @ memory)
        # The oracle embeds by row index: hand it this call's input rows as its table.
        self.llama.tok_embd = np.asarray(inputs, dtype=np.float32)
        try:
            return self.llama.forward(list(range(end - start)))
        finally:
            self.llama.tok_embd = self.embedding

    def greedy(self, prompt: Sequence[int], count: int) -> list[int]:
        ids = list(prompt)
        self.llama.reset(len(prompt) + count)
        logits = self._forward(ids, 0, len(ids))[-1]
        out: list[int] = []
        for _ in range(count):
            out.append(int(np.argmax(logits[: self.sampled_size])))
            ids.append(out[-1])
            logits = self._forward(ids, len(ids) - 1, len(ids))[-1]
        return out


def oracle(core: EngramCore, running: RunningModel) -> EngramOracle:
    return EngramOracle(core, running, running.verified.contract.sampled_size)


# ----------------------------------------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------------------------------------


def test_the_core_declares_one_table_staged_through_the_transport(running: RunningModel) -> None:
    execution = running.verified.core.execution
    (table,) = execution.engram_tables
    assert (table.max_order, table.heads_per_order, table.frames, table.dtype) == (3, 2, 2, mf.DTYPE_F32)
    assert all(m % 2 for m in table.multipliers)
    entry = next(e for e in execution.transport.entries if e.name == table.buffer)
    assert list(entry.shape) == [16, 4 * table.row_width]
    decodes = [g for g in running.verified.contract.model.graphs if g.name.startswith("decode_")]
    assert decodes and all(g.pending_token.binding_destination == "input_ids" for g in decodes)
    assert running.model.engram is not None and running.model.engram.frames == 2


def test_greedy_tokens_equal_an_independent_forward_pass(engram_core: EngramCore, running: RunningModel) -> None:
    expected = oracle(engram_core, running).greedy(PROMPT, NEW_TOKENS)
    assert running.engine.generate(request("a", PROMPT, NEW_TOKENS)).token_ids == expected
    # The same prompt again reuses the cached prefix: its chunk starts past the first positions, whose ids
    # the host still hashes from the request's context.
    again = running.engine.generate(request("b", PROMPT, NEW_TOKENS))
    assert (again.token_ids, again.reused_prompt_tokens > 0) == (expected, True)
    engram = running.model.engram
    assert engram is not None and (engram.held_by(0), engram.held_by(1)) == (-1, -1)


def test_requests_served_together_each_equal_the_forward_pass(engram_core: EngramCore, running: RunningModel) -> None:
    prompts = [PROMPT[:9], PROMPT[5:18]]
    reference = oracle(engram_core, running)
    expected = [reference.greedy(p, NEW_TOKENS) for p in prompts]
    streams = submit_all(running.engine, prompts, NEW_TOKENS)
    assert [token_ids(stream) for stream in streams] == expected


def test_the_table_matters(engram_core: EngramCore, running: RunningModel) -> None:
    with_table = running.engine.generate(request("a", PROMPT, NEW_TOKENS)).token_ids
    zeroed_model = start(engram_core.signed.path, engram_core.signed.trust, LoadOptions(), backend="reference")
    try:
        engram = zeroed_model.model.engram
        assert engram is not None
        engram.tables[0].rows[:] = 0  # the same core with its table zeroed (before anything is cached)
        zeroed = zeroed_model.engine.generate(request("a", PROMPT, NEW_TOKENS)).token_ids
    finally:
        zeroed_model.close()
    plain = LlamaNumpy(engram_core.weights, engram_core.hparams)
    plain.reset(len(PROMPT) + NEW_TOKENS)
    logits = plain.forward(PROMPT)[-1]
    sampled = running.verified.contract.sampled_size
    baseline: list[int] = []
    for _ in range(NEW_TOKENS):
        baseline.append(int(np.argmax(logits[:sampled])))
        logits = plain.forward([baseline[-1]])[-1]
    assert zeroed == baseline  # zero rows add nothing: the plain model
    assert zeroed != with_table


def test_two_thread_ranks_stage_once_and_retire_each_frame_on_both(
    engram_core: EngramCore, running: RunningModel, tmp_path: Path
) -> None:
    """A core of two tensor-parallel ranks: rank 0's staged rows reach both ranks, both retire every
    frame, and the tokens are the forward pass's."""
    declaration = synthetic_declaration("tiny", seed=7)
    declaration = dataclasses.replace(
        declaration, shape=dataclasses.replace(declaration.shape, rope_style="interleaved")
    )

    def build_two_ranks(*args: Any, **kwargs: Any) -> Any:
        return build_core(*args, tensor_parallel=2, **kwargs)

    signed = build_signed_core(build_two_ranks, declaration, CAPS, tmp_path, NAMESPACE)
    ranked = start(signed.path, signed.trust, LoadOptions(), backend="reference")
    try:
        engram = ranked.model.engram
        assert engram is not None and engram.participants == 2
        assert len(ranked.model.backend.rank_completions(0)) == 2  # type: ignore[attr-defined]
        expected = oracle(engram_core, running).greedy(PROMPT, NEW_TOKENS)
        assert ranked.engine.generate(request("a", PROMPT, NEW_TOKENS)).token_ids == expected
        assert (engram.held_by(0), engram.held_by(1)) == (-1, -1)
    finally:
        ranked.close()


# ----------------------------------------------------------------------------------------------------------
# the hash
# ----------------------------------------------------------------------------------------------------------

HASH = EngramHash(
    max_order=3, heads_per_order=2, primes=(5, 7, 11, 13), multipliers=(-(2**61) + 1, 2**62 + 3, -7), pad_id=2
)


def test_rows_are_the_wrapped_xor_mix_mod_each_prime_past_its_band() -> None:
    rng = np.random.default_rng(3)
    contexts = rng.integers(0, 2**40, size=(64, 3), dtype=np.int64)
    table = mf.EngramTable(max_order=3, heads_per_order=2, primes=HASH.primes, multipliers=HASH.multipliers)
    expected = [hashed_rows(table, list(row[::-1]), 2) for row in contexts.tolist()]
    assert engram_rows(HASH, contexts).tolist() == expected
    assert engram_rows(HASH, contexts).min() >= 0


def test_ids_are_compressed_and_the_start_padded() -> None:
    rows = np.arange(36 * 2, dtype=np.float32).reshape(36, 2)
    compression = (np.arange(10, dtype=np.int64) * 3) % 7
    host = HostEngramTable("t", "dest", rows, compression, HASH)
    windows = np.array([[4, -1, -1], [9, 4, -1], [1, 9, 4]], dtype=np.int64)
    hashed = np.where(windows < 0, HASH.pad_id, compression[np.maximum(windows, 0)])
    expected = rows[engram_rows(HASH, hashed)].reshape(3, 8)
    np.testing.assert_array_equal(host.gather(windows), expected)


# ----------------------------------------------------------------------------------------------------------
# staging frames
# ----------------------------------------------------------------------------------------------------------


def _staging(participants: int = 1) -> tuple[EngramStaging, list[dict[str, npt.NDArray[Any]]]]:
    rows = np.arange(36 * 2, dtype=np.float32).reshape(36, 2) + 1
    table = HostEngramTable("t", "engram.rows", rows, None, HASH)
    frames = [{"engram.rows": np.full((4, 8), -1.0, dtype=np.float32)} for _ in range(2)]
    return EngramStaging([table], participants=participants), frames


TOKENS = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) + 20
"""A slot table's input ids: slot 0 holds 20.., slot 1 holds 36..."""


def _lane(slot: int, start: int, count: int) -> Lane:
    positions = list(range(start, start + count))
    return Lane(slot=slot, generation=1, state_row=slot, positions=positions, cache_slots=positions, page_table=[0])


def test_a_staged_frame_holds_each_packed_tokens_rows_and_zeros_after() -> None:
    staging, frames = _staging()
    staging.stage(0, 1, frames[0], [_lane(0, 3, 2), _lane(1, 0, 1)], TOKENS)
    host = staging.tables[0]
    windows = np.array([[23, 22, 21], [24, 23, 22], [36, -1, -1]], dtype=np.int64)
    np.testing.assert_array_equal(frames[0]["engram.rows"][:3], host.gather(windows))
    np.testing.assert_array_equal(frames[0]["engram.rows"][3], np.zeros(8, dtype=np.float32))
    assert staging.held_by(0) == 1


def test_an_early_refill_raises_and_leaves_the_staged_rows() -> None:
    staging, frames = _staging()
    staging.stage(0, 1, frames[0], [_lane(0, 3, 2)], TOKENS)
    staged = frames[0]["engram.rows"].copy()
    with pytest.raises(EngramFrameBusy) as caught:
        staging.stage(0, 2, frames[0], [_lane(1, 5, 4)], TOKENS)
    assert str(caught.value) == (
        "Engram staging frame 0 cannot be refilled for round 2: round 1 staged in it is not retired by rank(s) [0]"
    )
    np.testing.assert_array_equal(frames[0]["engram.rows"], staged)
    assert staging.held_by(0) == 1
    staging.stage(1, 2, frames[1], [_lane(1, 5, 4)], TOKENS)  # the other frame is free
    assert staging.retire(0, 0) is True
    staging.stage(0, 3, frames[0], [_lane(1, 5, 4)], TOKENS)  # retired: reusable
    assert staging.held_by(0) == 3


def test_with_two_ranks_a_frame_waits_for_the_rank_that_retires_late() -> None:
    staging, frames = _staging(participants=2)
    staging.stage(0, 1, frames[0], [_lane(0, 0, 4)], TOKENS)
    staging.stage(1, 2, frames[1], [_lane(0, 4, 1)], TOKENS)
    assert staging.retire(0, 0) is False  # rank 0 finished round 1; rank 1 still reads frame 0
    assert staging.unretired(0) == (1,)
    staged = frames[0]["engram.rows"].copy()
    with pytest.raises(EngramFrameBusy, match=r"round 1 staged in it is not retired by rank\(s\) \[1\]"):
        staging.stage(0, 3, frames[0], [_lane(0, 5, 1)], TOKENS)
    np.testing.assert_array_equal(frames[0]["engram.rows"], staged)
    assert staging.retire(1, 1) is False and staging.retire(1, 0) is True  # frame 1 in either order
    assert staging.retire(0, 1) is True  # the late rank
    staging.stage(0, 3, frames[0], [_lane(0, 5, 1)], TOKENS)
    assert staging.held_by(0) == 3


def test_retiring_against_the_rules_raises() -> None:
    staging, frames = _staging(participants=2)
    with pytest.raises(EngramStagingError, match="frame 0 is not held by any round; rank 0 cannot retire it"):
        staging.retire(0, 0)
    staging.stage(0, 1, frames[0], [_lane(0, 0, 1)], TOKENS)
    staging.retire(0, 0)
    with pytest.raises(EngramStagingError, match="rank 0 already retired round 1 of Engram staging frame 0"):
        staging.retire(0, 0)
    with pytest.raises(EngramStagingError, match=r"rank 2 does not take part in Engram staging \(2 ranks\)"):
        staging.retire(0, 2)
    with pytest.raises(EngramStagingError, match="there is no frame 2"):
        staging.acquire(2, 5)


class _RankRecords:
    """The reference backend as a ranked one: ``rank_completions`` reports ``reporting`` ranks' records."""

    def __init__(self, inner: Any, reporting: int) -> None:
        self.inner = inner
        self.reporting = reporting

    def rank_completions(self, frame: int) -> list[Any]:
        return [self.inner.completion(frame)] * self.reporting

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_engine_retires_every_ranks_read(engram_core: EngramCore, running: RunningModel) -> None:
    engram = running.model.engram
    assert engram is not None
    expected = oracle(engram_core, running).greedy(PROMPT, 4)
    running.model.engram = EngramStaging(engram.tables, participants=2)
    running.model.backend = _RankRecords(running.model.backend, reporting=2)  # type: ignore[assignment]
    assert running.engine.generate(request("a", PROMPT, 4)).token_ids == expected
    assert (running.model.engram.held_by(0), running.model.engram.held_by(1)) == (-1, -1)


def test_the_engine_never_refills_a_frame_a_rank_has_not_retired(running: RunningModel) -> None:
    engram = running.model.engram
    assert engram is not None
    running.model.engram = EngramStaging(engram.tables, participants=2)
    running.model.backend = _RankRecords(running.model.backend, reporting=1)  # rank 1 never retires
    tokens, end = tokens_and_end(running.engine, request("a", PROMPT, 4))
    assert isinstance(end, ExecutionFailed) and not isinstance(end, Finished)
    assert "EngramFrameBusy: Engram staging frame 0 cannot be refilled" in end.message
    assert running.model.engram.unretired(0) == (1,)
    assert len(tokens) <= 1
