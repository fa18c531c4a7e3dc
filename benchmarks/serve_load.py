"""Streaming load on the real HTTP server beside the engine's own figures: throughput, TTFT, TPOT, token gaps.

One run prints one markdown table, one row per (backend, server mode, clients). For each backend of
``--backends`` it serves one core and drives it with N concurrent streaming clients (SSE, httpx
async) spread over ``--client-processes`` processes (default 8, ``multiprocessing`` spawn, results
gathered to this process; 0 runs the clients in this process; each process makes one request to
``/v1/models`` before the wave starts, so that its first stream does not wait for httpx's transport to
load). Every wave sends ``max(--requests, N)`` chat requests (greedy, ``ignore_eos``, ``--max-tokens``
each), handed to the clients round-robin; each client sends its requests one after the other. Per wave:

* tok/s: the completion tokens of the wave over its wall time (first request sent to last stream
  closed);
* window tok/s: output tokens over the window in which every client streams (from the last client's
  first content chunk to the first client's last one); each content chunk in the window counts for
  its request's ``usage.completion_tokens`` divided by its content chunks (a chunk's text may hold
  several tokens, or a token none);
* TTFT (request sent to first content chunk) p50 and p99;
* TPOT p50 and p99 over the wave's requests of 2 tokens or more: per request, (arrival of its last content
  chunk - arrival of its first) / (its completion tokens - 1);
* gap p50 and p99 over the wave's tokens: the server writes every event queued for a response at once, so
  a client reads several content chunks together; consecutive chunks of one response that arrive within
  ``DELIVERY_GAP_S`` (0.5 ms) of the one before are one delivery, and each delivery after a request's first
  gives each of its tokens (apportioned as for the window) the time since the previous delivery divided by
  its tokens: the gap between tokens as the client sees them, weighted by tokens;
* the engine alone (no HTTP): the same core started in this process, ``N`` concurrent requests of
  the HTTP prompt's length and ``--max-tokens`` new tokens submitted to the engine, decode tokens/s
  over the window in which every request decodes and ms per step (``gpu_decode.py``'s measurement);
  the ratio window tok/s over HTTP / engine tok/s, and TPOT / step (TPOT p50 / engine ms per step).

Server modes (``--modes``): ``in-process`` (uvicorn in a thread of this process; the backend's
``run`` is wrapped so the engine run time and the non-overlapped overhead per token are known),
``worker-process`` and ``thread`` (``helios run`` subprocesses with and without ``--worker-process``;
engine run time not measured). ``--http-processes`` gives the worker-process mode's HTTP process counts
(``helios run --http-processes N``; default 1, ``1,4`` serves it once with each); the table's ``HTTP
processes`` column says the count and, above 1, how many of the wave's requests each process admitted
(``helios_http_process_admitted_total`` before and after the wave: how the kernel spread the clients).
The engine phase runs after the first server. Defaults: clients 8 and 32, 64 tokens, ``in-process``; with
``--backends cuda``: clients 64 and 256, 512 tokens, ``worker-process,thread``.

Cores: without ``--shape`` (and without ``cuda``) a synthetic ``tiny`` core is built in a temporary
folder, decode rows up to the largest client count. With ``--shape`` (default ``1b`` for
``--backends cuda``) the core is the one ``gpu_decode.py`` builds (bf16, targets ``reference,sm_90a``
for cuda, else ``reference``; decode rows 1, 8, 64 and 256 and the client counts; context 1024),
reused from ``--cores DIR`` when it is there, else built in a child process with the kernel cache of
``$IGNITION_KERNEL_CACHE`` (default ``build/kernel-cache``; packed into ``$OUT`` after a build, as
``gpu_decode.py`` does). GPU-only modules are imported by the processes that use them only.

``--budget`` bounds the run (no new phase or wave starts after that many seconds); progress lines
go to stdout; every figure goes to ``--out`` as JSON (default ``$OUT/serve_load.json`` when ``OUT``
is set, else none), rewritten after every wave.

    python benchmarks/serve_load.py [--clients 8,32] [--requests 64] [--max-tokens 64] [--timeout 120] \\
        [--worker-process] [--client-processes 8]
    tools/gpu_run.sh python3 benchmarks/serve_load.py --backends cuda [--shape 1b] [--clients 64,256] \\
        [--cores build/cores] [--budget 240]
    python benchmarks/serve_load.py --backends reference --shape tiny --clients 4 --requests 8 \\
        --max-tokens 16 --client-processes 2    # the cuda path's code on the CPU
    tools/gpu_run.sh python3 benchmarks/serve_load.py --backends cuda --modes worker-process \\
        --http-processes 1,4 --clients 64,256   # one HTTP process beside four
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import multiprocessing
import os
import platform
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_decode  # noqa: E402  (core builds and the engine's own decode measurement)
from gpu_decode import log  # noqa: E402

NAMESPACE = "bench/serve"
BACKENDS = ("null", "reference")
MODES = ("in-process", "worker-process", "thread")
STARTUP_TIMEOUT_S = 300.0
"""Seconds ``helios run`` may take to print its readiness line (load, program build, warm-up)."""
ENGINE_PROMPT_FALLBACK = 45
"""Prompt tokens of the engine's requests when no HTTP request reported its own (the chat prompt's length)."""
MAX_CHAT_PROMPT = 64
"""Prompt tokens a wave's chat request stays under (its template and text); sizes the cache pages."""
DELIVERY_GAP_S = 0.0005
"""Content chunks of one response that arrive within this many seconds of the one before are one delivery
(the server writes every event queued for a response at once, so the client reads them together)."""


class Interrupted(Exception):
    """SIGTERM arrived: stop measuring, print and write what finished."""


# ------------------------------------------------------------------------------------------- cores


@dataclass(frozen=True)
class ServedCore:
    """The core every phase of one backend serves, the key and namespace it is accepted with."""

    path: Path
    public_key: Path
    namespace: str
    description: str
    cache_pages: int | None = None
    """Cap on physical cache pages given to the server and the engine alike (None: the runtime's choice)."""


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


def shape_plan(shape: str, backend: str, clients: Sequence[int], max_tokens: int, timeout: float) -> gpu_decode.Plan:
    """``gpu_decode.py``'s plan of one shape: its core arguments (so ``--cores`` shares the core) and the
    engine measurement's prompt, tokens and timeout."""
    cuda = backend == "cuda"
    return gpu_decode.Plan(
        shapes=(shape,), device="cuda" if cuda else "cpu", backend=backend,
        targets=("reference", "sm_90a") if cuda else ("reference",),
        batches=tuple(sorted({1, 8, 64, 256, *clients} if cuda else {1, *clients})), prompt=32, tokens=max_tokens,
        prefill=512, context=1024, page_tokens=16, baseline_steps=0, baseline_warmup=0, prefill_repeats=0,
        agreement_tokens=0, timeout_s=timeout, budget_s=float("inf"), seed=0,
    )  # fmt: skip


def shape_core(plan: gpu_decode.Plan, cores: Path, report: Report, max_prompt: int) -> ServedCore:
    """The core of ``plan``'s shape in ``cores``: reused when built with the same arguments, else built now."""
    (shape,) = plan.shapes
    signing, public = gpu_decode.keys_in(cores)
    (spec,) = gpu_decode.core_specs(plan, cores, signing)
    kernel_cache = Path(os.environ["IGNITION_KERNEL_CACHE"])
    kernels_before = gpu_decode.cached_kernels(kernel_cache)
    log(f"kernel cache {kernel_cache}: {kernels_before} kernels")
    with tempfile.TemporaryDirectory(prefix="serve-load-build-") as scratch:
        builds = gpu_decode.Report(Path(scratch) / "build.json", plan)
        gpu_decode.build_cores([spec], builds)
        entry = builds.shape(shape)
    report.data["build"] = entry.get("build", {})
    if "build" in entry.get("errors", {}):
        raise RuntimeError(f"building the {shape} core failed: {entry['errors']['build'][-600:]}")
    if gpu_decode.cached_kernels(kernel_cache) != kernels_before:  # carry the new kernels to the next run
        gpu_decode.pack_kernel_cache(kernel_cache)
    # Both the server and the engine get the cache pages gpu_decode.py gives its engine: every client's
    # prompt and output with a page of slack, plus one full-context request.
    full_context = -(-plan.context // plan.page_tokens)
    per_request = -(-(max_prompt + plan.tokens) // plan.page_tokens) + 1
    pages = max(full_context, int(plan.max_rows * per_request * 1.1) + full_context)
    description = f"{shape} bf16 {','.join(plan.targets)} core ({Path(spec.path).name})"
    return ServedCore(Path(spec.path), public, gpu_decode.NAMESPACE, description, pages)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ----------------------------------------------------------------------------------------- servers


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


def _options(max_active: int, cache_pages: int | None) -> Any:
    from helios_core.contract import LoadOptions

    return LoadOptions(max_active=max_active, queue_capacity=max_active, cache_pages=cache_pages)


@contextmanager
def serve(
    core: Path, key: Path, backend: str, max_active: int, namespace: str = NAMESPACE, cache_pages: int | None = None
) -> Iterator[tuple[str, EngineClock | None]]:
    """The real server over ``core`` on a random loopback port; yields its base URL and engine clock."""
    import uvicorn

    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start
    from helios_core.server.app import create_app

    running = start(core, TrustSettings((key,), namespace, None), _options(max_active, cache_pages), backend=backend)
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


@contextmanager
def serve_subprocess(
    core: Path,
    key: Path,
    backend: str,
    max_active: int,
    worker_process: bool,
    namespace: str = NAMESPACE,
    cache_pages: int | None = None,
    http_processes: int = 1,
) -> Iterator[tuple[str, EngineClock | None]]:
    """``helios run`` over ``core`` as a subprocess (with ``worker_process``: ``--worker-process``, and
    ``--http-processes`` above 1); yields its base URL, once it printed its readiness line, and no engine clock
    (its backend runs in another process)."""
    port = free_port()
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core), "--trust-key", str(key),
        "--accept", namespace, "--host", "127.0.0.1", "--port", str(port), "--backend", backend,
        "--max-active", str(max_active), "--queue-capacity", str(max_active),
        *(["--cache-pages", str(cache_pages)] if cache_pages is not None else []),
        *(["--worker-process"] if worker_process else []),
        *(["--http-processes", str(http_processes)] if http_processes > 1 else []),
    ]  # fmt: skip
    began = time.monotonic()
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    seen: list[str] = []

    def read_stderr() -> None:
        if server.stderr is not None:
            for line in server.stderr:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read_stderr, name="helios-run-stderr", daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(
                    f"helios run printed no readiness line in {STARTUP_TIMEOUT_S:.0f} s: {''.join(seen)[-2000:]}"
                ) from None
            if line is None:
                raise RuntimeError(
                    f"helios run exited with {server.wait()} before it was ready: {''.join(seen)[-2000:]}"
                )
            seen.append(line)
            if "helios run: ready" in line:
                break
        ready_s = time.monotonic() - began
        import httpx

        with httpx.Client(timeout=30) as client:
            served = client.get(f"http://127.0.0.1:{port}/v1/models").status_code
        log(
            f"helios run{' --worker-process' if worker_process else ''}"
            f"{f' --http-processes {http_processes}' if http_processes > 1 else ''} ({backend}): "
            f"ready in {ready_s:.2f} s, "
            f"/v1/models {served} at {time.monotonic() - began:.2f} s after the command started; "
            f"its own account: {seen[-1].strip().partition(' (')[2].rstrip(')') or 'none'}"
        )
        yield f"http://127.0.0.1:{port}", None
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ----------------------------------------------------------------------------------------- clients


class Sample(NamedTuple):
    """One streamed request, on the system-wide monotonic clock (comparable between processes)."""

    client: int
    begin: float
    end: float
    arrivals: list[float]
    """When each chunk with content arrived."""
    tokens: int
    """``usage.completion_tokens``."""
    prompt_tokens: int
    status: int
    """HTTP status; 0 when the request failed before a status or its stream ended with an error event."""
    error: str

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.begin if self.arrivals else float("nan")

    @property
    def tpot_s(self) -> float:
        """Time per output token as the client sees it: first to last content chunk over ``tokens - 1``."""
        if not self.arrivals or self.tokens < 2:
            return float("nan")
        return (self.arrivals[-1] - self.arrivals[0]) / (self.tokens - 1)

    def deliveries(self) -> list[tuple[float, int]]:
        """(arrival of its first chunk, content chunks) of each delivery: consecutive content chunks that
        arrived within ``DELIVERY_GAP_S`` of the one before belong to one delivery (one read from the socket)."""
        groups: list[tuple[float, int]] = []
        previous = float("-inf")
        for arrival in self.arrivals:
            if groups and arrival - previous <= DELIVERY_GAP_S:
                groups[-1] = (groups[-1][0], groups[-1][1] + 1)
            else:
                groups.append((arrival, 1))
            previous = arrival
        return groups

    def token_gaps(self) -> list[tuple[float, float]]:
        """(gap per token, tokens) of each delivery after the first: the time since the previous delivery
        divided by the delivery's tokens (``tokens / content chunks`` a chunk), weighted by those tokens."""
        if not self.arrivals or self.tokens <= 0:
            return []
        per_chunk = self.tokens / len(self.arrivals)
        groups = self.deliveries()
        return [
            ((later - earlier) / (chunks * per_chunk), chunks * per_chunk)
            for (earlier, _), (later, chunks) in itertools.pairwise(groups)
        ]


async def one_request(client: Any, url: str, max_tokens: int, index: int, client_index: int = 0) -> Sample:
    """One streaming chat request; a transport failure or an error event is recorded, not raised."""
    import httpx

    body = {
        "messages": [{"role": "user", "content": f"request {index}: tell me a story"}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    begin = time.monotonic()
    arrivals: list[float] = []
    tokens = prompt_tokens = status = 0
    error = ""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            status = response.status_code
            if status != 200:
                error = (await response.aread()).decode(errors="replace")[:300]
            else:
                async for line in response.aiter_lines():
                    if line.startswith("event: error"):
                        error = "the stream ended with an error event"
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
                        prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("delta", {}).get("content"):
                        arrivals.append(time.monotonic())
                    if "error" in chunk and not choices:
                        error = str(chunk["error"])[:300]
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Sample(client_index, begin, time.monotonic(), arrivals, tokens, prompt_tokens, status, error)


async def client_set(
    url: str, assignments: Sequence[tuple[int, Sequence[int]]], max_tokens: int, timeout: float
) -> tuple[list[Sample], str]:
    """Each ``(client, request indices)`` of ``assignments`` as one streaming client sending its requests one
    after the other on a connection of its own (one ``httpx.AsyncClient`` each, as separate users have);
    (finished samples, error or "").

    One shared pool would hand every waiting request the same first idle connection when a round of
    streams ends, so later requests would wait inside httpx (seconds at 128 clients), which the TTFT and
    throughput figures would then count as the server's."""
    import httpx

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    finished: list[Sample] = []

    async def one_client(client_index: int, indices: Sequence[int]) -> None:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            for index in indices:
                finished.append(await one_request(client, url, max_tokens, index, client_index))

    try:
        await asyncio.wait_for(asyncio.gather(*(one_client(c, i) for c, i in assignments)), timeout)
    except TimeoutError:
        return finished, f"{len(assignments)} clients did not finish within {timeout:.0f} s"
    return finished, ""


async def warm_client(url: str, timeout: float) -> None:
    """One request to ``/v1/models`` before a client process says ready: the first request of a process loads
    httpx's transport (httpcore, anyio, h11; over 0.1 s), which would otherwise delay the process's first
    stream, inflate its TTFT and start the process's clients after the others."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as client:
        (await client.get(url + "/v1/models")).raise_for_status()


def client_process(
    position: int,
    url: str,
    assignments: list[tuple[int, list[int]]],
    max_tokens: int,
    timeout: float,
    ready: Any,
    start: Any,
    results: Any,
) -> None:
    """A client process: warm its HTTP client, say ready, wait for the start, stream, put (position, samples,
    error)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    said_ready = False
    try:
        asyncio.run(warm_client(url, timeout))
        ready.put(position)
        said_ready = True
        if not start.wait(timeout):
            results.put((position, [], "the start signal never came"))
            return
        samples, error = asyncio.run(client_set(url, assignments, max_tokens, timeout))
        results.put((position, [tuple(s) for s in samples], error))
    except BaseException as exc:  # reported to the parent, which fails the wave
        results.put((position, [], f"{type(exc).__name__}: {exc}"))
        if not said_ready:  # the parent waits for every process's word before it gathers results
            ready.put(position)


def assign(clients: int, requests: int, processes: int) -> list[list[tuple[int, list[int]]]]:
    """Request indices handed to the clients round-robin, clients to the processes round-robin: one list of
    ``(client, request indices)`` per process (one list in all when ``processes`` is 0)."""
    per_client = [(c, list(range(c, requests, clients))) for c in range(clients)]
    groups = min(max(processes, 1), clients)
    return [per_client[g::groups] for g in range(groups)]


def run_wave(url: str, clients: int, requests: int, max_tokens: int, timeout: float, processes: int) -> list[Sample]:
    """``max(requests, clients)`` streaming requests from ``clients`` clients in ``processes`` processes
    (0: in this process); raises RuntimeError naming what failed when a client process failed or timed out."""
    groups = assign(clients, max(requests, clients), processes)
    if processes <= 0:
        finished, failure = asyncio.run(client_set(url, groups[0], max_tokens, timeout))
        if failure:
            raise RuntimeError(failure)
        return finished
    context = multiprocessing.get_context("spawn")
    ready, results, start = context.Queue(), context.Queue(), context.Event()
    children = [
        context.Process(
            target=client_process,
            args=(position, url, group, max_tokens, timeout, ready, start, results),
            name=f"serve-load-client-{position}",
            daemon=True,
        )
        for position, group in enumerate(groups)
    ]
    for child in children:
        child.start()
    try:
        deadline = time.monotonic() + 120
        for _ in children:
            try:
                ready.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"{len(children)} client processes did not start within 120 s") from None
        start.set()
        samples: list[Sample] = []
        errors: list[str] = []
        deadline = time.monotonic() + timeout + 60
        for _ in children:
            try:
                _, found, error = results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"client processes did not report within {timeout + 60:.0f} s") from None
            samples += [Sample(*values) for values in found]
            if error:
                errors.append(error)
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(children)} client processes failed: {errors[0]}")
        return samples
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
                child.join()


# ------------------------------------------------------------------------------------------ figures


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def weighted_percentile(pairs: Sequence[tuple[float, float]], q: float) -> float:
    """The value at ``q`` of the way through the total weight of ``(value, weight)`` pairs ordered by value
    (each pair spans its weight; q = 1 is the largest value); NaN without positive weight."""
    ordered = sorted((value, weight) for value, weight in pairs if weight > 0)
    total = sum(weight for _, weight in ordered)
    if not ordered:
        return float("nan")
    target, passed = q * total, 0.0
    for value, weight in ordered:
        passed += weight
        if passed > target:
            return value
    return ordered[-1][0]


def stream_window(samples: Sequence[Sample]) -> dict[str, float]:
    """Output tokens/s over the window in which every client streams: from the last client's first content
    chunk to the first client's last one; each chunk in it counts ``tokens / content chunks`` of its request."""
    ok = [s for s in samples if s.ok and s.arrivals]
    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}
    for sample in ok:
        firsts[sample.client] = min(firsts.get(sample.client, sample.arrivals[0]), sample.arrivals[0])
        lasts[sample.client] = max(lasts.get(sample.client, sample.arrivals[-1]), sample.arrivals[-1])
    clients = {s.client for s in samples}
    if not ok or set(firsts) != clients:
        return {"tokens_per_s": float("nan"), "seconds": 0.0, "tokens": 0.0}
    begin, end = max(firsts.values()), min(lasts.values())
    if end <= begin:
        return {"tokens_per_s": float("nan"), "seconds": 0.0, "tokens": 0.0}
    tokens = sum(s.tokens / len(s.arrivals) * sum(1 for t in s.arrivals if begin < t <= end) for s in ok)
    return {"tokens_per_s": tokens / (end - begin), "seconds": end - begin, "tokens": tokens}


@dataclass
class Row:
    backend: str
    mode: str
    clients: int
    ok: int
    requests: int
    tokens: int
    prompt_tokens: int
    wall_s: float
    window: dict[str, float]
    engine_s: float
    launches: int
    ttft: list[float]
    tpot: list[float]
    """Per request: first to last content chunk over its tokens - 1 (requests of 2 tokens or more)."""
    gaps: list[tuple[float, float]]
    """Per delivery after a request's first: (gap since the previous delivery per token, its tokens)."""
    errors: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    """The engine alone at this batch: ``tokens_per_s``, ``ms_per_step`` (``gpu_decode._decode_wave``)."""
    http_processes: int = 1
    """The server's HTTP processes (``helios run --http-processes``)."""
    split: list[int] = field(default_factory=list)
    """With several HTTP processes: the wave's requests each admitted, by process (empty when not read)."""

    @property
    def label(self) -> str:
        if self.mode == "in-process":
            return self.backend
        if self.http_processes > 1:
            return f"{self.backend} ({self.mode} x{self.http_processes})"
        return f"{self.backend} ({self.mode})"

    @property
    def processes_cell(self) -> str:
        """The HTTP process count, and how the wave's requests were spread over them."""
        if self.http_processes > 1 and self.split:
            return f"{self.http_processes}: {'/'.join(str(count) for count in self.split)}"
        return str(self.http_processes)

    @property
    def ratio(self) -> float:
        engine = self.engine.get("tokens_per_s")
        return self.window["tokens_per_s"] / engine if engine else float("nan")

    @property
    def tpot_per_step(self) -> float:
        """TPOT p50 over the engine's ms per step alone at this batch (NaN without the engine figure)."""
        step_ms = self.engine.get("ms_per_step")
        return percentile(self.tpot, 0.5) * 1000.0 / step_ms if step_ms else float("nan")

    def cells(self) -> list[str]:
        ms = 1000.0
        overhead_us = (self.wall_s - self.engine_s) / max(self.tokens, 1) * 1e6
        return [
            self.label,
            self.processes_cell,
            str(self.clients),
            f"{self.ok}/{self.requests}",
            str(self.tokens),
            _cell(self.tokens / self.wall_s if self.wall_s > 0 else float("nan"), 0),
            _cell(self.window["tokens_per_s"], 0),
            _cell(percentile(self.ttft, 0.5) * ms, 1),
            _cell(percentile(self.ttft, 0.99) * ms, 1),
            _cell(percentile(self.tpot, 0.5) * ms, 2),
            _cell(percentile(self.tpot, 0.99) * ms, 2),
            _cell(weighted_percentile(self.gaps, 0.5) * ms, 2),
            _cell(weighted_percentile(self.gaps, 0.99) * ms, 2),
            _cell(self.wall_s, 2),
            _cell(self.engine_s, 2),
            _cell(overhead_us, 0),
            _cell(self.engine.get("tokens_per_s"), 0),
            _cell(self.engine.get("ms_per_step"), 3),
            _cell(self.ratio, 2),
            _cell(self.tpot_per_step, 2),
        ]

    def summary(self) -> dict[str, Any]:
        """What the JSON keeps of the row: every figure, the latency lists as percentiles (``gap_s`` over tokens:
        ``count`` is its deliveries, ``tokens`` their tokens, ``mean`` weighted by them)."""
        figures = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ttft", "tpot", "gaps")}
        for name, values in (("ttft_s", self.ttft), ("tpot_s", self.tpot)):
            figures[name] = {f"p{q}": percentile(values, q / 100) for q in (50, 90, 99)} | {
                "mean": statistics.fmean(values) if values else float("nan"),
                "count": len(values),
                "max": max(values, default=float("nan")),
            }
        weight = sum(w for _, w in self.gaps)
        figures["gap_s"] = {f"p{q}": weighted_percentile(self.gaps, q / 100) for q in (50, 90, 99)} | {
            "mean": sum(v * w for v, w in self.gaps) / weight if weight else float("nan"),
            "count": len(self.gaps),
            "tokens": weight,
            "max": max((v for v, _ in self.gaps), default=float("nan")),
        }
        figures["label"], figures["ratio"], figures["tpot_per_step"] = self.label, self.ratio, self.tpot_per_step
        return figures


def _cell(value: float | None, digits: int) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


HEADERS = [
    "server", "HTTP processes", "clients", "ok", "out tokens", "tok/s", "window tok/s", "TTFT p50 ms", "TTFT p99 ms",
    "TPOT p50 ms", "TPOT p99 ms", "gap p50 ms", "gap p99 ms", "wall s", "engine run s", "overhead µs/token",
    "engine tok/s", "engine ms/step", "HTTP / engine", "TPOT / step",
]  # fmt: skip


def make_row(backend: str, mode: str, clients: int, samples: Sequence[Sample], engine_s: float, launches: int) -> Row:
    ok = [s for s in samples if s.ok]
    wall = max((s.end for s in samples), default=0.0) - min((s.begin for s in samples), default=0.0)
    prompts = [s.prompt_tokens for s in ok if s.prompt_tokens]
    return Row(
        backend, mode, clients, len(ok), len(samples), sum(s.tokens for s in ok),
        int(statistics.median(prompts)) if prompts else 0, wall, stream_window(samples), engine_s, launches,
        [s.ttft_s for s in ok if s.arrivals], [s.tpot_s for s in ok if s.arrivals and s.tokens >= 2],
        [gap for s in ok for gap in s.token_gaps()],
        sorted({s.error for s in samples if s.error})[:3],
    )  # fmt: skip


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "| --- | " + " | ".join("---:" for _ in HEADERS[1:]) + " |"]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- report


class Report:
    """Every figure of the run, written as JSON after every wave (nowhere when ``path`` is None)."""

    def __init__(self, path: Path | None, arguments: dict[str, Any]) -> None:
        self.path = path
        self.rows: list[Row] = []
        self.data: dict[str, Any] = {
            "date": str(date.today()), "arguments": arguments, "machine": machine_facts(arguments["backends"]),
            "cores": {}, "engine": {}, "rows": [], "errors": [],
        }  # fmt: skip

    def fail(self, what: str, message: str) -> None:
        self.data["errors"].append({"phase": what, "error": message})
        log(f"{what} failed: {message.splitlines()[0] if message else ''}")
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.data["rows"] = [row.summary() for row in self.rows]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)


def machine_facts(backends: str) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
        "processor": platform.processor(),
    }  # fmt: skip
    if "cuda" in backends:
        with contextlib.suppress(Exception):
            smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
            facts["gpu"] = subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.strip()
    return facts


def default_out() -> Path | None:
    out = os.environ.get("OUT")
    return Path(out) / "serve_load.json" if out else None


# ------------------------------------------------------------------------------------------- phases


class Budget:
    """``--budget``: no new phase or wave after ``seconds`` since the start of the run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.began = time.monotonic()

    def spent(self, report: Report, what: str) -> bool:
        if time.monotonic() - self.began <= self.seconds:
            return False
        report.fail(what, f"skipped: past the {self.seconds:.0f} s budget")
        return True


def admitted_by_process(url: str) -> list[int]:
    """``helios_http_process_admitted_total`` of a server of several HTTP processes, by process index."""
    import httpx

    with httpx.Client(timeout=30) as client:
        text = client.get(url + "/metrics").text
    found = {
        int(index): int(float(value))
        for index, value in re.findall(r'^helios_http_process_admitted_total\{process="(\d+)"\} (\S+)$', text, re.M)
    }
    return [found[index] for index in sorted(found)]


def measure_http(
    core: ServedCore, backend: str, mode: str, clients: Sequence[int], args: argparse.Namespace, report: Report,
    budget: Budget, http_processes: int = 1,
) -> list[Row]:  # fmt: skip
    """One server mode's waves, one row per client count (``http_processes``: the worker-process mode's
    ``--http-processes``)."""
    rows: list[Row] = []
    max_active = max(clients)
    began = time.monotonic()
    name = f"{mode} x{http_processes}" if http_processes > 1 else mode
    if mode == "in-process":
        serving = serve(core.path, core.public_key, backend, max_active, core.namespace, core.cache_pages)
    else:
        serving = serve_subprocess(
            core.path, core.public_key, backend, max_active, mode == "worker-process", core.namespace,
            core.cache_pages, http_processes,
        )  # fmt: skip
    with serving as (url, clock):
        log(f"{backend} ({name}): serving at {url} after {time.monotonic() - began:.1f} s")
        run_wave(url, 2, 2, 4, args.timeout, 0)  # warm-up: programs, tokenizer, connections
        for count in clients:
            if budget.spent(report, f"{backend} ({name}) {count} clients"):
                continue
            engine_before, launches_before = clock.read() if clock is not None else (0, 0)
            split_before = admitted_by_process(url) if http_processes > 1 else []
            try:
                samples = run_wave(url, count, args.requests, args.max_tokens, args.timeout, args.client_processes)
            except RuntimeError as exc:
                report.fail(f"{backend} ({name}) {count} clients", str(exc))
                continue
            engine_after, launches_after = clock.read() if clock is not None else (0, 0)
            engine_s = (engine_after - engine_before) / 1e9 if clock is not None else float("nan")
            row = make_row(backend, mode, count, samples, engine_s, launches_after - launches_before)
            row.http_processes = http_processes
            if http_processes > 1:
                row.split = [
                    after - before for after, before in zip(admitted_by_process(url), split_before, strict=True)
                ]
            rows.append(row)
            report.rows.append(row)
            report.save()
            log(
                f"{row.label} {count} clients: {row.ok}/{row.requests} ok, window "
                f"{_cell(row.window['tokens_per_s'], 0)} tok/s, TTFT p50 {percentile(row.ttft, 0.5) * 1000:.1f} ms, "
                f"TPOT p50 {percentile(row.tpot, 0.5) * 1000:.2f} ms, "
                f"gap p50 {weighted_percentile(row.gaps, 0.5) * 1000:.2f} ms"
            )
    return rows


def measure_engine(
    core: ServedCore, backend: str, clients: Sequence[int], prompt: int, args: argparse.Namespace, report: Report,
    budget: Budget,
) -> dict[int, dict[str, Any]]:  # fmt: skip
    """The engine alone in this process on the same core: ``gpu_decode.py``'s decode wave at each client count
    (that many concurrent requests of ``prompt`` random prompt tokens and ``--max-tokens`` new tokens)."""
    from helios_core.loading import TrustSettings
    from helios_core.runtime.startup import start

    # The decode wave reads the plan's prompt, tokens and timeout only.
    plan = dataclasses.replace(
        shape_plan(args.shape or "tiny", backend, clients, args.max_tokens, args.timeout),
        prompt=prompt,
        batches=tuple(clients),
    )
    began = time.monotonic()
    running = start(
        core.path, TrustSettings((core.public_key,), core.namespace, None), _options(max(clients), core.cache_pages),
        backend=backend,
    )  # fmt: skip
    log(f"{backend} engine: started in {time.monotonic() - began:.1f} s")
    found: dict[int, dict[str, Any]] = {}
    wedged = False
    try:
        vocab = gpu_decode.model_facts(running.verified.contract).input_vocab
        clock = gpu_decode.RoundClock(running)
        rng = np.random.default_rng(11)
        warm = gpu_decode._requests("warm", 2, prompt, 4, vocab, rng)
        gpu_decode.collect(running.engine, warm, args.timeout)
        for batch in clients:
            if budget.spent(report, f"{backend} engine batch {batch}"):
                continue
            try:
                window = gpu_decode._decode_wave(running.engine, clock, batch, plan, vocab, rng)
            except TimeoutError:  # a worker that stopped answering ends the phase
                raise
            except Exception as exc:  # one failed wave must not hide the others
                report.fail(f"{backend} engine batch {batch}", f"{type(exc).__name__}: {exc}")
                continue
            window.pop("prompt_ids", None)
            window.pop("token_ids", None)
            found[batch] = window
            report.data["engine"].setdefault(backend, {})[str(batch)] = window
            report.save()
            log(
                f"{backend} engine batch {batch}: {window['tokens_per_s']:.0f} tok/s, "
                f"{window['ms_per_step']:.3f} ms/step"
            )
    except BaseException:
        wedged = True
        raise
    finally:
        gpu_decode._close(running, wedged)
    return found


def measure_backend(
    backend: str, clients: list[int], modes: list[str], args: argparse.Namespace, report: Report, budget: Budget,
    scratch: Path,
) -> None:  # fmt: skip
    """Every phase of one backend: its core, the first server mode, the engine alone, the other modes."""
    try:
        if args.shape:
            plan = shape_plan(args.shape, backend, clients, args.max_tokens, args.timeout)
            cores = args.cores or scratch
            cores.mkdir(parents=True, exist_ok=True)
            core = shape_core(plan, cores, report, max_prompt=MAX_CHAT_PROMPT)
        else:
            path, key = build(scratch / backend, max(clients))
            core = ServedCore(path, key, NAMESPACE, "synthetic tiny core")
    except (Interrupted, KeyboardInterrupt):
        raise
    except Exception as exc:  # without a core no phase of this backend can run
        report.fail(f"{backend} core", f"{type(exc).__name__}: {exc}")
        return
    report.data["cores"][backend] = {"path": str(core.path), "description": core.description}
    log(f"{backend}: {core.description}")
    rows: list[Row] = []
    engine: dict[int, dict[str, Any]] = {}
    servers = [
        (mode, count) for mode in modes for count in (args.http_process_list if mode == "worker-process" else [1])
    ]
    phases: list[tuple[str, int]] = [*servers[:1], *([("engine", 1)] if args.engine else []), *servers[1:]]
    for phase, http_processes in phases:
        name = f"{phase} x{http_processes}" if http_processes > 1 else phase
        if budget.spent(report, f"{backend} {name}"):
            continue
        try:
            if phase == "engine":
                prompts = [row.prompt_tokens for row in rows if row.prompt_tokens]
                prompt = max(prompts) if prompts else ENGINE_PROMPT_FALLBACK
                engine = measure_engine(core, backend, clients, prompt, args, report, budget)
            else:
                rows += measure_http(core, backend, phase, clients, args, report, budget, http_processes)
        except (Interrupted, KeyboardInterrupt):
            raise
        except Exception as exc:  # one failed phase must not hide the others
            report.fail(f"{backend} {name}", f"{type(exc).__name__}: {exc}")
        for row in rows:
            row.engine = (
                {k: engine[row.clients][k] for k in ("tokens_per_s", "ms_per_step")} if row.clients in engine else {}
            )
        report.save()


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", help="comma-separated concurrent client counts (default 8,32; cuda: 64,256)")
    parser.add_argument("--requests", type=int, default=64, help="requests per wave (at least one per client)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request, ignore_eos (default 64; cuda: 512)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per wave (and per request)")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated backends (null, reference, cuda)"
    )
    parser.add_argument(
        "--modes",
        help="comma-separated server modes: in-process, worker-process, thread (default in-process; cuda: "
        "worker-process,thread); the engine phase runs after the first",
    )
    parser.add_argument(
        "--worker-process",
        action="store_true",
        help="shorthand for --modes thread,worker-process (helios run subprocesses; not for the null backend)",
    )
    parser.add_argument(
        "--http-processes",
        default="1",
        help="comma-separated HTTP process counts the worker-process mode is served with (helios run "
        "--http-processes; default 1, e.g. 1,4)",
    )
    parser.add_argument(
        "--client-processes", type=int, default=8, help="processes the clients are spread over (0: this process)"
    )
    parser.add_argument("--shape", help="serve gpu_decode.py's core of this llama-synthetic shape (cuda: default 1b)")
    parser.add_argument("--cores", type=Path, help="with --shape: folder to reuse the core from and build it into")
    parser.add_argument("--no-engine", dest="engine", action="store_false", help="skip the engine-alone figures")
    parser.add_argument("--budget", type=float, default=float("inf"), help="start no new phase after this many seconds")
    parser.add_argument("--out", type=Path, help="JSON of every figure (default $OUT/serve_load.json when OUT is set)")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    cuda = "cuda" in backends
    args.backends = ",".join(backends)
    args.clients = args.clients or ("64,256" if cuda else "8,32")
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (512 if cuda else 64)
    args.shape = args.shape or ("1b" if cuda else None)
    modes = args.modes or (
        "thread,worker-process" if args.worker_process else "worker-process,thread" if cuda else "in-process"
    )
    args.modes = [m.strip() for m in modes.split(",") if m.strip()]
    try:
        clients = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--clients must be comma-separated integers, not {args.clients!r}")
    if not clients or min(clients) <= 0 or args.requests <= 0 or args.max_tokens <= 0:
        parser.error("clients, requests and max-tokens must be positive")
    try:
        http_processes = sorted({int(c) for c in args.http_processes.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--http-processes must be comma-separated integers, not {args.http_processes!r}")
    if not http_processes or min(http_processes) <= 0:
        parser.error("--http-processes must be positive")
    if args.client_processes < 0 or args.timeout <= 0:
        parser.error("--client-processes must not be negative and --timeout must be positive")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"unknown server modes {unknown}; known: {', '.join(MODES)}")
    if args.shape:
        from ignition.recipes.synthetic import SHAPES

        if args.shape not in SHAPES:
            parser.error(f"unknown shape {args.shape!r}; known: {', '.join(SHAPES)}")
        if MAX_CHAT_PROMPT + args.max_tokens > 1024:
            parser.error(f"--max-tokens must leave {MAX_CHAT_PROMPT} prompt tokens in the core's context of 1024")
    if args.cores and not args.shape:
        parser.error("--cores needs --shape (or --backends cuda)")
    if max(http_processes) > 1 and "worker-process" not in args.modes:
        parser.error("--http-processes above 1 needs the worker-process mode (--modes worker-process)")
    args.client_list = clients
    args.http_process_list = http_processes
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("IGNITION_KERNEL_CACHE", str(gpu_decode.KERNEL_CACHE))
    arguments = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = Report(args.out or default_out(), arguments)
    budget = Budget(args.budget)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Interrupted()

    signal.signal(signal.SIGTERM, on_sigterm)
    clients: list[int] = args.client_list
    log(
        f"plan: backends {args.backends}, modes {','.join(args.modes)}, clients {clients}, "
        f"{args.max_tokens} tokens, {args.client_processes} client processes, "
        f"HTTP processes {','.join(map(str, args.http_process_list))}"
        + (f", shape {args.shape}, kernel cache {os.environ['IGNITION_KERNEL_CACHE']}" if args.shape else "")
    )
    try:
        with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
            for backend in args.backends.split(","):
                modes = [m for m in args.modes if not (backend == "null" and m != "in-process")]
                if not modes:
                    continue
                measure_backend(backend, clients, modes, args, report, budget, Path(tmp))
    except (Interrupted, KeyboardInterrupt):
        report.fail("run", "interrupted")
        log("interrupted: printing what finished")
    finally:
        report.save()
        print_table(report, args)
    incomplete = not report.rows or any(row.ok < row.requests for row in report.rows)
    if incomplete:
        print("warning: some requests did not finish with status 200", file=sys.stderr)
    return 1 if incomplete or report.data["errors"] else 0


def print_table(report: Report, args: argparse.Namespace) -> None:
    machine = report.data["machine"]
    cores = "; ".join(f"{b}: {c['description']}" for b, c in report.data["cores"].items()) or "no core"
    print()
    print(
        f"streaming load over loopback, {cores}; at least {args.requests} requests x {args.max_tokens} tokens per "
        f"wave, {args.client_processes} client processes, {date.today()}, {machine['machine']} "
        f"{machine['processor']} ({machine['cpus']} CPUs){'; ' + machine['gpu'] if machine.get('gpu') else ''}"
    )
    print(markdown(report.rows))
    print(
        "tok/s = completion tokens / wall; window tok/s = output tokens while every client streams; TPOT = per "
        "request, first to last content chunk / (tokens - 1); gap = per token, the time since the previous "
        f"delivery (chunks read together, within {DELIVERY_GAP_S * 1000:g} ms) / the delivery's tokens, over "
        "every token after a request's first delivery; engine run = sum of backend.run durations (in-process "
        "only), overhead µs/token = (wall - engine run) / tokens; engine tok/s and ms/step: the engine alone, that "
        "many concurrent requests, over the window in which all decode; HTTP / engine = window tok/s / engine "
        "tok/s; TPOT / step = TPOT p50 / engine ms/step; HTTP processes = helios run --http-processes, and above 1 "
        "the wave's requests each process admitted"
    )
    launches = [f"{r.label}/{r.clients}: {r.launches}" for r in report.rows if r.mode == "in-process"]
    if launches:
        print("launches per wave: " + ", ".join(launches))
    for failure in report.data["errors"]:
        print(f"{failure['phase']} FAILED: {failure['error'].splitlines()[0][:200] if failure['error'] else ''}")
    if report.path is not None:
        print(f"JSON: {report.path}")


if __name__ == "__main__":
    sys.exit(main())
