"""Programs that draft in-graph and allocate their own prefixes, served on the reference backend: the
output with self-drafting is the output without it, token for token; the speculation counters measure
what the program offered and accepted; an offer above a lane's ceiling fails only that request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import ExecutionFailed, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "tests/self-draft"
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41], [7, 7, 8, 7, 7, 8, 7]]

Serve = Callable[..., RunningModel]


def _build(tmp: Path, draft_layers: int) -> tuple[Path, TrustSettings]:
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities, speculative_widths
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    keys = generate_keys(tmp / "keys")
    core = tmp / "self-draft.core"
    caps = Capacities(
        max_rows=4, prefill_tokens=(32,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=96, context=160,
        snapshots=0, speculative_widths=speculative_widths(3), speculation="self-draft", draft_tokens=3,
        draft_layers=draft_layers,
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=5), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )  # fmt: skip
    return core, TrustSettings((keys["public"],), NAMESPACE, None)


@pytest.fixture(scope="module", params=[2, 1], ids=["draft-is-target", "one-layer-draft"])
def self_draft_core(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, TrustSettings, int]:
    """A tiny core (two layers) whose draft runs all its layers (every proposal holds) or one (most fail)."""
    layers: int = request.param
    core, trust = _build(tmp_path_factory.mktemp(f"self-draft-{layers}"), layers)
    return core, trust, layers


@pytest.fixture
def serve(self_draft_core: tuple[Path, TrustSettings, int]) -> Iterator[Serve]:
    running: list[RunningModel] = []

    def factory(**options: object) -> RunningModel:
        core, trust, _ = self_draft_core
        model = start(core, trust, LoadOptions(**options), backend="reference")  # type: ignore[arg-type]
        running.append(model)
        return model

    yield factory
    for model in running:
        model.close()


def _outputs(model: RunningModel, requests: list[PreparedRequest]) -> dict[str, list[object]]:
    streams = [model.engine.submit(request) for request in requests]
    return {
        stream.request_id: [
            (e.token_id, round(e.logprob, 4), e.pieces) if isinstance(e, TokenEvent) else e for e in stream
        ]
        for stream in streams
    }


def _work(sampling: SamplingParams, max_tokens: int = 30) -> list[PreparedRequest]:
    return [
        PreparedRequest(f"r{i}", prompt, max_tokens, sampling, ignore_eos=True) for i, prompt in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7, top_k=8, seed=5)])
def test_self_drafted_output_is_the_output_without_speculation(
    serve: Serve, self_draft_core: tuple[Path, TrustSettings, int], sampling: SamplingParams
) -> None:
    expected = _outputs(serve(speculative_width=1), _work(sampling))  # width one: no speculative rounds
    drafting = serve()
    assert _outputs(drafting, _work(sampling)) == expected
    stats = drafting.engine.statistics()
    offered, accepted = sum(stats.proposals_offered.values()), sum(stats.drafts_accepted.values())
    assert offered > 0
    if self_draft_core[2] == 2 and sampling is GREEDY:
        assert accepted == offered  # the draft is the target: every greedy proposal holds
    for events in expected.values():
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 30


def _inject(model: RunningModel, change: Callable[[dict[int, object]], None]) -> None:
    """Apply ``change`` to the completion record of the first self-drafting round."""
    backend = model.engine.model.backend
    original_run = backend.run
    done: list[bool] = []

    def inject(program: str, frame: int) -> None:
        original_run(program, frame)
        if program.startswith("selfdraft") and not done:
            change(backend.completion(frame))
            done.append(True)

    backend.run = inject  # type: ignore[method-assign]


def test_a_lane_that_accepts_more_than_it_offered_fails_only_its_request(serve: Serve) -> None:
    drafting = serve()

    def overaccept(record: dict[int, object]) -> None:
        accepted = record[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS].reshape(-1)  # type: ignore[attr-defined]
        accepted[0] = record[mf.COMPLETION_FIELD_OFFERS].reshape(-1)[0] + 1  # type: ignore[attr-defined]

    _inject(drafting, overaccept)
    served = _outputs(drafting, _work(GREEDY))
    failed = {rid: events[-1] for rid, events in served.items() if isinstance(events[-1], ExecutionFailed)}
    assert list(failed) == ["r0"] and "drafts of" in failed["r0"].message
    for rid, events in served.items():
        if rid not in failed:
            assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 30


def test_offers_beyond_the_programs_rows_fail_that_round_only(serve: Serve) -> None:
    drafting = serve()

    def overoffer(record: dict[int, object]) -> None:
        record[mf.COMPLETION_FIELD_OFFERS].reshape(-1)[0] = 99  # type: ignore[attr-defined]

    _inject(drafting, overoffer)
    served = _outputs(drafting, _work(GREEDY))
    failed = [events[-1] for events in served.values() if isinstance(events[-1], ExecutionFailed)]
    assert failed and all("target rows; the program holds" in event.message for event in failed)
    later = _outputs(drafting, _work(GREEDY))  # later rounds are unaffected
    assert all(isinstance(events[-1], Finished) for events in later.values())
