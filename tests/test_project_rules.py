"""Project-wide rules: no model-family names or assert-validation in the serving core."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODEL_FAMILY_NAMES = re.compile(
    r"llama|qwen|glm|deepseek|mistral|mixtral|gemma|smollm|gpt-?oss|kimi|falcon|baichuan|internlm|minicpm|"
    r"\bphi-?\d|\bopt-\d|harmony",
    re.IGNORECASE,
)


def _core_sources() -> list[Path]:
    return [p for p in (ROOT / "helios_core").rglob("*.py") if "_pb2" not in p.name]


def test_serving_core_names_no_model_family() -> None:
    offenders = []
    for path in _core_sources():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if MODEL_FAMILY_NAMES.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_name_check_catches_a_family_name() -> None:
    assert MODEL_FAMILY_NAMES.search("if model == 'Qwen3':")
    assert not MODEL_FAMILY_NAMES.search("paged attention over page tables")


def test_no_assert_statements_in_library_code() -> None:
    offenders = []
    for package in ("helios_core", "helios_plugins"):
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if re.match(r"\s*assert\b", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}")
    assert offenders == []


def test_every_library_module_starts_with_a_docstring() -> None:
    import ast

    missing = []
    for package in ("helios_core", "helios_plugins", "contrib/ignition/ignition"):
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if not ast.get_docstring(tree):
                missing.append(str(path.relative_to(ROOT)))
    assert missing == []
