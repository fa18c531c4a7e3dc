"""Recurrent histories end to end on the reference backend: the ``recurrent-synthetic`` core.

A tiny gated linear-recurrent core (its history one state row a layer and request, no cache planes
or page tables) generates the tokens of an independent numpy forward pass written here: alone, with
15 other requests, through preemption in a small cache (snapshots of the recurrent state at exact
token endpoints, restored on readmission) and behind a shared prompt prefix (restored from a published
checkpoint). The recurrence operators are checked against each other, and the contract rules of
recurrent regions are pinned.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ignition.preparation.program import ManifestBuilder
from ignition.recipes.llama import Capacities
from ignition.recipes.recurrent import (
    SHAPES,
    assemble_recurrent,
    build_recurrent_core,
    random_weights,
    recurrent_declaration,
    tensor_names,
)

from helios_core.backends import reference_kernels as rk
from helios_core.contract import prepare_contract
from helios_core.errors import ContractError
from helios_core.runtime.messages import Finished
from helios_core.runtime.startup import RunningModel
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct

from .conftest import FIXTURES
from .engine_harness import (
    SignedCore,
    assert_each_finishes_at_length,
    assert_pages_released,
    build_signed_core,
    prompt_of,
    request,
    rms_norm,
    run,
    solo_tokens,
    submit_all,
    token_ids,
)

NAMESPACE = "helios-tests/recurrent"
SEED = 11
PAGE_TOKENS = 4
CAPS = Capacities(
    max_rows=16,
    prefill_tokens=(16,),
    decode_rows=(1, 2, 4, 8, 16),
    page_tokens=PAGE_TOKENS,
    cache_pages=256,
    context=96,
    snapshots=4,
)


# -- the independent forward pass ------------------------------------------------------------------------
def oracle_greedy(prompt: list[int], count: int, *, seed: int = SEED) -> list[int]:
    """Greedy tokens of the model of ``ignition.recipes.recurrent`` (tiny shape), one token at a time:
    per layer ``s = a * s + (1 - a) * (W_in u)`` with ``a = 1 / (1 + exp(-W_gate u))``."""
    shape = SHAPES["tiny"]
    weights = random_weights(shape, seed)
    sampled = recurrent_declaration("tiny", seed=seed).sampled_size
    states = [np.zeros(shape.state, dtype=np.float32) for _ in range(shape.layers)]
    tokens, generated = list(prompt), []
    position = 0
    while len(generated) < count:
        x = weights["token_embd.weight"][tokens[position]].astype(np.float32)
        for layer in range(shape.layers):
            names = tensor_names(layer)
            u = rms_norm(x, weights[names["mix_norm"]], shape.rms_eps)
            decay = (1.0 / (1.0 + np.exp(-(weights[names["w_gate"]] @ u).astype(np.float64)))).astype(np.float32)
            states[layer] = (decay * states[layer] + (1 - decay) * (weights[names["w_in"]] @ u)).astype(np.float32)
            x = x + weights[names["w_out"]] @ states[layer]
            v = rms_norm(x, weights[names["ffn_norm"]], shape.rms_eps)
            gate, up = weights[names["ffn_gate"]] @ v, weights[names["ffn_up"]] @ v
            x = (x + weights[names["ffn_down"]] @ ((gate / (1.0 + np.exp(-gate))) * up)).astype(np.float32)
        position += 1
        if position == len(tokens):
            logits = weights["output.weight"] @ rms_norm(x, weights["output_norm.weight"], shape.rms_eps)
            tokens.append(int(np.argmax(logits[:sampled])))
            generated.append(tokens[-1])
    return generated


# -- the core -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    declaration = recurrent_declaration("tiny", seed=SEED)
    return build_signed_core(
        build_recurrent_core, declaration, CAPS, tmp_path_factory.mktemp("recurrent"), NAMESPACE, name="recurrent"
    )


# -- serving --------------------------------------------------------------------------------------------
def test_greedy_tokens_equal_the_recurrent_forward_pass(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started).engine
    prompt = prompt_of(0, 37)  # prefill chunks of 16, 16, 4 and 1: the state crosses rounds
    assert engine.generate(request("solo", prompt, 24)).token_ids == oracle_greedy(prompt, 24)
    launches = engine.statistics().launches
    assert launches["prefill_p16"] == 4 and launches["decode_b1"] == 23
    assert launches["snapshot"] == 3  # checkpoints at 16, 32 and 36 (the last page boundary of the prompt)
    assert_pages_released(engine)


def test_sixteen_concurrent_requests_equal_their_solo_outputs(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started, max_active=16).engine
    prompts = [prompt_of(i, 5 + i) for i in range(16)]
    solo = solo_tokens(engine, prompts, 20)
    together = [token_ids(stream) for stream in submit_all(engine, prompts, 20)]
    assert together == solo
    assert solo[3] == oracle_greedy(prompts[3], 20)
    assert solo[15] == oracle_greedy(prompts[15], 20)
    launches = engine.statistics().launches
    assert launches.get("decode_b8", 0) + launches.get("decode_b16", 0) > 0  # lanes of many requests in a round
    assert_pages_released(engine)


def test_decoding_requests_in_a_small_cache_resume_from_recurrent_snapshots(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # Each request needs 8 pages of 4 tokens; 24 pages hold three: decoding requests are preempted,
    # four of them at a time through snapshots of their recurrent state, the rest recomputed.
    prompts = [prompt_of(i, 6 + i % 3) for i in range(16)]
    solo = solo_tokens(run(core, started, max_active=16).engine, prompts, 24)
    engine = run(core, started, cache_pages=24, max_active=16).engine
    assert_each_finishes_at_length(submit_all(engine, prompts, 24), solo)
    stats = engine.statistics()
    assert stats.snapshots > 0 and stats.restores == stats.snapshots
    assert stats.preemptions > stats.snapshots
    assert engine.statistics().launches["restore"] == stats.restores
    assert solo[0] == oracle_greedy(prompts[0], 24)
    assert_pages_released(engine)


def test_a_shared_prefix_is_restored_from_a_checkpoint_and_gives_the_same_tokens(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # Published pages of a recurrent core hold no history; the first request's checkpoint at the last
    # page boundary of its 40-token prompt (36) does: the second request restores it after `initialize`
    # and prefills only its last 7 tokens, with the forward pass's tokens.
    engine = run(core, started).engine
    shared = prompt_of(5, 40)
    first = engine.generate(request("first", shared, 12))
    assert first.reused_prompt_tokens == 0
    prompt = [*shared, 40, 41, 42]
    events = list(engine.submit(request("second", prompt, 16)))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.reused_prompt_tokens == 36
    assert token_ids(events) == oracle_greedy(prompt, 16)
    launches = engine.statistics().launches
    assert launches["restore"] == 1 and launches["initialize"] == 2
    engine.allocator.check()


def test_the_golden_recurrent_fixture_generates_the_forward_pass_tokens() -> None:
    recorded = json.loads((FIXTURES / "expected_tokens.json").read_text())
    golden = recorded["cores"]["recurrent-tiny"]
    assert golden["greedy"] == oracle_greedy(golden["prompt_ids"], recorded["max_tokens"], seed=7)


def test_the_command_line_builds_the_recipe_and_refuses_attention_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ignition.cli import main

    out = tmp_path / "tiny.core"
    assert main(["build", "recurrent-synthetic", "--out", str(out), "--quiet", "--context", "64"]) == 0
    assert "15 programs" in capsys.readouterr().out
    refused = tmp_path / "refused.core"
    assert main(["build", "recurrent-synthetic", "--out", str(refused), "--window", "4", "--tool-syntax", "xtml"]) == 1
    assert capsys.readouterr().err == "ignition: error: recurrent-synthetic does not take --window, --tool-syntax\n"
    assert main(["build", "recurrent-synthetic", "--out", str(refused), "--targets", "reference,sm_80"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: recurrent-synthetic is built for the targets reference, sm_90a only; build without sm_80\n"
    )
    assert not refused.exists() and not (tmp_path / "refused.core.keys").exists()  # refused before any key


# -- the operators --------------------------------------------------------------------------------------
def test_the_packed_scan_equals_one_step_a_token() -> None:
    rng = np.random.default_rng(3)
    gate = rng.standard_normal((7, 5), dtype=np.float32) * np.float32(3.0)
    x = rng.standard_normal((7, 5), dtype=np.float32)
    token_row = np.array([0, 0, 0, 1, 1, 2, -1], dtype=np.int32)  # lane 2 is skipped; the last token pads
    rows = np.array([3, 0, -1], dtype=np.int32)
    initial = rng.standard_normal((4, 5), dtype=np.float32)
    scanned = initial.copy()
    out = rk.gated_recurrence_scan(gate, x, token_row, rows, scanned)
    stepped = initial.copy()
    expected = np.zeros_like(out)
    for t in range(6):
        lane = int(token_row[t])
        expected[t] = rk.gated_recurrence_step(gate[t : t + 1], x[t : t + 1], rows[lane : lane + 1], stepped)[0]
    assert np.array_equal(out, expected)  # the same float32 arithmetic, bit for bit
    assert np.array_equal(scanned, stepped)
    assert np.array_equal(scanned[[1, 2]], initial[[1, 2]])  # rows no lane names are untouched
    assert not out[5].any() and not out[6].any()
    decay = 1.0 / (1.0 + np.exp(-gate[3].astype(np.float64)))
    assert np.allclose(out[3], decay * initial[0] + (1 - decay) * x[3], rtol=1e-6, atol=1e-6)


def test_the_recurrence_gate_is_finite_for_large_pre_activations() -> None:
    gate = np.array([[-200.0, -1.0, 0.0, 1.0, 200.0]], dtype=np.float32)
    with np.errstate(over="raise"):
        decay = rk.recurrence_gate(gate)
    assert decay.tolist() == [[0.0, pytest.approx(0.26894142), 0.5, pytest.approx(0.7310586), 1.0]]


def test_the_recurrence_refuses_a_state_row_named_twice() -> None:
    state = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="rows: a state row appears twice"):
        rk.gated_recurrence_step(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32), np.array([1, 1]), state)
    with pytest.raises(ValueError, match="rows: 4 is out of range for 4 state rows"):
        rk.gated_recurrence_step(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32), np.array([4]), state)


# -- the contract ---------------------------------------------------------------------------------------
def _prepare(serving: ct.ServingContract, builder: ManifestBuilder, resources: list[Any]) -> None:
    described = [cb.ExecutableResource(id=r.id, kind=r.kind, decoded_nbytes=len(r.data)) for r in resources]
    prepare_contract(serving, builder.manifest, described)


def test_a_recurrent_region_must_name_persistent_state_rows() -> None:
    serving, builder, resources = assemble_recurrent(recurrent_declaration("tiny", seed=SEED), CAPS)
    _prepare(serving, builder, resources)  # as built: consistent
    region = next(r for r in serving.model.cache.regions if r.kind == ct.HISTORY_KIND_RECURRENT)
    region.planes.append("scratch.h")
    with pytest.raises(
        ContractError, match=re.escape("recurrent region 'recurrent' names 'scratch.h', which is not a persistent")
    ):
        _prepare(serving, builder, resources)
    del region.planes[:]
    with pytest.raises(ContractError, match=re.escape("recurrent region 'recurrent' names no state planes")):
        _prepare(serving, builder, resources)


def test_a_recurrent_plane_must_be_partitioned_by_state_rows() -> None:
    serving, builder, resources = assemble_recurrent(recurrent_declaration("tiny", seed=SEED), CAPS)
    region = next(r for r in serving.model.cache.regions if r.kind == ct.HISTORY_KIND_RECURRENT)
    region.planes.append("continuation.state0")  # persistent, but its rows are snapshot rows
    with pytest.raises(
        ContractError,
        match=re.escape("recurrent state plane 'continuation.state0': its leading dimension must be STATE_ROWS"),
    ):
        _prepare(serving, builder, resources)
