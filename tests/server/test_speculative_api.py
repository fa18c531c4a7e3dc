"""A core with speculative programs served with history drafting, through the official openai client:
streamed text, tools and structured output as without speculation, and the speculation metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from .conftest import Served, serve_fixture
from .helpers import build_synthetic_core
from .test_tools_api import ADD, CITY, REQUIRED_KEYS

NAMESPACE = "tests/speculative-api"
MODEL = "llama-synthetic-tiny"
MESSAGES = [{"role": "user", "content": "abc abc abc abc abc abc"}]


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """The same speculative core served without and with history drafting."""
    built = build_synthetic_core(
        tmp_path_factory.mktemp("speculative"), NAMESPACE, tool_syntax="json-tags", speculative_widths=(1, 2, 4)
    )
    with (
        serve_fixture(core=built.path, trust=built.trust) as plain,
        serve_fixture(core=built.path, trust=built.trust, history_drafting=True) as drafting,
    ):
        yield plain, drafting


def _streamed(served: Served, **body: object) -> tuple[str, str | None]:
    stream = served.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **body)  # type: ignore[call-overload]
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_streamed_text_is_the_text_without_speculation(served_pair: tuple[Served, Served]) -> None:
    plain, drafting = served_pair
    for body in ({"temperature": 0.0, "max_tokens": 48}, {"temperature": 0.3, "seed": 4, "max_tokens": 48}):
        expected = _streamed(plain, **body)
        assert _streamed(drafting, **body) == expected
        whole = drafting.client.chat.completions.create(model=MODEL, messages=MESSAGES, **body)  # type: ignore[call-overload]
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == expected
    metrics = httpx.get(drafting.base_url + "/metrics").text
    offered = [line for line in metrics.splitlines() if line.startswith("helios_speculative_proposals_offered_total")]
    assert offered and sum(float(line.split()[-1]) for line in offered) > 0


def test_tools_and_structured_output_are_served_with_history_drafting(served_pair: tuple[Served, Served]) -> None:
    _, drafting = served_pair
    reply = drafting.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Use a tool."}],
        tools=[CITY, ADD],  # type: ignore[list-item]
        tool_choice="required",
        temperature=1.0,
        seed=2,
        max_tokens=200,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert REQUIRED_KEYS[call.function.name] <= set(json.loads(call.function.arguments))
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    structured = drafting.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},  # type: ignore[typeddict-item]
        temperature=0.7,
        seed=9,
        max_tokens=200,
    )
    assert set(json.loads(structured.choices[0].message.content or "")) == {"n"}
