"""``helios run`` as a subprocess: readiness, graceful SIGTERM, startup failures, option precedence."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helios_core.errors import StartupError
from helios_core.server.serve import resolve_options
from tests.server.conftest import CORE, KEYS, NAMESPACE, free_port

ROOT = Path(__file__).resolve().parents[2]


def _helios(*args: str) -> list[str]:
    return [sys.executable, "-m", "helios_core.cli", "run", *args]


def test_run_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    process = subprocess.Popen(
        _helios(
            "--core",
            str(CORE),
            "--trust-key",
            str(KEYS / "signing.pub.pem"),
            "--accept",
            NAMESPACE,
            "--port",
            str(port),
            "--backend",
            "reference",
            "--alias",
            "tiny",
        ),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "ready" in line and "llama-synthetic-tiny, tiny" in line and f"127.0.0.1:{port}" in line
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=10,
        )
        assert response.status_code == 200
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=8) == 0
        assert time.monotonic() - started < 6
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


READY = re.compile(
    r"^helios run: ready: serving (?P<names>.+) at (?P<url>http://\S+) "
    r"\(startup (?P<startup>\d+\.\d\d) s: model loaded (?P<model>\d+\.\d\d) s, warm-up (?P<warm>\d+\.\d\d) s\)$"
)


def test_the_readiness_line_reports_the_startup_time_and_its_phases() -> None:
    port = free_port()
    command = _helios(
        "--core", str(CORE), "--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE, "--port",
        str(port), "--backend", "reference",
    )  # fmt: skip
    began = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline().rstrip("\n")
        elapsed = time.monotonic() - began
        match = READY.match(line)
        assert match is not None, line
        assert (match["names"], match["url"]) == ("llama-synthetic-tiny", f"http://127.0.0.1:{port}")
        startup, model, warm = (float(match[name]) for name in ("startup", "model", "warm"))
        assert model > 0 and warm >= 0
        assert model + warm <= startup + 0.01  # both phases lie within the startup (each rounded)
        assert startup <= elapsed
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=8) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_run_with_a_bad_trust_key_exits_1_with_one_line() -> None:
    result = subprocess.run(
        _helios("--core", str(CORE), "--trust-key", str(KEYS / "core.key"), "--accept", NAMESPACE),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("helios run: error:")


def test_run_with_a_wrong_acceptance_exits_1() -> None:
    result = subprocess.run(
        _helios("--core", str(CORE), "--trust-key", str(KEYS / "signing.pub.pem"), "--accept", "someone/else"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1


def test_option_precedence(tmp_path: Path) -> None:
    config = tmp_path / "helios.toml"
    config.write_text('core = "from-config.core"\nmax-active = 3\nport = 9001\nalias = ["a", "b"]\n')
    environ = {"HELIOS_MAX_ACTIVE": "1", "HELIOS_QUEUE_CAPACITY": "7", "HELIOS_PORT": "9000", "HELIOS_HOST": "0.0.0.0"}
    options = resolve_options({"port": 9002, "core": None, "alias": None}, config, environ)
    assert options.port == 9002  # explicit over config
    assert options.max_active == 3  # config over environment
    assert options.queue_capacity == 7  # environment over default
    assert options.host == "0.0.0.0"
    assert options.core == Path("from-config.core")
    assert options.alias == ("a", "b")
    assert options.frontend_workers is None  # the core's default


def test_config_errors_are_startup_errors(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("colour = 3\n")
    with pytest.raises(StartupError, match="unknown option"):
        resolve_options({"core": Path("x")}, config, {})
    with pytest.raises(StartupError, match="integer"):
        resolve_options({"core": Path("x")}, None, {"HELIOS_PORT": "eighty"})
    with pytest.raises(StartupError, match="no core"):
        resolve_options({}, None, {})
    config.write_text("max-active = 2\nmax_active = 3\n")
    with pytest.raises(StartupError, match="option 'max-active' is set twice"):
        resolve_options({"core": Path("x")}, config, {})
    for aliases in ("a,,b", "a,", " ,a"):
        with pytest.raises(StartupError, match=r"names an empty alias .*none may be empty or blank"):
            resolve_options({"core": Path("x")}, None, {"HELIOS_ALIAS": aliases})
    assert resolve_options({"core": Path("x")}, None, {"HELIOS_ALIAS": " a , b "}).alias == ("a", "b")


def test_a_prefill_chunk_below_every_prefill_program_exits_1_with_one_line() -> None:
    trust = ("--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE)
    result = subprocess.run(
        _helios("--core", str(CORE), *trust, "--port", "0", "--backend", "reference", "--prefill-chunk", "8"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "helios run: error: --prefill-chunk 8 leaves no prefill program: the core's smallest computes 16 tokens"
    ]


def _run_once(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    trust = ("--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE)
    return subprocess.run(
        _helios("--core", str(CORE), *trust, "--backend", "reference", *args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--port", "70000"), "--port must be between 0 and 65535, not 70000"),
        (("--port", "-1"), "--port must be between 0 and 65535, not -1"),
        (("--served-name", ""), "--served-name and --alias must name the model, not be empty"),
        (("--alias", " "), "--served-name and --alias must name the model, not be empty"),
        (("--ranks", "0"), "--ranks must be at least 1, not 0"),
        (("--host", "no.such.host.invalid"), "could not listen on no.such.host.invalid:8000: "),
    ],
)
def test_an_address_or_name_that_cannot_serve_exits_1_with_one_line(args: tuple[str, ...], message: str) -> None:
    result = _run_once(*args)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"helios run: error: {message}"), line


@pytest.mark.parametrize("worker_process", [False, True])
def test_a_taken_port_exits_1_naming_the_address(worker_process: bool) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _run_once("--port", str(port), *(("--worker-process",) if worker_process else ()))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"helios run: error: could not listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_port_0_serves_on_the_port_the_system_chose_and_names_it() -> None:
    trust = ("--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE)
    command = _helios("--core", str(CORE), *trust, "--port", "0", "--backend", "reference")
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    with _stopped_at_the_end(process):
        assert process.stderr is not None
        match = READY.match(process.stderr.readline().strip())
        assert match is not None
        port = int(match["url"].rsplit(":", 1)[1])
        assert port != 0
        assert httpx.get(f"{match['url']}/v1/models", timeout=10).json()["data"][0]["id"] == "llama-synthetic-tiny"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=8) == 0


@contextlib.contextmanager
def _stopped_at_the_end(process: subprocess.Popen[str]) -> Iterator[None]:
    """Kill ``process`` after the block if it is still running (a failed assertion left it serving)."""
    try:
        yield
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class _StartedServer:
    """A stand-in for the uvicorn server: it started, served nothing, and ended (the core never loaded)."""

    started = True
    startup_failure = None

    def __init__(self, forced_by: int | None, then: object = None) -> None:
        self.forced_by = forced_by
        self._then = then

    def run(self, sockets: object = None) -> None:
        if callable(self._then):
            self._then()


def _watchdog(action: Any) -> threading.Timer:
    timer = threading.Timer(6.0, action)
    timer.daemon = True
    return timer


def _run_options() -> object:
    from helios_core.server.serve import RunOptions

    return RunOptions(
        core=CORE, trust_key=(KEYS / "signing.pub.pem",), accept=NAMESPACE, backend="reference", port=0
    )


def test_a_second_signal_while_the_core_loads_interrupts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from helios_core.server import serve as serve_module

    def server(*args: object, warm_up: Any, **kwargs: object) -> _StartedServer:
        # a watchdog: were the second signal not acted on, the load step "ends" later and serve returns
        return _StartedServer(signal.SIGINT, _watchdog(warm_up.__self__.finished.set).start)

    monkeypatch.setattr(serve_module, "draining_server", server)
    with pytest.raises(KeyboardInterrupt):
        serve_module.serve(_run_options(), announce=lambda line: None)  # type: ignore[arg-type]


def test_a_signal_while_the_interrupted_load_ends_interrupts_whatever_the_inherited_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from helios_core.server import serve as serve_module

    def server(*args: object, warm_up: Any, **kwargs: object) -> _StartedServer:
        def signal_soon() -> None:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            # a watchdog: were the signal ignored, the load step "ends" later and serve returns
            _watchdog(warm_up.__self__.finished.set).start()

        return _StartedServer(None, signal_soon)

    monkeypatch.setattr(serve_module, "draining_server", server)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts
    try:
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            serve_module.serve(_run_options(), announce=lambda line: None)  # type: ignore[arg-type]
        assert time.monotonic() - started < 5
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_readiness_url_brackets_an_ipv6_host() -> None:
    from helios_core.server.serve import _url

    assert _url("::1", 8000) == "http://[::1]:8000"
    assert _url("fe80::1%eth0", 80) == "http://[fe80::1%eth0]:80"
    assert _url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert _url("localhost", 8000) == "http://localhost:8000"
