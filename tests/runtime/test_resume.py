"""RESUME rounds: readmission from a snapshot taken while a request prefilled, and assistant continuation.

A tiny synthetic core with snapshot, restore and RESUME programs runs on the reference backend under a
deterministic driver (plan, pack, run, validate, apply: what the engine's worker does for one frame), so
each test pins the exact program of every round (``RoundPlan.graph``) and compares the tokens with those
of the same request on the path without RESUME (a solo run that prefills and decodes), greedy with
penalties (the next token then depends on the restored sampling state).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helios_core.contract import LoadOptions, PreparedContract, PromptLayout, select
from helios_core.loading import open_core
from helios_core.runtime.completion import LaneResult, RecordViews, read_lanes
from helios_core.runtime.engine import _programs_writing_completion, _transport_owned
from helios_core.runtime.messages import (
    AdmissionRejected,
    Finished,
    PreparedRequest,
    RoundTokens,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.packing import Submission
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.slots import Phase
from helios_core.runtime.stats import SchedulerStats

from .engine_harness import build_snapshot_core

NAMESPACE = "helios-tests/resume"
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)


@contextmanager
def tiny_model(tmp: Path) -> Iterator[NativeModel]:
    """A tiny synthetic core on the reference backend: pages of 4 tokens, a 64-token context, B4 P16
    prefill, mixed and resume programs, decode B1/B2/B4 and 4 snapshot rows."""
    built = build_snapshot_core(tmp, NAMESPACE)
    core = open_core(built.path, built.trust, check_resources=False)
    try:
        loaded = NativeModel.load(core.core, core.contract, select(core.contract, LoadOptions()), backend="reference")
        try:
            yield loaded
        finally:
            loaded.close()
    finally:
        core.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeModel]:
    with tiny_model(tmp_path_factory.mktemp("resume")) as loaded:
        yield loaded


@dataclass
class Driver:
    """Runs a scheduler's rounds on a model one at a time, as the engine's worker does on one frame."""

    model: NativeModel
    scheduler: Scheduler
    graphs: list[str] = field(default_factory=list)
    """The program of every non-empty round, in order."""
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, Finished] = field(default_factory=dict)
    sequence: int = 0

    @classmethod
    def of(cls, model: NativeModel, *, pages: int, contract: PreparedContract | None = None) -> Driver:
        used = contract if contract is not None else model.contract
        allocator = PageAllocator(pages, used.model.cache.page_tokens, used.serving.cache_identity)
        scheduler = Scheduler(used, model.selection, allocator, SchedulerStats())
        scheduler.pipelining = False
        return cls(model, scheduler)

    def add(self, request: PreparedRequest, layout: PromptLayout | None = None) -> None:
        assert self.scheduler.add(request, layout) is None
        self.tokens[request.request_id] = []

    def run(self) -> None:
        """Rounds until every request has finished."""
        writers = _programs_writing_completion(self.model)
        backend = self.model.backend
        for _ in range(500):
            if self.scheduler.idle:
                return
            plan = self.scheduler.next_round()
            if plan is None or not len(plan):
                continue  # every lane made room for a preemption (a snapshot is planned next): planned again
            name = plan.graph.name
            self.graphs.append(name)
            self.sequence += 1
            staging = backend.transport(0)
            self.model.packers[name].pack(Submission(plan.lanes, self.sequence), 0, staging)
            frame_index, sequence = _transport_owned(self.model, staging)
            if frame_index is not None:
                frame_index[0] = 0
            if sequence is not None:
                sequence[0] = self.sequence
            backend.run(name, 0)
            if name in writers:
                results = read_lanes(
                    RecordViews.of(backend.completion(0)),
                    self.sequence,
                    plan.expectations,
                    self.model.contract.sampled_size,
                    packed_capacity=plan.graph.extents.packed_token_capacity,
                )
            else:
                results = [LaneResult(-1, 0.0) for _ in range(len(plan))]
            for event in self.scheduler.complete(plan, results):
                if isinstance(event, RoundTokens):
                    for request_id, lane in event.lanes.items():
                        self.tokens[request_id].append(event.token_ids[lane])
                elif isinstance(event, TokenEvent):
                    self.tokens[event.request_id].append(event.token_id)
                elif isinstance(event, Finished):
                    self.finished[event.request_id] = event
                else:
                    raise AssertionError(f"unexpected event {event!r}")
            self.scheduler.allocator.check()
        raise AssertionError("the requests did not finish within 500 rounds")


def solo(model: NativeModel, request: PreparedRequest) -> list[int]:
    """``request``'s tokens alone in a roomy cache, without a layout (no RESUME round)."""
    driver = Driver.of(model, pages=64)
    driver.add(request)
    driver.run()
    assert "resume_p16" not in driver.graphs
    return driver.tokens[request.request_id]


def prompt(length: int, start: int = 20) -> list[int]:
    return [start + (i * 7) % 90 for i in range(length)]


def test_a_request_preempted_while_it_prefills_is_restored_and_resumed(model: NativeModel) -> None:
    """The younger request is the victim while it prefills: a snapshot keeps its initialized sampling state
    at its consumed endpoint, and after the restore its remaining prompt runs on RESUME programs."""
    old = PreparedRequest("old", prompt(8), 6, PENALIZED, ignore_eos=True)
    young = PreparedRequest("young", prompt(40, start=60), 4, PENALIZED, ignore_eos=True)
    driver = Driver.of(model, pages=12)  # both prompts fill the cache: old's first decode page preempts young
    driver.add(old)
    driver.add(young)
    driver.run()
    assert driver.graphs == [
        "initialize",
        "prefill_p16",  # old's 8 tokens (it samples) and young's first 8
        "snapshot",  # old's first decode lane needs a page: young, prefilling, is snapshotted at 8
        *["decode_b1"] * 5,  # old alone (young waits for the pages of its whole prompt)
        "restore",  # young readmitted: its 2 complete pages matched again, the state rows restored
        "resume_p16",  # positions 8..23
        "resume_p16",  # positions 24..39; the last chunk samples
        *["decode_b1"] * 3,
    ]
    assert driver.tokens["old"] == solo(model, old)
    assert driver.tokens["young"] == solo(model, young)
    stats = driver.scheduler.stats
    assert (stats.snapshots, stats.restores, stats.preemptions) == (1, 1, 1)
    assert sorted(driver.scheduler.free_snapshot_rows) == [0, 1, 2, 3]
    assert driver.scheduler.allocator.referenced_pages == 0


def test_a_continued_assistant_message_is_resumed_after_its_prefix_is_prefilled(model: NativeModel) -> None:
    request = PreparedRequest("continued", prompt(30), 5, PENALIZED, ignore_eos=True)
    driver = Driver.of(model, pages=64)
    driver.add(request, PromptLayout(continuation=22))
    driver.run()
    # prefill stops where the assistant message's content starts; its 8 tokens are resumed and sample
    assert driver.graphs == ["initialize", "prefill_p16", "prefill_p16", "resume_p16", *["decode_b1"] * 4]
    assert driver.tokens["continued"] == solo(model, request)
    assert driver.finished["continued"].reason == "length"


def test_a_continuation_whose_prefix_is_reused_resumes_at_once(model: NativeModel) -> None:
    first = PreparedRequest("first", prompt(30), 2, PENALIZED, ignore_eos=True)
    tail = [200, 201, 202, 203, 204, 205]
    continued = PreparedRequest("continued", [*prompt(26), *tail], 4, PENALIZED, ignore_eos=True)
    driver = Driver.of(model, pages=64)
    driver.add(first)
    driver.run()
    driver.graphs.clear()
    driver.add(continued, PromptLayout(continuation=20))
    driver.run()
    # 24 tokens (6 pages) come from the first request's pages, past the continuation's start at 20
    assert driver.finished["continued"].reused_prompt_tokens == 24
    assert driver.graphs == ["initialize", "resume_p16", *["decode_b1"] * 3]
    assert driver.tokens["continued"] == solo(model, continued)


@pytest.mark.parametrize(("length", "continuation", "new"), [(20, 12, 10), (20, 6, 10), (22, 14, 12), (18, 10, 12)])
def test_continued_messages_preempted_by_a_snapshot_are_restored_where_they_were(
    model: NativeModel, length: int, continuation: int, new: int
) -> None:
    """Two continued assistant messages outgrow the cache while both decode: the younger is snapshotted, and
    readmitted it prefills its unmatched pages up to the snapshot's endpoint, is restored there and decodes
    on, with the tokens it has alone. (Its continuation's start used to become the prefill target again: an
    empty prefill lane when its matched pages reached past it, a restore over uncomputed pages otherwise.)"""
    old = PreparedRequest("old", prompt(length), new, PENALIZED, ignore_eos=True)
    young = PreparedRequest("young", prompt(length, start=60), new, PENALIZED, ignore_eos=True)
    driver = Driver.of(model, pages=12 if length >= 20 else 10)
    driver.add(old, PromptLayout(continuation=continuation))
    driver.add(young, PromptLayout(continuation=continuation))
    driver.run()
    snapshot = driver.graphs.index("snapshot")
    assert driver.graphs[snapshot:].count("restore") == 1
    assert driver.graphs[driver.graphs.index("restore") - 1] == "prefill_p16"  # the unmatched pages first
    assert "resume_p16" not in driver.graphs[snapshot:]  # it had decoded: restored, it decodes on
    assert (driver.tokens["old"], driver.tokens["young"]) == (solo(model, old), solo(model, young))
    stats = driver.scheduler.stats
    assert (stats.snapshots, stats.restores, stats.preemptions) == (1, 1, 1)
    assert driver.scheduler.allocator.referenced_pages == 0


def test_a_continuation_that_starts_at_the_prompts_end_prefills_as_usual(model: NativeModel) -> None:
    request = PreparedRequest("whole", prompt(12), 2, PENALIZED, ignore_eos=True)
    driver = Driver.of(model, pages=64)
    driver.add(request, PromptLayout(continuation=12))
    driver.run()
    assert driver.graphs == ["initialize", "prefill_p16", "decode_b1"]


def test_a_readmitted_request_preempted_before_its_restore_keeps_its_snapshot(model: NativeModel) -> None:
    """A request waiting for its restore holds nothing a snapshot could save: preempting it again keeps
    the snapshot it was readmitted with."""
    driver = Driver.of(model, pages=64)
    residency = driver.scheduler.residency
    driver.add(PreparedRequest("r", prompt(10), 8, PENALIZED, ignore_eos=True))
    for _ in range(3):  # initialize, prefill (samples), one decode round
        plan = driver.scheduler.next_round()
        assert plan is not None
        results = [LaneResult(7 if e.samples else -1, 0.0) for e in plan.expectation_list()]
        driver.scheduler.complete(plan, results)
    state = driver.scheduler.running[0]
    state.snapshot_row = residency.free_snapshot_rows.pop()
    state.snapshot_endpoint = int(driver.scheduler.table.consumed[state.slot])
    residency.leave_after_snapshot(state)
    residency.admit()
    # its 2 complete pages are matched; positions 8..10 are recomputed before the restore (its state rows
    # hold nothing of its own yet, so a snapshot of them now would be wrong)
    assert driver.scheduler.table.phase[state.slot] == Phase.PREFILL
    row = state.snapshot_row
    residency.preempt(state)
    assert (state.slot, state.snapshot_row, residency.waiting[0]) == (-1, row, state)
    assert row not in residency.free_snapshot_rows


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            PromptLayout(continuation=11),
            "the prompt layout does not fit the prompt: the continued assistant message starts at token 11, "
            "outside [0, 10]",
        ),
    ],
)
def test_a_layout_that_does_not_fit_the_prompt_is_rejected(
    model: NativeModel, layout: PromptLayout, message: str
) -> None:
    driver = Driver.of(model, pages=64)
    rejection = driver.scheduler.add(PreparedRequest("bad", prompt(10), 4, PENALIZED), layout)
    assert rejection == AdmissionRejected("bad", message, param="messages", permanent=True)
    assert not driver.scheduler.waiting
