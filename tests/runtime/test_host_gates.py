"""Host gates through the engine: string stops, token stops, observation and grammar statistics."""

from __future__ import annotations

import json
from collections.abc import Callable

from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel

GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "user", "content": "Hello there"}]


def run(running: RunningModel, **fields: object) -> tuple[list[TokenEvent], Finished]:
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    request = PreparedRequest("q", prompt, int(fields.pop("max_tokens", 20)), GREEDY, **fields)  # type: ignore[arg-type]
    events = list(running.engine.submit(request))
    finished = events[-1]
    assert isinstance(finished, Finished), finished
    return [e for e in events if isinstance(e, TokenEvent)], finished


def visible(tokens: list[TokenEvent], finished: Finished) -> str:
    return "".join(text for event in tokens for _, text in event.pieces) + "".join(t for _, t in finished.pieces)


def test_without_stops_the_pieces_are_the_decoded_output(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokens, finished = run(running, ignore_eos=True)
    ids = [e.token_id for e in tokens]
    assert visible(tokens, finished) == running.bootstrap.tokenizer.decode(ids, skip_special_tokens=False)
    assert [p[0] for e in tokens for p in e.pieces] == ids
    assert all(e.timestamp_ns == -1 for e in tokens)  # unobserved requests read no clock


def test_a_string_stop_removes_the_match_and_its_suffix(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokens, finished = run(running, ignore_eos=True)
    text = visible(tokens, finished)
    stop = text[6:9]
    first = text.index(stop)
    tokens, finished = run(running, ignore_eos=True, string_stops=[stop])
    assert finished.reason == "stop"
    assert visible(tokens, finished) == text[:first]
    # Usage counts every sampled token up to the one that completed the match.
    decoded = running.bootstrap.tokenizer.decode([e.token_id for e in tokens], skip_special_tokens=False)
    assert decoded.startswith(text[: first + len(stop)])
    assert finished.completion_tokens == len(tokens)


def test_an_unmatched_stop_prefix_is_flushed_at_the_output_limit(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokens, finished = run(running, ignore_eos=True, max_tokens=12)
    text = visible(tokens, finished)
    tokens, finished = run(running, ignore_eos=True, max_tokens=12, string_stops=[text[-1] + "\x00never"])
    assert finished.reason == "length"
    assert visible(tokens, finished) == text
    assert finished.pieces and finished.pieces[-1][1].endswith(text[-1])


def test_a_token_stop_is_omitted_from_presentation_but_observed(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokens, _ = run(running, ignore_eos=True)
    ids = [e.token_id for e in tokens]
    stop_id = ids[4]
    first = ids.index(stop_id)
    tokens, finished = run(running, ignore_eos=True, token_stops=[[stop_id]], observe_timestamps=True)
    assert finished.reason == "stop"
    assert [e.token_id for e in tokens] == ids[: first + 1]  # observation includes the stop token
    assert [p[0] for e in tokens for p in e.pieces] == ids[:first]  # presentation omits it
    stamps = [e.timestamp_ns for e in tokens]
    assert all(s >= 0 for s in stamps) and stamps == sorted(stamps)


def test_a_stop_sequence_buffers_its_prefix_until_resolved(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokens, _ = run(running, ignore_eos=True)
    ids = [e.token_id for e in tokens]
    sequence = [ids[2], ids[3], 100_000 % 259]
    if sequence[2] == ids[4]:
        sequence[2] = (sequence[2] + 1) % 259
    tokens, finished = run(running, ignore_eos=True, token_stops=[sequence])
    assert finished.reason == "length"
    presented = [p[0] for e in tokens for p in e.pieces] + [p[0] for p in finished.pieces if p[0] >= 0]
    assert presented == ids
    assert tokens[2].pieces == ()  # the possible stop prefix was held back


def test_constrained_and_unconstrained_requests_share_decode_rounds(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture()
    prompt = running.bootstrap.encode_prompt(MESSAGES)
    schema = {"type": "json_object"}
    streams = [
        running.engine.submit(PreparedRequest("c", prompt, 6, GREEDY, response_format=json.dumps(schema))),
        running.engine.submit(PreparedRequest("u", prompt, 6, GREEDY, ignore_eos=True)),
    ]
    outcomes = [list(s) for s in streams]
    assert all(isinstance(events[-1], Finished) for events in outcomes)
    constrained = "".join(t for e in outcomes[0] if isinstance(e, TokenEvent) for _, t in e.pieces)
    assert constrained.startswith("{")
    stats = running.engine.statistics()
    assert stats.constrained_max_inflight == 1
    assert stats.mixed_grammar_decode_steps > 0
