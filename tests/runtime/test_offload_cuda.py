"""The CUDA backend's host tier on the CPU, over the emulated driver context of ``test_cuda_backend``.

The emulated context runs queued work only when the stream or an event is waited on, as a GPU runs it
later, and here its asynchronous copies are queued on that same stream. So a page copy issued out of
order with the graphs, or read before the stream reached it, shows up as wrong bytes or wrong tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from helios_core.contract import LoadOptions, select
from helios_core.frontend.bootstrap import Bootstrap
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.offload import HOST_RESIDENT
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf
from tests.runtime.conftest import fixture_settings
from tests.runtime.test_cuda_backend import CORE, Emulated, EmulatedContext, _GraphNode, emulated_backend

GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass(eq=False)
class _QueuedCopy:
    nodes: list[_GraphNode]


def with_async_copies(context: EmulatedContext) -> None:
    """Give the emulated context the driver's asynchronous copies, queued on its one stream."""

    def to_host(host_pointer: int, device_pointer: int, nbytes: int) -> None:
        node = _GraphNode("copy", None, dst=host_pointer, src=device_pointer, nbytes=nbytes, to_device=False)
        context.queue.append(("copy", _QueuedCopy([node])))

    def to_device(device_pointer: int, host_pointer: int, nbytes: int) -> None:
        node = _GraphNode("copy", None, dst=device_pointer, src=host_pointer, nbytes=nbytes, to_device=True)
        context.queue.append(("copy", _QueuedCopy([node])))

    context.copy_to_host_async = to_host  # type: ignore[attr-defined]
    context.copy_to_device_async = to_device  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def verified() -> Iterator[VerifiedCore]:
    core = open_core(CORE, fixture_settings(), check_resources=False)
    yield core
    core.close()


def _planes(emulated: Emulated) -> list[str]:
    return [b.name for b in emulated.contract.execution.buffers if b.role == mf.BUFFER_ROLE_CACHE_PLANE]


def test_page_copies_run_in_stream_order_and_only_when_the_stream_gets_there(verified: VerifiedCore) -> None:
    emulated = emulated_backend(verified, cache_pages=16, prepare=with_async_copies)
    backend, context = emulated.backend, emulated.context
    try:
        backend.reserve_host_pages(4)
        with pytest.raises(ValueError, match="reserved once"):
            backend.reserve_host_pages(4)
        rng = np.random.default_rng(5)
        before = {}
        for name in _planes(emulated):
            values = rng.standard_normal(backend.download(name).shape).astype(np.float32)
            backend.upload(name, values)
            before[name] = values
        backend.copy_page_to_host(5, 2)
        backend.copy_page_to_host(9, 3)
        backend.copy_page_to_device(2, 9)
        backend.copy_page_to_device(3, 5)
        backend.copy_page_to_host(9, 2)  # overwrites slot 2 after the copy that read it
        backend.copy_page_to_device(2, 11)
        assert [kind for kind, _ in context.queue] == ["copy"] * (6 * len(before))  # nothing ran yet
        backend.drain()
        assert not context.queue
        for name, want in before.items():
            expected = want.copy()
            expected[5], expected[9], expected[11] = want[9], want[5], want[5]
            np.testing.assert_array_equal(backend.download(name), expected)
        with pytest.raises(ValueError, match="outside"):
            backend.copy_page_to_host(16, 0)
        with pytest.raises(ValueError, match="outside"):
            backend.copy_page_to_device(4, 0)
    finally:
        backend.close()
    assert context.host == {} and context.device.allocations == 0  # the host slots are freed at close


PREFIX = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 10 complete pages of 4 tokens
FIRST = [*PREFIX, 1, 2, 3, 4]
LATER = [*PREFIX, 9, 8, 7, 6]
UNRELATED = [(5 * i + 1) % 80 + 100 for i in range(52)]


def _tokens(engine: Engine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    events = list(engine.submit(PreparedRequest(request_id, prompt, 8, GREEDY, ignore_eos=True)))
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason == "length", finished
    return [e.token_id for e in events if isinstance(e, TokenEvent)], finished.reused_prompt_tokens


def test_the_engine_on_the_emulated_gpu_restores_an_offloaded_prefix_exactly(
    verified: VerifiedCore, start_fixture: Callable[..., RunningModel]
) -> None:
    reference = start_fixture(max_active=1, cache_pages=64)
    expected, _ = _tokens(reference.engine, "solo", LATER)
    selection = select(verified.contract, LoadOptions(max_active=1))
    rows = selection.max_active * selection.state_rows_per_request
    emulated = emulated_backend(verified, cache_pages=16, state_rows=rows, prepare=with_async_copies)
    emulated.backend.reserve_host_pages(16)
    model = NativeModel(
        emulated.contract, selection, emulated.backend, "cuda", cache_pages=16, state_rows=rows, frames=2,
        offload_pages=16,
    )  # fmt: skip
    engine = Engine(model, Bootstrap.load(verified.core, verified.contract).tokenizer)
    try:
        allocator = engine.allocator
        _tokens(engine, "first", FIRST)
        _tokens(engine, "unrelated", UNRELATED)  # 15 of the 16 device pages: the prefix moves to host memory
        keys: list[bytes] = []
        parent: bytes | None = None
        for start in range(0, len(PREFIX), 4):
            parent = allocator.chain_hash(parent, PREFIX[start : start + 4])
            keys.append(parent)
        on_host = sum(allocator.location(key) == HOST_RESIDENT for key in keys)
        assert on_host >= 8
        tokens, reused = _tokens(engine, "later", LATER)
        assert tokens == expected
        assert reused == len(PREFIX)
        assert engine.statistics().restored_pages == on_host
        allocator.check()
    finally:
        engine.shutdown()
    assert emulated.context.closed and emulated.context.host == {}
