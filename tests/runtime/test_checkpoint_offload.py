"""The host-memory tier of prefix checkpoints: evicted checkpoints move to host memory and come back.

On the golden ``recurrent-tiny`` core (its history in state rows, none in pages; context 64, page 4),
served with one snapshot row: a 56-token shared prefix (the longest the context leaves room for) is
checkpointed, its checkpoint is evicted from the row, and a later prompt sharing the prefix restores it
from the host tier with the tokens of a run that never reused anything. Without the tier the evicted
checkpoint is gone and the prefix is recomputed. The store's own eviction order and the CUDA backend's
copies (over the emulated driver, in stream order) are pinned directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from helios_core.errors import StartupError
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.checkpoints import ON_HOST, CheckpointIndex
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import Finished
from helios_core.runtime.offload import HostCheckpointStore, OffloadError
from helios_core.runtime.startup import RunningModel
from helios_core.server.metrics import MetricsExporter
from helios_core.wire import manifest_pb2 as mf
from tests.runtime.conftest import fixture_settings
from tests.runtime.engine_harness import prompt_of, request, tokens_and_end

PREFIX = prompt_of(1, 56)  # 14 complete pages: context 64 leaves room for a few more tokens and outputs
OTHER = prompt_of(2, 56)
FIRST = [*PREFIX, 5]
UNRELATED = [*OTHER, 6]
LATER = [*PREFIX, 7, 8]


def one_row(model: RunningModel) -> tuple[Engine, CheckpointIndex]:
    """``model``'s engine with one snapshot row (the fixture has two), and its checkpoint index."""
    residency = model.engine.scheduler.residency
    residency.free_snapshot_rows[:] = [0]
    assert residency.checkpoints is not None
    return model.engine, residency.checkpoints


def served(engine: Engine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    tokens, end = tokens_and_end(engine, request(request_id, prompt, 4))
    assert isinstance(end, Finished) and end.reason == "length", end
    return tokens, end.reused_prompt_tokens


@pytest.fixture
def alone(start_fixture: Callable[..., RunningModel]) -> list[int]:
    """LATER's tokens on a fresh engine (nothing reused)."""
    tokens, reused = served(start_fixture("recurrent-tiny", max_active=1).engine, "alone", LATER)
    assert reused == 0
    return tokens


def test_a_checkpoint_evicted_by_another_prefix_is_restored_from_the_host_tier(
    start_fixture: Callable[..., RunningModel], alone: list[int]
) -> None:
    engine, index = one_row(start_fixture("recurrent-tiny", max_active=1, offload_checkpoints=1))
    served(engine, "first", FIRST)
    assert index.endpoints() == [56] and index.on_host() == []
    served(engine, "unrelated", UNRELATED)  # its first checkpoint takes the row: the prefix's moves to the host
    assert index.endpoints() == [56] and index.on_host() == [56]
    tokens, reused = served(engine, "later", LATER)
    assert (tokens, reused) == (alone, 56)
    # the prefix's checkpoint came back into the row; the unrelated one had nowhere to go (the one host slot
    # was held by the checkpoint being restored) and was dropped
    assert index.on_host() == [] and index.stats.hits == 1
    snapshot = engine.statistics()
    assert (
        snapshot.offload_capacity_checkpoints,
        snapshot.offload_checkpoints,
        snapshot.offloaded_checkpoints,
        snapshot.restored_checkpoints,
        snapshot.offload_evicted_checkpoints,
    ) == (1, 0, 1, 1, 1)
    text = MetricsExporter(engine.statistics, lambda: 0).exposition().decode()
    assert "helios_offload_capacity_checkpoints 1.0" in text
    assert "helios_offload_checkpoints 0.0" in text
    assert "helios_offloaded_checkpoints_total 1.0" in text
    assert "helios_restored_checkpoints_total 1.0" in text
    assert "helios_offload_evicted_checkpoints_total 1.0" in text
    assert "helios_checkpoint_reused_tokens_total 56.0" in text
    index.check()


@pytest.mark.parametrize(("host_slots", "reused"), [(0, 0), (2, 56)])
def test_an_evicted_checkpoint_is_recomputed_without_the_host_tier_and_restored_with_it(
    start_fixture: Callable[..., RunningModel], alone: list[int], host_slots: int, reused: int
) -> None:
    engine, index = one_row(start_fixture("recurrent-tiny", max_active=1, offload_checkpoints=host_slots))
    served(engine, "first", FIRST)
    assert index.evict() == 0  # as a preemption does when it needs the snapshot row
    engine.scheduler.residency.free_snapshot_rows.append(0)
    assert index.on_host() == ([56] if host_slots else [])
    assert served(engine, "later", LATER) == (alone, reused)
    assert engine.statistics().restored_checkpoints == (1 if host_slots else 0)
    index.check()


def test_the_page_and_checkpoint_tiers_serve_together(
    start_fixture: Callable[..., RunningModel], alone: list[int]
) -> None:
    engine, index = one_row(start_fixture("recurrent-tiny", max_active=1, offload_checkpoints=2, offload_pages=8))
    served(engine, "first", FIRST)
    served(engine, "unrelated", UNRELATED)
    assert served(engine, "later", LATER) == (alone, 56)
    snapshot = engine.statistics()
    assert (snapshot.offload_capacity_pages, snapshot.offload_capacity_checkpoints) == (8, 2)
    assert (snapshot.offloaded_checkpoints, snapshot.restored_checkpoints) == (2, 1)
    assert index.on_host() == [56]  # the unrelated prefix's checkpoint now waits on the host
    index.check()
    engine.allocator.check()


def test_a_negative_host_checkpoint_count_is_refused_at_startup(start_fixture: Callable[..., RunningModel]) -> None:
    with pytest.raises(StartupError, match="--offload-checkpoints must not be negative, not -1"):
        start_fixture("recurrent-tiny", offload_checkpoints=-1)


@pytest.mark.parametrize("core", ["payload-v3", "sliding-window", "latent-tiny"])
def test_a_core_without_a_recurrent_history_refuses_a_checkpoint_host_tier(
    start_fixture: Callable[..., RunningModel], core: str
) -> None:
    with pytest.raises(StartupError, match=r"--offload-checkpoints 2: the core keeps no prefix checkpoints"):
        start_fixture(core, offload_checkpoints=2)


# -- the store ------------------------------------------------------------------------------------------
class Copies:
    """Labelled snapshot rows and host slots, and every copy."""

    def __init__(self) -> None:
        self.rows: dict[int, str] = {}
        self.host: dict[int, str] = {}
        self.log: list[tuple[str, int, int]] = []

    def copy_snapshot_to_host(self, row: int, slot: int) -> None:
        self.host[slot] = self.rows[row]
        self.log.append(("to_host", row, slot))

    def copy_snapshot_to_device(self, slot: int, row: int) -> None:
        self.rows[row] = self.host[slot]
        self.log.append(("to_device", slot, row))


def test_the_store_drops_the_first_arrived_unpinned_entry_and_restores_exactly() -> None:
    copies = Copies()
    store = HostCheckpointStore(2, copies)
    copies.rows = {0: "a", 1: "b"}
    assert store.store(b"a", 0) == () and store.store(b"b", 1) == ()
    copies.rows[0] = "c"
    store.pin(b"a")
    assert store.store(b"c", 0) == (b"b",)  # the first arrived is pinned: the next one leaves
    assert store.eviction_order() == [b"a", b"c"]
    store.pin(b"c")
    assert store.store(b"d", 1) == (b"d",)  # every entry pinned: the arriving one is dropped
    store.unpin(b"c")
    store.restore(b"a", 1)
    assert copies.rows[1] == "a" and b"a" not in store
    assert (store.stats.stored, store.stats.restored, store.stats.evicted) == (3, 1, 2)
    store.check()
    with pytest.raises(OffloadError, match="does not hold"):
        store.restore(b"a", 0)
    with pytest.raises(OffloadError, match="at least one slot"):
        HostCheckpointStore(0, copies)


def test_the_index_finds_a_host_checkpoint_and_brings_it_back_into_a_row() -> None:
    copies = Copies()
    index = CheckpointIndex(4, lambda parent, tokens: bytes(tokens), host=HostCheckpointStore(1, copies))
    index.reserve(b"k", 0)
    index.publish(b"k", 4, frozenset())
    copies.rows[0] = "k-state"
    assert index.evict() == 0
    found = index.deepest([b"k"])
    assert found is not None and found.row == ON_HOST and not index.wanted(b"k")
    index.bring_back(found, 0)
    assert found.row == 0 and index.rows() == [0] and copies.rows[0] == "k-state"
    assert copies.log == [("to_host", 0, 0), ("to_device", 0, 0)]
    index.check()


# -- the CUDA backend over the emulated driver ------------------------------------------------------------
@pytest.fixture(scope="module")
def verified() -> Iterator[VerifiedCore]:
    from tests.runtime.test_cuda_backend import CORE

    core = open_core(CORE, fixture_settings(), check_resources=False)
    yield core
    core.close()


def test_cuda_checkpoint_copies_run_in_stream_order_from_pinned_slots(verified: VerifiedCore) -> None:
    from tests.runtime.test_cuda_backend import emulated_backend, with_launches
    from tests.runtime.test_offload_cuda import with_async_copies

    execution = mf.ExecutionManifest()
    execution.CopyFrom(verified.contract.execution)
    for name, width in (("snapshot.state", 6), ("snapshot.tokens", 1)):
        execution.buffers.add(
            name=name,
            role=mf.BUFFER_ROLE_PERSISTENT_STATE,
            dtype=mf.DTYPE_F32,
            shape=[mf.Dim(size=4, symbol=mf.DIM_SYMBOL_SNAPSHOT_ROWS), mf.Dim(size=width)],
        )
    execution = with_launches(execution, shared_bytes={"lm_head": 96 * 1024})
    emulated = emulated_backend(verified, execution=execution, prepare=with_async_copies)
    backend, context = emulated.backend, emulated.context
    try:
        backend.reserve_host_snapshots(3, 2)  # two snapshot rows of 2 buffer rows each
        with pytest.raises(ValueError, match="reserved once"):
            backend.reserve_host_snapshots(3, 2)
        before = {}
        for name in ("snapshot.state", "snapshot.tokens"):
            values = np.arange(np.prod(backend.download(name).shape), dtype=np.float32).reshape(
                backend.download(name).shape
            )
            backend.upload(name, values)
            before[name] = values
        backend.copy_snapshot_to_host(1, 2)
        backend.copy_snapshot_to_host(0, 0)
        backend.copy_snapshot_to_device(2, 0)  # row 0 gets row 1's rows
        backend.copy_snapshot_to_device(0, 1)  # row 1 gets row 0's rows, read before row 0 was overwritten
        assert [kind for kind, _ in context.queue] == ["copy"] * 8  # nothing ran yet
        backend.drain()
        for name, want in before.items():
            expected = np.concatenate([want[2:4], want[0:2]])
            np.testing.assert_array_equal(backend.download(name), expected)
        with pytest.raises(ValueError, match="outside"):
            backend.copy_snapshot_to_host(2, 0)
        with pytest.raises(ValueError, match="outside"):
            backend.copy_snapshot_to_device(3, 0)
    finally:
        backend.close()
    assert context.host == {}  # the pinned slots are freed at close
