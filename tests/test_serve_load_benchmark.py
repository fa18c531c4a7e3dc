"""Smoke tests of ``benchmarks/serve_load.py``: the streaming window, the per-token figures (TPOT and the gap
between deliveries), the hand-out of requests to clients and client processes, its refusals of bad options,
and one small run on the reference backend with two client processes and the engine-alone figures beside the
HTTP row. No assertions on the speed figures themselves."""

from __future__ import annotations

import json
import math
import queue
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import benchmark_modules


def load_benchmark() -> ModuleType:
    return benchmark_modules.load_benchmark("serve_load")


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


def test_chunks_read_together_are_one_delivery_and_each_token_gets_its_deliverys_gap() -> None:
    benchmark = load_benchmark()
    # 12 tokens over 6 chunks (2 a chunk): deliveries at 1.0 (3 chunks, 0.2 ms apart), 1.010 (2), 1.030 (1)
    sample = benchmark.Sample(0, 0.9, 1.1, [1.0, 1.0002, 1.0004, 1.010, 1.0102, 1.030], 12, 10, 200, "")
    assert benchmark.DELIVERY_GAP_S == 0.0005
    assert sample.deliveries() == [(1.0, 3), (1.010, 2), (1.030, 1)]
    # 10 ms before a delivery of 4 tokens: 2.5 ms a token; 20 ms before one of 2 tokens: 10 ms a token
    assert sample.token_gaps() == [(pytest.approx(0.0025), 4.0), (pytest.approx(0.010), 2.0)]
    assert sample.tpot_s == pytest.approx(0.030 / 11)
    # chunks 0.8 ms apart are separate deliveries; one token a chunk
    apart = benchmark.Sample(0, 0.0, 1.0, [0.1, 0.1008, 0.1016], 3, 10, 200, "")
    assert apart.deliveries() == [(0.1, 1), (0.1008, 1), (0.1016, 1)]
    assert [weight for _, weight in apart.token_gaps()] == [1.0, 1.0]
    # one delivery: a TPOT but no gap; one token: neither
    burst = benchmark.Sample(0, 0.0, 1.0, [0.5, 0.5001], 4, 10, 200, "")
    assert (burst.token_gaps(), burst.tpot_s) == ([], pytest.approx(0.0001 / 3))
    assert math.isnan(benchmark.Sample(0, 0.0, 1.0, [0.5], 1, 10, 200, "").tpot_s)


def test_the_gap_percentiles_are_over_tokens_not_deliveries() -> None:
    benchmark = load_benchmark()
    # one delivery of 1 token after 30 ms, three of 3 tokens after 3 ms each: 9 of 10 tokens waited 1 ms
    pairs = [(0.030, 1.0), (0.001, 3.0), (0.001, 3.0), (0.001, 3.0)]
    assert benchmark.weighted_percentile(pairs, 0.5) == 0.001
    assert benchmark.weighted_percentile(pairs, 0.89) == 0.001
    assert benchmark.weighted_percentile(pairs, 0.99) == 0.030
    assert benchmark.weighted_percentile(pairs, 1.0) == 0.030
    assert benchmark.weighted_percentile([(0.004, 0.5), (0.002, 1.5)], 0.5) == 0.002
    assert math.isnan(benchmark.weighted_percentile([], 0.5))


def test_a_row_shows_tpot_gaps_and_tpot_over_the_engine_step() -> None:
    benchmark = load_benchmark()
    sample = benchmark.Sample
    samples = [
        # 5 tokens, one a chunk: TPOT 40 ms / 4 = 10 ms; gaps 10 ms a token
        sample(0, 0.0, 0.05, [0.010, 0.020, 0.030, 0.040, 0.050], 5, 10, 200, ""),
        # 6 tokens in 2 deliveries of 1 and 5 chunks: TPOT 20.4 ms / 5; the 5 tokens waited 20 ms / 5 = 4 ms
        sample(1, 0.0, 0.05, [0.010, 0.030, 0.0301, 0.0302, 0.0303, 0.0304], 6, 10, 200, ""),
        sample(2, 0.0, 0.05, [0.010], 1, 10, 200, ""),  # 1 token: no TPOT, no gap
    ]
    row = benchmark.make_row("reference", "in-process", 3, samples, float("nan"), 0)
    row.engine = {"tokens_per_s": 100.0, "ms_per_step": 4.0}
    cells = dict(zip(benchmark.HEADERS, row.cells(), strict=True))
    assert "ITL p50 ms" not in cells
    assert (cells["TPOT p50 ms"], cells["TPOT p99 ms"]) == ("4.08", "10.00")
    assert (cells["gap p50 ms"], cells["gap p99 ms"]) == ("4.00", "10.00")  # 5 of the 9 tokens waited 4 ms
    assert cells["TPOT / step"] == "1.02"
    summary = row.summary()
    assert "itl_s" not in summary and "gaps" not in summary and "tpot" not in summary
    assert summary["tpot_s"]["count"] == 2 and summary["tpot_s"]["p50"] == pytest.approx(0.00408)
    assert summary["gap_s"]["count"] == 5 and summary["gap_s"]["tokens"] == 9.0
    assert summary["gap_s"]["mean"] == pytest.approx((4 * 0.010 + 5 * 0.004) / 9)
    assert summary["tpot_per_step"] == pytest.approx(summary["tpot_s"]["p50"] * 1000 / 4.0)
    row.engine = {}
    assert dict(zip(benchmark.HEADERS, row.cells(), strict=True))["TPOT / step"] == "-"


def test_a_client_process_makes_a_request_before_it_says_ready_and_reports_a_failed_one() -> None:
    benchmark = load_benchmark()
    ready: queue.Queue[int] = queue.Queue()
    results: queue.Queue[tuple[int, list[Any], str]] = queue.Queue()
    url = f"http://127.0.0.1:{benchmark.free_port()}"  # nothing listens there
    benchmark.client_process(3, url, [(0, [0])], 4, 5.0, ready, threading.Event(), results)
    assert ready.get_nowait() == 3  # the parent is not left waiting for the process
    position, samples, error = results.get_nowait()
    assert (position, samples) == (3, []) and error.startswith("ConnectError")


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
        (["--http-processes", "2,x"], "--http-processes must be comma-separated integers"),
        (["--http-processes", "0"], "--http-processes must be positive"),
        (
            ["--http-processes", "1,4"],
            "--http-processes above 1 needs the worker-process mode (--modes worker-process)",
        ),
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
    # The client processes make their first request (which loads httpx's transport) before the start, and each
    # client streams 2 x 32 tokens: the two processes' streams overlap even on a loaded 2-core machine.
    argv = ["--backends", "reference", "--clients", "2", "--requests", "4", "--max-tokens", "32"]
    returned = benchmark.main([*argv, "--client-processes", "2", "--out", str(out)])
    found = json.loads(out.read_text())
    assert found["errors"] == []
    assert returned == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| server |")))
    names = [cell.strip() for cell in lines[header].split("|")[1:-1]]
    cells = dict(zip(names, [cell.strip() for cell in lines[header + 2].split("|")[1:-1]], strict=True))
    assert [cells[name] for name in ("server", "clients", "ok", "out tokens")] == ["reference", "2", "4/4", "128"]
    assert "ITL p50 ms" not in cells
    measured = ["window tok/s", "TPOT p50 ms", "TPOT p99 ms", "gap p50 ms", "gap p99 ms", "engine tok/s"]
    assert all(cells[name] != "-" for name in [*measured, "engine ms/step", "HTTP / engine", "TPOT / step"])
    assert any(line.startswith("tok/s = ") and "TPOT / step = TPOT p50 / engine ms/step" in line for line in lines)
    (row,) = found["rows"]
    assert (row["mode"], row["clients"], row["ok"], row["tokens"]) == ("in-process", 2, 4, 128)
    assert row["engine"]["tokens_per_s"] == found["engine"]["reference"]["2"]["tokens_per_s"] > 0
    assert row["window"]["seconds"] > 0 and row["window"]["tokens"] > 0
    assert "itl_s" not in row and row["tpot_s"]["count"] == 4 and row["tpot_s"]["p50"] > 0
    assert row["gap_s"]["count"] > 0 and 0 < row["gap_s"]["tokens"] < 128
    assert row["tpot_per_step"] == pytest.approx(row["tpot_s"]["p50"] * 1000 / row["engine"]["ms_per_step"])
    assert cells["TPOT / step"] == f"{row['tpot_per_step']:.2f}"


def test_the_http_process_counts_sweep_the_worker_process_mode_and_the_row_says_the_spread() -> None:
    benchmark = load_benchmark()
    args = benchmark.parse_args(["--modes", "thread,worker-process", "--http-processes", "4,1"])
    assert (args.modes, args.http_process_list) == (["thread", "worker-process"], [1, 4])
    assert benchmark.parse_args([]).http_process_list == [1]
    sample = benchmark.Sample(0, 0.0, 0.05, [0.010, 0.020], 2, 10, 200, "")
    row = benchmark.make_row("cuda", "worker-process", 256, [sample], float("nan"), 0)
    cells = dict(zip(benchmark.HEADERS, row.cells(), strict=True))
    assert (cells["server"], cells["HTTP processes"]) == ("cuda (worker-process)", "1")
    row.http_processes, row.split = 4, [70, 62, 64, 60]
    cells = dict(zip(benchmark.HEADERS, row.cells(), strict=True))
    assert (cells["server"], cells["HTTP processes"]) == ("cuda (worker-process x4)", "4: 70/62/64/60")
    assert row.summary()["split"] == [70, 62, 64, 60] and row.summary()["http_processes"] == 4


def test_a_server_of_two_http_processes_says_how_the_waves_requests_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = load_benchmark()
    out = tmp_path / "serve_load.json"
    argv = ["--backends", "reference", "--modes", "worker-process", "--http-processes", "2", "--clients", "2"]
    argv += ["--requests", "4", "--max-tokens", "8", "--client-processes", "0", "--no-engine", "--out", str(out)]
    returned = benchmark.main(argv)
    (row,) = json.loads(out.read_text())["rows"]
    assert returned == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| server |")))
    names = [cell.strip() for cell in lines[header].split("|")[1:-1]]
    cells = dict(zip(names, [cell.strip() for cell in lines[header + 2].split("|")[1:-1]], strict=True))
    assert (cells["server"], cells["clients"], cells["ok"]) == ("reference (worker-process x2)", "2", "4/4")
    assert (row["http_processes"], sum(row["split"]), len(row["split"])) == (2, 4, 2)
    assert cells["HTTP processes"] == f"2: {row['split'][0]}/{row['split'][1]}"
