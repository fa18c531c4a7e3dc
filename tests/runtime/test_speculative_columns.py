"""Speculative rounds as columns: a speculative LaneBatch stages exactly the bytes of its lanes, a
SpeculativeExpectations validates exactly as its list, and history rounds planned and applied as columns
serve exactly what rounds planned and applied lane by lane serve (tokens, events, statistics, pages),
which is what decode without speculation serves. The rounds run on the null backend, whose ids repeat
with a cycle (:class:`~helios_core.backends.null.NullTokens`), so history drafting proposes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.null import NullTokens
from helios_core.contract import LoadOptions, PreparedContract, PreparedGraph
from helios_core.loading import TrustSettings, open_core
from helios_core.runtime import progress, speculation
from helios_core.runtime.completion import (
    CompletionError,
    SpeculativeExpectations,
    SpeculativeResults,
    agree_across_ranks,
    read_lanes,
)
from helios_core.runtime.messages import ExecutionFailed, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.packing import _ROW_SOURCES, GraphPacker, Lane, LaneBatch, PageTableMemory, Submission
from helios_core.runtime.progress import RoundCompletion
from helios_core.runtime.speculation import SpeculativePlanner
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .packing_harness import assert_same_results, poisoned_staging

NAMESPACE = "tests/speculative-columns"
PAGE_TOKENS = 4
CYCLE = 9


@pytest.fixture(scope="module")
def history_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrustSettings]:
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities, speculative_widths
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    tmp = tmp_path_factory.mktemp("speculative-columns")
    keys = generate_keys(tmp / "keys")
    core = tmp / "history.core"
    caps = Capacities(
        max_rows=8, prefill_tokens=(32,), decode_rows=(1, 4, 8), page_tokens=PAGE_TOKENS, cache_pages=256,
        context=160, snapshots=0, speculative_widths=speculative_widths(7),
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=3), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )  # fmt: skip
    return core, TrustSettings((keys["public"],), NAMESPACE, None)


@pytest.fixture(scope="module")
def contract(history_core: tuple[Path, TrustSettings]) -> PreparedContract:
    verified = open_core(*history_core)
    verified.close()
    return verified.contract


# -- packing -------------------------------------------------------------------------------------------


def speculative_batch(
    rng: np.random.Generator,
    graph: PreparedGraph,
    constant: dict[int, np.ndarray],
    tables: np.ndarray,
    number: int,
    counts: np.ndarray | None = None,
) -> LaneBatch:
    """A batch of speculative lanes of ``graph`` with fresh proposals (``counts`` of them, else random) and
    positions over ``constant``."""
    count = constant[ct.VALUE_SOURCE_SLOT].shape[0]
    width = graph.extents.token_capacity
    if counts is None:
        counts = rng.integers(0, width, count).astype(np.int64)
    consumed = rng.integers(0, 20, count).astype(np.int32)
    rows = dict(constant)
    rows[ct.VALUE_SOURCE_QUERY_LENGTH] = counts + 1
    rows[ct.VALUE_SOURCE_CANDIDATE_COUNT] = counts
    rows[ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT] = consumed
    rows[ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT] = consumed
    rows[ct.VALUE_SOURCE_SAMPLING_STEP] = rng.integers(0, 9, count).astype(np.int32)
    rows[ct.VALUE_SOURCE_OUTPUT_LIMIT] = rng.integers(1, 9, count).astype(np.int64)
    positions = np.concatenate([np.arange(c, c + n + 1) for c, n in zip(consumed, counts, strict=True)])
    lane_of = np.repeat(np.arange(count), counts + 1)
    slots = rows[ct.VALUE_SOURCE_SLOT]
    cache = tables[slots[lane_of], positions // PAGE_TOKENS] * PAGE_TOKENS + positions % PAGE_TOKENS
    return LaneBatch(
        count=count,
        rows=rows,
        tokens={ct.VALUE_SOURCE_PROMPT_POSITIONS: positions, ct.VALUE_SOURCE_CACHE_SLOT: cache},
        page_source=tables,
        page_index=slots,
        page_counts=np.full(count, tables.shape[1], dtype=np.int64),
        staged_as=number,
        unchanged=frozenset(constant) | {ct.VALUE_SOURCE_GRAMMAR_MASK, ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS},
        page_version=number,
        candidates=rng.integers(-3, 300, (count, width - 1)).astype(np.int64),
    )


def constant_rows(rng: np.random.Generator, count: int) -> dict[int, np.ndarray]:
    rows: dict[int, np.ndarray] = {}
    for source in _ROW_SOURCES:
        rows[source] = rng.integers(0, 50, count).astype(np.int64)
    rows[ct.VALUE_SOURCE_SLOT] = rng.permutation(8)[:count].astype(np.int64)
    rows[ct.VALUE_SOURCE_CANDIDATE_GENERATION] = rows[ct.VALUE_SOURCE_GENERATION]  # as a Lane derives it
    rows[ct.VALUE_SOURCE_CONSTRAINED] = np.zeros(count, dtype=np.int64)
    rows[ct.VALUE_SOURCE_SAMPLING_DECISION] = np.ones(count, dtype=np.int64)
    rows[ct.VALUE_SOURCE_MIXED_PREFILL_ROW] = np.zeros(count, dtype=np.int64)
    rows[ct.VALUE_SOURCE_TEMPERATURE] = rng.uniform(0.0, 2.0, count)
    rows[ct.VALUE_SOURCE_SEED_BITS] = rng.integers(0, 2**62, count).astype(np.uint64)
    for changing in (
        ct.VALUE_SOURCE_QUERY_LENGTH,
        ct.VALUE_SOURCE_CANDIDATE_COUNT,
        ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT,
        ct.VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT,
        ct.VALUE_SOURCE_SAMPLING_STEP,
        ct.VALUE_SOURCE_OUTPUT_LIMIT,
    ):
        del rows[changing]
    return rows


def test_a_speculative_batch_stages_the_bytes_of_its_lanes_round_after_round(contract: PreparedContract) -> None:
    rng = np.random.default_rng(5)
    batch_staging, lane_staging = poisoned_staging(contract), poisoned_staging(contract)
    batch_memory, lane_memory = PageTableMemory(), PageTableMemory()
    tables = rng.integers(0, 200, (8, 12)).astype(np.int64)
    for name in ("speculative_w8_b8", "speculative_w4_b4", "speculative_w2_b8"):
        graph = contract.graphs[name]
        by_batch = GraphPacker(graph, batch_staging, batch_memory)
        by_lanes = GraphPacker(graph, lane_staging, lane_memory)
        for members in range(2):
            constant = constant_rows(rng, int(rng.integers(1, graph.extents.batch_capacity + 1)))
            for round_ in range(6):  # the same members: the rounds after the first write what changes only
                batch = speculative_batch(rng, graph, constant, tables, number=100 * members + len(name))
                by_batch.pack(Submission(batch, round_), 0, batch_staging)
                by_lanes.pack(Submission(batch.to_lanes(), round_), 0, lane_staging)
                for entry, staged in lane_staging.items():
                    assert batch_staging[entry].tobytes() == staged.tobytes(), (name, round_, entry)
                if round_ == 3:  # another graph writes the same staging in between
                    other = contract.graphs["decode_b1"]
                    lane = Lane(slot=7, generation=42, state_row=7, positions=[3], cache_slots=[5], page_table=[9])
                    for staging, memory in ((batch_staging, batch_memory), (lane_staging, lane_memory)):
                        GraphPacker(other, staging, memory).pack(Submission([lane], 99), 0, staging)


def test_proposals_wider_than_their_program_fail_as_their_lanes_do(contract: PreparedContract) -> None:
    rng = np.random.default_rng(2)
    graph = contract.graphs["speculative_w2_b4"]  # one proposal a lane
    tables = np.ones((8, 12), dtype=np.int64)
    three = np.array([1, 3, 0])
    batch = speculative_batch(rng, contract.graphs["speculative_w4_b4"], constant_rows(rng, 3), tables, 1, three)
    messages = []
    for lanes in (batch.to_lanes(), batch):
        staging = poisoned_staging(contract)
        with pytest.raises(ValueError, match="offers 3 candidates") as failure:
            GraphPacker(graph, staging).pack(Submission(lanes, 1), 0, staging)
        messages.append(str(failure.value))
    assert messages[0] == messages[1]


# -- validation ----------------------------------------------------------------------------------------


def speculative_record(
    rng: np.random.Generator, expectations: SpeculativeExpectations, rows: int, width: int
) -> dict[int, np.ndarray]:
    """A well-formed record of ``expectations``' lanes (``rows`` rows, ids ``width`` wide)."""
    count = len(expectations)
    accepted = np.array([rng.integers(0, offers + 1) for offers in expectations.offers.tolist()], dtype=np.int32)
    emitted = accepted + 1
    ids = rng.integers(0, 10, (rows, width)).astype(np.int32)
    out = {
        mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE: np.array([7], dtype=np.int64),
        mf.COMPLETION_FIELD_GENERATION: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_EMITTED_TOKENS: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_CONSUMED_TOKENS: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_OFFERS: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_ACCEPTED_DRAFTS: np.zeros(rows, dtype=np.int32),
        mf.COMPLETION_FIELD_DRAFT_CURSOR: np.full(rows, -1, dtype=np.int32),
        mf.COMPLETION_FIELD_RESERVED: np.full(rows, -1, dtype=np.int32),
        mf.COMPLETION_FIELD_SAMPLED_IDS: ids,
        mf.COMPLETION_FIELD_SAMPLED_LOGPROBS: rng.uniform(-5, 0, (rows, width)).astype(np.float32),
    }
    out[mf.COMPLETION_FIELD_GENERATION][:count] = expectations.generations
    out[mf.COMPLETION_FIELD_EMITTED_TOKENS][:count] = emitted
    out[mf.COMPLETION_FIELD_CONSUMED_TOKENS][:count] = expectations.consumed + emitted
    out[mf.COMPLETION_FIELD_OFFERS][:count] = expectations.offers
    out[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS][:count] = accepted
    return out


@pytest.mark.parametrize("count", [1, 5, 40])
@pytest.mark.parametrize("lag", [-1, 2])
def test_speculative_expectations_validate_as_their_list(count: int, lag: int) -> None:
    rng = np.random.default_rng(count + lag)
    fields = [
        mf.COMPLETION_FIELD_GENERATION,
        mf.COMPLETION_FIELD_RESERVED,
        mf.COMPLETION_FIELD_DRAFT_CURSOR,
        mf.COMPLETION_FIELD_CONSUMED_TOKENS,
        mf.COMPLETION_FIELD_EMITTED_TOKENS,
        mf.COMPLETION_FIELD_OFFERS,
        mf.COMPLETION_FIELD_ACCEPTED_DRAFTS,
        mf.COMPLETION_FIELD_SAMPLED_IDS,
    ]
    for trial in range(40):
        expectations = SpeculativeExpectations(
            rng.integers(1, 100, count).astype(np.int64),
            rng.integers(0, 100, count).astype(np.int32),
            True,
            offers=rng.integers(0, 4, count).astype(np.int64),
            cursor_lag=lag,
        )
        completion = speculative_record(rng, expectations, count + 2, 4)
        if lag >= 0:
            consumed = completion[mf.COMPLETION_FIELD_CONSUMED_TOKENS][:count]
            completion[mf.COMPLETION_FIELD_DRAFT_CURSOR][:count] = np.maximum(consumed - lag, 0)
        if trial % 5 == 4:  # a record without logprobs
            del completion[mf.COMPLETION_FIELD_SAMPLED_LOGPROBS]
        for _ in range(rng.integers(0, 4)):  # corrupt a few lanes, one field each
            lane, field = int(rng.integers(0, count)), fields[int(rng.integers(0, len(fields)))]
            values = completion[field].reshape(count + 2, -1)
            values[lane, int(rng.integers(0, values.shape[1]))] = rng.choice([-1, 3, 12, 2**20])
        capacity = 4 * count + 3
        try:
            by_list = read_lanes(completion, 7, expectations.to_list(), sampled_size=10, packed_capacity=capacity)
        except CompletionError as failure:  # a corrupted offer overran the round's rows: the round fails alike
            with pytest.raises(CompletionError) as batch_failure:
                read_lanes(completion, 7, expectations, sampled_size=10, packed_capacity=capacity)
            assert str(batch_failure.value) == str(failure)
            continue
        by_batch = read_lanes(completion, 7, expectations, sampled_size=10, packed_capacity=capacity)
        assert isinstance(by_batch, SpeculativeResults) and len(by_batch) == len(by_list) == count
        assert_same_results(by_batch, by_list)


def test_a_round_overrunning_its_rows_fails_a_batch_as_it_fails_a_list() -> None:
    rng = np.random.default_rng(1)
    expectations = SpeculativeExpectations(
        np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int32), True, offers=np.array([3, 3])
    )
    completion = speculative_record(rng, expectations, 2, 4)
    messages = []
    for lanes in (expectations, expectations.to_list()):
        with pytest.raises(CompletionError, match="the lanes' offers take 8 target rows; the program holds 7") as e:
            read_lanes(completion, 7, lanes, sampled_size=10, packed_capacity=7)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_rank_agreement_rejects_the_lanes_of_a_batch_as_those_of_its_list() -> None:
    """A lane whose emitted id differs on rank 1 is rejected alone; offers that differ reject every lane."""
    rng = np.random.default_rng(9)
    expectations = SpeculativeExpectations(
        np.arange(1, 5, dtype=np.int64), np.arange(10, 50, 10, dtype=np.int32), True, offers=np.full(4, 2)
    )
    rank0 = speculative_record(rng, expectations, 4, 4)
    for field, lane in ((mf.COMPLETION_FIELD_SAMPLED_IDS, 2), (mf.COMPLETION_FIELD_OFFERS, 1)):
        rank1 = {name: values.copy() for name, values in rank0.items()}
        rank1[field].reshape(4, -1)[lane, 0] += 1
        answers = []
        for lanes in (expectations, expectations.to_list()):
            results = read_lanes(rank0, 7, lanes, sampled_size=10)
            answers.append([str(r) for r in agree_across_ranks(results, [rank0, rank1], 7, lanes, 10)])
        assert answers[0] == answers[1]
        rejected = 1 if field == mf.COMPLETION_FIELD_SAMPLED_IDS else 4
        assert sum("rank 1" in answer for answer in answers[0]) == rejected


# -- serving ---------------------------------------------------------------------------------------------


@pytest.fixture
def null_models(history_core: tuple[Path, TrustSettings], started: list[RunningModel]) -> Callable[..., RunningModel]:
    """Starts the history core on the null backend with the given options, sampling ``tokens``' ids; every
    model it started is closed after the test (the ``started`` fixture)."""

    def factory(tokens: NullTokens, **options: object) -> RunningModel:
        model = start(*history_core, LoadOptions(**options), backend="null")  # type: ignore[arg-type]
        model.engine.model.backend.tokens = tokens
        started.append(model)
        return model

    return factory


@pytest.fixture
def serve(null_models: Callable[..., RunningModel], monkeypatch: pytest.MonkeyPatch) -> Callable[..., RunningModel]:
    monkeypatch.setattr(speculation, "COLUMNS_FROM", 1)  # every history round as columns, down to one lane
    return null_models


def _served(model: RunningModel, work: list[PreparedRequest]) -> dict[str, list[object]]:
    streams = [model.engine.submit(request) for request in work]
    return {
        stream.request_id: [
            (e.token_id, e.logprob, e.pieces, e.timestamp_ns) if isinstance(e, TokenEvent) else e for e in stream
        ]
        for stream in streams
    }


def _work(tokens: NullTokens, vocabulary: int, count: int = 8) -> list[PreparedRequest]:
    """Requests whose prompts are the null backend's own ids (so proposals start at once), of different
    lengths and output limits, some ending at an EOS id."""
    return [
        PreparedRequest(
            f"r{i}",
            tokens.ids(np.arange(3 + 2 * i, dtype=np.int64), vocabulary).tolist(),
            17 + 5 * i,
            SamplingParams(temperature=0.0),
            ignore_eos=i % 3 == 0,
        )
        for i in range(count)
    ]


EOS_POSITION = 4
"""The tests' EOS id is the null backend's on-cycle id at positions ``4 mod CYCLE`` (it ends requests
that do not ignore EOS inside accepted runs)."""


def _with_cycle_eos(model: RunningModel, tokens: NullTokens) -> int:
    """Make the cycle's id at :data:`EOS_POSITION` the core's only EOS id in ``model``'s completion."""
    vocabulary = model.engine.model.contract.sampled_size
    eos = int(NullTokens(cycle=tokens.cycle).ids(np.array([EOS_POSITION], dtype=np.int64), vocabulary)[0])
    completion = model.engine.scheduler.completion
    completion.eos, completion._eos_ids = frozenset({eos}), [eos]
    return eos


def _lane_by_lane(monkeypatch: pytest.MonkeyPatch, *, scanned: bool = False) -> None:
    """Plan and apply history rounds lane by lane only (``scanned``: their proposals scanned from each
    history, as rounds of a few members are planned)."""
    if scanned:
        monkeypatch.setattr(speculation, "COLUMNS_FROM", 10**6)
    monkeypatch.setattr(SpeculativePlanner, "_batch_round", lambda *arguments: None)
    monkeypatch.setattr(RoundCompletion, "_apply_speculative_batch", lambda *arguments: False)


@pytest.mark.parametrize("novelty", [0.0, 0.2])
def test_columnar_history_rounds_serve_what_lane_by_lane_rounds_and_plain_decode_serve(
    serve: object, novelty: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = NullTokens(cycle=CYCLE, novelty=novelty)
    served: list[dict[str, list[object]]] = []
    statistics = []
    for drafting, planned in ((False, "columns"), (True, "columns"), (True, "lanes"), (True, "scanned")):
        if planned != "columns":
            _lane_by_lane(monkeypatch, scanned=planned == "scanned")
        model = serve(tokens, history_drafting=drafting, max_active=8)  # type: ignore[operator]
        _with_cycle_eos(model, tokens)
        served.append(_served(model, _work(tokens, model.engine.model.contract.sampled_size)))
        statistics.append(model.engine.statistics())
        model.engine.allocator.check()
    plain, columns, lanes, scanned = served
    assert columns == plain and lanes == plain and scanned == plain
    ends = [events[-1] for events in plain.values()]
    assert all(isinstance(end, Finished) for end in ends)
    assert {end.reason for end in ends if isinstance(end, Finished)} == {"stop", "length"}
    for name in (
        "speculative_lanes",
        "proposals_offered",
        "drafts_accepted",
        "speculative_emitted",
        "offered_by_position",
        "accepted_by_position",
        "finished",
        "pages_published",
        "rounds",
    ):
        assert getattr(statistics[1], name) == getattr(statistics[2], name) == getattr(statistics[3], name), name
    assert sum(statistics[1].drafts_accepted.values()) > 0
    assert statistics[0].speculative_lanes == {}


@pytest.mark.parametrize("planned", ["columns", "scanned"])
@pytest.mark.parametrize(("requests", "deepest"), [(1, 7), (2, 2)])
def test_a_lone_lane_offers_every_proposal_and_more_lanes_what_their_acceptance_makes_worthwhile(
    serve: object, planned: str, requests: int, deepest: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lane of the widest program (8 rows) is within FREE_VERIFIED_ROWS: it offers every proposal its
    history holds whatever its acceptance. Two lanes (16 rows) offer what a rate of 0.5 makes worthwhile: 2."""
    monkeypatch.setattr(progress, "ACCEPTANCE_WEIGHT", 1.0)  # every rate stays at its initial 0.5
    if planned == "scanned":
        _lane_by_lane(monkeypatch, scanned=True)
    tokens = NullTokens(cycle=CYCLE)
    model = serve(tokens, history_drafting=True, max_active=8)  # type: ignore[operator]
    prompt = tokens.ids(np.arange(12, dtype=np.int64), model.engine.model.contract.sampled_size).tolist()
    work = [PreparedRequest(f"r{i}", prompt, 30, SamplingParams(), ignore_eos=True) for i in range(requests)]
    served = _served(model, work)
    assert all(len(events) == 31 and isinstance(events[-1], Finished) for events in served.values())
    statistics = model.engine.statistics()
    assert max(statistics.offered_by_position) == deepest
    assert statistics.accepted_by_position[deepest] > 0  # the null backend's cycle holds every proposal


def test_pages_completed_by_accepted_proposals_are_reused_by_a_later_prompt(serve: object) -> None:
    """Every page a speculative round commits is published with the tokens it holds: a later request whose
    prompt is an earlier one's prompt and output reuses all its complete pages but the last token's."""
    tokens = NullTokens(cycle=CYCLE)
    model = serve(tokens, history_drafting=True, max_active=8)  # type: ignore[operator]
    vocabulary = model.engine.model.contract.sampled_size
    prompt = tokens.ids(np.arange(5), vocabulary).tolist()
    first = PreparedRequest("first", prompt, 41, SamplingParams(), ignore_eos=True)
    output = model.engine.generate(first)
    assert sum(model.engine.statistics().drafts_accepted.values()) > 20  # long accepted runs: pages fill inside them
    prompt = first.prompt_ids + output.token_ids
    again = model.engine.generate(PreparedRequest("again", prompt, 3, SamplingParams(), ignore_eos=True))
    assert again.reused_prompt_tokens == (len(prompt) - 1) // PAGE_TOKENS * PAGE_TOKENS


def test_a_failed_lane_fails_only_its_request_in_a_columnar_round(serve: object) -> None:
    tokens = NullTokens(cycle=CYCLE)
    model = serve(tokens, history_drafting=True, max_active=8)  # type: ignore[operator]
    backend = model.engine.model.backend
    original_run = backend.run
    broken: list[int] = []

    def inject(program: str, frame: int) -> None:
        reserved = backend.completion(frame)[mf.COMPLETION_FIELD_RESERVED].reshape(-1)
        reserved[1] = -1  # the null backend writes the reserved field once: the next round's is well-formed
        original_run(program, frame)
        if program.startswith("speculative") and not broken:
            reserved[1] = 5
            broken.append(1)

    backend.run = inject  # type: ignore[method-assign]
    served = _served(model, _work(tokens, model.engine.model.contract.sampled_size, count=4))
    failed = [rid for rid, events in served.items() if isinstance(events[-1], ExecutionFailed)]
    assert len(failed) == 1 and "the reserved model field is 5, not -1" in served[failed[0]][-1].message  # type: ignore[union-attr]
    assert all(isinstance(events[-1], Finished) for rid, events in served.items() if rid not in failed)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.4, top_k=5, seed=13)],
)
def test_columnar_history_rounds_on_the_reference_backend_serve_the_output_without_speculation(
    history_core: tuple[Path, TrustSettings], sampling: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's own tokens, greedy and sampled: rounds as columns serve what decode serves."""
    monkeypatch.setattr(speculation, "COLUMNS_FROM", 1)
    applied: list[bool] = []
    apply_batch = RoundCompletion._apply_speculative_batch

    def counted(*arguments: object) -> bool:
        applied.append(apply_batch(*arguments))  # type: ignore[arg-type]
        return applied[-1]

    monkeypatch.setattr(RoundCompletion, "_apply_speculative_batch", counted)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41], [7, 7, 8, 7, 7, 8, 7], [100, 3, 100, 3, 100]]
    work = [PreparedRequest(f"r{i}", prompt, 30, sampling, ignore_eos=True) for i, prompt in enumerate(prompts)]
    served = []
    for options in ({}, {"history_drafting": True}):
        model = start(*history_core, LoadOptions(**options), backend="reference")  # type: ignore[arg-type]
        try:
            served.append(_served(model, work))
            lanes = model.engine.statistics().speculative_lanes
        finally:
            model.close()
    assert served[1] == served[0]
    assert sum(lanes.values()) > 0 and sum(applied) > 5  # rounds planned and applied as columns
