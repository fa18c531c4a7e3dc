"""Prefix-boundary rules decide where prefix reuse may cut.

The rules (``FrontendContract.prefix_boundaries``) turn a prompt's layout into allowed cuts; a request's
first admission then claims only the published pages wholly before the last allowed cut that its matched
run covers. Outputs stay those of the same request run alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from helios_core.contract import PrefixBoundaries, PromptLayout, PromptMessage
from helios_core.contract.boundaries import last_cut
from helios_core.runtime.messages import PreparedRequest
from helios_core.runtime.native_model import NativeModel
from helios_core.wire import contract_pb2 as ct

from .test_resume import PENALIZED, Driver, prompt, solo, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeModel]:
    with tiny_model(tmp_path_factory.mktemp("boundaries")) as loaded:
        yield loaded


SYSTEM, USER, ASSISTANT = ct.MESSAGE_ROLE_SYSTEM, ct.MESSAGE_ROLE_USER, ct.MESSAGE_ROLE_ASSISTANT
INDEPENDENT = ct.RENDERING_CONSTRAINT_INDEPENDENT
WITHOUT_TOOLS = ct.RENDERING_CONSTRAINT_INDEPENDENT_WITHOUT_TOOLS
UNLESS_STRIPPED = ct.RENDERING_CONSTRAINT_INDEPENDENT_UNLESS_REASONING_STRIPPED


def rules(*declared: tuple[list[int], int]) -> ct.FrontendContract:
    frontend = ct.FrontendContract()
    for roles, constraint in declared:
        frontend.prefix_boundaries.add(roles=roles, constraint=constraint)
    return frontend


CONVERSATION = (
    PromptMessage(SYSTEM, 6),
    PromptMessage(USER, 13),
    PromptMessage(ASSISTANT, 22),
    PromptMessage(USER, 34),
)


@pytest.mark.parametrize(
    ("layout", "cuts"),
    [
        (PromptLayout(CONVERSATION), (6, 13, 22, 34)),
        (PromptLayout(CONVERSATION, reasoning_stripped=True), (6, 13, 34)),
        (PromptLayout(CONVERSATION, tools=True), (13, 22, 34)),
        (PromptLayout(CONVERSATION, tools=True, reasoning_stripped=True), (13, 34)),
        (PromptLayout(()), ()),
    ],
)
def test_rules_allow_cuts_after_their_roles_when_their_constraint_holds(
    layout: PromptLayout, cuts: tuple[int, ...]
) -> None:
    boundaries = PrefixBoundaries.of(
        rules(([SYSTEM], WITHOUT_TOOLS), ([USER], INDEPENDENT), ([ASSISTANT], UNLESS_STRIPPED))
    )
    assert boundaries.restricted
    assert boundaries.cuts(layout) == cuts


def test_without_rules_or_without_a_layout_any_offset_may_cut() -> None:
    assert PrefixBoundaries.of(ct.FrontendContract()).cuts(PromptLayout(CONVERSATION)) is None
    assert PrefixBoundaries.of(rules(([USER], INDEPENDENT))).cuts(None) is None


@pytest.mark.parametrize(("limit", "cut"), [(5, 0), (6, 6), (12, 6), (13, 13), (40, 34)])
def test_the_last_cut_is_the_largest_at_most_the_limit(limit: int, cut: int) -> None:
    assert last_cut((6, 13, 22, 34), limit) == cut


def test_a_layout_whose_message_ends_decrease_names_the_message() -> None:
    layout = PromptLayout((PromptMessage(USER, 9), PromptMessage(ASSISTANT, 4)))
    assert layout.problem(20) == (
        "message 1 ends at token 4, outside [9, 20] (message ends must not decrease and must lie within the prompt)"
    )
    assert PromptLayout((PromptMessage(USER, 21),)).problem(20) == (
        "message 0 ends at token 21, outside [0, 20] (message ends must not decrease and must lie within the prompt)"
    )


@pytest.mark.parametrize(
    ("declared", "stripped", "reused"),
    [
        # no rules: every matched page (24 tokens: the requests differ from token 26, page 6 on)
        ((), False, 24),
        # the assistant message's end (22) is allowed: the 5 pages before it
        ((([SYSTEM, USER], INDEPENDENT), ([ASSISTANT], UNLESS_STRIPPED)), False, 20),
        # reasoning was stripped: the last allowed cut is the user message's end (13), 3 pages before it
        ((([SYSTEM, USER], INDEPENDENT), ([ASSISTANT], UNLESS_STRIPPED)), True, 12),
        # only system messages end at allowed cuts: one page before token 6
        ((([SYSTEM], INDEPENDENT),), False, 4),
    ],
)
def test_a_shared_prefix_is_reused_only_up_to_the_last_allowed_cut(
    model: NativeModel, declared: tuple[tuple[list[int], int], ...], stripped: bool, reused: int
) -> None:
    """Two conversations share their first 26 tokens (system, user and assistant messages and the start of
    a second user message); the second reuses the first's published pages only up to an allowed cut."""
    contract = model.contract
    frontend = rules(*declared)
    layout_model = ct.ModelContract()
    layout_model.CopyFrom(contract.model)
    layout_model.frontend.prefix_boundaries.extend(frontend.prefix_boundaries)
    driver = Driver.of(model, pages=64, contract=dataclasses.replace(contract, model=layout_model))
    shared = prompt(26)
    first = PreparedRequest("first", [*shared, 101, 102, 103, 104, 105, 106, 107, 108], 3, PENALIZED, ignore_eos=True)
    second = PreparedRequest("second", [*shared, 111, 112, 113, 114, 115, 116, 117, 118], 3, PENALIZED, ignore_eos=True)
    driver.add(first, PromptLayout(CONVERSATION))
    driver.run()
    driver.add(second, PromptLayout(CONVERSATION, reasoning_stripped=stripped))
    driver.run()
    assert driver.finished["first"].reused_prompt_tokens == 0
    assert driver.finished["second"].reused_prompt_tokens == reused
    assert driver.tokens["second"] == solo(model, second)
    assert driver.tokens["first"] == solo(model, first)
