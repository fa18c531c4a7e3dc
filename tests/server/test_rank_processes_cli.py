"""``helios run --rank-listen`` and ``helios rank`` as processes: joining with the shared secret, serving,
a killed rank ending serving with a clear error, a killed leader ending its rank processes, and the option
checks made before anything listens."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helios_core.cli import main
from helios_core.errors import StartupError
from helios_core.server.serve import resolve_options
from tests.server.conftest import FIXTURES, KEYS, NAMESPACE, free_port

ROOT = Path(__file__).resolve().parents[2]
TP2 = FIXTURES / "tp2-tiny.core"
DEADLINE_S = 15.0
"""The longest any step of these tests waits (a hang fails the test instead of stalling it)."""
TRUST = ("--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE)


def secret_file(directory: Path, content: bytes = b"the rank secret", mode: int = 0o600) -> Path:
    path = directory / f"secret-{mode:o}-{len(content)}"
    path.write_bytes(content)
    path.chmod(mode)
    return path


class Process:
    """A ``helios`` subprocess whose stderr lines are collected as they come."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "helios_core.cli", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, text: str) -> str:
        ends = time.monotonic() + DEADLINE_S
        while time.monotonic() < ends:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        pytest.fail(f"no line with {text!r} within {DEADLINE_S} s: {self.lines}")

    def finish(self) -> int:
        try:
            status = self.popen.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            pytest.fail(f"the process did not end within {DEADLINE_S} s: {self.lines}")
        self._reader.join(DEADLINE_S)
        return status


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    spawned: list[Process] = []
    yield spawned
    for process in spawned:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()


def leader(port: int, rank_port: int, secret: Path) -> Process:
    return Process(
        "run", "--core", str(TP2), *TRUST, "--backend", "reference", "--port", str(port),
        "--rank-listen", f"127.0.0.1:{rank_port}", "--rank-secret-file", str(secret),
        "--rank-join-timeout", str(DEADLINE_S),
    )  # fmt: skip


def rank(rank_port: int, secret: Path) -> Process:
    return Process(
        "rank", "--core", str(TP2), *TRUST, "--join", f"127.0.0.1:{rank_port}", "--rank", "1",
        "--rank-secret-file", str(secret), "--rank-join-timeout", str(DEADLINE_S),
    )  # fmt: skip


def test_a_rank_without_the_secret_is_refused_the_right_one_serves_and_its_death_ends_serving(
    tmp_path: Path, processes: list[Process]
) -> None:
    port, rank_port = free_port(), free_port()
    secret = secret_file(tmp_path)
    processes.append(served := leader(port, rank_port, secret))
    processes.append(intruder := rank(rank_port, secret_file(tmp_path, b"a guessed secret")))
    assert intruder.finish() == 1
    assert intruder.lines[-1] == (
        f"helios rank: error: the leader at 127.0.0.1:{rank_port} does not hold the shared secret (authentication "
        "failed); check --rank-secret-file"
    )
    refusal = served.wait_for_line("refused a rank process")
    assert refusal.startswith("helios run: warning: refused a rank process from 127.0.0.1:")
    assert refusal.endswith(
        ": a peer claiming rank 1 hung up on the leader's proof: it holds another secret (authentication failed)"
    )
    processes.append(joined := rank(rank_port, secret))
    ready = served.wait_for_line("ready")
    expected = f"helios run: ready: serving llama-synthetic-tiny at http://127.0.0.1:{port} (startup "
    assert ready.startswith(expected), ready
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
        timeout=DEADLINE_S,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
    joined.popen.send_signal(signal.SIGKILL)
    began = time.monotonic()
    assert served.finish() == 1
    assert time.monotonic() - began < 10.0
    assert served.lines[-1] == (
        "helios run: error: serving stopped: rank 1 disconnected (its process ended or its connection failed)"
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_leader_waits_for_its_ranks_stops_it_at_once(
    tmp_path: Path, processes: list[Process], signum: int
) -> None:
    port = free_port()
    waiting = leader(port, free_port(), secret_file(tmp_path))  # no rank process ever joins
    processes.append(waiting)
    ends = time.monotonic() + DEADLINE_S
    while time.monotonic() < ends:  # listening (and loading) once /ready answers
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 503:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    time.sleep(1.0)  # the load step reaches the wait for the rank processes
    signalled = time.monotonic()
    waiting.popen.send_signal(signum)
    assert waiting.finish() == 0, waiting.lines
    assert time.monotonic() - signalled < DEADLINE_S / 3  # not at the join deadline
    assert not [line for line in waiting.lines if "error" in line], waiting.lines


def test_the_leaders_death_ends_its_rank_process_with_a_clear_error(tmp_path: Path, processes: list[Process]) -> None:
    port, rank_port = free_port(), free_port()
    secret = secret_file(tmp_path)
    processes.append(joined := rank(rank_port, secret))  # it waits for the leader to listen
    processes.append(served := leader(port, rank_port, secret))
    served.wait_for_line("ready")
    joined.wait_for_line("rank 1 loaded; serving")
    served.popen.send_signal(signal.SIGKILL)
    assert joined.finish() == 1
    assert joined.lines[-1] == f"helios rank: error: the leader at 127.0.0.1:{rank_port} closed the connection"


LISTEN = ("--rank-listen", "127.0.0.1:1")
BAD_RUN_OPTIONS = [
    (LISTEN, "--rank-listen needs --rank-secret-file FILE (the secret the rank processes share)"),
    (("--rank-secret-file", "{good}"), "--rank-secret-file is used with --rank-listen HOST:PORT, which is missing"),
    (
        ("--rank-listen", "localhost", "--rank-secret-file", "{good}"),
        "--rank-listen must be HOST:PORT with a port from 1 to 65535, not 'localhost'",
    ),
    (
        (*LISTEN, "--rank-secret-file", "{open}"),
        "--rank-secret-file {open} is accessible by group or others (mode 0644); it must be private to its owner: "
        "chmod 600 {open}",
    ),
    ((*LISTEN, "--rank-secret-file", "{empty}"), "--rank-secret-file {empty} is empty; put a long random secret in it"),
    (
        (*LISTEN, "--rank-secret-file", "{good}", "--worker-process"),
        "--rank-listen cannot be combined with --worker-process",
    ),
    (
        (*LISTEN, "--rank-secret-file", "{good}", "--rank-join-timeout", "0"),
        "--rank-join-timeout must be positive, not 0",
    ),
]


@pytest.mark.parametrize(("options", "message"), BAD_RUN_OPTIONS)
def test_run_refuses_bad_rank_options_before_listening(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: tuple[str, ...], message: str
) -> None:
    files = {
        "good": str(secret_file(tmp_path)),
        "open": str(secret_file(tmp_path, mode=0o644)),
        "empty": str(secret_file(tmp_path, b"")),
    }
    arguments = [option.format(**files) for option in options]
    port = free_port()
    assert main(["run", "--core", str(TP2), *TRUST, "--port", str(port), *arguments]) == 1
    assert capsys.readouterr().err == f"helios run: error: {message.format(**files)}\n"


def test_rank_refuses_a_core_of_one_rank_a_rank_outside_the_core_and_an_open_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, open_secret = secret_file(tmp_path), secret_file(tmp_path, mode=0o640)
    common = ["--join", "127.0.0.1:1", *TRUST]
    one_rank = str(FIXTURES / "payload-v3.core")
    assert main(["rank", "--core", one_rank, "--rank", "1", "--rank-secret-file", str(good), *common]) == 1
    assert capsys.readouterr().err == (
        "helios rank: error: the core has one rank: it runs in the serving process alone, with no rank processes\n"
    )
    assert main(["rank", "--core", str(TP2), "--rank", "2", "--rank-secret-file", str(good), *common]) == 1
    assert capsys.readouterr().err == "helios rank: error: --rank 2 is not one of the core's rank processes 1..1\n"
    assert main(["rank", "--core", str(TP2), "--rank", "1", "--rank-secret-file", str(open_secret), *common]) == 1
    assert capsys.readouterr().err == (
        f"helios rank: error: --rank-secret-file {open_secret} is accessible by group or others (mode 0640); it must "
        f"be private to its owner: chmod 600 {open_secret}\n"
    )


def test_a_rank_joining_an_http_port_is_told_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_http() -> None:  # what a web server says to bytes that are no HTTP request
        connection, _ = server.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    web = threading.Thread(target=answer_http, daemon=True)
    web.start()
    try:
        arguments = ["--join", f"127.0.0.1:{port}", "--rank", "1", "--rank-secret-file", str(secret_file(tmp_path))]
        assert main(["rank", "--core", str(TP2), *TRUST, *arguments, "--rank-join-timeout", "10"]) == 1
    finally:
        web.join(DEADLINE_S)
        server.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the peer answered HTTP, not as a Helios leader or rank" in err, err


def test_rank_options_come_from_the_environment_and_the_config_file(tmp_path: Path) -> None:
    core = {"core": TP2}
    environ = {"HELIOS_RANK_LISTEN": "0.0.0.0:7001", "HELIOS_RANK_SECRET_FILE": "/etc/helios/rank.secret"}
    options = resolve_options({**core, "rank_join_timeout": None}, None, {**environ, "HELIOS_RANK_JOIN_TIMEOUT": "90"})
    assert (options.rank_listen, options.rank_secret_file, options.rank_join_timeout) == (
        "0.0.0.0:7001",
        Path("/etc/helios/rank.secret"),
        90.0,
    )
    assert resolve_options({**core, "rank_listen": "10.0.0.1:7002"}, None, environ).rank_listen == "10.0.0.1:7002"
    with pytest.raises(StartupError) as caught:
        resolve_options(core, None, {"HELIOS_RANK_JOIN_TIMEOUT": "soon"})
    assert (
        str(caught.value)
        == "rank-join-timeout (from $HELIOS_RANK_JOIN_TIMEOUT) must be a number of seconds, not 'soon'"
    )
