"""The host-memory tier of the prefix cache: evicted published pages move to host memory and come back.

The allocator tests drive :class:`PageAllocator` with a :class:`HostPageStore` over a copier that moves
labelled page contents, so every move is visible. The engine tests serve a tiny synthetic core whose
device cache holds one request at full context: a shared 200-token prefix is evicted to host memory by
an unrelated request and reused, restored byte for byte, by a later one with the same tokens as a run
that never offloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.contract import LoadOptions
from helios_core.errors import StartupError
from helios_core.runtime.messages import SamplingParams
from helios_core.runtime.offload import HOST_RESIDENT, HostPageStore
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.startup import RunningModel
from helios_core.server.metrics import MetricsExporter
from helios_core.wire import manifest_pb2 as mf
from tests.runtime.engine_harness import (
    SignedCore,
    assert_each_finishes_at_length,
    assert_pages_released,
    build_signed_core,
    chain_keys,
    run,
    solo_tokens,
    submit_all,
    tokens_and_reuse,
)
from tests.runtime.test_page_events import Recorder

NAMESPACE = "helios-tests/offload"
PAGE_TOKENS = 8
CONTEXT = 256
DEVICE_PAGES = CONTEXT // PAGE_TOKENS  # one request at full context: anything more is evicted
PREFIX = [(37 * i + 11) % 200 + 20 for i in range(200)]  # 25 complete pages


class Copies:
    """A page copier over labelled contents: what each device page and host slot holds, and every copy."""

    def __init__(self) -> None:
        self.device: dict[int, str] = {}
        self.host: dict[int, str] = {}
        self.log: list[tuple[str, int, int]] = []

    def copy_page_to_host(self, page: int, slot: int) -> None:
        self.host[slot] = self.device[page]
        self.log.append(("to_host", page, slot))

    def copy_page_to_device(self, slot: int, page: int) -> None:
        self.device[page] = self.host[slot]
        self.log.append(("to_device", slot, page))


def tiered(host_slots: int, device_pages: int, page_tokens: int = 1) -> tuple[Copies, HostPageStore, PageAllocator]:
    """An allocator of ``device_pages`` pages with a host tier of ``host_slots`` slots, both over new copies."""
    copies = Copies()
    host = HostPageStore(host_slots, copies)
    return copies, host, PageAllocator(device_pages, page_tokens, "id", host=host)


def recorded(pages: PageAllocator) -> Recorder:
    """A recorder of the page events ``pages`` announces from now on."""
    recorder = Recorder()
    pages.attach_events(recorder)
    return recorder


def publish(pages: PageAllocator, copies: Copies, tokens: Sequence[int], label: str) -> tuple[list[int], list[bytes]]:
    """Allocate and publish the complete pages of ``tokens`` (labelled ``label`` + index), as residency does."""
    step = pages.page_tokens
    owned = pages.allocate(len(tokens) // step)
    assert owned is not None
    keys: list[bytes] = []
    parent: bytes | None = None
    for index, page in enumerate(owned):
        chunk = list(tokens[index * step : (index + 1) * step])
        key = pages.chain_hash(parent, chunk)
        assert pages.publish(page, key, parent=parent, tokens=chunk)
        copies.device[page] = f"{label}{index}"
        keys.append(key)
        parent = key
    return owned, keys


# ----------------------------------------------------------------------------------------------
# the allocator and its host tier
# ----------------------------------------------------------------------------------------------


def test_an_evicted_published_page_moves_to_host_memory_and_a_prefix_match_restores_it() -> None:
    copies, host, pages = tiered(4, 3, 2)
    owned, keys = publish(pages, copies, [1, 2, 3, 4], "a")
    assert owned == [0, 1]
    pages.release(owned)  # evictable, the deeper page first in line
    taken = pages.allocate(3)
    assert taken == [2, 1, 0]
    assert copies.log == [("to_host", 1, 0), ("to_host", 0, 1)]
    assert host.eviction_order() == [keys[1], keys[0]]
    assert pages.published_keys() == frozenset(keys)
    assert [pages.location(key) for key in keys] == [HOST_RESIDENT, HOST_RESIDENT]
    pages.release(taken)  # nothing published on them: all three are free again
    match = pages.match_prefix([1, 2, 3, 4, 5], 5)
    assert match.pages == (HOST_RESIDENT, HOST_RESIDENT) and match.tokens == 4 and match.host_pages == 2
    claimed = pages.claim(match)
    assert claimed is not None and claimed.hashes == match.hashes and claimed.tokens == 4
    assert [copies.device[page] for page in claimed.pages] == ["a0", "a1"]  # byte for byte, in chain order
    assert [pages.location(key) for key in keys] == list(claimed.pages)
    assert [pages.refcount(page) for page in claimed.pages] == [1, 1]
    assert host.used_pages == 0 and host.free_pages == 4
    assert (host.stats.offloaded, host.stats.restored, host.stats.evicted) == (2, 2, 0)
    assert pages.stats.reused_tokens == 0 and pages.stats.prefix_hit_pages == 0  # counted at admission only
    pages.count_reuse(claimed, claimed.tokens)
    assert pages.stats.reused_tokens == 4 and pages.stats.prefix_hit_pages == 2
    pages.check()


def test_a_full_host_tier_drops_its_least_recently_used_page_and_announces_only_pages_leaving_the_index() -> None:
    copies, host, pages = tiered(2, 2)
    recorder = recorded(pages)
    owned, first = publish(pages, copies, [1, 2], "k")
    pages.release(owned)
    owned = pages.allocate(2)  # both move to the host tier, the deeper page first
    assert owned is not None
    assert host.eviction_order() == [first[1], first[0]]
    assert [call[0] for call in recorder.calls] == ["cleared", "stored", "stored"]  # a move is not announced
    second: list[bytes] = []
    parent: bytes | None = None
    for index, page in enumerate(owned):  # another prefix published on the same pages
        key = pages.chain_hash(parent, [7 + index])
        assert pages.publish(page, key, parent=parent, tokens=[7 + index])
        copies.device[page] = f"j{index}"
        second.append(key)
        parent = key
    pages.release(owned)
    assert pages.allocate(2) is not None  # the host tier is full: each store drops its oldest entry
    assert recorder.calls[3:] == [
        ("stored", second[0], None, (7,), 1),
        ("stored", second[1], second[0], (8,), 1),
        ("removed", first[1]),
        ("removed", first[0]),
    ]
    assert host.eviction_order() == [second[1], second[0]]
    assert sorted(copies.host.values()) == ["j0", "j1"]
    assert pages.published_keys() == frozenset(second)
    assert host.stats.evicted == 2 and host.stats.offloaded == 4
    pages.check()


def test_a_claim_keeps_the_host_pages_it_restores_while_its_own_allocation_evicts() -> None:
    copies, host, pages = tiered(1, 1)
    recorder = recorded(pages)
    owned, (wanted,) = publish(pages, copies, [1], "wanted")
    pages.release(owned)
    owned = pages.allocate(1)  # "wanted" moves to the only host slot
    assert owned is not None
    pages.release(owned)
    owned, (other,) = publish(pages, copies, [9], "other")
    pages.release(owned)
    match = pages.match_prefix([1, 5], 1)
    assert match.pages == (HOST_RESIDENT,)
    claimed = pages.claim(match)  # evicting "other" cannot drop the pinned "wanted": "other" is dropped
    assert claimed is not None and claimed.pages == (0,)
    assert copies.device[0] == "wanted0"
    assert recorder.calls[-1] == ("removed", other)
    assert pages.location(wanted) == 0 and pages.location(other) is None
    assert host.used_pages == 0 and host.stats.evicted == 1
    pages.check()


def test_a_claim_without_device_pages_for_its_restores_holds_nothing() -> None:
    copies, host, pages = tiered(2, 2)
    owned, keys = publish(pages, copies, [1, 2], "a")
    pages.release(owned)
    held = pages.allocate(2)  # both published pages move to the host tier; the holder keeps both device pages
    assert held is not None
    match = pages.match_prefix([1, 2, 3], 2)
    assert match.pages == (HOST_RESIDENT, HOST_RESIDENT)
    assert pages.claim(match) is None
    assert [pages.location(key) for key in keys] == [HOST_RESIDENT, HOST_RESIDENT]
    assert pages.referenced_pages == 2 and host.stats.restored == 0
    pages.check()  # nothing is left pinned
    pages.release(held)
    claimed = pages.claim(pages.match_prefix([1, 2, 3], 2))
    assert claimed is not None and [copies.device[page] for page in claimed.pages] == ["a0", "a1"]


def test_publishing_content_the_host_tier_holds_frees_the_host_copy_without_a_second_announcement() -> None:
    copies, host, pages = tiered(2, 2)
    recorder = recorded(pages)
    owned, (key,) = publish(pages, copies, [1], "a")
    pages.release(owned)
    taken = pages.allocate(2)  # the free page, then the published one moves to the host tier
    assert taken == [1, 0] and pages.location(key) == HOST_RESIDENT
    assert pages.publish(1, key, parent=None, tokens=[1])  # recomputed by a request that could not reuse it
    assert pages.location(key) == 1 and host.used_pages == 0
    assert [call[0] for call in recorder.calls] == ["cleared", "stored"]
    pages.check()


def test_without_a_host_tier_an_evicted_page_leaves_the_index() -> None:
    copies = Copies()
    pages = PageAllocator(2, 1, "id")
    owned, _ = publish(pages, copies, [1, 2], "a")
    pages.release(owned)
    assert pages.allocate(2) == [1, 0]
    assert pages.published_keys() == frozenset() and pages.host is None
    assert pages.match_prefix([1, 2, 3], 2).pages == ()
    assert copies.log == []


# ----------------------------------------------------------------------------------------------
# serving: a tiny synthetic core with a device cache of one request at full context
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    caps = Capacities(
        max_rows=2, prefill_tokens=(64,), decode_rows=(1, 2), page_tokens=PAGE_TOKENS, cache_pages=64,
        context=CONTEXT, snapshots=2,
    )  # fmt: skip
    declaration = synthetic_declaration("tiny", seed=11)
    return build_signed_core(build_core, declaration, caps, tmp_path_factory.mktemp("offload"), NAMESPACE)


@pytest.fixture
def serve(core: SignedCore, started: list[RunningModel]) -> Callable[..., RunningModel]:
    """Start the core with the given load options (closed after the test)."""
    return functools.partial(run, core, started)


def _tokens(running: RunningModel, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    return tokens_and_reuse(running.engine, request_id, prompt, 6)


def _page_contents(running: RunningModel, page: int) -> list[np.ndarray]:
    """One device page of every cache plane (reference backend)."""
    backend: Any = running.model.backend
    contract = running.model.contract
    names = [b.name for b in contract.execution.buffers if b.role == mf.BUFFER_ROLE_CACHE_PLANE]
    assert names
    return [np.array(backend.buffers[name][page], copy=True) for name in names]


FIRST = [*PREFIX, 3, 4, 5, 6, 7, 8, 9, 10]
LATER = [*PREFIX, 90, 91, 92, 93, 94, 95, 96, 97]
UNRELATED = [(11 * i + 5) % 150 + 60 for i in range(240)]


def test_a_shared_prefix_offloaded_to_host_memory_is_restored_and_reused_exactly(
    serve: Callable[..., RunningModel],
) -> None:
    solo = serve(max_active=1, cache_pages=DEVICE_PAGES)
    expected, reused = _tokens(solo, "solo", LATER)
    assert reused == 0
    solo.close()

    running = serve(max_active=1, cache_pages=DEVICE_PAGES, offload_pages=64)
    engine, allocator = running.engine, running.engine.allocator
    assert allocator.host is not None and allocator.host.capacity == 64
    _tokens(running, "first", FIRST)
    keys = chain_keys(allocator, PREFIX)
    contents = {key: _page_contents(running, page) for key in keys if (page := allocator.location(key)) is not None}
    assert len(contents) == 25  # every prefix page was published on the device
    _tokens(running, "unrelated", UNRELATED)  # needs 31 of the 32 device pages: the prefix moves to host memory
    on_host = [key for key in keys if allocator.location(key) == HOST_RESIDENT]
    assert len(on_host) >= 20
    before = engine.statistics()
    assert before.offloaded_pages >= len(on_host) and before.restored_pages == 0

    log: list[tuple[str, int]] = []
    backend: Any = running.model.backend
    run, to_device = backend.run, backend.copy_page_to_device

    def logged_run(program: str, frame: int) -> None:
        log.append(("run", frame))
        run(program, frame)

    def logged_to_device(slot: int, page: int) -> None:
        log.append(("to_device", page))
        to_device(slot, page)

    backend.run, backend.copy_page_to_device = logged_run, logged_to_device
    tokens, reused = _tokens(running, "later", LATER)
    assert tokens == expected
    assert reused == 200  # the whole shared prefix: 25 complete pages
    after = engine.statistics()
    assert after.restored_pages - before.restored_pages == len(on_host)
    assert after.reused_tokens - before.reused_tokens == 200
    restores = [index for index, (kind, _) in enumerate(log) if kind == "to_device"]
    assert len(restores) == len(on_host)
    assert max(restores) < min(index for index, (kind, _) in enumerate(log) if kind == "run")  # copied before read
    for key, planes in contents.items():  # the restored pages hold exactly what was offloaded
        page = allocator.location(key)
        assert page is not None and page != HOST_RESIDENT
        for got, want in zip(_page_contents(running, page), planes, strict=True):
            np.testing.assert_array_equal(got, want)
    allocator.check()
    assert allocator.referenced_pages == 0

    text = MetricsExporter(engine.statistics, lambda: 0).exposition().decode()
    assert "helios_offload_capacity_pages 64.0" in text
    assert f"helios_restored_pages_total {float(after.restored_pages)}" in text
    assert f"helios_offloaded_pages_total {float(after.offloaded_pages)}" in text
    assert f"helios_offload_pages {float(after.offload_pages_used)}" in text
    assert after.offload_pages_used + after.offload_pages_free == 64


def test_without_offload_the_evicted_prefix_is_recomputed(serve: Callable[..., RunningModel]) -> None:
    running = serve(max_active=1, cache_pages=DEVICE_PAGES)
    allocator = running.engine.allocator
    assert allocator.host is None and running.model.offload_pages == 0
    _tokens(running, "first", FIRST)
    _tokens(running, "unrelated", UNRELATED)
    keys = chain_keys(allocator, PREFIX)
    cached = 0
    while cached < len(keys) and allocator.location(keys[cached]) is not None:
        cached += 1
    assert cached < 25  # evicted pages left the index
    _, reused = _tokens(running, "later", LATER)
    assert reused == cached * PAGE_TOKENS
    stats = running.engine.statistics()
    assert (stats.offload_capacity_pages, stats.offloaded_pages, stats.restored_pages) == (0, 0, 0)
    text = MetricsExporter(running.engine.statistics, lambda: 0).exposition().decode()
    assert "helios_offload_capacity_pages 0.0" in text


def test_preemption_with_a_host_tier_keeps_every_output_exact(serve: Callable[..., RunningModel]) -> None:
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8)
    prompts = [[*PREFIX[:96], 50 + i, 51, 52, 53] for i in range(2)]  # 25 pages each with their outputs
    solo = solo_tokens(serve(max_active=1).engine, prompts, 100, penalized)
    engine = serve(max_active=2, cache_pages=DEVICE_PAGES, offload_pages=8).engine
    assert_each_finishes_at_length(submit_all(engine, prompts, 100, penalized), solo)
    stats = engine.statistics()
    assert stats.preemptions > 0 and stats.offloaded_pages > 0
    assert_pages_released(engine)


def test_a_negative_offload_capacity_is_a_startup_error(serve: Callable[..., RunningModel]) -> None:
    with pytest.raises(StartupError, match=r"^--offload-pages must not be negative, not -1$"):
        serve(offload_pages=-1)


def test_offload_pages_flows_from_the_command_line_to_the_load_options() -> None:
    from helios_core.cli import _RUN_OPTIONS, build_parser
    from helios_core.server.serve import RunOptions, resolve_options

    args = build_parser().parse_args(["run", "--core", "x.core", "--offload-pages", "128"])
    options = resolve_options({name: getattr(args, name) for name in _RUN_OPTIONS}, None, {})
    assert options.offload_pages == 128
    assert RunOptions().offload_pages == 0 and LoadOptions().offload_pages == 0
    from_environment = resolve_options({"core": Path("x.core")}, None, {"HELIOS_OFFLOAD_PAGES": "16"})
    assert from_environment.offload_pages == 16
