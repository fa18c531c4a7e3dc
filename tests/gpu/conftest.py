"""GPU tests: skipped unless a CUDA driver and device are present.

Run them on a machine with an NVIDIA GPU with ``python -m pytest -q tests/gpu`` (see
``docs/gpu.md``). Every test here compares the GPU against the reference backend.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helios_core.backends.cuda_driver import Context, cuda_available


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
