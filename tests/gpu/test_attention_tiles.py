"""Paged attention's query tiles and wide splits on the CUDA backend against the reference backend.

A ``paged_attention`` node with at least 64 tokens and two tokens a page-table row (prompt chunks
packed one after another, as a prefill program packs them) lowers to query tiles: consecutive tokens
times a KV head's query group in one program, attending each cache row of the tile in turn. A node with
one token a row and enough rows to give every multiprocessor two programs (decode at 64 rows and more)
lowers to 256-position splits. In a mixed program the tokens alone in their row (decode lanes) take a split
launch beside the tiles. All agree with the reference to float32 rounding, for query groups of
1, 3 and 4 heads, head sizes 16, 64 and 128, with and without a window, with padding tokens and chunks
that straddle tiles; pages no token may read hold NaN and never reach an output.
"""

from __future__ import annotations

import numpy as np
import pytest

from helios_core.backends.cuda_driver import Context
from helios_core.wire import contract_pb2 as ct

from .harness import lower, reference_node, run_node

pytestmark = pytest.mark.gpu

PAGE_TOKENS = 16


def _arrays(
    rng: np.random.Generator,
    chunks: list[tuple[int, int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    table_rows: int,
    window: int = 0,
) -> dict[str, np.ndarray]:
    """Packed tokens of ``chunks`` (row, first position, tokens; row -1: padding tokens), each row's
    pages a random permutation, every page outside all rows' reach (and wholly before a window) NaN."""
    rows = np.concatenate([np.full(count, row, np.int32) for row, _, count in chunks])
    positions = np.concatenate([np.arange(first, first + count, dtype=np.int32) for _, first, count in chunks])
    highest = int(positions.max()) + 1
    width = -(-highest // PAGE_TOKENS)
    pages = table_rows * width + 1
    poisoned = pages - 1
    k = rng.standard_normal((pages, PAGE_TOKENS, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((pages, PAGE_TOKENS, kv_heads, head_dim)).astype(np.float32)
    k[poisoned], v[poisoned] = np.nan, np.nan
    table = np.full((table_rows, width), poisoned, np.int32)
    order = rng.permutation(pages - 1)
    for row in range(table_rows):
        mine = positions[rows == row]
        if not mine.size:
            continue
        reach = -(-(int(mine.max()) + 1) // PAGE_TOKENS)
        lowest = max(int(mine.min()) - window + 1, 0) if window else 0
        table[row, :reach] = order[row * width : row * width + reach]
        table[row, : lowest // PAGE_TOKENS] = poisoned
    return {
        "q": rng.standard_normal((rows.size, heads, head_dim)).astype(np.float32),
        "k_plane": k,
        "v_plane": v,
        "page_table": table,
        "token_row": rows,
        "token_position": positions,
        "out": np.full((rows.size, heads, head_dim), 7.0, np.float32),
    }


def _check(
    cuda_context: Context,
    arrays: dict[str, np.ndarray],
    window: int,
    kernel: str,
    grid: list[int],
    *,
    operation: int = 0,
    kernels: tuple[str, ...] = (),
) -> None:
    """The node lowers to ``kernel`` on ``grid`` (then ``kernels``), and agrees with the reference."""
    attributes: dict[str, float | int] = {"scale": 1.0 / np.sqrt(arrays["q"].shape[2])}
    if window:
        attributes["window"] = window
    _context, launches = lower("paged_attention", arrays, attributes, operation=operation)
    assert [launch.module.split(".")[1] for launch in launches] == [kernel, *kernels]
    assert list(launches[0].grid) == grid
    got = run_node(cuda_context, "paged_attention", arrays, attributes, repeat=2, operation=operation)["out"]
    want = reference_node("paged_attention", arrays, attributes)["out"]
    assert np.isfinite(got).all()
    padding = arrays["token_row"] < 0
    assert (got[padding] == 0.0).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (9, 3, 16), (4, 4, 128), (32, 8, 64)])
@pytest.mark.parametrize("window", [0, 40])
def test_prompt_chunks_attend_as_query_tiles(
    cuda_context: Context, heads: int, kv_heads: int, head_dim: int, window: int
) -> None:
    rng = np.random.default_rng(heads * 1000 + head_dim + window)
    # chunks of several rows packed one after another (some continuing a prompt at a later position),
    # straddling tiles, with padding tokens between and after them
    chunks = [(0, 0, 37), (2, 100, 5), (1, 0, 1), (-1, 0, 3), (3, 17, 90), (2, 105, 30), (-1, 0, 10)]
    arrays = _arrays(rng, chunks, heads=heads, kv_heads=kv_heads, head_dim=head_dim, table_rows=4, window=window)
    query_rows = 64 if head_dim <= 64 else 32
    tile_tokens = query_rows // (1 << (heads // kv_heads - 1).bit_length())  # query rows / the padded group
    tiles = -(-arrays["q"].shape[0] // tile_tokens)
    _check(cuda_context, arrays, window, "attention_tile_kernel", [kv_heads, tiles, 1])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 64), (32, 8, 128), (9, 3, 16)])
@pytest.mark.parametrize("window", [0, 40])
def test_a_mixed_rounds_decode_lanes_attend_beside_its_prompt_chunks(
    cuda_context: Context, heads: int, kv_heads: int, head_dim: int, window: int
) -> None:
    """In a mixed program the tokens alone in their row (decode lanes, a one-token chunk) take the split kernel
    and the rest the tiles: every token attends once, as the reference."""
    rng = np.random.default_rng(heads + head_dim + window)
    decode = [(row, int(rng.integers(1, 600)), 1) for row in range(4, 44)]  # 40 decode lanes, contexts up to 600
    chunks = [*decode, (0, 0, 70), (1, 30, 1), (2, 7, 33), (3, 200, 2), (-1, 0, 5)]
    arrays = _arrays(rng, chunks, heads=heads, kv_heads=kv_heads, head_dim=head_dim, table_rows=44, window=window)
    query_rows = 64 if head_dim <= 64 else 32
    tile_tokens = query_rows // (1 << (heads // kv_heads - 1).bit_length())
    tiles = -(-arrays["q"].shape[0] // tile_tokens)
    _check(
        cuda_context,
        arrays,
        window,
        "attention_tile_kernel",
        [kv_heads, tiles, 1],
        operation=ct.OPERATION_MIXED,
        kernels=("attention_split_kernel",),
    )


@pytest.mark.parametrize("window", [0, 100])
def test_many_decode_rows_attend_in_wide_splits(cuda_context: Context, window: int) -> None:
    rng = np.random.default_rng(7 + window)
    rows = 96  # 96 tokens x 8 KV heads: at least two programs a multiprocessor
    contexts = rng.integers(1, 700, size=rows)
    contexts[:4] = [1, 256, 257, 699]  # one position, exactly one split, just past it, three splits
    chunks = [(row, int(contexts[row]) - 1, 1) for row in range(rows)]
    chunks[5] = (-1, 0, 1)
    arrays = _arrays(rng, chunks, heads=32, kv_heads=8, head_dim=64, table_rows=rows, window=window)
    reach = min(arrays["page_table"].shape[1] * PAGE_TOKENS, window or 1 << 30)
    splits = -(-reach // 256)
    _check(cuda_context, arrays, window, "attention_split_kernel", [rows, 8, splits])
