"""Admission (429), disconnect cancellation and the metrics export under held traffic."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Served, serve_fixture
from tests.server.helpers import chat, held_requests, wait_for


def _metrics(served: Served) -> dict[str, float]:
    text = httpx.get(served.base_url + "/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    return values


def test_full_ingress_is_429(served: Served) -> None:
    capacity = 4  # queue_capacity 2 + max_active 2
    rejected = _metrics(served)["helios_requests_rejected_total"]
    with served.slow(0.03), held_requests(served.base_url, capacity) as results:
        for _ in range(3):
            refused = chat(served.base_url, max_tokens=2)
            assert refused.status_code == 429
            assert refused.json()["error"]["type"] == "rate_limit_error"
        assert _metrics(served)["helios_requests_rejected_total"] == rejected + 3  # each 429 counted once
    assert results == [200] * capacity
    wait_for(lambda: _metrics(served)["helios_http_admitted"] == 0)
    assert chat(served.base_url, max_tokens=2).status_code == 200


def test_disconnect_cancels(served: Served) -> None:
    before = served.running.engine.statistics().finished.get("cancelled", 0)
    with served.slow(0.03), httpx.Client(timeout=10) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True, "stream": True}
        with client.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(4)]
            assert received[0].startswith("data: ")
        # leaving the block closes the connection mid-stream
        wait_for(lambda: served.running.engine.statistics().finished.get("cancelled", 0) == before + 1)
    served.wait_idle()
    stats = served.running.engine.statistics()
    assert stats.active_requests == 0
    assert stats.pages_referenced == 0
    wait_for(lambda: _metrics(served)["helios_http_admitted"] == 0)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_dropped_response_holds_its_permit_until_the_worker_ends_its_request(
    served: Served, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The permit of a dropped connection returns only once the model worker ended the request: here the
    cancellation is held back, so the request runs on to its output limit, and its permit with it."""
    engine = served.running.engine
    cancelled: list[str] = []
    monkeypatch.setattr(engine, "cancel", cancelled.append)  # the drop is noticed but does not stop the work
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True, "stream": stream}
    with served.slow(0.03):
        with httpx.Client(timeout=10) as client:
            if stream:
                with client.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
                    lines = response.iter_lines()
                    assert next(lines).startswith("data: ")
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post(served.base_url + "/v1/chat/completions", json=body, timeout=0.3)
        wait_for(lambda: bool(cancelled))  # the server saw the drop
        wait_for(lambda: engine.statistics().active_requests == 1)  # the statistics of a completed round
        assert _metrics(served)["helios_http_admitted"] == 1  # still generating: still held
    served.wait_idle()
    wait_for(lambda: _metrics(served)["helios_http_admitted"] == 0)


def test_paused_reader_loses_nothing(served: Served) -> None:
    with httpx.Client(timeout=10) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "ignore_eos": True, "stream": True,
                "return_token_ids": True}  # fmt: skip
        with client.stream("POST", served.base_url + "/v1/chat/completions", json=body) as response:
            served.wait_idle()  # generation finishes while the reader has read nothing
            text = response.read().decode()
    assert text.count('"token_ids":[') == 30
    assert text.endswith("data: [DONE]\n\n")


def test_metrics_export_and_flare_gauges() -> None:
    with serve_fixture(max_active=2) as served:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(served.base_url + "/metrics").text)}
        assert families["flare_constrained_max_inflight"].type == "gauge"
        assert families["flare_mixed_grammar_decode_steps"].type == "counter"
        values = _metrics(served)
        assert values["flare_constrained_max_inflight"] == 0
        assert values["flare_mixed_grammar_decode_steps_total"] == 0

        statuses: list[int] = []

        def constrained() -> None:
            statuses.append(chat(served.base_url, max_tokens=20, response_format={"type": "json_object"}).status_code)

        def plain() -> None:
            statuses.append(chat(served.base_url, max_tokens=20, ignore_eos=True).status_code)

        with served.slow(0.01):
            threads = [threading.Thread(target=constrained), threading.Thread(target=plain)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=20)
        assert statuses == [200, 200]
        values = _metrics(served)
        assert values["flare_constrained_max_inflight"] == 1
        assert values["flare_mixed_grammar_decode_steps_total"] > 0
        text = httpx.get(served.base_url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                assert not any("chatcmpl" in value for value in sample.labels.values())
        for name in (
            "helios_requests_admitted_total",
            "helios_prefix_queries_total",
            "helios_pages_total",
            "helios_pages_free",
            "helios_pages_referenced",
            "helios_pages_evictable",
            "helios_pages_published_total",
            "helios_requests_active",
            "helios_requests_waiting",
        ):
            assert name in values
        assert "helios_graph_launches" in {f.name for f in text_string_to_metric_families(text)}


def test_a_paused_reader_does_not_stall_other_streams(served: Served) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "ignore_eos": True, "stream": True}
    url = served.base_url + "/v1/chat/completions"
    with httpx.Client(timeout=10) as client, client.stream("POST", url, json=body) as paused:
        # While the first reader reads nothing, a second stream runs to completion.
        other = client.post(url, json={**body, "return_token_ids": True})
        assert other.status_code == 200
        assert other.text.count('"token_ids":[') == 30 and other.text.endswith("data: [DONE]\n\n")
        text = paused.read().decode()
    assert text.endswith("data: [DONE]\n\n")
