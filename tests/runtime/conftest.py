"""Shared fixtures of the runtime tests: golden fixture cores, trust settings, an engine factory and the
list of models a test starts, closed after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.startup import RunningModel, start
from tests.conftest import SMOL_NAMESPACE

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"


def fixture_settings() -> TrustSettings:
    return TrustSettings((KEYS / "signing.pub.pem",), NAMESPACE, KEYS / "core.key")


@pytest.fixture
def start_fixture() -> Iterator[Callable[..., RunningModel]]:
    """Start a golden fixture core by name; every started model is closed after the test."""
    running: list[RunningModel] = []

    def factory(name: str = "payload-v3", **options: int) -> RunningModel:
        model = start(FIXTURES / f"{name}.core", fixture_settings(), LoadOptions(**options), backend="reference")
        running.append(model)
        return model

    yield factory
    for model in running:
        model.close()


@pytest.fixture
def started() -> Iterator[list[RunningModel]]:
    """Models a test starts (``engine_harness.run`` adds them); each is closed after the test."""
    models: list[RunningModel] = []
    yield models
    for model in models:
        model.close()


@pytest.fixture(scope="session")
def smol_running(smol_core: tuple[Path, Path]) -> Iterator[RunningModel]:
    """The SmolLM2 core started once for the session (reference backend, 8 active requests)."""
    core, key = smol_core
    running = start(core, TrustSettings((key,), SMOL_NAMESPACE, None), LoadOptions(), backend="reference")
    yield running
    running.close()
