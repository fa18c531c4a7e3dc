"""Tool-call arguments holding JSON numbers beyond a float's range: a valid number the model wrote stays
that number, as written, in the presented arguments (JSON cannot hold infinity, which is what a float
makes of it), in every syntax family, unstreamed and at every split point."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest
from frontend_builders import harness, json_tags, recipient_header, xtml

from helios_core.plugin_api import EnvelopeState, ToolSpec, coerce_text, decode_json_value, dump_json
from helios_core.plugins.sections import JsonNumber

MEASURE = ToolSpec(
    "measure",
    {
        "type": "object",
        "properties": {"n": {"type": "number"}, "m": {"type": "number"}, "label": {"type": "string"}},
    },
)

HUGE = "83.83e+724221406307222"


def _arguments(result: Any) -> list[str]:
    return [call.arguments for call in result.output.tool_calls]


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        (f'{{"n": 9222, "m": {HUGE}}}', f'{{"n": 9222, "m": {HUGE}}}'),
        ('{"n": -1E400, "m": [1e999, 2.5], "label": "x"}', '{"n": -1E400, "m": [1e999, 2.5], "label": "x"}'),
        (f'"{{\\"n\\": {HUGE}}}"', f'{{"n": {HUGE}}}'),  # arguments given as a JSON string
    ],
    ids=["object", "nested-and-negative", "string-arguments"],
)
def test_json_tags_keep_an_out_of_range_number_as_written(tokenizer: Any, body: str, arguments: str) -> None:
    text = f'<tool_call>{{"name": "measure", "arguments": {body}}}</tool_call>'
    result = harness(tokenizer, json_tags(), tools=[MEASURE]).check_split_invariance(text)
    assert _arguments(result) == [arguments]
    assert result.finish_reason == "tool_calls"


def test_xtml_keeps_an_out_of_range_number_argument_as_a_number(tokenizer: Any) -> None:
    open_, close, sep = "<|open|>", "<|close|>", "<|sep|>"
    text = (
        f'{open_}tools{sep}{open_}call tool="measure"{sep}'
        f'{open_}argument key="n" type="number"{sep}922222811e82817{close}argument{sep}'
        f'{open_}argument key="m" type="number"{sep}2.5{close}argument{sep}'
        f"{close}call{sep}{close}tools{sep}"
    )
    result = harness(tokenizer, xtml(), tools=[MEASURE]).check_split_invariance(text)
    assert _arguments(result) == ['{"n": 922222811e82817, "m": 2.5}']


def test_recipient_header_keeps_an_out_of_range_number_argument_as_a_number(tokenizer: Any) -> None:
    h = harness(tokenizer, recipient_header(), tools=[MEASURE], envelope=EnvelopeState(open_header="assistant"))
    text = (
        ' to=functions<|message|><atem:function_calls><atem:invoke name="measure">'
        '<atem:parameter name="n">54630E17923</atem:parameter><atem:parameter name="label">x</atem:parameter>'
        "</atem:invoke></atem:function_calls><|eom|>"
    )
    result = h.check_split_invariance(text)
    assert _arguments(result) == ['{"n": 54630E17923, "label": "x"}']


def test_coerce_text_types_an_out_of_range_number_and_keeps_other_text() -> None:
    number = coerce_text("922222811e82817", {"type": "number"}, undeclared="string")
    assert isinstance(number, JsonNumber) and number.text == "922222811e82817"
    assert dump_json({"n": number}) == '{"n": 922222811e82817}'
    # not JSON numbers: the text stays a string, as any value that does not convert
    assert coerce_text("inf", {"type": "number"}, undeclared="string") == "inf"
    assert coerce_text("-Infinity", {"type": "number"}, undeclared="string") == "-Infinity"
    # numbers in range are unchanged
    assert coerce_text("1e3", {"type": "number"}, undeclared="string") == 1000.0
    assert coerce_text("12", {"type": "number"}, undeclared="string") == 12


def test_decoded_numbers_survive_copies_and_pickles() -> None:
    ok, value = decode_json_value(f'{{"m": {HUGE}, "s": "é"}}')
    assert ok and isinstance(value["m"], JsonNumber)
    for twin in (copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
        assert dump_json(twin) == f'{{"m": {HUGE}, "s": "é"}}'
    assert dump_json({"a": 1.5, "b": [1, None, True]}) == json.dumps({"a": 1.5, "b": [1, None, True]})
    # NaN has no JSON spelling: still refused, whatever else the value holds
    with pytest.raises(ValueError):
        dump_json({"m": value["m"], "x": float("nan")})
    assert decode_json_value("NaN") == (False, None)
