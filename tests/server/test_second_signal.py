"""A second SIGTERM or SIGINT during ``helios run``'s drain: the process exits 0 at once, its log stays one
``helios run: LEVEL: message`` line per record (no uvicorn or Litestar traceback from the lifespan the
forced close skipped), and each dropped request's line says that a second signal ended the drain, and
after how long, never that its response ran past the drain period.

Eight streams of 1000 tokens on one model slot keep the server busy far past the 0.3 s between the two
signals; the 30 s drain period is never reached. A unit test covers what a signal does once the server
stopped (:class:`~helios_core.server.serve._ClosingSignals`), when other HTTP processes may still drain.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helios_core.server import serve
from tests.server.helpers import build_synthetic_core

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "helios-tests/second-signal"
STREAMS = 8
DRAIN = 30
LINE = re.compile(r"helios run: (debug|info|warning|error|critical): \S.*")
DROPPED = re.compile(
    r"helios run: warning: request (chatcmpl-[0-9a-f]+) dropped before it finished: the server shut down: a second "
    rf"signal ended the drain after (\d+\.\d) s of its {DRAIN} s period"
)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    built = build_synthetic_core(tmp_path_factory.mktemp("second-signal"), NAMESPACE, seed=5)
    yield built.path, built.public_key


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_the_drain_at_once_with_one_line_per_record(
    core: tuple[Path, Path], signum: signal.Signals
) -> None:
    path, public_key = core
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(path), "--trust-key", str(public_key),
        "--accept", NAMESPACE, "--port", str(port), "--backend", "reference", "--max-active", "1",
        "--queue-capacity", str(STREAMS), "--shutdown-timeout", str(DRAIN),
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        ready = process.stderr.readline()
        assert ready.startswith("helios run: ready: serving"), ready
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        opened = threading.Semaphore(0)

        def read() -> None:
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30) as r:
                    chunks = r.iter_bytes()
                    next(chunks)  # the opening chunk: the request is admitted
                    opened.release()
                    for _ in chunks:
                        pass
            except httpx.HTTPError:  # the forced close cuts the stream
                pass

        readers = [threading.Thread(target=read, daemon=True) for _ in range(STREAMS)]
        for reader in readers:
            reader.start()
        for _ in range(STREAMS):
            assert opened.acquire(timeout=30)
        signalled = time.monotonic()
        process.send_signal(signum)
        time.sleep(0.3)
        process.send_signal(signum)
        assert process.wait(timeout=10) == 0
        assert time.monotonic() - signalled < 3
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = log.splitlines()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert all(LINE.fullmatch(line) for line in lines), log
    dropped = [match for line in lines if (match := DROPPED.fullmatch(line))]
    assert dropped, log  # the streams still queued or running were dropped, each with its one line
    assert len({match.group(1) for match in dropped}) == len(dropped) == len(lines)
    assert all(0.1 <= float(match.group(2)) < 3 for match in dropped), log


def test_a_signal_after_the_server_stopped_forces_the_other_processes_or_ends_a_load_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forced = threading.Event()
    signals = serve._ClosingSignals()
    signals(signal.SIGTERM, None)  # uvicorn re-raising what it handled while serving: ignored
    signals.served = True
    signals.stopped(forced.set)
    signals(signal.SIGTERM, None)  # while the other HTTP processes still drain: they close at once
    assert forced.wait(5)

    alone = serve._ClosingSignals()
    alone.served = True
    alone.stopped(None)
    alone(signal.SIGINT, None)  # nothing else drains: ignored, the close goes on and exits 0

    ended: list[int] = []

    def end_at_once(signum: int, frame: object) -> None:
        ended.append(signum)

    monkeypatch.setattr(serve, "_end_at_once", end_at_once)
    loading = serve._ClosingSignals()
    loading.stopped(forced.set)
    loading(signal.SIGTERM, None)  # stopped while the core loaded: the process ends at once, as before
    assert ended == [signal.SIGTERM]
