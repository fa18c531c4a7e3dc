"""A prefill chunk (``--prefill-chunk N``, ``LoadOptions.prefill_chunk``): only the prompt-computing programs
(prefill, mixed, resume, scored prefill) of at most N tokens are selected, so a long prompt is computed in
rounds of at most N tokens and the requests already decoding get a token in every one of them (mixed
rounds), while what every request generates stays what it generates without the chunk.

The core: the tiny synthetic Llama with prefill programs of 8 and 32 tokens, 4 slots, decode B1/B2/B4,
pages of 4 tokens, a context of 128."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.contract import LoadOptions, PreparedContract, select
from helios_core.errors import StartupError
from helios_core.loading import open_core
from helios_core.runtime.completion import ExpectationBatch, LaneResult, LaneResults
from helios_core.runtime.gates import GateOutcome
from helios_core.runtime.messages import PreparedRequest, SamplingParams
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.packing import GraphPacker, Lane, LaneBatch, Submission
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.startup import RunningModel
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct

from .engine_harness import SignedCore, assert_each_finishes_at_length, build_signed_core, prompt_of, run, submit_all
from .packing_harness import poisoned_staging

NAMESPACE = "tests/prefill-chunk"
CAPS = Capacities(
    max_rows=4, prefill_tokens=(8, 32), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=128, context=128, snapshots=2
)
PROMPT_OPERATIONS = (ct.OPERATION_PREFILL, ct.OPERATION_MIXED, ct.OPERATION_RESUME, ct.OPERATION_SCORED_PREFILL)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    directory = tmp_path_factory.mktemp("prefill-chunk")
    return build_signed_core(build_core, synthetic_declaration("tiny", seed=7), CAPS, directory, NAMESPACE)


@pytest.fixture(scope="module")
def contract(core: SignedCore) -> Iterator[PreparedContract]:
    verified = open_core(core.path, core.trust, check_resources=False)
    yield verified.contract
    verified.close()


def prompt_programs(contract: PreparedContract, graphs: dict[str, object] | None = None) -> dict[str, int]:
    """Each prompt-computing program's name and token capacity, of ``graphs`` (default: the core's)."""
    chosen = contract.graphs if graphs is None else graphs
    return {
        name: graph.extents.token_capacity
        for name, graph in contract.graphs.items()
        if name in chosen and graph.operation in PROMPT_OPERATIONS
    }


# -- selection ------------------------------------------------------------------------------------------


def test_the_core_has_every_prompt_operation_at_8_and_32_tokens(contract: PreparedContract) -> None:
    programs = prompt_programs(contract)
    assert sorted(programs.values()) == [8, 8, 8, 8, 32, 32, 32, 32]
    for operation in PROMPT_OPERATIONS:
        assert sorted(g.extents.token_capacity for g in contract.graphs.values() if g.operation == operation) == [8, 32]


@pytest.mark.parametrize("chunk", [8, 9, 31])
def test_a_chunk_keeps_only_the_prompt_programs_within_it(contract: PreparedContract, chunk: int) -> None:
    everything = select(contract, LoadOptions())
    selection = select(contract, LoadOptions(prefill_chunk=chunk))
    kept = prompt_programs(contract, dict(selection.graphs))
    assert len(kept) == 4 and set(kept.values()) == {8}
    dropped = set(everything.graphs) - set(selection.graphs)
    assert {contract.graphs[name].extents.token_capacity for name in dropped} == {32}
    assert {contract.graphs[name].operation for name in dropped} == set(PROMPT_OPERATIONS)


@pytest.mark.parametrize("chunk", [None, 32, 1000])
def test_a_chunk_at_or_above_the_largest_program_keeps_every_program(contract: PreparedContract, chunk: int) -> None:
    assert set(select(contract, LoadOptions(prefill_chunk=chunk)).graphs) == set(contract.graphs)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (7, "--prefill-chunk 7 leaves no prefill program: the core's smallest computes 8 tokens"),
        (0, "--prefill-chunk must be positive, not 0"),
        (-8, "--prefill-chunk must be positive, not -8"),
    ],
)
def test_a_chunk_below_every_program_of_a_kind_is_a_startup_error(
    contract: PreparedContract, chunk: int, message: str
) -> None:
    with pytest.raises(StartupError, match=re.escape(message)):
        select(contract, LoadOptions(prefill_chunk=chunk))


# -- rounds -----------------------------------------------------------------------------------------------


def make_scheduler(core: SignedCore, contract: PreparedContract, **options: int) -> Scheduler:
    verified = open_core(core.path, core.trust, check_resources=False)
    try:
        selection = select(contract, LoadOptions(**options))
        model = NativeModel.load(verified.core, contract, selection, backend="null")
        try:
            allocator = PageAllocator(
                model.cache_pages, contract.model.cache.page_tokens, contract.serving.cache_identity
            )
            return Scheduler(contract, model.selection, allocator, SchedulerStats())
        finally:
            model.close()
    finally:
        verified.close()


def complete(scheduler: Scheduler, plan: RoundPlan, token: int = 5) -> None:
    """Complete ``plan`` with ``token`` for every sampling lane."""
    expectations = plan.expectations
    if isinstance(expectations, ExpectationBatch):
        scheduler.complete(plan, LaneResults([token] * len(expectations), [-0.5] * len(expectations), {}, {}))
        return
    answers = [LaneResult(token, -0.5) if e.samples else LaneResult(-1, 0.0) for e in expectations]
    scheduler.complete(plan, answers)


def decode_all(scheduler: Scheduler) -> None:
    """Run rounds until one is a decode round of every running request."""
    while True:
        plan = scheduler.next_round()
        assert plan is not None
        complete(scheduler, plan)
        if plan.graph.operation == ct.OPERATION_DECODE and len(plan.request_ids) == len(scheduler.running):
            return


def request(request_id: str, length: int, max_tokens: int) -> PreparedRequest:
    return PreparedRequest(request_id, prompt_of(len(request_id), length), max_tokens, SamplingParams(0.0))


def test_a_long_prompt_runs_in_mixed_rounds_of_at_most_the_chunk_with_every_decoder_in_each(
    core: SignedCore, contract: PreparedContract
) -> None:
    scheduler = make_scheduler(core, contract, prefill_chunk=8)
    for index in range(3):
        assert scheduler.add(request(f"d{index}", 5, 60)) is None
    decode_all(scheduler)
    assert scheduler.add(request("long", 30, 2)) is None
    initialize = scheduler.next_round()
    assert initialize is not None and initialize.graph.name == "initialize"
    complete(scheduler, initialize)
    chunks: list[tuple[str, list[int]]] = []
    while True:
        plan = scheduler.next_round()
        assert plan is not None
        lanes = plan.lane_list()
        if plan.graph.operation != ct.OPERATION_MIXED:
            break
        assert list(plan.request_ids[:3]) == ["d0", "d1", "d2"]  # every decoder, one token each
        assert [len(lane.positions) for lane in lanes[:3]] == [1, 1, 1]
        (long_lane,) = lanes[3:]
        chunks.append((plan.graph.name, list(long_lane.positions)))
        complete(scheduler, plan)
    # 30 prompt tokens, five a round beside the three decoders' tokens, on the 8-token mixed program
    assert [name for name, _ in chunks] == ["mixed_p8"] * 6
    assert [positions for _, positions in chunks] == [list(range(start, start + 5)) for start in range(0, 30, 5)]
    assert plan.graph.operation == ct.OPERATION_DECODE


def test_without_a_chunk_the_same_prompt_takes_one_mixed_round(core: SignedCore, contract: PreparedContract) -> None:
    scheduler = make_scheduler(core, contract)
    for index in range(3):
        assert scheduler.add(request(f"d{index}", 5, 60)) is None
    decode_all(scheduler)
    assert scheduler.add(request("long", 28, 2)) is None
    initialize = scheduler.next_round()
    assert initialize is not None
    complete(scheduler, initialize)
    plan = scheduler.next_round()
    assert plan is not None and plan.graph.name == "mixed_p32"
    assert [len(lane.positions) for lane in plan.lane_list()] == [1, 1, 1, 28]


# -- serving ------------------------------------------------------------------------------------------------


def test_served_tokens_are_the_same_with_and_without_a_chunk(core: SignedCore, started: list[RunningModel]) -> None:
    prompts = [prompt_of(index, length) for index, length in enumerate((5, 30, 9, 61))]
    whole = run(core, started)
    expected = _served(whole, prompts)
    assert (
        whole.engine.statistics().launches.get("mixed_p32", 0)
        + whole.engine.statistics().launches.get("prefill_p32", 0)
        > 0
    )
    chunked = run(core, started, prefill_chunk=8)
    streams = submit_all(chunked.engine, prompts, 12)
    assert_each_finishes_at_length(streams, expected)
    launches = chunked.engine.statistics().launches
    assert {name for name, count in launches.items() if count and name.endswith("_p32")} == set()
    # 105 prompt tokens in rounds of at most 8: at least 14 prompt rounds
    assert sum(count for name, count in launches.items() if name.endswith("_p8")) >= 14


def _served(model: RunningModel, prompts: list[list[int]]) -> list[list[int]]:
    from .engine_harness import token_ids

    return [token_ids(list(stream)) for stream in submit_all(model.engine, prompts, 12)]


def test_run_options_carry_the_chunk_to_the_load_options(tmp_path: Path) -> None:
    from helios_core.server.serve import resolve_options

    core = tmp_path / "model.core"
    assert resolve_options({"core": core, "prefill_chunk": 64}).prefill_chunk == 64
    assert resolve_options({"core": core}, environ={"HELIOS_PREFILL_CHUNK": "128"}).prefill_chunk == 128
    with pytest.raises(StartupError, match=re.escape("prefill-chunk (from $HELIOS_PREFILL_CHUNK) must be an integer")):
        resolve_options({"core": core}, environ={"HELIOS_PREFILL_CHUNK": "many"})


# -- mixed rounds as columns -----------------------------------------------------------------------------


class MaskGate:
    """A host gate that constrains every token to ``mask``, presents no text and never stops its request."""

    constrained = True
    holds_rounds = True
    plain = False

    def __init__(self, mask: np.ndarray) -> None:
        self._mask = mask

    def mask(self) -> np.ndarray:
        return self._mask

    def text(self, token: int) -> str:
        return ""

    def observe(self, token: int) -> GateOutcome:
        return GateOutcome(pieces=[(token, "")])

    def finish(self) -> list[tuple[int, str]]:
        return []


def sampled(request_id: str, length: int, max_tokens: int, sampling: SamplingParams) -> PreparedRequest:
    return PreparedRequest(request_id, prompt_of(len(request_id) + length, length), max_tokens, sampling)


VARIED = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11),
    SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, seed=3),
)


def lanes_one_by_one(scheduler: Scheduler, plan: RoundPlan) -> list[Lane]:
    """``plan``'s lanes as the planner builds a lane on its own: each decode lane at its request's consumed
    endpoint, each prompt lane over the positions the plan gave it."""
    planner = scheduler.planner
    states = {s.request_id: s for s in scheduler.running}
    lanes = []
    for request_id, lane in zip(plan.request_ids, plan.lane_list(), strict=True):
        state = states[request_id]
        positions = range(lane.positions[0], lane.positions[-1] + 1)
        if lane.mixed_prefill:
            lanes.append(planner.lane(state, positions, sample=lane.sample, mixed_prefill=True))
        else:
            consumed = int(scheduler.table.consumed[state.slot])
            assert list(positions) == [consumed]
            lanes.append(planner.lane(state, range(consumed, consumed + 1), sample=True))
    return lanes


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("constrained", [False, True])
def test_a_mixed_rounds_columns_stage_exactly_what_its_lanes_stage(
    core: SignedCore, contract: PreparedContract, chunk: int | None, constrained: bool
) -> None:
    """Every mixed round is planned as one LaneBatch; packed round after round on one packer it stages the
    bytes that the same lanes built one by one (``RoundPlanner.lane``) stage on another, page tables
    remembered between rounds included."""
    options = {} if chunk is None else {"prefill_chunk": chunk}
    scheduler = make_scheduler(core, contract, **options)
    words = contract.mask_words
    if constrained:  # the second decoder and the long prompt sample under a grammar mask
        masks = {"d1": np.full(words, 0x0F0F0F0F, dtype=np.int32), "long": np.full(words, 0x00FF00FF, dtype=np.int32)}
        scheduler.make_gate = lambda request: (
            MaskGate(masks[request.request_id]) if request.request_id in masks else None
        )
    for index, sampling in enumerate(VARIED):
        assert scheduler.add(sampled(f"d{index}", 5 + 2 * index, 60, sampling)) is None
    decode_all(scheduler)
    assert scheduler.add(sampled("long", 30, 3, SamplingParams(temperature=0.5, top_k=7, seed=5))) is None
    by_batch, by_lanes = poisoned_staging(contract), poisoned_staging(contract)
    packers = {}
    mixed = 0
    for _ in range(40):
        plan = scheduler.next_round()
        assert plan is not None
        if plan.graph.operation == ct.OPERATION_MIXED:
            mixed += 1
            assert isinstance(plan.lanes, LaneBatch)
            assert plan.constrained is constrained
            if plan.graph.name not in packers:
                packers[plan.graph.name] = (GraphPacker(plan.graph, by_batch), GraphPacker(plan.graph, by_lanes))
            batch_packer, lane_packer = packers[plan.graph.name]
            batch_packer.pack(Submission(plan.lanes, mixed), 0, by_batch)
            lane_packer.pack(Submission(lanes_one_by_one(scheduler, plan), mixed), 0, by_lanes)
            for name in by_batch:
                assert by_batch[name].tobytes() == by_lanes[name].tobytes(), (plan.graph.name, mixed, name)
        complete(scheduler, plan)
        if not any(s.request_id == "long" for s in scheduler.running):
            break
    # 30 prompt tokens beside three decoders: 29 then 1 on the 32-token program, or 5 a round on the 8-token one
    assert mixed == (2 if chunk is None else 6)
