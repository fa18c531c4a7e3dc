"""The load gauges an inference gateway scrapes: names, single series, live values, the vLLM names."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from helios_core.server.admission import Admission
from helios_core.server.app import ServerSettings
from helios_core.server.serve import resolve_options
from tests.server.conftest import Served, serve_fixture
from tests.server.helpers import chat, wait_for

GATEWAY_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info")


def _scrape(served: Served) -> tuple[str, dict[str, float]]:
    """The exposition text and every unlabelled sample's value."""
    text = httpx.get(served.base_url + "/metrics").text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }
    return text, values


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith((name + " ", name + "{"))]


def test_gauges_count_held_requests_live(served: Served) -> None:
    """Two requests hold both model slots; two more wait. Rounds take 0.2 s, so the worker's snapshot
    (taken between rounds) cannot know the newcomers yet: the gauges are read live."""
    statuses: list[int] = []

    def hold() -> None:
        statuses.append(chat(served.base_url, max_tokens=6, ignore_eos=True, stream=True).status_code)

    with served.slow(0.2):
        first = [threading.Thread(target=hold) for _ in range(2)]
        for thread in first:
            thread.start()
        wait_for(lambda: _scrape(served)[1]["helios_num_requests_running"] == 2)
        second = [threading.Thread(target=hold) for _ in range(2)]
        for thread in second:
            thread.start()
        while True:  # the first scrape that sees all four permits
            _, values = _scrape(served)
            if values["helios_http_admitted"] == 4:
                break
        assert values["helios_num_requests_running"] == 2
        assert values["helios_num_requests_waiting"] == 2
        assert 0.0 < values["helios_kv_cache_usage_ratio"] <= 1.0
        for thread in first + second:
            thread.join(timeout=30)
    assert statuses == [200] * 4
    served.wait_idle()
    wait_for(lambda: _scrape(served)[1]["helios_http_admitted"] == 0)
    _, values = _scrape(served)
    assert values["helios_num_requests_running"] == 0
    assert values["helios_num_requests_waiting"] == 0


def test_idle_cached_pages_count_as_free(served: Served) -> None:
    assert chat(served.base_url, max_tokens=8, ignore_eos=True).status_code == 200
    served.wait_idle()
    wait_for(lambda: _scrape(served)[1]["helios_http_admitted"] == 0)
    _, values = _scrape(served)
    allocator = served.running.engine.allocator
    assert allocator.evictable_pages > 0  # the finished request's published pages stay cached
    assert allocator.free_pages < allocator.total_pages
    assert values["helios_pages_referenced"] == 0
    assert values["helios_kv_cache_usage_ratio"] == 0.0


def test_one_typed_series_each_and_the_cache_config_labels(served: Served) -> None:
    text, _ = _scrape(served)
    allocator = served.running.engine.allocator
    for name in ("helios_num_requests_waiting", "helios_num_requests_running", "helios_kv_cache_usage_ratio"):
        assert f"# TYPE {name} gauge" in text.splitlines()
        assert len(_series(text, name)) == 1
    assert "# TYPE helios_cache_config_info gauge" in text.splitlines()
    assert _series(text, "helios_cache_config_info") == [
        f'helios_cache_config_info{{block_size="{allocator.page_tokens}",num_gpu_blocks="{allocator.total_pages}"}} 1.0'
    ]
    assert "vllm:" not in text  # the compatibility names are opt-in


def test_vllm_names_when_enabled() -> None:
    with serve_fixture(ServerSettings(vllm_metrics=True), max_active=2, queue_capacity=2) as served:
        text, values = _scrape(served)
        allocator = served.running.engine.allocator
    for name in GATEWAY_GAUGES:
        assert f"# TYPE vllm:{name} gauge" in text.splitlines()
        assert len(_series(text, f"vllm:{name}")) == 1
    assert values["vllm:num_requests_waiting"] == 0
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:kv_cache_usage_perc"] == values["helios_kv_cache_usage_ratio"]
    assert _series(text, "vllm:cache_config_info") == [
        f'vllm:cache_config_info{{block_size="{allocator.page_tokens}",num_gpu_blocks="{allocator.total_pages}"}} 1.0'
    ]
    assert "gpu_cache_usage_perc" not in text


def test_vllm_metrics_option_resolves() -> None:
    assert resolve_options({"core": Path("c.core")}, environ={}).vllm_metrics is False
    assert resolve_options({"core": Path("c.core"), "vllm_metrics": True}, environ={}).vllm_metrics is True
    assert resolve_options({"core": Path("c.core")}, environ={"HELIOS_VLLM_METRICS": "1"}).vllm_metrics is True


def test_ended_generation_counts_until_the_permit_is_released() -> None:
    admission = Admission(capacity=2, preparation_slots=1)
    permit = admission.admit()
    assert (admission.in_use, admission.ended) == (1, 0)
    permit.generation_ended()
    permit.generation_ended()  # idempotent
    assert (admission.in_use, admission.ended) == (1, 1)
    permit.release()
    assert (admission.in_use, admission.ended) == (0, 0)
    permit.generation_ended()  # after release: nothing to count
    assert admission.ended == 0
