"""Fixtures of the frontend tests."""

from __future__ import annotations

from typing import Any

import pytest
from frontend_builders import SPECIAL

from helios_core.testing import byte_level_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return byte_level_tokenizer(SPECIAL)
