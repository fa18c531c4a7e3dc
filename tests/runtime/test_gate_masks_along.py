"""The grammar masks of a constrained speculative lane: one a position, computed without touching the
request's grammar state (``HostGate.masks_along``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from helios_core.frontend.formats import parse_response_format
from helios_core.runtime.gates import HostGate
from helios_core.runtime.messages import PreparedRequest, SamplingParams
from helios_core.runtime.startup import RunningModel

GREEDY = SamplingParams(temperature=0.0)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"k": {"enum": ["ab", "cd"]}},
    "required": ["k"],
    "additionalProperties": False,
}
DOCUMENT = '{"k":"ab"}'


class _Grammar:
    """Gates of one schema on the fixture core, and its single-character token ids."""

    def __init__(self, running: RunningModel) -> None:
        self.tokenizer, self.compiler = running.bootstrap.tokenizer, running.grammar_compiler
        fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "k", "schema": SCHEMA}})
        assert fmt is not None
        self.grammar = self.compiler.compile(fmt)
        self.ids = {self.tokenizer.decode([token]): token for token in range(self.compiler.sampled_size)}
        self.eos = self.compiler.eos_token_ids[0]

    def gate(self, *, grammar: bool = True) -> HostGate:
        request = PreparedRequest("g", [1, 2], 16, GREEDY, grammar=self.grammar if grammar else None)
        return HostGate(request, self.tokenizer, self.compiler if grammar else None)

    def spell(self, text: str) -> list[int]:
        return [self.ids[character] for character in text]


@pytest.fixture
def grammar(start_fixture: Callable[..., RunningModel]) -> _Grammar:
    return _Grammar(start_fixture())


def _mask(gate: HostGate) -> np.ndarray:
    """The gate's mask of the next token (a constrained gate has one)."""
    mask = gate.mask()
    assert mask is not None
    return mask


def _allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def test_each_position_gets_the_mask_after_the_candidates_before_it(grammar: _Grammar) -> None:
    gate = grammar.gate()
    first = _mask(gate).copy()
    candidates = grammar.spell(DOCUMENT[:6])
    masks = gate.masks_along(candidates)
    assert len(masks) == 7  # the pending token's position and one after each candidate
    walked = grammar.gate()
    for position, mask in enumerate(masks):
        assert np.array_equal(mask, _mask(walked)), position
        if position < len(candidates):
            walked.observe(candidates[position])
    # the request's own grammar has not moved: its mask is the first, and it accepts the first candidate
    assert np.array_equal(_mask(gate), first)
    gate.observe(candidates[0])
    assert np.array_equal(_mask(gate), masks[1])


def test_the_masks_stop_at_the_first_candidate_the_grammar_refuses(grammar: _Grammar) -> None:
    gate = grammar.gate()
    candidates = grammar.spell('{"k":"x')  # "x" starts neither "ab" nor "cd"
    masks = gate.masks_along(candidates)
    assert len(masks) == 7  # the six candidates before "x" may be offered
    assert not _allows(masks[6], grammar.ids["x"])
    refused = gate.masks_along(grammar.spell("}"))  # refused at once: no candidate may be offered
    assert len(refused) == 1 and np.array_equal(refused[0], _mask(gate))
    # a refused candidate leaves the request's grammar where it was
    for token in grammar.spell(DOCUMENT):
        gate.observe(token)
    assert _allows(_mask(gate), grammar.eos)


def test_the_masks_never_pass_an_end_of_sequence(grammar: _Grammar) -> None:
    gate = grammar.gate()
    document = grammar.spell(DOCUMENT)
    masks = gate.masks_along([*document, grammar.eos, grammar.ids["{"]])
    assert len(masks) == len(document) + 1  # the document's tokens, not the EOS nor what follows it
    assert _allows(masks[-1], grammar.eos)  # complete: EOS may be sampled at the last position
    alone = gate.masks_along([])
    assert len(alone) == 1 and np.array_equal(alone[0], _mask(gate))


def test_an_unconstrained_gate_has_no_masks(grammar: _Grammar) -> None:
    gate = grammar.gate(grammar=False)
    assert not gate.constrained
    assert gate.masks_along(grammar.spell(DOCUMENT)) == []


def test_a_response_format_is_compiled_into_the_gate(grammar: _Grammar) -> None:
    """The fixture's request shape: a response format with its compiled grammar constrains the gate."""
    request = PreparedRequest(
        "f", [1, 2], 16, GREEDY, response_format=json.dumps({"type": "json_object"}), grammar=grammar.grammar
    )
    gate = HostGate(request, grammar.tokenizer, grammar.compiler)
    assert len(gate.masks_along(grammar.spell('{"k"'))) == 5
