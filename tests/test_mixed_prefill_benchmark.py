"""Smoke tests of ``benchmarks/mixed_prefill.py``: the stall figures from hand-made timestamps, its refusals
of bad options, and one small run on the reference backend whose chunked prompt runs on the small mixed
program only. No assertions on the speed figures themselves."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests import benchmark_modules


def load_benchmark() -> ModuleType:
    return benchmark_modules.load_benchmark("mixed_prefill")


def test_the_step_comes_before_the_prompt_and_the_gaps_overlapping_its_computation_after() -> None:
    benchmark = load_benchmark()
    ms = 1_000_000
    # the prompt is submitted at 10 ms and its first token comes at 20 ms
    first = benchmark.Stream(stamps_ns=[0, 2 * ms, 4 * ms, 6 * ms, 8 * ms, 9 * ms, 15 * ms, 21 * ms, 23 * ms])
    second = benchmark.Stream(stamps_ns=[1 * ms, 3 * ms, 5 * ms, 7 * ms, 9 * ms, 12 * ms, 18 * ms, 20 * ms])
    figures = benchmark.stall([first, second], 3 * ms, 10 * ms, 20 * ms)
    # steady gaps (from 3 ms, ending by 10 ms): 4->6, 6->8, 8->9 and 3->5, 5->7, 7->9: 2, 2, 1, 2, 2, 2 ms
    assert figures["step_ms"] == 2.0
    # overlapping (10, 20): first 9->15 (6), 15->21 (6); second 9->12 (3), 12->18 (6), 18->20 (2)
    assert figures["longest_gap_ms"] == 6.0
    assert figures["gap_over_step"] == 3.0
    # tokens in (10, 20]: first 15; second 12, 18, 20
    assert figures["decoder_tokens"] == 2.0


def test_no_gap_before_the_prompt_is_an_error() -> None:
    benchmark = load_benchmark()
    with pytest.raises(RuntimeError, match="no decode gaps"):
        benchmark.stall([benchmark.Stream(stamps_ns=[5, 50])], 0, 1, 100)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cpu", "--chunks", "none,4"], "chunks [4] leave no room for prompt tokens beside 4 decoders"),
        (["--device", "cpu", "--chunks", "none,zero"], "--chunks takes 'none' and positive token counts, not 'zero'"),
        (["--device", "cpu", "--long", "300"], "--long fit the context of 256"),
    ],
)
def test_bad_options_are_refused(argv: list[str], message: str) -> None:
    benchmark = load_benchmark()
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        benchmark.make_setup(benchmark.parse_args(argv))


def test_the_prompt_rounds_and_decode_tokens_follow_the_chunks() -> None:
    benchmark = load_benchmark()
    setup = benchmark.make_setup(benchmark.parse_args(["--device", "cpu", "--chunks", "none,16,8"]))
    assert setup.prefill_variants == (8, 16, 64)
    # 64 prompt tokens beside 4 decoders: 60 a round (none), 12 (16), 4 (8)
    assert [setup.prompt_rounds(chunk) for chunk in setup.chunks] == [2, 6, 16]
    assert setup.decode_tokens == 256 - 16 - 1


def test_a_small_run_on_the_reference_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    out = tmp_path / "mixed.json"
    code = benchmark.main(["--device", "cpu", "--cores", str(tmp_path / "cores"), "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    whole, chunked = data["results"]
    assert (whole["chunk"], chunked["chunk"]) == (None, 16)
    assert "mixed_p64" in whole["prompt_rounds"]
    assert sorted(set(chunked["prompt_rounds"])) == ["initialize", "mixed_p16"]
    assert chunked["prompt_rounds"].count("mixed_p16") == 6
    for result in (whole, chunked):
        assert result["ttft_ms"] > 0 and result["alone_ms"] > 0 and result["step_ms"] > 0
        assert result["longest_gap_ms"] > 0 and result["decoder_tokens"] > 0
    printed = capsys.readouterr().out
    assert "| 16 | 1 initialize, 6 mixed_p16 |" in printed
