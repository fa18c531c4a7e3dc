"""Shared fixtures of the runtime tests: golden fixture cores, trust settings, an engine factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.startup import RunningModel, start

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"
SMOL_NAMESPACE = "helios-tests/smollm2"


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


@pytest.fixture(scope="session")
def smol_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    from ignition.cli import main as ignition_main

    from helios_core.container.keys import generate_keys

    directory = tmp_path_factory.mktemp("smollm2")
    keys = generate_keys(directory / "keys")
    core = directory / "smol.core"
    code = ignition_main(
        [
            "build", "smollm2-135m-instruct", "--out", str(core), "--sign-key", str(keys["signing"]),
            "--namespace", SMOL_NAMESPACE, "--max-rows", "8", "--prefill-tokens", "16,64", "--context", "512",
            "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    yield core, keys["public"]


@pytest.fixture(scope="session")
def smol_running(smol_core: tuple[Path, Path]) -> Iterator[RunningModel]:
    """The SmolLM2 core started once for the session (reference backend, 8 active requests)."""
    core, key = smol_core
    running = start(core, TrustSettings((key,), SMOL_NAMESPACE, None), LoadOptions(), backend="reference")
    yield running
    running.close()
