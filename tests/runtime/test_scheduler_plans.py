"""The scheduler on its own: exact plans for given capacities, and exact state after hand-made completions.

Each test builds a :class:`Scheduler` from the golden fixture core's selection as the engine does (a
``NativeModel`` on the null backend supplies the physical cache pages; nothing is executed), adds
requests, asks for rounds and feeds each round the :class:`LaneResult` values a validated completion
record would give. The fixture core: 4 slots, a context of 64 tokens in pages of 4 (16 per row), EOS ids
256 and 258, an input vocabulary of 259, variants ``initialize`` (B4), ``prefill_p16`` and ``mixed_p16``
(B4, P16), ``decode_b1``, ``decode_b2`` and ``decode_b4``, and no snapshot programs (preemption recomputes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from helios_core.contract import LoadOptions, select
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.completion import CompletionError, ExpectationBatch, LaneExpectation, LaneResult, LaneResults
from helios_core.runtime.messages import (
    AdmissionRejected,
    ExecutionFailed,
    Finished,
    Outgoing,
    PreparedRequest,
    RoundTokens,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.packing import Lane, LaneBatch
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.plan import RoundPlan as Round
from helios_core.runtime.planner import prompt_histogram
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.slots import Phase, RequestState
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct

from .conftest import FIXTURES, fixture_settings

GREEDY = SamplingParams(temperature=0.0)
EOS = 256
"""One of the fixture core's EOS ids (258 is the other)."""

MakeScheduler = Callable[..., Scheduler]


@pytest.fixture(scope="module")
def verified() -> Iterator[VerifiedCore]:
    core = open_core(FIXTURES / "payload-v3.core", fixture_settings(), check_resources=False)
    yield core
    core.close()


@pytest.fixture
def make_scheduler(verified: VerifiedCore) -> MakeScheduler:
    """A scheduler over ``LoadOptions(**options)``, its allocator sized as the engine sizes it; with
    ``total_pages`` the allocator has that many pages instead (fewer than a model would ever load)."""

    def factory(*, total_pages: int | None = None, **options: Any) -> Scheduler:
        contract = verified.contract
        load = LoadOptions(**options)
        model = NativeModel.load(
            verified.core, contract, select(contract, load), backend="null", cache_pages=load.cache_pages
        )
        try:
            pages = model.cache_pages if total_pages is None else total_pages
            allocator = PageAllocator(pages, contract.model.cache.page_tokens, contract.serving.cache_identity)
            return Scheduler(contract, model.selection, allocator, SchedulerStats())
        finally:
            model.close()

    return factory


def request(request_id: str, prompt: Sequence[int], max_tokens: int, *, ignore_eos: bool = False) -> PreparedRequest:
    return PreparedRequest(request_id, list(prompt), max_tokens, GREEDY, ignore_eos=ignore_eos)


def prompt_of(length: int, start: int = 1) -> list[int]:
    return list(range(start, start + length))


def lanes_of(round_: Round) -> list[Lane]:
    return round_.lane_list()


def expectations_of(round_: Round) -> list[LaneExpectation]:
    return round_.expectation_list()


def ids(round_: Round) -> list[str]:
    return list(round_.request_ids)


def generated_tokens(scheduler: Scheduler) -> list[list[int]]:
    """Each running request's generated tokens, from the slot table (the one copy of its progress)."""
    return [scheduler.table.token_list(s.slot, s.prompt_len) for s in scheduler.running]


def page_tables(scheduler: Scheduler) -> list[list[int]]:
    return [scheduler.table.page_list(s.slot) for s in scheduler.running]


def shape(round_: Round) -> list[tuple[int, list[int], list[int], bool]]:
    """Per lane: slot, positions, host-fed tokens and whether it samples."""
    return [(lane.slot, list(lane.positions), list(lane.tokens), lane.sample) for lane in lanes_of(round_)]


def results(round_: Round, tokens: Sequence[int] = ()) -> Sequence[LaneResult | CompletionError]:
    """What validation returns for ``round_``: ``tokens`` for its sampling lanes in lane order (a decode
    round's batch is answered with LaneResults, as :func:`read_lanes` answers it)."""
    expectations = round_.expectations
    if isinstance(expectations, ExpectationBatch):
        assert len(tokens) == len(expectations)
        return LaneResults(list(tokens), [-0.5] * len(tokens), {}, {})
    sampled = iter(tokens)
    answer = [LaneResult(next(sampled), -0.5) if e.samples else LaneResult(-1, 0.0) for e in expectations]
    assert next(sampled, None) is None, "more tokens than sampling lanes"
    return answer


def step(scheduler: Scheduler, tokens: Sequence[int] = ()) -> tuple[Round, list[Outgoing]]:
    """Plan the next round and complete it with ``tokens``."""
    round_ = scheduler.next_round()
    assert round_ is not None
    return round_, scheduler.complete(round_, results(round_, tokens))


def token(request_id: str, token_id: int) -> TokenEvent:
    return TokenEvent(request_id, token_id, -0.5, ((token_id, ""),))


def test_prompt_histograms_count_each_id_below_the_width_up_to_255() -> None:
    prompt = np.array([3, 7, 3, *[9] * 300, 12, -1, 3], dtype=np.int32)
    histogram = prompt_histogram(prompt, 10)  # 12 and -1 lie outside a 10-id histogram
    assert histogram.dtype == np.uint8
    assert histogram.tolist() == [0, 0, 0, 3, 0, 0, 0, 1, 0, 255]
    assert prompt_histogram(np.array([], dtype=np.int32), 4).tolist() == [0, 0, 0, 0]


def test_the_initialize_lane_carries_its_prompts_histogram(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_active=2)
    prompt = [4, 9, 4, 4, 250, 9, 1]
    assert scheduler.add(request("r0", prompt, 1)) is None
    init = scheduler.next_round()
    assert init is not None and init.graph.name == "initialize"
    (lane,) = lanes_of(init)
    assert lane.prompt_histogram is not None
    width = scheduler.planner.histogram_width
    assert lane.prompt_histogram.tolist() == np.bincount(prompt, minlength=width).tolist()


# -- admission -----------------------------------------------------------------------------------------


def test_requests_queue_in_order_and_are_admitted_up_to_max_active(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_active=2)
    for index in range(3):
        assert scheduler.add(request(f"r{index}", prompt_of(5 + index), 1)) is None
    assert [s.request_id for s in scheduler.waiting] == ["r0", "r1", "r2"]
    assert scheduler.running == []

    init = scheduler.next_round()
    assert init is not None
    assert init.graph.name == "initialize"
    assert ids(init) == ["r0", "r1"]
    assert [(lane.slot, lane.generation, list(lane.page_table)) for lane in lanes_of(init)] == [
        (0, 1, [0, 1]),  # 5 tokens: 2 pages of 4
        (1, 2, [2, 3]),  # 6 tokens
    ]
    assert [lane.prompt_histogram is not None for lane in lanes_of(init)] == [True, True]
    assert expectations_of(init) == [LaneExpectation(1, 0, False), LaneExpectation(2, 0, False)]
    assert [s.request_id for s in scheduler.waiting] == ["r2"]
    assert scheduler.free_slots == []
    assert scheduler.complete(init, results(init)) == []

    # Both prompts fit one prefill round; each lane ends its prompt, so it samples. max_tokens=1: both end.
    prefill, events = step(scheduler, [10, 11])
    assert prefill.graph.name == "prefill_p16"
    assert shape(prefill) == [
        (0, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5], True),
        (1, [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], True),
    ]
    assert events == [
        token("r0", 10),
        Finished("r0", "length", 5, 1, 0),
        token("r1", 11),
        Finished("r1", "length", 6, 1, 0),
    ]
    # The third request takes the first slot released (slot 1 was released last) and the next generation.
    init = scheduler.next_round()
    assert init is not None and ids(init) == ["r2"]
    assert [(lane.slot, lane.generation) for lane in lanes_of(init)] == [(1, 3)]
    stats = scheduler.stats
    assert (stats.received, stats.admitted, stats.rejected) == (3, 3, 0)
    assert stats.finished == {"length": 2}


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message", "param"),
    [
        ([], 4, "the prompt is empty", "messages"),
        ([1, 259, 2], 4, "prompt token id 259 lies outside the input vocabulary [0, 259)", "messages"),
        ([1, 2], 0, "max_tokens must be positive", "max_tokens"),
        (
            prompt_of(60),
            10,
            "prompt (60 tokens) plus max_tokens (10) exceeds the core's context of 64 tokens; "
            "at most 4 output tokens fit this prompt",
            "max_tokens",
        ),
        (
            prompt_of(64),
            1,
            "prompt (64 tokens) does not fit the core's context of 64 tokens: it leaves no room for an output token",
            "messages",
        ),
    ],
)
def test_capacity_rejections_name_the_field_and_are_permanent(
    make_scheduler: MakeScheduler, prompt: list[int], max_tokens: int, message: str, param: str
) -> None:
    scheduler = make_scheduler()
    assert scheduler.add(request("x", prompt, max_tokens)) == AdmissionRejected("x", message, param, True)
    assert not scheduler.waiting
    assert (scheduler.stats.received, scheduler.stats.rejected) == (0, 1)
    assert scheduler.next_round() is None


def test_a_request_needing_more_pages_than_the_cache_holds_is_rejected(make_scheduler: MakeScheduler) -> None:
    # The engine never loads a cache this small (one request at full context needs 16 pages); the check
    # still compares a request's pages with the physical cache as well as with a page-table row.
    scheduler = make_scheduler(total_pages=8)
    assert scheduler.add(request("fits", prompt_of(20), 12)) is None  # 32 tokens: 8 pages
    assert scheduler.add(request("big", prompt_of(20), 13)) == AdmissionRejected(
        "big", "the request needs 9 cache pages; at most 8 fit", "max_tokens", True
    )
    assert scheduler.add(request("long", prompt_of(40), 1)) == AdmissionRejected(
        "long", "the request needs 11 cache pages; at most 8 fit", "max_tokens", True
    )
    assert [s.request_id for s in scheduler.waiting] == ["fits"]
    assert (scheduler.stats.received, scheduler.stats.rejected) == (1, 2)


def test_a_full_pending_queue_refuses_transiently(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(queue_capacity=2)
    assert scheduler.add(request("a", [1, 2], 1)) is None
    assert scheduler.has_room
    assert scheduler.add(request("b", [1, 2], 1)) is None
    assert not scheduler.has_room
    assert scheduler.add(request("c", [1, 2], 1)) == AdmissionRejected(
        "c", "the pending admission queue holds its limit of 2 requests; retry later", None, False
    )
    assert [s.request_id for s in scheduler.waiting] == ["a", "b"]
    assert (scheduler.stats.received, scheduler.stats.rejected) == (2, 1)


# -- prefill, mixed and decode rounds ---------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_chunks_of_the_largest_prefill_variant(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    prompt = prompt_of(40, start=100)
    assert scheduler.add(request("long", prompt, 3)) is None
    init, _ = step(scheduler)
    assert init.graph.name == "initialize"
    assert list(lanes_of(init)[0].page_table) == list(range(10))  # 40 tokens: 10 pages, lowest ids first

    chunks = []
    for tokens in ([], [], [7]):  # only the chunk that ends the prompt samples
        round_, events = step(scheduler, tokens)
        (lane,) = lanes_of(round_)
        chunks.append((round_.graph.name, lane.positions[0], lane.query_length, lane.sample, lane.consumed))
        assert list(lane.tokens) == prompt[lane.positions[0] : lane.positions[0] + lane.query_length]
        assert list(lane.cache_slots) == list(lane.positions)  # pages 0..9 in order: slot = position
    assert chunks == [
        ("prefill_p16", 0, 16, False, 0),
        ("prefill_p16", 16, 16, False, 16),
        ("prefill_p16", 32, 8, True, 32),
    ]
    assert events == [token("long", 7)]
    assert scheduler.allocator.stats.published == 10  # every complete prompt page, as prefill completes it
    assert scheduler.stats.rounds == {"initialize": 1, "prefill": 3}


def test_a_prefill_runs_beside_decoding_requests_in_a_mixed_round(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    assert scheduler.add(request("short", prompt_of(6), 8)) is None
    assert scheduler.add(request("long", prompt_of(30, start=50), 8)) is None
    step(scheduler)  # initialize both

    # Nothing decodes yet: a plain prefill round, first come first served within 16 tokens.
    prefill, events = step(scheduler, [20])
    assert prefill.graph.name == "prefill_p16"
    assert ids(prefill) == ["short", "long"]
    assert shape(prefill) == [
        (0, list(range(6)), prompt_of(6), True),
        (1, list(range(10)), prompt_of(10, start=50), False),
    ]
    assert [lane.mixed_prefill for lane in lanes_of(prefill)] == [False, False]
    assert events == [token("short", 20)]

    # "short" now decodes: it joins first as a one-token lane fed from the host, then "long" takes the
    # remaining 15 tokens of the budget.
    mixed, events = step(scheduler, [21])
    assert mixed.graph.name == "mixed_p16"
    assert ids(mixed) == ["short", "long"]
    assert shape(mixed) == [(0, [6], [20], True), (1, list(range(10, 25)), prompt_of(15, start=60), False)]
    assert [lane.mixed_prefill for lane in lanes_of(mixed)] == [False, True]
    assert [lane.sampling_step for lane in lanes_of(mixed)] == [1, 0]
    assert expectations_of(mixed) == [LaneExpectation(1, 7, True), LaneExpectation(2, 25, False)]
    assert events == [token("short", 21)]

    # The last 5 prompt tokens end "long"'s prompt: both lanes sample.
    mixed, events = step(scheduler, [22, 30])
    assert mixed.graph.name == "mixed_p16"
    assert shape(mixed) == [(0, [7], [21], True), (1, list(range(25, 30)), prompt_of(5, start=75), True)]
    assert events == [token("short", 22), token("long", 30)]

    # Both decode: a decode round of two lanes on the smallest variant that holds them, tokens device-owned.
    decode = scheduler.next_round()
    assert decode is not None
    assert decode.graph.name == "decode_b2"
    assert isinstance(decode.lanes, LaneBatch)
    assert shape(decode) == [(0, [8], [], True), (1, [30], [], True)]
    assert [lane.sampling_step for lane in lanes_of(decode)] == [3, 1]
    assert [list(lane.page_table) for lane in lanes_of(decode)] == [[0, 1, 10], [2, 3, 4, 5, 6, 7, 8, 9]]
    assert [list(lane.cache_slots) for lane in lanes_of(decode)] == [[40], [38]]
    assert expectations_of(decode) == [LaneExpectation(1, 9, True), LaneExpectation(2, 31, True)]
    assert scheduler.stats.launches == {"initialize": 1, "prefill_p16": 1, "mixed_p16": 2}
    assert scheduler.stats.lanes == 8


def decoding(scheduler: Scheduler, *requests: PreparedRequest) -> None:
    """Admit ``requests`` (prompts of at most 16 tokens together), initialize and prefill them: each
    samples its first token (100, 101, ...), so all are decode-ready."""
    for prepared in requests:
        assert scheduler.add(prepared) is None
    step(scheduler)
    prefill, _ = step(scheduler, [100 + index for index in range(len(requests))])
    assert prefill.graph.name == "prefill_p16" and len(prefill) == len(requests)


def test_a_steady_decode_round_has_a_follow_up_one_position_ahead(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    decoding(scheduler, request("a", [1, 2, 3], 6), request("b", [4, 5, 6, 7, 8, 9], 6))
    decode = scheduler.next_round()
    assert decode is not None and decode.graph.name == "decode_b2"
    assert shape(decode) == [(0, [3], [], True), (1, [6], [], True)]

    follow = scheduler.followup(decode)
    assert follow is not None
    assert follow.graph is decode.graph
    assert follow.request_ids == decode.request_ids
    assert shape(follow) == [(0, [4], [], True), (1, [7], [], True)]
    assert [lane.sampling_step for lane in lanes_of(follow)] == [2, 2]
    assert [lane.consumed for lane in lanes_of(follow)] == [4, 7]
    # "a" (3 tokens in its one page) has one position left there: its next page is taken for the follow-up.
    assert [list(lane.page_table) for lane in lanes_of(follow)] == [[0, 3], [1, 2]]
    assert expectations_of(follow) == [LaneExpectation(1, 5, True), LaneExpectation(2, 8, True)]
    assert scheduler.stats.pipelined_rounds == 1

    # The running round completes first: its tokens go out once for the whole cohort.
    assert scheduler.complete(decode, results(decode, [40, 41])) == [
        RoundTokens({"a": 0, "b": 1}, [40, 41], [-0.5, -0.5], None)
    ]
    # The round after the follow-up is planned while the follow-up runs; "b" now needs its third page.
    third = scheduler.followup(follow)
    assert third is not None
    assert shape(third) == [(0, [5], [], True), (1, [8], [], True)]
    assert [list(lane.page_table) for lane in lanes_of(third)] == [[0, 3], [1, 2, 4]]
    assert scheduler.complete(follow, results(follow, [42, 43])) == [
        RoundTokens({"a": 0, "b": 1}, [42, 43], [-0.5, -0.5], None)
    ]
    assert generated_tokens(scheduler) == [[100, 40, 42], [101, 41, 43]]
    assert scheduler.stats.pipelined_rounds == 2
    assert scheduler.stats.launches == {"initialize": 1, "prefill_p16": 1, "decode_b2": 2}


def test_no_follow_up_when_a_round_needs_completion_feedback(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_active=2)
    decoding(scheduler, request("a", [1, 2, 3], 3), request("b", [4, 5, 6], 8))
    decode = scheduler.next_round()
    assert decode is not None and decode.graph.name == "decode_b2"
    # "a" has generated 1 of 3: the follow-up would sample its last token, so it may be planned ...
    follow = scheduler.followup(decode)
    assert follow is not None
    scheduler.complete(decode, results(decode, [40, 41]))
    # ... but not a third round: after the follow-up "a" has no token left.
    assert scheduler.followup(follow) is None
    events = scheduler.complete(follow, results(follow, [42, 43]))
    assert events == [RoundTokens({"a": 0, "b": 1}, [42, 43], [-0.5, -0.5], None), Finished("a", "length", 3, 3, 0)]
    scheduler.release_fenced()
    assert [s.request_id for s in scheduler.running] == ["b"]

    # A request waiting for a free slot ends the chain: it must be admitted first.
    decode = scheduler.next_round()
    assert decode is not None and ids(decode) == ["b"] and decode.graph.name == "decode_b1"
    follow = scheduler.followup(decode)
    assert follow is not None
    assert scheduler.complete(decode, results(decode, [44])) == [RoundTokens({"b": 0}, [44], [-0.5], None)]
    assert scheduler.add(request("c", [7, 8, 9], 4)) is None
    assert scheduler.followup(follow) is None
    assert scheduler.complete(follow, results(follow, [45])) == [RoundTokens({"b": 0}, [45], [-0.5], None)]
    scheduler.release_fenced()
    init = scheduler.next_round()
    assert init is not None and init.graph.name == "initialize" and ids(init) == ["c"]
    assert scheduler.followup(init) is None  # only decode rounds are followed up
    scheduler.complete(init, results(init))
    mixed = scheduler.next_round()
    assert mixed is not None and mixed.graph.name == "mixed_p16" and ids(mixed) == ["b", "c"]
    assert scheduler.followup(mixed) is None
    scheduler.complete(mixed, results(mixed, [46, 102]))

    # Both slots are taken: a waiting request cannot be admitted, so it does not end the chain ...
    assert scheduler.add(request("d", [1], 4)) is None
    decode = scheduler.next_round()
    assert decode is not None and ids(decode) == ["b", "c"]
    follow = scheduler.followup(decode)
    assert follow is not None
    scheduler.complete(decode, results(decode, [47, 103]))
    # ... and with pipelining off there is never a follow-up.
    scheduler.pipelining = False
    assert scheduler.followup(follow) is None
    assert scheduler.complete(follow, results(follow, [48, 104])) == [
        RoundTokens({"b": 0, "c": 1}, [48, 104], [-0.5, -0.5], None),
        Finished("b", "length", 3, 8, 0),  # its eighth token
    ]
    scheduler.release_fenced()
    assert generated_tokens(scheduler) == [[102, 103, 104]]
    assert scheduler.stats.pipelined_rounds == 3


# -- completion ------------------------------------------------------------------------------------------


def test_completion_finishes_on_eos_unless_ignored_and_on_the_output_limit(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    decoding(
        scheduler,
        request("eos", [1, 2, 3], 8),
        request("ignoring", [1, 2, 3, 4], 8, ignore_eos=True),
        request("limit", [5, 6, 7], 2),
    )
    decode = scheduler.next_round()
    assert decode is not None and decode.graph.name == "decode_b4"
    assert ids(decode) == ["eos", "ignoring", "limit"]
    events = scheduler.complete(decode, results(decode, [EOS, EOS, 9]))
    assert events == [
        RoundTokens({"eos": 0, "ignoring": 1, "limit": 2}, [EOS, EOS, 9], [-0.5, -0.5, -0.5], None),
        Finished("eos", "stop", 3, 2, 0),  # lane order
        Finished("limit", "length", 3, 2, 0),
    ]
    assert [s.request_id for s in scheduler.running] == ["ignoring"]
    assert sorted(scheduler.free_slots) == [0, 2, 3]
    assert scheduler.stats.finished == {"length": 1, "stop": 1}
    # The round completed the first page of "eos" and of "limit" (3 prompt tokens and the first sampled
    # one): published as they released their pages, which stay reusable (evictable). "ignoring"'s prompt
    # page was published by its prefill; it holds that page and the one of its position 4.
    pages = scheduler.allocator
    assert pages.stats.published == 3
    assert (pages.referenced_pages, pages.evictable_pages, pages.free_pages) == (2, 2, pages.total_pages - 4)
    assert page_tables(scheduler) == [[1, 3]]
    pages.check()

    # EOS does not end "ignoring" and a token past EOS is simply appended; its output limit ends it.
    for _ in range(5):
        round_, events = step(scheduler, [EOS])
        assert round_.graph.name == "decode_b1"
        assert events == [RoundTokens({"ignoring": 0}, [EOS], [-0.5], None)]
    round_, events = step(scheduler, [EOS])
    assert events == [RoundTokens({"ignoring": 0}, [EOS], [-0.5], None), Finished("ignoring", "length", 4, 8, 0)]
    assert scheduler.idle and sorted(scheduler.free_slots) == [0, 1, 2, 3]
    assert pages.referenced_pages == 0
    assert pages.stats.published == 4  # and "ignoring"'s second page (positions 4..7), as it released it
    assert scheduler.stats.finished == {"length": 2, "stop": 1}
    assert scheduler.next_round() is None


def test_lane_by_lane_completion_publishes_a_token_event_per_lane(make_scheduler: MakeScheduler) -> None:
    """A prefill lane's token (here with an EOS) is a TokenEvent followed by the request's end."""
    scheduler = make_scheduler()
    assert scheduler.add(request("a", prompt_of(8), 4)) is None
    assert scheduler.add(request("b", prompt_of(5, start=20), 4)) is None
    step(scheduler)
    prefill, events = step(scheduler, [258, 30])
    assert ids(prefill) == ["a", "b"]
    assert events == [token("a", 258), Finished("a", "stop", 8, 1, 0), token("b", 30)]
    assert scheduler.allocator.stats.published == 3  # "a": 2 prompt pages; "b": 1 complete page of 5 tokens
    assert scheduler.allocator.evictable_pages == 2  # "a"'s pages, released


# -- preemption and cancellation --------------------------------------------------------------------------


def test_a_page_shortage_preempts_the_most_recent_request_which_is_readmitted_later(
    make_scheduler: MakeScheduler,
) -> None:
    scheduler = make_scheduler(cache_pages=16)
    assert scheduler.allocator.total_pages == 16
    assert scheduler.add(request("old", prompt_of(20), 6)) is None  # 5 pages
    assert scheduler.add(request("new", prompt_of(40, start=50), 10)) is None  # 10 pages
    step(scheduler)
    step(scheduler)  # "old" 0..15
    step(scheduler, [60])  # "old" 16..19 (samples), "new" 0..11
    mixed, _ = step(scheduler, [61])  # "old" at 20 takes the last free page; "new" 12..26
    assert [list(lane.page_table) for lane in lanes_of(mixed)] == [[0, 1, 2, 3, 4, 15], list(range(5, 15))]
    mixed, _ = step(scheduler, [62, 63])  # "new" 27..39 ends its prompt
    assert scheduler.allocator.available() == 0

    # "new" lacks the page of position 40, and nobody younger runs: it waits (starved) while "old" decodes.
    for position in (22, 23):
        decode, _ = step(scheduler, [64])
        assert (decode.graph.name, ids(decode), shape(decode)) == ("decode_b1", ["old"], [(0, [position], [], True)])
        assert scheduler.starved
        assert scheduler.stats.preemptions == 0
    # "old" now needs the page of position 24: the younger "new" is preempted (recomputation: no snapshot
    # programs), its slot and pages released and its progress reset; it waits at the front of the queue.
    pressed = scheduler.next_round()
    assert pressed is not None and ids(pressed) == ["old"]
    assert scheduler.stats.preemptions == 1
    assert [s.request_id for s in scheduler.waiting] == ["new"]
    (new,) = scheduler.waiting
    assert (new.slot, new.generated) == (-1, 1)  # it holds no slot, so no pages and no progress
    assert new.tokens == [*prompt_of(40, start=50), 63]  # prompt and generated token kept
    assert scheduler.free_slots == [3, 2, 1]
    assert not scheduler.starved
    assert len(lanes_of(pressed)[0].page_table) == 7
    events = scheduler.complete(pressed, results(pressed, [65]))
    assert events == [RoundTokens({"old": 0}, [65], [-0.5], None), Finished("old", "length", 20, 6, 0)]

    # Readmitted: a new slot generation, initialized again, then its 41 tokens are prefilled beyond what
    # its reusable pages hold and the last chunk samples its second token. Its pages were released last
    # page first, so the one page "old" took was its deepest: the nine before it are reused.
    init, _ = step(scheduler)
    assert init.graph.name == "initialize" and ids(init) == ["new"]
    assert [(lane.slot, lane.generation) for lane in lanes_of(init)] == [(0, 3)]  # "old"'s slot, released last
    assert len(lanes_of(init)[0].page_table) == 11
    first_positions = []
    while True:
        prefill = scheduler.next_round()
        assert prefill is not None and prefill.graph.name == "prefill_p16" and ids(prefill) == ["new"]
        (lane,) = lanes_of(prefill)
        first_positions.append(lane.positions[0])
        events = scheduler.complete(prefill, results(prefill, [70] if lane.sample else []))
        if lane.sample:
            break
    assert (lane.positions[-1], lane.tokens[-1]) == (40, 63)
    assert first_positions == [36]  # 9 reused pages of 4 tokens; only positions 36..40 are computed
    assert events == [token("new", 70)]
    assert scheduler.stats.admitted == 3
    scheduler.allocator.check()


def test_cancelled_waiting_and_running_requests_finish_and_release_slot_and_pages(
    make_scheduler: MakeScheduler,
) -> None:
    scheduler = make_scheduler(max_active=1)
    assert scheduler.add(request("running", prompt_of(6), 8)) is None
    assert scheduler.add(request("waiting", prompt_of(3), 8)) is None
    step(scheduler)
    step(scheduler, [40])
    assert [s.request_id for s in scheduler.running] == ["running"]
    assert scheduler.allocator.referenced_pages == 2

    scheduler.cancel("waiting")
    scheduler.cancel("unknown")  # ignored
    assert scheduler.take_cancelled() == [Finished("waiting", "cancelled", 3, 0, 0)]
    assert not scheduler.waiting
    assert scheduler.take_cancelled() == []

    scheduler.cancel("running")
    assert scheduler.take_cancelled() == [Finished("running", "cancelled", 6, 1, 0)]
    assert scheduler.running == [] and scheduler.idle
    assert scheduler.free_slots == [0]
    pages = scheduler.allocator
    assert pages.referenced_pages == 0
    assert pages.evictable_pages == 1  # its one complete prompt page stays reusable
    pages.check()
    assert scheduler.stats.finished == {"cancelled": 2}
    assert scheduler.next_round() is None


# -- completion: the exact state a plan and its results leave --------------------------------------------


def progress(scheduler: Scheduler, request_id: str) -> tuple[str, int, int, list[int], list[int], int]:
    """A running request's row of the slot table: phase, consumed endpoint, generated count, tokens,
    page table and published pages."""
    (state,) = [s for s in scheduler.running if s.request_id == request_id]
    table, slot = scheduler.table, state.slot
    return (
        Phase(int(table.phase[slot])).name,
        int(table.consumed[slot]),
        int(table.generated[slot]),
        table.token_list(slot),
        table.page_list(slot),
        int(table.published[slot]),
    )


def test_a_round_plan_is_a_frozen_value_without_request_objects(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    decoding(scheduler, request("a", [1, 2, 3], 6))
    plan = scheduler.next_round()
    assert plan is not None and plan.decode
    for name in RoundPlan.__struct_fields__:
        assert not isinstance(getattr(plan, name), RequestState), name
    with pytest.raises(AttributeError):
        plan.cohort = 7  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.lanes.count = 2  # type: ignore[union-attr,misc]
    assert not plan.lanes.rows[ct.VALUE_SOURCE_SLOT].flags.writeable  # type: ignore[union-attr]
    init_lane = Lane(slot=0, generation=1, state_row=0, positions=[], cache_slots=[], page_table=[0])
    with pytest.raises(AttributeError):
        init_lane.slot = 1  # type: ignore[misc]


def test_completion_writes_the_slot_table_from_the_plan_and_results(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    assert scheduler.add(request("a", prompt_of(6), 4)) is None
    assert scheduler.add(request("b", prompt_of(3, start=20), 4)) is None
    init = scheduler.next_round()
    assert init is not None
    assert progress(scheduler, "a") == ("INITIALIZE", 0, 0, prompt_of(6), [0, 1], 0)
    assert scheduler.complete(init, results(init)) == []
    assert progress(scheduler, "a") == ("PREFILL", 0, 0, prompt_of(6), [0, 1], 0)
    prefill = scheduler.next_round()
    assert prefill is not None
    scheduler.complete(prefill, results(prefill, [40, 41]))
    # Prompt computed, the sampled token appended and pending on the device; "a"'s first page is full.
    assert progress(scheduler, "a") == ("DECODE", 6, 1, [*prompt_of(6), 40], [0, 1], 1)
    assert progress(scheduler, "b") == ("DECODE", 3, 1, [*prompt_of(3, start=20), 41], [2], 0)
    decode = scheduler.next_round()
    assert decode is not None and decode.decode
    scheduler.complete(decode, results(decode, [42, 43]))
    # The decode round's positions were 6 and 3: the tokens there are computed; "b" completes its page
    # (published when another request could first reuse it: counted here, hashed at admission or release).
    assert progress(scheduler, "a") == ("DECODE", 7, 2, [*prompt_of(6), 40, 42], [0, 1], 1)
    assert progress(scheduler, "b") == ("DECODE", 4, 2, [*prompt_of(3, start=20), 41, 43], [2], 1)
    assert scheduler.table.completions == 3


def test_a_failed_lane_leaves_the_other_lanes_state_as_a_healthy_round_would(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    decoding(scheduler, request("a", [1, 2, 3], 6), request("b", [4, 5, 6], 6))
    decode = scheduler.next_round()
    assert decode is not None
    answer = LaneResults([50, 51], [-0.5, -0.5], {0: CompletionError("lane 0: generation 9 is stale")}, {})
    events = scheduler.complete(decode, answer)
    assert events == [
        ExecutionFailed("a", "lane 0: generation 9 is stale"),
        token("b", 51),
    ]
    assert [s.request_id for s in scheduler.running] == ["b"]
    assert progress(scheduler, "b") == ("DECODE", 4, 2, [4, 5, 6, 101, 51], [1], 1)
    assert scheduler.table.phase[0] == Phase.FREE and 0 in scheduler.free_slots


def test_a_request_that_ends_under_a_follow_up_is_fenced_and_its_lane_suppressed(
    make_scheduler: MakeScheduler,
) -> None:
    scheduler = make_scheduler()
    decoding(scheduler, request("a", [1, 2, 3], 8), request("b", [4, 5, 6], 8))
    decode = scheduler.next_round()
    assert decode is not None
    follow = scheduler.followup(decode)
    assert follow is not None and follow.ahead == 1
    assert set(scheduler.in_flight) == {0, 1}
    events = scheduler.complete(decode, results(decode, [EOS, 60]))
    assert events == [RoundTokens({"a": 0, "b": 1}, [EOS, 60], [-0.5, -0.5], None), Finished("a", "stop", 3, 2, 0)]
    # "a" keeps its slot and pages until the follow-up's fence, as ENDED; its follow-up lane is suppressed.
    assert progress(scheduler, "a")[0] == "ENDED"
    assert scheduler.followup(follow) is None  # the cohort changed
    assert scheduler.complete(follow, results(follow, [70, 61])) == [token("b", 61)]
    scheduler.release_fenced()
    assert [s.request_id for s in scheduler.running] == ["b"]
    assert scheduler.table.phase[0] == Phase.FREE
    assert progress(scheduler, "b")[:4] == ("DECODE", 5, 3, [4, 5, 6, 101, 60, 61])
