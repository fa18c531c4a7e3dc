"""``helios run --backend cuda`` end to end: a SmolLM2-shaped synthetic core served over HTTP on the GPU.

Builds a bf16 ``135m`` core with the ``reference,sm_90a`` targets, starts ``helios run`` as a
subprocess on a free loopback port, waits for its readiness line, sends one chat completion as JSON
and one as a stream (httpx), checks status, token usage and finish reason, then stops the server
with SIGTERM and expects exit status 0.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .harness import skip_when_compiling_only

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "helios-gpu-tests/serve"
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def served_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A signed 135m-shaped bf16 core with GPU kernels, and the public key it was signed with."""
    from ignition.cli import main as ignition_main

    from helios_core.container.keys import generate_keys

    directory = tmp_path_factory.mktemp("gpu-serve")
    keys = generate_keys(directory / "keys")
    core = directory / "smol-shape.core"
    arguments = [
        "build", "llama-synthetic", "--shape", "135m", "--dtype", "bf16", "--targets", "reference,sm_90a",
        "--max-rows", "4", "--decode-rows", "1,2,4", "--prefill-tokens", "64", "--context", "512",
        "--out", str(core), "--sign-key", str(keys["signing"]), "--namespace", NAMESPACE, "--quiet",
    ]  # fmt: skip
    assert ignition_main(arguments) == 0
    return core, keys["public"]


@pytest.fixture(scope="module")
def server(served_core: tuple[Path, Path]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``helios run`` on the CUDA backend, after its readiness line; stopped by the test or at teardown."""
    skip_when_compiling_only("helios run --backend cuda")
    core, public = served_core
    port = _free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core), "--trust-key", str(public),
        "--accept", NAMESPACE, "--backend", "cuda", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environment.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(command, cwd=ROOT, env=environment, stderr=subprocess.PIPE, text=True)
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    seen: list[str] = []

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read_stderr, name="helios-run-stderr", daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail(f"helios run printed no readiness line in {STARTUP_TIMEOUT_S:.0f} s: {''.join(seen)}")
            if line is None:
                pytest.fail(f"helios run exited with {process.wait()} before it was ready: {''.join(seen)}")
            seen.append(line)
            if "ready" in line:
                break
        assert f"127.0.0.1:{port}" in seen[-1]
        yield f"http://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _chat(stream: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def test_chat_completion_json_and_stream_then_sigterm(server: tuple[str, subprocess.Popen[str]]) -> None:
    url, process = server
    response = httpx.post(f"{url}/v1/chat/completions", json=_chat(stream=False), timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["prompt_tokens"] > 0
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert answer["choices"][0]["finish_reason"] == "length"

    finish_reasons: list[str] = []
    usage: dict[str, int] = {}
    done = False
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=_chat(stream=True), timeout=REQUEST_TIMEOUT_S
    ) as streamed:
        assert streamed.status_code == 200
        for line in streamed.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            finish_reasons += [c["finish_reason"] for c in chunk.get("choices") or [] if c.get("finish_reason")]
    assert done
    assert finish_reasons == ["length"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == MAX_TOKENS

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
