"""Smoke tests of ``benchmarks/serve_load.py``: the streaming window, the hand-out of requests to clients and
client processes, its refusals of bad options, and one small run on the reference backend with two client
processes and the engine-alone figures beside the HTTP row. No assertions on the speed figures themselves."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_benchmark() -> ModuleType:
    if "serve_load" in sys.modules:
        return sys.modules["serve_load"]
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses, and the client processes, look the module up there
    spec.loader.exec_module(module)
    return module


def test_the_window_runs_from_the_last_first_chunk_to_the_first_last_chunk_and_weights_chunks_by_usage() -> None:
    benchmark = load_benchmark()
    sample = benchmark.Sample
    samples = [
        # client 0: chunks at 1, 2, 3, 4 carrying 8 tokens (2 per chunk)
        sample(0, 0.0, 4.5, [1.0, 2.0, 3.0, 4.0], 8, 10, 200, ""),
        # client 1: first chunk at 2, last at 5, 3 tokens over 3 chunks
        sample(1, 0.5, 5.5, [2.0, 3.5, 5.0], 3, 10, 200, ""),
    ]
    window = benchmark.stream_window(samples)
    # window (2, 4]: client 0 has chunks 3 and 4 (2 tokens each), client 1 has 3.5 (1 token)
    assert window == {"tokens_per_s": 2.5, "seconds": 2.0, "tokens": 5.0}


def test_a_client_without_content_leaves_no_window() -> None:
    benchmark = load_benchmark()
    sample = benchmark.Sample
    samples = [sample(0, 0.0, 2.0, [1.0, 2.0], 2, 10, 200, ""), sample(1, 0.0, 1.0, [], 0, 0, 429, "busy")]
    window = benchmark.stream_window(samples)
    assert math.isnan(window["tokens_per_s"]) and window["seconds"] == 0.0


def test_requests_go_to_clients_and_clients_to_processes_round_robin() -> None:
    benchmark = load_benchmark()
    assert benchmark.assign(4, 6, 2) == [[(0, [0, 4]), (2, [2])], [(1, [1, 5]), (3, [3])]]
    assert benchmark.assign(2, 2, 0) == [[(0, [0]), (1, [1])]]
    assert benchmark.assign(2, 2, 8) == [[(0, [0])], [(1, [1])]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "sideways"], "unknown server modes ['sideways']"),
        (["--clients", "4,x"], "--clients must be comma-separated integers"),
        (["--cores", "somewhere"], "--cores needs --shape"),
        (["--shape", "huge"], "unknown shape 'huge'"),
        (["--shape", "tiny", "--max-tokens", "1000"], "--max-tokens must leave 64 prompt tokens"),
        (["--client-processes", "-1"], "--client-processes must not be negative"),
    ],
)
def test_bad_options_are_refused_with_their_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    with pytest.raises(SystemExit) as exited:
        benchmark.parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_defaults_to_the_1b_core_both_server_modes_and_the_large_client_counts() -> None:
    args = load_benchmark().parse_args(["--backends", "cuda"])
    assert (args.shape, args.modes, args.client_list, args.max_tokens) == (
        "1b",
        ["worker-process", "thread"],
        [64, 256],
        512,
    )
    assert args.client_processes == 8


def test_one_run_prints_http_and_engine_figures_side_by_side_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    out = tmp_path / "serve_load.json"
    argv = ["--backends", "reference", "--clients", "2", "--requests", "4", "--max-tokens", "6"]
    assert benchmark.main([*argv, "--client-processes", "2", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| server |")))
    cells = [cell.strip() for cell in lines[header + 2].split("|")[1:-1]]
    assert cells[:4] == ["reference", "2", "4/4", "24"]
    assert all(cell != "-" for cell in cells[-3:])  # engine tok/s, engine ms/step, HTTP / engine
    found = json.loads(out.read_text())
    assert found["errors"] == []
    (row,) = found["rows"]
    assert (row["mode"], row["clients"], row["ok"], row["tokens"]) == ("in-process", 2, 4, 24)
    assert row["engine"]["tokens_per_s"] == found["engine"]["reference"]["2"]["tokens_per_s"] > 0
