"""``stream_options.continuous_usage_stats`` (vLLM's extension): with ``include_usage`` every chunk of a stream
carries the usage so far (the prompt, and the tokens generated up to that chunk), and the last usage chunk
the whole response's."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import Served
from tests.server.helpers import sse_events

LIMIT = 6


def _stream(served: Served, path: str, **options: Any) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": LIMIT, "ignore_eos": True, "stream": True, "temperature": 0.0}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "Once upon a time"
    body.update(options)
    response = httpx.post(served.base_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1] == (None, "[DONE]")
    return [data for _, data in events[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"], ids=["chat", "completions"])
def test_every_chunk_carries_the_usage_so_far(served: Served, path: str) -> None:
    chunks = _stream(
        served, path, stream_options={"include_usage": True, "continuous_usage_stats": True}, return_token_ids=True
    )
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == LIMIT
    prompt = last["usage"]["prompt_tokens"]
    seen = 0
    for chunk in choice_chunks:
        seen += len(chunk["choices"][0].get("token_ids") or [])
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen, "total_tokens": prompt + seen}
    assert seen == LIMIT


@pytest.mark.parametrize(
    "options",
    [{"include_usage": True}, {"include_usage": False, "continuous_usage_stats": True}],
    ids=["usage-last-only", "without-include-usage"],
)
def test_without_continuous_stats_only_the_last_chunk_counts(served: Served, options: dict[str, Any]) -> None:
    chunks = _stream(served, "/v1/chat/completions", stream_options=options)
    if options["include_usage"]:
        assert (
            all(chunk["usage"] is None for chunk in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == LIMIT
        )
    else:
        assert all("usage" not in chunk for chunk in chunks)
