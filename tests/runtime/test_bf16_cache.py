"""A core with bf16 key and value cache planes end to end on the reference backend.

A tiny synthetic core built with ``cache_dtype="bf16"`` (pages of 4 tokens, snapshot rows of the same
type): sixteen concurrent requests give their solo tokens; in a cache too small to hold them all they
are preempted through snapshots of their committed state (the partial pages' bf16 rows copied out and
back) and still give those tokens; a reused prefix gives the tokens of the same prompt without reuse.
"""

from __future__ import annotations

import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.runtime.messages import Finished
from helios_core.runtime.startup import RunningModel
from helios_core.wire import manifest_pb2 as mf

from .engine_harness import (
    SignedCore,
    assert_pages_released,
    build_signed_core,
    prompt_of,
    request,
    run,
    solo_tokens,
    submit_all,
    token_ids,
)

NAMESPACE = "helios-tests/bf16-cache"


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    caps = Capacities(
        max_rows=16,
        prefill_tokens=(16,),
        decode_rows=(1, 2, 4, 8, 16),
        page_tokens=4,
        cache_pages=256,
        context=96,
        snapshots=4,
        cache_dtype="bf16",
    )
    declaration = synthetic_declaration("tiny", seed=5)
    return build_signed_core(build_core, declaration, caps, tmp_path_factory.mktemp("bf16-cache"), NAMESPACE)


def test_the_planes_and_snapshot_rows_are_bf16(core: SignedCore, started: list[RunningModel]) -> None:
    contract = run(core, started).model.contract
    kinds = {
        decl.name.split(".")[0]: decl.dtype
        for decl in contract.execution.buffers
        if decl.role == mf.BUFFER_ROLE_CACHE_PLANE or decl.name.startswith("continuation.")
    }
    assert kinds == {"cache": mf.DTYPE_BF16, "continuation": mf.DTYPE_BF16}


def test_decoding_requests_resume_from_bf16_snapshots_with_their_solo_tokens(
    core: SignedCore, started: list[RunningModel]
) -> None:
    prompts = [prompt_of(i, 6 + i % 3) for i in range(16)]
    solo = solo_tokens(run(core, started, max_active=16).engine, prompts, 24)
    engine = run(core, started, cache_pages=24, max_active=16).engine
    assert [token_ids(stream) for stream in submit_all(engine, prompts, 24)] == solo
    stats = engine.statistics()
    assert stats.snapshots > 0 and stats.preemptions > 0
    assert_pages_released(engine)


def test_a_reused_bf16_prefix_gives_the_tokens_of_the_prompt_without_reuse(
    core: SignedCore, started: list[RunningModel]
) -> None:
    shared = prompt_of(5, 17)
    prompt = [*shared, 40, 41, 42]
    fresh = run(core, started).engine.generate(request("fresh", prompt, 16)).token_ids
    engine = run(core, started).engine
    engine.generate(request("first", shared, 12))
    events = list(engine.submit(request("second", prompt, 16)))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.reused_prompt_tokens == 16  # four complete pages of the shared prompt
    assert token_ids(events) == fresh
