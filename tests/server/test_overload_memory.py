"""Overload: the excess is refused with 429 at once, and what the server retains stays bounded.

A server with ``max_active=2, queue_capacity=2`` (four admission permits) and slowed launches gets
waves of 200 concurrent streaming requests over loopback (bounded in count and time). The admitted
permits (peak of ``Admission.in_use`` and the ``helios_http_admitted`` gauge) and the live
per-response event queues of the bridge never exceed ``queue_capacity + max_active``; the refused
requests get OpenAI-shaped 429s quickly; and tracemalloc sees no growth across two identical waves.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
import tracemalloc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from helios_core.server.admission import Admission, Permit
from helios_core.server.bridge import EventBridge
from tests.server.conftest import Served, serve_fixture

MAX_ACTIVE = 2
QUEUE_CAPACITY = 2
CAPACITY = MAX_ACTIVE + QUEUE_CAPACITY
WAVE = 200
WAVE_TIMEOUT_S = 60.0
LAUNCH_DELAY_S = 0.25  # an admitted request (prefill + 6 decode launches) takes at least 1.75 s
GROWTH_LIMIT_BYTES = 5 * 1024 * 1024


@dataclass
class Retained:
    """Peaks of what the server holds per response, recorded by wrapping admission and the bridge."""

    peak_permits: int = 0
    peak_queues: int = 0
    queues: list[weakref.ref[Any]] = field(default_factory=list)

    def live_queues(self) -> int:
        self.queues = [ref for ref in self.queues if ref() is not None]
        return len(self.queues)


@pytest.fixture
def retained(monkeypatch: pytest.MonkeyPatch) -> Retained:
    record = Retained()
    real_admit = Admission.admit
    real_attach = EventBridge.attach

    def admit(self: Admission) -> Permit:
        permit = real_admit(self)
        record.peak_permits = max(record.peak_permits, self.in_use)
        return permit

    def attach(
        self: EventBridge, stream: Any, loop: asyncio.AbstractEventLoop, on_end: Any = None
    ) -> asyncio.Queue[Any]:
        queue = real_attach(self, stream, loop, on_end)
        record.queues.append(weakref.ref(queue))
        record.peak_queues = max(record.peak_queues, record.live_queues())
        return queue

    monkeypatch.setattr(Admission, "admit", admit)
    monkeypatch.setattr(EventBridge, "attach", attach)
    return record


@pytest.fixture
def overloaded(retained: Retained) -> Iterator[Served]:
    with serve_fixture(max_active=MAX_ACTIVE, queue_capacity=QUEUE_CAPACITY) as served:
        yield served


@dataclass
class Outcome:
    status: int
    seconds: float
    error_type: str | None


async def _one(client: httpx.AsyncClient, index: int) -> Outcome:
    body = {
        "messages": [{"role": "user", "content": f"overload {index}"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
    }
    begin = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        data = await response.aread()
    error_type = None
    if response.status_code != 200:
        error_type = httpx.Response(response.status_code, content=data).json()["error"]["type"]
    else:
        assert data.endswith(b"data: [DONE]\n\n")
    return Outcome(response.status_code, time.monotonic() - begin, error_type)


async def _admitted_gauge(client: httpx.AsyncClient, peaks: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith("helios_http_admitted "):
                peaks.append(float(line.split()[1]))
        await asyncio.sleep(0.02)


async def _wave(base_url: str) -> tuple[list[Outcome], list[float]]:
    limits = httpx.Limits(max_connections=WAVE + 1, max_keepalive_connections=0)
    gauge: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(_admitted_gauge(client, gauge, stop))
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(_one(client, i) for i in range(WAVE))), timeout=WAVE_TIMEOUT_S
            )
        finally:
            stop.set()
            await watcher
    return list(outcomes), gauge


def _settle(served: Served) -> None:
    served.wait_idle(timeout=30)
    deadline = time.monotonic() + 10
    while "helios_http_admitted 0.0" not in httpx.get(served.base_url + "/metrics").text:
        assert time.monotonic() < deadline, "admission permits were not all released"
        time.sleep(0.02)
    gc.collect()


def _check(outcomes: list[Outcome], gauge: list[float]) -> None:
    statuses = [o.status for o in outcomes]
    assert set(statuses) <= {200, 429}, statuses
    served_ok = statuses.count(200)
    refused = [o for o in outcomes if o.status == 429]
    assert served_ok >= CAPACITY
    assert len(refused) >= WAVE // 2, f"only {len(refused)} of {WAVE} refused"
    assert all(o.error_type == "rate_limit_error" for o in refused)
    # refusals do not wait for generation: quicker than any admitted request's slowed decode
    fastest_served = min(o.seconds for o in outcomes if o.status == 200)
    assert statistics.median(o.seconds for o in refused) < fastest_served
    assert max(o.seconds for o in refused) < 10.0
    assert max(gauge, default=0) <= CAPACITY


def test_overload_is_429_and_memory_stays_bounded(overloaded: Served, retained: Retained) -> None:
    with overloaded.slow(LAUNCH_DELAY_S):
        warm, gauge = asyncio.run(_wave(overloaded.base_url))  # warm-up: lazy imports, caches, pools
        _settle(overloaded)
        _check(warm, gauge)

        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            first, gauge_first = asyncio.run(_wave(overloaded.base_url))
            _settle(overloaded)
            after_first = tracemalloc.get_traced_memory()[0]
            second, gauge_second = asyncio.run(_wave(overloaded.base_url))
            _settle(overloaded)
            after_second = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    _check(first, gauge_first)
    _check(second, gauge_second)
    assert retained.peak_permits == CAPACITY
    assert retained.peak_queues <= CAPACITY
    assert retained.live_queues() == 0, "per-response event queues outlived their responses"
    growth = after_second - after_first
    assert growth < GROWTH_LIMIT_BYTES, f"second wave grew traced memory by {growth} bytes"
    assert after_first - baseline < GROWTH_LIMIT_BYTES, f"first traced wave grew by {after_first - baseline} bytes"
