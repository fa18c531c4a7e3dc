"""Paged-latent histories end to end on the reference backend: the ``latent-synthetic`` core.

A tiny decoder that caches one compressed latent a token (or one a ``tokens_per_record`` tokens) and
up-projects keys and values at attention time generates the tokens of an independent numpy forward
pass written here: alone, with 15 other requests, through preemption in a small cache, and behind a
shared 200-token prompt prefix reused from published pages. Its attention reads the page table
through a view shifted by one column.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ignition.recipes.latent import SHAPES, build_latent_core, latent_declaration, random_weights, tensor_names
from ignition.recipes.llama import Capacities

from helios_core.backends import reference_kernels as rk
from helios_core.runtime.messages import Finished
from helios_core.runtime.startup import RunningModel
from helios_core.sampling import SamplingParams
from helios_core.wire import contract_pb2 as ct

from .conftest import FIXTURES
from .engine_harness import (
    F32,
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

NAMESPACE = "helios-tests/latent"
SEED = 13
CAPS = Capacities(
    max_rows=16,
    prefill_tokens=(16,),
    decode_rows=(1, 2, 4, 8, 16),
    page_tokens=4,
    cache_pages=512,
    context=256,
    snapshots=0,
)


# -- the independent forward pass ------------------------------------------------------------------------
def oracle_greedy(prompt: list[int], count: int, *, seed: int = SEED, tokens_per_record: int = 1) -> list[int]:
    """Greedy tokens of ``ignition.recipes.latent`` (tiny shape), one token at a time: each layer caches
    ``c = W_dkv x``; a token at position p attends, per head, to keys ``W_uk r`` and values ``W_uv r`` of
    the records ``r`` (means of R consecutive latents) whose tokens all lie at or before p."""
    shape = SHAPES["tiny"]
    s = shape.base
    weights = random_weights(shape, seed)
    sampled = latent_declaration("tiny", seed=seed).sampled_size
    latents: list[list[F32]] = [[] for _ in range(s.layers)]
    tokens, generated = list(prompt), []
    position = 0
    while len(generated) < count:
        x = weights["token_embd.weight"][tokens[position]].astype(np.float32)
        for layer in range(s.layers):
            names = tensor_names(layer)
            xn = rms_norm(x, weights[names["attn_norm"]], s.rms_eps)
            q = (weights[names["wq"]] @ xn).reshape(s.heads, s.head_dim)
            latents[layer].append(weights[names["w_dkv"]] @ xn)
            visible = (position + 1) // tokens_per_record
            attended = np.zeros((s.heads, s.head_dim), dtype=np.float32)
            if visible:
                history = np.stack(latents[layer][: visible * tokens_per_record])
                records = history.reshape(visible, tokens_per_record, -1).mean(axis=1)
                keys = (records @ weights[names["w_uk"]].T).reshape(visible, s.heads, s.head_dim)
                values = (records @ weights[names["w_uv"]].T).reshape(visible, s.heads, s.head_dim)
                scores = np.einsum("hd,nhd->hn", q, keys) * np.float32(s.head_dim**-0.5)
                probs = np.exp(scores - scores.max(axis=1, keepdims=True))
                probs /= probs.sum(axis=1, keepdims=True)
                attended = np.einsum("hn,nhd->hd", probs, values).astype(np.float32)
            x = x + weights[names["wo"]] @ attended.reshape(-1)
            v = rms_norm(x, weights[names["ffn_norm"]], s.rms_eps)
            gate, up = weights[names["w_gate"]] @ v, weights[names["w_up"]] @ v
            x = (x + weights[names["w_down"]] @ ((gate / (1.0 + np.exp(-gate))) * up)).astype(np.float32)
        position += 1
        if position == len(tokens):
            logits = weights["output.weight"] @ rms_norm(x, weights["output_norm.weight"], s.rms_eps)
            tokens.append(int(np.argmax(logits[:sampled])))
            generated.append(tokens[-1])
    return generated


# -- the cores ------------------------------------------------------------------------------------------
def _build(tmp: Path, name: str, **options: int) -> SignedCore:
    declaration = latent_declaration("tiny", seed=SEED, **options)
    return build_signed_core(build_latent_core, declaration, CAPS, tmp, NAMESPACE, name=name)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    """Records of one token, read through a page-table view shifted by one column."""
    return _build(tmp_path_factory.mktemp("latent"), "shifted", page_offset=1)


# -- serving --------------------------------------------------------------------------------------------
def test_the_core_declares_a_paged_latent_region_and_a_shifted_view(
    core: SignedCore, started: list[RunningModel]
) -> None:
    contract = run(core, started).verified.contract
    (region,) = contract.model.cache.regions
    assert (region.kind, region.tokens_per_record, len(region.planes)) == (ct.HISTORY_KIND_PAGED_LATENT, 1, 2)
    views = [(v.buffer, v.page_offset, v.pages_per_row) for v in contract.model.cache.page_table_views]
    assert views == [("page_table", 0, 64), ("latent_page_table", 1, 64)]
    assert contract.buffers[region.planes[0]].shape[1].size == 4


def test_greedy_tokens_equal_the_latent_forward_pass(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started).engine
    prompt = prompt_of(0, 37)  # prefill chunks of 16, 16 and 5: the history crosses rounds
    assert engine.generate(request("solo", prompt, 24)).token_ids == oracle_greedy(prompt, 24)
    launches = engine.statistics().launches
    assert launches["prefill_p16"] == 3 and launches["decode_b1"] == 23
    assert_pages_released(engine)


def test_records_of_several_tokens_equal_the_forward_pass(tmp_path: Path, started: list[RunningModel]) -> None:
    core = _build(tmp_path, "pairs", tokens_per_record=2)
    model = run(core, started)
    (region,) = model.verified.contract.model.cache.regions
    assert region.tokens_per_record == 2 and model.verified.contract.buffers[region.planes[0]].shape[1].size == 2
    prompt = prompt_of(1, 21)
    assert model.engine.generate(request("pairs", prompt, 16)).token_ids == oracle_greedy(
        prompt, 16, tokens_per_record=2
    )


def test_sixteen_concurrent_requests_equal_their_solo_outputs(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started, max_active=16).engine
    prompts = [prompt_of(i, 5 + i) for i in range(16)]
    solo = solo_tokens(engine, prompts, 20)
    together = [token_ids(stream) for stream in submit_all(engine, prompts, 20)]
    assert together == solo
    assert solo[3] == oracle_greedy(prompts[3], 20)
    launches = engine.statistics().launches
    assert launches.get("decode_b8", 0) + launches.get("decode_b16", 0) > 0
    assert_pages_released(engine)


def test_a_small_cache_completes_every_request_through_preemption(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # Each request ends with 8 pages of 4 tokens; 64 pages (one request at full context) hold 8 of them.
    prompts = [prompt_of(i, 6 + i % 3) for i in range(16)]
    solo = solo_tokens(run(core, started, max_active=16).engine, prompts, 24)
    engine = run(core, started, cache_pages=64, max_active=16).engine
    assert_each_finishes_at_length(submit_all(engine, prompts, 24), solo)
    assert engine.statistics().preemptions > 0
    assert solo[0] == oracle_greedy(prompts[0], 24)
    assert_pages_released(engine)


def test_a_repetition_penalty_survives_preemption_by_recomputation(
    core: SignedCore, started: list[RunningModel]
) -> None:
    """The latent core has no snapshot programs: a preempted request is recomputed from position 0. Its
    initialization marks the ids it generated before as present, so a greedy request with a repetition
    penalty (which reads presence in the prompt or the output) goes on exactly as it would alone."""
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    prompts = [prompt_of(i, 6 + i % 3) for i in range(16)]
    solo = solo_tokens(run(core, started, max_active=16).engine, prompts, 24, penalised)
    assert solo != solo_tokens(run(core, started, max_active=16).engine, prompts, 24)  # the penalty matters
    engine = run(core, started, cache_pages=64, max_active=16).engine
    assert_each_finishes_at_length(submit_all(engine, prompts, 24, penalised), solo)
    assert engine.statistics().preemptions > 0
    assert_pages_released(engine)


def test_a_shared_200_token_prefix_is_reused_with_the_same_tokens(
    core: SignedCore, started: list[RunningModel]
) -> None:
    engine = run(core, started).engine
    shared = prompt_of(5, 200)
    first = engine.generate(request("first", [*shared, 9], 8))
    assert first.reused_prompt_tokens == 0
    prompt = [*shared, 40, 41, 42]
    events = list(engine.submit(request("second", prompt, 12)))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.reused_prompt_tokens == 200
    assert token_ids(events) == oracle_greedy(prompt, 12)
    engine.allocator.check()


def test_the_golden_latent_fixture_generates_the_forward_pass_tokens() -> None:
    recorded = json.loads((FIXTURES / "expected_tokens.json").read_text())
    golden = recorded["cores"]["latent-tiny"]
    assert golden["greedy"] == oracle_greedy(golden["prompt_ids"], recorded["max_tokens"], seed=7)


def test_the_command_line_builds_the_recipe_and_refuses_what_it_has_no_programs_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ignition.cli import main

    out = tmp_path / "tiny.core"
    assert main(["build", "latent-synthetic", "--out", str(out), "--quiet", "--context", "64"]) == 0
    assert "13 programs" in capsys.readouterr().out
    refused = tmp_path / "refused.core"
    assert main(["build", "latent-synthetic", "--out", str(refused), "--window", "4"]) == 1
    assert capsys.readouterr().err == "ignition: error: latent-synthetic does not take --window\n"
    assert main(["build", "llama-synthetic", "--out", str(refused), "--page-offset", "1"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: --tokens-per-record and --page-offset belong to latent-synthetic\n"
    )
    assert main(["build", "latent-synthetic", "--out", str(refused), "--tokens-per-record", "3"]) == 1
    assert capsys.readouterr().err == (
        "ignition: error: --tokens-per-record must be at least 1 and divide --page-tokens 16, got 3\n"
    )
    assert not refused.exists() and not (tmp_path / "refused.core.keys").exists()  # refused before any key


# -- the operators --------------------------------------------------------------------------------------
def test_records_hold_the_mean_of_their_tokens_whatever_the_chunking() -> None:
    rng = np.random.default_rng(5)
    latent = rng.standard_normal((6, 3)).astype(np.float32)
    whole = np.zeros((2, 2, 3), dtype=np.float32)
    rk.latent_cache_write(whole, latent, np.array([4, 5, 6, 7, 0, 1]), 2)
    chunked = np.zeros((2, 2, 3), dtype=np.float32)
    rk.latent_cache_write(chunked, latent[:3], np.array([4, 5, 6]), 2)
    rk.latent_cache_write(chunked, latent[3:], np.array([7, 0, 1]), 2)
    assert whole.tobytes() == chunked.tobytes()
    np.testing.assert_allclose(whole[1, 0], (latent[0] + latent[1]) / 2, rtol=1e-6)
    np.testing.assert_allclose(whole[0, 0], (latent[4] + latent[5]) / 2, rtol=1e-6)


def test_latent_attention_reads_pages_after_the_view_offset() -> None:
    rng = np.random.default_rng(6)
    plane = rng.standard_normal((4, 2, 3)).astype(np.float32)
    q = rng.standard_normal((1, 2, 2)).astype(np.float32)
    w_uk, w_uv = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2))
    direct = rk.latent_attention(q, plane, w_uk, w_uv, np.array([[3, 1]]), np.array([0]), np.array([3]), 0.5, 1)
    shifted = rk.latent_attention(
        q, plane, w_uk, w_uv, np.array([[-1, 3, 1]]), np.array([0]), np.array([3]), 0.5, 1, page_offset=1
    )
    assert direct.tobytes() == shifted.tobytes()
    with pytest.raises(ValueError, match=r"^page_table: row 0 names a page outside \[0, 4\)$"):
        rk.latent_attention(q, plane, w_uk, w_uv, np.array([[-1, 3, 1]]), np.array([0]), np.array([3]), 0.5, 1)
