"""Golden fixture cores keep generating exactly the tokens recorded when they were written."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from helios_core.runtime.messages import PreparedRequest, SamplingParams
from helios_core.runtime.startup import RunningModel

from .conftest import FIXTURES

EXPECTED = json.loads((FIXTURES / "expected_tokens.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED["cores"]))
def test_fixture_core_regenerates_its_recorded_tokens(name: str, start_fixture: Callable[..., RunningModel]) -> None:
    recorded = EXPECTED["cores"][name]
    running = start_fixture(name)
    prompt = running.bootstrap.encode_prompt(EXPECTED["messages"])
    assert prompt == recorded["prompt_ids"]
    limit = EXPECTED["max_tokens"]
    greedy = running.engine.generate(
        PreparedRequest("greedy", prompt, limit, SamplingParams(temperature=0.0), ignore_eos=True)
    )
    assert greedy.token_ids == recorded["greedy"]
    seeded = running.engine.generate(
        PreparedRequest(
            "seeded", prompt, limit, SamplingParams(temperature=0.8, top_p=0.95, seed=1234), ignore_eos=True
        )
    )
    assert seeded.token_ids == recorded["seeded_t0.8_p0.95_s1234"]
