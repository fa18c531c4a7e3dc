"""Helpers of the tests that run ``ignition build`` through its command line: a build and a refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from ignition.cli import main as ignition_main


def build(out: Path | str, *extra: str, recipe: str = "llama-synthetic", key: Path | None = None) -> int:
    """``ignition build RECIPE --out OUT --quiet EXTRA... [--sign-key KEY]``; its exit code."""
    argv = ["build", recipe, "--out", str(out), "--quiet", *extra]
    if key is not None:
        argv += ["--sign-key", str(key)]
    return ignition_main(argv)


def refused(capsys: pytest.CaptureFixture[str], code: int, message: str) -> None:
    """The build exited 1 with ``message`` as its one error line and nothing on stdout."""
    assert code == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"ignition: error: {message}\n")
