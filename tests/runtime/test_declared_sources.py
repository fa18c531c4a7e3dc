"""Contract parts the runtime now serves: the OUTPUT_LIMIT, EOS_IDS and PENDING_TOKEN sources (with a
host-owned pending token), the completion status word, tuning producers on the reference backend,
state rows partitioned per request, and per-graph completion dependencies.

Packing is checked byte for byte against hand-computed layouts. The engine runs variants of the golden
fixture core whose decode programs bind the new sources (re-validated with ``prepare_contract``): a
host-owned pending-token variant whose decode programs embed the token the host feeds instead of
reading the device state, and a variant whose graphs declare two state rows per request. Both must
generate exactly what the fixture core generates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from helios_core.backends import reference_kernels as rk
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import LoadOptions, PreparedContract, PreparedGraph, prepare_contract, select
from helios_core.errors import StartupError, UnsupportedFeatureError
from helios_core.frontend.bootstrap import Bootstrap
from helios_core.frontend.structured import GrammarCompiler
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.completion import CompletionError, LaneExpectation, read_lanes
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import ExecutionFailed, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.packing import GraphPacker, Lane, LaneBatch, Submission
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.startup import RunningModel
from helios_core.runtime.stats import SchedulerStats
from helios_core.sampling import SAMPLING_PARAMETERS
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .conftest import FIXTURES, fixture_settings
from .packing_harness import POISON, poisoned_staging

GREEDY = SamplingParams(temperature=0.0)
EOS = (258, 256)
"""The fixture core's EOS ids."""


@pytest.fixture(scope="module")
def verified() -> Iterator[VerifiedCore]:
    core = open_core(FIXTURES / "payload-v3.core", fixture_settings(), check_resources=False)
    yield core
    core.close()


def _bound(graph: PreparedGraph, *bindings: ct.ValueBinding) -> PreparedGraph:
    """``graph`` with ``bindings`` added (a binding replaces one of the same destination)."""
    contract = ct.GraphContract()
    contract.CopyFrom(graph.contract)
    names = {b.destination for b in bindings}
    kept = [b for b in contract.bindings if b.destination not in names]
    del contract.bindings[:]
    contract.bindings.extend([*kept, *bindings])
    return dataclasses.replace(graph, contract=contract)


def _staging(contract: PreparedContract, **extra: tuple[int, ...]) -> dict[str, np.ndarray]:
    staging = poisoned_staging(contract)
    for name, shape in extra.items():
        staging[name] = np.full(shape, POISON, dtype=np.int32)
    return staging


def _lanes() -> list[Lane]:
    return [
        Lane(slot=3, generation=5, state_row=3, positions=[9], cache_slots=[9], page_table=[2, 5], tokens=[41],
             sample=True, sampling_step=4, consumed=9, output_limit=6),
        Lane(slot=1, generation=2, state_row=1, positions=[4], cache_slots=[20], page_table=[5], tokens=[17],
             sample=True, sampling_step=1, consumed=4, output_limit=11),
    ]  # fmt: skip


def _batch(lanes: list[Lane]) -> LaneBatch:
    """``lanes`` as the columns a decode round's batch holds."""
    rows: dict[int, np.ndarray] = {
        ct.VALUE_SOURCE_SLOT: np.array([lane.slot for lane in lanes]),
        ct.VALUE_SOURCE_GENERATION: np.array([lane.generation for lane in lanes]),
        ct.VALUE_SOURCE_LIVE_STATE_ROWS: np.array([lane.state_row for lane in lanes]),
        ct.VALUE_SOURCE_QUERY_LENGTH: np.ones(len(lanes), dtype=np.int64),
        ct.VALUE_SOURCE_SAMPLING_DECISION: np.ones(len(lanes), dtype=np.int64),
        ct.VALUE_SOURCE_MIXED_PREFILL_ROW: np.zeros(len(lanes), dtype=np.int64),
        ct.VALUE_SOURCE_RESTORE_SOURCE: np.full(len(lanes), -1),
        ct.VALUE_SOURCE_SNAPSHOT_DESTINATION: np.full(len(lanes), -1),
        ct.VALUE_SOURCE_CONSTRAINED: np.zeros(len(lanes), dtype=np.int64),
        ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT: np.array([lane.consumed for lane in lanes]),
        ct.VALUE_SOURCE_SAMPLING_STEP: np.array([lane.sampling_step for lane in lanes]),
        ct.VALUE_SOURCE_OUTPUT_LIMIT: np.array([lane.output_limit for lane in lanes]),
    }
    for source in (
        ct.VALUE_SOURCE_TEMPERATURE, ct.VALUE_SOURCE_TOP_P, ct.VALUE_SOURCE_TOP_K, ct.VALUE_SOURCE_MIN_P,
        ct.VALUE_SOURCE_REPETITION_PENALTY, ct.VALUE_SOURCE_FREQUENCY_PENALTY, ct.VALUE_SOURCE_PRESENCE_PENALTY,
        ct.VALUE_SOURCE_SEED_BITS,
    ):  # fmt: skip
        rows[source] = np.array([_lane_setting(lane, source) for lane in lanes])
    pages = np.zeros((4, 16), dtype=np.int64)
    for lane in lanes:
        pages[lane.slot, : len(lane.page_table)] = lane.page_table
    return LaneBatch(
        count=len(lanes),
        rows=rows,
        tokens={
            ct.VALUE_SOURCE_PROMPT_POSITIONS: np.array([p for lane in lanes for p in lane.positions]),
            ct.VALUE_SOURCE_CACHE_SLOT: np.array([c for lane in lanes for c in lane.cache_slots]),
            ct.VALUE_SOURCE_PENDING_TOKEN: np.array([t for lane in lanes for t in lane.tokens], dtype=np.int32),
        },
        page_source=pages,
        page_index=np.array([lane.slot for lane in lanes]),
        page_counts=np.array([len(lane.page_table) for lane in lanes]),
    )


def _lane_setting(lane: Lane, source: int) -> float | int:
    (parameter,) = [p for p in SAMPLING_PARAMETERS if p.source == source]
    value: float | int = getattr(lane.sampling, parameter.name)
    return value


# -- packing: OUTPUT_LIMIT --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indexing", "offset", "expected"),
    [
        (ct.INDEXING_SUBMISSION_ROW, 0, [6, 11, -1, -1]),
        (ct.INDEXING_ACTIVE_ROW, 0, [6, 11, POISON, POISON]),
        (ct.INDEXING_PHYSICAL_REQUEST_ROW, 0, [POISON, 11, POISON, 6]),
        (ct.INDEXING_SCALAR, 100, [106, POISON, POISON, POISON]),
    ],
)
def test_output_limit_packs_each_lanes_remaining_tokens(
    verified: VerifiedCore, indexing: int, offset: int, expected: list[int]
) -> None:
    contract = verified.contract
    graph = _bound(
        contract.graphs["decode_b4"],
        ct.ValueBinding(
            destination="left", source=ct.VALUE_SOURCE_OUTPUT_LIMIT, indexing=indexing, padding=-1, offset=offset
        ),
    )
    for lanes in (_lanes(), _batch(_lanes())):
        staging = _staging(contract, left=(4,))
        GraphPacker(graph, staging, eos_ids=EOS).pack(Submission(lanes, 1), 0, staging)
        assert staging["left"].tolist() == expected


# -- packing: PENDING_TOKEN -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indexing", "tail"), [(ct.INDEXING_PACKED_TOKEN, [0, 0]), (ct.INDEXING_ACTIVE_ROW, [POISON, POISON])]
)
def test_a_host_owned_pending_token_packs_each_lanes_completed_token(
    verified: VerifiedCore, indexing: int, tail: list[int]
) -> None:
    contract = verified.contract
    graph = _bound(
        contract.graphs["decode_b4"],
        ct.ValueBinding(destination="input_ids", source=ct.VALUE_SOURCE_PENDING_TOKEN, indexing=indexing, padding=0),
    )
    for lanes in (_lanes(), _batch(_lanes())):
        staging = _staging(contract)
        GraphPacker(graph, staging, eos_ids=EOS).pack(Submission(lanes, 1), 0, staging)
        assert staging["input_ids"].tolist()[:4] == [41, 17, *tail]  # P = 4: the rest keeps its bytes
        assert staging["input_ids"].tolist()[4:] == [POISON] * 12


def test_a_decode_batch_without_pending_tokens_fails_a_graph_that_binds_them(verified: VerifiedCore) -> None:
    contract = verified.contract
    graph = _bound(
        contract.graphs["decode_b4"],
        ct.ValueBinding(
            destination="input_ids",
            source=ct.VALUE_SOURCE_PENDING_TOKEN,
            indexing=ct.INDEXING_PACKED_TOKEN,
        ),
    )
    batch = _batch(_lanes())
    batch = LaneBatch(
        count=batch.count,
        rows=batch.rows,
        tokens={k: v for k, v in batch.tokens.items() if k != ct.VALUE_SOURCE_PENDING_TOKEN},
        page_source=batch.page_source,
        page_index=batch.page_index,
        page_counts=batch.page_counts,
    )
    staging = _staging(contract)
    with pytest.raises(ValueError, match=r"^lane 0 supplies 0 values for 'input_ids', but its query length is 1$"):
        GraphPacker(graph, staging, eos_ids=EOS).pack(Submission(batch, 1), 0, staging)


# -- packing: EOS_IDS -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indexing", "shape", "expected"),
    [
        (ct.INDEXING_SCALAR, (4,), [258, 256, -1, -1]),
        (ct.INDEXING_SUBMISSION_ROW, (4, 3), [[258, 256, -1], [258, 256, -1], [-1, -1, -1], [-1, -1, -1]]),
        (ct.INDEXING_ACTIVE_ROW, (4, 3), [[258, 256, -1], [258, 256, -1], [POISON] * 3, [POISON] * 3]),
        (ct.INDEXING_PHYSICAL_REQUEST_ROW, (4, 2), [[POISON] * 2, [258, 256], [POISON] * 2, [258, 256]]),
    ],
)
def test_eos_ids_pack_the_cores_ids_padded(
    verified: VerifiedCore, indexing: int, shape: tuple[int, ...], expected: list[Any]
) -> None:
    contract = verified.contract
    graph = _bound(
        contract.graphs["decode_b4"],
        ct.ValueBinding(destination="eos", source=ct.VALUE_SOURCE_EOS_IDS, indexing=indexing, padding=-1, offset=9),
    )
    for lanes in (_lanes(), _batch(_lanes())):
        staging = _staging(contract, eos=shape)
        GraphPacker(graph, staging, eos_ids=EOS).pack(Submission(lanes, 1), 0, staging)
        assert staging["eos"].tolist() == expected  # ids are a vector: the offset is not added


@pytest.mark.parametrize(
    ("indexing", "shape", "message"),
    [
        (
            ct.INDEXING_PACKED_TOKEN,
            (4,),
            "graph 'decode_b4' binds EOS_IDS to 'eos' with INDEXING_PACKED_TOKEN indexing, which packing does "
            "not supply",
        ),
        (
            ct.INDEXING_SCALAR,
            (1,),
            "graph 'decode_b4' binds EOS_IDS to 'eos', whose entries hold 1 values; the core has 2 EOS ids",
        ),
        (
            ct.INDEXING_SUBMISSION_ROW,
            (4,),
            "graph 'decode_b4' binds EOS_IDS to 'eos', whose rows hold 0 values; the core has 2 EOS ids",
        ),
    ],
)
def test_eos_ids_that_do_not_fit_fail_at_startup(
    verified: VerifiedCore, indexing: int, shape: tuple[int, ...], message: str
) -> None:
    contract = verified.contract
    graph = _bound(
        contract.graphs["decode_b4"],
        ct.ValueBinding(destination="eos", source=ct.VALUE_SOURCE_EOS_IDS, indexing=indexing, padding=-1),
    )
    staging = _staging(contract, eos=shape)
    with pytest.raises(UnsupportedFeatureError) as raised:
        GraphPacker(graph, staging, eos_ids=EOS)
    assert str(raised.value) == message


def test_a_packer_without_eos_ids_refuses_an_eos_binding(verified: VerifiedCore) -> None:
    contract = verified.contract
    graph = _bound(
        contract.graphs["decode_b4"],
        ct.ValueBinding(destination="eos", source=ct.VALUE_SOURCE_EOS_IDS, indexing=ct.INDEXING_SCALAR),
    )
    staging = _staging(contract, eos=(4,))
    with pytest.raises(ValueError) as raised:
        GraphPacker(graph, staging)
    assert str(raised.value) == "graph 'decode_b4' binds EOS_IDS to 'eos', but its packer was given no EOS ids"


# -- fixture variants -------------------------------------------------------------------------------


def _variant(verified: VerifiedCore, *, host_pending: bool = False, rows_per_request: int = 1) -> PreparedContract:
    """The fixture core's contract, changed and validated again.

    ``host_pending``: every decode program takes its pending token from the host (``input_ids`` bound
    with PENDING_TOKEN, which its embedding reads in place of the device's pending-token state) and binds
    ``left`` (OUTPUT_LIMIT) and ``eos`` (EOS_IDS). ``rows_per_request``: every graph declares that many
    state rows per request.
    """
    core = verified.core
    serving = ct.ServingContract()
    serving.CopyFrom(core.contract)
    execution = mf.ExecutionManifest()
    execution.CopyFrom(core.execution)
    programs = {p.name: p for p in execution.programs}
    for graph in serving.model.graphs:
        graph.state_rows_per_request = rows_per_request
        if not host_pending or graph.operation != ct.OPERATION_DECODE:
            continue
        graph.bindings.add(
            destination="input_ids",
            source=ct.VALUE_SOURCE_PENDING_TOKEN,
            indexing=ct.INDEXING_PACKED_TOKEN,
            padding=0,
        )
        graph.bindings.add(
            destination="left", source=ct.VALUE_SOURCE_OUTPUT_LIMIT, indexing=ct.INDEXING_SUBMISSION_ROW, padding=-1
        )
        graph.bindings.add(
            destination="eos", source=ct.VALUE_SOURCE_EOS_IDS, indexing=ct.INDEXING_SUBMISSION_ROW, padding=-1
        )
        graph.pending_token.binding_destination = "input_ids"
        program = programs[graph.name]
        nodes = [node for node in program.nodes if node.name != "load_pending_token"]
        del program.nodes[:]
        program.nodes.extend(nodes)
        (embedding,) = [node for node in program.nodes if node.name == "embedding"]
        (ids,) = [arg for arg in embedding.args if arg.name == "ids"]
        ids.view.buffer = "input_ids"  # the first B packed tokens: one per lane
    if host_pending:
        execution.transport.entries.add(name="left", dtype=mf.DTYPE_I32, shape=[4])
        execution.transport.entries.add(name="eos", dtype=mf.DTYPE_I32, shape=[4, 3])
    return prepare_contract(serving, execution, list(core.resources.values()))


class _Recorder:
    """The reference backend, recording what chosen staging entries hold when each program runs."""

    def __init__(self, inner: Any, entries: tuple[str, ...]) -> None:
        self.inner = inner
        self.entries = entries
        self.runs: list[tuple[str, dict[str, list[Any]]]] = []

    def transport(self, frame: int) -> Any:
        return self.inner.transport(frame)

    def run(self, program: str, frame: int) -> None:
        staging = self.inner.transport(frame)
        self.runs.append((program, {name: staging[name].tolist() for name in self.entries}))
        self.inner.run(program, frame)

    def completion(self, frame: int) -> Any:
        return self.inner.completion(frame)

    def close(self) -> None:
        self.inner.close()


def _engine(verified: VerifiedCore, contract: PreparedContract, entries: tuple[str, ...]) -> tuple[Engine, _Recorder]:
    selection = select(contract, LoadOptions(max_active=2))
    model = NativeModel.load(verified.core, contract, selection, backend="reference")
    recorder = _Recorder(model.backend, entries)
    model.backend = recorder
    bootstrap = Bootstrap.load(verified.core, contract)
    compiler = GrammarCompiler(
        bootstrap.tokenizer,
        sampled_size=contract.sampled_size,
        logits_width=contract.logits_width,
        eos_token_ids=contract.eos_token_ids,
    )
    return Engine(model, bootstrap.tokenizer, compiler), recorder


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    streams = [
        engine.submit(PreparedRequest(f"r{i}", prompt, max_tokens, GREEDY, ignore_eos=True))
        for i, prompt in enumerate(prompts)
    ]
    outputs = []
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], Finished), events[-1]
        outputs.append([e.token_id for e in events if isinstance(e, TokenEvent)])
    return outputs


def _prompts(running: RunningModel) -> list[list[int]]:
    return [
        running.bootstrap.encode_prompt([{"role": "user", "content": text}]) for text in ("Hello there", "Good day")
    ]


def test_a_host_owned_pending_token_core_generates_what_the_fixture_does(
    verified: VerifiedCore, start_fixture: Callable[..., RunningModel]
) -> None:
    stock = start_fixture(max_active=2)
    prompts = _prompts(stock)
    (expected,) = _generate(stock.engine, prompts[:1])
    assert stock.engine.statistics().pipelined_rounds > 0  # the fixture's decode rounds run two frames deep

    contract = _variant(verified, host_pending=True)
    decode = contract.graphs["decode_b1"]
    assert decode.completion_dependencies == {ct.VALUE_SOURCE_PENDING_TOKEN}
    assert contract.graphs["mixed_p16"].completion_dependencies == frozenset()  # its own inputs only
    engine, recorder = _engine(verified, contract, ("input_ids", "left", "eos"))
    try:
        assert _generate(engine, prompts[:1]) == [expected]
        assert engine.statistics().pipelined_rounds == 0  # each decode round waits for the token it feeds
    finally:
        engine.shutdown()
    decodes = [staged for program, staged in recorder.runs if program == "decode_b1"]
    assert len(decodes) == 7  # the prefill samples the first of the 8 tokens
    assert [staged["input_ids"][0] for staged in decodes] == expected[:7]  # each round feeds the last token
    # decode_b1 holds one row (B = 1): the entries' other rows keep what they held (zeros)
    assert [staged["left"] for staged in decodes] == [[7 - i, 0, 0, 0] for i in range(7)]
    assert all(staged["eos"] == [[258, 256, -1]] + [[0, 0, 0]] * 3 for staged in decodes)


def test_graphs_with_two_state_rows_per_request_use_rows_slot_times_two(
    verified: VerifiedCore, start_fixture: Callable[..., RunningModel]
) -> None:
    stock = start_fixture(max_active=2)
    prompts = _prompts(stock)
    expected = _generate(stock.engine, prompts)

    contract = _variant(verified, rows_per_request=2)
    engine, recorder = _engine(verified, contract, ("state_rows",))
    try:
        assert engine.model.manifests().state_rows == 4  # two active requests, two rows each
        assert _generate(engine, prompts) == expected
    finally:
        engine.shutdown()
    staged = {tuple(rows["state_rows"]) for program, rows in recorder.runs if program == "decode_b2"}
    assert staged and all(sorted(rows[:2]) == [0, 2] for rows in staged)  # B = 2: rows past it keep their bytes
    first_rows = {rows["state_rows"][0] for program, rows in recorder.runs if program in ("initialize", "prefill_p16")}
    assert first_rows <= {0, 2} and first_rows


def test_snapshot_and_restore_rows_follow_the_rows_per_request(verified: VerifiedCore) -> None:
    contract = _variant(verified, rows_per_request=2)
    selection = select(contract, LoadOptions(max_active=2))
    allocator = PageAllocator(64, contract.model.cache.page_tokens, contract.serving.cache_identity)
    scheduler = Scheduler(contract, selection, allocator, SchedulerStats())
    assert scheduler.add(PreparedRequest("a", [1, 2, 3], 4, GREEDY)) is None
    assert scheduler.add(PreparedRequest("b", [1, 2, 3], 4, GREEDY)) is None
    round_ = scheduler.next_round()
    assert round_ is not None and isinstance(round_.lanes, tuple)
    assert [lane.state_row for lane in round_.lanes] == [0, 2]
    state = scheduler.residency.running[1]
    lane = scheduler.planner.lane(state, range(0), sample=False, snapshot_row=3, restore_row=1)
    assert (lane.state_row, lane.snapshot_row, lane.restore_row) == (2, 6, 2)
    assert scheduler.planner.lane(state, range(0), sample=False).snapshot_row == -1


# -- completion status ------------------------------------------------------------------------------


def _record(status: int | None) -> dict[int, np.ndarray]:
    record: dict[int, np.ndarray] = {
        mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE: np.array([7]),
        mf.COMPLETION_FIELD_GENERATION: np.array([3, 0]),
        mf.COMPLETION_FIELD_RESERVED: np.array([-1, -1]),
        mf.COMPLETION_FIELD_DRAFT_CURSOR: np.array([-1, -1]),
        mf.COMPLETION_FIELD_CONSUMED_TOKENS: np.array([5, 0]),
        mf.COMPLETION_FIELD_EMITTED_TOKENS: np.array([1, 0]),
        mf.COMPLETION_FIELD_SAMPLED_IDS: np.array([[12], [0]]),
    }
    if status is not None:
        record[mf.COMPLETION_FIELD_STATUS] = np.array([status], dtype=np.int32)
    return record


def test_a_nonzero_status_word_fails_the_round() -> None:
    lanes = [LaneExpectation(3, 5, True)]
    assert [r.token_id for r in read_lanes(_record(None), 7, lanes, 320)] == [12]  # type: ignore[union-attr]
    assert [r.token_id for r in read_lanes(_record(0), 7, lanes, 320)] == [12]  # type: ignore[union-attr]
    with pytest.raises(CompletionError) as raised:
        read_lanes(_record(3), 7, lanes, 320)
    assert str(raised.value) == "the program reports status 3 (0 is success)"


class _StatusInjector(_Recorder):
    """Completion records with a status word that reads ``status`` from the ``nth`` decode round on."""

    def __init__(self, inner: Any, status: int, nth: int) -> None:
        super().__init__(inner, ())
        self.status = status
        self.nth = nth
        self.decodes = 0

    def run(self, program: str, frame: int) -> None:
        super().run(program, frame)
        self.decodes += program.startswith("decode")

    def completion(self, frame: int) -> Mapping[int, Any]:
        record = dict(self.inner.completion(frame))
        failed = self.decodes >= self.nth
        record[mf.COMPLETION_FIELD_STATUS] = np.array([self.status if failed else 0], dtype=np.int32)
        return record


def test_a_failing_status_fails_the_request_and_publishes_nothing_of_its_round(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture(max_active=1)
    running.engine.scheduler.pipelining = False  # one round at a time: the failing one is known
    (expected,) = _generate(running.engine, _prompts(running)[:1])
    running.model.backend = _StatusInjector(running.model.backend, status=5, nth=3)  # type: ignore[assignment]
    stream = running.engine.submit(PreparedRequest("f", _prompts(running)[0], 8, GREEDY, ignore_eos=True))
    events = list(stream)
    failed = events[-1]
    assert isinstance(failed, ExecutionFailed)
    assert failed.message == "execution failed: the program reports status 5 (0 is success)"
    published = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert published == expected[:3]  # the prefill's token and two decode rounds; nothing of the third


# -- tuning producers on the reference backend ------------------------------------------------------


def _with_tuning(verified: VerifiedCore, *, broken: bool = False) -> PreparedContract:
    execution = mf.ExecutionManifest()
    execution.CopyFrom(verified.core.execution)
    tuned = execution.buffers.add(name="tuned.table", role=mf.BUFFER_ROLE_TUNED, dtype=mf.DTYPE_F32)
    tuned.shape.add(size=1)
    tuned.shape.add(size=32)
    program = execution.tuning_programs.add(name="tune_table")
    node = program.nodes.add(name="fill")
    node.op.name, node.op.version = "rmsnorm", 1
    width = 16 if broken else 32  # a broken producer's weight does not match its rows
    for name, buffer, shape in (
        ("x", "output_norm.weight", [1, 32]),
        ("weight", "output_norm.weight", [width]),
        ("out", "tuned.table", [1, 32]),
    ):
        node.args.add(name=name, view=mf.BufferView(buffer=buffer, shape=shape))
    node.attributes.add(name="eps", float_value=1e-5)
    execution.tuning.add(program="tune_table", outputs=["tuned.table"])
    return dataclasses.replace(verified.contract, execution=execution)


def test_tuning_producers_fill_their_buffers_before_the_reference_backend_serves(verified: VerifiedCore) -> None:
    contract = _with_tuning(verified)
    backend = ReferenceBackend(contract, verified.core, cache_pages=8, state_rows=2, frames=2)
    try:
        weight = np.asarray(backend.buffers["output_norm.weight"], dtype=np.float32)
        want = rk.rmsnorm(weight.reshape(1, 32), weight, 1e-5)
        assert np.any(want)
        np.testing.assert_allclose(backend.buffers["tuned.table"], want, rtol=1e-6)
    finally:
        backend.close()


def test_a_failing_tuning_producer_fails_startup(verified: VerifiedCore) -> None:
    contract = _with_tuning(verified, broken=True)
    with pytest.raises(StartupError, match=r"^tuning producer 'tune_table': "):
        ReferenceBackend(contract, verified.core, cache_pages=8, state_rows=2, frames=2)
