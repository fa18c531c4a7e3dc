"""``helios run`` shutdown with streams still running: the drain period, then one terminal error event
per dropped stream and one log line each, no tracebacks.

The core is a tiny synthetic one with a 1024-token context (built in well under a second), served with
one model slot: two dozen streams of 1000 tokens each keep the server busy well past the five-second
drain period (about 25 seconds of generation here), so the test takes about eight seconds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helios_core.server.serve import DRAIN_SECONDS
from tests.server.helpers import build_synthetic_core

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "helios-tests/shutdown"
STREAMS = 24


@pytest.fixture(scope="module")
def long_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    built = build_synthetic_core(tmp_path_factory.mktemp("shutdown"), NAMESPACE, seed=5)
    yield built.path, built.public_key


def _events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            name = None
            data = ""
            for line in block.split("\n"):
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    data = line.removeprefix("data: ")
            events.append((name, data))
    return events


def test_sigterm_ends_streams_past_the_drain_with_one_error_event_and_one_log_line_each(
    long_core: tuple[Path, Path],
) -> None:
    core, public_key = long_core
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core), "--trust-key", str(public_key),
        "--accept", NAMESPACE, "--port", str(port), "--backend", "reference", "--max-active", "1",
        "--queue-capacity", str(STREAMS), "--shutdown-timeout", str(DRAIN_SECONDS),
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    bodies: dict[int, str] = {}
    try:
        assert process.stderr is not None
        assert "ready" in process.stderr.readline()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True, "stream": True}

        opened = threading.Semaphore(0)

        def read(index: int) -> None:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30) as r:
                chunks = r.iter_bytes()
                first = next(chunks)  # the opening chunk: the stream is running
                opened.release()
                bodies[index] = (first + b"".join(chunks)).decode()

        readers = [threading.Thread(target=read, args=(index,)) for index in range(STREAMS)]
        for reader in readers:
            reader.start()
        for _ in range(STREAMS):
            assert opened.acquire(timeout=30)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=DRAIN_SECONDS + 10)
        assert process.wait(timeout=10) == 0
        assert time.monotonic() - started < DRAIN_SECONDS + 3
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert len(bodies) == STREAMS
    dropped: list[str] = []
    for text in bodies.values():
        events = _events(text)
        name, data = events[-1]
        if data == "[DONE]":
            continue
        assert name == "error", events[-3:]
        error = json.loads(data)["error"]
        assert error["type"] == "cancelled" and error["code"] == 503
        assert error["message"] == (
            f"the server shut down: the response was still running after the {DRAIN_SECONDS} s drain period"
        )
        dropped.append(json.loads(events[0][1])["id"])
    assert dropped, "every stream finished within the drain period"
    lines = log.splitlines()
    assert sorted(line for line in lines if "dropped" in line) == sorted(
        f"helios run: warning: request {request_id} dropped before it finished: the server shut down: "
        f"the response was still running after the {DRAIN_SECONDS} s drain period"
        for request_id in dropped
    )
    assert "Traceback" not in log
    assert len(lines) == len(dropped), log
