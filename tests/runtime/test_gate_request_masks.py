"""The masks a request's own fields put on its rounds through its host gate.

``min_tokens``: the ending ids and single-id token stops are masked out of the first ``min_tokens``
tokens (with the grammar's mask, when there is one, unless the grammar allows nothing else), each
speculative position gets the mask of where it stands, and no stop is looked for in those tokens.
``logit_bias``: -100 bans an id from every round, 100 restricts every round to the ids given 100, each
narrowing skipped where it would leave no id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from helios_core.frontend.formats import parse_response_format
from helios_core.runtime.gates import HostGate, format_param, held_back_ids, needs_gate
from helios_core.runtime.messages import AdmissionRejected, Finished, PreparedRequest, SamplingParams
from helios_core.runtime.startup import RunningModel

GREEDY = SamplingParams(temperature=0.0)
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"k": {"enum": ["ab"]}}, "required": ["k"]}


class _Core:
    """The fixture core's tokenizer and grammar compiler, its single-character ids and an EOS id."""

    def __init__(self, running: RunningModel) -> None:
        self.tokenizer, self.compiler = running.bootstrap.tokenizer, running.grammar_compiler
        self.ids = {self.tokenizer.decode([token]): token for token in range(self.compiler.sampled_size)}
        self.eos = self.compiler.eos_token_ids[0]
        self.ends = frozenset(self.compiler.eos_token_ids)
        fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "k", "schema": SCHEMA}})
        assert fmt is not None
        self.grammar = self.compiler.compile(fmt)

    def request(self, min_tokens: int, **fields: Any) -> PreparedRequest:
        return PreparedRequest("m", [1, 2], 16, GREEDY, min_tokens=min_tokens, **fields)

    def gate(self, request: PreparedRequest, *, ends: frozenset[int] | None = None) -> HostGate:
        ends = self.ends if ends is None else ends
        return HostGate(request, self.tokenizer, self.compiler, ends=ends, silent=ends)

    def spell(self, text: str) -> list[int]:
        return [self.ids[character] for character in text]


@pytest.fixture
def core(start_fixture: Callable[..., RunningModel]) -> _Core:
    return _Core(start_fixture())


def _allows(mask: np.ndarray | None, token: int) -> bool:
    assert mask is not None
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def _allowed(mask: np.ndarray | None, size: int) -> set[int]:
    return {token for token in range(size) if _allows(mask, token)}


def test_the_first_min_tokens_are_masked_off_the_ends_and_the_single_id_stops(core: _Core) -> None:
    stop, other = core.ids["a"], core.ids["b"]
    request = core.request(3, token_stops=[[stop], [other, stop]])
    assert needs_gate(request)
    assert held_back_ids(request, core.ends) == core.ends | {stop}  # not the sequence's ids
    gate = core.gate(request)
    assert gate.holds_rounds and gate.constrained
    size = core.compiler.sampled_size
    for produced in range(3):
        mask = gate.mask()
        assert _allowed(mask, size) == set(range(size)) - core.ends - {stop}, produced
        assert mask is not None and not mask.flags.writeable
        gate.observe(other)
    assert not gate.constrained and gate.mask() is None  # from the fourth token on: every id
    assert gate.masks_along([stop]) == []


def test_no_stop_is_looked_for_in_the_first_min_tokens(core: _Core) -> None:
    a, b = core.ids["a"], core.ids["b"]
    strings = core.gate(core.request(2, string_stops=["a"]))
    first = strings.observe(a)
    assert not first.stopped and [text for _, text in first.pieces] == ["a"]
    assert not strings.observe(b).stopped
    assert strings.observe(a).stopped  # the third token: past min_tokens, the stop matches
    sequences = core.gate(core.request(2, token_stops=[[a, b]]))
    assert not sequences.observe(a).stopped and not sequences.observe(b).stopped
    assert not sequences.observe(a).stopped
    assert sequences.observe(b).stopped


def test_speculative_positions_get_the_mask_of_where_they_stand(core: _Core) -> None:
    a, b = core.ids["a"], core.ids["b"]
    gate = core.gate(core.request(3))
    gate.observe(a)  # one produced: positions 0 and 1 are the second and third tokens, held back
    size = core.compiler.sampled_size
    masks = gate.masks_along([a, b, core.eos])
    assert len(masks) == 4  # the EOS at position 2 is past min_tokens: it may be offered
    assert [_allows(mask, core.eos) for mask in masks] == [False, False, True, True]
    assert _allowed(masks[3], size) == set(range(size))
    refused = gate.masks_along([a, core.eos, b])  # an EOS at position 1 would be the third token
    assert len(refused) == 2 and not _allows(refused[1], core.eos)
    assert gate.constrained  # the walk left the count alone


def test_a_grammar_mask_loses_the_ends_unless_it_allows_nothing_else(core: _Core) -> None:
    size = core.compiler.sampled_size
    number = parse_response_format({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    assert number is not None
    digits = core.compiler.compile(number)
    held, free = (
        core.gate(core.request(5, grammar=digits, response_format="{}")),
        core.gate(core.request(0, grammar=digits, response_format="{}")),
    )
    for gate in (held, free):
        gate.observe(core.ids["1"])
    assert _allows(free.mask(), core.eos)  # "1" is a whole integer: the grammar allows an end or more digits
    assert _allowed(held.mask(), size) == _allowed(free.mask(), size) - core.ends
    assert core.ids["2"] in _allowed(held.mask(), size)

    document = core.spell('{"k":"ab"}')
    held, free = (
        core.gate(core.request(12, grammar=core.grammar, response_format="{}")),
        core.gate(core.request(0, grammar=core.grammar, response_format="{}")),
    )
    for token in document:
        assert np.array_equal(held.mask(), free.mask())  # no end allowed before the document is whole
        held.observe(token)
        free.observe(token)
    # the document is whole and the grammar allows only an end: its mask stands, short of min_tokens or not
    assert _allowed(free.mask(), size) == core.ends
    assert held.constrained and np.array_equal(held.mask(), free.mask())


def test_without_anything_to_hold_back_the_gate_stays_plain(core: _Core) -> None:
    request = core.request(4, ignore_eos=True)
    assert held_back_ids(request, frozenset()) == frozenset()
    gate = core.gate(request, ends=frozenset())
    assert gate.plain and not gate.constrained and gate.mask() is None


def test_min_tokens_needs_a_grammar_compiler_and_names_its_field(core: _Core) -> None:
    request = core.request(2)
    with pytest.raises(ValueError, match="min_tokens needs a grammar compiler"):
        HostGate(request, core.tokenizer, None, ends=core.ends, silent=core.ends)
    assert format_param(request) == "min_tokens"
    assert format_param(core.request(0)) == "response_format"
    assert not needs_gate(core.request(0))


def test_logit_bias_bans_ids_and_restricts_to_the_ids_given_100(core: _Core) -> None:
    a, b, c = core.ids["a"], core.ids["b"], core.ids["c"]
    size = core.compiler.sampled_size
    banned = core.gate(core.request(0, banned_ids=[a, core.eos]))
    assert needs_gate(core.request(0, banned_ids=[a])) and banned.holds_rounds and banned.constrained
    assert _allowed(banned.mask(), size) == set(range(size)) - {a, core.eos}
    banned.observe(b)
    assert banned.constrained and _allowed(banned.mask(), size) == set(range(size)) - {a, core.eos}
    only = core.gate(core.request(0, only_ids=[a, b], banned_ids=[b]))
    assert _allowed(only.mask(), size) == {a}
    masks = only.masks_along([a, a, c, a])
    assert len(masks) == 3 and all(_allowed(mask, size) == {a} for mask in masks)  # c may not be offered
    assert format_param(core.request(0, only_ids=[a])) == "logit_bias"


def test_logit_bias_narrows_a_grammar_unless_nothing_would_be_left(core: _Core) -> None:
    size = core.compiler.sampled_size
    digits = [core.ids[d] for d in "0123456789"]
    number = parse_response_format({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    assert number is not None
    grammar = core.compiler.compile(number)
    free = core.gate(core.request(0, grammar=grammar, response_format="{}"))
    seven = core.gate(core.request(0, grammar=grammar, response_format="{}", only_ids=[core.ids["7"]]))
    assert _allowed(seven.mask(), size) == {core.ids["7"]}
    letters = core.gate(core.request(0, grammar=grammar, response_format="{}", only_ids=[core.ids["a"]]))
    assert np.array_equal(letters.mask(), free.mask())  # no digit given 100: the grammar's mask stands
    no_digits = core.gate(core.request(0, grammar=grammar, response_format="{}", banned_ids=digits[1:]))
    assert _allowed(no_digits.mask(), size) == _allowed(free.mask(), size) - set(digits[1:])


def test_an_end_given_100_outranks_min_tokens(core: _Core) -> None:
    gate = core.gate(core.request(4, only_ids=[core.eos]))
    assert _allowed(gate.mask(), core.compiler.sampled_size) == {core.eos}


@pytest.mark.parametrize(("fields", "param"), [({"min_tokens": 2}, "min_tokens"), ({"banned_ids": [5]}, "logit_bias")])
def test_an_engine_that_makes_no_gates_refuses_a_round_mask(
    start_fixture: Callable[..., RunningModel], fields: dict[str, Any], param: str
) -> None:
    """Without a tokenizer an engine makes no host gates, so it cannot mask a round: such a request is
    refused, not served without its mask."""
    running = start_fixture()
    running.engine.scheduler.make_gate = None
    events = list(running.engine.submit(PreparedRequest("m", [1, 2], 4, GREEDY, **fields)))
    assert events == [
        AdmissionRejected("m", "an engine without a tokenizer masks no tokens", param=param, permanent=True)
    ]
    served = list(running.engine.submit(PreparedRequest("p", [1, 2], 4, GREEDY)))
    assert isinstance(served[-1], Finished) and served[-1].completion_tokens == 4
