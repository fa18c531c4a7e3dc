"""The speculative operators lower to sm_90a launches on a machine without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels import speculative
from ignition.kernels.lowering import LoweringError

from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import lower

VOCAB = 49152  # as the sampling lowering tests: the sample kernels compile once per session
LANES = 2
SAMPLE_SYMBOLS = ["_sample_chunk_kernel", "_sample_weight_kernel", "_sample_finish_kernel"]


def _verify_arrays(width: int, *, state_rows: int = 5) -> dict[str, Any]:
    lanes, candidates = LANES, width - 1
    return {
        "logits": np.zeros((lanes * width, VOCAB), np.float32),
        "query_length": np.zeros(lanes, np.int32),
        "candidate_ids": np.zeros((lanes, candidates), np.int32),
        "temperature": np.ones(lanes, np.float32),
        "top_k": np.zeros(lanes, np.int32),
        "top_p": np.ones(lanes, np.float32),
        "min_p": np.zeros(lanes, np.float32),
        "repetition_penalty": np.ones(lanes, np.float32),
        "frequency_penalty": np.zeros(lanes, np.float32),
        "presence_penalty": np.zeros(lanes, np.float32),
        "prompt_presence": np.zeros((state_rows, VOCAB), np.uint8),
        "output_counts": np.zeros((state_rows, VOCAB), np.int32),
        "rows": np.arange(lanes, dtype=np.int32),
        "seed": np.zeros(lanes, np.uint64),
        "step": np.zeros(lanes, np.int64),
        "active": np.ones(lanes, np.uint8),
        "ids": np.zeros((lanes, width), np.int32),
        "accepted": np.zeros(lanes, np.int32),
        "emitted": np.zeros(lanes, np.int32),
        "pending": np.zeros(lanes, np.int32),
    }


def _check_launch(launch: mf.KernelLaunch, grid: tuple[int, int, int]) -> None:
    assert launch.target == "sm_90a"
    assert tuple(launch.grid) == grid
    assert launch.programmatic_wait
    assert 0 <= launch.shared_bytes <= 227 * 1024


@pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels
def test_sample_verify_samples_each_position_with_the_sample_kernels() -> None:
    width = 4
    context, launches = lower("sample_verify", _verify_arrays(width), {"vocab_limit": VOCAB})
    symbols = [launch.symbol for launch in launches]
    assert symbols == ["_verify_begin_kernel", *[*SAMPLE_SYMBOLS, "_verify_step_kernel"] * width]
    chunks = -(-VOCAB // speculative.GATHER_BLOCK)
    _check_launch(launches[0], (LANES, chunks, 1))
    steps = [launch for launch in launches if launch.symbol == "_verify_step_kernel"]
    for step in steps[:-1]:
        _check_launch(step, (LANES, chunks, 1))  # records position j and copies row j + 1
    _check_launch(steps[-1], (LANES, 1, 1))  # the last position copies nothing
    # One specialization of each kernel serves every position (the step kernel has two: with and
    # without the next row's copy); the positions differ in addresses only.
    assert len({launch.module for launch in launches}) == 6
    # Position j's draw reads row j of the flag and counter workspaces, 16-byte aligned.
    for position, first in enumerate(i for i, s in enumerate(symbols) if s == "_sample_chunk_kernel"):
        chunk = launches[first]
        named = {p.buffer: p.byte_offset for p in chunk.params if p.buffer.startswith("workspace.verify")}
        assert named["workspace.verify.logits"] == 0
        assert named["workspace.verify.active"] == position * speculative.ROW_ALIGN
        finish = launches[first + 2]
        offsets = {p.buffer: p.byte_offset for p in finish.params if p.buffer.startswith("workspace.verify")}
        assert offsets["workspace.verify.steps"] == position * speculative.ROW_ALIGN * 8
        assert offsets["workspace.verify.ids"] == position * speculative.ROW_ALIGN * 4
    written = {p.buffer for launch in launches for p in launch.params if p.buffer}
    assert {"logits", "output_counts", "ids", "accepted", "emitted", "pending", "candidate_ids"} <= written
    workspaces = {b.name: b for b in context.manifest.buffers if b.name.startswith("workspace.verify")}
    assert int(workspaces["workspace.verify.logits"].shape[0].size) == LANES * VOCAB
    assert workspaces["workspace.verify.active"].dtype == mf.DTYPE_U8


@pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels
def test_constrained_verification_hands_each_position_its_mask_rows() -> None:
    """With the grammar inputs, every position's ``sample`` launches read the ``[B, words]`` mask workspace
    (which the begin and step launches fill from rows ``start_r + j``) and the node's own flags."""
    width, words = 4, VOCAB // 32
    arrays = {
        **_verify_arrays(width),
        "allowed_mask": np.zeros((LANES * width, words), np.int32),
        "constrained": np.ones(LANES, np.uint8),
    }
    context, launches = lower("sample_verify", arrays, {"vocab_limit": VOCAB})
    symbols = [launch.symbol for launch in launches]
    assert symbols == ["_verify_begin_kernel", *[*SAMPLE_SYMBOLS, "_verify_step_kernel"] * width]
    for launch in launches:
        named = {p.buffer for p in launch.params if p.buffer}
        if launch.symbol == "_sample_chunk_kernel":  # the masked logits: the workspace rows, the lanes' flags
            assert {"workspace.verify.allowed_mask", "constrained"} <= named
            assert "allowed_mask" not in named
        elif launch.symbol in ("_verify_begin_kernel", "_verify_step_kernel"):  # the row copies
            assert {"allowed_mask", "constrained", "workspace.verify.allowed_mask"} <= named
    workspaces = {b.name: b for b in context.manifest.buffers if b.name.startswith("workspace.verify")}
    mask_workspace = workspaces["workspace.verify.allowed_mask"]
    assert (int(mask_workspace.shape[0].size), mask_workspace.dtype) == (LANES * words, mf.DTYPE_I32)
    # without the grammar inputs no mask workspace is declared and the launches are the same kernels
    plain_context, plain = lower("sample_verify", _verify_arrays(width), {"vocab_limit": VOCAB})
    assert [launch.symbol for launch in plain] == symbols
    assert not any(b.name == "workspace.verify.allowed_mask" for b in plain_context.manifest.buffers)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"allowed_mask": np.zeros((8, VOCAB // 32), np.int32)}, "allowed_mask and constrained must be given"),
        (
            {"allowed_mask": np.zeros((7, VOCAB // 32), np.int32), "constrained": np.ones(LANES, np.uint8)},
            r"allowed_mask: expected \[>= 8, >= 1536\] words",
        ),
        (
            {"allowed_mask": np.zeros((8, VOCAB // 32), np.float32), "constrained": np.ones(LANES, np.uint8)},
            "allowed_mask: dtype",
        ),
        (
            {"allowed_mask": np.zeros((8, VOCAB // 32), np.int32), "constrained": np.ones(LANES + 1, np.uint8)},
            "constrained: expected 2 elements",
        ),
    ],
)
def test_sample_verify_rejects_bad_grammar_inputs(change: dict[str, Any], message: str) -> None:
    arrays = {**_verify_arrays(4), **change}
    with pytest.raises(LoweringError, match=message):
        lower("sample_verify", arrays, {"vocab_limit": VOCAB})


@pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels
def test_width_one_runs_one_position_without_candidates() -> None:
    _, launches = lower("sample_verify", _verify_arrays(1), {"vocab_limit": VOCAB})
    assert [launch.symbol for launch in launches] == ["_verify_begin_kernel", *SAMPLE_SYMBOLS, "_verify_step_kernel"]


@pytest.mark.parametrize(
    ("change", "attributes", "message"),
    [
        ({"ids": np.zeros((LANES, 2), np.int32)}, {"vocab_limit": VOCAB}, "ids: expected"),
        ({"candidate_ids": np.zeros((LANES + 1, 3), np.int32)}, {"vocab_limit": VOCAB}, "candidate_ids"),
        ({"logits": np.zeros((8, VOCAB), np.int32)}, {"vocab_limit": VOCAB}, "logits: dtype"),
        ({"logprob": np.zeros((LANES, 3), np.float32)}, {"vocab_limit": VOCAB}, "logprob: expected"),
        ({"accepted": np.zeros(LANES + 1, np.int32)}, {"vocab_limit": VOCAB}, "accepted: expected"),
        ({}, {"vocab_limit": VOCAB + 1}, "vocab_limit"),
    ],
)
def test_sample_verify_rejects_bad_nodes(change: dict[str, Any], attributes: dict[str, Any], message: str) -> None:
    arrays = _verify_arrays(4)
    arrays.update(change)
    with pytest.raises(LoweringError, match=message):
        lower("sample_verify", arrays, attributes)


@pytest.mark.parametrize("capacity", [0, 3, 7])
def test_speculative_inputs_is_one_program(capacity: int) -> None:
    lanes = 64
    arrays = {
        "pending_tokens": np.zeros((9, 1), np.int32),
        "rows": np.zeros(lanes, np.int32),
        "candidate_ids": np.zeros((lanes, capacity), np.int32),
        "query_length": np.zeros(lanes, np.int32),
        "ids": np.zeros(lanes * (capacity + 1), np.int32),
    }
    _, launches = lower("speculative_inputs", arrays)
    assert [launch.symbol for launch in launches] == ["_speculative_inputs_kernel"]
    _check_launch(launches[0], (1, 1, 1))
    arrays["pending_tokens"] = np.zeros((9, 2), np.int32)
    with pytest.raises(LoweringError, match="pending_tokens"):
        lower("speculative_inputs", arrays)


def _record_arrays(lanes: int, packed: int) -> dict[str, Any]:
    arrays = {
        name: np.zeros(lanes, np.int32)
        for name in ("generation", "query_length", "accepted", "emitted", *speculative._RECORD_OUTPUTS)
    }
    arrays["positions"] = np.zeros(packed, np.int32)
    arrays["submission_sequence"] = np.zeros(1, np.int64)
    arrays["out_sequence"] = np.zeros(1, np.int64)
    return arrays


def test_completion_speculative_is_one_program() -> None:
    _, launches = lower("completion_speculative", _record_arrays(8, 32))
    assert [launch.symbol for launch in launches] == ["_completion_speculative_kernel"]
    _check_launch(launches[0], (1, 1, 1))
    named = [p.buffer for p in launches[0].params if p.buffer]
    assert named[:6] == ["generation", "query_length", "accepted", "emitted", "positions", "submission_sequence"]
    assert named[6:14] == [*speculative._RECORD_OUTPUTS, "out_sequence"]
    arrays = _record_arrays(8, 32)
    arrays["out_offers"] = np.zeros(7, np.int32)
    with pytest.raises(LoweringError, match="out_offers"):
        lower("completion_speculative", arrays)
