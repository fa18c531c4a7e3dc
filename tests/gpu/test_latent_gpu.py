"""The paged-latent kernels and a latent core with GPU kernels against the reference backend.

Node level: ``latent_cache_write`` (one record a token, and records of 2 tokens split over two writes)
and ``latent_attention`` through a page-table view shifted by ``page_offset`` columns, with padding
tokens and tokens that see no record yet, give the reference's planes and outputs within float32
rounding. Core level: a tiny ``latent-synthetic`` core (records of 2 tokens, a page-table offset of 1)
built for ``reference,sm_90a`` with 16-token prefill programs serves prompts of several prefill chunks on
the CUDA backend with the reference's greedy tokens (up to a step the reference itself decided by a
near tie) and the reference's log-probabilities within 2e-2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helios_core.backends.cuda_driver import Context
from helios_core.loading import TrustSettings
from helios_core.runtime.startup import RunningModel

from .harness import assert_cuda_matches_reference, build_gpu_core, reference_node, relative_error, run_node

NAMESPACE = "helios-tests/gpu-latent"
LATENT_OPTIONS = ("--tokens-per-record", "2", "--page-offset", "1")

pytestmark = pytest.mark.gpu

PAGE_TOKENS, PAGES, WIDTH, HEADS, HEAD_DIM = 8, 6, 12, 3, 8


def _paged_tokens(page_offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(page table, token rows, positions, slots): row 0 at positions 0..4, row 1 at 9..10, a padding token."""
    table = np.full((2, page_offset + 3), -1, dtype=np.int32)
    table[0, page_offset:] = [2, 4, 1]
    table[1, page_offset:] = [0, 5, 3]
    rows = np.array([0, 0, 0, 0, 0, 1, 1, -1], dtype=np.int32)
    positions = np.array([0, 1, 2, 3, 4, 9, 10, 0], dtype=np.int32)
    slots = np.array(
        [table[r, page_offset + p // PAGE_TOKENS] * PAGE_TOKENS + p % PAGE_TOKENS if r >= 0 else -1
         for r, p in zip(rows, positions, strict=True)],
        dtype=np.int32,
    )  # fmt: skip
    return table, rows, positions, slots


@pytest.mark.parametrize("tokens_per_record", [1, 2])
def test_cache_write_matches_the_reference(cuda_context: Context, tokens_per_record: int) -> None:
    rng = np.random.default_rng(3)
    _, _, _, slots = _paged_tokens(0)
    records = PAGE_TOKENS // tokens_per_record
    plane = rng.normal(size=(PAGES, records, WIDTH)).astype(np.float32)
    latent = rng.normal(size=(slots.size, WIDTH)).astype(np.float32)
    first = {"latent": latent[:3], "slots": slots[:3], "plane": plane}
    attributes = {"tokens_per_record": tokens_per_record}
    got = run_node(cuda_context, "latent_cache_write", first, attributes)["plane"]
    want = reference_node("latent_cache_write", first, attributes)["plane"]
    np.testing.assert_array_equal(got, want)  # a record split over two writes
    second = {"latent": latent[3:], "slots": slots[3:], "plane": want}
    got = run_node(cuda_context, "latent_cache_write", second, attributes)["plane"]
    want = reference_node("latent_cache_write", second, attributes)["plane"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("tokens_per_record", "page_offset"), [(1, 0), (2, 1), (4, 2)])
def test_attention_matches_the_reference(cuda_context: Context, tokens_per_record: int, page_offset: int) -> None:
    rng = np.random.default_rng(4)
    table, rows, positions, _ = _paged_tokens(page_offset)
    records = PAGE_TOKENS // tokens_per_record
    arrays = {
        "q": rng.normal(size=(rows.size, HEADS, HEAD_DIM)).astype(np.float32),
        "plane": rng.normal(size=(PAGES, records, WIDTH)).astype(np.float32),
        "w_uk": (rng.normal(size=(HEADS * HEAD_DIM, WIDTH)) * WIDTH**-0.5).astype(np.float32),
        "w_uv": (rng.normal(size=(HEADS * HEAD_DIM, WIDTH)) * WIDTH**-0.5).astype(np.float32),
        "page_table": table,
        "token_row": rows,
        "token_position": positions,
        "out": np.full((rows.size, HEADS, HEAD_DIM), 9.0, dtype=np.float32),
    }
    attributes = {"scale": HEAD_DIM**-0.5, "tokens_per_record": tokens_per_record, "page_offset": page_offset}
    got = run_node(cuda_context, "latent_attention", arrays, attributes, weights=("w_uk", "w_uv"))["out"]
    want = reference_node("latent_attention", arrays, attributes)["out"]
    assert relative_error(got, want) < 1e-5
    unseen = (rows < 0) | ((positions + 1) // tokens_per_record == 0)
    assert not got[unseen].any()


@pytest.fixture(scope="module")
def gpu_core(tmp_path_factory: pytest.TempPathFactory, cuda_context: Context) -> tuple[Path, TrustSettings]:
    return build_gpu_core(
        tmp_path_factory, cuda_context, "gpu-latent", NAMESPACE,
        "--max-rows", "4", "--prefill-tokens", "16", "--context", "128", "--page-tokens", "16",
        "--cache-pages", "64", *LATENT_OPTIONS,
        core_name="latent.core", recipe="latent-synthetic", dtype=None,
    )  # fmt: skip


def test_latent_core_on_cuda_gives_the_reference_tokens_and_logprobs(
    gpu_core: tuple[Path, TrustSettings], reference_running: RunningModel
) -> None:
    assert_cuda_matches_reference(gpu_core, reference_running)
