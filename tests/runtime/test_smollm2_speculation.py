"""SmolLM2-135M built with speculative programs of both kinds: greedy output with speculation equals
greedy output without it, token for token, at every selected width."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start

pytestmark = pytest.mark.slow

NAMESPACE = "tests/smollm2-speculation"
GREEDY = SamplingParams(temperature=0.0)


def _build(directory: Path, *speculation: str) -> tuple[Path, TrustSettings]:
    from ignition.cli import main as ignition_main

    from helios_core.container.keys import generate_keys

    keys = generate_keys(directory / "keys")
    core = directory / "smol.core"
    code = ignition_main(
        [
            "build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"]),
            "--namespace", NAMESPACE, "--max-rows", "2", "--decode-rows", "1,2", "--prefill-tokens", "64",
            "--context", "256", "--quiet", *speculation,
        ]
    )  # fmt: skip
    assert code == 0
    return core, TrustSettings((keys["public"],), NAMESPACE, None)


@pytest.fixture(
    scope="module",
    params=[
        ("--speculative", "history", "--draft-tokens", "3"),
        ("--speculative", "self-draft", "--draft-tokens", "3", "--draft-layers", "30"),
    ],
    ids=["history", "self-draft"],
)
def smol_speculative(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, TrustSettings, str]]:
    kind = request.param[1]
    core, trust = _build(tmp_path_factory.mktemp(f"smol-{kind}"), *request.param)
    yield core, trust, kind


def _tokens(running: RunningModel) -> list[list[int]]:
    boot = running.bootstrap
    prompts = [
        boot.encode_prompt([{"role": "user", "content": "Repeat exactly, three times: the quick brown fox."}]),
        boot.encode_prompt([{"role": "user", "content": "Count: one two three one two three one two"}]),
    ]
    streams = [
        running.engine.submit(PreparedRequest(f"r{i}", prompt, 40, GREEDY, ignore_eos=True))
        for i, prompt in enumerate(prompts)
    ]
    return [[event.token_id for event in stream if isinstance(event, TokenEvent)] for stream in streams]


def test_smollm2_speculation_serves_the_greedy_tokens_of_plain_decode(
    smol_speculative: tuple[Path, TrustSettings, str],
) -> None:
    core, trust, kind = smol_speculative
    outputs = {}
    offered = {}
    for label, options in (
        ("plain", LoadOptions(max_active=2, speculative_width=1)),
        ("w2", LoadOptions(max_active=2, speculative_width=2, history_drafting=kind == "history")),
        ("w4", LoadOptions(max_active=2, speculative_width=4, history_drafting=kind == "history")),
    ):
        running = start(core, trust, options, backend="reference")
        try:
            outputs[label] = _tokens(running)
            offered[label] = sum(running.engine.statistics().proposals_offered.values())
        finally:
            running.close()
    assert outputs["w2"] == outputs["plain"] and outputs["w4"] == outputs["plain"]
    assert offered["plain"] == 0 and offered["w2"] > 0 and offered["w4"] > 0
