"""``benchmarks/projection_tiles.py``: the tiles ``--tiles`` names, read back as the table labels them."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from tests import benchmark_modules


def load_benchmark() -> ModuleType:
    benchmark_modules.load_benchmark("gpu_decode")  # the script imports it from its own folder
    return benchmark_modules.load_benchmark("projection_tiles")


def test_named_tiles_read_back_as_their_labels() -> None:
    benchmark = load_benchmark()
    tiles = benchmark.parse_tiles("256x128x64w8s3/2tma")
    assert (tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages) == (256, 128, 64, 8, 3)
    assert (tiles.split, tiles.descriptors, tiles.persistent) == (2, True, 0)
    persistent = benchmark.parse_tiles("256x128x64w8s4tmap1ws")
    assert (persistent.persistent, persistent.specialised, persistent.descriptors) == (1, True, True)
    labels = ("*128x128x64 w8 s4 tma p1", "64x128x64 w4 s4 /2", "16x64x128 w4 s3", "256x128x64 w8 s4 tma p1 ws")
    for label in labels:
        assert benchmark._label(benchmark.parse_tiles(label), None).strip() == label.lstrip("*")
    with pytest.raises(argparse.ArgumentTypeError, match="'128x128w8' is not a tile"):
        benchmark.parse_tiles("128x128w8")


def test_named_tiles_replace_the_candidates() -> None:
    benchmark = load_benchmark()
    projection = benchmark._projections("1b")["o"]
    named = [benchmark.parse_tiles("256x128x64w8s3/4tma")]
    candidates = benchmark._candidates(256, projection, only=named)
    assert candidates == [benchmark._chosen(256, projection), *named]
