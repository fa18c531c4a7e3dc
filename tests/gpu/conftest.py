"""GPU tests: skipped unless a CUDA driver and device are present.

Run them on a machine with an NVIDIA GPU with ``python -m pytest -q tests/gpu`` (see
``docs/gpu.md``). Every test here compares the GPU against the reference backend.

With ``HELIOS_GPU_TESTS_COMPILE_ONLY=1`` the tests run without a GPU as far as their first use of the
device: the kernels they lower and the cores they build are compiled (into ``IGNITION_KERNEL_CACHE``
when it names a folder), and a test that reaches the device is reported skipped. A machine without a
GPU so compiles the suite's kernels ahead, for the GPU machine to read from the carried cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from helios_core.backends.cuda_driver import Context, CudaError, CudaUnavailableError, cuda_available
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.runtime.startup import RunningModel

from .harness import COMPILE_ONLY, start_core


class CompileOnlyContext:
    """The CUDA context of a compile-only run: the architecture the kernels are built for, and any use of
    the device raises :class:`CudaUnavailableError` (the test is then reported skipped)."""

    architecture = "sm_90a"

    def __getattr__(self, name: str) -> Any:
        raise CudaUnavailableError(f"Context.{name} needs the GPU")

    def close(self) -> None:
        pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available() or COMPILE_ONLY:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and its driver")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In a compile-only run, a test (or its fixture) that reached the device is skipped, not failed."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not COMPILE_ONLY or call.excinfo is None:
        return
    error: BaseException | None = call.excinfo.value
    while error is not None and not isinstance(error, CudaError):  # a startup error names its cause
        error = error.__cause__
    if error is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: compile only: {error}")


@pytest.fixture(scope="session")
def cuda_context() -> Iterator[Context]:
    context = cast(Context, CompileOnlyContext()) if COMPILE_ONLY else Context(0)
    yield context
    context.close()


@pytest.fixture(scope="module")
def verified(gpu_core: tuple[Any, ...]) -> Iterator[VerifiedCore]:
    """The module's ``gpu_core`` (its path and trust settings first) opened once, without the resource check."""
    core = open_core(gpu_core[0], gpu_core[1], check_resources=False)
    yield core
    core.close()


@pytest.fixture(scope="module")
def reference_running(gpu_core: tuple[Path, TrustSettings]) -> Iterator[RunningModel]:
    """The module's ``gpu_core`` served on the reference backend (``start_core``'s defaults), once a module;
    a module that needs other settings defines its own."""
    running = start_core(gpu_core, "reference")
    yield running
    running.close()
