"""GPU tests: skipped unless a CUDA driver and device are present.

Run them on a machine with an NVIDIA GPU with ``python -m pytest -q tests/gpu`` (see
``docs/gpu.md``). Every test here compares the GPU against the reference backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helios_core.backends.cuda_driver import Context, cuda_available
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.runtime.startup import RunningModel

from .harness import start_core


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and its driver")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_context() -> Iterator[Context]:
    context = Context(0)
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
