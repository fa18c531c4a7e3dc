"""SmolLM2-135M built for three tensor-parallel ranks (its 9 attention and 3 key-value heads allow 1 or 3)
serves on thread ranks with the one-rank core's greedy tokens, alone and batched."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start

pytestmark = pytest.mark.slow

NAMESPACE = "helios-tests/smollm2-ranks"
GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["Name the capital of France.", "What is two plus two?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningModel]:
    from ignition.cli import main as ignition_main

    from helios_core.container.keys import generate_keys

    directory = tmp_path_factory.mktemp("smollm2-tp3")
    keys = generate_keys(directory / "keys")
    core = directory / "smol-tp3.core"
    code = ignition_main(
        [
            "build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"]),
            "--namespace", NAMESPACE, "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "512",
            "--tensor-parallel", "3", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    running = start(core, TrustSettings((keys["public"],), NAMESPACE, None), LoadOptions(), backend="reference")
    yield running
    running.close()


def _tokens(running: RunningModel, prompts: list[list[int]], together: bool) -> list[list[int]]:
    engine = running.engine
    if not together:
        return [
            engine.generate(PreparedRequest(f"solo{n}", prompt, 8, GREEDY, ignore_eos=True)).token_ids
            for n, prompt in enumerate(prompts)
        ]
    streams = [
        engine.submit(PreparedRequest(f"together{n}", prompt, 8, GREEDY, ignore_eos=True))
        for n, prompt in enumerate(prompts)
    ]
    tokens = []
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], Finished)
        tokens.append([event.token_id for event in events if isinstance(event, TokenEvent)])
    return tokens


def test_three_thread_ranks_give_the_one_rank_tokens(smol_running: RunningModel, three_ranks: RunningModel) -> None:
    assert three_ranks.model.manifests().ranks == 3
    prompts = [smol_running.bootstrap.encode_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert [three_ranks.bootstrap.encode_prompt([{"role": "user", "content": q}]) for q in QUESTIONS] == prompts
    expected = _tokens(smol_running, prompts, together=False)
    assert _tokens(three_ranks, prompts, together=False) == expected
    assert _tokens(three_ranks, prompts, together=True) == expected
    three_ranks.engine.allocator.check()
