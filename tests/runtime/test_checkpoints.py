"""Published prefix checkpoints: a recurrent core reuses a shared prefix from a snapshot row.

On the tiny ``recurrent-synthetic`` core (its history in state rows, none in pages): a prefilling
request's state is snapshotted at page-boundary chunk ends and at the last page boundary of its
prompt, published only after the snapshot round validated; a later request sharing the prefix restores
the deepest checkpoint after ``initialize`` and prefills only the rest, with the tokens of an
independent forward pass and of a run without reuse. A failed snapshot round publishes nothing, a
request whose penalties read prompt presence restores only a checkpoint of the same prompt ids, and
preemption evicts checkpoints for snapshot rows with outputs unchanged. The index's own rules are
pinned directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
from ignition.recipes.llama import Capacities
from ignition.recipes.recurrent import build_recurrent_core, recurrent_declaration

from helios_core.runtime.checkpoints import CheckpointError, CheckpointIndex
from helios_core.runtime.engine import Engine
from helios_core.runtime.messages import ExecutionFailed, Finished, SamplingParams
from helios_core.runtime.startup import RunningModel
from helios_core.server.metrics import MetricsExporter
from helios_core.wire import manifest_pb2 as mf

from .engine_harness import (
    SignedCore,
    assert_each_finishes_at_length,
    assert_pages_released,
    build_signed_core,
    prompt_of,
    request,
    run,
    solo_tokens,
    submit_all,
    tokens_and_end,
)
from .test_recurrent import oracle_greedy

NAMESPACE = "helios-tests/checkpoints"
SEED = 11
CAPS = Capacities(
    max_rows=8,
    prefill_tokens=(16,),
    decode_rows=(1, 2, 4, 8),
    page_tokens=4,
    cache_pages=512,
    context=256,
    snapshots=4,
)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    declaration = recurrent_declaration("tiny", seed=SEED)
    return build_signed_core(
        build_recurrent_core, declaration, CAPS, tmp_path_factory.mktemp("checkpoints"), NAMESPACE, name="recurrent"
    )


def checkpoints_of(engine: Engine) -> CheckpointIndex:
    index = engine.scheduler.residency.checkpoints
    assert index is not None
    return index


SHARED = prompt_of(3, 200)


# -- reuse ----------------------------------------------------------------------------------------------
def test_a_shared_200_token_prefix_is_restored_from_its_checkpoint(
    core: SignedCore, started: list[RunningModel]
) -> None:
    engine = run(core, started).engine
    first = [*SHARED, 11, 12, 13]  # 203 tokens: chunks end at 16 .. 192, then at 200, its last page boundary
    assert engine.generate(request("first", first, 6)).reused_prompt_tokens == 0
    index = checkpoints_of(engine)
    # four snapshot rows: each deeper checkpoint of the chain took the row of its least recently used one
    assert index.endpoints() == [160, 176, 192, 200]
    assert index.stats.published == 13 and index.stats.evicted == 9
    second = [*SHARED, 21, 22, 23, 24]
    tokens, end = tokens_and_end(engine, request("second", second, 12))
    assert isinstance(end, Finished) and end.reused_prompt_tokens == 200
    assert tokens == oracle_greedy(second, 12)
    fresh = run(core, started).engine
    alone, alone_end = tokens_and_end(fresh, request("alone", second, 12))
    assert isinstance(alone_end, Finished) and alone_end.reused_prompt_tokens == 0
    assert alone == tokens
    assert index.stats.hits == 1 and index.stats.reused_tokens == 200
    assert engine.statistics().reused_tokens == 200
    # the statistics snapshot and /metrics carry the checkpoint counters as the index counts them
    snapshot = engine.statistics()
    assert (snapshot.checkpoints_held, snapshot.checkpoint_hits, snapshot.checkpoint_reused_tokens) == (4, 1, 200)
    stats = index.stats
    assert (snapshot.checkpoints_published, snapshot.checkpoints_evicted, snapshot.checkpoints_abandoned) == (
        stats.published,
        stats.evicted,
        stats.abandoned,
    )
    text = MetricsExporter(engine.statistics, lambda: 0).exposition().decode()
    assert "helios_checkpoints 4.0" in text
    assert "helios_checkpoint_hits_total 1.0" in text
    assert "helios_checkpoint_reused_tokens_total 200.0" in text
    assert f"helios_checkpoints_published_total {float(stats.published)}" in text
    # the second request prefilled only its 4 tokens past the checkpoint, after initialize and restore
    launches = engine.statistics().launches
    assert launches["restore"] == 1 and launches["initialize"] == 2
    index.check()
    assert_pages_released(engine)


def test_a_new_prefix_takes_a_row_from_another_chain_once_every_row_is_held(
    core: SignedCore, started: list[RunningModel]
) -> None:
    """Without a host tier the first long prompt's chain holds all four rows; a prompt of another chain
    still takes checkpoints (its first takes the row of the least recently used checkpoint of any chain,
    the deeper ones those of its own chain), so the prompt's next turn reuses it."""
    engine = run(core, started).engine
    engine.generate(request("first", [*SHARED, 11, 12, 13], 4))
    index = checkpoints_of(engine)
    assert index.endpoints() == [160, 176, 192, 200]
    other = prompt_of(9, 63)  # no page in common with SHARED
    assert engine.generate(request("other", other, 4)).reused_prompt_tokens == 0
    assert sorted(index.endpoints()) == [60, 176, 192, 200]  # chunks end at 16, 32, 48 and the cut at 60
    follow_up = [*other[:60], 8, 9]
    tokens, end = tokens_and_end(engine, request("follow-up", follow_up, 8))
    assert isinstance(end, Finished) and end.reused_prompt_tokens == 60
    assert tokens == oracle_greedy(follow_up, 8)
    index.check()
    assert_pages_released(engine)


def test_a_prompt_sharing_part_of_a_chain_restores_the_deepest_checkpoint_it_shares(
    core: SignedCore, started: list[RunningModel]
) -> None:
    engine = run(core, started).engine
    engine.generate(request("first", SHARED[:70], 4))  # checkpoints at 16, 32, 48 and 64 (its last boundary 68)
    assert checkpoints_of(engine).endpoints() == [32, 48, 64, 68]
    prompt = [*SHARED[:50], 7, 7, 7]  # shares 50 tokens: the checkpoint at 48 is the deepest it shares
    tokens, end = tokens_and_end(engine, request("partial", prompt, 10))
    assert isinstance(end, Finished) and end.reused_prompt_tokens == 48
    assert tokens == oracle_greedy(prompt, 10)


def test_a_request_whose_penalty_reads_prompt_presence_restores_only_the_same_prompt_ids(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # A restore copies the checkpoint's prompt-presence row: exact only for the same set of prompt ids.
    engine = run(core, started).engine
    engine.generate(request("first", SHARED[:40], 4))
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    new_ids = [*SHARED[:40], 1, 2]  # ids 1 and 2 are not in the checkpoint's prompt
    same_ids = [*SHARED[:40], SHARED[0], SHARED[1]]
    reference = run(core, started).engine
    for prompt, reused in ((new_ids, 0), (same_ids, 36)):
        tokens, end = tokens_and_end(engine, request(f"p{reused}", prompt, 10, penalized))
        assert isinstance(end, Finished) and end.reused_prompt_tokens == reused
        expected, _ = tokens_and_end(reference, request(f"r{reused}", prompt, 10, penalized))
        assert tokens == expected


# -- failures and eviction ------------------------------------------------------------------------------
def test_a_failed_snapshot_round_publishes_no_checkpoint(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started).engine
    backend = engine.model.backend
    original = backend.run

    def corrupting_run(program: str, frame: int) -> None:
        original(program, frame)
        if program == "snapshot":
            backend.completion(frame)[mf.COMPLETION_FIELD_GENERATION].reshape(-1)[0] = 999

    backend.run = corrupting_run  # type: ignore[method-assign]
    tokens, end = tokens_and_end(engine, request("doomed", SHARED[:40], 6))
    assert isinstance(end, ExecutionFailed) and "generation 999 is stale" in end.message
    assert tokens == []
    index = checkpoints_of(engine)
    assert len(index) == 0 and index.stats.published == 0 and index.stats.abandoned == 1
    assert sorted(engine.scheduler.free_snapshot_rows) == [0, 1, 2, 3]

    def raising_run(program: str, frame: int) -> None:
        if program == "snapshot":
            raise RuntimeError("device lost")
        original(program, frame)

    backend.run = raising_run  # type: ignore[method-assign]
    tokens, end = tokens_and_end(engine, request("raised", SHARED[:40], 6))
    assert isinstance(end, ExecutionFailed) and end.message == "execution failed: RuntimeError: device lost"
    assert len(index) == 0 and index.stats.abandoned == 2
    backend.run = original  # type: ignore[method-assign]
    prompt = [*SHARED[:40], 5]
    tokens, end = tokens_and_end(engine, request("after", prompt, 8))
    assert isinstance(end, Finished) and end.reused_prompt_tokens == 0  # nothing was published to reuse
    assert tokens == oracle_greedy(prompt, 8)
    index.check()
    assert_pages_released(engine)


def test_preemption_evicts_checkpoints_for_snapshot_rows_with_the_same_outputs(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # Each request needs 15 or 16 pages; 64 pages hold four. Checkpoints of the first prompts fill the
    # four snapshot rows, and decoding victims take their rows: outputs equal the solo runs.
    prompts = [prompt_of(i, 9 + i % 4) for i in range(8)]
    solo = solo_tokens(run(core, started).engine, prompts, 50)
    engine = run(core, started, cache_pages=64).engine
    assert_each_finishes_at_length(submit_all(engine, prompts, 50), solo)
    stats, index = engine.statistics(), checkpoints_of(engine)
    assert index.stats.published >= 4 and index.stats.evicted > 0
    assert stats.snapshots > 0 and stats.restores == stats.snapshots
    assert len(index) + len(engine.scheduler.free_snapshot_rows) == 4
    index.check()
    assert_pages_released(engine)


# -- the index ------------------------------------------------------------------------------------------
def _chain(previous: bytes | None, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b((previous or b"root") + bytes(tokens), digest_size=16).digest()


def test_the_deepest_usable_checkpoint_is_found_and_a_pinned_one_is_never_evicted() -> None:
    index = CheckpointIndex(2, _chain)
    keys = index.chain_keys([1, 2, 3, 4, 5, 6, 7], 7)
    assert len(keys) == 3 and keys == index.chain_keys([1, 2, 3, 4, 5, 6, 9], 6)
    for row, (key, endpoint) in enumerate(zip(keys[:2], (2, 4), strict=True)):
        index.reserve(key, row)
        index.publish(key, endpoint, frozenset({1}))
    assert index.deepest(keys).endpoint == 4  # type: ignore[union-attr]
    assert index.deepest(keys, lambda checkpoint: checkpoint.endpoint < 4).endpoint == 2  # type: ignore[union-attr]
    assert index.deepest(index.chain_keys([9, 9, 9], 3)) is None
    shallow = index.deepest(keys[:1])
    assert shallow is not None
    index.claim(shallow)  # pinned, and now the most recently used
    assert index.evict() == 1  # the checkpoint at 4: the least recently used unpinned one
    assert index.evict() is None
    index.unpin(shallow)
    assert index.evict() == 0 and len(index) == 0
    assert index.stats.evicted == 2 and index.stats.hits == 1 and index.stats.reused_tokens == 2


def test_the_index_refuses_what_breaks_its_rules() -> None:
    index = CheckpointIndex(4, _chain)
    key = index.chain_keys([1, 2, 3, 4], 4)[0]
    with pytest.raises(CheckpointError, match="a checkpoint is published that was not reserved"):
        index.publish(key, 4, frozenset())
    index.reserve(key, 0)
    assert not index.wanted(key)
    with pytest.raises(CheckpointError, match="published or being taken already"):
        index.reserve(key, 1)
    with pytest.raises(CheckpointError, match="checkpoint endpoint 6 is not a positive page boundary"):
        index.publish(key, 6, frozenset())
    index.reserve(index.chain_keys([5, 6, 7, 8], 4)[0], 1)
    assert index.abandon(index.chain_keys([5, 6, 7, 8], 4)[0]) == 1
    with pytest.raises(CheckpointError, match="a checkpoint is abandoned that was not reserved"):
        index.abandon(index.chain_keys([5, 6, 7, 8], 4)[0])
    with pytest.raises(CheckpointError, match="checkpoints need pages of at least one token"):
        CheckpointIndex(0, _chain)
