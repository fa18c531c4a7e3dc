"""The GPU suite collects cleanly on a machine without Triton or a GPU (its tests then skip)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run pytest's collection with every ``triton`` import failing, as on a machine without the package.
_WITHOUT_TRITON = """
import sys
import importlib.abc


class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
    del sys.modules[name]
sys.meta_path.insert(0, _NoTriton())
import pytest

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"]))
"""


def test_gpu_suite_collects_without_triton() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ tests collected in [\d.]+s", summary), summary
