"""Raw HTTP helpers of the server tests (SSE parsing for fields the openai client does not type)."""

from __future__ import annotations

import json
from typing import Any

import httpx


def sse_events(response: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every SSE event; ``[DONE]`` is returned as the string."""
    events: list[tuple[str | None, Any]] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        name = None
        data = ""
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


def chat(base_url: str, **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)
