"""The GPU suite on a machine without a GPU: it collects cleanly without Triton (its tests then skip), and
with ``HELIOS_GPU_TESTS_COMPILE_ONLY=1`` compiles its kernels into the kernel cache, each test reported
skipped where it first needs the device."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


RMSNORM_CASES = "tests/gpu/test_kernels_elementwise.py::test_rmsnorm"


def _run_gpu_tests(kernel_cache: Path, *, compile_only: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HELIOS_GPU_TESTS_COMPILE_ONLY", "CUDA_VISIBLE_DEVICES")}
    env["IGNITION_KERNEL_CACHE"] = str(kernel_cache)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no device, on any machine
    if compile_only:
        env["HELIOS_GPU_TESTS_COMPILE_ONLY"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", RMSNORM_CASES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_compile_only_run_fills_the_kernel_cache_and_skips_at_the_device(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    done = _run_gpu_tests(tmp_path / "compiled", compile_only=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^4 skipped in ", done.stdout.strip().splitlines()[-1]), done.stdout[-2000:]
    assert "compile only: Context.alloc needs the GPU" in done.stdout
    entries = sorted((tmp_path / "compiled").glob("triton-*/*.json"))
    assert entries, "no kernel was compiled"
    for entry in entries:  # every entry whole: its metadata and its cubin
        assert json.loads(entry.read_text())["symbol"] == "_rmsnorm_kernel"
        assert entry.with_suffix(".cubin").stat().st_size > 0

    # the same cases without the mode skip at collection and compile nothing
    plain = _run_gpu_tests(tmp_path / "plain", compile_only=False)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert "needs an NVIDIA GPU and its driver" in plain.stdout
    assert not list((tmp_path / "plain").glob("triton-*/*"))
