"""The null backend's sampled ids (:class:`NullTokens`) and its speculative programs: the records it writes
for copied proposals are the ones a greedy target writes (the longest prefix of proposals that equal its
own ids is accepted, then its next id), and they validate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.null import NullBackend, NullTokens
from helios_core.contract import PreparedContract
from helios_core.loading import TrustSettings, open_core
from helios_core.runtime.completion import SpeculativeExpectations, SpeculativeResults, read_lanes
from helios_core.runtime.packing import GraphPacker, Lane, PageTableMemory, Submission
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "tests/null-backend"
VOCABULARY = 259


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> PreparedContract:
    from ignition.build import build_core
    from ignition.recipes.llama import Capacities, speculative_widths
    from ignition.recipes.synthetic import synthetic_declaration

    from helios_core.container.keys import generate_keys, load_private_key

    tmp = tmp_path_factory.mktemp("null-backend")
    keys = generate_keys(tmp / "keys")
    core = tmp / "history.core"
    caps = Capacities(
        max_rows=4, prefill_tokens=(16,), decode_rows=(1, 4), page_tokens=4, cache_pages=64, context=64,
        snapshots=0, speculative_widths=speculative_widths(3),
    )  # fmt: skip
    build_core(
        synthetic_declaration("tiny", seed=2), core, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )  # fmt: skip
    verified = open_core(Path(core), TrustSettings((keys["public"],), NAMESPACE, None))
    verified.close()
    return verified.contract


def test_the_default_ids_are_seven_times_the_position_plus_three() -> None:
    positions = np.arange(600, dtype=np.int64)
    assert NullTokens().ids(positions, VOCABULARY).tolist() == [(7 * q + 3) % VOCABULARY for q in range(600)]


def test_ids_on_a_cycle_repeat_and_a_fixed_fraction_leaves_it() -> None:
    positions = np.arange(20_000, dtype=np.int64)
    on_cycle = NullTokens(cycle=24).ids(positions, VOCABULARY)
    assert (on_cycle[24:] == on_cycle[:-24]).all()
    assert on_cycle[:24].tolist() == [(7 * q + 3) % VOCABULARY for q in range(24)]
    novel = NullTokens(cycle=24, novelty=0.1).ids(positions, VOCABULARY)
    off = novel != on_cycle
    assert abs(float(off.mean()) - 0.1) < 0.005  # the hash spreads the off-cycle positions evenly
    assert ((novel >= 0) & (novel < VOCABULARY)).all()
    assert (NullTokens(cycle=24, novelty=0.1).ids(positions, VOCABULARY) == novel).all()  # deterministic


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"cycle": -1}, "the null backend's token cycle is a count of positions (0: none); got -1"),
        ({"cycle": 4, "novelty": 1.5}, "the null backend's novelty is a fraction of positions in [0, 1]; got 1.5"),
        ({"novelty": 0.2}, "the null backend's novelty needs a cycle (positions off a cycle)"),
    ],
)
def test_bad_token_settings_are_refused_by_name(arguments: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        NullTokens(**arguments)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_a_speculative_program_accepts_the_proposals_that_are_its_own_ids(contract: PreparedContract) -> None:
    tokens = NullTokens(cycle=5)
    backend = NullBackend(contract, frames=1, tokens=tokens)
    graph = contract.graphs["speculative_w4_b4"]
    staging = backend.transport(0)
    endpoints = [10, 20, 30]
    ids = [tokens.ids(np.arange(e + 1, e + 4, dtype=np.int64), VOCABULARY).tolist() for e in endpoints]
    proposals = [ids[0], [ids[1][0], 99, ids[1][2]], [ids[2][0]]]  # all hold; the second fails; one offer
    lanes = [
        Lane(
            slot=slot,
            generation=7 + slot,
            state_row=slot,
            positions=list(range(e, e + 1 + len(offered))),
            cache_slots=list(range(len(offered) + 1)),
            page_table=[slot],
            sample=True,
            consumed=e,
            candidates=offered,
        )
        for slot, (e, offered) in enumerate(zip(endpoints, proposals, strict=True))
    ]
    GraphPacker(graph, staging, PageTableMemory()).pack(Submission(lanes, 5), 0, staging)
    staging[contract.execution.transport.submission_sequence_entry].reshape(-1)[0] = 5
    backend.run(graph.name, 0)
    record = backend.completion(0)
    assert record[mf.COMPLETION_FIELD_OFFERS][:3].tolist() == [3, 3, 1]
    assert record[mf.COMPLETION_FIELD_ACCEPTED_DRAFTS][:3].tolist() == [3, 1, 1]
    assert record[mf.COMPLETION_FIELD_EMITTED_TOKENS][:4].tolist() == [4, 2, 2, 0]  # the fourth row: no lane
    assert record[mf.COMPLETION_FIELD_CONSUMED_TOKENS][:3].tolist() == [14, 22, 32]
    emitted = record[mf.COMPLETION_FIELD_SAMPLED_IDS][:3]
    model = [tokens.ids(np.arange(e + 1, e + 5, dtype=np.int64), VOCABULARY).tolist() for e in endpoints]
    assert emitted.tolist() == [model[0], model[1][:2] + [-1] * 2, model[2][:2] + [-1] * 2]  # the record is W = 4 wide
    expectations = SpeculativeExpectations(
        np.array([7, 8, 9], dtype=np.int64),
        np.array(endpoints, dtype=np.int32),
        True,
        offers=np.array([3, 3, 1], dtype=np.int64),
    )
    results = read_lanes(record, 5, expectations, VOCABULARY, packed_capacity=graph.extents.packed_token_capacity)
    assert isinstance(results, SpeculativeResults) and not results.errors
