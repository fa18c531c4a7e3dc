"""Structured output and stops on the real SmolLM2 core, end to end through the engine."""

from __future__ import annotations

import json

import pytest

from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 30},
        "capital": {"type": "string", "maxLength": 30},
    },
    "required": ["country", "capital"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}}


def _text(events: list[object]) -> str:
    pieces = [t for e in events if isinstance(e, TokenEvent) for _, t in e.pieces]
    finished = events[-1]
    assert isinstance(finished, Finished)
    return "".join(pieces) + "".join(t for _, t in finished.pieces)


def test_schema_constrained_output_parses_every_time(smol_running: RunningModel) -> None:
    prompt = smol_running.bootstrap.encode_prompt(
        [{"role": "user", "content": "Reply in JSON with the country France and its capital."}]
    )
    streams = [
        smol_running.engine.submit(
            PreparedRequest(
                f"s{seed}", prompt, 80, SamplingParams(temperature=0.8, seed=seed), response_format=json.dumps(FORMAT)
            )
        )
        for seed in range(6)
    ]
    for stream in streams:
        events = list(stream)
        finished = events[-1]
        assert isinstance(finished, Finished) and finished.reason == "stop", events[-1]
        text = _text(events).removesuffix("<|im_end|>")
        document = json.loads(text)
        assert set(document) == {"country", "capital"}
        assert all(isinstance(v, str) and len(v) <= 30 for v in document.values())


def test_a_string_stop_on_the_real_model(smol_running: RunningModel) -> None:
    prompt = smol_running.bootstrap.encode_prompt(
        [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
    )
    events = list(
        smol_running.engine.submit(
            PreparedRequest("stop", prompt, 20, SamplingParams(temperature=0.0), string_stops=[" is"])
        )
    )
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason == "stop"
    assert _text(events) == "The capital of France"
    assert finished.completion_tokens == 5  # "The", " capital", " of", " France", " is"


def test_a_token_stop_and_observation_on_the_real_model(smol_running: RunningModel) -> None:
    prompt = smol_running.bootstrap.encode_prompt(
        [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
    )
    paris = smol_running.bootstrap.tokenizer.encode(" Paris", add_special_tokens=False).ids
    assert len(paris) == 1
    request = PreparedRequest(
        "tokstop", prompt, 20, SamplingParams(temperature=0.0), token_stops=[paris], observe_timestamps=True
    )
    events = list(smol_running.engine.submit(request))
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason == "stop"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert tokens[-1].token_id == paris[0]  # observed, though never presented
    assert _text(events) == "The capital of France is"
    stamps = [e.timestamp_ns for e in tokens]
    assert all(s > 0 for s in stamps) and stamps == sorted(stamps)
