"""Preemption through snapshots: a preempted request resumes from its exact committed state.

With penalties the next token depends on the request's output counts, so outputs equal solo runs only
when preemption restores the sampling state exactly (snapshot, then restore), not by re-initializing.
"""

from __future__ import annotations

import pytest

from helios_core.runtime.messages import SamplingParams
from helios_core.runtime.startup import RunningModel

from .engine_harness import (
    SignedCore,
    assert_each_finishes_at_length,
    assert_pages_released,
    build_snapshot_core,
    run,
    solo_tokens,
    submit_all,
)

NAMESPACE = "helios-tests/preemption"
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    return build_snapshot_core(tmp_path_factory.mktemp("preemption"), NAMESPACE)


@pytest.fixture
def running(core: SignedCore, started: list[RunningModel]) -> RunningModel:
    return run(core, started, cache_pages=20)


def test_preempted_requests_resume_from_their_snapshots(running: RunningModel) -> None:
    engine = running.engine
    prompts = [[7 + i, 40, 41, 42, 43, 44, 45, 90 + i, 12, 13] for i in range(4)]
    solo = solo_tokens(engine, prompts, 30, PENALIZED)
    assert_each_finishes_at_length(submit_all(engine, prompts, 30, PENALIZED), solo)
    stats = engine.statistics()
    assert stats.snapshots > 0 and stats.restores == stats.snapshots
    assert stats.launches.get("snapshot", 0) == stats.snapshots
    assert_pages_released(engine)
    assert sorted(engine.scheduler.free_snapshot_rows) == [0, 1, 2, 3]
