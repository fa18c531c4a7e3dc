"""KV-cache events over ZeroMQ: ``--kv-events-config``, the golden wire bytes, the publisher's sockets,
replay, the bounded queue's drop counter, the events of real requests through the engine, and a
``helios run --worker-process`` server whose publisher runs in the worker process."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from helios_core.errors import StartupError
from helios_core.runtime.kv_events import (
    END_OF_REPLAY,
    KvEventPublisher,
    KvEventsConfig,
    binds,
    encode_batch,
    encode_event,
    frames,
)
from helios_core.runtime.pages import PageAllocator
from helios_core.server.kv_events import default_topic, parse_kv_events_config, publisher_counters
from helios_core.server.serve import resolve_options
from tests.server.conftest import FIXTURES, KEYS, MODEL, NAMESPACE, ROOT, free_port, serve_fixture
from tests.server.helpers import wait_for
from tests.server.test_fleet import CACHE_PAGES, MAX_ACTIVE, PAGE_TOKENS, Indexer, Server, scrape, workload

# -- the configuration -------------------------------------------------------------------------------


def test_vllm_json_decodes_with_vllm_defaults() -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null,'
        ' "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}'
    )
    assert config == KvEventsConfig(enable_kv_cache_events=True)
    assert config.enabled
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').endpoint == "tcp://*:5557"
    assert not parse_kv_events_config("{}").enabled  # vLLM's default: off
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field `endpont`"),
        ('{"hwm": "many"}', r"Expected `int`, got `str` - at `\$.hwm`"),
        ('{"enable_kv_cache_events": 1}', r"Expected `bool`, got `int` - at `\$.enable_kv_cache_events`"),
        ('{"publisher": "kafka"}', r"Invalid enum value 'kafka' - at `\$.publisher`"),
        ('{"max_queue_size": 0}', r"Expected `int` >= 1 - at `\$.max_queue_size`"),
        ('{"replay_endpoint": ""}', "replay_endpoint must not be empty"),
        ('{"enable_kv_cache_events": true, "endpoint": ""}', "endpoint must not be empty"),
        ("[1]", "Expected `object`, got `array`"),
        ("{", "is not JSON"),
    ],
)
def test_bad_configs_are_startup_errors_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(StartupError, match=f"^--kv-events-config.*{message}"):
        parse_kv_events_config(text)


def test_the_option_comes_from_the_environment_or_a_config_table(tmp_path: Path) -> None:
    text = '{"enable_kv_cache_events": true, "topic": "t"}'
    options = resolve_options({"core": Path("x")}, None, {"HELIOS_KV_EVENTS_CONFIG": text})
    assert options.kv_events_config == text
    config = tmp_path / "helios.toml"
    config.write_text('core = "c.core"\n[kv-events-config]\nenable_kv_cache_events = true\nhwm = 5\n')
    resolved = resolve_options({}, config, {})
    assert resolved.kv_events_config is not None
    assert parse_kv_events_config(resolved.kv_events_config) == KvEventsConfig(enable_kv_cache_events=True, hwm=5)
    with pytest.raises(StartupError, match=r"kv-events-config \(from \$HELIOS_KV_EVENTS_CONFIG\).*unknown field `x`"):
        resolve_options({"core": Path("x")}, None, {"HELIOS_KV_EVENTS_CONFIG": '{"x": 1}'})


def test_the_command_line_option_reaches_the_run_options() -> None:
    from helios_core.cli import _RUN_OPTIONS, build_parser

    args = build_parser().parse_args(["run", "--core", "c.core", "--kv-events-config", '{"topic": "t"}'])
    options = resolve_options({name: getattr(args, name) for name in _RUN_OPTIONS}, None, {})
    assert options.kv_events_config == '{"topic": "t"}'


def test_the_bind_or_connect_rule_and_the_default_topic() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x") and binds("inproc://x")
    assert not binds("tcp://10.0.0.1:5557") and not binds("tcp://epp.local:5557")
    assert default_topic("10.1.2.3", 8000, "tiny") == "kv@10.1.2.3:8000@tiny"


def test_an_endpoint_that_cannot_be_used_is_a_startup_error(tmp_path: Path, context: zmq.Context[Any]) -> None:
    with pytest.raises(StartupError, match=r"cannot connect to endpoint 'bogus://nowhere'"):
        KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint="bogus://nowhere"), "t")
    port = free_port()
    holder = context.socket(zmq.ROUTER)
    holder.bind(f"tcp://127.0.0.1:{port}")
    replay = f"tcp://127.0.0.1:{port}"
    with pytest.raises(StartupError, match=f"cannot bind replay_endpoint '{replay}'"):
        KvEventPublisher(KvEventsConfig(True, endpoint=f"ipc://{tmp_path}/a", replay_endpoint=replay), "t")


# -- the wire format ----------------------------------------------------------------------------------

KEY = bytes(range(16))  # on the wire: 0x08090a0b0c0d0e0f
PARENT = bytes(8) + b"\xff" * 8  # on the wire: 2**64 - 1 (an unsigned integer)

GOLDEN_PAYLOAD = bytes.fromhex(
    "92"  # the batch: an array of two
    "cb3ff8000000000000"  # timestamp 1.5, float 64
    "93"  # three events
    "97" "ab" + b"BlockStored".hex()  # an array of seven; the tag
    + "91cf08090a0b0c0d0e0f"  # block_hashes: [uint64]
    "cfffffffffffffffff"  # parent_block_hash
    "94" "01" "02" "cd012c" "ce00011170"  # token_ids [1, 2, 300, 70000]
    "04"  # block_size
    "c0"  # lora_id nil
    "a3" + b"GPU".hex()  # medium
    + "93" "ac" + b"BlockRemoved".hex() + "91cf08090a0b0c0d0e0f" "a3" + b"GPU".hex()
    + "91" "b0" + b"AllBlocksCleared".hex()
)  # fmt: skip


def test_golden_payload_bytes() -> None:
    events = [
        encode_event((0, KEY, PARENT, [1, 2, 300, 70000], 4)),
        encode_event((1, KEY)),
        encode_event((2,)),
    ]
    assert encode_batch(1.5, events) == GOLDEN_PAYLOAD
    assert encode_event((0, KEY, None, [7, 8], 2))[2] is None  # a prefix's first page has no parent


def test_golden_frames() -> None:
    assert frames(b"kv@127.0.0.1:8000@tiny", 5, b"\x90") == [
        b"kv@127.0.0.1:8000@tiny",
        b"\x00\x00\x00\x00\x00\x00\x00\x05",
        b"\x90",
    ]
    assert END_OF_REPLAY == b"\xff" * 8


class Batch(msgspec.Struct, array_like=True):
    """The batch as llm-d's decoder reads it (positional, field order of its structs)."""

    ts: float
    events: list[msgspec.Raw]


class Tag(msgspec.Struct, array_like=True):
    tag: str


class BlockStored(msgspec.Struct, array_like=True):
    tag: str
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True):
    tag: str
    block_hashes: list[int]
    medium: str | None = None


def decode(payload: bytes) -> tuple[float, list[Any]]:
    """A payload decoded by an independent msgpack decoder into llm-d's field order."""
    batch = msgspec.msgpack.decode(payload, type=Batch)
    events: list[Any] = []
    for raw in batch.events:
        tag = msgspec.msgpack.decode(raw, type=list[Any])[0]
        if tag == "BlockStored":
            events.append(msgspec.msgpack.decode(raw, type=BlockStored))
        elif tag == "BlockRemoved":
            events.append(msgspec.msgpack.decode(raw, type=BlockRemoved))
        else:
            assert msgspec.msgpack.decode(raw, type=list[Any]) == ["AllBlocksCleared"]
            events.append("AllBlocksCleared")
    return batch.ts, events


def test_an_independent_decoder_reads_the_golden_payload_in_llm_d_field_order() -> None:
    ts, events = decode(GOLDEN_PAYLOAD)
    assert ts == 1.5
    assert events == [
        BlockStored("BlockStored", [0x08090A0B0C0D0E0F], 2**64 - 1, [1, 2, 300, 70000], 4, None, "GPU"),
        BlockRemoved("BlockRemoved", [0x08090A0B0C0D0E0F], "GPU"),
        "AllBlocksCleared",
    ]


# -- the publisher ------------------------------------------------------------------------------------


def wire(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def receive(sub: zmq.Socket[Any], timeout_s: float = 5.0) -> list[bytes]:
    if not sub.poll(int(timeout_s * 1000)):
        raise TimeoutError("no batch arrived")
    return sub.recv_multipart()


def synchronise(publisher: KvEventPublisher, sub: zmq.Socket[Any]) -> int:
    """Clear until the subscriber hears one (a subscription needs a moment to reach the publisher);
    the sequence number the next batch will carry."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.all_cleared()
        if sub.poll(100):
            while sub.poll(50):
                _topic, sequence, payload = sub.recv_multipart()
            assert decode(payload)[1] == ["AllBlocksCleared"]
            return int.from_bytes(sequence, "big") + 1
    raise TimeoutError("the subscriber heard nothing")


def wait_published(publisher: KvEventPublisher, count: int) -> None:
    deadline = time.monotonic() + 5
    while publisher.published < count:
        if time.monotonic() > deadline:
            raise TimeoutError("events were not published")
        time.sleep(0.002)


def test_a_connecting_publisher_sends_numbered_batches_of_the_allocators_events(context: zmq.Context[Any]) -> None:
    """The subscriber binds (llm-d's central mode); an endpoint without a wildcard makes the server connect."""
    port = free_port()
    sub = context.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    publisher = KvEventPublisher(KvEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"), "kv@pod:1@tiny")
    pages = PageAllocator(2, 2, "id")
    try:
        publisher.attach(pages)
        first_sequence = synchronise(publisher, sub)
        owned = pages.allocate(1) or []
        key = pages.chain_hash(None, [7, 9])
        pages.publish(owned[0], key, parent=None, tokens=[7, 9])
        topic, sequence, payload = receive(sub)
        assert topic == b"kv@pod:1@tiny"
        assert int.from_bytes(sequence, "big") == first_sequence
        ts, events = decode(payload)
        assert abs(ts - time.time()) < 5
        assert events == [BlockStored("BlockStored", [wire(key)], None, [7, 9], 2, None, "GPU")]
        pages.release(owned)
        pages.allocate(2)  # evicts the published page
        topic, sequence, payload = receive(sub)
        assert int.from_bytes(sequence, "big") == first_sequence + 1
        assert decode(payload)[1] == [BlockRemoved("BlockRemoved", [wire(key)], "GPU")]
    finally:
        publisher.close()
    # Closing detaches from the allocator: the last batch clears everything.
    topic, sequence, payload = receive(sub)
    assert int.from_bytes(sequence, "big") == first_sequence + 2
    assert decode(payload)[1] == ["AllBlocksCleared"]
    assert not sub.poll(100)


def test_a_binding_publisher_serves_subscribers_that_connect(tmp_path: Path, context: zmq.Context[Any]) -> None:
    """llm-d's pod-discovery mode: the server binds, the indexer connects."""
    endpoint = f"ipc://{tmp_path}/events"
    publisher = KvEventPublisher(KvEventsConfig(True, endpoint=endpoint), "kv@a@b")
    sub = context.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        publisher.attach(PageAllocator(2, 2, "id"))
        assert synchronise(publisher, sub) >= 1  # sequence 0 was the clear at attaching
    finally:
        publisher.close()


def test_replay_returns_the_kept_batches_from_the_start_sequence_then_the_end_marker(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    config = KvEventsConfig(
        True, endpoint=f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=3
    )
    publisher = KvEventPublisher(config, "t")
    pages = PageAllocator(8, 1, "id")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(config.replay_endpoint or "")
    try:
        publisher.attach(pages)  # batch 0: the clear
        wait_published(publisher, 1)
        for token in range(4):  # batches 1..4, one stored page each
            page = pages.allocate(1) or []
            pages.publish(page[0], pages.chain_hash(None, [token]), parent=None, tokens=[token])
            wait_published(publisher, 2 + token)

        def replay(start: int) -> list[tuple[int, list[Any]]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, list[Any]]] = []
            while True:
                assert dealer.poll(5000)
                empty, sequence, payload = dealer.recv_multipart()
                assert empty == b""
                if sequence == END_OF_REPLAY:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(sequence, "big"), decode(payload)[1]))

        kept = replay(0)  # only the last three batches are kept
        assert [sequence for sequence, _ in kept] == [2, 3, 4]
        assert [events[0].token_ids for _, events in kept] == [[1], [2], [3]]
        assert [sequence for sequence, _ in replay(4)] == [4]
        assert replay(5) == []
        dealer.send_multipart([b"", b"\x01"])  # malformed: ignored, the socket goes on serving
        assert [sequence for sequence, _ in replay(3)] == [3, 4]
    finally:
        publisher.close()


def test_a_full_queue_drops_and_counts_and_a_clear_always_fits(tmp_path: Path) -> None:
    """Nothing drains the queue before the publisher is attached: the worker's calls return at once."""
    publisher = KvEventPublisher(KvEventsConfig(True, endpoint=f"ipc://{tmp_path}/e", max_queue_size=2), "t")
    try:
        started = time.perf_counter()
        for index in range(5):
            publisher.page_stored(bytes(16), None, [index], 1)
        publisher.page_removed(bytes(16))
        assert time.perf_counter() - started < 0.5
        assert publisher.dropped == 4
        publisher.all_cleared()  # supersedes what is queued
        assert publisher.dropped == 4
        registry = CollectorRegistry(auto_describe=False)
        registry.register(publisher_counters(publisher))
        text = generate_latest(registry).decode()
        assert "# TYPE helios_kv_events_dropped_total counter\nhelios_kv_events_dropped_total 4.0\n" in text
        assert "helios_kv_events_published_total 0.0\n" in text
    finally:
        publisher.close()


# -- through the engine -------------------------------------------------------------------------------


def test_requests_publish_their_complete_prompt_pages_with_exact_tokens(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    """A 9-token prompt fills two 4-token pages: both are announced with the prompt's own ids, the second
    naming the first as parent; a second request reuses exactly what was announced."""
    endpoint = f"ipc://{tmp_path}/events"
    sub = context.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    with serve_fixture(max_active=2) as served:
        publisher = KvEventPublisher(KvEventsConfig(True, endpoint=endpoint), "t")
        try:
            publisher.attach(served.running.engine.allocator)
            synchronise(publisher, sub)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            first = httpx.post(served.base_url + "/v1/completions", json=body, timeout=30)
            assert first.status_code == 200, first.text
            stored: list[BlockStored] = []
            while len(stored) < 2:
                stored.extend(e for e in decode(receive(sub)[2])[1] if isinstance(e, BlockStored))
            assert [event.token_ids for event in stored] == [[11, 12, 13, 14], [15, 16, 17, 18]]
            assert [event.block_size for event in stored] == [4, 4]
            assert stored[0].parent_block_hash is None
            assert stored[1].parent_block_hash == stored[0].block_hashes[0]
            allocator = served.running.engine.allocator
            assert {wire(key) for key in allocator.published_keys()} == {e.block_hashes[0] for e in stored}
            again = httpx.post(served.base_url + "/v1/completions", json=body, timeout=30)
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
        finally:
            publisher.close()


# -- in the worker process ------------------------------------------------------------------------------


def start_worker_process_server(events_port: int) -> Server:
    """``helios run --worker-process`` on the golden core, connecting to a bound subscriber, with a replay
    socket (as each server of tests/server/test_fleet.py, whose helpers read it)."""
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(FIXTURES / "payload-v3.core"),
        "--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE, "--backend", "reference",
        "--port", str(port), "--max-active", str(MAX_ACTIVE), "--queue-capacity", "8",
        "--cache-pages", str(CACHE_PAGES), "--kv-events-config", json.dumps(config), "--worker-process",
    ]  # fmt: skip
    server = Server(port, replay_port, subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    threading.Thread(target=server.drain_log, daemon=True).start()
    return server


def replayed_events(context: zmq.Context[Any], server: Server) -> list[tuple[int, list[Any]]]:
    """Every batch the server's replay socket keeps, from sequence 0: (sequence, events)."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{server.replay_port}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[tuple[int, list[Any]]] = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, sequence, payload = dealer.recv_multipart()
            if sequence == END_OF_REPLAY:
                return batches
            batches.append((int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload)[1]))
    finally:
        dealer.close(linger=0)


def post_completion(server: Server, prompt: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_a_worker_process_server_publishes_from_the_worker_and_exports_its_counters(
    context: zmq.Context[Any],
) -> None:
    """The fleet test's indexer, fed by one ``--worker-process`` server: the first event clears, a prompt's
    complete pages arrive with their exact tokens, an evicting workload's index predicts every reuse the
    server reports, ``/metrics`` counts exactly the events sent, and stopping the server clears last."""
    events_port = free_port()
    indexer = Indexer(context, events_port)  # bound before the server connects
    server = start_worker_process_server(events_port)
    try:
        assert server.ready.wait(60), "".join(server.log)
        indexer.replay_ports[server.topic] = server.replay_port
        first_sequence, first_events = replayed_events(context, server)[0]
        assert (first_sequence, first_events[0]) == (0, ["AllBlocksCleared"])  # attached before the warm-up
        prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
        post_completion(server, prompt)

        def stored_pages() -> list[list[Any]]:
            pages = ([11, 12, 13, 14], [15, 16, 17, 18])
            replayed = replayed_events(context, server)
            return [
                event for _, events in replayed for event in events if event[0] == "BlockStored" and event[3] in pages
            ]

        wait_for(lambda: len(stored_pages()) == 2, timeout=5.0)
        stored = stored_pages()
        assert [(event[3], event[4], event[6]) for event in stored] == [
            ([11, 12, 13, 14], PAGE_TOKENS, "GPU"),
            ([15, 16, 17, 18], PAGE_TOKENS, "GPU"),
        ]
        assert stored[0][2] is None and stored[1][2] == stored[0][1][0]
        assert post_completion(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 8

        prompts = workload(seed=7)
        for prompt in prompts:
            post_completion(server, prompt)
        index = indexer.settle(server)  # also: dropped 0 and published == the events the indexer applied
        values = scrape(server)
        assert values["helios_pages_evicted_total"] > 0, "the workload must evict"
        assert values["helios_kv_events_dropped_total"] == 0
        removed = sum(event[0] == "BlockRemoved" for _, events in replayed_events(context, server) for event in events)
        assert removed > 0
        assert len(index.blocks) == values["helios_pages_published_total"] - values["helios_pages_evicted_total"]
        probes = [*prompts[:6], *(prompt[: 3 * PAGE_TOKENS + 1] for prompt in prompts[:3]), [7, 8, 9, 10, 11]]
        random.Random(3).shuffle(probes)
        for probe in probes:
            predicted = index.reusable_tokens(probe)
            assert post_completion(server, probe)["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
            index = indexer.settle(server)
        assert index.blocks

        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0, "".join(server.log)
        wait_for(lambda: indexer.index(server).last_event == "AllBlocksCleared", timeout=5.0)
        assert not indexer.index(server).blocks
        assert not any("Traceback" in line for line in server.log)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
        indexer.close()


def test_a_worker_process_publisher_that_cannot_start_fails_the_start_with_its_reason() -> None:
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": "bogus://nowhere"})
    command = [
        sys.executable, "-m", "helios_core.cli", "run", "--core", str(FIXTURES / "payload-v3.core"),
        "--trust-key", str(KEYS / "signing.pub.pem"), "--accept", NAMESPACE, "--backend", "reference",
        "--port", str(free_port()), "--kv-events-config", config, "--worker-process",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "helios run: error: --kv-events-config: cannot connect to endpoint 'bogus://nowhere': "
        "Protocol not supported (addr='bogus://nowhere')"
    )
    assert "Traceback" not in result.stderr
