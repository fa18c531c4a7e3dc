"""Fixtures shared by the lowering tests of ``tests/ignition``."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def launched_constants(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The compile-time constants of every launch lowered while the test runs, in order."""
    from ignition.kernels.lowering import LoweringContext

    seen: list[dict[str, Any]] = []
    original = LoweringContext.launch

    def launch(self: LoweringContext, fn: Any, args: Any, constants: Any, grid: Any, **options: Any) -> Any:
        seen.append(dict(constants))
        return original(self, fn, args, constants, grid, **options)

    monkeypatch.setattr(LoweringContext, "launch", launch)
    return seen
