"""Thread ranks: the collectives of a ThreadCommunicator group, a per-rank program through a RankedBackend,
and rank agreement of completion records in the engine.

The per-rank program is handcrafted (a manifest of a few nodes, weights from an in-memory core): a
tensor-parallel MLP ``y = W2 · (W1 · x)`` whose first projection is split by output rows (each rank holds
``W1[r]``, ``all_gather`` joins the halves) and whose second by input columns (each rank holds ``W2[:, r]``,
``all_reduce`` sums the partial products), beside the same MLP declared for one rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from unittest import mock

import numpy as np
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends.ranks import RankedBackend, RankError, ThreadCommunicator
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import LoadOptions, select
from helios_core.errors import StartupError, UnsupportedFeatureError
from helios_core.loading import open_core
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import ExecutionFailed, Finished
from helios_core.runtime.native_model import NativeModel
from helios_core.wire import manifest_pb2 as mf

from .conftest import FIXTURES, fixture_settings
from .engine_harness import (
    FailingRank,
    SignedCore,
    build_signed_core,
    prompt_of,
    run,
    solo_tokens,
    submit_all,
    token_ids,
)

DEADLINE_S = 0.5
"""The collective deadline of the failure tests: short, so a missing rank is found quickly."""


def on_ranks(size: int, action: Callable[[ThreadCommunicator], Any], *, deadline_s: float = 10.0) -> list[Any]:
    """Run ``action(communicator)`` on ``size`` thread ranks of one group: each rank's result or exception."""
    communicators = ThreadCommunicator.group(size, deadline_s=deadline_s)
    outcomes: list[Any] = [None] * size

    def body(rank: int) -> None:
        try:
            outcomes[rank] = action(communicators[rank])
        except Exception as exc:  # the outcome under test
            outcomes[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a rank hangs"
    return outcomes


# ----------------------------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("size", [2, 4])
def test_all_reduce_sums_in_rank_order_with_the_same_bits_on_every_rank(size: int) -> None:
    # float32 sums whose value depends on the order: 1e8 + 1 rounds back to 1e8
    values = [np.float32(1e8), np.float32(1.0), np.float32(-1e8), np.float32(1.0)][:size]
    rows = [np.array([value, value * 2, 3.0 * (rank + 1)], dtype=np.float32) for rank, value in enumerate(values)]
    expected = rows[0].copy()
    for row in rows[1:]:
        expected = expected + row
    for attempt in range(5):  # the ranks arrive in a different order each time

        def action(comm: ThreadCommunicator, attempt: int = attempt) -> np.ndarray:
            time.sleep(0.002 * ((comm.rank + attempt) % size))
            return np.array(comm.all_reduce(rows[comm.rank]))

        results = on_ranks(size, action)
        for result in results:
            assert result.dtype == np.float32
            assert result.tobytes() == expected.tobytes()
    if size == 2:
        assert expected.tolist() == [1e8, 2e8, 9.0]  # 1e8 + 1 and 2e8 + 2 round back in float32
    else:
        assert expected.tolist() == [1.0, 2.0, 30.0]  # ((1e8 + 1) - 1e8) + 1 = 1, not 2


@pytest.mark.parametrize("size", [2, 4])
def test_all_gather_concatenates_in_rank_order_along_the_axis(size: int) -> None:
    def action(comm: ThreadCommunicator) -> tuple[np.ndarray, np.ndarray]:
        block = np.arange(6, dtype=np.int32).reshape(2, 3) + 100 * comm.rank
        return np.array(comm.all_gather(block, 0)), np.array(comm.all_gather(block, -1))

    blocks = [np.arange(6, dtype=np.int32).reshape(2, 3) + 100 * rank for rank in range(size)]
    for rows, columns in on_ranks(size, action):
        assert rows.tolist() == np.concatenate(blocks, axis=0).tolist()
        assert columns.tolist() == np.concatenate(blocks, axis=1).tolist()
        assert columns.shape == (2, 3 * size)


@pytest.mark.parametrize("size", [2, 4])
def test_broadcast_gives_every_rank_the_roots_array(size: int) -> None:
    root = size - 1

    def action(comm: ThreadCommunicator) -> np.ndarray:
        return np.array(comm.broadcast(np.full(3, comm.rank, dtype=np.float32), root))

    assert [result.tolist() for result in on_ranks(size, action)] == [[float(root)] * 3] * size


def test_one_rank_collectives_are_copies() -> None:
    (comm,) = ThreadCommunicator.group(1)
    x = np.arange(4, dtype=np.float32)
    assert comm.all_reduce(x).tolist() == x.tolist()
    assert comm.all_gather(x, 0).tolist() == x.tolist()
    assert comm.broadcast(x, 0).tolist() == x.tolist()


def test_a_failing_rank_makes_every_rank_raise_within_the_deadline() -> None:
    def action(comm: ThreadCommunicator) -> np.ndarray:
        if comm.rank == 2:
            comm.abort("rank 2 failed: ValueError: bad weights")
            raise ValueError("bad weights")
        return np.array(comm.all_reduce(np.ones(2, dtype=np.float32)))

    began = time.monotonic()
    outcomes = on_ranks(4, action, deadline_s=30.0)  # an abort wakes the peers long before the deadline
    assert time.monotonic() - began < 5.0
    assert isinstance(outcomes[2], ValueError)
    for rank in (0, 1, 3):
        error = outcomes[rank]
        assert isinstance(error, RankError)
        assert error.rank == 2
        assert str(error) == f"rank {rank} stopped: rank 2 failed: ValueError: bad weights"


def test_a_rank_that_never_arrives_is_named_after_the_deadline_and_nothing_hangs() -> None:
    def action(comm: ThreadCommunicator) -> np.ndarray:
        if comm.rank == 3:
            time.sleep(3 * DEADLINE_S)  # stuck past the deadline, then arrives at a broken group
        return np.array(comm.all_reduce(np.ones(2, dtype=np.float32)))

    began = time.monotonic()
    outcomes = on_ranks(4, action, deadline_s=DEADLINE_S)
    assert time.monotonic() - began < 3 * DEADLINE_S + 2.0
    message = "rank 3 did not reach all_reduce (collective 1) within 0.5 s"
    for rank, error in enumerate(outcomes):
        assert isinstance(error, RankError)
        assert error.rank == 3
        assert str(error) == (message if rank == 3 else f"rank {rank} stopped: {message}")


def test_ranks_that_reach_different_collectives_are_refused() -> None:
    def action(comm: ThreadCommunicator) -> np.ndarray:
        x = np.ones(2, dtype=np.float32)
        return np.array(comm.all_gather(x, 0) if comm.rank == 1 else comm.all_reduce(x))

    outcomes = on_ranks(2, action)
    for error in outcomes:
        assert isinstance(error, RankError)
        assert error.rank == 1
    assert "rank 1 reached all_gather(0) where rank 0 reached all_reduce(0)" in str(outcomes[0])


# ----------------------------------------------------------------------------------------------- a per-rank program

TOKENS, WIDTH, HIDDEN = 3, 8, 16
"""The handcrafted MLP: x [T, D], W1 [F, D], W2 [D, F]."""


@dataclass(frozen=True)
class _Contract:
    """What the reference backend reads of a prepared contract (the manifest and its rank count)."""

    execution: mf.ExecutionManifest
    ranks: int


class _MemoryCore:
    """Weights resources held in memory (what the reference backend reads of a core file)."""

    def __init__(self, resources: Mapping[str, bytes]) -> None:
        self._resources = resources

    def read_resource(self, resource_id: str, kind: int) -> bytearray:
        return bytearray(self._resources[resource_id])

    def read_resource_into(self, resource_id: str, kind: int, allocate: Callable[[int], memoryview]) -> None:
        data = self._resources[resource_id]
        allocate(len(data))[:] = data


def _weights() -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(7)
    w1 = generator.standard_normal((HIDDEN, WIDTH)).astype(np.float32)
    w2 = generator.standard_normal((WIDTH, HIDDEN)).astype(np.float32)
    return w1, w2


def _node(program: mf.ProgramDecl, name: str, op: str, args: dict[str, str], **attributes: int) -> None:
    node = program.nodes.add(name=name, op=mf.OpRef(name=op, version=1))
    for arg, buffer in args.items():
        node.args.add(name=arg, view=mf.BufferView(buffer=buffer))
    for key, value in attributes.items():
        node.attributes.add(name=key, int_value=value)


def mlp_core(ranks: int) -> tuple[_Contract, _MemoryCore]:
    """The MLP for ``ranks`` ranks (one: the plain program; several: sharded weights and collectives)."""
    w1, w2 = _weights()
    shard = HIDDEN // ranks
    execution = mf.ExecutionManifest(ranks=ranks if ranks > 1 else 0, op_catalogue=1)
    execution.transport.frames = 1
    execution.transport.entries.add(name="x", dtype=mf.DTYPE_F32, shape=[TOKENS, WIDTH])
    resources: dict[str, bytes] = {}

    def scratch(name: str, *shape: int) -> None:
        execution.buffers.add(
            name=name, role=mf.BUFFER_ROLE_SCRATCH, dtype=mf.DTYPE_F32, shape=[mf.Dim(size=s) for s in shape]
        )

    for rank in range(ranks):
        rows = w1[rank * shard : (rank + 1) * shard]
        columns = np.ascontiguousarray(w2[:, rank * shard : (rank + 1) * shard])
        resources[f"w.rank{rank}"] = rows.tobytes() + columns.tobytes()
        for name, array, offset in (("w1", rows, 0), ("w2", columns, rows.nbytes)):
            execution.buffers.add(
                name=name, role=mf.BUFFER_ROLE_WEIGHTS, dtype=mf.DTYPE_F32,
                shape=[mf.Dim(size=s) for s in array.shape], resource_id=f"w.rank{rank}", resource_offset=offset,
                rank=rank if ranks > 1 else 0,
            )  # fmt: skip
    scratch("h_shard", TOKENS, shard)
    scratch("h", TOKENS, HIDDEN)
    scratch("h_again", TOKENS, shard)
    scratch("y", TOKENS, WIDTH)
    scratch("root", TOKENS, WIDTH)
    program = execution.programs.add(name="mlp")
    _node(program, "up", "linear", {"x": "x", "weight": "w1", "out": "h_shard"})
    _node(program, "gather", "all_gather", {"x": "h_shard", "out": "h"}, axis=1)
    _node(program, "down", "linear", {"x": "h_shard", "weight": "w2", "out": "y"})
    _node(program, "reduce", "all_reduce", {"x": "y", "out": "y"})  # in place, as a residual update would be
    _node(program, "scatter", "linear", {"x": "x", "weight": "w1", "out": "h_again"})
    _node(program, "from_last", "broadcast", {"x": "y", "out": "root"}, root=ranks - 1)
    return _Contract(execution, max(ranks, 1)), _MemoryCore(resources)


def ranked_mlp(ranks: int, wrap: Callable[[int, ReferenceBackend], Any] | None = None) -> RankedBackend:
    """The MLP on ``ranks`` thread ranks; ``wrap(rank, backend)`` may stand in for a rank's backend."""
    contract, core = mlp_core(ranks)
    communicators = ThreadCommunicator.group(ranks, deadline_s=5.0)
    backends: list[Any] = []
    for rank in range(ranks):
        backend = ReferenceBackend(
            contract,  # type: ignore[arg-type]
            core,  # type: ignore[arg-type]
            cache_pages=1,
            state_rows=1,
            frames=1,
            rank=rank,
            communicator=communicators[rank],
        )
        backends.append(wrap(rank, backend) if wrap is not None else backend)
    return RankedBackend(backends, communicators=communicators, deadline_s=5.0)


X = np.random.default_rng(3).standard_normal((TOKENS, WIDTH)).astype(np.float32)


def single_rank_outputs() -> dict[str, np.ndarray]:
    contract, core = mlp_core(1)
    backend = ReferenceBackend(contract, core, cache_pages=1, state_rows=1, frames=1)  # type: ignore[arg-type]
    backend.transport(0)["x"][...] = X
    backend.run("mlp", 0)
    outputs = {name: np.array(backend.buffers[name]) for name in ("h", "y", "root")}
    backend.close()
    return outputs


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_per_rank_program_through_thread_ranks_equals_the_one_rank_program(ranks: int) -> None:
    expected = single_rank_outputs()
    w1, w2 = _weights()
    assert np.allclose(expected["y"], (X @ w1.T) @ w2.T, rtol=1e-5, atol=1e-5)  # the one-rank program is the MLP
    backend = ranked_mlp(ranks)
    try:
        backend.transport(0)["x"][...] = X  # rank 0's staging only: run copies it to every rank
        first: list[bytes] = []
        for repeat in range(3):
            backend.run("mlp", 0)
            outputs = [backend.ranks[rank].buffers for rank in range(ranks)]
            for rank_outputs in outputs:
                # the gathered shards are the one-rank projection exactly (each row of W1 lies on one rank)
                assert np.array_equal(rank_outputs["h"], expected["h"])
                # the reduced sum differs from one dot product over F only by float32 rounding
                np.testing.assert_allclose(rank_outputs["y"], expected["y"], rtol=1e-5, atol=1e-5)
                assert rank_outputs["y"].tobytes() == outputs[0]["y"].tobytes()  # same bits on every rank
                assert rank_outputs["root"].tobytes() == outputs[0]["y"].tobytes()
            if repeat == 0:
                first = [rank_outputs["y"].tobytes() for rank_outputs in outputs]
            assert [rank_outputs["y"].tobytes() for rank_outputs in outputs] == first  # deterministic
    finally:
        backend.close()


def test_a_failing_rank_fails_the_round_naming_it_and_the_next_round_runs() -> None:
    backend = ranked_mlp(4, lambda rank, ref: FailingRank(ref) if rank == 2 else ref)
    try:
        backend.transport(0)["x"][...] = X
        began = time.monotonic()
        with pytest.raises(RankError) as caught:
            backend.run("mlp", 0)
        assert time.monotonic() - began < 4.0  # the peers were woken, not left to their 5 s deadline
        assert caught.value.rank == 2
        assert str(caught.value) == (
            "rank 2 failed program 'mlp': FloatingPointError: overflow in the rank's projection"
        )
        backend.run("mlp", 0)  # the group was reset: the next round runs on every rank
        np.testing.assert_allclose(backend.ranks[0].buffers["y"], single_rank_outputs()["y"], rtol=1e-5, atol=1e-5)
    finally:
        backend.close()


# ----------------------------------------------------------------------------------------------- loading


def test_load_refuses_a_rank_count_other_than_the_cores() -> None:
    verified = open_core(FIXTURES / "payload-v3.core", fixture_settings())
    try:
        selection = select(verified.contract, LoadOptions())
        with pytest.raises(StartupError) as caught:
            NativeModel.load(verified.core, verified.contract, selection, backend="reference", ranks=2)
        assert str(caught.value) == (
            "--ranks 2 does not match the core, which is built for 1 tensor-parallel rank; pass --ranks 1 or "
            "leave it out"
        )
        null = NativeModel.load(verified.core, verified.contract, selection, backend="null", ranks=1)
        assert null.backend.ranks == 1  # type: ignore[attr-defined]
        null.close()
    finally:
        verified.close()


# ----------------------------------------------------------------------------------------------- rank agreement


class _CorruptingRank:
    """A rank whose completion record, once armed, has one lane's field changed for one round."""

    def __init__(self, backend: ReferenceBackend, field: int, change: Callable[[np.ndarray], None]) -> None:
        self.backend = backend
        self.field = field
        self.change = change
        self.armed = False
        self.corrupted = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def completion(self, frame: int) -> Mapping[int, np.ndarray]:
        record = self.backend.completion(frame)
        if not self.armed:
            return record
        self.armed = False
        self.corrupted += 1
        copy = {field: np.array(values) for field, values in record.items()}
        self.change(copy[self.field].reshape(copy[self.field].shape[0], -1)[0])  # lane 0
        return copy


def _bump(row: np.ndarray) -> None:
    row[0] = (int(row[0]) + 1) % 320  # another id inside the sampled vocabulary: rank 1 accepts it, differs


def _stale(row: np.ndarray) -> None:
    row[0] = int(row[0]) + 7  # a generation the lane never had: rank 1 rejects the lane


@pytest.mark.parametrize(
    ("field", "change", "problem"),
    [
        (
            mf.COMPLETION_FIELD_SAMPLED_IDS,
            _bump,
            "rank 1's completion differs from rank 0's in COMPLETION_FIELD_SAMPLED_IDS",
        ),
        (mf.COMPLETION_FIELD_GENERATION, _stale, "rank 1 rejects it: generation "),
    ],
)
def test_a_lane_one_rank_rejects_is_committed_by_none_and_fails_only_its_request(
    field: int, change: Callable[[np.ndarray], None], problem: str
) -> None:
    verified = open_core(FIXTURES / "payload-v3.core", fixture_settings())
    contract = verified.contract
    model = NativeModel.load(verified.core, contract, select(contract, LoadOptions()), backend="reference")
    geometry = model.manifests()
    second = ReferenceBackend(
        contract, verified.core, cache_pages=model.cache_pages, state_rows=model.state_rows, frames=model.frames,
        snapshot_rows=geometry.snapshot_rows,
    )  # fmt: skip
    corrupting = _CorruptingRank(second, field, change)
    model.backend = RankedBackend([model.backend, corrupting])  # two ranks of the same one-rank program
    engine = Engine(model)
    try:
        prompts = [prompt_of(index) for index in range(3)]
        expected = solo_tokens(engine, prompts, 6)  # both ranks agree on every round
        assert corrupting.corrupted == 0
        corrupting.armed = True
        streams = submit_all(engine, prompts, 6)
        ends: list[Sequence[Any]] = [list(stream) for stream in streams]
        assert corrupting.corrupted == 1
        failed = [index for index, events in enumerate(ends) if isinstance(events[-1], ExecutionFailed)]
        assert len(failed) == 1
        (index,) = failed
        failure = ends[index][-1]
        assert isinstance(failure, ExecutionFailed)
        assert problem in failure.message
        # nothing of the rejected round was committed: the request published only earlier rounds' tokens
        assert token_ids(ends[index]) == expected[index][: len(token_ids(ends[index]))]
        assert len(token_ids(ends[index])) < 6
        for other, events in enumerate(ends):
            if other != index:
                assert isinstance(events[-1], Finished) and events[-1].reason == "length"
                assert token_ids(events) == expected[other]
        assert solo_tokens(engine, prompts[:1], 6) == expected[:1]  # and the engine goes on
        engine.allocator.check()
        assert engine.allocator.referenced_pages == 0
    finally:
        engine.shutdown()
        model.close()
        verified.close()


# ----------------------------------------------------------------------------------------------- tensor-parallel cores

TP_CAPS = Capacities(max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64)
"""Small capacities for the ``llama-synthetic-small`` cores (8 heads, 4 key-value heads: 2 and 4 ranks divide them)."""


@pytest.fixture(scope="module")
def tp_cores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, SignedCore]:
    """``llama-synthetic-small`` (seed 5) built for one rank and for 2 and 4 tensor-parallel ranks."""
    directory = tmp_path_factory.mktemp("tp-cores")
    declaration = synthetic_declaration("small", seed=5)
    namespace = "helios-tests/tensor-parallel"
    return {
        ranks: build_signed_core(
            partial(build_core, tensor_parallel=ranks), declaration, TP_CAPS, directory, namespace, name=f"tp{ranks}"
        )
        for ranks in (0, 2, 4)
    }


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_tensor_parallel_core_on_thread_ranks_gives_the_one_rank_cores_greedy_tokens(
    tp_cores: dict[int, SignedCore], started: list[Any], ranks: int
) -> None:
    # The ranks' partial sums are added in rank order, so logits differ from the one-rank core's only by float32
    # rounding; greedy tokens of these prompts are equal (the comparison is exact, and deterministic).
    prompts = [prompt_of(index) for index in range(3)]
    single = run(tp_cores[0], started)
    expected = solo_tokens(single.engine, prompts, 8)
    ranked = run(tp_cores[ranks], started)
    assert isinstance(ranked.model.backend, RankedBackend)
    assert ranked.model.backend.size == ranks
    assert ranked.model.manifests().ranks == ranks
    assert solo_tokens(ranked.engine, prompts, 8) == expected
    streams = submit_all(ranked.engine, prompts, 8)  # batched rounds over every rank
    for stream, tokens in zip(streams, expected, strict=True):
        events = list(stream)
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert token_ids(events) == tokens


def test_ranks_other_than_the_cores_and_cuda_are_refused(tp_cores: dict[int, SignedCore], started: list[Any]) -> None:
    with pytest.raises(StartupError) as caught:
        run(tp_cores[2], started, ranks=4)
    assert str(caught.value) == (
        "--ranks 4 does not match the core, which is built for 2 tensor-parallel ranks; pass --ranks 2 or leave it out"
    )
    assert isinstance(run(tp_cores[2], started, ranks=2).model.backend, RankedBackend)
    verified = open_core(tp_cores[2].path, tp_cores[2].trust)
    try:
        selection = select(verified.contract, LoadOptions())
        with (
            mock.patch("helios_core.backends.cuda_driver.device_count", return_value=1),
            pytest.raises(UnsupportedFeatureError) as refused,  # refused before any GPU is opened
        ):
            NativeModel.load(verified.core, verified.contract, selection, backend="cuda")
        assert str(refused.value) == (
            "the core needs 2 tensor-parallel ranks; this runtime has 1 (the CUDA backend runs one rank on each GPU "
            "and 1 GPU is visible; --backend reference runs the ranks as threads)"
        )
        null = NativeModel.load(verified.core, verified.contract, selection, backend="null")
        assert null.backend.ranks == 2  # type: ignore[attr-defined]
        null.close()
    finally:
        verified.close()


def test_run_options_carry_ranks_from_the_command_line_and_the_environment() -> None:
    from pathlib import Path

    from helios_core.server.serve import resolve_options

    core = {"core": Path("model.core")}
    assert resolve_options({**core, "ranks": None}, None, {}).ranks is None  # the core's count
    assert resolve_options({**core, "ranks": None}, None, {"HELIOS_RANKS": "2"}).ranks == 2
    assert resolve_options({**core, "ranks": 4}, None, {"HELIOS_RANKS": "2"}).ranks == 4
    with pytest.raises(StartupError) as caught:
        resolve_options(core, None, {"HELIOS_RANKS": "two"})
    assert str(caught.value) == "ranks (from $HELIOS_RANKS) must be an integer, not 'two'"
