"""Tests of the example plugin, written with the Helios plugin-author harness."""

from __future__ import annotations

import json

import helios_example_plugin
import pytest

from helios_core.plugin_api import ToolSpec
from helios_core.testing import FrontendHarness, byte_level_tokenizer
from helios_core.wire import contract_pb2 as ct


@pytest.fixture
def harness() -> FrontendHarness:
    frontend = ct.FrontendContract(
        tool_parser=helios_example_plugin.IDENTIFIER,
        reasoning_parser=ct.REASONING_PARSER_NONE,
        image_preparation=ct.IMAGE_PREPARATION_NONE,
        image_layout=ct.IMAGE_LAYOUT_NONE,
    )
    return FrontendHarness(
        byte_level_tokenizer(), frontend, tools=[ToolSpec("add", {})], plugins=[helios_example_plugin]
    )


def test_call_and_content(harness: FrontendHarness) -> None:
    result = harness.check_split_invariance('Adding. [[add {"a": 1, "b": 2}]]')
    assert result.output.content == "Adding."
    assert [(c.name, json.loads(c.arguments)) for c in result.output.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert result.finish_reason == "tool_calls"


def test_malformed_call_is_content(harness: FrontendHarness) -> None:
    result = harness.check_split_invariance("see [[add nope]] and [[")
    assert result.output.content == "see [[add nope]] and [["
    assert result.output.tool_calls == []
