"""Tensor-parallel ranks on the CUDA backend, checked without a GPU.

Pins the parts of one backend a GPU that need no device: the NCCL group of one process's ranks (one unique
id, every rank's ``ncclCommInitRank`` with its device's context current between ``ncclGroupStart`` and
``ncclGroupEnd``), a rank joining a group spread over processes, aborting a communicator once; a thread
that drives several contexts switching the current context whenever it changes; the CUDA backend's rank
checks (a core of two ranks needs the communicator of its rank); which ranks ``auto`` and ``--backend cuda``
run for the GPUs visible; the loading of a two-rank core as two CUDA backends (over fakes of the driver,
NCCL and the backend: the GPU each rank opens, the cache pages chosen from the GPU with the least room, the
communicator each rank is given, every NCCL communicator aborted when a rank fails to load); and a
RankedBackend launching asynchronous ranks in rank order under the engine: the same tokens as one rank, and
a rank that fails to launch aborts the group once and fails every later round with the same error instead
of hanging. Rank processes on CUDA (over fakes of the GPUs and of each rank's backend): the leader makes the
NCCL group's unique id and every rank builds its backend with it on a GPU of its own; a failed round breaks the
group (both ranks abort their collectives, the rank process is stopped, ``on_lost`` is told, later rounds are
refused at once); a rank process without a GPU tells the leader why it cannot load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest

from helios_core.backends import cuda_driver
from helios_core.backends.cuda import CudaBackend, plan_transport, reserved_device_nbytes, sparse_entries
from helios_core.backends.cuda_driver import Context, HostBuffer
from helios_core.backends.nccl import NcclCommunicator, NcclError, NcclLibrary
from helios_core.backends.ranks import RankedBackend, RankError, ThreadCommunicator
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import LoadOptions, RuntimeCapabilities, select
from helios_core.errors import StartupError, UnsupportedFeatureError
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import ExecutionFailed
from helios_core.runtime.native_model import (
    DeviceMemory,
    NativeModel,
    backend_capabilities,
    bytes_per_page,
    choose_cache_pages,
    resolve_backend,
)
from helios_core.runtime.startup import RunningModel, start

from .conftest import FIXTURES, fixture_settings
from .engine_harness import FailingRank, prompt_of, solo_tokens, submit_all, token_ids
from .test_nccl_binding import FakeFunctions
from .test_process_ranks import DEADLINE_S, SECRET, TP2, free_port

# ----------------------------------------------------------------------------------------------
# NCCL: the ranks of one process, a rank of many processes, abort
# ----------------------------------------------------------------------------------------------


class NumberedFunctions(FakeFunctions):
    """NCCL's functions handing out communicator 0xC0, 0xC1, ... in the order ranks are created."""

    def __init__(self, results: dict[str, int] | None = None) -> None:
        super().__init__(results)
        self.made = 0

    def ncclCommInitRank(self, handle: Any, ranks: int, unique: Any, rank: int) -> int:
        code = super().ncclCommInitRank(handle, ranks, unique, rank)
        handle._obj.value = 0xC0 + self.made
        self.made += 1
        return code


class CurrentContext:
    """A context that records being made current into the NCCL call log."""

    def __init__(self, log: list[tuple[str, tuple[Any, ...]]], device: int) -> None:
        self.log = log
        self.device = device

    def make_current(self) -> None:
        self.log.append(("make_current", (self.device,)))


def test_the_ranks_of_one_process_join_one_group_each_on_its_own_device() -> None:
    functions = NumberedFunctions()
    contexts = [CurrentContext(functions.calls, device) for device in range(3)]
    made = NcclCommunicator.group(NcclLibrary(functions), contexts)
    assert [(c.rank, c.size, c.handle) for c in made] == [(0, 3, 0xC0), (1, 3, 0xC1), (2, 3, 0xC2)]
    assert functions.calls == [
        ("ncclGetUniqueId", ()),
        ("ncclGroupStart", ()),
        ("make_current", (0,)),
        ("ncclCommInitRank", (3, functions.unique, 0)),
        ("make_current", (1,)),
        ("ncclCommInitRank", (3, functions.unique, 1)),
        ("make_current", (2,)),
        ("ncclCommInitRank", (3, functions.unique, 2)),
        ("ncclGroupEnd", ()),
    ]


def test_a_failing_rank_of_the_group_still_ends_the_nccl_group_and_names_the_call() -> None:
    functions = NumberedFunctions({"ncclCommInitRank": 5})
    with pytest.raises(NcclError) as caught:
        NcclCommunicator.group(NcclLibrary(functions), [CurrentContext(functions.calls, d) for d in range(2)])
    assert caught.value.call == "ncclCommInitRank"
    assert [name for name, _ in functions.calls][-2:] == ["ncclCommInitRank", "ncclGroupEnd"]
    with pytest.raises(NcclError) as empty:
        NcclCommunicator.group(NcclLibrary(functions), [])
    assert str(empty.value) == "an NCCL group needs at least one rank"


def test_a_rank_process_joins_with_the_leaders_unique_id_and_aborts_once() -> None:
    functions = NumberedFunctions()
    unique = bytes(range(1, 129))
    joined = NcclCommunicator.joined(NcclLibrary(functions), 2, unique, 1)
    assert (joined.rank, joined.size, joined.handle) == (1, 2, 0xC0)
    joined.abort()
    joined.abort()  # once only
    joined.close()  # an aborted communicator is gone: nothing to destroy
    assert functions.calls == [("ncclCommInitRank", (2, unique, 1)), ("ncclCommAbort", (0xC0,))]


# ----------------------------------------------------------------------------------------------
# one thread driving several contexts
# ----------------------------------------------------------------------------------------------


def test_bind_makes_a_context_current_whenever_the_threads_current_one_differs() -> None:
    driver = pytest.importorskip("cuda.bindings.driver")
    calls: list[Any] = []

    def set_current(handle: Any) -> tuple[Any]:
        calls.append(handle)
        return (driver.CUresult.CUDA_SUCCESS,)

    recording = SimpleNamespace(cuCtxSetCurrent=set_current)
    first, second = object.__new__(Context), object.__new__(Context)
    for context, handle in ((first, "ctx0"), (second, "ctx1")):
        context._cu = recording
        context.context = handle
    first.bind()
    first.bind()  # already current on this thread: no driver call
    second.bind()
    first.bind()
    assert calls == ["ctx0", "ctx1", "ctx0"]


# ----------------------------------------------------------------------------------------------
# the CUDA backend of one rank
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def tp2() -> Iterator[VerifiedCore]:
    verified = open_core(FIXTURES / "tp2-tiny.core", fixture_settings())
    yield verified
    verified.close()


def test_a_rank_of_a_two_rank_core_needs_the_nccl_communicator_of_its_rank(tp2: VerifiedCore) -> None:
    cases = [
        (0, None, "the core is built for 2 tensor-parallel ranks: the CUDA backend of rank 0 needs that rank's NCCL "
                  "communicator in a group of 2"),
        (0, mock.MagicMock(rank=1, size=2), "the NCCL communicator is rank 1 of 2; this backend is rank 0 of the "
                                            "core's 2"),
        (1, mock.MagicMock(rank=1, size=4), "the NCCL communicator is rank 1 of 4; this backend is rank 1 of the "
                                            "core's 2"),
        (2, mock.MagicMock(rank=2, size=2), "rank 2 is not one of the core's 2 tensor-parallel ranks"),
    ]  # fmt: skip
    for rank, communicator, message in cases:
        context = mock.MagicMock(architecture="sm_90a")
        with pytest.raises(StartupError) as caught:
            CudaBackend(
                tp2.contract, tp2.core, cache_pages=8, state_rows=4, context=context, communicator=communicator,
                rank=rank,
            )  # fmt: skip
        assert str(caught.value) == message
        context.alloc.assert_not_called()
        context.close.assert_called_once_with()  # the backend took the context over and released it
        if communicator is not None:  # and the communicator likewise
            communicator.close.assert_called_once_with()


# ----------------------------------------------------------------------------------------------
# which ranks run on CUDA
# ----------------------------------------------------------------------------------------------


def test_the_cuda_backend_runs_one_rank_a_visible_gpu(tp2: VerifiedCore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "device_count", lambda: 2)
    assert backend_capabilities("cuda") == RuntimeCapabilities(
        ranks=2,
        ranks_limit="the CUDA backend runs one rank on each GPU and 2 GPUs are visible; --backend reference runs "
        "the ranks as threads",
    )
    monkeypatch.setattr(cuda_driver, "device_count", lambda: 1)
    selection = select(tp2.contract, LoadOptions())
    with (
        mock.patch.object(cuda_driver, "open_context") as opened,
        pytest.raises(UnsupportedFeatureError) as refused,
    ):
        NativeModel.load(tp2.core, tp2.contract, selection, backend="cuda")
    assert str(refused.value) == (
        "the core needs 2 tensor-parallel ranks; this runtime has 1 (the CUDA backend runs one rank on each GPU and "
        "1 GPU is visible; --backend reference runs the ranks as threads)"
    )
    with (
        mock.patch.object(cuda_driver, "open_context") as opened,
        pytest.raises(StartupError) as direct,
    ):
        NativeModel.load(tp2.core, tp2.contract, selection, backend="cuda", capabilities=RuntimeCapabilities())
    assert str(direct.value) == (
        "the core is built for 2 tensor-parallel ranks; the CUDA backend runs one rank on each GPU and 1 GPU is "
        "visible; --backend reference runs the ranks as threads"
    )
    opened.assert_not_called()


def test_auto_picks_cuda_for_a_core_of_n_ranks_only_with_n_gpus_it_has_kernels_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_kernels = SimpleNamespace(ranks=2, execution=SimpleNamespace(targets=["reference", "sm_90a"]))
    without = SimpleNamespace(ranks=2, execution=SimpleNamespace(targets=["reference"]))
    architectures = {0: "sm_90a", 1: "sm_90a", 2: "sm_89"}
    monkeypatch.setattr(cuda_driver, "device_architecture", lambda device: architectures[device])
    picks = {}
    for visible in (1, 2, 3):
        monkeypatch.setattr(cuda_driver, "device_count", lambda visible=visible: visible)
        picks[visible] = (
            resolve_backend("auto", with_kernels),  # type: ignore[arg-type]
            resolve_backend("auto", without),  # type: ignore[arg-type]
            resolve_backend("auto", with_kernels, device=1),  # type: ignore[arg-type]  # GPUs 1 and 2
        )
    assert picks == {
        1: ("reference", "reference", "reference"),
        2: ("cuda", "reference", "reference"),
        3: ("cuda", "reference", "reference"),  # GPU 2 is an sm_89 the core has no kernels for
    }


# ----------------------------------------------------------------------------------------------
# loading the ranks of a core on CUDA, over fakes
# ----------------------------------------------------------------------------------------------


class FakeGpu:
    """A device's context: its free memory and architecture; records being made current, its page-locked
    allocations and being closed."""

    def __init__(self, device: int, free: int, log: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.device = device
        self.free = free
        self.log = log
        self.architecture = "sm_90a"
        self.closed = False
        self.host: list[tuple[int, bool]] = []

    def free_memory(self) -> int:
        return self.free

    def make_current(self) -> None:
        self.log.append(("make_current", (self.device,)))

    def host_alloc(self, nbytes: int, *, mapped: bool = False) -> HostBuffer:
        self.host.append((nbytes, mapped))
        return HostBuffer(0x10000 * len(self.host), nbytes)

    def close(self) -> None:
        self.closed = True
        self.log.append(("close", (self.device,)))


class FakeRankBackend:
    """What the loader builds for each rank: its arguments, whether its collectives were aborted, closing;
    staging and programs are its rank's reference backend's."""

    fail_rank: int | None = None

    def __init__(self, contract: Any, core: Any, **options: Any) -> None:
        if options["rank"] == FakeRankBackend.fail_rank:
            raise StartupError(f"rank {options['rank']} could not load its weights")
        self.options = options
        self.aborted = 0
        self.closed = False
        sizes = {key: options[key] for key in ("cache_pages", "state_rows", "frames", "snapshot_rows", "rank")}
        self.reference = ReferenceBackend(contract, core, **sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reference, name)

    def abort_collectives(self) -> None:
        self.aborted += 1

    def close(self) -> None:
        self.closed = True
        self.options["context"].log.append(("close rank", (self.options["rank"],)))
        self.reference.close()


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[FakeGpu], NumberedFunctions]]:
    """Two GPUs (80 and 30 GiB free); every context opened, in order, and the NCCL call log."""
    functions = NumberedFunctions()
    opened: list[FakeGpu] = []

    def open_gpu(device: int) -> FakeGpu:
        opened.append(FakeGpu(device, (80 << 30, 30 << 30)[device], functions.calls))
        return opened[-1]

    monkeypatch.setattr(cuda_driver, "device_count", lambda: 2)
    monkeypatch.setattr(cuda_driver, "open_context", open_gpu)
    monkeypatch.setattr("helios_core.backends.nccl.load_library", lambda: NcclLibrary(functions))
    monkeypatch.setattr("helios_core.backends.cuda.check_targets", lambda execution, architecture: None)
    monkeypatch.setattr("helios_core.backends.cuda.CudaBackend", FakeRankBackend)
    FakeRankBackend.fail_rank = None
    yield opened, functions


def test_a_two_rank_core_loads_as_one_cuda_backend_a_gpu_behind_an_in_order_ranked_backend(
    tp2: VerifiedCore, fake_gpus: tuple[list[FakeGpu], NumberedFunctions]
) -> None:
    gpus, functions = fake_gpus
    selection = select(tp2.contract, LoadOptions())
    model = NativeModel.load(tp2.core, tp2.contract, selection, backend="cuda")
    backend = model.backend
    assert isinstance(backend, RankedBackend)
    ranks: tuple[FakeRankBackend, ...] = backend.ranks
    assert [(r.options["rank"], r.options["context"], r.options["communicator"].rank) for r in ranks] == [
        (0, gpus[0], 0),
        (1, gpus[1], 1),
    ]
    assert {r.options["communicator"].size for r in ranks} == {2}
    assert [name for name, _ in functions.calls] == [
        "ncclGetUniqueId", "ncclGroupStart", "make_current", "ncclCommInitRank", "make_current", "ncclCommInitRank",
        "ncclGroupEnd",
    ]  # fmt: skip
    # one page-locked staging a frame, held by a reference of its own to GPU 0, read by both ranks
    holder = gpus[2]
    assert holder.device == 0 and len(gpus) == 3
    layout = plan_transport(tp2.contract.execution.transport, sparse=sparse_entries(tp2.contract))
    shared = ranks[0].options["staging"]
    assert ranks[1].options["staging"] is shared and len(shared) == model.frames
    assert not layout.mapped.slots  # the small fixture has no entry large enough to be read in place
    assert [(s.host.nbytes, s.mapped) for s in shared] == [(layout.copied.nbytes, None)] * model.frames
    assert holder.host == [(layout.copied.nbytes, False)] * model.frames
    # the cache is sized on the GPU with the least room (GPU 1's 30 GiB) and is the same on both ranks
    reserved = reserved_device_nbytes(
        tp2.contract.execution, state_rows=model.state_rows, snapshot_rows=model.manifests().snapshot_rows,
        frames=model.frames, sparse=sparse_entries(tp2.contract), rank=1,
    )  # fmt: skip
    expected = choose_cache_pages(tp2.contract, selection, None, DeviceMemory(30 << 30, reserved))
    assert model.cache_pages == expected == ranks[0].options["cache_pages"] == ranks[1].options["cache_pages"]
    assert bytes_per_page(tp2.contract) > 0
    with pytest.raises(RankError) as caught:  # a rank that cannot launch breaks the group
        backend.on_every_rank(lambda rank, b: b.missing_method(), "program 'decode_b1'")
    assert caught.value.rank == 0
    assert [r.aborted for r in ranks] == [1, 1]
    del functions.calls[:]
    model.close()
    assert all(r.closed for r in ranks)
    closes = [entry for entry in functions.calls if entry[0].startswith("close")]
    assert closes == [("close rank", (1,)), ("close rank", (0,)), ("close", (0,))]  # the staging's holder last


def test_a_rank_that_fails_to_load_aborts_the_nccl_group_and_releases_every_gpu(
    tp2: VerifiedCore, fake_gpus: tuple[list[FakeGpu], NumberedFunctions]
) -> None:
    gpus, functions = fake_gpus
    FakeRankBackend.fail_rank = 1
    with pytest.raises(StartupError) as caught:
        NativeModel.load(tp2.core, tp2.contract, select(tp2.contract, LoadOptions()), backend="cuda")
    assert str(caught.value) == "rank 1 could not load its weights"
    aborted = sorted(arguments for name, arguments in functions.calls if name == "ncclCommAbort")
    assert aborted == [(0xC0,), (0xC1,)]  # rank 0 may be waiting at a tuning collective for rank 1
    assert len(gpus) == 3  # GPU 0, GPU 1 and the staging's reference to GPU 0
    assert all(gpu.closed for gpu in gpus)


# ----------------------------------------------------------------------------------------------
# asynchronous ranks launched in order under the engine
# ----------------------------------------------------------------------------------------------


def _two_ranks(verified: VerifiedCore, wrap: Any = lambda backend: backend) -> tuple[NativeModel, list[str]]:
    """A one-rank core's model whose backend is two ranks of the same program launched in rank order (the
    second wrapped by ``wrap``); the list records every group abort."""
    contract = verified.contract
    model = NativeModel.load(verified.core, contract, select(contract, LoadOptions()), backend="reference")
    second = ReferenceBackend(
        contract, verified.core, cache_pages=model.cache_pages, state_rows=model.state_rows, frames=model.frames,
        snapshot_rows=model.manifests().snapshot_rows,
    )  # fmt: skip
    aborts: list[str] = []
    model.backend = RankedBackend([model.backend, wrap(second)], in_order=True, abort_group=aborts.append)
    return model, aborts


def test_ranks_launched_in_order_give_one_ranks_tokens() -> None:
    verified = open_core(FIXTURES / "payload-v3.core", fixture_settings())
    alone = NativeModel.load(verified.core, verified.contract, select(verified.contract, LoadOptions()))
    engine = Engine(alone)
    prompts = [prompt_of(index) for index in range(3)]
    try:
        expected = solo_tokens(engine, prompts, 6)
    finally:
        engine.shutdown()
        alone.close()
    model, aborts = _two_ranks(verified)
    engine = Engine(model)
    try:
        assert [token_ids(list(stream)) for stream in submit_all(engine, prompts, 6)] == expected
        assert aborts == []
    finally:
        engine.shutdown()
        model.close()
        verified.close()


def test_a_rank_that_fails_to_launch_aborts_the_group_once_and_fails_every_later_round() -> None:
    verified = open_core(FIXTURES / "payload-v3.core", fixture_settings())
    model, aborts = _two_ranks(verified, lambda backend: FailingRank(backend))
    engine = Engine(model)
    try:
        ends = [list(stream)[-1] for stream in submit_all(engine, [prompt_of(index) for index in range(2)], 4)]
        after = [list(stream)[-1] for stream in submit_all(engine, [prompt_of(5)], 4)]
    finally:
        engine.shutdown()
        model.close()
        verified.close()
    reason = "rank 1 failed program"
    for end in ends + after:
        assert isinstance(end, ExecutionFailed)
        assert reason in end.message and "FloatingPointError: overflow in the rank's projection" in end.message
    assert len(aborts) == 1 and aborts[0].startswith("rank 1 failed program ")


# ----------------------------------------------------------------------------------------------
# rank processes on CUDA, over fakes of the GPUs and of the backend of each rank
# ----------------------------------------------------------------------------------------------


class DeviceRank:
    """A rank's backend as the CUDA rank processes build it: a reference backend whose collectives meet the
    other ranks' in this process (as NCCL's meet on the devices: none crosses the sockets), failing its next
    ``failures`` runs (its peers are told, as NCCL's would be by the abort) and counting aborts."""

    def __init__(self, backend: Any, communicator: Any = None) -> None:
        self.backend = backend
        self.communicator = communicator
        self.failures = 0
        self.aborted = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def run(self, program: str, frame: int) -> None:
        if self.failures:
            self.failures -= 1
            if self.communicator is not None:
                self.communicator.abort("a peer failed")
            raise FloatingPointError("overflow in the rank's projection")
        self.backend.run(program, frame)

    def abort_collectives(self) -> None:
        self.aborted += 1


def test_cuda_rank_processes_join_one_nccl_group_and_a_failed_round_breaks_the_group(
    monkeypatch: pytest.MonkeyPatch, started: list[RunningModel]
) -> None:
    from helios_core.backends import rank_processes as rp

    functions = NumberedFunctions()
    opened: list[int] = []
    built: dict[int, tuple[str, bytes, Any, DeviceRank]] = {}

    def open_gpu(device: int) -> Any:
        opened.append(device)
        return FakeGpu(device, 80 << 30, functions.calls)

    communicators = ThreadCommunicator.group(2, deadline_s=DEADLINE_S)

    def rank_backend(contract: Any, core: Any, welcome: Any, rank: int, context: Any) -> DeviceRank:
        made = DeviceRank(
            ReferenceBackend(
                contract, core, cache_pages=welcome.cache_pages, state_rows=welcome.state_rows, frames=welcome.frames,
                snapshot_rows=welcome.snapshot_rows, rank=rank, communicator=communicators[rank],
            ),
            communicators[rank],
        )  # fmt: skip
        built[rank] = (welcome.backend, welcome.nccl_id, context, made)
        return made

    monkeypatch.setattr(cuda_driver, "device_count", lambda: 2)
    monkeypatch.setattr(cuda_driver, "open_context", open_gpu)
    monkeypatch.setattr("helios_core.backends.nccl.load_library", lambda: NcclLibrary(functions))
    monkeypatch.setattr("helios_core.backends.cuda.check_targets", lambda execution, architecture: None)
    monkeypatch.setattr(rp, "cuda_rank_backend", rank_backend)
    verified = open_core(TP2, fixture_settings(), check_resources=False)
    port = free_port()
    stopped: list[str] = []

    def rank_one() -> None:
        stopped.append(
            rp.run_rank_process(verified.contract, verified.core, "127.0.0.1", port, 1, SECRET, timeout_s=DEADLINE_S)
        )

    thread = threading.Thread(target=rank_one, daemon=True)
    thread.start()
    lost: list[RankError] = []
    settings = rp.ProcessRankSettings("127.0.0.1", port, SECRET, join_timeout_s=DEADLINE_S, on_lost=lost.append)
    leader = start(TP2, fixture_settings(), LoadOptions(rank_peers=settings), backend="cuda")
    started.append(leader)
    try:
        assert isinstance(leader.model.backend, rp.ProcessRankedBackend)
        assert opened == [0, 1]  # rank 0 on GPU 0 here, rank 1 on GPU 1 (its number of the 2 visible)
        assert {rank: entry[:2] for rank, entry in built.items()} == {
            0: ("cuda", functions.unique),
            1: ("cuda", functions.unique),
        }
        assert [name for name, _ in functions.calls] == ["ncclGetUniqueId"]  # the ranks join in their backends
        assert len(solo_tokens(leader.engine, [prompt_of(0)], 4)[0]) == 4
        built[1][3].failures = 1
        (events,) = [list(stream) for stream in submit_all(leader.engine, [prompt_of(1)], 4)]
        failure = events[-1]
        assert isinstance(failure, ExecutionFailed)
        assert "rank 1 failed program '" in failure.message
        assert failure.message.endswith("FloatingPointError: overflow in the rank's projection")
        thread.join(DEADLINE_S)
        assert stopped and stopped[0].startswith("rank 1 was lost: rank 1 failed program '")
        assert built[0][3].aborted == 1  # rank 0's collectives stopped waiting for rank 1
        assert built[1][3].aborted == 1  # and rank 1's, before its backend closed
        (events,) = [list(stream) for stream in submit_all(leader.engine, [prompt_of(2)], 4)]
        assert isinstance(events[-1], ExecutionFailed)  # the group is broken: refused at once, no hang
        deadline = time.monotonic() + DEADLINE_S
        while not lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [error.rank for error in lost] == [1]
    finally:
        leader.close()
        started.remove(leader)
        thread.join(DEADLINE_S)
        verified.close()


def test_a_rank_process_without_a_gpu_tells_a_cuda_leader_why_it_cannot_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from helios_core.backends import rank_processes as rp
    from helios_core.backends.cuda_driver import CudaUnavailableError

    def no_gpu(device: int) -> Any:
        raise CudaUnavailableError("no CUDA device is present")

    monkeypatch.setattr(cuda_driver, "device_count", lambda: 0)
    monkeypatch.setattr(cuda_driver, "open_context", no_gpu)
    verified = open_core(TP2, fixture_settings(), check_resources=False)
    port = free_port()
    settings = rp.ProcessRankSettings("127.0.0.1", port, SECRET, join_timeout_s=DEADLINE_S)
    outcome: dict[str, Any] = {}

    def rank_one() -> None:
        outcome["stopped"] = rp.run_rank_process(
            verified.contract, verified.core, "127.0.0.1", port, 1, SECRET, timeout_s=DEADLINE_S
        )

    thread = threading.Thread(target=rank_one, daemon=True)
    thread.start()
    try:
        peers = rp.gather_peers(settings, rp.contract_digest(verified.contract), 2)
        group = rp.ProcessRankedBackend(peers, settings, collectives_on_device=True)
        welcome = rp.Welcome(2, 8, 4, 2, 0, DEADLINE_S, "cuda", bytes(128))
        with pytest.raises(StartupError) as caught:
            group.load(lambda communicator: DeviceRank(mock.MagicMock()), welcome)
        assert str(caught.value) == (
            "rank 1 failed to load: rank 1 failed loading: StartupError: the leader runs the CUDA backend; this rank "
            "has no GPU (no CUDA device is present)"
        )
        thread.join(DEADLINE_S)
        assert outcome["stopped"] == "a rank failed to load"
    finally:
        thread.join(DEADLINE_S)
        verified.close()


# ----------------------------------------------------------------------------------------------
# one staging read by every rank
# ----------------------------------------------------------------------------------------------


class StagingRank:
    """A rank whose staging views ``memory`` (read-only unless it is rank 0's), counting fences and runs."""

    def __init__(self, memory: np.ndarray, *, writable: bool) -> None:
        view = memory.view()
        view.flags.writeable = writable
        self.staging = {"input_ids": view[:4], "page_table": view[4:].reshape(2, 2)}
        self.fences = 0
        self.runs: list[tuple[str, int]] = []

    def transport(self, frame: int) -> dict[str, np.ndarray]:
        self.fences += 1
        return self.staging

    def run(self, program: str, frame: int) -> None:
        self.runs.append((program, frame))

    def close(self) -> None:
        return None


def test_ranks_sharing_one_staging_wait_for_every_ranks_fence_and_copy_nothing() -> None:
    memory = np.zeros(8, dtype=np.int32)
    first, second = StagingRank(memory, writable=True), StagingRank(memory, writable=False)
    closed: list[str] = []
    holder = SimpleNamespace(close=lambda: closed.append("staging"))
    backend = RankedBackend([first, second], in_order=True, shared=(holder,))
    staging = backend.transport(0)
    assert (first.fences, second.fences) == (1, 1)  # the packer may rewrite what rank 1 reads only now
    staging["input_ids"][...] = [5, 6, 7, 8]
    backend.run("decode_b1", 0)  # rank 1's views are read-only: a copy would raise
    assert second.staging["input_ids"].tolist() == [5, 6, 7, 8]
    assert first.runs == second.runs == [("decode_b1", 0)]
    separate = StagingRank(np.zeros(8, dtype=np.int32), writable=True)
    copying = RankedBackend([first, separate])
    copying.run("decode_b1", 1)  # staging of its own: rank 0's values are copied
    copying.close()
    assert separate.staging["input_ids"].tolist() == [5, 6, 7, 8]
    backend.close()
    assert closed == ["staging"]


def test_shared_staging_must_hold_the_transport_blocks() -> None:
    from helios_core.backends.cuda import BlockLayout, FrameStaging, TransportLayout, check_staging

    layout = TransportLayout(copied=BlockLayout({}, 4096), mapped=BlockLayout({}, 1 << 20))
    check_staging(FrameStaging(HostBuffer(0x1000, 4096), HostBuffer(0x9000, 1 << 20)), layout)
    with pytest.raises(ValueError) as caught:
        check_staging(FrameStaging(HostBuffer(0x1000, 4096), None), layout)
    assert str(caught.value) == (
        "shared staging of 4096 and 0 bytes cannot hold the transport's 4096 copied and 1048576 mapped bytes"
    )


def test_a_context_finds_its_own_address_of_a_shared_mapped_block() -> None:
    driver = pytest.importorskip("cuda.bindings.driver")
    calls: list[Any] = []

    def record(name: str, answer: Any = None) -> Any:
        def call(*arguments: Any) -> tuple[Any, ...]:
            calls.append((name, *arguments))
            return (driver.CUresult.CUDA_SUCCESS,) if answer is None else (driver.CUresult.CUDA_SUCCESS, answer)

        return call

    context = object.__new__(Context)
    context._cu = SimpleNamespace(
        cuCtxSetCurrent=record("cuCtxSetCurrent"), cuMemHostGetDevicePointer=record("cuMemHostGetDevicePointer", 0xB0B)
    )
    context.context = "ctx1"
    assert context.mapped_pointer(HostBuffer(0x7000, 64, device_pointer=0xA0A)) == 0xB0B
    assert calls == [("cuCtxSetCurrent", "ctx1"), ("cuMemHostGetDevicePointer", 0x7000, 0)]
