"""Helpers of the server tests: small signed synthetic cores, raw HTTP and SSE parsing, scripted model
replies, waiting for a condition, and streams held open to fill the server's admission."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from helios_core.loading import TrustSettings
from helios_core.wire import manifest_pb2 as mf


class BuiltCore(NamedTuple):
    """A signed synthetic core, the public key that verifies it and the trust settings accepting it."""

    path: Path
    public_key: Path
    trust: TrustSettings


def build_synthetic_core(
    tmp: Path,
    namespace: str,
    *,
    seed: int = 3,
    tool_syntax: str = "none",
    reasoning: str = "none",
    context: int = 1024,
    max_rows: int = 2,
    prefill_tokens: tuple[int, ...] = (64, 256),
    decode_rows: tuple[int, ...] = (1, 2),
    speculative_widths: tuple[int, ...] = (),
) -> BuiltCore:
    """Build and sign a ``tiny`` synthetic core in ``tmp`` (fresh keys, no snapshot rows; speculative
    programs verifying copied proposals at ``speculative_widths``)."""
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    keys = generate_keys(tmp / "keys")
    core = tmp / "synthetic.core"
    caps = Capacities(
        max_rows=max_rows, prefill_tokens=prefill_tokens, decode_rows=decode_rows, page_tokens=16, cache_pages=128,
        context=context, snapshots=0, speculative_widths=speculative_widths,
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=seed, tool_syntax=tool_syntax, reasoning=reasoning), core, caps=caps,
        signing_key=load_private_key(keys["signing"]), namespace=namespace,
    )  # fmt: skip
    return BuiltCore(core, keys["public"], TrustSettings((keys["public"],), namespace, None))


CITY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
"""A tool whose one argument the grammar keeps short (random-weight models sample it)."""


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


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> None:
    """Poll ``predicate`` every ``interval`` seconds until it holds; ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval)


def metric_values(base_url: str) -> dict[str, float]:
    """Every sample of the server's ``/metrics`` by its name and labels (``name{label="x"}``), on a fresh
    connection."""
    values: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def admitted(base_url: str) -> int:
    """The admission permits the server holds now (its ``helios_http_admitted`` gauge)."""
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("helios_http_admitted "):
            return int(float(line.split()[1]))
    raise LookupError("no helios_http_admitted gauge")


def hold_chat_stream(base_url: str, index: int) -> httpx.Response:
    """A streamed chat completion of 10 tokens (end of sequence ignored): long enough to hold its permit."""
    return chat(base_url, max_tokens=10, ignore_eos=True, stream=True)


@contextmanager
def held_requests(
    base_url: str, count: int, send: Callable[[str, int], httpx.Response] = hold_chat_stream
) -> Iterator[list[int]]:
    """Send ``count`` requests (``send(base_url, index)``), each from its own thread, and wait until the server
    holds all ``count`` admission permits; the block runs while they are held (slow the rounds to keep them
    so), and its end joins the threads. Yields the list each request's status code is appended to as it ends."""
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda index=index: statuses.append(send(base_url, index).status_code))
        for index in range(count)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: admitted(base_url) == count)
    yield statuses
    for thread in threads:
        thread.join(timeout=20)


@contextmanager
def scripted_replies(running: Any) -> Iterator[Callable[..., None]]:
    """Make a served core 'say' a chosen text: each sampling launch's first lane gets the next scripted id.

    The engine, host gates, output pipeline and presentation all run for real; only the sampled ids of
    lane 0 are replaced after each launch of a sampling program (others leave the last round's record).
    """
    backend = running.model.backend
    tokenizer = running.bootstrap.tokenizer
    eos = running.verified.contract.eos_token_ids[0]
    original = backend.run
    pending: list[int] = []

    def scripted_run(program: str, frame: int) -> Any:
        result = original(program, frame)
        completion = backend.completion(frame)
        emitted = completion[mf.COMPLETION_FIELD_EMITTED_TOKENS].reshape(-1)
        sampling = program.startswith(("prefill", "mixed", "decode"))
        if pending and sampling and emitted.size and emitted[0] == 1:
            ids = completion[mf.COMPLETION_FIELD_SAMPLED_IDS]
            ids.reshape(ids.shape[0], -1)[0, 0] = pending.pop(0)
        return result

    def say(text: str, *, end: bool = True) -> None:
        """Script ``text`` (then EOS when ``end``; else the model continues sampling after it)."""
        pending[:] = [*tokenizer.encode(text, add_special_tokens=False).ids, *([eos] if end else [])]

    backend.run = scripted_run
    try:
        yield say
    finally:
        backend.run = original
