"""Tests of the example plugin, written with the Helios plugin-author harness."""

from __future__ import annotations

import json

import helios_example_plugin
import numpy as np
import pytest

from helios_core.frontend.formats import ToolCallFormat
from helios_core.frontend.structured import GrammarCompiler
from helios_core.plugin_api import ToolGrammarError, ToolSpec
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


ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
ECHO = {
    "type": "object",
    "properties": {"text": {"enum": ["x", "y"]}},
    "required": ["text"],
    "additionalProperties": False,
}


def _walk(compiler: GrammarCompiler, fmt: ToolCallFormat, eos: int, seed: int) -> list[int]:
    """Sample uniformly among the ids the grammar allows until EOS; the ids before it."""
    rng = np.random.default_rng(seed)
    matcher = compiler.compile(fmt).matcher()
    ids: list[int] = []
    for _ in range(300):
        bits = np.unpackbits(matcher.mask().astype("<u4").view(np.uint8), bitorder="little")
        token = int(rng.choice(np.flatnonzero(bits[: eos + 1])))
        if token == eos:
            return ids
        matcher.advance(token)
        ids.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("choice", [None, "echo"])
def test_the_grammar_writes_exactly_one_call_the_parser_reads(harness: FrontendHarness, choice: str | None) -> None:
    tokenizer = byte_level_tokenizer(["<|eos|>"])
    eos = tokenizer.token_to_id("<|eos|>")
    compiler = GrammarCompiler(tokenizer, sampled_size=eos + 1, logits_width=eos + 1, eos_token_ids=[eos])
    tools = [("add", ADD), ("echo", ECHO)]
    fmt = ToolCallFormat.for_frontend(
        tools, choice, harness.selected.frontend, grammar=helios_example_plugin.bracket_call_grammar
    )
    calls = set()
    for seed in range(8):
        text = tokenizer.decode(_walk(compiler, fmt, eos, seed))
        assert text.startswith("[[") and text.endswith("]]") and text.count("[[") == 1, text
        result = FrontendHarness(tokenizer, harness.selected.frontend, tools=[ToolSpec(n, s) for n, s in tools],
                                 plugins=[helios_example_plugin]).run_text(text)  # fmt: skip
        ((name, arguments),) = [(c.name, json.loads(c.arguments)) for c in result.output.tool_calls]
        assert result.finish_reason == "tool_calls" and not result.output.content
        assert arguments in ([{"a": n} for n in range(10)] if name == "add" else [{"text": "x"}, {"text": "y"}])
        calls.add(name)
    assert calls == ({"add", "echo"} if choice is None else {"echo"})


def test_an_unwritable_name_is_refused(harness: FrontendHarness) -> None:
    with pytest.raises(ToolGrammarError, match="cannot be written"):
        ToolCallFormat.for_frontend(
            [("no spaces", ADD)], None, harness.selected.frontend, grammar=helios_example_plugin.bracket_call_grammar
        )
