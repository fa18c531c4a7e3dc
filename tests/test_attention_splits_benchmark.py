"""Smoke tests of ``benchmarks/attention_splits.py``'s prompt-chunk mode (``--chunk``): its tile
configurations as written on the command line, its refusals of bad options, and one compile-only run whose
candidates lower to the query tiles they name. No GPU, no speed figures."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests import benchmark_modules

pytest.importorskip("triton")


def load_benchmark() -> ModuleType:
    for sibling in ("gpu_decode", "projection_tiles"):  # the script imports them from its own folder
        benchmark_modules.load_benchmark(sibling)
    return benchmark_modules.load_benchmark("attention_splits")


def test_tile_configurations_read_tokens_positions_warps_and_stages() -> None:
    benchmark = load_benchmark()
    assert benchmark._tile_config("t16n64w4s3") == (16, 64, 4, 3)
    assert benchmark._tile_config("t8n128w8s2") == (8, 128, 8, 2)
    with pytest.raises(SystemExit, match="--tile-configs: 't16n64w4' is not tBLOCK_TnBLOCK_NwWARPSsSTAGES"):
        benchmark._tile_config("t16n64w4")


@pytest.mark.parametrize("tokens", [32, 2048])
def test_a_chunk_outside_the_tiles_and_the_span_is_refused(tokens: int) -> None:
    benchmark = load_benchmark()
    with pytest.raises(SystemExit, match="--chunk must be 64 to 1024 tokens"):
        benchmark.main(["--shapes", "tiny", "--chunk", str(tokens), "--compile-only"])


def test_a_compile_only_run_lowers_every_candidate_to_query_tiles() -> None:
    benchmark = load_benchmark()
    assert benchmark.main(["--shapes", "tiny", "--chunk", "64", "--tile-configs", "t8n32w4s2", "--compile-only"]) == 0
    shape = benchmark.SHAPES["tiny"]
    _, module, launch = benchmark._lowered(
        64, shape.heads, shape.kv_heads, shape.head_dim, plane_dtype=benchmark.mf.DTYPE_BF16, table_rows=1,
        tile_config=(8, 32, 4, 2),
    )  # fmt: skip
    assert module[:4] == b"\x7fELF"  # a cubin
    assert launch.symbol == "attention_tile_kernel"
    # KV heads first, then 64 / 8 tiles; four warps
    assert list(launch.grid) == [shape.kv_heads, 8, 1]
    assert list(launch.block) == [128, 1, 1]
