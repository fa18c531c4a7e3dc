"""A loopback fleet: three ``helios run`` processes as an inference gateway and llm-d's KV-cache indexer
see them.

The three servers serve the tiny golden fixture core (4-token pages) on the reference backend with two
model slots and a 24-page cache, and publish KV-cache events to one ZeroMQ subscriber that binds (llm-d's
central mode; each server connects, with a replay socket of its own). The test

* scrapes ``/metrics`` with a strict reading (every gateway gauge one series, declared
  ``# TYPE ... gauge``) while five slow requests saturate one server: some scrape sees exactly two
  running and three waiting, the cache usage is a whole number of pages, and idle cached pages count as
  free once the requests are done;
* rebuilds each server's prefix index from its events alone, as llm-d's indexer does (blocks keyed by
  their parent and exact token ids; a gap in the sequence numbers is filled from the replay socket), and
  after a scripted workload that evicts, finds it equal to what the server really reuses: the index
  holds as many blocks as the server's published-minus-evicted pages, and for every probe prompt the
  reuse predicted from the index equals the ``cached_tokens`` the server reports;
* stops the servers: each exits 0 and its last event clears its index.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from helios_core.server.kv_events import END_OF_REPLAY
from tests.server.conftest import FIXTURES, KEYS, MODEL, NAMESPACE, ROOT, free_port
from tests.server.helpers import wait_for

SERVERS = 3
CACHE_PAGES = 24
PAGE_TOKENS = 4
MAX_ACTIVE = 2
GATEWAY_GAUGES = (
    "helios_num_requests_waiting",
    "helios_num_requests_running",
    "helios_kv_cache_usage_ratio",
    "helios_cache_config_info",
)


@dataclass
class Server:
    port: int
    replay_port: int
    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def topic(self) -> str:
        return f"kv@127.0.0.1:{self.port}@{MODEL}"

    def drain_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if "ready: serving" in line:
                self.ready.set()


def start_server(events_port: int) -> Server:
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "",
    }
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(FIXTURES / "payload-v3.core"),
        "--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE, "--backend", "reference",
        "--port", str(port), "--max-active", str(MAX_ACTIVE), "--queue-capacity", "8",
        "--cache-pages", str(CACHE_PAGES), "--kv-events-config", json.dumps(config),
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    server = Server(port, replay_port, process)
    threading.Thread(target=server.drain_log, daemon=True).start()
    return server


# -- the strict metrics reading --------------------------------------------------------------------------


def scrape(server: Server) -> dict[str, Any]:
    """Every family's samples by name, checking the gateway gauges as the gateway's parser needs them."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a family is exposed twice"
    values: dict[str, Any] = {}
    for family in families:
        if family.name in GATEWAY_GAUGES:
            assert family.type == "gauge" and f"# TYPE {family.name} gauge\n" in text, family.name
            assert len(family.samples) == 1, family.samples
            assert family.samples[0].timestamp is None
        for sample in family.samples:
            values[sample.name] = sample.labels if family.name == "helios_cache_config_info" else sample.value
    assert all(name in values for name in GATEWAY_GAUGES)
    return values


# -- the indexer -------------------------------------------------------------------------------------------


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[list[Any]]


@dataclass
class ServerIndex:
    """One server's blocks as its events describe them: engine hash -> (parent hash, token ids)."""

    blocks: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    next_sequence: int = 0
    events: int = 0
    last_event: str = ""

    def apply(self, events: list[list[Any]]) -> None:
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, tokens, block_size = event[1], event[2], event[3], event[4]
                assert block_size == PAGE_TOKENS and len(tokens) == block_size * len(hashes)
                assert event[6] == "GPU"
                for index, block in enumerate(hashes):
                    assert block not in self.blocks, "a block announced twice"
                    chunk = tuple(tokens[index * block_size : (index + 1) * block_size])
                    self.blocks[block] = (parent, chunk)
                    parent = block
            elif tag == "BlockRemoved":
                for block in event[1]:
                    assert self.blocks.pop(block, None) is not None, "a block removed that was never stored"
            else:
                assert event == ["AllBlocksCleared"]
                self.blocks.clear()
            self.events += 1
            self.last_event = tag

    def reusable_tokens(self, prompt: list[int]) -> int:
        """The prompt tokens a server holding these blocks reuses: the longest chain of blocks equal to
        the prompt's complete pages, keyed by content as llm-d's indexer does (a server matches at most
        ``len(prompt) - 1`` tokens: the last one is always computed)."""
        by_content = {(parent, tokens): block for block, (parent, tokens) in self.blocks.items()}
        parent: int | None = None
        pages = 0
        for start in range(0, len(prompt) - 1 - PAGE_TOKENS + 1, PAGE_TOKENS):
            block = by_content.get((parent, tuple(prompt[start : start + PAGE_TOKENS])))
            if block is None:
                break
            parent = block
            pages += 1
        return pages * PAGE_TOKENS


class Indexer:
    """A ZeroMQ SUB socket bound for the fleet, read all the time by its own thread (as a real indexer
    is: a subscriber sends its subscription only once its owner has taken the new connection), and each
    server's index."""

    def __init__(self, context: zmq.Context[Any], port: int) -> None:
        self.context = context
        self.sub = context.socket(zmq.SUB)
        self.sub.bind(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.lock = threading.Lock()
        self.indexes: dict[str, ServerIndex] = {}
        self.replay_ports: dict[str, int] = {}
        self.replays = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="test-indexer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def index(self, server: Server) -> ServerIndex:
        """A copy of one server's index as of now (the reader thread goes on changing the original)."""
        with self.lock:
            if self.failure is not None:
                raise AssertionError("the indexer failed") from self.failure
            index = self.indexes.get(server.topic, ServerIndex())
            return ServerIndex(dict(index.blocks), index.next_sequence, index.events, index.last_event)

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sub.poll(20):
                    continue
                topic_bytes, sequence_bytes, payload = self.sub.recv_multipart()
                topic, sequence = topic_bytes.decode(), int.from_bytes(sequence_bytes, "big")
                with self.lock:
                    index = self.indexes.setdefault(topic, ServerIndex())
                    if sequence > index.next_sequence:  # missed while the subscription travelled: replay the gap
                        self._replay(topic, index, sequence)
                    assert sequence == index.next_sequence, (topic, sequence, index.next_sequence)
                    index.apply(msgspec.msgpack.decode(payload, type=Batch).events)
                    index.next_sequence = sequence + 1
        except BaseException as exc:
            self.failure = exc
        finally:
            self.sub.close(linger=0)

    def _replay(self, topic: str, index: ServerIndex, until: int) -> None:
        self.replays += 1
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_ports[topic]}")
        try:
            dealer.send_multipart([b"", index.next_sequence.to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "the replay socket did not answer"
                _, sequence_bytes, payload = dealer.recv_multipart()
                if sequence_bytes == END_OF_REPLAY:
                    return
                sequence = int.from_bytes(sequence_bytes, "big")
                if index.next_sequence <= sequence < until:
                    assert sequence == index.next_sequence
                    index.apply(msgspec.msgpack.decode(payload, type=Batch).events)
                    index.next_sequence = sequence + 1
        finally:
            dealer.close(linger=0)

    def settle(self, server: Server) -> ServerIndex:
        """Wait until this subscriber has every event the server has sent, and nothing more comes."""
        deadline = time.monotonic() + 10
        steady = 0
        while steady < 3:
            values = scrape(server)
            assert values["helios_kv_events_dropped_total"] == 0
            index = self.index(server)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the events of {server.topic} did not settle: {values['helios_kv_events_published_total']} "
                    f"published, {index.events} received"
                )
            steady = steady + 1 if index.events == values["helios_kv_events_published_total"] else 0
            time.sleep(0.02)
        return self.index(server)


# -- the fleet -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[Server], Indexer]]:
    context: zmq.Context[Any] = zmq.Context()
    events_port = free_port()
    indexer = Indexer(context, events_port)  # bound before any server connects
    servers = [start_server(events_port) for _ in range(SERVERS)]
    try:
        for server in servers:
            if not server.ready.wait(60):
                raise RuntimeError(f"a server did not start: {''.join(server.log)}")
            indexer.replay_ports[server.topic] = server.replay_port
        yield servers, indexer
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()
        indexer.close()
        context.destroy(linger=0)


def complete(server: Server, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_saturation_gauges_read_the_known_occupancy(fleet: tuple[list[Server], Indexer]) -> None:
    """Five requests of 48 tokens (12 pages each, so two fill the cache without preemption) on two model
    slots: two run and three wait until the first pair ends."""
    server = fleet[0][0]
    idle = scrape(server)
    assert idle["helios_cache_config_info"] == {"block_size": str(PAGE_TOKENS), "num_gpu_blocks": str(CACHE_PAGES)}
    assert (idle["helios_num_requests_waiting"], idle["helios_num_requests_running"]) == (0, 0)
    seen: list[tuple[float, float, float]] = []
    for attempt in range(10):  # a scrape must land while the first pair runs (about 0.1 s): retried if not
        done = threading.Event()
        threads = [
            threading.Thread(target=complete, args=(server, [30 + attempt, 31 + lane, 32, 33, 34], 43))
            for lane in range(5)
        ]
        for thread in threads:
            thread.start()

        def sample(done: threading.Event = done) -> None:
            while not done.is_set():
                values = scrape(server)
                seen.append(
                    (
                        values["helios_num_requests_waiting"],
                        values["helios_num_requests_running"],
                        values["helios_kv_cache_usage_ratio"],
                    )
                )

        sampler = threading.Thread(target=sample)
        sampler.start()
        for thread in threads:
            thread.join(30)
        done.set()
        sampler.join(10)
        if any(reading[:2] == (3, 2) for reading in seen):
            break
    saturated = [usage for waiting, running, usage in seen if (waiting, running) == (3, 2)]
    assert saturated, f"no scrape saw two running and three waiting: {sorted(set(r[:2] for r in seen))}"
    for waiting, running, usage in seen:
        assert 0 <= running <= MAX_ACTIVE and waiting + running <= 5
        assert 0.0 <= usage <= 1.0 and abs(usage * CACHE_PAGES - round(usage * CACHE_PAGES)) < 1e-9
    # Two running requests hold at least their prompts' two pages each. (The gauges are read one after the
    # other, not as one snapshot: a scrape racing the pair's end can see them running and their pages
    # already released, so this holds for the fullest saturated reading.)
    assert max(saturated) >= 2 * 2 / CACHE_PAGES, saturated
    wait_for(lambda: scrape(server)["helios_num_requests_running"] == 0, timeout=5.0)
    after = scrape(server)
    assert (after["helios_num_requests_waiting"], after["helios_kv_cache_usage_ratio"]) == (0, 0.0)
    assert after["helios_pages_evictable"] > 0  # the requests' pages stay cached, and count as free


def workload(seed: int) -> list[list[int]]:
    """Three 3-page prefixes, each followed by four 2-page suffixes: 33 distinct pages, more than the cache."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(20, 250) for _ in range(3 * PAGE_TOKENS)] for _ in range(3)]
    prompts = [
        prefix + [rng.randrange(20, 250) for _ in range(2 * PAGE_TOKENS)] for prefix in prefixes for _ in range(4)
    ]
    rng.shuffle(prompts)
    return prompts


def test_the_rebuilt_index_equals_each_servers_reusable_prefixes(fleet: tuple[list[Server], Indexer]) -> None:
    servers, indexer = fleet
    scripts = {server.topic: workload(seed) for seed, server in enumerate(servers)}
    for step in range(len(next(iter(scripts.values())))):
        for server in servers:  # the servers take their requests interleaved
            complete(server, scripts[server.topic][step])
    probes_checked = 0
    reuse: dict[int, int] = {}
    """How many probes reused how many tokens."""
    for server in servers:
        index = indexer.settle(server)
        values = scrape(server)
        assert values["helios_pages_evicted_total"] > 0, "the workload must evict"
        wait_for(
            lambda server=server: (
                len(indexer.settle(server).blocks)
                == scrape(server)["helios_pages_published_total"] - scrape(server)["helios_pages_evicted_total"]
            ),
            timeout=5.0,
        )
        rng = random.Random(server.port)
        prompts = scripts[server.topic]
        probes = [*prompts, *(prompt[: 3 * PAGE_TOKENS + 1] for prompt in prompts[:4]), [7, 8, 9, 10, 11]]
        rng.shuffle(probes)
        for prompt in probes:
            predicted = index.reusable_tokens(prompt)
            reported = complete(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert reported == predicted, (server.topic, prompt)
            probes_checked += 1
            reuse[predicted] = reuse.get(predicted, 0) + 1
            index = indexer.settle(server)
    assert probes_checked == SERVERS * 17
    assert reuse.get(0, 0) > 0 and reuse.get(12, 0) + reuse.get(16, 0) > 0, reuse  # misses and long hits
    assert all(indexer.index(server).blocks for server in servers)


def test_stopping_a_server_clears_its_index(fleet: tuple[list[Server], Indexer]) -> None:
    servers, indexer = fleet
    for server in servers:
        server.process.send_signal(signal.SIGTERM)
    for server in servers:
        assert server.process.wait(timeout=20) == 0, "".join(server.log)
    wait_for(lambda: all(indexer.index(s).last_event == "AllBlocksCleared" for s in servers), timeout=5.0)
    assert all(not indexer.index(s).blocks for s in servers)
    assert not any("Traceback" in line for server in servers for line in server.log)
