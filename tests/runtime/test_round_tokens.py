"""A steady decode round's tokens cross to the request streams once per round, and an ungated request's
stream detokenizes its tokens: every stream yields exactly the events that completing each round lane
by lane with a host gate per request yields (plain and gated requests, EOS, the output limit, failed
lanes, cancellation), in the same order."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from helios_core.frontend.detokenizer import TokenBytes
from helios_core.runtime import engine as engine_module
from helios_core.runtime.engine import Engine, RequestStream
from helios_core.runtime.gates import HostGate, StreamText
from helios_core.runtime.messages import (
    Finished,
    PreparedRequest,
    RoundTokens,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.progress import RoundCompletion
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf

GREEDY = SamplingParams(temperature=0.0)


def test_a_round_token_lane_is_the_token_event_it_stands_for() -> None:
    tokens = RoundTokens({"a": 0, "b": 1}, [7, 9], [-0.5, -1.25], ["x", ""])
    assert tokens.event("b") == TokenEvent("b", 9, -1.25, ((9, ""),), -1)
    assert tokens.event("a") == TokenEvent("a", 7, -0.5, ((7, "x"),), -1, ())
    stream = RequestStream("b")
    stream.put(tokens)
    stream.put(Finished("b", "length", 3, 1))
    assert list(stream) == [TokenEvent("b", 9, -1.25, ((9, ""),)), Finished("b", "length", 3, 1)]


def _work(running: RunningModel) -> list[PreparedRequest]:
    prompts = [running.bootstrap.encode_prompt([{"role": "user", "content": f"Rounds, then {i}"}]) for i in range(5)]
    warm = SamplingParams(temperature=0.9, top_p=0.95, seed=4)
    return [
        PreparedRequest("plain", prompts[0], 14, GREEDY, ignore_eos=True),
        PreparedRequest("eos", prompts[1], 16, warm),  # ends at the injected EOS id
        PreparedRequest("stopped", prompts[2], 6, GREEDY, ignore_eos=True, string_stops=["\x00never"]),
        PreparedRequest("failing", prompts[3], 15, warm, ignore_eos=True),  # its lane fails validation
        PreparedRequest("short", prompts[4], 9, GREEDY, ignore_eos=True),
        PreparedRequest("late", prompts[0], 5, warm, ignore_eos=True),  # waits for a slot
    ]


def _serve(running: RunningModel) -> tuple[dict[str, list[object]], int]:
    """Every stream's events and how many decode rounds were delivered as one :class:`RoundTokens`."""
    engine = running.engine
    backend = engine.model.backend
    original_run = backend.run
    injected: set[str] = set()
    eos = running.model.contract.eos_token_ids[0]

    def inject(program: str, frame: int) -> None:
        original_run(program, frame)
        if not program.startswith("decode_b"):
            return
        record = backend.completion(frame)
        generations = record[mf.COMPLETION_FIELD_GENERATION].reshape(-1).tolist()
        table = engine.scheduler.table
        lanes = {
            s.request_id: (int(table.generation[s.slot]), int(table.generated[s.slot]))
            for s in engine.scheduler.running
            if table.generation[s.slot] in generations
        }
        eos_lane, failing = lanes.get("eos"), lanes.get("failing")
        if eos_lane is not None and eos_lane[1] >= 4 and "eos" not in injected:
            injected.add("eos")  # the EOS id in the lane of the request that stops at EOS
            record[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(-1)[generations.index(eos_lane[0])] = eos
        if failing is not None and failing[1] >= 6 and "failing" not in injected:
            injected.add("failing")  # a stale generation in its lane
            record[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[generations.index(failing[0])] += 100

    delivered = [0]
    put_round = engine._put_round

    def counted(tokens: RoundTokens) -> None:
        delivered[0] += 1
        put_round(tokens)

    backend.run = inject  # type: ignore[method-assign]
    engine._put_round = counted  # type: ignore[method-assign]
    streams = [engine.submit(request) for request in _work(running)]
    served = {stream.request_id: list(stream) for stream in streams}
    return served, delivered[0]


def test_round_tokens_serve_the_events_of_lane_by_lane_completion(
    start_fixture: Callable[..., RunningModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    served, delivered = _serve(start_fixture())
    assert delivered > 0
    kinds = {rid: type(events[-1]).__name__ for rid, events in served.items()}
    assert kinds["failing"] == "ExecutionFailed" and "is stale" in str(served["failing"][-1])
    finished = {rid: events[-1].reason for rid, events in served.items() if isinstance(events[-1], Finished)}
    assert finished == {"plain": "length", "eos": "stop", "stopped": "length", "short": "length", "late": "length"}
    assert all(
        isinstance(event, TokenEvent) for events in served.values() for event in events[:-1]
    )  # every stream yields events only
    assert any(events[-1].pieces for events in served.values() if isinstance(events[-1], Finished))
    # The oracle: the same work, every decode round's events built lane by lane in the worker, and every request
    # detokenized by a host gate in the worker.
    monkeypatch.setattr(
        RoundCompletion,
        "_round_tokens",
        lambda self, lanes, results, skipped, events: self._lane_events(lanes, results, False, skipped, [], events),
    )
    monkeypatch.setattr(engine_module, "needs_gate", lambda request: True)
    expected, by_lane = _serve(start_fixture())
    assert by_lane == 0
    assert served == expected


def test_stream_text_gives_what_a_plain_gate_gives(start_fixture: Callable[..., RunningModel]) -> None:
    running = start_fixture()
    tokenizer = running.bootstrap.tokenizer
    token_bytes = TokenBytes.from_tokenizer(tokenizer)
    request = PreparedRequest("t", [1], 40, GREEDY)
    ids = [200, 201, 65, 195, 169, 300, 226, 130, 172, 66, 240, 159, 152, 128, 250]  # whole and split characters
    for table in (token_bytes, None):
        for cut in (len(ids), len(ids) - 1, len(ids) - 3):
            gate, text = HostGate(request, tokenizer, None, table), StreamText(tokenizer, table)
            for token in ids[:cut]:
                assert text.token(TokenEvent("t", token, -0.5, ((token, ""),), 9, ((1, -1.0),))) == TokenEvent(
                    "t", token, -0.5, tuple(gate.observe(token).pieces), 9, ((1, -1.0),)
                )
            for reason in ("length", "stop"):
                end = Finished("t", reason, 1, cut)
                assert text.finished(end) == Finished("t", reason, 1, cut, 0, gate.finish())
    cancelled = Finished("t", "cancelled", 1, 1)
    text = StreamText(tokenizer, token_bytes)
    text.push(195)
    assert text.finished(cancelled) is cancelled


def test_a_cancelled_request_ends_after_the_round_tokens_it_received(
    start_fixture: Callable[..., RunningModel],
) -> None:
    running = start_fixture()
    engine: Engine = running.engine
    prompt = running.bootstrap.encode_prompt([{"role": "user", "content": "Cancel me"}])
    drain = engine._drain
    cancelled: list[int] = []

    def drain_and_cancel(*, block: bool) -> bool:
        keep = drain(block=block)
        # On the worker, between two pipelined rounds: c0 is cancelled once it has generated 5 tokens.
        state = next((s for s in engine.scheduler.running if s.request_id == "c0"), None)
        generated = int(engine.scheduler.table.generated[state.slot]) if state is not None else 0
        if generated >= 5 and not cancelled:
            cancelled.append(generated)
            engine.scheduler.cancel("c0")
        return keep

    engine._drain = drain_and_cancel  # type: ignore[method-assign]
    streams = [engine.submit(PreparedRequest(f"c{i}", prompt, 30, GREEDY, ignore_eos=True)) for i in range(3)]
    events = list(streams[0])
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
    tokens = [e for e in events[:-1] if isinstance(e, TokenEvent)]
    assert len(tokens) == len(events) - 1 == events[-1].completion_tokens >= cancelled[0]
    for stream in streams[1:]:
        rest = list(stream)
        assert isinstance(rest[-1], Finished) and rest[-1].reason == "length"
        assert sum(isinstance(e, TokenEvent) for e in rest) == 30
