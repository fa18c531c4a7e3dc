"""Fixtures of the HTTP server tests: a real uvicorn server on loopback over a golden fixture core.

The server runs in a background thread (no signal handlers) on a random free port of 127.0.0.1.
``Served.slow`` delays every model launch, so tests can hold requests in flight (admission,
disconnects, mixed constrained/unconstrained decoding) with bounded request counts and times.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.startup import RunningModel, start
from helios_core.server.app import ServerSettings, create_app

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
CORE = FIXTURES / "payload-v3.core"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"
MODEL = "llama-synthetic-tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Served:
    running: RunningModel
    base_url: str
    delay_s: list[float]

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)

    @contextmanager
    def slow(self, seconds: float) -> Iterator[None]:
        """Delay every model launch by ``seconds`` while the block runs."""
        self.delay_s[0] = seconds
        try:
            yield
        finally:
            self.delay_s[0] = 0.0

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.running.engine.statistics()
            if stats.active_requests == 0 and stats.waiting_requests == 0:
                return
            time.sleep(0.02)
        raise TimeoutError("the engine did not become idle")


@contextmanager
def serve_fixture(
    settings: ServerSettings | None = None,
    *,
    core: Path = CORE,
    trust: TrustSettings | None = None,
    **options: Any,
) -> Iterator[Served]:
    trust = trust or TrustSettings((KEYS / "signing.pub.pem",), NAMESPACE, None)
    running = start(core, trust, LoadOptions(**options), backend="reference")
    delay = [0.0]
    backend = running.model.backend
    real_run: Callable[..., Any] = backend.run

    def slowed_run(*args: Any, **kwargs: Any) -> Any:
        if delay[0]:
            time.sleep(delay[0])
        return real_run(*args, **kwargs)

    backend.run = slowed_run  # type: ignore[method-assign]
    port = free_port()
    config = uvicorn.Config(create_app(running, settings), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Served(running, f"http://127.0.0.1:{port}", delay)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        running.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The fixture core with two model slots and two queue places (four admission permits)."""
    with serve_fixture(ServerSettings(aliases=("tiny",)), max_active=2, queue_capacity=2) as value:
        yield value


@pytest.fixture(scope="module")
def smol(smol_core: tuple[Path, Path]) -> Iterator[Served]:
    """The SmolLM2 core of the session (``tests/conftest.py``) served on loopback, for a module's tests."""
    from tests.conftest import SMOL_NAMESPACE

    core, public_key = smol_core
    with serve_fixture(core=core, trust=TrustSettings((public_key,), SMOL_NAMESPACE, None)) as served:
        yield served
