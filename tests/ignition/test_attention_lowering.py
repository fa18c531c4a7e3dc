"""Which attention kernel a ``paged_attention`` node lowers to, and the staged projection input's type.

Lowered for sm_90a on a machine without a GPU (the real compiler runs): prompt chunks (at least 64
tokens, two a page-table row) become query tiles, many single-token rows become 256-position splits,
a few rows keep 64-position splits; the output rows may be float32, bf16 or f16; a normalised or
SwiGLU projection over bf16 weights stages its input in bf16, over float32 weights in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels.attention import TILE_MIN_TOKENS, WIDE_SPLIT_POSITIONS
from ignition.kernels.lowering import LoweringError

from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import bf16_bits, lower

HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, TABLE_PAGES = 32, 8, 64, 16, 64


def _attention(tokens: int, table_rows: int) -> dict[str, np.ndarray]:
    return {
        "q": np.zeros((tokens, HEADS, HEAD_DIM), np.float32),
        "k_plane": np.zeros((40, PAGE_TOKENS, KV_HEADS, HEAD_DIM), np.float32),
        "v_plane": np.zeros((40, PAGE_TOKENS, KV_HEADS, HEAD_DIM), np.float32),
        "page_table": np.zeros((table_rows, TABLE_PAGES), np.int32),
        "token_row": np.zeros(tokens, np.int32),
        "token_position": np.zeros(tokens, np.int32),
        "out": np.zeros((tokens, HEADS, HEAD_DIM), np.float32),
    }


@pytest.mark.parametrize(
    ("tokens", "table_rows", "symbol", "grid"),
    [
        (512, 256, "attention_tile_kernel", (KV_HEADS, 32, 1)),  # a prompt chunk: 16 tokens x 4 heads a tile
        (TILE_MIN_TOKENS, 8, "attention_tile_kernel", (KV_HEADS, 4, 1)),
        # too few tokens to tile, enough for wide splits
        (TILE_MIN_TOKENS - 1, 8, "attention_split_kernel", (63, KV_HEADS, 1024 // WIDE_SPLIT_POSITIONS)),
        (64, 64, "attention_split_kernel", (64, KV_HEADS, 1024 // WIDE_SPLIT_POSITIONS)),  # wide decode
        (256, 256, "attention_split_kernel", (256, KV_HEADS, 1024 // WIDE_SPLIT_POSITIONS)),
        (8, 8, "attention_split_kernel", (8, KV_HEADS, 16)),  # a few decode rows: 64-position splits
    ],
)
def test_the_attention_kernel_follows_the_node_shape(
    tokens: int, table_rows: int, symbol: str, grid: tuple[int, int, int]
) -> None:
    context, launches = lower("paged_attention", _attention(tokens, table_rows), {"scale": 0.125})
    (launch,) = launches
    assert launch.symbol == symbol
    assert tuple(launch.grid) == grid
    # a wide split launch (every multiprocessor two programs before splitting) runs two warps a program
    wide_split = symbol == "attention_split_kernel" and tokens * KV_HEADS >= 2 * 132
    assert launch.block[0] == 32 * (2 if wide_split else 4)
    assert launch.programmatic_wait
    (module,) = context.modules.values()
    assert module.data[:4] == b"\x7fELF"  # a cubin


@pytest.mark.parametrize(
    ("operation", "symbols"),
    [
        (ct.OPERATION_PREFILL, ["attention_tile_kernel"]),
        (ct.OPERATION_MIXED, ["attention_tile_kernel", "attention_split_kernel"]),
    ],
)
def test_a_mixed_programs_decode_lanes_take_the_split_kernel_beside_the_tiles(
    operation: int, symbols: list[str], launched_constants: list[dict[str, object]]
) -> None:
    # 64 decode lanes and a 128-token prompt chunk: 192 tokens over 65 page-table rows
    _context, launches = lower("paged_attention", _attention(192, 65), {"scale": 0.125}, operation=operation)
    assert [launch.symbol for launch in launches] == symbols
    mixed = operation == ct.OPERATION_MIXED
    assert launched_constants[0]["SKIP_ALONE"] is mixed
    assert tuple(launches[0].grid) == (KV_HEADS, 192 // 16, 1)
    if mixed:
        # every token a program per KV head and 256-position split (192 x 8 programs: a wide launch)
        assert launched_constants[1]["ALONE_ONLY"] is True
        assert tuple(launches[1].grid) == (192, KV_HEADS, 1024 // WIDE_SPLIT_POSITIONS)
        assert all(launch.programmatic_wait for launch in launches)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tokens_a_tile"), [(32, 8, 64, 16), (32, 8, 128, 8), (9, 3, 16, 16)]
)
def test_prompt_tiles_hold_half_the_query_rows_for_heads_over_64(
    heads: int, kv_heads: int, head_dim: int, tokens_a_tile: int
) -> None:
    tokens = 512
    arrays = {
        "q": np.zeros((tokens, heads, head_dim), np.float32),
        "k_plane": np.zeros((40, PAGE_TOKENS, kv_heads, head_dim), np.float32),
        "v_plane": np.zeros((40, PAGE_TOKENS, kv_heads, head_dim), np.float32),
        "page_table": np.zeros((4, TABLE_PAGES), np.int32),
        "token_row": np.zeros(tokens, np.int32),
        "token_position": np.arange(tokens, dtype=np.int32),
        "out": np.zeros((tokens, heads, head_dim), np.float32),
    }
    _context, (launch,) = lower("paged_attention", arrays, {"scale": 0.125})
    assert launch.symbol == "attention_tile_kernel"
    # KV heads first, then the tiles (run last first); four warps
    assert tuple(launch.grid) == (kv_heads, tokens // tokens_a_tile, 1)
    assert tuple(launch.block) == (128, 1, 1)


@pytest.mark.parametrize("tokens", [8, 512])  # split kernel, query tiles
@pytest.mark.parametrize("out_type", [np.uint16, np.float16])  # bf16 bit patterns, f16
def test_attention_writes_its_output_rows_in_a_16_bit_type(tokens: int, out_type: type) -> None:
    """A bf16 kernel graph's attention writes its rows in bf16 for the output projection: both kernels
    compile with a 16-bit output pointer, and launch over the same grid as with a float32 one."""
    arrays = _attention(tokens, tokens if tokens < TILE_MIN_TOKENS else tokens // 2)
    _context, wide = lower("paged_attention", arrays, {"scale": 0.125})
    arrays["out"] = arrays["out"].astype(out_type)
    context, narrow = lower("paged_attention", arrays, {"scale": 0.125})
    assert [launch.symbol for launch in narrow] == [launch.symbol for launch in wide]
    assert [tuple(launch.grid) for launch in narrow] == [tuple(launch.grid) for launch in wide]
    (module,) = context.modules.values()
    assert module.data[:4] == b"\x7fELF"


def test_attention_refuses_an_integer_output_by_name() -> None:
    arrays = _attention(8, 8)
    arrays["out"] = arrays["out"].astype(np.int32)
    with pytest.raises(LoweringError, match="out must be float32, bf16 or f16"):
        lower("paged_attention", arrays, {"scale": 0.125})


@pytest.mark.parametrize(
    ("weights", "dtype", "key"),
    [("bf16", mf.DTYPE_BF16, "projection_input_bf16"), ("f32", mf.DTYPE_F32, "projection_input")],
)
@pytest.mark.parametrize("op", ["rmsnorm_linear", "silu_mul_linear_add"])
def test_a_staged_projection_input_takes_the_weights_type(weights: str, dtype: int, key: str, op: str) -> None:
    rows, n, k = 64, 256, 128
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    arrays: dict[str, np.ndarray] = {
        "weight": bf16_bits(weight) if weights == "bf16" else weight,
        "out": np.zeros((rows, n), np.float32),
    }
    if op == "rmsnorm_linear":
        arrays |= {"x": np.zeros((rows, k), np.float32), "norm_weight": np.ones(k, np.float32)}
    else:
        arrays |= {"gate_up": np.zeros((rows, 2 * k), np.float32), "residual": np.zeros((rows, n), np.float32)}
    context, launches = lower(op, arrays, {"eps": 1e-5}, weights=("weight", "norm_weight"))
    staged = {
        decl.name: decl for decl in context.manifest.buffers if decl.name.startswith("workspace.projection_input")
    }
    assert list(staged) == [f"workspace.{key}"]
    assert staged[f"workspace.{key}"].dtype == dtype
    assert int(staged[f"workspace.{key}"].shape[0].size) == rows * k
    assert [launch.symbol for launch in launches][-1] == "projection_kernel"
