"""Sliding-window attention end to end on the reference backend.

A tiny synthetic core built with ``window=6`` (pages of 4 tokens: the window boundary falls inside a
page) generates the tokens of an independent numpy forward pass written here, alone and with 15 other
requests, through preemption in a small cache and with a reused prefix; a long generation keeps the
number of referenced pages bounded because pages behind every window are released while it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from ignition.build import build_core
from ignition.recipes.llama import Capacities, LlamaShape, speculative_widths, tensor_names
from ignition.recipes.synthetic import SHAPES, random_weights, synthetic_declaration

from helios_core.runtime.messages import Finished, TokenEvent
from helios_core.runtime.startup import RunningModel

from .engine_harness import (
    F32,
    SignedCore,
    assert_each_finishes_at_length,
    assert_pages_released,
    build_signed_core,
    request,
    rms_norm,
    run,
    solo_tokens,
    submit_all,
    token_ids,
)

NAMESPACE = "helios-tests/sliding-window"
WINDOW = 6
PAGE_TOKENS = 4
SEED = 5


# -- the independent forward pass ------------------------------------------------------------------------
def _rotate_half(x: F32, positions: npt.NDArray[np.int64], theta: float) -> F32:
    """RoPE on pairs (i, i + d/2) of the last axis of ``x [T, heads, d]``."""
    half = x.shape[-1] // 2
    inverse = 1.0 / np.power(theta, np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
    angles = positions[:, None].astype(np.float64) * inverse[None, :]
    cos, sin = np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1).astype(np.float32)


def oracle_logits(shape: LlamaShape, weights: Mapping[str, F32], tokens: list[int], window: int) -> F32:
    """Logits after the last of ``tokens``: every layer's position ``t`` attends ``max(t - window + 1, 0)..t``
    (``window`` 0: ``0..t``)."""
    count = len(tokens)
    positions = np.arange(count, dtype=np.int64)
    x = weights["token_embd.weight"][tokens].astype(np.float32)
    group = shape.heads // shape.kv_heads
    for layer in range(shape.layers):
        names = tensor_names(layer)
        h = rms_norm(x, weights[names["attn_norm"]], shape.rms_eps)
        q = _rotate_half(
            (h @ weights[names["wq"]].T).reshape(count, shape.heads, shape.head_dim), positions, shape.rope_theta
        )
        k = _rotate_half(
            (h @ weights[names["wk"]].T).reshape(count, shape.kv_heads, shape.head_dim), positions, shape.rope_theta
        )
        v = (h @ weights[names["wv"]].T).reshape(count, shape.kv_heads, shape.head_dim)
        attended = np.zeros((count, shape.heads, shape.head_dim), dtype=np.float32)
        for t in range(count):
            first = max(t - window + 1, 0) if window else 0
            for head in range(shape.heads):
                keys, values = k[first : t + 1, head // group], v[first : t + 1, head // group]
                scores = keys @ q[t, head] * np.float32(shape.head_dim**-0.5)
                weights_t = np.exp(scores - scores.max())
                attended[t, head] = (weights_t / weights_t.sum()) @ values
        x = x + attended.reshape(count, -1) @ weights[names["wo"]].T
        h = rms_norm(x, weights[names["ffn_norm"]], shape.rms_eps)
        gate, up = h @ weights[names["w_gate"]].T, h @ weights[names["w_up"]].T
        x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ weights[names["w_down"]].T
    last = rms_norm(x[-1:], weights["output_norm.weight"], shape.rms_eps)
    logits: F32 = (last @ weights["output.weight"].T)[0].astype(np.float32)
    return logits


def oracle_greedy(prompt: list[int], count: int, *, window: int = WINDOW) -> list[int]:
    shape = SHAPES["tiny"]
    weights = random_weights(shape, SEED)
    sampled = synthetic_declaration("tiny", seed=SEED).sampled_size
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(np.argmax(oracle_logits(shape, weights, tokens, window)[:sampled])))
    return tokens[len(prompt) :]


# -- the core -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> SignedCore:
    caps = Capacities(
        max_rows=16,
        prefill_tokens=(16,),
        decode_rows=(1, 2, 4, 8, 16),
        page_tokens=PAGE_TOKENS,
        cache_pages=256,
        context=96,
        snapshots=4,
        window=WINDOW,
    )
    declaration = synthetic_declaration("tiny", seed=SEED)
    return build_signed_core(
        build_core, declaration, caps, tmp_path_factory.mktemp("window"), NAMESPACE, name="windowed"
    )


def prompt_of(index: int, length: int = 11) -> list[int]:
    return [(31 * index + 7 * i + 3) % 250 + 3 for i in range(length)]


# -- tests ----------------------------------------------------------------------------------------------
def test_greedy_tokens_equal_the_windowed_forward_pass(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started).engine
    prompt = prompt_of(0, 14)
    expected = oracle_greedy(prompt, 24)
    assert expected != oracle_greedy(prompt, 24, window=0)  # the window changes this model's tokens
    assert engine.generate(request("solo", prompt, 24)).token_ids == expected
    assert_pages_released(engine)


def test_sixteen_concurrent_requests_equal_their_solo_outputs(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started, max_active=16).engine
    prompts = [prompt_of(i, 5 + i) for i in range(16)]
    solo = solo_tokens(engine, prompts, 20)
    together = [token_ids(stream) for stream in submit_all(engine, prompts, 20)]
    assert together == solo
    assert solo[3] == oracle_greedy(prompts[3], 20)
    assert_pages_released(engine)


def test_a_small_cache_completes_every_request_through_preemption(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # Admission takes a prompt's 20 pages at once and the cache holds 24 (one request at full context):
    # a request admitted while another prefills runs the cache dry, and the younger one is preempted.
    prompts = [prompt_of(i, 80) for i in range(3)]
    solo = solo_tokens(run(core, started).engine, prompts, 16)
    engine = run(core, started, cache_pages=24, max_active=4).engine
    assert_each_finishes_at_length(submit_all(engine, prompts, 16), solo)
    assert engine.statistics().preemptions > 0
    assert_pages_released(engine)


def test_decoding_requests_in_the_smallest_cache_resume_from_snapshots(
    core: SignedCore, started: list[RunningModel]
) -> None:
    # 16 decoding requests each hold the pages of their window; 24 pages cannot hold them all, so
    # decoding requests are preempted through snapshots of their committed state.
    prompts = [prompt_of(i, 6 + i % 3) for i in range(16)]
    solo = solo_tokens(run(core, started, max_active=16).engine, prompts, 24)
    engine = run(core, started, cache_pages=24, max_active=16).engine
    assert [token_ids(stream) for stream in submit_all(engine, prompts, 24)] == solo
    stats = engine.statistics()
    assert stats.snapshots > 0 and stats.preemptions > stats.snapshots
    assert_pages_released(engine)


def test_a_reused_prefix_gives_the_same_tokens(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started).engine
    shared = prompt_of(5, 17)
    engine.generate(request("first", shared, 12))
    prompt = [*shared, 40, 41, 42]
    events = list(engine.submit(request("second", prompt, 16)))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.reused_prompt_tokens == 16  # four complete pages of the shared prompt
    assert token_ids(events) == oracle_greedy(prompt, 16)
    engine.allocator.check()


def test_history_speculation_with_a_window_gives_the_same_tokens(tmp_path: Path, started: list[RunningModel]) -> None:
    caps = Capacities(
        max_rows=2,
        prefill_tokens=(16,),
        decode_rows=(1, 2),
        page_tokens=PAGE_TOKENS,
        cache_pages=64,
        context=96,
        snapshots=0,
        window=WINDOW,
        speculative_widths=speculative_widths(3),
    )
    core = build_signed_core(build_core, synthetic_declaration("tiny", seed=SEED), caps, tmp_path, NAMESPACE)
    engine = run(core, started, speculative_width=4, history_drafting=True).engine
    prompt = [5, 6, 7, 8] * 3 + [5, 6]  # a repeating history: its copies are proposed
    assert engine.generate(request("copied", prompt, 30)).token_ids == oracle_greedy(prompt, 30)
    assert any(name.startswith("speculative_w") for name in engine.statistics().launches)
    assert_pages_released(engine)


def test_a_long_generation_keeps_its_referenced_pages_bounded(core: SignedCore, started: list[RunningModel]) -> None:
    engine = run(core, started).engine
    allocator = engine.allocator
    referenced: list[int] = []
    for event in engine.submit(request("long", prompt_of(9, 5), 88)):
        if isinstance(event, TokenEvent):
            referenced.append(allocator.referenced_pages)
    assert len(referenced) == 88
    # 93 positions span 24 pages; the window (6 positions) spans at most 3, plus the page being filled ahead
    assert max(referenced) <= 4
    assert allocator.stats.allocated >= 23
    allocator.check()
    assert allocator.referenced_pages == 0
