"""Tensor-parallel cores served on thread ranks give the one-rank core's greedy tokens.

SmolLM2-135M (9 attention heads, 3 key-value heads, 1536 feed-forward rows) on three ranks divides
evenly; on two ranks each rank holds 2 key-value heads and 768 rows (rank 1's second head is zero
padding), on four 1 head and 384 rows (rank 3 holds only a padded head, and real rows). Each is built
once for the module (its cores one after the other) and compared with the one-rank core, batched, and
the three-rank core also one request at a time. The tiny synthetic shape on three ranks (1 of its 2
key-value heads and 22 of its 64 feed-forward rows a rank: rank 2 holds a padded head and 20 real rows)
is compared with the same shape on one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start

pytestmark = pytest.mark.slow

NAMESPACE = "helios-tests/smollm2-ranks"
GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["Name the capital of France.", "What is two plus two?", "Say hello in Spanish."]
NEW_TOKENS = 8


def _build(directory: Path, name: str, recipe: list[str], *extra: str) -> RunningModel:
    from ignition.cli import main as ignition_main

    from helios_core.container.keys import generate_keys

    keys = generate_keys(directory / f"{name}.keys")
    core = directory / f"{name}.core"
    code = ignition_main(
        [
            "build", *recipe, "--out", str(core), "--sign-key", str(keys["signing"]), "--namespace", NAMESPACE,
            "--max-rows", "8", "--quiet", *extra,
        ]
    )  # fmt: skip
    assert code == 0
    return start(core, TrustSettings((keys["public"],), NAMESPACE, None), LoadOptions(), backend="reference")


@pytest.fixture(scope="module", params=[3, 2, 4], ids=lambda ranks: f"{ranks}-ranks")
def smol_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningModel]:
    ranks: int = request.param
    directory = tmp_path_factory.mktemp(f"smollm2-tp{ranks}")
    smol = ["smollm2-135m-instruct", "--prefill-tokens", "16,64", "--context", "512"]
    running = _build(directory, f"smol-tp{ranks}", smol, "--tensor-parallel", str(ranks))
    yield running
    running.close()


@pytest.fixture(scope="module")
def one_rank_tokens(smol_running: RunningModel) -> tuple[list[list[int]], list[list[int]]]:
    """The chat prompts of QUESTIONS and the one-rank core's greedy tokens of each, alone."""
    prompts = [smol_running.bootstrap.encode_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    return prompts, _tokens(smol_running, prompts, together=False)


def _tokens(running: RunningModel, prompts: list[list[int]], together: bool) -> list[list[int]]:
    engine = running.engine
    if not together:
        return [
            engine.generate(PreparedRequest(f"solo{n}", prompt, NEW_TOKENS, GREEDY, ignore_eos=True)).token_ids
            for n, prompt in enumerate(prompts)
        ]
    streams = [
        engine.submit(PreparedRequest(f"together{n}", prompt, NEW_TOKENS, GREEDY, ignore_eos=True))
        for n, prompt in enumerate(prompts)
    ]
    tokens = []
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], Finished)
        tokens.append([event.token_id for event in events if isinstance(event, TokenEvent)])
    return tokens


def test_thread_ranks_give_the_one_rank_tokens(
    smol_ranks: RunningModel, one_rank_tokens: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, expected = one_rank_tokens
    ranks = smol_ranks.model.manifests().ranks
    assert ranks in (2, 3, 4)
    assert [smol_ranks.bootstrap.encode_prompt([{"role": "user", "content": q}]) for q in QUESTIONS] == prompts
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)
    if ranks == 3:  # the even partition also one request at a time; the padded ones batched only (time)
        assert _tokens(smol_ranks, prompts, together=False) == expected
    assert _tokens(smol_ranks, prompts, together=True) == expected
    smol_ranks.engine.allocator.check()


def test_the_tiny_shape_on_three_padded_ranks_gives_the_one_rank_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = tmp_path_factory.mktemp("tiny-tp3")
    tiny = ["llama-synthetic", "--shape", "tiny", "--seed", "7"]
    prompts = [[11, 200, 37, 5, 150, 99], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [42]]
    one_rank = _build(directory, "tiny", tiny)
    try:
        expected = _tokens(one_rank, prompts, together=False)
    finally:
        one_rank.close()
    three = _build(directory, "tiny-tp3", tiny, "--tensor-parallel", "3")
    try:
        assert three.model.manifests().ranks == 3
        assert _tokens(three, prompts, together=False) == expected
        assert _tokens(three, prompts, together=True) == expected
        three.engine.allocator.check()
    finally:
        three.close()
