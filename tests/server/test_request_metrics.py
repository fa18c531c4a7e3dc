"""Token counters and request-latency histograms at ``/metrics``, measured against a known workload.

The counters must equal the sums of the responses' ``usage``; each histogram counts every request it
covers once, with cumulative buckets whose ``+Inf`` bucket is the count, and the vLLM names (opt-in)
carry the same values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from helios_core.runtime.stats import E2E_BUCKETS_S, TTFT_BUCKETS_S
from helios_core.server.app import ServerSettings

from .conftest import Served, serve_fixture
from .helpers import chat, metric_values, wait_for

PROMPTS = ["hi", "hello", "hey you"]
"""Short: the fixture core's context is 64 tokens."""


@pytest.fixture(scope="module")
def served_vllm_names() -> Iterator[Served]:
    with serve_fixture(ServerSettings(vllm_metrics=True), max_active=2, queue_capacity=2) as served:
        yield served


def _buckets(values: dict[str, float], name: str, bounds: tuple[float, ...]) -> list[float]:
    return [values[f'{name}_bucket{{le="{bound}"}}'] for bound in [*(format(b, "g") for b in bounds), "+Inf"]]


def test_token_counters_equal_the_usage_and_each_request_is_timed_once(served_vllm_names: Served) -> None:
    served = served_vllm_names
    before = metric_values(served.base_url)
    usages = []
    for index, prompt in enumerate(PROMPTS):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3 + index, "ignore_eos": True}
        usages.append(chat(served.base_url, **body).json()["usage"])
    streamed = chat(
        served.base_url, messages=[{"role": "user", "content": "and a stream"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, ignore_eos=True,
    )  # fmt: skip
    assert streamed.status_code == 200
    usages.append(_usage_of(streamed.text))
    wait_for(lambda: metric_values(served.base_url)["helios_e2e_request_latency_seconds_count"] >= before.get(
        "helios_e2e_request_latency_seconds_count", 0) + len(usages))  # fmt: skip
    after = metric_values(served.base_url)
    for prefix in ("helios_", "vllm:"):
        assert after[f"{prefix}prompt_tokens_total"] - before.get(f"{prefix}prompt_tokens_total", 0) == sum(
            usage["prompt_tokens"] for usage in usages
        )
        assert after[f"{prefix}generation_tokens_total"] - before.get(f"{prefix}generation_tokens_total", 0) == sum(
            usage["completion_tokens"] for usage in usages
        )
        for name, bounds in (
            ("time_to_first_token_seconds", TTFT_BUCKETS_S),
            ("e2e_request_latency_seconds", E2E_BUCKETS_S),
        ):
            full = f"{prefix}{name}"
            assert after[f"{full}_count"] - before.get(f"{full}_count", 0) == len(usages)
            assert after[f"{full}_sum"] > before.get(f"{full}_sum", 0)
            buckets = _buckets(after, full, bounds)
            assert buckets == sorted(buckets) and buckets[-1] == after[f"{full}_count"]
    # a request's time to its first token is within its whole latency
    assert after["helios_time_to_first_token_seconds_sum"] <= after["helios_e2e_request_latency_seconds_sum"]


def test_a_cancelled_request_counts_its_tokens_but_no_latency(served_vllm_names: Served) -> None:
    served = served_vllm_names
    before = metric_values(served.base_url)
    with httpx.stream(
        "POST", served.base_url + "/v1/chat/completions", timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True, "ignore_eos": True},
    ) as response:  # fmt: skip
        next(response.iter_bytes())  # admitted and streaming; closing the stream cancels it
    cancelled = 'helios_requests_finished_total{reason="cancelled"}'
    wait_for(lambda: metric_values(served.base_url).get(cancelled, 0) == before.get(cancelled, 0) + 1)
    after = metric_values(served.base_url)
    assert after["helios_e2e_request_latency_seconds_count"] == before["helios_e2e_request_latency_seconds_count"]
    assert after["helios_prompt_tokens_total"] > before["helios_prompt_tokens_total"]


def _usage_of(text: str) -> dict[str, int]:
    """The usage of a stream's usage-only chunk."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"choices":[]' in line.replace(" ", ""):
            usage: dict[str, int] = json.loads(line.removeprefix("data: "))["usage"]
            return usage
    raise LookupError("no usage chunk")
