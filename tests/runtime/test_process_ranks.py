"""Process ranks: a leader (rank 0, in the test process) and rank processes that join it over loopback.

The two-rank fixture ``tp2-tiny.core`` holds the weights of ``payload-v3.core`` split over two ranks, so
process ranks, thread ranks and the one-rank core give the same greedy tokens (what the thread-rank tests
compare for their tensor-parallel cores). Rank processes are ``helios rank`` subprocesses; the handshake
tests drive the leader's side with in-process peers, and the four-rank core (built in the test with
``tensor_parallel=4``) runs its three rank peers as threads of this process over the same sockets.
"""

from __future__ import annotations

import logging
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends import rank_processes as rp
from helios_core.backends.rank_processes import (
    ProcessRankedBackend,
    ProcessRankSettings,
    contract_digest,
    gather_peers,
    join_leader,
    read_secret_file,
    run_rank_process,
)
from helios_core.backends.ranks import RankError
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import LoadOptions
from helios_core.errors import StartupError
from helios_core.loading import TrustSettings, open_core
from helios_core.runtime.messages import ExecutionFailed, Finished
from helios_core.runtime.startup import RunningModel, start

from .conftest import FIXTURES, fixture_settings
from .engine_harness import FailingRank, SignedCore, build_signed_core, prompt_of, solo_tokens, submit_all, token_ids

ROOT = Path(__file__).resolve().parents[2]
TP2 = FIXTURES / "tp2-tiny.core"
SECRET = b"a long shared secret of the rank processes"
DEADLINE_S = 10.0
"""Every wait of these tests (a rank joining, a process ending): short, so a hang fails the test."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def secret_file(directory: Path, content: bytes = SECRET, mode: int = 0o600) -> Path:
    path = directory / "rank.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def spawn_rank(core: Path, trust: TrustSettings, port: int, rank: int, secret: Path) -> subprocess.Popen[str]:
    """``helios rank`` joining the leader at 127.0.0.1:``port``."""
    command = [sys.executable, "-m", "helios_core.cli", "rank", "--core", str(core), "--join", f"127.0.0.1:{port}"]
    command += ["--rank", str(rank), "--rank-secret-file", str(secret), "--rank-join-timeout", str(DEADLINE_S)]
    for key in trust.trust_keys:
        command += ["--trust-key", str(key)]
    command += ["--accept", str(trust.acceptance)]
    return subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    """The process's exit status and stderr (killed first if it is still running after the deadline)."""
    try:
        _, stderr = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"the process did not end within {DEADLINE_S} s: {stderr}")
    return process.returncode, stderr


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Rank processes a test spawns; any still running afterwards is killed."""
    spawned: list[subprocess.Popen[str]] = []
    yield spawned
    for process in spawned:
        if process.poll() is None:
            process.kill()
        process.communicate()


def lead(core: Path, trust: TrustSettings, port: int, started: list[RunningModel], **settings: Any) -> RunningModel:
    """Start ``core`` as the leader listening at 127.0.0.1:``port`` (closed after the test)."""
    peers = ProcessRankSettings("127.0.0.1", port, SECRET, join_timeout_s=DEADLINE_S, **settings)
    model = start(core, trust, LoadOptions(rank_peers=peers), backend="reference")
    started.append(model)
    return model


def greedy(model: RunningModel, count: int = 3, tokens: int = 8) -> list[list[int]]:
    return solo_tokens(model.engine, [prompt_of(index) for index in range(count)], tokens)


# ------------------------------------------------------------------------------------------------ the same tokens


def test_process_ranks_give_the_thread_ranks_and_the_one_rank_cores_greedy_tokens(
    tmp_path: Path, started: list[RunningModel], processes: list[subprocess.Popen[str]]
) -> None:
    one_rank = start(FIXTURES / "payload-v3.core", fixture_settings(), LoadOptions(), backend="reference")
    started.append(one_rank)
    expected = greedy(one_rank)
    threads = start(TP2, fixture_settings(), LoadOptions(), backend="reference")
    started.append(threads)
    assert greedy(threads) == expected

    port = free_port()
    processes.append(spawn_rank(TP2, fixture_settings(), port, 1, secret_file(tmp_path)))
    leader = lead(TP2, fixture_settings(), port, started)
    backend = leader.model.backend
    assert isinstance(backend, ProcessRankedBackend)
    assert backend.size == 2
    assert leader.model.manifests().ranks == 2
    assert greedy(leader) == expected
    streams = submit_all(leader.engine, [prompt_of(index) for index in range(3)], 8)  # batched rounds
    for stream, tokens in zip(streams, expected, strict=True):
        events = list(stream)
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert token_ids(events) == tokens
    leader.close()
    started.remove(leader)
    status, stderr = finish(processes[0])
    assert status == 0
    assert stderr.splitlines()[-1] == "helios rank: stopped: the leader is shutting down"


TP_CAPS = Capacities(max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64)


@pytest.fixture(scope="module")
def small_cores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, SignedCore]:
    """``llama-synthetic-small`` (seed 5) for one rank and for four tensor-parallel ranks."""
    directory = tmp_path_factory.mktemp("process-ranks")
    declaration = synthetic_declaration("small", seed=5)
    builders = {ranks: partial(build_core, tensor_parallel=ranks) for ranks in (0, 4)}
    return {
        ranks: build_signed_core(builder, declaration, TP_CAPS, directory, "helios-tests/ranks", name=f"tp{ranks}")
        for ranks, builder in builders.items()
    }


def test_four_ranks_over_sockets_give_the_one_rank_cores_greedy_tokens(
    small_cores: dict[int, SignedCore], started: list[RunningModel]
) -> None:
    expected = greedy(start_one(small_cores[0], started))
    core = small_cores[4]
    port = free_port()
    outcomes: dict[int, Any] = {}

    def peer(rank: int) -> None:
        verified = open_core(core.path, core.trust, check_resources=False)
        try:
            outcomes[rank] = run_rank_process(
                verified.contract, verified.core, "127.0.0.1", port, rank, SECRET, timeout_s=DEADLINE_S
            )
        except Exception as exc:  # the outcome under test
            outcomes[rank] = exc
        finally:
            verified.close()

    peers = [threading.Thread(target=peer, args=(rank,), daemon=True) for rank in (1, 2, 3)]
    for thread in peers:
        thread.start()
    leader = lead(core.path, core.trust, port, started)
    assert leader.model.manifests().ranks == 4
    assert greedy(leader) == expected
    leader.close()
    started.remove(leader)
    for thread in peers:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    assert outcomes == {rank: "the leader is shutting down" for rank in (1, 2, 3)}


def start_one(core: SignedCore, started: list[RunningModel]) -> RunningModel:
    model = start(core.path, core.trust, LoadOptions(), backend="reference")
    started.append(model)
    return model


# ------------------------------------------------------------------------------------------------ the handshake


def test_the_leader_refuses_peers_without_the_secret_a_wrong_or_duplicate_rank_or_core_and_waits_for_the_right(
    small_cores: dict[int, SignedCore], caplog: pytest.LogCaptureFixture
) -> None:
    verified = open_core(small_cores[4].path, small_cores[4].trust, check_resources=False)
    digest = contract_digest(verified.contract)
    verified.close()
    port = free_port()
    settings = ProcessRankSettings("127.0.0.1", port, SECRET, join_timeout_s=DEADLINE_S)
    joined: dict[str, Any] = {}

    def gather() -> None:
        try:
            joined["peers"] = gather_peers(settings, digest, 4)
        except Exception as exc:  # the outcome under test
            joined["peers"] = exc

    leader = threading.Thread(target=gather, daemon=True)
    caplog.set_level(logging.INFO, logger="helios_core.server.ranks")
    leader.start()

    def attempt(rank: int, secret: bytes = SECRET, core: str = digest) -> str:
        try:
            join_leader("127.0.0.1", port, rank, secret, core, timeout_s=DEADLINE_S)
        except StartupError as exc:
            return str(exc)
        return "joined"

    address = f"127.0.0.1:{port}"
    accepted: list[str] = []

    def join_in_background(rank: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: accepted.append(attempt(rank)), daemon=True)
        thread.start()
        return thread

    assert attempt(1, secret=b"not the secret").startswith(
        f"the leader at {address} does not hold the shared secret (authentication failed)"
    )  # the leader's proof fails first: a peer without the secret learns it is not talking to its leader
    waiting = [join_in_background(1)]
    ends = time.monotonic() + DEADLINE_S
    while not any(record.getMessage() == "rank 1 joined from 127.0.0.1" for record in caplog.records):
        assert time.monotonic() < ends, "rank 1 did not join"
        time.sleep(0.01)
    assert attempt(1) == f"the leader at {address} refused rank 1: rank 1 has already joined"
    assert (
        attempt(4)
        == f"the leader at {address} refused rank 4: rank 4 is not one of the rank processes 1..3 of this core"
    )
    assert attempt(2, core="0" * 64).startswith(f"the leader at {address} refused rank 2: rank 2 loaded another core")
    # a peer that cannot prove the secret: it signs its answer with the wrong key
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw:
        wire = rp.Wire(raw, "test")
        wire.send(rp.Hello(2, digest, b"x" * 32))
        proof = wire.receive(DEADLINE_S)
        assert isinstance(proof, rp.LeaderProof)
        wire.send(rp.RankProof(b"\0" * 32))
        with pytest.raises(rp.PeerClosed):
            wire.receive(DEADLINE_S)  # refused without a word
    # an unauthenticated peer cannot make the leader allocate, nor send a greeting it cannot check
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw:
        raw.sendall(struct.pack(">I", 1 << 31))
        assert raw.recv(1) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw:
        rp.Wire(raw, "test").send(rp.Hello(-1, digest, b"x" * 32))
        assert raw.recv(1) == b""
    waiting += [join_in_background(2), join_in_background(3)]
    leader.join(DEADLINE_S)
    peers = joined["peers"]
    assert isinstance(peers, dict) and sorted(peers) == [1, 2, 3]
    for wire in peers.values():
        wire.send(rp.Stop("the test is over"))
        wire.close()
    for thread in waiting:
        thread.join(DEADLINE_S)
    assert accepted == [f"the leader at {address} stopped before serving: the test is over"] * 3
    refusals = [record.getMessage().split(": ", 1)[1] for record in caplog.records if record.levelno == logging.WARNING]
    assert refusals == [
        "a peer claiming rank 1 hung up on the leader's proof: it holds another secret (authentication failed)",
        "rank 1 has already joined",
        "rank 4 is not one of the rank processes 1..3 of this core",
        f"rank 2 loaded another core (contract digest {'0' * 16}..., the leader's is {digest[:16]}...)",
        "it does not hold the shared secret (authentication failed)",
        "the handshake failed: a frame of 2147483648 bytes is larger than the 4096 accepted",
        "it did not open with a rank greeting",
    ]


def test_a_leader_gives_up_on_missing_ranks_at_its_deadline(small_cores: dict[int, SignedCore]) -> None:
    settings = ProcessRankSettings("127.0.0.1", free_port(), SECRET, join_timeout_s=0.3)
    began = time.monotonic()
    with pytest.raises(StartupError) as caught:
        gather_peers(settings, "0" * 64, 4)
    assert time.monotonic() - began < 3.0
    assert str(caught.value) == (
        f"rank processes 1, 2, 3 did not join at {settings.address} within 0.3 s (--rank-join-timeout)"
    )


@pytest.mark.parametrize(
    ("content", "mode", "problem"),
    [
        (SECRET, 0o640, "is accessible by group or others (mode 0640); it must be private to its owner: chmod 600"),
        (SECRET, 0o604, "is accessible by group or others (mode 0604); it must be private to its owner: chmod 600"),
        (b"", 0o600, "is empty; put a long random secret in it"),
        (b" \n", 0o600, "is empty; put a long random secret in it"),
    ],
)
def test_a_secret_file_readable_by_others_or_empty_is_refused(
    tmp_path: Path, content: bytes, mode: int, problem: str
) -> None:
    path = secret_file(tmp_path, content, mode)
    with pytest.raises(StartupError) as caught:
        read_secret_file(path)
    assert str(caught.value).startswith(f"--rank-secret-file {path} {problem}")
    assert read_secret_file(secret_file(tmp_path, SECRET + b"\n")) == SECRET


# ------------------------------------------------------------------------------------------------ failures


def test_a_failing_rank_fails_only_its_round_naming_it_and_the_next_round_runs(started: list[RunningModel]) -> None:
    one_rank = start(FIXTURES / "payload-v3.core", fixture_settings(), LoadOptions(), backend="reference")
    started.append(one_rank)
    expected = greedy(one_rank)
    verified = open_core(TP2, fixture_settings(), check_resources=False)
    port = free_port()
    holder: dict[str, Any] = {}

    def rank_one() -> None:
        peer = join_leader("127.0.0.1", port, 1, SECRET, contract_digest(verified.contract), timeout_s=DEADLINE_S)
        welcome = peer.welcome

        def build(communicator: Any) -> FailingRank:
            backend = ReferenceBackend(
                verified.contract, verified.core, cache_pages=welcome.cache_pages, state_rows=welcome.state_rows,
                frames=welcome.frames, snapshot_rows=welcome.snapshot_rows, rank=1, communicator=communicator,
            )  # fmt: skip
            holder["backend"] = wrapped = FailingRank(backend, failures=0)
            return wrapped

        peer.load(build)
        holder["stopped"] = peer.serve()
        peer.wire.close()

    thread = threading.Thread(target=rank_one, daemon=True)
    thread.start()
    leader = lead(TP2, fixture_settings(), port, started)
    try:
        holder["backend"].failures = 1
        (events,) = [list(stream) for stream in submit_all(leader.engine, [prompt_of(0)], 8)]
        failure = events[-1]
        assert isinstance(failure, ExecutionFailed)
        assert failure.message.startswith("execution failed: RankError: rank 1 failed program '")
        assert failure.message.endswith("': FloatingPointError: overflow in the rank's projection")
        assert greedy(leader) == expected  # the group goes on
    finally:
        leader.close()
        started.remove(leader)
        thread.join(DEADLINE_S)
        verified.close()
    assert holder["stopped"] == "the leader is shutting down"


def test_a_killed_rank_process_fails_serving_with_an_error_naming_it_and_nothing_hangs(
    tmp_path: Path, started: list[RunningModel], processes: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    processes.append(spawn_rank(TP2, fixture_settings(), port, 1, secret_file(tmp_path)))
    lost: list[RankError] = []
    signalled = threading.Event()

    def on_lost(error: RankError) -> None:
        lost.append(error)
        signalled.set()

    leader = lead(TP2, fixture_settings(), port, started, on_lost=on_lost)
    assert len(greedy(leader, count=1)) == 1
    processes[0].send_signal(signal.SIGKILL)
    processes[0].wait(DEADLINE_S)
    assert signalled.wait(DEADLINE_S)  # noticed between rounds, without a request
    (error,) = lost
    assert error.rank == 1
    assert str(error) == "rank 1 disconnected (its process ended or its connection failed)"
    began = time.monotonic()
    (events,) = [list(stream) for stream in submit_all(leader.engine, [prompt_of(0)], 4)]
    assert time.monotonic() - began < 5.0  # refused at once: the group is broken
    failure = events[-1]
    assert isinstance(failure, ExecutionFailed)
    assert failure.message == (
        "execution failed: RankError: rank 1 disconnected (its process ended or its connection failed)"
    )


def test_a_rank_lost_inside_a_round_fails_the_round_and_stops_the_other_ranks(
    small_cores: dict[int, SignedCore], started: list[RunningModel]
) -> None:
    core = small_cores[4]
    verified = open_core(core.path, core.trust, check_resources=False)
    digest = contract_digest(verified.contract)
    port = free_port()
    outcomes: dict[int, Any] = {}
    communicators: dict[int, Any] = {}

    def peer(rank: int) -> None:
        try:
            joined = join_leader("127.0.0.1", port, rank, SECRET, digest, timeout_s=DEADLINE_S)
            welcome = joined.welcome
            hang_up = rank == 2

            class _Vanishing:
                def __init__(self, communicator: Any) -> None:
                    self.inner = communicator
                    self.armed = False

                def __getattr__(self, name: str) -> Any:
                    return getattr(self.inner, name)

                def all_reduce(self, array: np.ndarray) -> np.ndarray:
                    if self.armed:  # the process dies inside a collective of a round
                        joined.wire.close()
                        raise ConnectionResetError("gone")
                    return self.inner.all_reduce(array)  # type: ignore[no-any-return]

            def build(communicator: Any) -> ReferenceBackend:
                wrapped = _Vanishing(communicator) if hang_up else communicator
                communicators[rank] = wrapped
                return ReferenceBackend(
                    verified.contract, verified.core, cache_pages=welcome.cache_pages, state_rows=welcome.state_rows,
                    frames=welcome.frames, snapshot_rows=welcome.snapshot_rows, rank=rank, communicator=wrapped,
                )  # fmt: skip

            joined.load(build)
            outcomes[rank] = joined.serve()
        except Exception as exc:  # the outcome under test
            outcomes[rank] = exc

    threads = [threading.Thread(target=peer, args=(rank,), daemon=True) for rank in (1, 2, 3)]
    for thread in threads:
        thread.start()
    lost: list[RankError] = []
    leader = lead(core.path, core.trust, port, started, on_lost=lost.append)
    communicators[2].armed = True
    began = time.monotonic()
    (events,) = [list(stream) for stream in submit_all(leader.engine, [prompt_of(0)], 4)]
    failure = events[-1]
    assert isinstance(failure, ExecutionFailed)
    assert failure.message == (
        "execution failed: RankError: rank 2 disconnected (its process ended or its connection failed)"
    )
    for thread in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    assert time.monotonic() - began < DEADLINE_S
    assert (
        outcomes[1]
        == outcomes[3]
        == ("rank 2 was lost: rank 2 disconnected (its process ended or its connection failed)")
    )
    assert [error.rank for error in lost] == [2]
    verified.close()
