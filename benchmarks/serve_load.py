"""Streaming load on the real HTTP server over loopback: throughput, TTFT, ITL and server overhead.

Builds a synthetic tiny core, starts it in-process (uvicorn in a thread on a random free port of
127.0.0.1) once with the null backend and once with the reference backend, and drives it with N
concurrent streaming clients (httpx async, SSE). Per request it records the time to the first
content chunk, the gaps between content chunks (inter-token latency) and the completion tokens from
the final usage chunk. Engine time is measured by wrapping the backend's ``run`` (the sum of launch
durations during the wave); the server and host overhead is ``wall - engine run time`` divided by
the output tokens of the wave. Every loop is bounded in count (``--requests``) and time
(``--timeout``). One run prints one table (rows: backend x clients).

With ``--worker-process`` each backend but ``null`` is served instead by ``helios run`` subprocesses, once
as it is (``helios-run``: the model worker a thread of the server) and once with ``--worker-process``
(the model worker in its own process), so the load generator never shares the server's GIL; the
engine run time is then not measured (``nan``).

    python benchmarks/serve_load.py [--clients 8,32] [--requests 64] [--max-tokens 64] [--timeout 120] \
        [--worker-process]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))

NAMESPACE = "bench/serve"
BACKENDS = ("null", "reference")


def build(directory: Path, max_rows: int) -> tuple[Path, Path]:
    """A tiny synthetic core with decode programs up to ``max_rows`` rows."""
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    keys = generate_keys(directory / "keys")
    core = directory / "serve.core"
    decode_rows = tuple(sorted({r for r in (1, 2, 4, 8, 16, 32, 64, max_rows) if r <= max_rows}))
    caps = Capacities(
        max_rows=max_rows, prefill_tokens=(64, 256), decode_rows=decode_rows, page_tokens=16,
        cache_pages=max(64, max_rows * 12), context=512, snapshots=0,
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=1), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )  # fmt: skip
    return core, keys["public"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class EngineClock:
    """Sum of the backend's ``run`` durations (the worker is one thread; the lock is for readers)."""

    total_ns: int = 0
    launches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter_ns()
            try:
                return run(*args, **kwargs)
            finally:
                elapsed = time.perf_counter_ns() - begin
                with self.lock:
                    self.total_ns += elapsed
                    self.launches += 1

        return timed

    def read(self) -> tuple[int, int]:
        with self.lock:
            return self.total_ns, self.launches


@contextmanager
def serve(core: Path, key: Path, backend: str, max_active: int) -> Iterator[tuple[str, EngineClock | None]]:
    """The real server over ``core`` on a random loopback port; yields its base URL and engine clock."""
    import uvicorn

    from helios_core.contract import LoadOptions
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start
    from helios_core.server.app import create_app

    running = start(
        core, TrustSettings((key,), NAMESPACE, None), LoadOptions(max_active=max_active, queue_capacity=max_active),
        backend=backend,
    )  # fmt: skip
    clock = EngineClock()
    model_backend = running.model.backend
    model_backend.run = clock.wrap(model_backend.run)  # type: ignore[method-assign]
    port = free_port()
    config = uvicorn.Config(create_app(running), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the benchmark server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", clock
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        running.close()


@dataclass
class Sample:
    ttft_s: float
    gaps_s: list[float]
    tokens: int
    status: int


async def one_request(client: Any, url: str, max_tokens: int, index: int) -> Sample:
    body = {
        "messages": [{"role": "user", "content": f"request {index}: tell me a story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    begin = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Sample(float("nan"), [], 0, response.status_code)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        return Sample(float("nan"), [], tokens, response.status_code)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return Sample(arrivals[0] - begin, gaps, tokens, response.status_code)


async def wave(url: str, clients: int, requests: int, max_tokens: int, timeout: float) -> tuple[list[Sample], float]:
    """``requests`` streaming requests, at most ``clients`` at once; (samples, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    samples: list[Sample] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                samples.append(await one_request(client, url, max_tokens, queue.get_nowait()))

        begin = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), timeout)
        wall = time.perf_counter() - begin
    return samples, wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Row:
    backend: str
    clients: int
    ok: int
    requests: int
    tokens: int
    wall_s: float
    engine_s: float
    launches: int
    ttft: list[float]
    itl: list[float]

    def cells(self) -> list[str]:
        ms = 1000.0
        overhead_us = (self.wall_s - self.engine_s) / max(self.tokens, 1) * 1e6
        return [
            self.backend,
            str(self.clients),
            f"{self.ok}/{self.requests}",
            str(self.tokens),
            f"{self.tokens / self.wall_s:.0f}",
            f"{percentile(self.ttft, 0.5) * ms:.1f}",
            f"{percentile(self.ttft, 0.99) * ms:.1f}",
            f"{percentile(self.itl, 0.5) * ms:.2f}",
            f"{percentile(self.itl, 0.99) * ms:.2f}",
            f"{self.wall_s:.2f}",
            f"{self.engine_s:.2f}",
            f"{overhead_us:.0f}",
        ]


HEADERS = [
    "backend", "clients", "ok", "out tokens", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
    "wall s", "engine run s", "overhead µs/token",
]  # fmt: skip


@contextmanager
def serve_subprocess(
    core: Path, key: Path, backend: str, max_active: int, worker_process: bool
) -> Iterator[tuple[str, EngineClock | None]]:
    """``helios run`` over ``core`` as a subprocess (with ``worker_process``: ``--worker-process``); yields its
    base URL and no engine clock (its backend runs in another process)."""
    import subprocess

    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core), "--trust-key", str(key),
        "--accept", NAMESPACE, "--port", str(port), "--backend", backend, "--max-active", str(max_active),
        "--queue-capacity", str(max_active), *(["--worker-process"] if worker_process else []),
    ]  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        if server.stderr is None:
            raise RuntimeError("helios run was started without a stderr pipe")
        line = server.stderr.readline()
        if "ready" not in line:
            raise RuntimeError(line + server.stderr.read())
        threading.Thread(target=server.stderr.read, daemon=True).start()
        yield f"http://127.0.0.1:{port}", None
    finally:
        server.terminate()
        server.wait(timeout=60)


def measure(
    core: Path, key: Path, backend: str, clients: list[int], args: argparse.Namespace, mode: str = "in-process"
) -> list[Row]:
    """One backend's waves; ``mode`` is ``in-process`` (uvicorn in a thread of this process, the engine clock
    read), ``helios-run`` or ``worker-process`` (``helios run`` subprocesses, no engine clock)."""
    rows: list[Row] = []
    if mode == "in-process":
        serving = serve(core, key, backend, max(clients))
    else:
        serving = serve_subprocess(core, key, backend, max(clients), mode == "worker-process")
    label = backend if mode == "in-process" else f"{backend} ({mode})"
    with serving as (url, clock):
        asyncio.run(wave(url, 2, 2, 4, args.timeout))  # warm-up: programs, tokenizer, connections
        for count in clients:
            engine_before, launches_before = clock.read() if clock is not None else (0, 0)
            samples, wall = asyncio.run(wave(url, count, args.requests, args.max_tokens, args.timeout))
            engine_after, launches_after = clock.read() if clock is not None else (0, 0)
            engine_s = (engine_after - engine_before) / 1e9 if clock is not None else float("nan")
            ok = [s for s in samples if s.status == 200]
            row = Row(
                label, count, len(ok), args.requests, sum(s.tokens for s in ok), wall,
                engine_s, launches_after - launches_before,
                [s.ttft_s for s in ok if s.ttft_s == s.ttft_s], [g for s in ok for g in s.gaps_s],
            )  # fmt: skip
            rows.append(row)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "| --- | " + " | ".join("---:" for _ in HEADERS[1:]) + " |"]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="8,32", help="comma-separated concurrent client counts")
    parser.add_argument("--requests", type=int, default=64, help="requests per (backend, clients) wave")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per wave (and per request)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backends")
    parser.add_argument(
        "--worker-process",
        action="store_true",
        help="instead, serve each backend with `helios run` subprocesses, with and without --worker-process "
        "(reference and cuda only: helios run has no null backend)",
    )
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    clients = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    if not clients or min(clients) <= 0 or args.requests <= 0 or args.max_tokens <= 0:
        parser.error("clients, requests and max-tokens must be positive")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        core, key = build(Path(tmp), max(clients))
        for backend in args.backends.split(","):
            if not args.worker_process:
                rows += measure(core, key, backend.strip(), clients, args)
            elif backend.strip() != "null":
                for mode in ("helios-run", "worker-process"):
                    rows += measure(core, key, backend.strip(), clients, args, mode)
    print(
        f"streaming load over loopback, synthetic tiny core, {args.requests} requests x {args.max_tokens} tokens "
        f"per wave, {date.today()}, {platform.machine()} {platform.processor() or ''} "
        f"({os.cpu_count()} CPUs)"
    )
    print(markdown(rows))
    print("overhead µs/token = (wall - engine run time) / output tokens; engine run = sum of backend.run durations")
    print("launches per wave: " + ", ".join(f"{r.backend}/{r.clients}: {r.launches}" for r in rows))
    if statistics.fmean(r.ok / r.requests for r in rows) < 1.0:
        print("warning: some requests did not finish with status 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
