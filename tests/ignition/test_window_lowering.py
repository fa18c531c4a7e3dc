"""Sliding-window ``paged_attention`` lowers to sm_90a launches on a machine without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("triton")

from ignition.kernels import lowering
from ignition.kernels.lowering import LoweringError

from tests.gpu.harness import lower

TOKENS, HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, TABLE_PAGES = 3, 4, 2, 8, 4, 64


def _arrays() -> dict[str, np.ndarray]:
    return {
        "q": np.zeros((TOKENS, HEADS, HEAD_DIM), np.float32),
        "k_plane": np.zeros((80, PAGE_TOKENS, KV_HEADS, HEAD_DIM), np.float32),
        "v_plane": np.zeros((80, PAGE_TOKENS, KV_HEADS, HEAD_DIM), np.float32),
        "page_table": np.zeros((2, TABLE_PAGES), np.int32),
        "token_row": np.zeros(TOKENS, np.int32),
        "token_position": np.zeros(TOKENS, np.int32),
        "out": np.zeros((TOKENS, HEADS, HEAD_DIM), np.float32),
    }


@pytest.fixture
def compiled_constants(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The constants of every kernel the lowering compiles (the real compiler still runs)."""
    seen: list[dict[str, Any]] = []
    real = lowering.compile_triton

    def recording(fn: Any, signature: Any, constants: Any, **options: Any) -> Any:
        seen.append(dict(constants))
        return real(fn, signature, constants, **options)

    monkeypatch.setattr(lowering, "compile_triton", recording)
    return seen


@pytest.mark.parametrize(
    ("window", "splits", "split"),
    [
        (0, 4, 64),  # 256 positions in 64-position splits
        (6, 1, 8),  # a window of 6 positions: one split of 8
        (100, 2, 64),  # at most 100 positions: two splits of 64
    ],
)
def test_the_attention_launch_carries_the_window_and_spans_only_its_splits(
    compiled_constants: list[dict[str, Any]], window: int, splits: int, split: int
) -> None:
    attributes = {"scale": 0.5, "window": window} if window else {"scale": 0.5}
    context, launches = lower("paged_attention", _arrays(), attributes)
    (launch,) = launches
    assert launch.symbol == "attention_split_kernel"
    assert launch.target == "sm_90a"
    assert tuple(launch.grid) == (TOKENS, KV_HEADS, splits)
    assert launch.programmatic_wait
    (constants,) = compiled_constants
    assert (constants["WINDOW"], constants["SPLITS"], constants["SPLIT"]) == (window, splits, split)
    assert constants["SHORT"] == max(split, min(64, window or TABLE_PAGES * PAGE_TOKENS))
    (module,) = context.modules.values()
    assert module.decl.target == "sm_90a"
    assert module.data[:4] == b"\x7fELF"  # a cubin
    workspace = {decl.name: int(decl.shape[0].size) for decl in context.manifest.buffers}
    assert workspace["workspace.attention_max"] == TOKENS * HEADS * splits


def test_windows_compile_to_distinct_kernels() -> None:
    modules = {lower("paged_attention", _arrays(), {"window": w})[1][0].module for w in (6, 7)}
    assert len(modules) == 2


@pytest.mark.parametrize("window", [-1, -64])
def test_a_negative_window_is_refused(window: int) -> None:
    with pytest.raises(LoweringError) as refused:
        lower("paged_attention", _arrays(), {"window": window})
    assert str(refused.value) == (
        f"program 'test' node 'paged_attention': window must be 0 (unlimited) or a positive integer, got {window}"
    )
