"""Fixtures shared by every test package: the SmolLM2-135M core, built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SMOL_NAMESPACE = "helios-tests/smollm2"


@pytest.fixture(scope="session")
def smol_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A signed SmolLM2-135M core (8 active requests, a 512-token context) and its public key."""
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
