"""Load-time selection: capacities from options and core defaults, speculative width, history drafting."""

from __future__ import annotations

import re

import pytest

from helios_core.contract import LoadOptions, select
from helios_core.contract.selection import (
    DEFAULT_EVENT_CAPACITY,
    DEFAULT_FRONTEND_WORKERS,
    DEFAULT_QUEUE_CAPACITY,
)
from helios_core.errors import StartupError

CAPACITY_FIELDS = ["max_active", "queue_capacity", "frontend_workers", "event_capacity"]


def refuses(parts, options: LoadOptions, fragment: str) -> None:
    prepared = parts.prepare()
    with pytest.raises(StartupError, match=re.escape(fragment)):
        select(prepared, options)


def test_defaults_without_core_defaults(parts) -> None:
    for field in CAPACITY_FIELDS:
        assert not parts.serving.defaults.HasField(field)
    selection = select(parts.prepare(), LoadOptions())
    assert selection.max_active == parts.serving.max_concurrency == 4
    assert selection.queue_capacity == DEFAULT_QUEUE_CAPACITY
    assert selection.frontend_workers == DEFAULT_FRONTEND_WORKERS
    assert selection.event_capacity == DEFAULT_EVENT_CAPACITY
    assert selection.speculative_width == 1
    assert selection.history_drafting is False
    assert set(selection.graphs) == {g.name for g in parts.model.graphs}
    assert selection.state_rows_per_request == 1


def test_core_defaults_fill_unset_options(parts) -> None:
    defaults = parts.serving.defaults
    defaults.max_active = 2
    defaults.queue_capacity = 10
    defaults.frontend_workers = 3
    defaults.event_capacity = 100
    selection = select(parts.prepare(), LoadOptions())
    assert (selection.max_active, selection.queue_capacity) == (2, 10)
    assert (selection.frontend_workers, selection.event_capacity) == (3, 100)


@pytest.mark.parametrize("field", CAPACITY_FIELDS)
def test_each_core_default_is_used_on_its_own(parts, field: str) -> None:
    setattr(parts.serving.defaults, field, 3)
    selection = select(parts.prepare(), LoadOptions())
    assert getattr(selection, field) == 3


def test_explicit_options_win_over_core_defaults(parts) -> None:
    defaults = parts.serving.defaults
    defaults.max_active = 2
    defaults.queue_capacity = 10
    defaults.frontend_workers = 3
    defaults.event_capacity = 100
    options = LoadOptions(max_active=3, queue_capacity=7, frontend_workers=1, event_capacity=512)
    selection = select(parts.prepare(), options)
    assert (selection.max_active, selection.queue_capacity) == (3, 7)
    assert (selection.frontend_workers, selection.event_capacity) == (1, 512)


def test_max_active_above_captured_concurrency(parts) -> None:
    refuses(
        parts,
        LoadOptions(max_active=5),
        "max_active 5 exceeds the core's captured concurrency 4; load-time selection can only reduce it",
    )


def test_core_default_max_active_above_captured_concurrency(parts) -> None:
    parts.serving.defaults.max_active = 8
    refuses(parts, LoadOptions(), "max_active 8 exceeds the core's captured concurrency 4")


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("field", [*CAPACITY_FIELDS, "speculative_width"])
def test_non_positive_option(parts, field: str, value: int) -> None:
    flag = "--" + field.replace("_", "-")
    refuses(parts, LoadOptions(**{field: value}), f"{flag} must be positive, not {value}")


def test_speculative_width_defaults_to_the_widest_declared(parts) -> None:
    parts.add_speculative()
    selection = select(parts.prepare(), LoadOptions())
    assert selection.speculative_width == 4
    assert "speculative_w4" in selection.graphs


def test_smaller_speculative_width_drops_wider_programs(parts) -> None:
    parts.add_speculative()
    selection = select(parts.prepare(), LoadOptions(speculative_width=1))
    assert selection.speculative_width == 1
    assert "speculative_w4" not in selection.graphs
    assert "decode_b4" in selection.graphs


def test_a_width_between_captured_widths_runs_as_the_widest_within_it(parts) -> None:
    parts.add_speculative(widths=(2, 4))
    selection = select(parts.prepare(), LoadOptions(speculative_width=3))
    assert selection.speculative_width == 2
    assert "speculative_w4" not in selection.graphs


def test_speculative_width_above_widest(parts) -> None:
    parts.add_speculative()
    refuses(
        parts,
        LoadOptions(speculative_width=5),
        "speculative width 5 exceeds the widest captured width 4; load-time selection can only reduce it",
    )


def test_speculative_width_without_speculative_programs(parts) -> None:
    refuses(parts, LoadOptions(speculative_width=2), "speculative width 2 exceeds the widest captured width 1")


def test_history_drafting_needs_learned_speculation(parts) -> None:
    parts.add_speculative(candidate_ids=True)
    refuses(
        parts,
        LoadOptions(history_drafting=True),
        "history drafting needs a core with learned speculation enabled",
    )


def test_history_drafting_needs_a_width_above_one(parts) -> None:
    parts.add_speculative(candidate_ids=True)
    parts.serving.learned_speculation = True
    refuses(
        parts,
        LoadOptions(history_drafting=True, speculative_width=1),
        "history drafting needs a speculative width above one",
    )


def test_history_drafting_needs_candidate_ids_in_wider_graphs(parts) -> None:
    parts.add_speculative(candidate_ids=False)
    parts.serving.learned_speculation = True
    refuses(
        parts,
        LoadOptions(history_drafting=True),
        "history drafting needs copied-token inputs (CANDIDATE_IDS) in selected graph 'speculative_w4'",
    )


def test_history_drafting_checks_every_selected_wider_graph(parts) -> None:
    parts.add_speculative("speculative_w4", candidate_ids=True)
    parts.add_speculative("speculative_w3", width=3, packed=12, draft=2, widths=(3, 4), candidate_ids=False)
    parts.serving.learned_speculation = True
    refuses(
        parts,
        LoadOptions(history_drafting=True),
        "history drafting needs copied-token inputs (CANDIDATE_IDS) in selected graph 'speculative_w3'",
    )


def test_history_drafting_with_candidate_ids(parts) -> None:
    parts.add_speculative(candidate_ids=True)
    parts.serving.learned_speculation = True
    selection = select(parts.prepare(), LoadOptions(history_drafting=True))
    assert selection.history_drafting is True
    assert selection.speculative_width == 4
    assert "speculative_w4" in selection.graphs


def test_state_rows_per_request_is_the_maximum_over_selected_graphs(parts) -> None:
    parts.graph("prefill_p16").state_rows_per_request = 2
    parts.graph("decode_b4").state_rows_per_request = 3
    assert select(parts.prepare(), LoadOptions()).state_rows_per_request == 3


def test_state_rows_ignore_graphs_that_are_not_selected(parts) -> None:
    parts.graph("decode_b4").state_rows_per_request = 2
    parts.add_speculative().state_rows_per_request = 5
    prepared = parts.prepare()
    assert select(prepared, LoadOptions()).state_rows_per_request == 5
    assert select(prepared, LoadOptions(speculative_width=1)).state_rows_per_request == 2


@pytest.mark.parametrize("field", ["max_active", "queue_capacity", "frontend_workers", "event_capacity"])
def test_a_zero_core_default_is_rejected(field: str, make_parts) -> None:
    parts = make_parts()
    setattr(parts.serving.defaults, field, 0)
    with pytest.raises(StartupError, match=f"the core's default {field} is 0"):
        select(parts.prepare(), LoadOptions())
