"""Sliding-window attention on the CUDA backend against the reference backend.

One ``paged_attention`` node with a window runs on the GPU and through the reference adapter, with
pages wholly before every token's window pointing at another row's page filled with NaN (a page the
host released and reused): the outputs agree to float32 rounding and stay finite. Then a tiny
``llama-synthetic`` core built with ``--window 72`` (``--targets reference,sm_90a``, bf16 weights,
8-token pages): every decode and prefill program, run once on both backends from identical state with
positions past the window and released pages pointing at other rows' pages, gives logits within 2e-2
relative and the same greedy ids where the reference's top-2 gap is wide; and concurrent greedy requests
whose prompts are longer than the window (pages released and reused mid-request) give the reference's
tokens up to a near tie.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.backends.reference import ReferenceBackend
from helios_core.contract import PreparedContract
from helios_core.loading import TrustSettings, VerifiedCore
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.packing import Lane
from helios_core.runtime.startup import RunningModel
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .harness import build_gpu_core, reference_node, relative_error, run_node, start_core
from .test_backend import _agrees_until_a_near_tie, _randomize_state, _reference_steps, _stage

NAMESPACE = "helios-tests/gpu-window"
WINDOW = 72
"""Longer than one 64-position split: windowed contexts of 65 to 72 positions take the split path."""
PAGE_TOKENS = 8
CACHE_PAGES = 96
STATE_ROWS = 8
GREEDY = SamplingParams(temperature=0.0)

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------------------------
# one node
# ----------------------------------------------------------------------------------------------


def _node_arrays(window: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens, heads, kv_heads, head_dim, page_tokens, width, pages = 6, 4, 2, 16, 4, 64, 80
    poisoned = pages  # one extra page: another request's, never to be read
    k = rng.standard_normal((pages + 1, page_tokens, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((pages + 1, page_tokens, kv_heads, head_dim)).astype(np.float32)
    k[poisoned], v[poisoned] = np.nan, np.nan
    rows = np.array([0, 0, 1, -1, 0, 1], np.int32)
    positions = np.array([3, 100, 70, 0, 255, 71], np.int32)
    table = np.zeros((2, width), np.int32)
    table[0] = rng.permutation(pages)[:width]
    table[1] = rng.permutation(pages)[:width]
    for row in (0, 1):
        lowest = min(max(int(p) - window + 1, 0) for r, p in zip(rows, positions, strict=True) if r == row)
        table[row, : lowest // page_tokens] = poisoned
    return {
        "q": rng.standard_normal((tokens, heads, head_dim)).astype(np.float32),
        "k_plane": k,
        "v_plane": v,
        "page_table": table,
        "token_row": rows,
        "token_position": positions,
        "out": np.zeros((tokens, heads, head_dim), np.float32),
    }


@pytest.mark.parametrize("window", [1, 6, 37, 64, 65, 100, 200])
def test_windowed_attention_matches_the_reference_and_never_reads_released_pages(
    cuda_context: Context, window: int
) -> None:
    arrays = _node_arrays(window, np.random.default_rng(window))
    attributes = {"scale": 0.25, "window": window}
    got = run_node(cuda_context, "paged_attention", arrays, attributes, repeat=2)["out"]
    want = reference_node("paged_attention", arrays, attributes)["out"]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# a windowed core
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-window", NAMESPACE,
        "--max-rows", "4", "--prefill-tokens", "16,64", "--context", "256", "--page-tokens", str(PAGE_TOKENS),
        "--cache-pages", str(CACHE_PAGES), "--window", str(WINDOW),
    )  # fmt: skip


def _windowed_lanes(contract: PreparedContract, graph_name: str, rng: np.random.Generator) -> list[Lane]:
    """Lanes at positions past the window; each row's pages wholly before its first token's window name
    a live page of the next row (released and reused), its other pages are its own."""
    graph = contract.graphs[graph_name]
    ext = graph.extents
    decode = graph.operation == ct.OPERATION_DECODE
    rows = ext.batch_capacity if decode else max(1, min(ext.batch_capacity, ext.packed_token_capacity // 8))
    tokens = 1 if decode else min(ext.packed_token_capacity // rows, ext.token_capacity)
    spans = []
    for row in range(rows):
        start = 90 + 13 * row
        positions = list(range(start, start + tokens))
        first_live = max(start - WINDOW + 1, 0) // PAGE_TOKENS
        spans.append((positions, first_live, positions[-1] // PAGE_TOKENS + 1))
    fresh = iter(range(CACHE_PAGES))
    live = [[next(fresh) for _ in range(first, last)] for _, first, last in spans]
    lanes = []
    for row, (positions, first_live, _) in enumerate(spans):
        stale = live[(row + 1) % rows][0] if rows > 1 else CACHE_PAGES - 1
        pages = [stale] * first_live + live[row]
        lanes.append(
            Lane(
                slot=row,
                generation=row + 1,
                state_row=row,
                positions=positions,
                cache_slots=[pages[p // PAGE_TOKENS] * PAGE_TOKENS + p % PAGE_TOKENS for p in positions],
                page_table=pages,
                tokens=[] if decode else [int(t) for t in rng.integers(0, contract.sampled_size, tokens)],
                sample=True,
                sampling=SamplingParams(temperature=0.0, seed=row),
                consumed=positions[0],
            )
        )
    return lanes


def test_every_windowed_program_matches_the_reference(verified: VerifiedCore) -> None:
    contract = verified.contract
    assert contract.model.cache.regions[0].window_tokens == WINDOW
    ref = ReferenceBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    gpu = CudaBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, frames=2)
    try:
        names = [
            name
            for name, graph in contract.graphs.items()
            if graph.operation in (ct.OPERATION_DECODE, ct.OPERATION_PREFILL)
        ]
        assert {contract.graphs[n].operation for n in names} == {ct.OPERATION_DECODE, ct.OPERATION_PREFILL}
        for sequence, name in enumerate(names, 1):
            rng = np.random.default_rng(sequence)
            _randomize_state(contract, ref, gpu, rng)
            lanes = _windowed_lanes(contract, name, rng)
            _stage(contract, name, ref.transport(0), lanes, sequence)
            _stage(contract, name, gpu.transport(0), lanes, sequence)
            ref.run(name, 0)
            gpu.run(name, 0)
            rows = len(lanes)
            want, got = ref.completion(0), gpu.completion(0)
            want_ids = want[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(want[mf.COMPLETION_FIELD_SAMPLED_IDS].shape[0], -1)
            got_ids = got[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(want_ids.shape)
            logits = gpu.download("scratch.logits")[:rows]
            expected = ref.buffers["scratch.logits"][:rows]
            assert np.isfinite(logits).all(), name
            assert relative_error(logits, expected) < 2e-2, name
            sampled = contract.sampled_size
            deviation = np.abs(logits[:, :sampled] - expected[:, :sampled]).max(axis=1)
            top_two = np.sort(expected[:, :sampled], axis=1)[:, -2:]
            decided = (top_two[:, 1] - top_two[:, 0]) > 2 * deviation
            np.testing.assert_array_equal(got_ids[:rows, 0][decided], want_ids[:rows, 0][decided], err_msg=name)
            assert decided.mean() >= 0.5, name
    finally:
        gpu.close()
        ref.close()


def _long_prompts(running: RunningModel, count: int) -> list[list[int]]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"]
    words += ["seven", "bright", "stars", "turn", "slowly"]
    prompts = []
    for i in range(count):
        story = " ".join(words[(i + j) % len(words)] for j in range(24))
        prompts.append(running.bootstrap.encode_prompt([{"role": "user", "content": f"Story {i}: {story}"}]))
    assert all(len(p) > 2 * WINDOW for p in prompts), [len(p) for p in prompts]
    return prompts


def test_long_greedy_requests_give_the_reference_tokens(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    max_tokens = 24
    prompts = _long_prompts(reference_running, 6)
    expected = _reference_steps(reference_running, prompts, max_tokens)
    running = start_core(gpu_core, "cuda")
    try:
        assert running.model.backend_name == "cuda"
        streams = [
            running.engine.submit(PreparedRequest(f"w{i}", p, max_tokens, GREEDY, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        outcomes = [list(stream) for stream in streams]
        assert all(isinstance(events[-1], Finished) for events in outcomes), [o[-1] for o in outcomes]
        tokens = [[e.token_id for e in events if isinstance(e, TokenEvent)] for events in outcomes]
        assert all(len(t) == max_tokens for t in tokens)
        assert all(_agrees_until_a_near_tie(t, want) for t, want in zip(tokens, expected, strict=True)), (
            tokens,
            expected,
        )
        exact = sum(t == [token for token, _ in want] for t, want in zip(tokens, expected, strict=True))
        assert exact >= len(prompts) // 2
    finally:
        running.close()
