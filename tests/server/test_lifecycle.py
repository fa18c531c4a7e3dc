"""Readiness, liveness, retry headers, render endpoints and the SIGTERM drain of ``helios run``.

In-process servers run the golden fixture core; the drain tests run ``helios run`` as a subprocess on a
tiny synthetic core with a 1024-token context (about a millisecond per generated token here), so a few
1000-token streams outlast a short ``--shutdown-timeout``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from helios_core.container.keys import load_public_key
from helios_core.contract import LoadOptions
from helios_core.errors import StartupError, TrustError
from helios_core.loading import TrustSettings
from helios_core.runtime.startup import RunningModel, start
from helios_core.server import admission as admission_module
from helios_core.server.admission import Admission
from helios_core.server.app import create_app
from helios_core.server.readiness import Phase, Readiness
from helios_core.server.serve import DEFAULT_SHUTDOWN_TIMEOUT, resolve_options
from tests.server.conftest import CORE, KEYS, NAMESPACE, Served, free_port
from tests.server.helpers import build_synthetic_core, chat, held_requests, sse_events, wait_for

ROOT = Path(__file__).resolve().parents[2]
DRAIN_NAMESPACE = "helios-tests/lifecycle"
HI = [{"role": "user", "content": "hi"}]


def _assert_unhealthy(base: str, status: str, reason: str) -> None:
    """``GET /health`` of the fixture core's server answers 503 with ``status`` and ``reason``."""
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 503
    assert health.json() == {"status": status, "model": "llama-synthetic-tiny", "reason": reason}


@contextmanager
def _server(readiness: Readiness | None, **options: Any) -> Iterator[tuple[str, RunningModel]]:
    """An in-process server of the fixture core with the given readiness state."""
    running = start(
        CORE, TrustSettings((KEYS / "signing.pub.pem",), NAMESPACE, None), LoadOptions(**options), backend="reference"
    )
    port = free_port()
    config = uvicorn.Config(create_app(running, readiness=readiness), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: bool(server.started))
        yield f"http://127.0.0.1:{port}", running
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        running.close()


def _assert_not_ready(response: httpx.Response, message: str, *, closing: bool = False) -> None:
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.headers["retry-after-ms"] == "1000"
    assert (response.headers.get("connection") == "close") is closing
    assert response.json() == {"error": {"message": message, "type": "not_ready", "param": None, "code": 503}}


# -- readiness and liveness ----------------------------------------------------------------------
def test_every_inference_route_is_503_until_ready_then_served_then_503_with_close_while_draining() -> None:
    readiness = Readiness()
    readiness.starting("the warm-up generation is running")
    starting = "the server is not ready yet: the warm-up generation is running; retry later"
    draining = "the server is shutting down: shutdown began; retry on another replica"
    with _server(readiness, max_active=1, queue_capacity=1) as (base, _running):
        body = {"messages": HI, "max_tokens": 2}
        routes: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", "/ready", None),
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", body),
            ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
            ("POST", "/v1/chat/completions/render", body),
            ("POST", "/v1/completions/render", {"prompt": "Hello"}),
        ]
        for method, path, payload in routes:
            _assert_not_ready(httpx.request(method, base + path, json=payload, timeout=10), starting)
        health = httpx.get(base + "/health", timeout=10)
        assert (health.status_code, health.json()["status"]) == (200, "ok")  # liveness is not readiness
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200

        readiness.mark_ready()
        assert httpx.get(base + "/ready", timeout=10).json() == {"status": "ready", "model": "llama-synthetic-tiny"}
        assert chat(base, max_tokens=2).status_code == 200
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 200

        readiness.drain("shutdown began")
        for method, path, payload in routes:
            _assert_not_ready(httpx.request(method, base + path, json=payload, timeout=10), draining, closing=True)
        readiness.mark_ready()  # a drain never ends in ready again
        assert readiness.phase is Phase.DRAINING


def test_health_is_503_once_the_model_worker_stopped_and_ready_follows() -> None:
    with _server(None, max_active=1, queue_capacity=1) as (base, running):
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/ready", timeout=10).status_code == 200
        running.engine.shutdown()  # the worker thread ends
        _assert_unhealthy(base, "dead", "the model worker stopped")
        ready = httpx.get(base + "/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["error"]["message"] == "the model worker stopped"


def test_overload_flips_neither_health_nor_ready(served: Served) -> None:
    with served.slow(0.03), held_requests(served.base_url, 4) as held:  # queue_capacity 2 + max_active 2
        refused = chat(served.base_url, max_tokens=2)
        health = httpx.get(served.base_url + "/health", timeout=10).status_code
        ready = httpx.get(served.base_url + "/ready", timeout=10).status_code
    assert refused.status_code == 429
    seconds, milliseconds = int(refused.headers["retry-after"]), int(refused.headers["retry-after-ms"])
    assert 1 <= seconds <= 60 and 1000 <= milliseconds <= 60_000 and seconds == -(-milliseconds // 1000)
    assert (health, ready) == (200, 200)
    assert held == [200] * 4


# -- retry estimate -------------------------------------------------------------------------------
def test_retry_after_is_waiting_requests_times_mean_hold_over_max_active_clamped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(admission_module.time, "monotonic", lambda: now[0])
    admission = Admission(capacity=10, preparation_slots=1, max_active=2)
    assert admission.retry_after_ms() == 1000  # no measurement: one second per waiting request / 2, clamped
    permits = [admission.admit() for _ in range(10)]
    now[0] += 4.0
    permits[0].release()  # held 4 s
    now[0] += 2.0
    permits[1].release()  # held 6 s: mean 5 s
    # 8 held, 2 of them on model slots: 6 waiting x 5 s / 2 slots = 15 s
    assert admission.retry_after_ms() == 15_000
    for permit in permits[2:]:
        permit.release()
    assert admission.retry_after_ms() == 2900  # none waiting counts as one: 1 x mean 5.8 s / 2 slots
    slow = Admission(capacity=200, preparation_slots=1, max_active=1)
    held = [slow.admit() for _ in range(200)]
    now[0] += 10.0
    held[0].release()
    assert slow.retry_after_ms() == 60_000  # 198 waiting x 10 s: clamped to 60 s


def test_openai_client_honours_retry_after_and_succeeds_on_its_retry(served: Served) -> None:
    statuses: list[int] = []
    sent: list[float] = []

    def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    def stamp(request: httpx.Request) -> None:
        sent.append(time.monotonic())

    client = openai.OpenAI(
        base_url=served.base_url + "/v1",
        api_key="unused",
        max_retries=2,
        http_client=httpx.Client(event_hooks={"request": [stamp], "response": [record]}, timeout=30),
    )
    with served.slow(0.02), held_requests(served.base_url, 4):
        completion = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert statuses[0] == 429 and statuses[-1] == 200 and len(statuses) in (2, 3)
    assert sent[1] - sent[0] >= 0.95  # the client waited the Retry-After of at least one second


# -- render ---------------------------------------------------------------------------------------
def test_render_returns_the_prompt_ids_generation_prefills(served: Served) -> None:
    chat_body = {"messages": [{"role": "system", "content": "Be brief."}, *HI], "max_tokens": 2}
    rendered = httpx.post(served.base_url + "/v1/chat/completions/render", json=chat_body, timeout=10)
    assert rendered.status_code == 200
    data = rendered.json()
    assert set(data) == {"id", "object", "model", "prompt_token_ids", "num_prompt_tokens"}
    assert data["object"] == "render" and data["model"] == "llama-synthetic-tiny"
    generated = chat(served.base_url, **chat_body, return_token_ids=True).json()
    assert data["prompt_token_ids"] == generated["prompt_token_ids"]
    assert data["num_prompt_tokens"] == generated["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])

    # completions have no return_token_ids: the rendered ids, sent as the prompt, generate exactly what the
    # text does (greedy), with the same prompt token count
    completion_body = {"prompt": "Hello there", "max_tokens": 4, "model": "tiny", "temperature": 0}
    rendered = httpx.post(served.base_url + "/v1/completions/render", json=completion_body, timeout=10).json()
    assert rendered["model"] == "tiny"
    from_text = httpx.post(served.base_url + "/v1/completions", json=completion_body, timeout=10).json()
    by_ids = {**completion_body, "prompt": rendered["prompt_token_ids"]}
    from_ids = httpx.post(served.base_url + "/v1/completions", json=by_ids, timeout=10).json()
    assert rendered["num_prompt_tokens"] == from_text["usage"]["prompt_tokens"] == from_ids["usage"]["prompt_tokens"]
    assert from_ids["choices"][0]["text"] == from_text["choices"][0]["text"]
    assert served.running.engine.statistics().active_requests == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "param"),
    [
        ("/v1/chat/completions/render", {"messages": HI, "colour": 1}, 400, "invalid_request_error", "colour"),
        ("/v1/chat/completions/render", {"messages": HI, "model": "other"}, 404, "not_found_error", None),
        ("/v1/completions/render", {"prompt": [[1], [2]]}, 400, "invalid_request_error", "prompt"),
        ("/v1/completions/render", {"prompt": "x", "temperature": -1}, 400, "invalid_request_error", "temperature"),
    ],
)
def test_render_refuses_what_generation_refuses(
    served: Served, path: str, body: dict[str, Any], status: int, kind: str, param: str | None
) -> None:
    rendered = httpx.post(served.base_url + path, json=body, timeout=10)
    generated = httpx.post(served.base_url + path.removesuffix("/render"), json=body, timeout=10)
    assert rendered.status_code == generated.status_code == status
    error = rendered.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (kind, param, status)
    assert error == generated.json()["error"]


# -- run options ----------------------------------------------------------------------------------
def test_shutdown_timeout_option_resolution() -> None:
    assert resolve_options({"core": Path("x")}, None, {}).shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT == 5
    assert resolve_options({"core": Path("x")}, None, {"HELIOS_SHUTDOWN_TIMEOUT": "2.5"}).shutdown_timeout == 2.5
    explicit = resolve_options({"core": Path("x"), "shutdown_timeout": 0.0}, None, {"HELIOS_SHUTDOWN_TIMEOUT": "9"})
    assert explicit.shutdown_timeout == 0.0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(StartupError, match=r"shutdown-timeout .* must be a"):
            resolve_options({"core": Path("x")}, None, {"HELIOS_SHUTDOWN_TIMEOUT": bad})


# -- drain of helios run --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drain_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    built = build_synthetic_core(tmp_path_factory.mktemp("lifecycle"), DRAIN_NAMESPACE, seed=7)
    return built.path, built.public_key


@contextmanager
def _helios_run(core: tuple[Path, Path], *options: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core[0]), "--trust-key", str(core[1]),
        "--accept", DRAIN_NAMESPACE, "--port", str(port), "--backend", "reference", "--max-active", "1",
        *options,
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "ready" in line, line
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class _Stream:
    """One long SSE stream read on a thread: ``opened`` once its first chunk arrived."""

    def __init__(self, base: str, max_tokens: int = 1000) -> None:
        self.opened = threading.Event()
        self.chunks: list[bytes] = []
        body = {"messages": HI, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self._thread.start()

    def _read(self, base: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as response:
                for chunk in response.iter_bytes():
                    self.chunks.append(chunk)
                    self.opened.set()
        except httpx.HTTPError:  # the server closed the connection (a forced exit)
            self.chunks.append(b"\n\nevent: closed\ndata: null\n\n")

    def events(self, timeout: float) -> list[tuple[str | None, Any]]:
        self._thread.join(timeout=timeout)
        return sse_events(httpx.Response(200, content=b"".join(self.chunks)))


def test_sigterm_drains_while_answering_503_then_drops_past_the_timeout(drain_core: tuple[Path, Path]) -> None:
    with _helios_run(drain_core, "--shutdown-timeout", "1.5", "--queue-capacity", "4") as (process, base):
        assert httpx.get(base + "/ready", timeout=10).status_code == 200
        streams = [_Stream(base) for _ in range(4)]  # one slot: about four seconds of generation
        for stream in streams:
            assert stream.opened.wait(timeout=30)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(base + "/ready", timeout=5).status_code == 503, timeout=2)
        assert time.monotonic() - signalled < 1.0
        refused = chat(base, max_tokens=2)  # still answered: the socket stays open during the drain
        _assert_not_ready(
            refused, "the server is shutting down: shutdown began; retry on another replica", closing=True
        )
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert httpx.get(base + "/metrics", timeout=5).status_code == 200
        assert process.wait(timeout=8) == 0
        elapsed = time.monotonic() - signalled
        log = process.stderr.read() if process.stderr is not None else ""
    assert 1.5 <= elapsed < 1.5 + 3
    endings = [stream.events(timeout=5)[-1] for stream in streams]
    message = "the server shut down: the response was still running after the 1.5 s drain period"
    dropped = [end for end in endings if end != (None, "[DONE]")]
    assert dropped and all(
        end == ("error", {"error": {"message": message, "type": "cancelled", "param": None, "code": 503}})
        for end in dropped
    )
    assert "Traceback" not in log


def test_streams_that_finish_within_the_timeout_complete_and_a_second_sigterm_exits_at_once(
    drain_core: tuple[Path, Path],
) -> None:
    with _helios_run(drain_core) as (process, base):  # the default 30 s timeout
        short = _Stream(base, max_tokens=200)
        assert short.opened.wait(timeout=30)
        long = [_Stream(base) for _ in range(3)]  # queued behind it on the one model slot: seconds of work
        assert all(stream.opened.wait(timeout=30) for stream in long)
        process.send_signal(signal.SIGTERM)
        short_events = short.events(timeout=10)
        assert short_events[-1] == (None, "[DONE]")  # in-flight work goes on during the drain
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
        assert time.monotonic() - signalled < 2
    endings = [stream.events(timeout=5)[-1] for stream in long]
    assert ("closed", None) in endings  # cut by the forced exit, without a terminal event


# -- listening before the core is loaded ----------------------------------------------------------
@contextmanager
def _loading_run(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """``helios run`` of the fixture core whose trusted key is a FIFO: loading blocks reading the key (a
    key on a slow mount) until the test writes it, while the server already listens."""
    key = tmp_path / "slow-signing.pub.pem"
    os.mkfifo(key)
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(CORE), "--trust-key", str(key),
        "--accept", NAMESPACE, "--port", str(port), "--backend", "reference",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        yield process, f"http://127.0.0.1:{port}", key
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _get_while_listening(url: str, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=5)
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_the_port_answers_while_the_core_loads_then_the_server_turns_ready(tmp_path: Path) -> None:
    loading = "the server is not ready yet: the core is loading; retry later"
    with _loading_run(tmp_path) as (process, base, key):
        _assert_not_ready(_get_while_listening(base + "/ready"), loading)
        health = httpx.get(base + "/health", timeout=5)
        assert (health.status_code, health.json()) == (200, {"status": "starting", "reason": "the core is loading"})
        routes: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
            ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
            ("POST", "/v1/chat/completions/render", {"messages": HI}),
            ("POST", "/v1/completions/render", {"prompt": "Hello"}),
        ]
        for method, path, payload in routes:
            refused = httpx.request(method, base + path, json=payload, timeout=5)
            _assert_not_ready(refused, loading)
            if path.startswith(("/v1/chat/completions", "/v1/completions")):  # every generating route's answer
                prefix = "chatcmpl-" if path.startswith("/v1/chat") else "cmpl-"
                assert re.fullmatch(prefix + "[0-9a-f]{32}", refused.headers.get("x-request-id", "")), refused.headers
        assert process.poll() is None
        key.write_bytes((KEYS / "signing.pub.pem").read_bytes())  # the load goes on
        assert process.stderr is not None
        line = process.stderr.readline()
        assert line.startswith(f"helios run: ready: serving llama-synthetic-tiny at {base} (startup "), line
        assert httpx.get(base + "/ready", timeout=5).json() == {"status": "ready", "model": "llama-synthetic-tiny"}
        assert chat(base, max_tokens=2).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0


def test_a_load_that_fails_after_listening_exits_with_its_one_line_and_status(tmp_path: Path) -> None:
    with _loading_run(tmp_path) as (process, base, key):
        assert _get_while_listening(base + "/health").status_code == 200
        key.write_bytes(b"not a key\n")
        assert process.wait(timeout=30) == 1
        log = process.stderr.read() if process.stderr is not None else ""
    key.unlink()
    key.write_bytes(b"not a key\n")  # the same bytes at the same path, as a plain file: the same error
    with pytest.raises(TrustError) as expected:
        load_public_key(key)
    assert log == f"helios run: error: {expected.value}\n"
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=5)


def test_health_says_failed_and_ready_refuses_once_the_start_failed() -> None:
    readiness = Readiness()
    readiness.fail("loading the core failed: boom")
    with _server(readiness, max_active=1, queue_capacity=1) as (base, _running):
        _assert_unhealthy(base, "failed", "loading the core failed: boom")
        message = "the server failed to start: loading the core failed: boom; retry on another replica"
        _assert_not_ready(httpx.get(base + "/ready", timeout=10), message, closing=True)
    readiness.drain("shutdown began")
    readiness.mark_ready()
    assert (readiness.phase, readiness.reason) == (Phase.FAILED, "loading the core failed: boom")
