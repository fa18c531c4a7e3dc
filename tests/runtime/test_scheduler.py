"""Continuous batching on a golden tiny core: batched outputs equal solo outputs, prefix reuse,
preemption under a small cache, per-request fault isolation, and allocator invariants."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from helios_core.runtime.messages import (
    ExecutionFailed,
    Finished,
    PreparedRequest,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf

GREEDY = SamplingParams(temperature=0.0)


def prompts(running: RunningModel, count: int) -> list[list[int]]:
    """Prompts sharing a common opening (overlapping prefixes) with distinct endings."""
    return [
        running.bootstrap.encode_prompt([{"role": "user", "content": f"Shared opening, then {i}"}])
        for i in range(count)
    ]


def solo(running: RunningModel, prompt: list[int], tokens: int, params: SamplingParams = GREEDY) -> list[int]:
    return running.engine.generate(PreparedRequest("solo", prompt, tokens, params, ignore_eos=True)).token_ids


def concurrent(
    running: RunningModel, work: list[tuple[list[int], SamplingParams]], tokens: int
) -> dict[str, list[int]]:
    streams = [
        running.engine.submit(PreparedRequest(f"r{i}", prompt, tokens, params, ignore_eos=True))
        for i, (prompt, params) in enumerate(work)
    ]
    outputs: dict[str, list[int]] = {}
    for stream in streams:
        events = list(stream)
        assert isinstance(events[-1], Finished), events[-1]
        outputs[stream.request_id] = [e.token_id for e in events if isinstance(e, TokenEvent)]
    return outputs


def assert_allocator_settled(running: RunningModel) -> None:
    pages = running.engine.allocator
    pages.check()
    assert pages.referenced_pages == 0
    assert pages.free_pages + pages.evictable_pages == pages.total_pages


def test_concurrent_requests_produce_exactly_their_solo_tokens(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    texts = prompts(running, 6)
    work = [(texts[i % 6], GREEDY if i % 2 else SamplingParams(temperature=0.9, top_p=0.9, seed=i)) for i in range(16)]
    expected = {f"r{i}": solo(running, prompt, 12, params) for i, (prompt, params) in enumerate(work)}
    assert concurrent(running, work, 12) == expected
    stats = running.engine.statistics()
    assert stats.launches.get("decode_b4", 0) > 0  # requests really shared rounds
    assert stats.finished == {"length": 32}
    assert_allocator_settled(running)


def test_shared_prefix_is_reused_with_identical_output(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    shared = list(range(1, 41))  # 40 tokens: 10 complete pages of 4
    first = running.engine.generate(PreparedRequest("a", [*shared, 50], 8, GREEDY, ignore_eos=True))
    assert first.reused_prompt_tokens == 0
    second = running.engine.generate(PreparedRequest("b", [*shared, 50], 8, GREEDY, ignore_eos=True))
    assert second.reused_prompt_tokens == 40
    assert second.token_ids == first.token_ids
    other = running.engine.generate(
        PreparedRequest("c", [*shared[:20], 99, *shared[21:], 7], 8, GREEDY, ignore_eos=True)
    )
    assert other.reused_prompt_tokens == 20
    # Without reuse (a cold cache) the same prompt gives the same tokens.
    cold = start_fixture()
    assert cold.engine.generate(PreparedRequest("d", [*shared, 50], 8, GREEDY, ignore_eos=True)).token_ids == (
        first.token_ids
    )
    assert running.engine.statistics().reused_tokens == 60
    assert_allocator_settled(running)


def test_pages_completed_while_decoding_are_reusable_by_the_next_admission(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """Decode rounds publish complete pages lazily: before a later admission matches prefixes (here while
    the first request still decodes) and when the request releases them (after it finished)."""
    running = start_fixture()
    engine = running.engine
    prompt = [5, 6, 7]  # 3 tokens: every later page of 4 is completed by decode rounds
    stream = engine.submit(PreparedRequest("long", prompt, 40, GREEDY, ignore_eos=True))
    seen: list[int] = []
    events = iter(stream)
    while len(seen) < 14:
        event = next(events)
        if isinstance(event, TokenEvent):
            seen.append(event.token_id)
    # "long" has consumed its prompt and 13 sampled tokens (16 positions: 4 complete pages) by now.
    during = engine.generate(PreparedRequest("during", [*prompt, *seen], 6, GREEDY, ignore_eos=True))
    assert during.reused_prompt_tokens == 16
    rest = [e.token_id for e in events if isinstance(e, TokenEvent)]
    generated = [*seen, *rest]
    assert len(generated) == 40
    after = engine.generate(PreparedRequest("after", [*prompt, *generated[:30]], 6, GREEDY, ignore_eos=True))
    assert after.reused_prompt_tokens == 32  # 33 prompt tokens: 8 complete pages below the last token
    cold = start_fixture()
    assert cold.engine.generate(PreparedRequest("c1", [*prompt, *seen], 6, GREEDY, ignore_eos=True)).token_ids == (
        during.token_ids
    )
    assert cold.engine.generate(
        PreparedRequest("c2", [*prompt, *generated[:30]], 6, GREEDY, ignore_eos=True)
    ).token_ids == after.token_ids
    assert_allocator_settled(running)


def test_a_small_cache_completes_everything_through_preemption(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture(cache_pages=20)  # 4 requests x (30 + 20 tokens) need 52 pages of 4
    texts = prompts(running, 4)
    work = [(text, GREEDY) for text in texts]
    expected = {f"r{i}": solo(running, prompt, 20) for i, (prompt, _) in enumerate(work)}
    assert concurrent(running, work, 20) == expected
    stats = running.engine.statistics()
    assert stats.preemptions > 0
    assert stats.finished.get("length") == 8
    assert_allocator_settled(running)


def test_a_stale_generation_fails_only_its_request(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    backend = running.engine.model.backend
    original = backend.run
    corrupted = []

    def corrupt_second_lane(program: str, frame: int) -> None:
        original(program, frame)
        if program.startswith("decode_b") and not corrupted:
            backend.completion(frame)[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[1] += 100
            corrupted.append(program)

    texts = prompts(running, 3)
    expected = [solo(running, text, 10) for text in texts]
    backend.run = corrupt_second_lane  # type: ignore[method-assign]
    streams = [
        running.engine.submit(PreparedRequest(f"r{i}", t, 10, GREEDY, ignore_eos=True)) for i, t in enumerate(texts)
    ]
    outcomes = [list(stream) for stream in streams]
    failed = [events for events in outcomes if isinstance(events[-1], ExecutionFailed)]
    assert len(failed) == 1 and "is stale" in failed[0][-1].message
    for events, tokens in zip(outcomes, expected, strict=True):
        if isinstance(events[-1], Finished):
            assert [e.token_id for e in events if isinstance(e, TokenEvent)] == tokens
        else:  # nothing from the failed round was published for the failed request
            published = [e.token_id for e in events if isinstance(e, TokenEvent)]
            assert published == tokens[: len(published)] and len(published) < 10
    assert_allocator_settled(running)


def test_an_exception_inside_a_program_fails_only_that_round(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    backend = running.engine.model.backend
    original = backend.run
    raised = []

    def explode_once(program: str, frame: int) -> None:
        if program.startswith("decode") and not raised:
            raised.append(program)
            raise FloatingPointError("injected")
        original(program, frame)

    text = prompts(running, 1)[0]
    backend.run = explode_once  # type: ignore[method-assign]
    events = list(running.engine.submit(PreparedRequest("x", text, 5, GREEDY, ignore_eos=True)))
    assert isinstance(events[-1], ExecutionFailed) and "FloatingPointError: injected" in events[-1].message
    # The model stays healthy for the next request.
    assert len(running.engine.generate(PreparedRequest("y", text, 5, GREEDY, ignore_eos=True)).token_ids) == 5
    assert_allocator_settled(running)


@pytest.mark.parametrize("value", [-1, 100_000])
def test_an_out_of_vocabulary_id_fails_only_its_request(value: int, start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    backend = running.engine.model.backend
    original = backend.run

    def corrupt_first_lane(program: str, frame: int) -> None:
        original(program, frame)
        if program.startswith("decode_b"):
            backend.completion(frame)[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(-1)[0] = value

    backend.run = corrupt_first_lane  # type: ignore[method-assign]
    texts = prompts(running, 2)
    outcomes = [
        list(s) for s in [running.engine.submit(PreparedRequest(f"r{i}", t, 6, GREEDY)) for i, t in enumerate(texts)]
    ]
    kinds = sorted(type(events[-1]).__name__ for events in outcomes)
    assert kinds[0] == "ExecutionFailed"
    expected = "no id could be sampled" if value == -1 else f"sampled id {value} lies outside the vocabulary"
    assert any(expected in e[-1].message for e in outcomes if isinstance(e[-1], ExecutionFailed))
    assert_allocator_settled(running)


def test_two_frames_pipeline_decode_rounds_without_changing_outputs(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture()
    texts = prompts(running, 4)
    work = [(text, GREEDY if i % 2 else SamplingParams(temperature=0.9, seed=i)) for i, text in enumerate(texts)]
    pipelined = concurrent(running, work, 16)
    assert running.engine.statistics().pipelined_rounds > 0
    running.engine.scheduler.pipelining = False
    before = running.engine.statistics().pipelined_rounds
    assert concurrent(running, work, 16) == pipelined
    assert running.engine.statistics().pipelined_rounds == before
    assert_allocator_settled(running)


def test_a_lane_failing_in_the_first_frame_is_suppressed_in_the_second(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture()
    backend = running.engine.model.backend
    original = backend.run
    corrupted: list[int] = []

    def corrupt_frame0_lane1(program: str, frame: int) -> None:
        original(program, frame)
        if program.startswith("decode_b") and frame == 0 and not corrupted:
            backend.completion(frame)[mf.COMPLETION_FIELD_RESERVED].reshape(-1)[1] = 7
            corrupted.append(frame)

    texts = prompts(running, 3)
    expected = [solo(running, text, 12) for text in texts]
    backend.run = corrupt_frame0_lane1  # type: ignore[method-assign]
    streams = [
        running.engine.submit(PreparedRequest(f"p{i}", t, 12, GREEDY, ignore_eos=True)) for i, t in enumerate(texts)
    ]
    outcomes = [list(stream) for stream in streams]
    assert running.engine.statistics().pipelined_rounds > 0
    failures = [events for events in outcomes if isinstance(events[-1], ExecutionFailed)]
    assert len(failures) == 1 and "reserved model field is 7" in failures[0][-1].message
    for events, tokens in zip(outcomes, expected, strict=True):
        published = [e.token_id for e in events if isinstance(e, TokenEvent)]
        assert published == tokens[: len(published)]
        assert sum(isinstance(e, (Finished, ExecutionFailed)) for e in events) == 1
    assert_allocator_settled(running)
