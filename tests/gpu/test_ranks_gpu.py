"""Tensor-parallel ranks on two GPUs: thread ranks and process ranks give one rank's greedy tokens.

For the 1B and 8B synthetic shapes (bf16 weights of one seed, ``reference,sm_90a`` kernels, small capacities)
a one-rank core and its ``--tensor-parallel 2`` twin are built. The one-rank core on GPU 0 gives the expected
greedy tokens with each step's top-2 log-probability gap; the two-rank core then runs

* as thread ranks: ``--backend cuda`` in this process, one CUDA backend on each of GPUs 0 and 1 over one NCCL
  group (a ``RankedBackend`` launching both ranks in order), and
* as process ranks: rank 0 here (``rank_peers``) and rank 1 a ``helios rank --device 1`` process on the same
  host, the two CUDA backends joined by one NCCL group whose id the leader sends,

and each gives the one-rank tokens up to a step the one-rank core decided by less than ``NEAR_TIE`` (the
ranks add their partial sums in another order, so bf16 logits differ by rounding), with whole sequences equal
for at least half the prompts. Skipped with fewer than two GPUs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context, device_count
from helios_core.backends.rank_processes import ProcessRankedBackend, ProcessRankSettings
from helios_core.backends.ranks import RankedBackend
from helios_core.container.keys import generate_keys
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start

from .harness import NEAR_TIE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(device_count() < 2, reason="needs two NVIDIA GPUs"),
]

NAMESPACE = "helios-tests/gpu-ranks"
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[(13 * p + 7 * i + 5) % 2000 + 3 for i in range(9 + 5 * p)] for p in range(6)]
NEW_TOKENS = 12
ROOT = Path(__file__).resolve().parents[2]
SECRET = b"the two-GPU rank test's shared secret"
JOIN_TIMEOUT_S = 600.0
"""Loading an 8B rank (weights decoded and uploaded, graphs built) takes minutes."""

Steps = list[list[tuple[int, float]]]


def _build(folder: Path, shape: str, keys: dict[str, Path], *options: str) -> Path:
    from ignition.cli import main as ignition_main

    core = folder / f"{shape}{'-'.join(('', *options[1::2]))}.core"
    code = ignition_main(
        [
            "build", "llama-synthetic", "--shape", shape, "--dtype", "bf16", "--targets", "reference,sm_90a",
            "--max-rows", "4", "--decode-rows", "1,4", "--prefill-tokens", "16", "--context", "256",
            "--page-tokens", "16", "--seed", "3", "--out", str(core), "--sign-key", str(keys["signing"]),
            "--namespace", NAMESPACE, *options, "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    return core


@pytest.fixture(scope="module", params=["1b", "8b"])
def cores(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cuda_context: Context
) -> Iterator[tuple[Path, Path, TrustSettings]]:
    """The shape's one-rank core and its two-rank twin (the same weights), and their trust settings."""
    if cuda_context.architecture != "sm_90a":
        pytest.skip(f"the kernels are built for sm_90a; this GPU is {cuda_context.architecture}")
    folder = tmp_path_factory.mktemp(f"ranks-{request.param}")
    keys = generate_keys(folder / "keys")
    one = _build(folder, request.param, keys)
    two = _build(folder, request.param, keys, "--tensor-parallel", "2")
    yield one, two, TrustSettings((keys["public"],), NAMESPACE, None)
    for core in (one, two):
        core.unlink()


def _greedy(running: RunningModel) -> Steps:
    """Each prompt's greedy tokens with each step's top-2 log-probability gap (all prompts at once)."""
    streams = [
        running.engine.submit(PreparedRequest(f"r{i}", p, NEW_TOKENS, GREEDY, ignore_eos=True, top_logprobs=2))
        for i, p in enumerate(PROMPTS)
    ]
    outcomes = [list(stream) for stream in streams]
    assert all(isinstance(events[-1], Finished) for events in outcomes), [events[-1] for events in outcomes]
    return [
        [(e.token_id, e.top[0][1] - e.top[1][1]) for e in events if isinstance(e, TokenEvent)] for events in outcomes
    ]


def _assert_matches(got: Steps, expected: Steps) -> None:
    tokens = [[token for token, _ in steps] for steps in got]
    for mine, want in zip(tokens, expected, strict=True):
        assert len(mine) == NEW_TOKENS
        for step, (token, (wanted, gap)) in enumerate(zip(mine, want, strict=True)):
            if token != wanted:
                assert gap < NEAR_TIE, (step, mine, want)
                break
    exact = sum(mine == [token for token, _ in want] for mine, want in zip(tokens, expected, strict=True))
    assert exact >= len(PROMPTS) // 2, (tokens, expected)


@pytest.fixture(scope="module")
def one_rank(cores: tuple[Path, Path, TrustSettings]) -> Steps:
    running = start(cores[0], cores[2], LoadOptions(max_active=4), backend="cuda")
    try:
        assert isinstance(running.model.backend, CudaBackend)
        return _greedy(running)
    finally:
        running.close()


def test_thread_ranks_on_two_gpus_give_one_ranks_greedy_tokens(
    cores: tuple[Path, Path, TrustSettings], one_rank: Steps
) -> None:
    running = start(cores[1], cores[2], LoadOptions(max_active=4), backend="cuda")
    try:
        backend = running.model.backend
        assert isinstance(backend, RankedBackend)
        assert [rank.rank for rank in backend.ranks] == [0, 1]
        assert all(isinstance(rank, CudaBackend) and rank.collectives["decode_b1"] > 0 for rank in backend.ranks)
        first, second = (rank.transport(0)["input_ids"] for rank in backend.ranks)
        assert first.ctypes.data == second.ctypes.data  # one page-locked staging read by both GPUs
        assert running.model.manifests().ranks == 2
        got = _greedy(running)
    finally:
        running.close()
    _assert_matches(got, one_rank)


def test_process_ranks_on_two_gpus_of_one_host_give_one_ranks_greedy_tokens(
    cores: tuple[Path, Path, TrustSettings], one_rank: Steps, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    secret = tmp_path / "rank.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    trust = cores[2]
    command = [
        sys.executable, "-m", "helios_core.cli", "rank", "--core", str(cores[1]), "--join", f"127.0.0.1:{port}",
        "--rank", "1", "--device", "1", "--rank-secret-file", str(secret), "--rank-join-timeout",
        str(JOIN_TIMEOUT_S), "--accept", str(trust.acceptance),
    ]  # fmt: skip
    for key in trust.trust_keys:
        command += ["--trust-key", str(key)]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        peers = ProcessRankSettings("127.0.0.1", port, SECRET, join_timeout_s=JOIN_TIMEOUT_S)
        running = start(cores[1], trust, LoadOptions(max_active=4, rank_peers=peers), backend="cuda")
        try:
            backend = running.model.backend
            assert isinstance(backend, ProcessRankedBackend)
            assert isinstance(backend.leader, CudaBackend) and backend.leader.rank == 0
            got = _greedy(running)
        finally:
            running.close()
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        assert "(cuda)" in stderr and stderr.splitlines()[-1] == "helios rank: stopped: the leader is shutting down"
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    _assert_matches(got, one_rank)
