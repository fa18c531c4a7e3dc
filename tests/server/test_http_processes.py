"""``helios run --worker-process --http-processes 2``: two HTTP processes on one socket in front of one worker.

A real ``helios run`` subprocess serves a tiny synthetic core (reference backend, two model slots, two queue
places: a bound of four admitted requests) from two HTTP processes. Which process admitted a request is
read from ``helios_http_process_admitted_total{process=...}``, the table the processes share, so every
test sees where its requests landed whichever process answers the scrape. Greedy replies equal the thread
mode's; admission holds exactly four requests over both processes (the fifth is 429 whichever process it
reaches); ``/metrics`` totals are the whole server's in every process; SIGTERM drains both processes and
exits 0; a killed HTTP process has its request cancelled in the worker and stops the run with its exit; a
killed worker ends the open streams of both processes with the same message. The shared table itself is
checked across two spawned processes, and the worker's routing of a decode round per pipe on its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from helios_core.errors import StartupError
from helios_core.runtime.messages import Finished, RoundTokens
from helios_core.runtime.remote import RoundDelivery, from_worker_decoder
from helios_core.runtime.stats import StatsSnapshot
from helios_core.server.app import ServerSettings
from helios_core.server.metrics import EngineCollector, OutputFailures
from helios_core.server.serve import resolve_options, serve
from helios_core.server.server_tally import ServerTally, TallyShare
from tests.server.helpers import BuiltCore, build_synthetic_core, metric_values, sse_events, wait_for

from .conftest import free_port, serve_fixture

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "helios-tests/http-processes"
HI = [{"role": "user", "content": "hi"}]
LONG = {"messages": HI, "max_tokens": 900, "ignore_eos": True, "stream": True}
"""A stream that runs for a while (about a second of generation on one slot)."""
ADMITTED = re.compile(r'^helios_http_process_admitted_total\{process="(\d+)"\} (\S+)$', re.MULTILINE)
READY = re.compile(
    r"^helios run: ready: serving llama-synthetic-tiny at http://127\.0\.0\.1:\d+ \(startup \d+\.\d\d s: "
    r"model loaded \d+\.\d\d s, worker loaded \d+\.\d\d s, warm-up \d+\.\d\d s, "
    r"2 HTTP processes ready \d+\.\d\d s\)$"
)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> BuiltCore:
    return build_synthetic_core(tmp_path_factory.mktemp("http-processes"), NAMESPACE, seed=5)


class Run:
    """A ``helios run`` subprocess and its stderr as it comes."""

    def __init__(self, process: subprocess.Popen[str], port: int, lines: list[str]) -> None:
        self.process = process
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.lines = lines

    def stderr(self) -> str:
        return "".join(self.lines)


@contextmanager
def helios_run(core: BuiltCore, *extra: str) -> Iterator[Run]:
    """``helios run --worker-process --http-processes 2`` on ``core`` (max-active 2, queue-capacity 2)."""
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core.path), "--trust-key",
        str(core.public_key), "--accept", NAMESPACE, "--port", str(port), "--backend", "reference",
        "--max-active", "2", "--queue-capacity", "2", "--worker-process", "--http-processes", "2", *extra,
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert process.stderr is not None
        first = process.stderr.readline()
        lines.append(first)
        assert READY.match(first.rstrip("\n")), first
        stderr = process.stderr

        def read_rest() -> None:
            lines.extend(stderr)

        threading.Thread(target=read_rest, daemon=True).start()
        yield Run(process, port, lines)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def run(core: BuiltCore) -> Iterator[Run]:
    with helios_run(core) as started:
        yield started


def _admitted(base_url: str) -> tuple[int, int]:
    """Requests each HTTP process admitted so far (process 0, process 1)."""
    found = {int(index): int(float(value)) for index, value in ADMITTED.findall(httpx.get(base_url + "/metrics").text)}
    assert set(found) == {0, 1}, found
    return found[0], found[1]


def _children(server_pid: int) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()]


def _socket_inodes(local_port: int, remote_port: int | None = None) -> set[str]:
    """Inodes of the loopback TCP sockets on ``local_port`` (listening when ``remote_port`` is None, else
    connected to ``remote_port``)."""
    inodes: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] != f"0100007F:{local_port:04X}":
            continue
        if (remote_port is None and fields[3] == "0A") or fields[2] == f"0100007F:{remote_port or 0:04X}":
            inodes.add(fields[9])
    return inodes


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    links = {f"socket:[{inode}]" for inode in inodes}
    with contextlib.suppress(FileNotFoundError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in links:
                    return True
    return False


def _roles(run: Run) -> tuple[int, int]:
    """(the other HTTP process, the worker process): of the two spawned children, the one holding the
    listening socket serves HTTP."""
    listening = _socket_inodes(run.port)
    spawned = [pid for pid in _children(run.process.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    (http,) = [pid for pid in spawned if _holds_socket(pid, listening)]
    (worker,) = [pid for pid in spawned if pid != http]
    return http, worker


class Streams:
    """Streams held open (each read to its first chunk: admitted and running or queued) and the HTTP process
    serving each: the one holding the server's end of its connection."""

    def __init__(self, run: Run, stack: contextlib.ExitStack) -> None:
        self.run = run
        self.stack = stack
        self.other, _ = _roles(run)
        self.readers: list[tuple[int, Iterator[bytes], bytes]] = []

    def _open(self, body: dict[str, Any], stack: contextlib.ExitStack) -> tuple[int, Iterator[bytes], bytes]:
        client = stack.enter_context(httpx.Client(timeout=60))
        response = stack.enter_context(client.stream("POST", self.run.base_url + "/v1/chat/completions", json=body))
        assert response.status_code == 200
        chunks = response.iter_bytes()
        first = next(chunks)
        client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
        served_by = _socket_inodes(self.run.port, client_port)
        process = 1 if _holds_socket(self.other, served_by) else 0
        assert process == 1 or _holds_socket(self.run.process.pid, served_by)
        return process, chunks, first

    def open(self, body: dict[str, Any]) -> int:
        """Open one more stream (a fresh connection); the process that serves it."""
        self.readers.append(self._open(body, self.stack))
        return self.readers[-1][0]

    def on_both(self, body: dict[str, Any], width: int = 2, tries: int = 15) -> None:
        """Open ``width`` streams at once, until they are served by both processes (else close them, wait
        until the server holds none, and try again)."""
        for _ in range(tries):
            attempt = contextlib.ExitStack()
            with ThreadPoolExecutor(width) as pool:
                opened = list(pool.map(self._open, [body] * width, [attempt] * width))
            if {process for process, _, _ in opened} == {0, 1}:
                self.stack.push(attempt)
                self.readers += opened
                return
            attempt.close()
            wait_for(lambda: metric_values(self.run.base_url)["helios_http_admitted"] == 0)
        raise AssertionError(f"{tries} times {width} connections all reached one process")

    def read_all(self) -> list[tuple[int, str]]:
        """Each stream's process and text, read to its end (or to where its connection broke off)."""
        texts: list[tuple[int, str]] = []
        for process, chunks, first in self.readers:
            received = [first]
            with contextlib.suppress(httpx.RemoteProtocolError):
                received.extend(chunks)
            texts.append((process, b"".join(received).decode()))
        return texts


def _post(base_url: str, **body: Any) -> httpx.Response:
    body.setdefault("messages", HI)
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)


def test_requests_reach_both_processes_and_greedy_replies_equal_the_thread_mode(core: BuiltCore, run: Run) -> None:
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with serve_fixture(ServerSettings(), core=core.path, trust=core.trust, max_active=2, queue_capacity=2) as thread:
        expected = _post(thread.base_url, **body).json()["choices"][0]
    assert len(expected["token_ids"]) == 24
    before = _admitted(run.base_url)
    replies: list[dict[str, Any]] = []
    for _ in range(40):  # each on a fresh connection, until both processes answered some
        replies.append(_post(run.base_url, **body).json()["choices"][0])
        after = _admitted(run.base_url)
        if len(replies) >= 4 and all(after[index] > before[index] for index in (0, 1)):
            break
    after = _admitted(run.base_url)
    assert all(after[index] > before[index] for index in (0, 1)), (before, after)
    assert sum(after) - sum(before) == len(replies)
    for choice in replies:
        assert choice["message"]["content"] == expected["message"]["content"]
        assert choice["token_ids"] == expected["token_ids"]
        assert choice["finish_reason"] == "length"

    with contextlib.ExitStack() as stack:
        streams = Streams(run, stack)
        streams.on_both({**body, "messages": HI, "stream": True, "return_token_ids": False})
        for _, text in streams.read_all():
            events = sse_events(httpx.Response(200, text=text))
            assert events[-1] == (None, "[DONE]")
            chunks = [data for _, data in events[:-1]]
            content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
            assert content == expected["message"]["content"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_admission_holds_exactly_four_requests_over_both_processes(run: Run) -> None:
    served = run.base_url
    with contextlib.ExitStack() as stack:
        streams = Streams(run, stack)
        streams.on_both(LONG)
        while len(streams.readers) < 4:
            streams.open(LONG)
        rejected = metric_values(served)["helios_requests_rejected_total"]
        for _ in range(6):  # each a fresh connection: whichever process it reaches refuses it
            refused = httpx.post(served + "/v1/chat/completions", json=LONG, timeout=30)
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("rate_limit_error", None, 429)
            assert error["message"] == (
                "the server holds its limit of 4 requests (queue_capacity + max_active); retry later"
            )
            assert 1 <= int(refused.headers["retry-after"]) <= 60
        for _ in range(4):  # every process exports the server's figures
            assert metric_values(served)["helios_http_admitted"] == 4
            assert metric_values(served)["helios_requests_rejected_total"] == rejected + 6  # the 429s of both
        wait_for(lambda: metric_values(served)["helios_num_requests_running"] == 2)
        wait_for(lambda: metric_values(served)["helios_num_requests_waiting"] == 2)
    # every stream was closed unread: the permits return in both processes
    wait_for(lambda: metric_values(served)["helios_http_admitted"] == 0)
    wait_for(lambda: metric_values(served)["helios_num_requests_running"] == 0)
    assert _post(served, max_tokens=2).status_code == 200


def test_metrics_totals_are_the_whole_servers_in_every_process(run: Run) -> None:
    served = run.base_url

    def finished(values: dict[str, float]) -> float:
        return values.get('helios_requests_finished_total{reason="length"}', 0.0)

    wait_for(lambda: metric_values(served)["helios_num_requests_running"] == 0)
    before_values = metric_values(served)
    before = _admitted(served)
    count = 12
    for _ in range(count):
        assert _post(served, max_tokens=3, temperature=0, ignore_eos=True).status_code == 200
    after = _admitted(served)
    assert sum(after) - sum(before) == count
    for _ in range(8):  # fresh connections: both processes answer scrapes, each with the server's totals

        def settled() -> bool:
            values = metric_values(served)
            return finished(values) == finished(before_values) + count and values["helios_http_admitted"] == 0

        wait_for(settled)
        values = metric_values(served)
        assert values["helios_requests_received_total"] == before_values["helios_requests_received_total"] + count
        assert _admitted(served) == after


def test_sigterm_drains_both_processes_then_stops_the_worker(core: BuiltCore) -> None:
    with helios_run(core, "--shutdown-timeout", "20") as run, contextlib.ExitStack() as stack:
        other, worker = _roles(run)
        streams = Streams(run, stack)
        streams.on_both(LONG)
        run.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(run.base_url + "/ready").status_code == 503)
        for _ in range(4):  # draining, still listening: either process refuses new work
            assert httpx.get(run.base_url + "/ready").status_code == 503
        for _, text in streams.read_all():
            events = sse_events(httpx.Response(200, text=text))
            assert events[-1] == (None, "[DONE]")
            assert events[-2][1]["choices"][0]["finish_reason"] == "length"
        assert run.process.wait(timeout=30) == 0
        for pid in (other, worker):
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
        assert "Traceback" not in run.stderr()


def test_a_killed_http_process_has_its_request_cancelled_and_stops_the_run(core: BuiltCore) -> None:
    with helios_run(core, "--shutdown-timeout", "20") as run, contextlib.ExitStack() as stack:
        other, worker = _roles(run)
        cancelled = 'helios_requests_finished_total{reason="cancelled"}'
        streams = Streams(run, stack)
        streams.on_both(LONG)

        def only_ours_active() -> bool:  # any attempt on_both closed has ended and is counted
            values = metric_values(run.base_url)
            return values["helios_requests_active"] + values["helios_requests_waiting"] == 2

        wait_for(only_ours_active)
        before = metric_values(run.base_url).get(cancelled, 0.0)
        os.kill(other, signal.SIGKILL)
        # the worker cancels the dead process's request; the other process drains its own and answers scrapes
        wait_for(lambda: metric_values(run.base_url).get(cancelled, 0.0) == before + 1)
        for process, text in streams.read_all():
            if process == 0:
                events = sse_events(httpx.Response(200, text=text))
                assert events[-1] == (None, "[DONE]")
            else:
                assert "[DONE]" not in text
        assert run.process.wait(timeout=30) == 1
        stderr = run.stderr()
        lost = f"HTTP process 1 (pid {other}) exited unexpectedly (signal 9)"
        assert f"helios run: error: {lost}; the server stops\n" in stderr
        assert stderr.endswith(f"helios run: error: serving stopped: {lost}\n")
        assert "Traceback" not in stderr
        assert not Path(f"/proc/{worker}").exists() or _zombie(worker)


def test_a_killed_worker_ends_the_streams_of_both_processes_and_stops_the_run(core: BuiltCore) -> None:
    with helios_run(core) as run, contextlib.ExitStack() as stack:
        _, worker = _roles(run)
        streams = Streams(run, stack)
        streams.on_both(LONG)
        os.kill(worker, signal.SIGKILL)
        for _, text in streams.read_all():
            name, data = sse_events(httpx.Response(200, text=text))[-1]
            assert name == "error"
            assert data["error"] == {
                "message": "the model worker process exited unexpectedly (signal 9)",
                "type": "execution_error",
                "param": None,
                "code": 500,
            }
        assert run.process.wait(timeout=30) == 1
        stderr = run.stderr()
        lost = "the model worker process exited unexpectedly (signal 9)"
        assert f"helios run: error: {lost}; the server stops\n" in stderr
        assert stderr.endswith(f"helios run: error: serving stopped: {lost}\n")
        assert "Traceback" not in stderr


REFUSING_RUN = """
import sys

from helios_core.errors import StartupError
from helios_core.server import worker_process


def refuse(*args, **kwargs):
    raise StartupError("the frontend could not be built here")


# spawned processes import this module again (as __mp_main__): the other HTTP process connects through this
worker_process.connect_worker_process = refuse

if __name__ == "__main__":
    from helios_core.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def test_an_http_process_that_cannot_load_fails_the_start_with_its_reason(core: BuiltCore, tmp_path: Path) -> None:
    script = tmp_path / "refusing_run.py"
    script.write_text(REFUSING_RUN)
    command = [
        sys.executable, str(script), "run", "--core", str(core.path), "--trust-key", str(core.public_key),
        "--accept", NAMESPACE, "--port", str(free_port()), "--backend", "reference", "--worker-process",
        "--http-processes", "2",
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1
    assert finished.stderr.splitlines()[-1] == (
        "helios run: error: HTTP process 1 could not start: the frontend could not be built here"
    )
    assert "Traceback" not in finished.stderr
    assert "ready: serving" not in finished.stderr


def _zombie(pid: int) -> bool:
    return re.search(r"\) Z ", Path(f"/proc/{pid}/stat").read_text()) is not None


def test_the_option_comes_from_the_environment_and_the_config_file_and_is_checked(tmp_path: Path) -> None:
    core = {"core": Path("x.core")}
    assert resolve_options(core, environ={}).http_processes == 1
    assert resolve_options(core, environ={"HELIOS_HTTP_PROCESSES": "4"}).http_processes == 4
    config = tmp_path / "run.toml"
    config.write_text("http-processes = 3\nworker-process = true\n")
    assert resolve_options(core, config, environ={}).http_processes == 3
    assert resolve_options({**core, "http_processes": 2}, config, environ={}).http_processes == 2
    with pytest.raises(StartupError, match=r"^http-processes \(from \$HELIOS_HTTP_PROCESSES\) must be an integer"):
        resolve_options(core, environ={"HELIOS_HTTP_PROCESSES": "many"})
    with pytest.raises(
        StartupError,
        match=r"^--http-processes 2 needs --worker-process \(the HTTP processes share one model worker process\)$",
    ):
        serve(resolve_options({**core, "http_processes": 2}, environ={}), announce=lambda line: None)
    with pytest.raises(StartupError, match=r"^--http-processes must be at least 1, not 0$"):
        serve(resolve_options({**core, "http_processes": 0, "worker_process": True}, environ={}), lambda line: None)


def test_a_taken_port_fails_before_any_process_starts(core: BuiltCore) -> None:
    with contextlib.closing(__import__("socket").socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        options = resolve_options(
            {
                "core": core.path, "trust_key": [core.public_key], "accept": NAMESPACE, "backend": "reference",
                "worker_process": True, "http_processes": 2, "port": port,
            },
            environ={},
        )  # fmt: skip
        with pytest.raises(StartupError, match=rf"^could not listen on 127\.0\.0\.1:{port}: Address already in use$"):
            serve(options, announce=lambda line: None)
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------------------------ the shared table


def _take_and_return(share: TallyShare, index: int, attempts: int, start: Any, results: Any) -> None:
    """In a spawned process: ``attempts`` times, try to take the server's one permit and give it back at once;
    report how many were taken and the most permits the server held while this process held one."""
    tally = ServerTally.attach(share, index)
    start.wait(30)
    taken = most = 0
    for _ in range(attempts):
        if tally.take_permit(1):
            taken += 1
            most = max(most, tally.held())
            tally.return_permit()
    results.put((index, taken, most))
    tally.close()


def test_two_processes_never_hold_the_last_permit_at_once() -> None:
    """Two processes race for a bound of one permit: each takes it many times, never both at once (taking it
    without the file lock lets both through within a few thousand attempts)."""
    tally = ServerTally.create(3)
    try:
        context = multiprocessing.get_context("spawn")
        start, results = context.Event(), context.Queue()
        processes = [
            context.Process(target=_take_and_return, args=(tally.share(), index, 20000, start, results))
            for index in (1, 2)
        ]
        for process in processes:
            process.start()
        start.set()
        found = sorted(results.get(timeout=60) for _ in processes)
        for process in processes:
            process.join(30)
            assert process.exitcode == 0
        assert [(index, most) for index, _, most in found] == [(1, 1), (2, 1)]
        assert all(taken > 0 for _, taken, _ in found)
        assert tally.held() == 0
        assert tally.admitted() == [0, found[0][1], found[1][1]]
    finally:
        tally.close()


def test_permits_of_a_dead_process_are_forgotten_and_its_counts_stay() -> None:
    tally = ServerTally.create(2)
    other = ServerTally.attach(TallyShare(os.dup(tally.share().fd), 2), 1)
    try:
        assert tally.take_permit(3) and other.take_permit(3) and other.take_permit(3)
        assert not tally.take_permit(3) and not other.take_permit(3)
        assert (tally.held(), tally.admitted()) == (3, [1, 2])
        tally.forget(1)  # process 1 died holding two permits
        assert (tally.held(), tally.admitted()) == (1, [1, 2])
        assert tally.take_permit(3)
        assert tally.admitted() == [2, 2]
    finally:
        other.close()
        tally.close()
    assert tally.closed and tally.held() == 0 and not tally.take_permit(1)


def test_output_failures_and_ended_permits_are_summed_over_the_processes() -> None:
    first = ServerTally.create(2)
    second = ServerTally.attach(TallyShare(os.dup(first.share().fd), 2), 1)
    try:
        failures = [OutputFailures(shared=first), OutputFailures(shared=second)]
        failures[0].record("stop")
        failures[1].record("stop")
        failures[1].record("cancelled")
        assert failures[0].moved == {"stop": 1}  # what this process counted
        assert failures[0].counts() == failures[1].counts() == {"stop": 2, "cancelled": 1}
        assert failures[1].total == 3
        snapshot = _snapshot(finished={"stop": 10, "cancelled": 4}, failed=1)
        collector = EngineCollector(lambda: snapshot, lambda: 0, failures[1])
        exported = {sample.name + str(sample.labels): sample.value for f in collector.collect() for sample in f.samples}
        assert exported["helios_requests_finished_total{'reason': 'stop'}"] == 8
        assert exported["helios_requests_finished_total{'reason': 'cancelled'}"] == 3
        assert exported["helios_requests_failed_total{}"] == 4
        first.add_ended(1)
        second.add_ended(1)
        second.add_ended(-1)
        assert first.ended() == second.ended() == 1
        with pytest.raises(ValueError, match=r"^'bogus' is not a finish reason \(stop, length, cancelled\)$"):
            first.record_output_failure("bogus")
    finally:
        second.close()
        first.close()


def _snapshot(**values: Any) -> StatsSnapshot:
    """A statistics snapshot of zeros and empty counts but ``values``."""
    names = StatsSnapshot.__struct_fields__
    required = names[: len(names) - len(StatsSnapshot.__struct_defaults__)]
    fields = {name: {} if name in ("finished", "rounds", "launches") else 0 for name in required}
    return msgspec.convert({**fields, **values}, StatsSnapshot)


# ------------------------------------------------------------------------------ the worker's routing


def _frames(connection: Connection) -> list[Any]:
    decode = from_worker_decoder().decode
    items: list[Any] = []
    while connection.poll(1.0):
        items += decode(connection.recv_bytes())
        if items and isinstance(items[-1], Finished):
            break
    return items


def test_each_pipe_receives_only_its_own_lanes_of_a_decode_round() -> None:
    from helios_core.runtime import remote

    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
    routes = remote._Routes()
    links = [remote._Link(index, worker, routes) for index, (_, worker) in enumerate(pipes)]
    assert routes.claim("a1", links[0]) and routes.claim("b1", links[1]) and routes.claim("a2", links[0])
    assert not routes.claim("a1", links[1])  # an id active on another pipe is refused
    tokens = RoundTokens({"a1": 0, "b1": 1, "a2": 2}, [10, 11, 12], [-0.1, -0.2, -0.3], ["x", "y", "z"])
    later = RoundTokens(tokens.lanes, [20, 21, 22], [-1.0, -2.0, -3.0], None)  # the cohort's next round
    for round_tokens in (tokens, later):  # as the engine puts them: once on every stream of the cohort
        links[0].outbox.put(round_tokens)
        links[1].outbox.put(round_tokens)
        links[0].outbox.put(round_tokens)
    links[0].outbox.put(Finished("a1", "length", 3, 0))
    links[1].outbox.put(Finished("b1", "length", 3, 0))
    first, second = _frames(pipes[0][0]), _frames(pipes[1][0])
    assert first == [
        RoundDelivery(RoundTokens({"a1": 0, "a2": 1}, [10, 12], [-0.1, -0.3], ["x", "z"])),
        RoundDelivery(RoundTokens({"a1": 0, "a2": 1}, [20, 22], [-1.0, -3.0], None)),
        Finished("a1", "length", 3, 0),
    ]
    assert second == [
        RoundDelivery(RoundTokens({"b1": 0}, [11], [-0.2], ["y"])),
        RoundDelivery(RoundTokens({"b1": 0}, [21], [-2.0], None)),
        Finished("b1", "length", 3, 0),
    ]
    # a terminal event frees its id on its own pipe only; the refused claim took nothing from pipe 0
    assert routes.claim("b1", links[0])
    assert not routes.claim("a2", links[1])
    assert sorted(routes.drop(links[0])) == ["a2", "b1"]  # a pipe that ends: what it still had
    assert routes.claim("a2", links[1])
    for link in links:
        link.outbox.put(remote.WorkerStopped())
        link.outbox.close()
