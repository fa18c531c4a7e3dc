"""The sampling operators lower to sm_90a launches on a machine without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels import sampling
from ignition.kernels.lowering import LoweringContext, LoweringError

from helios_core.wire import manifest_pb2 as mf
from tests.gpu.harness import lower, one_node_manifest

pytestmark = pytest.mark.kernels  # minutes of Triton compilation: tox -e kernels

VOCAB = 49152


def _sample_arrays(rows: int, vocab: int, *, state_rows: int, mask: bool = True, top_n: int = 5) -> dict[str, Any]:
    arrays: dict[str, Any] = {
        "logits": np.zeros((rows, vocab), np.float32),
        "temperature": np.ones(rows, np.float32),
        "top_k": np.zeros(rows, np.int32),
        "top_p": np.ones(rows, np.float32),
        "min_p": np.zeros(rows, np.float32),
        "repetition_penalty": np.ones(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32),
        "presence_penalty": np.zeros(rows, np.float32),
        "prompt_presence": np.zeros((state_rows, vocab), np.uint8),
        "output_counts": np.zeros((state_rows, vocab), np.int32),
        "rows": np.arange(rows, dtype=np.int32),
        "seed": np.zeros(rows, np.uint64),
        "step": np.zeros(rows, np.int64),
        "active": np.ones(rows, np.uint8),
        "ids": np.zeros((rows, 1), np.int32),
        "logprob": np.zeros((rows, 1), np.float32),
        "top_ids": np.zeros((rows, top_n), np.int32),
        "top_logprobs": np.zeros((rows, top_n), np.float32),
    }
    if mask:
        arrays["allowed_mask"] = np.zeros((rows, -(-vocab // 32)), np.int32)
        arrays["constrained"] = np.zeros(rows, np.uint8)
    return arrays


def _check_launch(launch: mf.KernelLaunch, grid: tuple[int, int, int], params: int) -> None:
    assert launch.target == "sm_90a"
    assert tuple(launch.grid) == grid
    assert launch.block[0] in (128, 256) and tuple(launch.block[1:]) == (1, 1)
    assert launch.programmatic_wait
    assert 0 <= launch.shared_bytes <= 227 * 1024
    assert len(launch.params) >= params  # the kernel's own parameters, then compiler scratch
    assert all(p.kind == mf.PARAM_KIND_ADDRESS for p in launch.params)


@pytest.mark.parametrize("rows", [1, 64])
def test_sample_lowers_to_four_launches(rows: int) -> None:
    context, launches = lower(
        "sample", _sample_arrays(rows, VOCAB, state_rows=rows + 3), {"vocab_limit": VOCAB - 7, "top_n": 5}
    )
    programs = {1: -(-VOCAB // sampling.CHUNK), 64: 17}[rows]  # every chunk its own program; ~8 a multiprocessor
    assert [launch.symbol for launch in launches] == [
        "_sample_chunk_kernel",
        "_sample_top_kernel",
        "_sample_weight_kernel",
        "_sample_finish_kernel",
    ]
    _check_launch(launches[0], (rows, programs, 1), 15)
    _check_launch(launches[1], (rows, programs, 1), 14)
    _check_launch(launches[2], (rows, programs, 1), 10)
    _check_launch(launches[3], (rows, 1, 1), 26)
    assert all(module.data for module in context.modules.values())
    workspaces = {b.name for b in context.manifest.buffers if b.name.startswith("workspace.")}
    assert "workspace.sample.processed" in workspaces and "workspace.sample.weights" in workspaces
    named = {p.buffer for launch in launches for p in launch.params if p.buffer}
    assert {"logits", "output_counts", "ids", "top_ids", "top_logprobs"} <= named


def test_sample_never_compiles_in_the_state_rows() -> None:
    attributes = {"vocab_limit": VOCAB, "top_n": 5}
    few, launches_few = lower("sample", _sample_arrays(4, VOCAB, state_rows=5), attributes)
    many, launches_many = lower("sample", _sample_arrays(4, VOCAB, state_rows=900), attributes)
    assert [launch.module for launch in launches_few] == [launch.module for launch in launches_many]
    assert sorted(few.modules) == sorted(many.modules)


def test_sample_without_optional_arguments() -> None:
    arrays = _sample_arrays(2, VOCAB, state_rows=2, mask=False)
    for name in ("logprob", "top_ids", "top_logprobs"):
        del arrays[name]
    _, launches = lower("sample", arrays, {"vocab_limit": VOCAB})
    assert len(launches) == 3
    named = {p.buffer for launch in launches for p in launch.params if p.buffer}
    assert "allowed_mask" not in named and "top_ids" not in named


@pytest.mark.parametrize(
    ("change", "attributes", "message"),
    [
        ({}, {"vocab_limit": VOCAB + 1}, "vocab_limit"),
        ({}, {"vocab_limit": VOCAB, "top_n": sampling.MAX_TOP_N + 1}, "top_n"),
        ({"top_ids": np.zeros((2, 3), np.int32)}, {"vocab_limit": VOCAB, "top_n": 5}, "top_ids"),
        ({"output_counts": np.zeros((4, VOCAB - 1), np.int32)}, {"vocab_limit": VOCAB}, "output_counts"),
        ({"temperature": np.ones(3, np.float32)}, {"vocab_limit": VOCAB}, "temperature"),
        ({"constrained": None}, {"vocab_limit": VOCAB}, "given together"),
        ({"allowed_mask": np.zeros((2, 7), np.int32)}, {"vocab_limit": VOCAB}, "allowed_mask"),
    ],
)
def test_sample_rejects_bad_nodes(change: dict[str, Any], attributes: dict[str, Any], message: str) -> None:
    arrays = _sample_arrays(2, VOCAB, state_rows=4)
    for name, value in change.items():
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    with pytest.raises(LoweringError, match=message):
        lower("sample", arrays, attributes)


def test_sample_takes_a_given_layout() -> None:
    """A layout names the chunk, the programs a row (never more than its chunks) and the warps."""
    arrays = _sample_arrays(4, VOCAB, state_rows=5)
    attributes = {"vocab_limit": VOCAB, "top_n": 5}
    manifest, node = one_node_manifest("sample", arrays, attributes)
    context = LoweringContext(manifest, "sm_90a", program="test", node="sample")
    launches = sampling.lower_sample(context, node, sampling.SampleLayout(chunk=4096, programs=5, warps=8))
    assert tuple(launches[0].grid) == (4, 5, 1) and tuple(launches[0].block) == (256, 1, 1)
    assert [tuple(launch.grid) for launch in launches[1:]] == [(4, 5, 1), (4, 5, 1), (4, 1, 1)]
    context = LoweringContext(manifest, "sm_90a", program="test", node="sample")
    launches = sampling.lower_sample(context, node, sampling.SampleLayout(chunk=8192, programs=100, warps=4))
    assert tuple(launches[0].grid) == (4, 6, 1) and tuple(launches[0].block) == (128, 1, 1)  # 6 chunks of 8192
    for bad in (sampling.SampleLayout(3000, 4, 4), sampling.SampleLayout(2048, 0, 4)):
        context = LoweringContext(manifest, "sm_90a", program="test", node="sample")
        with pytest.raises(LoweringError, match="sample layout"):
            sampling.lower_sample(context, node, bad)


@pytest.mark.parametrize("rows", [1, 64])
def test_apply_grammar_mask_lowers(rows: int) -> None:
    arrays = {
        "logits": np.zeros((rows, VOCAB), np.float32),
        "allowed_mask": np.zeros((rows, VOCAB // 32), np.int32),
        "constrained": np.zeros(rows, np.uint8),
        "out": np.zeros((rows, VOCAB), np.float32),
    }
    _, launches = lower("apply_grammar_mask", arrays)
    assert len(launches) == 1
    _check_launch(launches[0], (rows, -(-VOCAB // sampling.MASK_BLOCK), 1), 4)


@pytest.mark.parametrize("rows", [1, 64])
def test_log_softmax_gather_lowers(rows: int) -> None:
    arrays = {
        "logits": np.zeros((rows, VOCAB), np.float32),
        "targets": np.zeros(rows, np.int32),
        "out": np.zeros(rows, np.float32),
    }
    _, launches = lower("log_softmax_gather", arrays, {"vocab_limit": VOCAB - 3})
    assert len(launches) == 1
    _check_launch(launches[0], (rows, 1, 1), 3)
    with pytest.raises(LoweringError, match="vocab_limit"):
        lower("log_softmax_gather", arrays, {"vocab_limit": 0})
