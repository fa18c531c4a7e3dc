"""The README's demo core answers tool calls through the official ``openai`` client.

The core is the real SmolLM2-135M-Instruct built as the README builds it (``--context 8192
--tool-syntax json-tags``; two request rows keep startup small), served by the real server on
loopback. ``tool_choice="required"`` constrains the answer to one JSON-tag call; greedy decoding
makes its arguments exact. A request beyond the context is refused once, permanently: the client,
left with its default retries, sends it a single time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helios_core.container.keys import generate_keys
from helios_core.loading import TrustSettings

from .conftest import Served, serve_fixture

pytestmark = pytest.mark.slow

NAMESPACE = "demo/smollm2"
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
TIMEOUT_S = 300.0
"""Generous: the reference backend shares two cores with the rest of the suite."""


def _client(demo: Served, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo.base_url + "/v1", api_key="unused", timeout=TIMEOUT_S, **options)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from ignition.cli import main as ignition_main

    directory = tmp_path_factory.mktemp("demo-tools")
    keys = generate_keys(directory / "keys")
    core = directory / "smol.core"
    code = ignition_main(
        [
            "build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"]),
            "--namespace", NAMESPACE, "--context", "8192", "--tool-syntax", "json-tags",
            "--max-rows", "2", "--prefill-tokens", "64,256", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    with serve_fixture(core=core, trust=TrustSettings((Path(keys["public"]),), NAMESPACE, None)) as served:
        yield served


def test_a_required_tool_call_through_the_openai_client(demo: Served) -> None:
    client = _client(demo, max_retries=0)
    response = client.chat.completions.create(
        model=MODEL, messages=[QUESTION], tools=[WEATHER], tool_choice="required", temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == len("call_") + 24

    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=[
            QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature_c": 18, "sky": "clear"}'},
        ],
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    assert follow_up.usage is not None and follow_up.usage.prompt_tokens > response.usage.prompt_tokens


def test_a_request_beyond_the_context_is_refused_once_without_retries(demo: Served) -> None:
    sent: list[httpx.Request] = []
    client = _client(demo, http_client=httpx.Client(event_hooks={"request": [sent.append]}))
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model=MODEL, messages=[QUESTION], max_tokens=9000)
    assert len(sent) == 1
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.body == {
        "message": "prompt (37 tokens) plus max_tokens (9000) exceeds the core's context of 8192 tokens; "
        "at most 8155 output tokens fit this prompt",
        "type": "admission_rejected",
        "param": "max_tokens",
        "code": 503,
    }
    with pytest.raises(openai.InternalServerError) as raised:  # the field the client sent is the one named
        client.chat.completions.create(model=MODEL, messages=[QUESTION], max_completion_tokens=9000)
    assert raised.value.body == {
        "message": "prompt (37 tokens) plus max_completion_tokens (9000) exceeds the core's context of 8192 "
        "tokens; at most 8155 output tokens fit this prompt",
        "type": "admission_rejected",
        "param": "max_completion_tokens",
        "code": 503,
    }
