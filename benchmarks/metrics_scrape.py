"""``GET /metrics`` latency and gauge age while ``helios run`` is saturated, beside an idle server.

Builds a tiny synthetic core (the reference backend), starts ``helios run`` on it as a subprocess on a
free loopback port (``--max-active`` slots, a queue behind them), and scrapes ``/metrics`` 40 times a
second (every 25 ms on a fixed schedule, one keep-alive connection) from a thread of this process for
``--seconds`` seconds, twice: once with the server idle, once while a separate load process keeps
``--clients`` streaming chat requests in flight (more clients than slots, so requests queue; each
request is bounded by ``--max-tokens`` and every client stops at the end of the phase).

Per phase it prints the scrape latency (p50/p90/p99/max, ms), the scrapes answered out of those sent
and, under load, how old the gauges were: the load process records when each of its requests was
sent and when its response ended, so the number of requests in flight is known at every instant; a
scrape's ``helios_http_admitted`` is compared with that count, and its age is the time between the
scrape's answer and the last instant the count had that value (0 when the count had it while the
scrape ran). ``running`` is the share of loaded scrapes whose ``helios_num_requests_running`` equals
``--max-active`` and whose ``waiting + running`` equals the admitted count.

With ``--worker-process`` the same phases run again against a server started with ``--worker-process``
(the model worker in its own process), and both tables are printed.

    .venv/bin/python benchmarks/metrics_scrape.py [--seconds 10] [--clients 16] [--max-active 4] [--worker-process]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import multiprocessing
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import NAMESPACE, build, free_port  # noqa: E402

SCRAPE_INTERVAL = 0.025
"""40 scrapes per second."""

GAUGES = ("helios_http_admitted", "helios_num_requests_waiting", "helios_num_requests_running")


@dataclass
class Scrape:
    sent: float
    """``time.monotonic()`` when the request was sent."""
    answered: float
    ok: bool
    values: dict[str, float] = field(default_factory=dict)

    @property
    def latency_ms(self) -> float:
        return (self.answered - self.sent) * 1000


def scrape_for(url: str, seconds: float) -> list[Scrape]:
    """Scrape ``url`` every :data:`SCRAPE_INTERVAL` for ``seconds`` (a late scrape does not shift the
    schedule: the next one goes out at its own slot, or at once when that slot passed)."""
    import httpx

    scrapes: list[Scrape] = []
    with httpx.Client(timeout=5.0) as client:
        start = time.monotonic()
        slot = 0
        while (now := time.monotonic()) < start + seconds:
            due = start + slot * SCRAPE_INTERVAL
            if due > now:
                time.sleep(due - now)
            slot += 1
            sent = time.monotonic()
            try:
                response = client.get(url)
                answered = time.monotonic()
                ok = response.status_code == 200
                text = response.text if ok else ""
            except httpx.HTTPError:
                answered, ok, text = time.monotonic(), False, ""
            values: dict[str, float] = {}
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name in GAUGES:
                    values[name] = float(value)
            scrapes.append(Scrape(sent, answered, ok, values))
    return scrapes


def load_process(url: str, clients: int, max_tokens: int, until: float, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In its own process: ``clients`` streaming chat clients, each sending one request after another
    until ``until`` (monotonic); puts the list of (sent, ended) pairs on ``results``."""
    import httpx

    spans: list[tuple[float, float]] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        number = 0
        while time.monotonic() < until:
            body = {
                "messages": [{"role": "user", "content": f"client {index} request {number}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            number += 1
            sent = time.monotonic()
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
            spans.append((sent, time.monotonic()))

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
            await asyncio.gather(*(client(index, http) for index in range(clients)))

    asyncio.run(main())
    results.put(spans)


TRANSIT_SECONDS = 0.02
"""How long a request may take to reach admission after the client sent it, or to be seen ended by the
client after the server released it (loopback, a busy host)."""


class Occupancy:
    """The admitted count the server can have had at an instant, from the load process's spans: at most
    the requests the client had in flight, at least those sent :data:`TRANSIT_SECONDS` before and not
    ending within :data:`TRANSIT_SECONDS` after."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        self._spans = spans
        edges = {t for sent, ended in spans for t in (sent, ended, sent + TRANSIT_SECONDS, ended - TRANSIT_SECONDS)}
        self.instants = sorted(edges)

    def bounds(self, t: float) -> tuple[int, int]:
        high = sum(1 for sent, ended in self._spans if sent <= t < ended)
        low = sum(1 for sent, ended in self._spans if sent + TRANSIT_SECONDS <= t < ended - TRANSIT_SECONDS)
        return low, high

    def possible(self, value: float, t: float) -> bool:
        low, high = self.bounds(t)
        return low <= value <= high


def gauge_age_ms(scrape: Scrape, occupancy: Occupancy) -> float | None:
    """How old the scrape's ``helios_http_admitted`` was when it was answered: 0 when the count was
    possible while the scrape ran, else the time since the last instant it was; None when never."""
    value = scrape.values.get("helios_http_admitted")
    if value is None:
        return None
    instants = occupancy.instants
    begin = bisect.bisect_left(instants, scrape.sent)
    end = bisect.bisect_right(instants, scrape.answered)
    window = [scrape.sent, *instants[begin:end]]
    if any(occupancy.possible(value, t) for t in window):
        return 0.0
    for index in range(begin - 1, -1, -1):  # the count held from instants[index] until instants[index + 1]
        if occupancy.possible(value, instants[index]):
            return (scrape.answered - instants[index + 1]) * 1000
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, scrapes: list[Scrape], ages: list[float] | None = None, dated: int = 0, consistent: str = "") -> str:
    latencies = [s.latency_ms for s in scrapes if s.ok]
    cells = [
        name,
        *(f"{percentile(latencies, q):.2f}" for q in (0.5, 0.9, 0.99)),
        f"{max(latencies, default=float('nan')):.2f}",
        f"{len(latencies)}/{len(scrapes)}",
    ]
    if ages is not None:
        cells += [f"{percentile(ages, 0.5):.1f}", f"{percentile(ages, 0.99):.1f}", f"{max(ages, default=0):.1f}"]
        cells.append(f"{len(ages)}/{dated}")
    else:
        cells += ["", "", "", ""]
    cells.append(consistent)
    return "| " + " | ".join(cells) + " |"


def measure_mode(args: argparse.Namespace, core: Path, key: Path, worker_process: bool) -> list[str]:
    """One server (the model worker in a thread, or with ``worker_process`` in its own process): idle and
    loaded phases; the lines of its table."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(core), "--trust-key", str(key),
        "--accept", NAMESPACE, "--port", str(port), "--backend", "reference",
        "--max-active", str(args.max_active), "--queue-capacity", str(args.clients * 2),
        *(["--worker-process"] if worker_process else []),
    ]  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        if server.stderr is None:
            raise RuntimeError("helios run was started without a stderr pipe")
        line = server.stderr.readline()
        if "ready" not in line:
            raise RuntimeError(line + server.stderr.read())
        # stderr is drained on a thread so that server log lines never block it
        threading.Thread(target=server.stderr.read, daemon=True).start()
        idle = scrape_for(base + "/metrics", args.seconds)

        results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        ramp = 1.0
        until = time.monotonic() + ramp + args.seconds
        loader = multiprocessing.Process(
            target=load_process, args=(base, args.clients, args.max_tokens, until, results)
        )
        loader.start()
        time.sleep(ramp)  # every client has a request in flight
        loaded = scrape_for(base + "/metrics", args.seconds)
        spans: list[tuple[float, float]] = results.get(timeout=120)
        loader.join(timeout=30)
    finally:
        server.terminate()
        server.wait(timeout=60)

    occupancy = Occupancy(spans)
    ages = [age for s in loaded if s.ok and (age := gauge_age_ms(s, occupancy)) is not None]
    dated = sum(1 for s in loaded if s.ok)
    answered = [s for s in loaded if s.ok and all(g in s.values for g in GAUGES)]
    consistent = sum(
        1
        for s in answered
        if s.values["helios_num_requests_running"] == args.max_active
        and s.values["helios_num_requests_waiting"] + s.values["helios_num_requests_running"]
        <= s.values["helios_http_admitted"]
    )
    tokens = len(spans) * args.max_tokens
    mode = "model worker in its own process (--worker-process)" if worker_process else "model worker thread"
    return [
        f"{mode}: under load {len(spans)} requests ended ({tokens / args.seconds:.0f} tokens/s)\n",
        "| server | p50 ms | p90 ms | p99 ms | max ms | answered | age p50 ms | age p99 ms | age max ms | dated "
        "| running |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        row("idle", idle),
        row(f"{args.clients} streams", loaded, ages, dated, f"{consistent}/{len(answered)}"),
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="scraping time per phase")
    parser.add_argument("--clients", type=int, default=16, help="streaming clients under load")
    parser.add_argument("--max-active", type=int, default=4, help="model slots of the server")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument(
        "--worker-process",
        action="store_true",
        help="also measure a server run with --worker-process (both tables are printed)",
    )
    args = parser.parse_args()
    if args.clients <= args.max_active:
        parser.error("--clients must exceed --max-active, so that requests queue")

    tables: list[str] = []
    with tempfile.TemporaryDirectory() as directory:
        core, key = build(Path(directory), max_rows=max(8, args.max_active))
        try:
            for worker_process in (False, True) if args.worker_process else (False,):
                tables += measure_mode(args, core, key, worker_process)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
    print(
        f"{date.today()}, {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; {args.seconds:g} s per phase, {args.clients} clients, "
        f"--max-active {args.max_active}, {args.max_tokens} tokens per request\n"
    )
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
