"""Speculative programs of tensor-parallel cores on thread ranks: history and self-drafting cores of two
ranks serve the one-rank cores' greedy tokens, every self-drafting program broadcasts rank 0's draft
confidences right before its allocation, and that broadcast is what keeps the ranks' allocations equal.

The perturbation stands for ranks whose floating-point sums differ in their last bits: on rank 1 the
reference ``draft_argmax`` step is wrapped so that, after it runs, its confidence row is overwritten
(lane 0 certain, every other lane hopeless), before the program's broadcast. With the broadcast every
rank allocates from rank 0's confidences and nothing changes; in a core built without it rank 1
allocates other prefixes, its completion record differs from rank 0's, and rank agreement commits none
of the round's lanes on any rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pytest
from ignition.build import assemble, build_core
from ignition.recipes.llama import (
    CONFIDENCE_BROADCAST,
    Capacities,
    LlamaProgramWriter,
    self_draft_draws,
    speculative_widths,
)
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends import reference
from helios_core.backends.ranks import RankedBackend
from helios_core.runtime.messages import ExecutionFailed, Finished
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf

from .engine_harness import SignedCore, build_signed_core, run, solo_tokens, submit_all, token_ids

DRAFT_TOKENS = 3
MAX_TOKENS = 16
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5], [40, 41, 42, 43, 40, 41, 42, 43, 40]]
"""Two prompts served together (rounds of two lanes, whose allocation depends on confidence), repetitive
so that history proposals are offered too."""


def _caps(speculation: str) -> Capacities:
    return Capacities(
        max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=64, context=64,
        speculative_widths=speculative_widths(DRAFT_TOKENS), speculation=speculation, draft_tokens=DRAFT_TOKENS,
    )  # fmt: skip


@contextmanager
def _without_confidence_broadcast() -> Iterator[None]:
    """Programs written meanwhile allocate from each rank's own confidences (no broadcast node)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaProgramWriter, "_broadcast_confidence", staticmethod(lambda prog, confidence: None))
        yield


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SignedCore]:
    """The tiny synthetic core (seed 5, 4 heads, 2 key-value heads) as one-rank and two-rank history and
    self-drafting cores, and a two-rank self-drafting core built without the confidence broadcast."""
    directory = tmp_path_factory.mktemp("rank-speculation")
    declaration = synthetic_declaration("tiny", seed=5)
    namespace = "helios-tests/rank-speculation"

    def build(name: str, speculation: str, ranks: int) -> SignedCore:
        builder = partial(build_core, tensor_parallel=ranks)
        return build_signed_core(builder, declaration, _caps(speculation), directory, namespace, name=name)

    built = {
        "history": build("history", "history", 0),
        "history-tp2": build("history-tp2", "history", 2),
        "self-draft": build("self-draft", "self-draft", 0),
        "self-draft-tp2": build("self-draft-tp2", "self-draft", 2),
    }
    with _without_confidence_broadcast():
        built["self-draft-tp2-unbroadcast"] = build("self-draft-tp2-unbroadcast", "self-draft", 2)
    return built


def _served_together(model: RunningModel) -> list[list[Any]]:
    """The events of :data:`PROMPTS` queued at once."""
    return [list(stream) for stream in submit_all(model.engine, PROMPTS, MAX_TOKENS)]


def _speculated(model: RunningModel) -> tuple[int, int]:
    stats = model.engine.statistics()
    return sum(stats.proposals_offered.values()), sum(stats.drafts_accepted.values())


# ----------------------------------------------------------------------------------------------- programs


def _program_nodes(manifest: mf.ExecutionManifest, prefix: str) -> dict[str, list[mf.Node]]:
    return {p.name: list(p.nodes) for p in manifest.programs if p.name.startswith(prefix)}


@pytest.mark.parametrize("kernel_graph", [False, True], ids=["reference-graph", "kernel-graph"])
@pytest.mark.parametrize("draft_sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_every_drafting_program_broadcasts_rank_zero_confidence_right_before_the_allocation(
    ranks: int, draft_sampling: str, kernel_graph: bool
) -> None:
    caps = dataclasses.replace(_caps("self-draft"), draft_sampling=draft_sampling)
    _, builder, _ = assemble(
        synthetic_declaration("tiny", seed=5), caps, kernel_graph=kernel_graph, tensor_parallel=ranks
    )
    programs = _program_nodes(builder.manifest, "selfdraft_")
    assert sorted(programs) == sorted(f"selfdraft_w{w}_b{b}" for w in (1, 2, 4) for b in (1, 2, 4))
    for name, nodes in programs.items():
        width, rows = (int(part[1:]) for part in name.removeprefix("selfdraft_").split("_"))
        ops = [node.op.name for node in nodes]
        allocation = ops.index("draft_allocate")
        assert ops.count("draft_allocate") == 1
        if not self_draft_draws(width, DRAFT_TOKENS):  # width one draws nothing: no confidence to agree on
            assert "broadcast" not in ops
            continue
        assert ops.count("broadcast") == 1
        broadcast = nodes[allocation - 1]
        assert (broadcast.name, broadcast.op.name, broadcast.op.version) == (CONFIDENCE_BROADCAST, "broadcast", 1)
        assert [(a.name, a.int_value) for a in broadcast.attributes] == [("root", 0)]
        confidence = next(arg.view for arg in nodes[allocation].args if arg.name == "confidence")
        assert list(confidence.shape) == [rows, DRAFT_TOKENS]
        assert {arg.name: arg.view for arg in broadcast.args} == {"x": confidence, "out": confidence}
        # every draft step's confidence is written before the broadcast (nothing after it changes them)
        assert [node.name for node in nodes].index("draft_confidence") < allocation - 1


def test_cores_built_without_tensor_parallel_and_history_programs_carry_no_broadcast() -> None:
    declaration = synthetic_declaration("tiny", seed=5)
    _, plain, _ = assemble(declaration, _caps("self-draft"))
    assert all(node.op.name != "broadcast" for program in plain.manifest.programs for node in program.nodes)
    _, history, _ = assemble(declaration, _caps("history"), tensor_parallel=2)
    programs = _program_nodes(history.manifest, "speculative_")
    assert sorted(programs) == sorted(f"speculative_w{w}_b{b}" for w in (1, 2, 4) for b in (1, 2, 4))
    for nodes in programs.values():
        ops = [node.op.name for node in nodes]
        assert "broadcast" not in ops and "draft_allocate" not in ops
        assert ops.count("all_reduce") == 2 * 2  # the output and down projections of both layers


# ----------------------------------------------------------------------------------------------- serving


@pytest.mark.parametrize("speculation", ["history", "self-draft"])
def test_a_two_rank_speculative_core_serves_the_one_rank_cores_greedy_tokens(
    cores: dict[str, SignedCore], started: list[RunningModel], speculation: str
) -> None:
    options = {"history_drafting": speculation == "history"}  # history proposals are a startup option
    single = run(cores[speculation], started, **options)
    expected = solo_tokens(single.engine, PROMPTS, MAX_TOKENS)
    ranked = run(cores[f"{speculation}-tp2"], started, **options)
    assert isinstance(ranked.model.backend, RankedBackend)
    assert ranked.model.backend.size == 2
    assert solo_tokens(ranked.engine, PROMPTS, MAX_TOKENS) == expected
    for events, tokens in zip(_served_together(ranked), expected, strict=True):
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert token_ids(events) == tokens
    offered, accepted = _speculated(ranked)
    assert offered > 0 and accepted > 0  # speculative rounds ran, and some proposals held


class _Perturbation:
    """Rank 1's ``draft_argmax`` steps, wrapped: after each, lane 0's confidence is 1 and every other
    lane's 0 (rank 0's steps are left alone)."""

    def __init__(self) -> None:
        self.original = reference._ADAPTERS[("draft_argmax", 1)]
        self.steps = 0

    def adapter(self, node: Any) -> Callable[[], None]:
        step = self.original(node)
        communicator = node.communicator
        if communicator is None or communicator.rank != 1:
            return step
        confidence = node.tensor("confidence").reshape(-1)

        def perturbed() -> None:
            step()
            confidence[0] = 1.0
            confidence[1:] = 0.0
            self.steps += 1

        return perturbed


def _start_perturbed(core: SignedCore, started: list[RunningModel]) -> tuple[RunningModel, _Perturbation]:
    perturbation = _Perturbation()
    with pytest.MonkeyPatch.context() as patch:  # the steps are bound at load
        patch.setitem(reference._ADAPTERS, ("draft_argmax", 1), perturbation.adapter)
        model = run(core, started)
    return model, perturbation


def _record_allocations(model: RunningModel) -> list[tuple[str, list[list[int]]]]:
    """From now on, after every self-drafting round: its program and each rank's allocated lane lengths
    (rank order), appended to the list returned."""
    backend = model.model.backend
    if not isinstance(backend, RankedBackend):
        raise TypeError(f"a model on thread ranks has a RankedBackend, not {type(backend).__name__}")
    run_program = backend.run
    rounds: list[tuple[str, list[list[int]]]] = []

    def recording(program: str, frame: int) -> None:
        run_program(program, frame)
        if program.startswith("selfdraft_"):
            lanes = int(program.rsplit("_b", 1)[1])
            buffers = [rank.buffers["scratch.self_draft.query_length"] for rank in backend.ranks]
            rounds.append((program, [[int(n) for n in lengths[:lanes]] for lengths in buffers]))

    backend.run = recording  # type: ignore[method-assign]
    return rounds


PERTURBED_ALLOCATION = [DRAFT_TOKENS + 1, 1]
"""What rank 1 allocates in a round of two lanes from its perturbed confidences: lane 0 takes every
proposal row it may (P = 2 + 3 rows at width four)."""


def test_a_perturbed_rank_one_confidence_does_not_change_the_allocation(
    cores: dict[str, SignedCore], started: list[RunningModel]
) -> None:
    expected = solo_tokens(run(cores["self-draft"], started).engine, PROMPTS, MAX_TOKENS)
    model, perturbation = _start_perturbed(cores["self-draft-tp2"], started)
    rounds = _record_allocations(model)
    for events, tokens in zip(_served_together(model), expected, strict=True):
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert token_ids(events) == tokens
    assert perturbation.steps > 0  # rank 1's confidences were changed before every broadcast
    assert rounds
    for _, (rank0, rank1) in rounds:
        assert rank1 == rank0  # every rank allocated from rank 0's confidences
    # rank 0's own choice differed from what the perturbed confidences would have chosen
    assert any(program == "selfdraft_w4_b2" and rank0 != PERTURBED_ALLOCATION for program, (rank0, _) in rounds)
    assert _speculated(model)[0] > 0


def test_without_the_broadcast_a_perturbed_rank_disagrees_and_no_rank_commits_the_lanes(
    cores: dict[str, SignedCore], started: list[RunningModel]
) -> None:
    core = cores["self-draft-tp2-unbroadcast"]
    expected = solo_tokens(run(cores["self-draft"], started).engine, PROMPTS, MAX_TOKENS)
    # unperturbed, thread ranks' sums agree to the bit: the core without the broadcast serves correctly
    for events, tokens in zip(_served_together(run(core, started)), expected, strict=True):
        assert token_ids(events) == tokens
    model, perturbation = _start_perturbed(core, started)
    rounds = _record_allocations(model)
    ends = _served_together(model)
    assert perturbation.steps > 0
    # the first self-drafting round of the two lanes: the ranks allocated from their own confidences
    ((program, (rank0, rank1)),) = rounds
    assert program == "selfdraft_w4_b2"
    assert rank1 == PERTURBED_ALLOCATION != rank0
    # the ranks laid out, verified and reported different rows: every lane of the round is rejected
    for lane, (events, tokens) in enumerate(zip(ends, expected, strict=True)):
        failure = events[-1]
        assert isinstance(failure, ExecutionFailed)
        assert failure.message == (
            f"lane {lane}: rank 1 allocated the cohort apart from rank 0 (the offers of lane 0 differ); "
            "no lane of the round is committed"
        )
        published = token_ids(events)
        assert len(published) < MAX_TOKENS
        assert published == tokens[: len(published)]  # nothing of the rejected round was committed
    model.engine.allocator.check()
    assert model.engine.allocator.referenced_pages == 0


def test_ranks_that_allocate_a_cohort_apart_commit_none_of_its_lanes() -> None:
    """Four speculative lanes; rank 1 gave lane 2 a different prefix (its offers differ) while the other three
    lanes' fields match rank 0's bit for bit: every lane is rejected, since the ranks summed rows of different
    layouts for all of them."""
    from helios_core.runtime.completion import CompletionError, agree_across_ranks, read_lanes
    from tests.runtime.test_speculative_host import expect, record

    lanes = [(1, 2, 2, 3, 13, [5, 6, 7]), (2, 1, 0, 1, 21, [9]), (3, 2, 1, 2, 32, [4, 8]), (4, 1, 1, 2, 41, [3, 3])]
    expectations = [expect(1, 10, 2), expect(2, 20, 1), expect(3, 30, 2), expect(4, 39, 1)]
    rank0 = record(lanes)
    rank1 = record([*lanes[:2], (3, 1, 1, 2, 32, [4, 8]), lanes[3]])
    results = read_lanes(rank0, 3, expectations, sampled_size=100)
    assert not any(isinstance(result, CompletionError) for result in results)
    agreed = agree_across_ranks(results, [rank0, rank1], 3, expectations, 100)
    assert [str(result) for result in agreed] == [
        f"lane {index}: rank 1 allocated the cohort apart from rank 0 (the offers of lane 2 differ); "
        "no lane of the round is committed"
        for index in range(4)
    ]
    # a difference outside the allocation (a sampled id) rejects that lane only
    rank1 = record([*lanes[:3], (4, 1, 1, 2, 41, [3, 7])])
    agreed = agree_across_ranks(results, [rank0, rank1], 3, expectations, 100)
    assert [isinstance(result, CompletionError) for result in agreed] == [False, False, False, True]
