"""Helios on Ray Serve, end to end on loopback: two replicas of the tiny fixture core behind Ray
Serve's HTTP proxy serve concurrent chats (JSON and SSE, the official client too), route equal
prompts to the same replica, and a replica whose Helios process is killed mid-run fails only its
own requests and is replaced. Runs under ``tox -e ray``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from helios_ray import affinity_key, build_app, rendezvous_order  # noqa: E402
from helios_ray.process import HeliosProcess, free_loopback_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
NAMESPACE = "helios-fixtures/golden"
MODEL = "llama-synthetic-tiny"


@dataclass(frozen=True)
class Served:
    url: str
    core: Path


def helios_processes(core: Path) -> set[int]:
    """Pids of the ``helios run`` processes serving ``core`` (a path unique to this test module)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(core).encode() in argv and b"run" in argv:
            pids.add(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("helios-ray")
    core = directory / "ray-fixture.core"
    shutil.copyfile(FIXTURES / "payload-v3.core", core)
    port = free_loopback_port()
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=96 * 1024 * 1024, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            ["--core", str(core), "--trust-key", str(FIXTURES / "keys" / "signing.pub.pem"), "--accept", NAMESPACE,
             "--backend", "reference", "--shutdown-timeout", "2"],
            num_replicas=2,
            shutdown_timeout_s=2.0,
            startup_timeout_s=60.0,
            health_check_period_s=1.0,
            health_check_timeout_s=5.0,
            replica_actor_options={"num_cpus": 0},
        )  # fmt: skip
        serve.run(app, name="helios", route_prefix="/")
        yield Served(f"http://127.0.0.1:{port}", core)
    finally:
        serve.shutdown()
        ray.shutdown()
    deadline = time.monotonic() + 10
    while helios_processes(core) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert helios_processes(core) == set()


def chat(client: httpx.Client, url: str, prompt: str, *, stream: bool, max_tokens: int = 6) -> tuple[bool, str, str]:
    """(succeeded, replica id, text) of one chat completion through the proxy."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}  # fmt: skip
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            replica = response.headers.get("x-helios-replica", "")
            if response.status_code != 200:
                response.read()
                return False, replica, response.text
            if not stream:
                response.read()
                return True, replica, response.json()["choices"][0]["message"]["content"]
            text, done = "", False
            for line in response.iter_lines():
                if line.startswith("event: error"):
                    return False, replica, line
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text += delta.get("content") or ""
            return done, replica, text
    except httpx.HTTPError as exc:
        return False, "", f"{type(exc).__name__}: {exc}"


def test_responses_carry_each_header_once(served: Served) -> None:
    """Ray Serve's proxy writes ``date``, ``server`` and ``x-request-id`` itself: the ingress forwards none of
    Helios's, and Helios's request id (the response's ``id``) arrives as ``x-helios-request-id``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    response = httpx.post(
        f"{served.url}/v1/chat/completions", json=body, headers={"x-request-id": "mine-1"}, timeout=30
    )
    assert response.status_code == 200, response.text
    names = [name.lower() for name, _ in response.headers.multi_items()]
    repeated = sorted({name for name in names if names.count(name) > 1})
    assert repeated == [], response.headers
    assert response.headers["x-helios-request-id"] == response.json()["id"]
    assert response.headers["x-request-id"] == "mine-1"  # Ray Serve keeps the client's request id


def test_two_replicas_serve_concurrent_chats_with_prefix_affinity(served: Served) -> None:
    assert len(helios_processes(served.core)) == 2
    prompts = [f"request number {index}: tell me something" for index in range(16)]
    with httpx.Client() as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: chat(client, served.url, prompts[i], stream=i % 2 == 1), range(16)))
        assert [ok for ok, _, _ in results] == [True] * 16, results
        assert len({replica for _, replica, _ in results}) == 2
        # equal prompts (JSON or SSE) reach the same replica, and (greedy) get the same text
        again = list(pool.map(lambda i: chat(client, served.url, prompts[3], stream=i % 2 == 0), range(6)))
        assert {(ok, replica, text) for ok, replica, text in again} == {results[3]}
    # the official client, through the proxy
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompts[3]}], max_tokens=6, temperature=0
    )
    assert completion.choices[0].message.content == results[3][2]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompts[3]}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        if chunk.choices
    )
    assert streamed == results[3][2]


def test_a_killed_helios_process_fails_only_its_replicas_requests_and_is_replaced(served: Served) -> None:
    before = helios_processes(served.core)
    assert len(before) == 2
    # each replica's model worker runs in a process of its own
    assert all(b"--worker-process" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in before)
    victim = min(before)
    outcomes: list[tuple[float, bool, str]] = []
    killed_at: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(number: int) -> None:
        with httpx.Client() as client:
            for index in range(60):
                if stop.is_set():
                    return
                ok, replica, _ = chat(client, served.url, f"worker {number} request {index}", stream=index % 2 == 0)
                with lock:
                    outcomes.append((time.monotonic(), ok, replica))

    threads = [threading.Thread(target=worker, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # both replicas have served before the kill
            with lock:
                if len(outcomes) >= 8 and len({replica for _, ok, replica in outcomes if ok}) == 2:
                    break
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        killed_at.append(time.monotonic())
        # wait for the replacement: two Helios processes again, the victim gone, and its replica serving
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            current = helios_processes(served.core)
            if len(current) == 2 and victim not in current:
                break
            time.sleep(0.2)
        assert victim not in helios_processes(served.core) and len(helios_processes(served.core)) == 2
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    replicas_before = {replica for at, ok, replica in outcomes if at < killed_at[0] and ok}
    assert len(replicas_before) == 2
    # no failure before the kill; after it, failures only on the one replica whose Helios died
    assert [ok for at, ok, _ in outcomes if at < killed_at[0]] == [True] * sum(
        at < killed_at[0] for at, _, _ in outcomes
    )
    failed_replicas = {replica for _, ok, replica in outcomes if not ok}
    assert len(failed_replicas) <= 1 and failed_replicas <= replicas_before
    survivor = replicas_before - failed_replicas if failed_replicas else set()
    assert all(ok for _, ok, replica in outcomes if replica in survivor)
    # after the replacement every request succeeds, and the new replica takes its share
    serving: set[str] = set()
    deadline = time.monotonic() + 60
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        for attempt in itertools.count():
            if len(serving) >= 2 or time.monotonic() >= deadline:
                break
            # new prompts each attempt: their affinity keys spread over the replicas anew (the same eight
            # keys could all favour one replica for good)
            prompts = [(f"after the kill, attempt {attempt}, request {i}", i % 2 == 0) for i in range(8)]
            after = list(pool.map(lambda item: chat(client, served.url, item[0], stream=item[1]), prompts))
            assert [ok for ok, _, _ in after] == [True] * 8, after
            serving |= {replica for _, replica, _ in after}
    assert len(serving) == 2
    assert len(serving - replicas_before) == 1, "the replaced replica has a new id"
    assert failed_replicas <= replicas_before - serving


def test_the_affinity_key_reads_the_conversation_or_the_prompt() -> None:
    messages = [
        {"role": "system", "content": "S" * 10},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    chat_body = json.dumps({"messages": messages}).encode()
    assert affinity_key(chat_body, 256) == "system:SSSSSSSSSS\nuser:hello\n"
    assert affinity_key(chat_body, 8) == "system:S"
    assert affinity_key(json.dumps({"prompt": ["abc", "def"]}).encode(), 256) == "abc"
    assert affinity_key(json.dumps({"prompt": [1, 2, 3]}).encode(), 256) == "[1, 2, 3]"
    assert affinity_key(b"not json", 256) is None
    assert affinity_key(b"{}", 256) is None


def test_rendezvous_order_moves_only_the_keys_of_a_removed_replica() -> None:
    keys = [f"prefix {index}" for index in range(200)]
    three = {key: rendezvous_order(key, ["a", "b", "c"])[0] for key in keys}
    two = {key: rendezvous_order(key, ["a", "c"])[0] for key in keys}
    assert {key for key in keys if three[key] != two[key]} == {key for key in keys if three[key] == "b"}
    assert set(three.values()) == {"a", "b", "c"}


def test_a_process_that_cannot_start_is_reported(tmp_path: Path) -> None:
    process = HeliosProcess(["--core", str(tmp_path / "missing.core")], startup_timeout_s=30)
    with pytest.raises(RuntimeError, match="helios run exited with status 1 before it was ready"):
        process.start()
    with pytest.raises(ValueError, match="run_args must not contain --port"):
        HeliosProcess(["--core", "x.core", "--port", "9000"])
