"""Prefix-reuse counters under page pressure, through the HTTP API on the reference backend.

A tiny synthetic core (context 256) served with a cache of 18 pages of 16 tokens: two requests sharing a
128-token system message, each holding 15 or 16 pages, cannot run together, so the second waits for pages,
matching its prefix again each round it tries. ``helios_prefix_reused_tokens_total``,
``helios_prefix_hit_pages_total`` and ``helios_prefix_queries_total`` count what the admitted requests
reused, once each: the sum of the responses' ``cached_tokens``, its pages, and one lookup a request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import Served, serve_fixture
from .helpers import build_synthetic_core, metric_values

NAMESPACE = "helios-tests/prefix-counters"
SHARED = "".join(chr(ord("a") + (index * 7) % 26) for index in range(128))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    built = build_synthetic_core(tmp_path_factory.mktemp("prefix-counters"), NAMESPACE, context=256)
    with serve_fixture(core=built.path, trust=built.trust, cache_pages=18) as served:
        yield served


def _chat(served: Served, tail: str, results: list[dict[str, Any]]) -> None:
    body = {
        "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": tail}],
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 0,
    }
    response = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    results.append(response.json()["usage"])


def test_a_request_waiting_for_pages_counts_its_reuse_once(served: Served) -> None:
    before = metric_values(served.base_url)
    results: list[dict[str, Any]] = []
    waited = 0.0
    with served.slow(0.05):
        first = threading.Thread(target=_chat, args=(served, ("first question " * 4)[:60], results))
        first.start()
        time.sleep(0.2)  # the first request holds most of the cache
        second = threading.Thread(target=_chat, args=(served, ("second question " * 4)[:60], results))
        second.start()
        while second.is_alive() and first.is_alive():
            waited = max(waited, metric_values(served.base_url)["helios_requests_waiting"])
            time.sleep(0.02)
        first.join(timeout=60)
        second.join(timeout=60)
    assert len(results) == 2
    assert waited == 1.0  # the second request waited in the engine for pages while the first ran
    after = metric_values(served.base_url)
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in results)
    assert cached >= 128 - 16  # the second request reused the shared message's complete pages
    reused = after["helios_prefix_reused_tokens_total"] - before["helios_prefix_reused_tokens_total"]
    pages = after["helios_prefix_hit_pages_total"] - before["helios_prefix_hit_pages_total"]
    queries = after["helios_prefix_queries_total"] - before["helios_prefix_queries_total"]
    assert (reused, pages, queries) == (cached, cached // 16, 2)
