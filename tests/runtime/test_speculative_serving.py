"""History drafting end to end on the reference backend: the output with speculation is the output
without it, token for token, greedy and sampled, under concurrency, preemption and prefix reuse; stops
inside an accepted run cut exactly there; validation failures stay with their request. Requests with a
grammar (a JSON schema response format, a required tool call) speculate too, under one mask a position,
and serve exactly what constrained decode serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helios_core.contract import LoadOptions
from helios_core.errors import StartupError
from helios_core.frontend.formats import ToolCallFormat
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import ExecutionFailed, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "tests/speculative"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def speculative_core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrustSettings]:
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities, speculative_widths
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    tmp = tmp_path_factory.mktemp("speculative")
    keys = generate_keys(tmp / "keys")
    core = tmp / "speculative.core"
    caps = Capacities(
        max_rows=4, prefill_tokens=(32,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=96, context=160,
        snapshots=0, speculative_widths=speculative_widths(3),
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=5, tool_syntax="json-tags"), core, caps=caps,
        signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )  # fmt: skip
    return core, TrustSettings((keys["public"],), NAMESPACE, None)


@pytest.fixture
def serve(speculative_core: tuple[Path, TrustSettings]) -> Iterator[object]:
    running: list[RunningModel] = []

    def factory(**options: object) -> RunningModel:
        core, trust = speculative_core
        model = start(core, trust, LoadOptions(**options), backend="reference")  # type: ignore[arg-type]
        running.append(model)
        return model

    yield factory
    for model in running:
        model.close()


PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41], [7, 7, 8, 7, 7, 8, 7], [100, 3, 100, 3, 100]]


def _outputs(model: RunningModel, requests: list[PreparedRequest]) -> dict[str, list[object]]:
    streams = [model.engine.submit(request) for request in requests]
    served: dict[str, list[object]] = {}
    for stream in streams:
        events = list(stream)
        served[stream.request_id] = [
            (e.token_id, round(e.logprob, 4), e.pieces) if isinstance(e, TokenEvent) else e for e in events
        ]
    return served


def _work(sampling: SamplingParams, max_tokens: int = 40, **extra: object) -> list[PreparedRequest]:
    return [
        PreparedRequest(f"r{i}", prompt, max_tokens, sampling, ignore_eos=True, **extra)  # type: ignore[arg-type]
        for i, prompt in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize(
    ("sampling", "accepts"),
    [
        (GREEDY, True),
        (SamplingParams(temperature=0.3, top_k=4, seed=11), True),  # sampled, repetitive enough to accept
        (SamplingParams(temperature=0.8, top_p=0.95, seed=11), False),
        (SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.2, frequency_penalty=0.3), False),
    ],
)
def test_speculative_output_is_the_output_without_speculation(
    serve: object, sampling: SamplingParams, accepts: bool
) -> None:
    plain = serve()  # type: ignore[operator]
    expected = _outputs(plain, _work(sampling))
    drafting = serve(history_drafting=True)  # type: ignore[operator]
    assert _outputs(drafting, _work(sampling)) == expected
    stats = drafting.engine.statistics()
    assert sum(stats.speculative_lanes.values()) > 0
    if accepts:
        assert sum(stats.drafts_accepted.values()) > 0  # repeated text: some proposals hold
    assert stats.pipelined_rounds == 0
    assert plain.engine.statistics().speculative_lanes == {}
    for finished in (events[-1] for events in expected.values()):
        assert isinstance(finished, Finished) and finished.reason == "length" and finished.completion_tokens == 40


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.3, top_k=4, seed=21)])
def test_every_selected_width_serves_the_same_tokens(serve: object, width: int, sampling: SamplingParams) -> None:
    """Seeded output is reproducible whatever widths the rounds use: token k of a request always draws
    with counter k of its stream."""
    expected = _outputs(serve(), _work(sampling))  # type: ignore[operator]
    narrow = serve(history_drafting=True, speculative_width=width)  # type: ignore[operator]
    assert _outputs(narrow, _work(sampling)) == expected
    widths = narrow.engine.statistics().speculative_lanes
    assert widths and max(widths) <= width


def test_speculation_under_preemption_and_prefix_reuse(serve: object) -> None:
    again = PreparedRequest("again", PROMPTS[0], 60, GREEDY, ignore_eos=True)  # reuses r0's prompt pages
    work = [*_work(GREEDY, max_tokens=60), again]
    expected = _outputs(serve(cache_pages=40), work)  # type: ignore[operator]
    drafting = serve(history_drafting=True, cache_pages=40)  # type: ignore[operator]
    assert _outputs(drafting, work) == expected
    stats = drafting.engine.statistics()
    assert stats.preemptions > 0 and sum(stats.drafts_accepted.values()) > 0
    drafting.engine.allocator.check()


def test_a_stop_inside_an_accepted_run_cuts_exactly_there(serve: object) -> None:
    plain = serve()  # type: ignore[operator]
    (reference,) = _outputs(plain, [PreparedRequest("s", PROMPTS[0], 40, GREEDY, ignore_eos=True)]).values()
    tokens = [event[0] for event in reference[:-1]]  # type: ignore[index]
    stop = [tokens[24], tokens[25]]  # a token stop deep in a repeating run
    request = PreparedRequest("s", PROMPTS[0], 40, GREEDY, ignore_eos=True, token_stops=[stop])
    expected = _outputs(serve(), [request])  # type: ignore[operator]
    drafting = serve(history_drafting=True)  # type: ignore[operator]
    assert _outputs(drafting, [request]) == expected
    finished = expected["s"][-1]
    assert isinstance(finished, Finished) and finished.reason == "stop"


def test_an_offer_above_its_ceiling_fails_only_that_request(serve: object) -> None:
    drafting = serve(history_drafting=True)  # type: ignore[operator]
    engine = drafting.engine
    backend = engine.model.backend
    original_run = backend.run
    broken: list[str] = []

    def inject(program: str, frame: int) -> None:
        original_run(program, frame)
        if program.startswith("speculative") and not broken:
            record = backend.completion(frame)
            offers = record[mf.COMPLETION_FIELD_OFFERS].reshape(-1)
            lane = int(offers.argmax())
            offers[lane] += 1  # one more offer than the lane was given
            broken.append(str(lane))

    backend.run = inject  # type: ignore[method-assign]
    served = _outputs(drafting, _work(GREEDY))
    failed = [rid for rid, events in served.items() if isinstance(events[-1], ExecutionFailed)]
    assert len(failed) == 1 and "proposals; the lane's ceiling is" in served[failed[0]][-1].message  # type: ignore[union-attr]
    for rid, events in served.items():
        if rid not in failed:
            assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 40


def test_history_drafting_needs_a_core_that_speculates(serve: object) -> None:
    with pytest.raises(StartupError, match="history drafting needs a speculative width above one"):
        serve(history_drafting=True, speculative_width=1)  # type: ignore[operator]


# -- requests with a grammar ---------------------------------------------------------------------------

ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"const": "abc"}, "n": {"enum": [1, 2]}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
REPEATING: dict[str, Any] = {"type": "array", "items": ITEM, "minItems": 2, "maxItems": 2}
"""A document that repeats itself: history proposals copy the earlier items."""
JSON_FORMAT = json.dumps({"type": "json_schema", "json_schema": {"name": "items", "schema": REPEATING}})


def _structured(sampling: SamplingParams, model: RunningModel) -> list[PreparedRequest]:
    """Two JSON-schema requests, a required tool call and an unconstrained request in one batch."""
    tool = ToolCallFormat.for_frontend(
        [("record", {**REPEATING, "minItems": 4, "maxItems": 4})], None, model.bootstrap.frontend
    )
    return [
        PreparedRequest("json0", PROMPTS[0], 150, sampling, response_format=JSON_FORMAT),
        PreparedRequest("json1", PROMPTS[1], 150, sampling, response_format=JSON_FORMAT),
        PreparedRequest("tool", PROMPTS[2], 140, sampling, grammar=model.grammar_compiler.compile(tool)),
        PreparedRequest("free", PROMPTS[3], 40, sampling, ignore_eos=True),
    ]


def _document(events: list[object]) -> str:
    """The text a request served before the EOS token that ended it."""
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason == "stop", finished
    return "".join(text for event in events[:-2] for _, text in event[2])  # type: ignore[index]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7, seed=13)])
def test_constrained_requests_speculate_and_serve_the_constrained_decode_output(
    serve: object, sampling: SamplingParams
) -> None:
    plain = serve()  # type: ignore[operator]
    expected = _outputs(plain, _structured(sampling, plain))
    drafting = serve(history_drafting=True)  # type: ignore[operator]
    backend = drafting.engine.model.backend
    original_run = backend.run
    constrained = {"offers": 0, "accepted": 0}

    def record(program: str, frame: int) -> None:  # what the constrained lanes of each round were offered
        original_run(program, frame)
        if program.startswith("speculative"):
            flags = backend.transport(frame)["constrained"].reshape(-1).astype(bool)
            completion = backend.completion(frame)
            constrained["offers"] += int(completion[mf.COMPLETION_FIELD_OFFERS].reshape(-1)[flags].sum())
            constrained["accepted"] += int(completion[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS].reshape(-1)[flags].sum())

    backend.run = record  # type: ignore[method-assign]
    served = _outputs(drafting, _structured(sampling, drafting))
    assert served == expected
    for request_id in ("json0", "json1"):
        document = json.loads(_document(served[request_id]))
        assert len(document) == 2 and all(item["name"] == "abc" and item["n"] in (1, 2) for item in document)
    call = _document(served["tool"])
    assert call.startswith("<tool_call>") and call.endswith("</tool_call>")
    arguments = json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert arguments["name"] == "record" and len(arguments["arguments"]) == 4
    assert constrained["offers"] > 0 and constrained["accepted"] > 0  # the constrained lanes speculated


def test_min_tokens_requests_speculate_and_serve_their_output_without_speculation(serve: object) -> None:
    """Lanes short of ``min_tokens`` speculate under the mask of each position (the held-back stop id and
    the EOS ids left out) and serve exactly the tokens of plain decode."""
    free = _outputs(serve(), _work(GREEDY))  # type: ignore[operator]
    stop = free["r0"][2][0]  # type: ignore[index]
    work = [
        PreparedRequest(f"m{i}", prompt, 40, GREEDY, min_tokens=12, token_stops=[[stop]])  # type: ignore[arg-type]
        for i, prompt in enumerate(PROMPTS)
    ]
    expected = _outputs(serve(), work)  # type: ignore[operator]
    drafting = serve(history_drafting=True)  # type: ignore[operator]
    backend = drafting.engine.model.backend
    original_run = backend.run
    constrained_offers = [0]

    def record(program: str, frame: int) -> None:
        original_run(program, frame)
        if program.startswith("speculative"):
            flags = backend.transport(frame)["constrained"].reshape(-1).astype(bool)
            offers = backend.completion(frame)[mf.COMPLETION_FIELD_OFFERS].reshape(-1)
            constrained_offers[0] += int(offers[flags].sum())

    backend.run = record  # type: ignore[method-assign]
    assert _outputs(drafting, work) == expected
    assert constrained_offers[0] > 0  # lanes short of min_tokens were offered proposals
    first = [event[0] for event in expected["m0"] if isinstance(event, tuple)]
    assert first[:2] == [event[0] for event in free["r0"][:2]]  # type: ignore[index]
    assert stop not in first[:12] and len(first) > 12
