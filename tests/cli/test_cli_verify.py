"""``helios verify``, ``helios inspect`` and ``helios keys`` on the golden fixtures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helios_core.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
KEYS = FIXTURES / "keys"
NAMESPACE = "helios-fixtures/golden"
CORES = [
    "payload-v3",
    "contract-v2",
    "contract-v1",
    "logical-v6",
    "logical-v4",
    "abi-label",
    "sliding-window",
    "recurrent-tiny",
    "latent-tiny",
]
PROGRAMS = {"recurrent-tiny": 10}
"""Programs of a fixture other than the tiny Llama's 8 (the recurrent core adds snapshot and restore)."""


def verify(core: Path, *, key: Path = KEYS / "signing.pub.pem", accept: str = NAMESPACE) -> list[str]:
    return ["verify", str(core), "--trust-key", str(key), "--accept", accept, "--core-key", str(KEYS / "core.key")]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", CORES)
def test_verify_accepts_each_fixture(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(verify(FIXTURES / f"{name}.core"), capsys)
    assert (code, err) == (0, "")
    assert out.count("\n") == 1
    assert out.startswith(f"OK {FIXTURES / name}.core: namespace 'helios-fixtures/golden'")
    assert f"{PROGRAMS.get(name, 8)} programs" in out


def _assert_one_line_failure(code: int, out: str, err: str) -> None:
    assert code == 1
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("helios verify: error: ")
    assert "Traceback" not in err


def test_verify_rejects_a_key_that_did_not_sign(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    code, out, err = run(verify(FIXTURES / "payload-v3.core", key=tmp_path / "other" / "signing.pub.pem"), capsys)
    _assert_one_line_failure(code, out, err)
    assert "no trusted key" in err.lower() or "not signed by a trusted key" in err.lower()


@pytest.mark.parametrize(
    "acceptance",
    [
        "Helios-fixtures/golden",
        "HELIOS-FIXTURES/GOLDEN",
        " helios-fixtures/golden",
        "helios-fixtures/golden ",
        "helios-fixtures/golden\n",
        "helios-fixtures/ golden",
        "",
    ],
)
def test_verify_rejects_a_namespace_differing_by_case_or_whitespace(
    acceptance: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(verify(FIXTURES / "payload-v3.core", accept=acceptance), capsys)
    _assert_one_line_failure(code, out, err)
    assert "acceptance" in err


def _copy(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    target = tmp_path / f"{name}.core"
    shutil.copyfile(FIXTURES / f"{name}.core", target)
    return target, target.read_bytes()


@pytest.mark.parametrize("name", ["payload-v3", "logical-v6", "logical-v4"])
def test_verify_rejects_a_flipped_byte_anywhere(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, original = _copy(tmp_path, name)
    positions = sorted(set(range(0, 64)) | set(range(64, len(original), 389)) | {len(original) - 1})
    accepted = []
    for position in positions:
        mutated = bytearray(original)
        mutated[position] ^= 0x5A
        target.write_bytes(mutated)
        code, out, err = run(verify(target), capsys)
        if code != 1 or out or err.count("\n") != 1 or "Traceback" in err:
            accepted.append((position, code, out, err))
    assert accepted == []


@pytest.mark.parametrize("name", ["payload-v3", "logical-v4"])
def test_verify_rejects_truncation_at_any_point(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, original = _copy(tmp_path, name)
    for cut in sorted({0, 1, 7, 8, 15, 16, 17, *range(0, len(original), len(original) // 60), len(original) - 1}):
        target.write_bytes(original[:cut])
        code, out, err = run(verify(target), capsys)
        _assert_one_line_failure(code, out, err)


@pytest.mark.parametrize("extra", [b"\0", b"trailing", b"\x28\xb5\x2f\xfd" + b"\0" * 64])
def test_verify_rejects_trailing_bytes(extra: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, original = _copy(tmp_path, "payload-v3")
    target.write_bytes(original + extra)
    code, out, err = run(verify(target), capsys)
    _assert_one_line_failure(code, out, err)
    assert "trailing" in err


def test_verify_without_trust_configuration_says_what_to_pass(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HELIOS_TRUST_KEYS", raising=False)
    code, out, err = run(["verify", str(FIXTURES / "payload-v3.core"), "--accept", NAMESPACE], capsys)
    _assert_one_line_failure(code, out, err)
    assert "--trust-key" in err


def test_trust_configuration_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HELIOS_TRUST_KEYS", str(KEYS / "signing.pub.pem"))
    monkeypatch.setenv("HELIOS_ACCEPT", NAMESPACE)
    monkeypatch.setenv("HELIOS_CORE_KEY", str(KEYS / "core.key"))
    code, out, _ = run(["verify", str(FIXTURES / "logical-v4.core")], capsys)
    assert code == 0 and out.startswith("OK ")


def test_v4_core_without_its_core_key_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "verify",
        str(FIXTURES / "logical-v4.core"),
        "--trust-key",
        str(KEYS / "signing.pub.pem"),
        "--accept",
        NAMESPACE,
    ]
    code, out, err = run(args, capsys)
    _assert_one_line_failure(code, out, err)
    assert "core key" in err


def test_v4_core_with_a_wrong_core_key_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong.key"
    wrong.write_text("11" * 32 + "\n")
    args = verify(FIXTURES / "logical-v4.core")
    args[-1] = str(wrong)
    code, out, err = run(args, capsys)
    _assert_one_line_failure(code, out, err)


def test_inspect_json_describes_the_core(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["inspect", str(FIXTURES / "payload-v3.core"), "--json", "--trust-key", str(KEYS / "signing.pub.pem")], capsys
    )
    assert code == 0
    info = json.loads(out)
    assert info["signature"] == "verified"
    assert info["publisher_namespace"] == NAMESPACE
    assert info["versions"] == {
        "payload_format": 2,
        "layout": "payload",
        "contract": 3,
        "execution_abi": "helios-exec-1",
    }
    assert info["vocabulary"] == {"sampled_size": 259, "logits_width": 320, "input_size": 259}
    assert info["capacities"]["max_concurrency"] == 4
    names = {g["name"]: g for g in info["graphs"]}
    assert set(names) == {
        "initialize",
        "prefill_p16",
        "mixed_p16",
        "resume_p16",
        "scored_prefill_p16",
        "decode_b1",
        "decode_b2",
        "decode_b4",
    }
    assert names["decode_b4"]["operation"] == "decode" and names["decode_b4"]["batch_capacity"] == 4
    assert names["prefill_p16"]["packed_token_capacity"] == 16
    kinds = {r["id"]: r["kind"] for r in info["resources"]}
    assert kinds["tokenizer"] == "tokenizer" and kinds["chat_template"] == "chat_template"
    assert info["frontend"]["tool_parser"] == "TOOL_PARSER_NONE"


def test_inspect_names_a_vision_cores_image_capacities(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["inspect", str(FIXTURES / "vision-tiles.core"), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["images"] == {
        "features_per_image": 16,
        "features_per_request": 64,
        "patches_per_feature": 1,
        "patch_capacities": [16, 64],
    }
    code, out, _ = run(["inspect", str(FIXTURES / "vision-tiles.core")], capsys)
    assert code == 0
    assert (
        "images          up to 16 features an image, 64 a request (patches per feature 1, patch capacities [16, 64])"
        in out
    )
    code, out, _ = run(["inspect", str(FIXTURES / "payload-v3.core"), "--json"], capsys)
    assert json.loads(out)["images"] is None  # a text-only core
    code, out, _ = run(["inspect", str(FIXTURES / "payload-v3.core")], capsys)
    assert "images " not in out


def test_inspect_names_third_party_selections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ignition.cli import main as ignition_main

    core = tmp_path / "third-party.core"
    assert ignition_main(
        ["build", "llama-synthetic", "--out", str(core), "--quiet", "--tool-syntax", "json-tags",
         "--tool-parser", "100042", "--reasoning-parser", "100043"]
    ) == 0  # fmt: skip
    capsys.readouterr()
    code, out, _ = run(["inspect", str(core)], capsys)
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("frontend "))
    assert "tool_parser=100042" in line and "reasoning_parser=100043" in line
    assert "image_layout=IMAGE_LAYOUT_NONE" in line


def test_inspect_without_keys_marks_the_signature_unchecked(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["inspect", str(FIXTURES / "abi-label.core")], capsys)
    assert code == 0
    assert "not checked" in out
    assert "execution ABI 'helios-exec-99-unfamiliar'" in out


def test_keys_generate_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "key id" in out
    code, _, err = run(["keys", "generate", "--out", str(tmp_path)], capsys)
    assert code == 1 and err.startswith("helios keys: error:")


def test_console_script_prints_no_traceback(tmp_path: Path) -> None:
    broken = tmp_path / "broken.core"
    broken.write_bytes(b"not a core at all")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "helios_core.cli", *verify(broken)], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_trust_key_bundle_trusts_each_of_its_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helios_core.container.keys import generate_keys

    other = generate_keys(tmp_path / "other")
    publisher = (KEYS / "signing.pub.pem").read_bytes()
    for order in ([other["public"].read_bytes(), publisher], [publisher, other["public"].read_bytes()]):
        bundle = tmp_path / "bundle.pem"
        bundle.write_bytes(b"".join(order))
        code, out, err = run(verify(FIXTURES / "payload-v3.core", key=bundle), capsys)
        assert (code, err) == (0, ""), err
        assert out.startswith("OK ")
    bundle.write_bytes(publisher + other["signing"].read_bytes())
    code, _, err = run(verify(FIXTURES / "payload-v3.core", key=bundle), capsys)
    assert code == 1
    assert f"'{bundle} (PEM block 2 of 2)' is not a PEM public key" in err
