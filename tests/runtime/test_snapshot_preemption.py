"""Preemption through snapshots: a preempted request resumes from its exact committed state.

With penalties the next token depends on the request's output counts, so outputs equal solo runs only
when preemption restores the sampling state exactly (snapshot, then restore), not by re-initializing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.container.keys import generate_keys, load_private_key
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.startup import RunningModel, start

NAMESPACE = "helios-tests/preemption"
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("preemption")
    keys = generate_keys(tmp / "keys")
    path = tmp / "tiny.core"
    caps = Capacities(
        max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64, snapshots=4
    )
    build_core(
        synthetic_declaration("tiny", seed=5), path, caps=caps, signing_key=load_private_key(keys["signing"]),
        namespace=NAMESPACE,
    )  # fmt: skip
    return path, keys["public"]


@pytest.fixture
def running(core: tuple[Path, Path]) -> Iterator[RunningModel]:
    path, key = core
    model = start(path, TrustSettings((key,), NAMESPACE, None), LoadOptions(cache_pages=20), backend="reference")
    yield model
    model.close()


def test_preempted_requests_resume_from_their_snapshots(running: RunningModel) -> None:
    engine = running.engine
    prompts = [[7 + i, 40, 41, 42, 43, 44, 45, 90 + i, 12, 13] for i in range(4)]
    solo = [
        engine.generate(PreparedRequest(f"solo{i}", p, 30, PENALIZED, ignore_eos=True)).token_ids
        for i, p in enumerate(prompts)
    ]
    streams = [
        engine.submit(PreparedRequest(f"r{i}", p, 30, PENALIZED, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    for stream, expected in zip(streams, solo, strict=True):
        events = list(stream)
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == expected
    stats = engine.statistics()
    assert stats.snapshots > 0 and stats.restores == stats.snapshots
    assert stats.launches.get("snapshot", 0) == stats.snapshots
    engine.allocator.check()
    assert engine.allocator.referenced_pages == 0
    assert sorted(engine.scheduler.free_snapshot_rows) == [0, 1, 2, 3]
