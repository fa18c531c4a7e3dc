"""``helios run --worker-process``: the model worker in its own process behind the same HTTP behaviour.

A real ``helios run`` subprocess serves a tiny synthetic core (reference backend, 1024-token context,
two model slots, two queue places) with the worker in a process of its own. Greedy replies equal those
of the thread mode on the same core; stops, structured output, admission (429 at exactly
``queue_capacity + max_active``), cancellation on disconnect and the ``/metrics`` gauges behave as in
the thread mode; killing the worker process ends open streams with ``execution_error`` and turns
``/health`` 503; SIGTERM drains admitted requests before the worker stops. At startup the worker
process starts before the core is verified in the server process: every failure ordering leaves no
worker process alive and nothing open, and the readiness line reports the startup phases.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import httpx
import pytest

from helios_core.contract import LoadOptions
from helios_core.errors import ContractError, StartupError, TrustError
from helios_core.frontend.structured import GrammarCompiler
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.server import worker_process
from helios_core.server.app import ServerSettings
from helios_core.server.serve import RunOptions, resolve_options, serve
from tests.server.helpers import BuiltCore, build_synthetic_core, metric_values, sse_events, wait_for

from .conftest import free_port, serve_fixture

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "helios-tests/worker-process"
HI = [{"role": "user", "content": "hi"}]
LONG = {"messages": HI, "max_tokens": 900, "ignore_eos": True, "stream": True}
"""A stream that runs for a while (about a second of generation on one slot)."""


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> BuiltCore:
    return build_synthetic_core(tmp_path_factory.mktemp("worker-process"), NAMESPACE, seed=5)


@contextmanager
def helios_run(core: BuiltCore, *extra: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``helios run --worker-process`` on ``core`` (max-active 2, queue-capacity 2): (process, base url)."""
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core.path), "--trust-key",
        str(core.public_key), "--accept", NAMESPACE, "--port", str(port), "--backend", "reference",
        "--max-active", "2", "--queue-capacity", "2", "--worker-process", *extra,
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert line.startswith("helios run: ready: serving"), line
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def served(core: BuiltCore) -> Iterator[str]:
    with helios_run(core) as (_, base_url):
        yield base_url


def _post(base_url: str, **body: Any) -> httpx.Response:
    body.setdefault("messages", HI)
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)


def _worker_pid(server_pid: int) -> int:
    """The spawned model worker's process id (the server's child that runs ``spawn_main``)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return int(child)
    raise AssertionError(f"no worker process among {children}")


def test_greedy_replies_equal_the_thread_mode_in_json_and_sse(core: BuiltCore, served: str) -> None:
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with serve_fixture(ServerSettings(), core=core.path, trust=core.trust, max_active=2, queue_capacity=2) as thread:
        expected = _post(thread.base_url, **body).json()["choices"][0]
    reply = _post(served, **body)
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == expected["message"]["content"]
    assert choice["token_ids"] == expected["token_ids"]
    assert len(choice["token_ids"]) == 24
    assert choice["finish_reason"] == "length"

    stream = _post(served, **{**body, "stream": True, "return_token_ids": False})
    assert stream.status_code == 200
    events = sse_events(stream)
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _, data in events[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert text == expected["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_string_stop(served: str) -> None:
    text = _post(served, max_tokens=20, temperature=0, ignore_eos=True).json()["choices"][0]["message"]["content"]
    stop = text[2:4]
    choice = _post(served, max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert choice["message"]["content"] == text[: text.find(stop)]
    assert choice["finish_reason"] == "stop"


def test_structured_output_is_compiled_in_the_worker(served: str) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    documents = []
    for seed in range(4):
        choice = _post(served, max_tokens=40, seed=seed, temperature=1, response_format=fmt).json()["choices"][0]
        if choice["finish_reason"] == "stop":
            documents.append(json.loads(choice["message"]["content"]))
    assert documents, "no seed finished within the output limit"
    assert all(set(doc) == {"a"} and isinstance(doc["a"], int) for doc in documents)
    bad = _post(
        served, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_admission_limit_gauges_and_cancellation_on_disconnect(served: str) -> None:
    before = metric_values(served).get('helios_requests_finished_total{reason="cancelled"}', 0.0)
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as stack:
        readers = []  # held: a reader that is collected closes its connection (a disconnect)
        for _ in range(4):  # queue_capacity 2 + max_active 2
            response = stack.enter_context(client.stream("POST", served + "/v1/chat/completions", json=LONG))
            assert response.status_code == 200
            readers.append(response.iter_bytes())
            next(readers[-1])  # the opening chunk: admitted and running or queued
        refused = httpx.post(served + "/v1/chat/completions", json=LONG, timeout=30)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("rate_limit_error", None, 429)
        assert metric_values(served)["helios_http_admitted"] == 4

        def gauges_show_the_load() -> bool:
            values = metric_values(served)
            return (
                values["helios_num_requests_running"] == 2
                and values["helios_num_requests_waiting"] == 2
                and values["helios_kv_cache_usage_ratio"] > 0
            )

        wait_for(gauges_show_the_load)
    # every stream was closed unread: each request is cancelled in the worker
    wait_for(lambda: metric_values(served).get('helios_requests_finished_total{reason="cancelled"}', 0.0) == before + 4)
    values = metric_values(served)
    assert values["helios_num_requests_running"] == 0
    assert values["helios_num_requests_waiting"] == 0
    assert _post(served, max_tokens=2).status_code == 200


def test_a_killed_worker_ends_open_streams_and_stops_the_run(core: BuiltCore) -> None:
    """The open stream ends with the exit as its error event, and the run logs the exit, stops serving and
    fails (exit status 1), so that a supervisor restarts the replica; the worker is never replaced."""
    with helios_run(core) as (process, base_url):
        assert httpx.get(base_url + "/health").json() == {"status": "ok", "model": "llama-synthetic-tiny"}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=LONG, timeout=30) as response:
            chunks = response.iter_bytes()
            first = next(chunks)
            os.kill(_worker_pid(process.pid), signal.SIGKILL)
            text = (first + b"".join(chunks)).decode()
        name, data = sse_events(httpx.Response(200, text=text))[-1]
        assert name == "error"
        assert data["error"] == {
            "message": "the model worker process exited unexpectedly (signal 9)",
            "type": "execution_error",
            "param": None,
            "code": 500,
        }
        assert process.wait(timeout=30) == 1
        assert process.stderr is not None
        stderr = process.stderr.read()
        lost = "the model worker process exited unexpectedly (signal 9)"
        assert f"helios run: error: {lost}; the server stops\n" in stderr
        assert stderr.endswith(f"helios run: error: serving stopped: {lost}\n")
        assert "Traceback" not in stderr


def test_sigterm_drains_admitted_streams_then_stops_the_worker(core: BuiltCore) -> None:
    with helios_run(core, "--shutdown-timeout", "20") as (process, base_url):
        worker = _worker_pid(process.pid)
        body = {**LONG, "max_tokens": 300}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=30) as response:
            chunks = response.iter_bytes()
            first = next(chunks)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            assert httpx.get(base_url + "/ready").status_code == 503  # draining, still listening
            text = (first + b"".join(chunks)).decode()
        events = sse_events(httpx.Response(200, text=text))
        assert events[-1] == (None, "[DONE]")
        assert events[-2][1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=20) == 0
        assert not Path(f"/proc/{worker}").exists() or _zombie(worker)
        assert process.stderr is not None
        assert "Traceback" not in process.stderr.read()


def _zombie(pid: int) -> bool:
    return re.search(r"\) Z ", Path(f"/proc/{pid}/stat").read_text()) is not None


def test_the_option_comes_from_the_environment_and_the_config_file(tmp_path: Path) -> None:
    from helios_core.server.serve import resolve_options

    core = {"core": Path("x.core")}
    assert resolve_options(core, environ={}).worker_process is False
    assert resolve_options(core, environ={"HELIOS_WORKER_PROCESS": "true"}).worker_process is True
    config = tmp_path / "run.toml"
    config.write_text("worker-process = true\n")
    assert resolve_options(core, config, environ={}).worker_process is True
    with pytest.raises(StartupError, match=r"^worker-process \(from \$HELIOS_WORKER_PROCESS\) must be a boolean$"):
        resolve_options(core, environ={"HELIOS_WORKER_PROCESS": "maybe"})


READY = re.compile(
    r"^helios run: ready: serving (?P<names>.+) at (?P<url>http://\S+) \(startup (?P<startup>\d+\.\d\d) s: "
    r"model loaded (?P<model>\d+\.\d\d) s, worker loaded (?P<worker>\d+\.\d\d) s, warm-up (?P<warm>\d+\.\d\d) s\)$"
)


def test_the_readiness_line_reports_the_startup_phases_of_the_worker_process(core: BuiltCore) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core.path), "--trust-key",
        str(core.public_key), "--accept", NAMESPACE, "--port", str(port), "--backend", "reference",
        "--worker-process",
    ]  # fmt: skip
    began = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline().rstrip("\n")
        elapsed = time.monotonic() - began
        match = READY.match(line)
        assert match is not None, line
        assert (match["names"], match["url"]) == ("llama-synthetic-tiny", f"http://127.0.0.1:{port}")
        startup, model, worker, warm = (float(match[name]) for name in ("startup", "model", "worker", "warm"))
        assert 0 < worker <= model  # the worker's own load is part of the wait for it
        assert model + warm <= startup + 0.01  # both phases lie within the startup (each rounded)
        assert startup <= elapsed
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _spawned_workers() -> list[str]:
    return [child.name for child in multiprocessing.active_children()]


def test_a_core_that_fails_verification_here_stops_the_running_worker(
    core: BuiltCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker process is started before the core is verified here; a verification error here is
    raised as it is and the worker process is killed and joined."""
    running: list[BaseProcess] = []
    refused = TrustSettings(core.trust.trust_keys, "helios-tests/someone-else", None)

    def open_core_while_the_worker_loads(path: Path, settings: TrustSettings, **options: Any) -> VerifiedCore:
        running.extend(multiprocessing.active_children())
        return open_core(path, refused, **options)  # the worker process itself accepts the core

    monkeypatch.setattr(worker_process, "open_core", open_core_while_the_worker_loads)
    with pytest.raises(TrustError) as raised:
        worker_process.start_worker_process(core.path, core.trust, LoadOptions(), backend="reference")
    with pytest.raises(TrustError) as direct:
        open_core(core.path, refused, check_resources=False)
    assert str(raised.value) == str(direct.value)
    assert [process.name for process in running] == ["helios-model-worker"]
    assert not running[0].is_alive() and running[0].exitcode is not None  # killed and joined
    assert _spawned_workers() == []


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[VerifiedCore]:
    """Every core the server side of the worker process opens, kept to check that it was closed."""
    cores: list[VerifiedCore] = []

    def open_core_and_keep(path: Path, settings: TrustSettings, **options: Any) -> VerifiedCore:
        cores.append(open_core(path, settings, **options))
        return cores[-1]

    monkeypatch.setattr(worker_process, "open_core", open_core_and_keep)
    return cores


def test_a_failure_here_after_verifying_stops_the_worker_and_closes_the_core(
    core: BuiltCore, monkeypatch: pytest.MonkeyPatch, opened: list[VerifiedCore]
) -> None:
    def no_compiler(*args: Any, **kwargs: Any) -> GrammarCompiler:
        raise ContractError("structured output needs at least one EOS token id")

    monkeypatch.setattr(worker_process, "GrammarCompiler", no_compiler)
    with pytest.raises(ContractError, match=r"^structured output needs at least one EOS token id$"):
        worker_process.start_worker_process(core.path, core.trust, LoadOptions(), backend="reference")
    assert len(opened) == 1 and opened[0].core._fd is None  # closed
    assert _spawned_workers() == []


def test_a_worker_that_fails_to_start_names_its_reason_and_closes_what_was_opened_here(
    core: BuiltCore, opened: list[VerifiedCore]
) -> None:
    with pytest.raises(StartupError) as raised:
        worker_process.start_worker_process(core.path, core.trust, LoadOptions(), backend="bogus")
    assert str(raised.value) == (
        "the model worker process could not start: backend 'bogus' is not available; use auto, reference or cuda"
    )
    assert len(opened) == 1 and opened[0].core._fd is None  # verified here first, then closed
    assert _spawned_workers() == []


def test_the_worker_reports_its_own_load_time_when_ready(core: BuiltCore) -> None:
    began = time.monotonic()
    running = worker_process.start_worker_process(core.path, core.trust, LoadOptions(), backend="reference")
    try:
        elapsed = time.monotonic() - began
        assert running.worker_load_seconds is not None
        assert 0 < running.worker_load_seconds < elapsed
    finally:
        running.close()
    assert _spawned_workers() == []


def _run_options(core: BuiltCore) -> RunOptions:
    return resolve_options(
        {
            "core": core.path, "trust_key": [core.public_key], "accept": NAMESPACE, "backend": "reference",
            "worker_process": True, "port": free_port(),
        },
        environ={},
    )  # fmt: skip


def test_helios_run_starts_the_worker_process_before_it_builds_the_http_server(
    core: BuiltCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker process already loads while the app is built; a failure there stops it (no orphan)."""
    from helios_core.server import app

    running: list[str] = []

    def no_app(readiness: Any) -> Any:
        running.extend(_spawned_workers())
        raise RuntimeError("the app could not be built")

    monkeypatch.setattr(app, "create_pending_app", no_app)
    with pytest.raises(RuntimeError, match=r"^the app could not be built$"):
        serve(_run_options(core), announce=lambda line: None)
    assert running == ["helios-model-worker"]
    assert _spawned_workers() == []


def test_a_worker_process_the_load_step_never_took_is_stopped(core: BuiltCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that does not listen never runs the load step: closing the loader stops the worker process."""
    from helios_core.server import serve as serve_module

    running: list[str] = []

    class NotListening:
        started = False
        startup_failure = None

        def run(self, sockets: object = None) -> None:
            running.extend(_spawned_workers())

    monkeypatch.setattr(serve_module, "draining_server", lambda *args, **kwargs: NotListening())
    with pytest.raises(StartupError, match=r"^could not listen on 127\.0\.0\.1:\d+$"):
        serve(_run_options(core), announce=lambda line: None)
    assert running == ["helios-model-worker"]
    assert _spawned_workers() == []
