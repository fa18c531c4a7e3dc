"""Columnar rounds: a LaneBatch stages exactly the bytes of its lanes, an ExpectationBatch validates
exactly as its list of expectations, and columnar decode planning serves exactly what planning lane by
lane serves (tokens, logprobs, events, statistics)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from helios_core.contract import PreparedContract
from helios_core.runtime.completion import (
    CompletionError,
    ExpectationBatch,
    LaneResults,
    read_lanes,
)
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.packing import (
    _ROW_SOURCES,
    GraphPacker,
    Lane,
    LaneBatch,
    PageTableMemory,
    Submission,
)
from helios_core.runtime.startup import RunningModel
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .packing_harness import assert_same_results, payload_contract, poisoned_staging

FLOATS = {
    ct.VALUE_SOURCE_TEMPERATURE,
    ct.VALUE_SOURCE_TOP_P,
    ct.VALUE_SOURCE_MIN_P,
    ct.VALUE_SOURCE_REPETITION_PENALTY,
    ct.VALUE_SOURCE_FREQUENCY_PENALTY,
    ct.VALUE_SOURCE_PRESENCE_PENALTY,
}
CHANGING = {ct.VALUE_SOURCE_SAMPLING_STEP, ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT}


@pytest.fixture(scope="module")
def contract() -> PreparedContract:
    return payload_contract()


def constants(rng: np.random.Generator, count: int) -> dict[int, np.ndarray]:
    """Per-lane columns that stay the same from round to round (as in a decode cohort)."""
    rows: dict[int, np.ndarray] = {}
    for source in _ROW_SOURCES:
        if source in FLOATS:
            rows[source] = rng.uniform(-1.0, 2.0, count)
        elif source == ct.VALUE_SOURCE_SEED_BITS:
            rows[source] = rng.integers(0, 2**63, count, dtype=np.uint64) * np.uint64(2)
        elif source == ct.VALUE_SOURCE_QUERY_LENGTH:
            rows[source] = np.ones(count, dtype=np.int64)
        elif source in (ct.VALUE_SOURCE_SAMPLING_DECISION, ct.VALUE_SOURCE_MIXED_PREFILL_ROW):
            rows[source] = rng.integers(0, 2, count).astype(np.int64)
        elif source == ct.VALUE_SOURCE_CONSTRAINED:  # no lane has a grammar mask
            rows[source] = np.zeros(count, dtype=np.int64)
        elif source not in CHANGING:
            rows[source] = rng.integers(-1, 50, count).astype(np.int64)
    rows[ct.VALUE_SOURCE_SLOT] = rng.permutation(4)[:count].astype(np.int64)
    rows[ct.VALUE_SOURCE_GENERATION] = rng.integers(1, 1000, count).astype(np.int64)
    return rows


def decode_batch(
    rows: dict[int, np.ndarray],
    positions: np.ndarray,
    tables: np.ndarray,
    counts: np.ndarray,
    step: int,
    *,
    host_tokens: bool = False,
) -> LaneBatch:
    count = positions.shape[0]
    every = dict(rows)
    every[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT] = positions.astype(np.int64)
    every[ct.VALUE_SOURCE_SAMPLING_STEP] = np.full(count, step, dtype=np.int64)
    slots = rows[ct.VALUE_SOURCE_SLOT]
    cache = tables[slots, positions // 4] * 4 + positions % 4
    tokens = {ct.VALUE_SOURCE_PROMPT_POSITIONS: positions, ct.VALUE_SOURCE_CACHE_SLOT: cache}
    if host_tokens:  # the completed pending tokens, fed from the host
        tokens[ct.VALUE_SOURCE_PROMPT_TOKENS] = (positions * 7 + step) % 300
    return LaneBatch(
        count=count,
        rows=every,
        tokens=tokens,
        page_source=tables,
        page_index=slots,
        page_counts=counts[slots].copy(),
        staged_as=id(rows),
        unchanged=frozenset(rows) | {ct.VALUE_SOURCE_TOKEN_ROW, ct.VALUE_SOURCE_GRAMMAR_MASK},
        page_version=int(counts.sum()),
    )


def assert_same_staging(batch_side: dict[str, np.ndarray], lane_side: dict[str, np.ndarray]) -> None:
    for name, array in lane_side.items():
        assert batch_side[name].tobytes() == array.tobytes(), name


@pytest.mark.parametrize("graph", ["decode_b4", "prefill_p16", "mixed_p16"])
def test_a_batch_stages_the_bytes_of_its_lanes_round_after_round(contract: PreparedContract, graph: str) -> None:
    rng = np.random.default_rng(len(graph))
    batch_staging, lane_staging = poisoned_staging(contract), poisoned_staging(contract)
    batch_memory, lane_memory = PageTableMemory(), PageTableMemory()
    by_batch = GraphPacker(contract.graphs[graph], batch_staging, batch_memory)
    by_lanes = GraphPacker(contract.graphs[graph], lane_staging, lane_memory)
    other_batch = GraphPacker(contract.graphs["decode_b1"], batch_staging, batch_memory)
    other_lanes = GraphPacker(contract.graphs["decode_b1"], lane_staging, lane_memory)
    tables = rng.integers(0, 60, (4, 16)).astype(np.int64)
    counts = np.array([2, 3, 1, 4], dtype=np.int64)
    for cohort in range(3):
        lanes_now = 3 if cohort != 1 else 2
        rows = constants(rng, lanes_now)
        positions = (counts[rows[ct.VALUE_SOURCE_SLOT]] * 4 - 2).astype(np.int32)
        for step in range(12):
            batch = decode_batch(rows, positions, tables, counts, step, host_tokens=graph != "decode_b4")
            for frame in (0, 1):
                lanes = batch.to_lanes()
                by_batch.pack(Submission(batch, step), frame, batch_staging)
                by_lanes.pack(Submission(lanes, step), frame, lane_staging)
                assert_same_staging(batch_staging, lane_staging)
            positions = positions + 1
            grow = positions // 4 >= counts[rows[ct.VALUE_SOURCE_SLOT]]
            counts[rows[ct.VALUE_SOURCE_SLOT][grow]] += 1
            if step == 5:  # another graph writes the same staging in between
                lane = Lane(slot=9, generation=4242, state_row=0, positions=[1], cache_slots=[2], page_table=[5, 6])
                other_batch.pack(Submission([lane], 99), 0, batch_staging)
                other_lanes.pack(Submission([lane], 99), 0, lane_staging)
                assert_same_staging(batch_staging, lane_staging)


def test_a_batch_without_host_tokens_fails_as_its_lanes_do(contract: PreparedContract) -> None:
    rng = np.random.default_rng(4)
    tables = rng.integers(0, 60, (4, 16)).astype(np.int64)
    batch = decode_batch(constants(rng, 2), np.array([1, 2], dtype=np.int32), tables, np.full(4, 2, dtype=np.int64), 0)
    messages = []
    for submission in (Submission(batch.to_lanes(), 1), Submission(batch, 1)):
        staging = poisoned_staging(contract)
        with pytest.raises(ValueError, match="supplies 0 values for 'input_ids'") as failure:
            GraphPacker(contract.graphs["prefill_p16"], staging).pack(submission, 0, staging)
        messages.append(str(failure.value))
    assert messages[0] == messages[1]


def test_a_batch_value_outside_its_destination_fails_as_its_lanes_do(contract: PreparedContract) -> None:
    rng = np.random.default_rng(3)
    rows = constants(rng, 2)
    rows[ct.VALUE_SOURCE_TOP_K] = np.array([3, 2**40], dtype=np.int64)  # top_k stages as int32
    tables = rng.integers(0, 60, (4, 16)).astype(np.int64)
    batch = decode_batch(rows, np.array([1, 2], dtype=np.int32), tables, np.full(4, 2, dtype=np.int64), 0)
    with pytest.raises(OverflowError) as by_lanes:
        GraphPacker(contract.graphs["decode_b4"], poisoned_staging(contract)).pack(
            Submission(batch.to_lanes(), 1), 0, poisoned_staging(contract)
        )
    staging = poisoned_staging(contract)
    with pytest.raises(OverflowError) as by_batch:
        GraphPacker(contract.graphs["decode_b4"], staging).pack(Submission(batch, 1), 0, staging)
    assert str(by_batch.value) == str(by_lanes.value)


def record(rng: np.random.Generator, rows: int, generations: np.ndarray, consumed: np.ndarray) -> dict[int, np.ndarray]:
    count = generations.shape[0]
    ids = rng.integers(0, 10, (rows, 1)).astype(np.int32)
    out = {
        mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE: np.array([7], dtype=np.int64),
        mf.COMPLETION_FIELD_GENERATION: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_EMITTED_TOKENS: np.ones(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_CONSUMED_TOKENS: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_DRAFT_CURSOR: np.full(rows, -1, dtype=np.int32),
        mf.COMPLETION_FIELD_RESERVED: np.full(rows, -1, dtype=np.int32),
        mf.COMPLETION_FIELD_SAMPLED_IDS: ids,
        mf.COMPLETION_FIELD_SAMPLED_LOGPROBS: rng.uniform(-5, 0, (rows, 1)).astype(np.float32),
        mf.COMPLETION_FIELD_TOP_IDS: rng.integers(0, 10, (rows, 3)).astype(np.int32),
        mf.COMPLETION_FIELD_TOP_LOGPROBS: rng.uniform(-5, 0, (rows, 3)).astype(np.float32),
    }
    out[mf.COMPLETION_FIELD_GENERATION][:count] = generations
    out[mf.COMPLETION_FIELD_CONSUMED_TOKENS][:count] = consumed
    return out


@pytest.mark.parametrize("count", [1, 5, 8, 9, 40])
def test_an_expectation_batch_validates_as_its_list(count: int) -> None:
    rng = np.random.default_rng(count)
    fields = [
        mf.COMPLETION_FIELD_GENERATION,
        mf.COMPLETION_FIELD_RESERVED,
        mf.COMPLETION_FIELD_DRAFT_CURSOR,
        mf.COMPLETION_FIELD_CONSUMED_TOKENS,
        mf.COMPLETION_FIELD_EMITTED_TOKENS,
        mf.COMPLETION_FIELD_SAMPLED_IDS,
        mf.COMPLETION_FIELD_TOP_IDS,
    ]
    for trial in range(30):
        generations = rng.integers(1, 100, count).astype(np.int64)
        consumed = rng.integers(1, 100, count).astype(np.int32)
        top = rng.integers(0, 3, count).astype(np.int64) if trial % 2 else None
        batch = ExpectationBatch(generations, consumed, True, top)
        completion = record(rng, count + 3, generations, consumed)
        for _ in range(rng.integers(0, 4)):  # corrupt a few lanes, one field each
            lane = int(rng.integers(0, count))
            completion[fields[int(rng.integers(0, len(fields)))]].reshape(count + 3, -1)[lane, 0] = rng.choice(
                [-1, 7, 12, 2**20]
            )
        by_batch = read_lanes(completion, 7, batch, sampled_size=10)
        by_list = read_lanes(completion, 7, batch.to_list(), sampled_size=10)
        assert isinstance(by_batch, LaneResults) and len(by_batch) == len(by_list) == count
        assert_same_results(by_batch, by_list)


def test_a_wrong_sequence_fails_a_batch_as_it_fails_a_list() -> None:
    rng = np.random.default_rng(0)
    batch = ExpectationBatch(np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int32), True)
    completion = record(rng, 4, batch.generations, batch.consumed)
    with pytest.raises(CompletionError, match="completion echoes submission 7, expected 8"):
        read_lanes(completion, 8, batch, sampled_size=10)


def _serve(running: RunningModel, work: list[PreparedRequest]) -> dict[str, list[object]]:
    streams = [running.engine.submit(request) for request in work]
    served: dict[str, list[object]] = {}
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], Finished), events[-1]
        served[stream.request_id] = [
            (e.token_id, e.logprob, e.pieces, e.top) if isinstance(e, TokenEvent) else e for e in events
        ]
    return served


def test_pipelined_decode_rounds_serve_what_rounds_planned_after_each_completion_serve(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """Decode rounds planned one position ahead (a follow-up per round) serve exactly the tokens, events
    and pages of rounds each planned from the completed round before, across sampling settings, page
    growth, preemption and readmission."""

    def work(running: RunningModel) -> list[PreparedRequest]:
        prompts = [
            running.bootstrap.encode_prompt([{"role": "user", "content": f"Batch rows, then {i}"}]) for i in range(6)
        ]
        params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3),
            SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.1, seed=2**63 + 11),
            SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=-0.25, seed=5),
        ]
        return [
            PreparedRequest(f"r{i}", prompts[i % 6], 10 + i, params[i % 4], ignore_eos=i % 3 != 0, top_logprobs=i % 3)
            for i in range(10)
        ]

    columnar = start_fixture(cache_pages=24)  # few pages: page growth, preemption and readmission in the mix
    expected = _serve(columnar, work(columnar))
    stats = columnar.engine.statistics()
    assert stats.pipelined_rounds > 0 and stats.preemptions > 0
    by_lane = start_fixture(cache_pages=24)
    by_lane.engine.scheduler.pipelining = False
    assert _serve(by_lane, work(by_lane)) == expected
    lane_stats = by_lane.engine.statistics()
    assert lane_stats.pipelined_rounds == 0
    for name in ("finished", "pages_published"):
        assert getattr(lane_stats, name) == getattr(stats, name), name
    for running in (columnar, by_lane):
        pages = running.engine.allocator
        pages.check()
        assert pages.referenced_pages == 0


def test_requests_end_at_their_limit_when_the_epoch_changes_between_pipelined_rounds(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture(max_active=4)
    engine = running.engine
    prompts = [running.bootstrap.encode_prompt([{"role": "user", "content": f"Limits, then {i}"}]) for i in range(4)]
    greedy = SamplingParams(temperature=0.0)

    def request(name: str, index: int) -> PreparedRequest:
        return PreparedRequest(name, prompts[index], 9 + 2 * index, greedy, ignore_eos=True)

    expected = [engine.generate(request(f"s{i}", i)).token_ids for i in range(4)]
    drain = engine._drain
    queued = iter(range(10**6))

    def drain_and_churn(*, block: bool) -> bool:
        keep = drain(block=block)
        # On the worker, between two pipelined rounds, when a request has two tokens left: a queued
        # request comes and is cancelled, so the next follow-up is planned from a new cohort.
        table = engine.scheduler.table
        if any(s.max_tokens - table.generated[s.slot] == 2 for s in engine.scheduler.running):
            name = f"q{next(queued)}"
            engine.scheduler.add(PreparedRequest(name, prompts[0], 4, greedy))
            engine.scheduler.cancel(name)
        return keep

    engine._drain = drain_and_churn  # type: ignore[method-assign]
    before = engine.statistics().pipelined_rounds
    streams = [engine.submit(request(f"r{i}", i)) for i in range(4)]
    for stream, tokens in zip(streams, expected, strict=True):
        events = list(stream)
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == tokens
    assert engine.statistics().pipelined_rounds > before
