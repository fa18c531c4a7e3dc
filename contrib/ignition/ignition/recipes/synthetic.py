"""The ``llama-synthetic`` recipe: named Llama shapes with seeded random weights.

Owns the shape table (tiny shapes for tests, 135M/1B/8B-class shapes for GPU
benchmarks), the seeded weight generators and a small byte-level tokenizer
with a ChatML template, so synthetic cores exercise the whole serving path
without any downloaded artifact.

Weights of shapes up to ``PERIODIC_ABOVE`` parameters (tiny, small, 135m) are
one sequential stream of standard normals, drawn all at once; tests pin the
tokens of cores built from them, so that stream never changes. Larger shapes
(1b, 8b) get :class:`PeriodicWeights`: each tensor is made on demand from one
seeded pool of ``PERIOD`` normals, tiled from a seeded start offset and scaled,
so an 8B build never holds every float32 weight at once, spends no time on
billions of normal draws, and compresses to a small core (the bf16 period lies
inside the zstd window). Timing does not depend on the values; the period is
coprime with every row length, so rows are distinct shifts of the pool. The
sequential stream and its first tensors (:func:`seeded_normal`,
:func:`embedding_and_head_weights`, :func:`norm_gain`) also serve the
``recurrent-synthetic`` and ``latent-synthetic`` recipes, as does the tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from helios_core.wire import contract_pb2 as ct
from ignition.preparation import frontend as frontend_declarations
from ignition.recipes.llama import LlamaShape, tensor_names

if TYPE_CHECKING:
    from ignition.build import TextModelDeclaration

SHAPES: dict[str, LlamaShape] = {
    "tiny": LlamaShape(
        vocab=320, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=64, rope_theta=10000.0, rms_eps=1e-5
    ),
    "tiny-llama3": LlamaShape(
        vocab=320,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=8,
        ffn=64,
        rope_theta=500000.0,
        rms_eps=1e-5,
        frequency_band_scaling=(8.0, 1.0, 4.0, 64),
    ),
    "small": LlamaShape(
        vocab=512, hidden=128, layers=4, heads=8, kv_heads=4, head_dim=16, ffn=384, rope_theta=10000.0, rms_eps=1e-5
    ),
    "135m": LlamaShape(
        vocab=49152,
        hidden=576,
        layers=30,
        heads=9,
        kv_heads=3,
        head_dim=64,
        ffn=1536,
        rope_theta=100000.0,
        rms_eps=1e-5,
    ),
    "1b": LlamaShape(
        vocab=128256,
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        head_dim=64,
        ffn=8192,
        rope_theta=500000.0,
        rms_eps=1e-5,
        frequency_band_scaling=(32.0, 1.0, 4.0, 8192),
    ),
    "8b": LlamaShape(
        vocab=128256,
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffn=14336,
        rope_theta=500000.0,
        rms_eps=1e-5,
        frequency_band_scaling=(8.0, 1.0, 4.0, 8192),
    ),
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SyntheticTokenizer:
    """A tokenizer.json and the ids of its special tokens."""

    json: str
    vocab_size: int
    special_ids: dict[str, int]

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end generation: ChatML's ``<|im_end|>``, then ``<|endoftext|>``."""
        return [self.special_ids["<|im_end|>"], self.special_ids["<|endoftext|>"]]


def byte_level_tokenizer(extra_special: tuple[str, ...] = ()) -> SyntheticTokenizer:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens, then special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    specials = (*SPECIAL_TOKENS, *extra_special)
    tokenizer.add_special_tokens(list(specials))
    ids: dict[str, int] = {}
    for token in specials:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} did not register")
        ids[token] = token_id
    return SyntheticTokenizer(json=tokenizer.to_str(), vocab_size=tokenizer.get_vocab_size(), special_ids=ids)


def _byte_of(symbol: str) -> int:
    """The byte a ByteLevel alphabet symbol stands for (GPT-2 byte-to-unicode table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    inverse = {chr(code): b for b, code in table.items()}
    return inverse[symbol]


PERIODIC_ABOVE = 500_000_000
"""Shapes with more parameters than this get :class:`PeriodicWeights` (1b and 8b; not 135m and smaller)."""

PERIOD = 524_287
"""Values in the pool of :class:`PeriodicWeights` (the prime 2**19 - 1): about 1 MiB of bf16, inside the
2 MiB window of zstd level 3, and coprime with every row length."""


class NormalDraw(Protocol):
    """``normal(*dims, scale=s)``: the next ``dims`` standard normals of a seeded stream, times ``s``."""

    def __call__(self, *dims: int, scale: float) -> npt.NDArray[np.float32]: ...


def seeded_normal(seed: int) -> NormalDraw:
    """One sequential stream of float32 standard normals from ``numpy.random.default_rng(seed)``; each
    call draws the next block (the synthetic recipes draw their tensors in a fixed order from one)."""
    rng = np.random.default_rng(seed)

    def normal(*dims: int, scale: float) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    return normal


def norm_gain(normal: NormalDraw, width: int) -> npt.NDArray[np.float32]:
    """An RMSNorm gain of ``width`` values near one (1 + 0.05 x a standard normal)."""
    return (1.0 + normal(width, scale=0.05)).astype(np.float32)


def embedding_and_head_weights(normal: NormalDraw, vocab: int, hidden: int) -> dict[str, npt.NDArray[np.float32]]:
    """The first tensors a synthetic recipe draws: token embedding, final norm gain and LM head."""
    return {
        "token_embd.weight": normal(vocab, hidden, scale=1.0),
        "output_norm.weight": norm_gain(normal, hidden),
        "output.weight": normal(vocab, hidden, scale=hidden**-0.5),
    }


def random_weights(shape: LlamaShape, seed: int) -> Mapping[str, npt.NDArray[np.float32]]:
    """Seeded random weights with scales that keep activations well conditioned.

    Shapes above ``PERIODIC_ABOVE`` parameters get :class:`PeriodicWeights` (made per tensor on
    access); smaller shapes get a dict drawn from one sequential stream, unchanged since tests pin it.
    """
    if shape.parameter_count() > PERIODIC_ABOVE:
        return PeriodicWeights(shape, seed)
    normal = seeded_normal(seed)
    h, hd = shape.hidden, shape.head_dim
    weights = embedding_and_head_weights(normal, shape.vocab, h)
    for layer in range(shape.layers):
        names = tensor_names(layer)
        weights[names["attn_norm"]] = norm_gain(normal, h)
        weights[names["ffn_norm"]] = norm_gain(normal, h)
        weights[names["wq"]] = normal(shape.heads * hd, h, scale=h**-0.5)
        weights[names["wk"]] = normal(shape.kv_heads * hd, h, scale=h**-0.5)
        weights[names["wv"]] = normal(shape.kv_heads * hd, h, scale=h**-0.5)
        weights[names["wo"]] = normal(h, shape.heads * hd, scale=(shape.heads * hd) ** -0.5)
        weights[names["w_gate"]] = normal(shape.ffn, h, scale=h**-0.5)
        weights[names["w_up"]] = normal(shape.ffn, h, scale=h**-0.5)
        weights[names["w_down"]] = normal(h, shape.ffn, scale=shape.ffn**-0.5)
    return weights


@dataclass(frozen=True)
class _TensorRecipe:
    """How one periodic tensor is made: ``offset + scale * pool[(start + i) % PERIOD]``, reshaped."""

    dims: tuple[int, ...]
    scale: float
    offset: float
    start: int


class PeriodicWeights(Mapping[str, npt.NDArray[np.float32]]):
    """Seeded weights of a large shape, each tensor made on access (nothing is kept between accesses).

    One pool of ``PERIOD`` float32 standard normals comes from ``numpy.random.default_rng(seed)``,
    then one start offset per tensor in the order of :func:`random_weights`. Element ``i`` of a
    tensor (row-major) is ``pool[(start + i) % PERIOD] * scale``, or ``1 + 0.05 * pool[...]`` for norm
    gains; the scales are those of :func:`random_weights`. The same seed always gives the same values.
    """

    def __init__(self, shape: LlamaShape, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._pool = rng.standard_normal(PERIOD, dtype=np.float32)  # [PERIOD]
        h, hd = shape.hidden, shape.head_dim
        plan: list[tuple[str, tuple[int, ...], float, float]] = [
            ("token_embd.weight", (shape.vocab, h), 1.0, 0.0),
            ("output_norm.weight", (h,), 0.05, 1.0),
            ("output.weight", (shape.vocab, h), h**-0.5, 0.0),
        ]
        for layer in range(shape.layers):
            names = tensor_names(layer)
            plan += [
                (names["attn_norm"], (h,), 0.05, 1.0),
                (names["ffn_norm"], (h,), 0.05, 1.0),
                (names["wq"], (shape.heads * hd, h), h**-0.5, 0.0),
                (names["wk"], (shape.kv_heads * hd, h), h**-0.5, 0.0),
                (names["wv"], (shape.kv_heads * hd, h), h**-0.5, 0.0),
                (names["wo"], (h, shape.heads * hd), (shape.heads * hd) ** -0.5, 0.0),
                (names["w_gate"], (shape.ffn, h), h**-0.5, 0.0),
                (names["w_up"], (shape.ffn, h), h**-0.5, 0.0),
                (names["w_down"], (h, shape.ffn), shape.ffn**-0.5, 0.0),
            ]
        starts = rng.integers(0, PERIOD, size=len(plan))
        self._recipes = {
            name: _TensorRecipe(dims, scale, offset, int(start))
            for (name, dims, scale, offset), start in zip(plan, starts, strict=True)
        }

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        recipe = self._recipes[name]
        pool = self._pool * np.float32(recipe.scale)  # [PERIOD]
        if recipe.offset:
            pool += np.float32(recipe.offset)
        doubled = np.concatenate([pool, pool])  # [2 * PERIOD]: any window of PERIOD values is one slice
        count = math.prod(recipe.dims)
        out = np.empty(count, dtype=np.float32)
        for begin in range(0, count, PERIOD):
            phase = (recipe.start + begin) % PERIOD
            end = min(begin + PERIOD, count)
            out[begin:end] = doubled[phase : phase + end - begin]
        return out.reshape(recipe.dims)

    def __iter__(self) -> Iterator[str]:
        return iter(self._recipes)

    def __len__(self) -> int:
        return len(self._recipes)


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
"""The think-tag reasoning delimiters ``--reasoning think-tags`` adds as special tokens."""

_ASSISTANT_REASONING = (
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "<think>{{ message['reasoning_content'] }}</think>{% endif %}"
)
"""Jinja statements writing an assistant message's ``reasoning_content`` (when it has any) as
``<think>REASONING</think>``, before its content."""

_THINKING_SWITCH = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
"""Jinja statements, after the generation prompt: an empty, closed reasoning block when the template variable
``enable_thinking`` is given and false (a request's ``chat_template_kwargs``); nothing otherwise, so thinking
is on by default and the model may open ``<think>`` itself."""


def _json_tools_template(reasoning: str = "", generation_prompt: str = "") -> str:
    """The JSON-tools ChatML template, with ``reasoning`` (Jinja) between each message's role line and its
    content, and ``generation_prompt`` (Jinja) after the assistant opener of the generation prompt."""
    return (
        "{%- if tools %}<|im_start|>system\nCall a tool by replying "
        '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:\n'
        "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
        "{%- for message in messages %}<|im_start|>{{ message['role'] + '\\n' }}"
        + reasoning
        + "{{ message['content'] or '' }}"
        "{%- for call in message.get('tool_calls') or [] %}{% set arguments = call['function']['arguments'] %}"
        '<tool_call>{"name": {{ call["function"]["name"] | tojson }}, "arguments": '
        "{{ arguments if arguments is string else arguments | tojson }}}</tool_call>{% endfor %}"
        "<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n" + generation_prompt + "{% endif %}"
    )


CHATML_JSON_TOOLS_TEMPLATE = _json_tools_template()
"""ChatML with tools in a system message and JSON-tag tool calls in assistant messages: every message is
``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``, an assistant message's calls following its text as
``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` (ARGS as given when it is a string, else as
JSON). The newline after the role is written by the expression, since the ``{%-`` of the tag after it
strips the whitespace before that tag."""

CHATML_THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    + _ASSISTANT_REASONING
    + "{{ (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}" + _THINKING_SWITCH + "{% endif %}"
)
"""ChatML (:data:`CHATML_TEMPLATE`) with think-tag reasoning: an assistant message's ``reasoning_content``
is written as ``<think>REASONING</think>`` before its content, and the generation prompt
``<|im_start|>assistant\\n`` is followed by ``<think>\\n\\n</think>\\n\\n`` when the template variable
``enable_thinking`` is given and false."""

CHATML_JSON_TOOLS_THINK_TEMPLATE = _json_tools_template(_ASSISTANT_REASONING, _THINKING_SWITCH)
""":data:`CHATML_JSON_TOOLS_TEMPLATE` with think-tag reasoning, written as :data:`CHATML_THINK_TEMPLATE`
writes it (an assistant message's reasoning before its content and tool calls)."""

_ATTRIBUTE_MACRO = (
    "{%- macro attribute(text) %}"
    "{{ text | replace('&', '&amp;') | replace('\"', '&quot;') | replace('<', '&lt;') | replace('>', '&gt;') }}"
    "{% endmacro %}"
)
"""Jinja macro ``attribute(text)``: ``text`` as a double-quoted attribute value, with ``& " < >`` written as
the entities the element parsers unescape (names the call grammars write hold none of them)."""

_ARGUMENTS_CHECK = (
    "{%- set arguments = call['function']['arguments'] %}"
    "{%- if arguments is not mapping %}"
    "{{ raise_exception('the arguments of a tool call in this tool syntax must be a JSON object') }}"
    "{% endif %}"
)
"""Jinja statements setting ``arguments`` to the call's arguments; anything but an object is refused, since
the tool syntax writes one element per argument."""

_VALUE = "{{ value if value is string else value | tojson }}"
"""Jinja expression of an argument value: a string verbatim, any other value as compact JSON (``tojson``
writes ``", "`` and ``": "``, as the call grammars do)."""

RECIPIENT_HEADER_TEMPLATE = (
    _ATTRIBUTE_MACRO + "{%- if tools %}<|start|>system<|message|>Call a tool in a frame to=functions.NAME. Tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.get('tool_calls') %}"
    "{%- if message['content'] %}<|start|>assistant<|message|>{{ message['content'] }}<|end|>{% endif %}"
    "{%- for call in message['tool_calls'] %}" + _ARGUMENTS_CHECK + "<|start|>assistant to=functions."
    "{{ call['function']['name'] }}<|message|><atem:function_calls>{{ '\\n' }}"
    "<atem:invoke name=\"{{ attribute(call['function']['name']) }}\">{{ '\\n' }}"
    "{%- for key, value in arguments.items() %}"
    '<atem:parameter name="{{ attribute(key) }}">' + _VALUE + "</atem:parameter>{{ '\\n' }}"
    "{%- else %}{{ '\\n' }}{% endfor %}"
    "</atem:invoke>{{ '\\n' }}</atem:function_calls><|eom|>{% endfor %}"
    "{%- elif message['role'] == 'tool' %}<|start|>functions to=assistant<|message|>{{ message['content'] }}<|end|>"
    "{%- else %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] or '' }}<|end|>{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)
"""Recipient-header frames ``<|start|>ROLE<|message|>CONTENT<|end|>``; the generation prompt leaves the
assistant header open. An assistant message with tool calls is its text in a frame of its own (when it has
any), then one frame per call, as the model writes a call::

    <|start|>assistant to=functions.NAME<|message|><atem:function_calls>
    <atem:invoke name="NAME">
    <atem:parameter name="KEY">VALUE</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>

with one parameter line per argument (an empty line for none), a string value verbatim and any other value
as compact JSON. Tool results are ``<|start|>functions to=assistant<|message|>RESULT<|end|>``."""

XTML_TEMPLATE = (
    _ATTRIBUTE_MACRO + "{%- macro kind(value) %}"
    "{% if value is string %}string{% elif value is boolean %}boolean{% elif value is none %}null"
    "{% elif value is number %}number{% elif value is mapping %}object{% else %}array{% endif %}"
    "{% endmacro %}"
    '{%- if tools %}<|open|>message role="system"<|sep|>Tools:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|close|>message<|sep|>{% endif %}"
    "{%- for message in messages %}<|open|>message role=\"{{ message['role'] }}\"<|sep|>"
    "{{ message['content'] or '' }}"
    "{%- if message.get('tool_calls') %}<|open|>tools<|sep|>"
    "{%- for call in message['tool_calls'] %}" + _ARGUMENTS_CHECK + '<|open|>call tool="'
    "{{ attribute(call['function']['name']) }}\"<|sep|>"
    "{%- for key, value in arguments.items() %}"
    '<|open|>argument key="{{ attribute(key) }}" type="{{ kind(value) }}"<|sep|>'
    + _VALUE
    + "<|close|>argument<|sep|>{% endfor %}<|close|>call<|sep|>{% endfor %}<|close|>tools<|sep|>{% endif %}"
    "<|close|>message<|sep|>{% endfor %}"
    '{%- if add_generation_prompt %}<|open|>message role="assistant"<|sep|><|open|>think<|sep|>{% endif %}'
)
"""XTML messages ``<|open|>message role="ROLE"<|sep|>CONTENT<|close|>message<|sep|>``; the generation prompt
opens the assistant's XTML think element. An assistant message's tool calls follow its text in one tools
block, as the model writes calls::

    <|open|>tools<|sep|><|open|>call tool="NAME"<|sep|>
    <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|>

(on one line), with one argument element per argument: a string ``type="string"`` and verbatim; any other
value compact JSON, typed ``number``, ``boolean``, ``null``, ``object`` or ``array`` by its value."""

TOOL_SYNTAXES = ("none", "json-tags", "recipient-header", "xtml")
_SYNTAX_SPECIALS = {
    "none": (),
    "json-tags": ("<tool_call>", "</tool_call>"),
    "recipient-header": ("<|start|>", "<|message|>", "<|end|>", "<|eom|>"),
    "xtml": ("<|open|>", "<|close|>", "<|sep|>"),
}

REASONING_KINDS = ("none", "think-tags")
"""The reasoning a synthetic core may add to its tool syntax (``--reasoning``)."""

OWN_REASONING_SYNTAXES = ("recipient-header", "xtml")
"""The tool syntaxes that carry their own reasoning: they take no ``--reasoning`` but ``none``."""

_REASONING_SPECIALS = {"none": (), "think-tags": (THINK_OPEN, THINK_CLOSE)}


def check_reasoning(reasoning: str, tool_syntax: str = "none") -> None:
    """Refuse an unknown reasoning, and think-tag reasoning for a tool syntax that carries its own.

    Raises:
        ValueError: ``reasoning`` is not one of :data:`REASONING_KINDS`, or is not ``none`` while
            ``tool_syntax`` is one of :data:`OWN_REASONING_SYNTAXES`.
    """
    if reasoning not in REASONING_KINDS:
        raise ValueError(f"unknown reasoning {reasoning!r}; known: {', '.join(REASONING_KINDS)}")
    if reasoning != "none" and tool_syntax in OWN_REASONING_SYNTAXES:
        raise ValueError(
            f"--reasoning {reasoning} cannot be combined with --tool-syntax {tool_syntax}: that tool syntax "
            "carries its own reasoning"
        )


def check_extra_special(extra_special: Sequence[str], tool_syntax: str = "none", reasoning: str = "none") -> None:
    """Refuse ``--extra-special`` tokens that would not be new tokens of the synthetic tokenizer.

    Raises:
        ValueError: an empty token, one named twice, one of :data:`SPECIAL_TOKENS`, one the tool syntax
            or the reasoning adds, or one of the 256 byte tokens (which would make that byte a special
            token, skipped when decoding).
    """
    from tokenizers import pre_tokenizers

    byte_tokens = set(pre_tokenizers.ByteLevel.alphabet())
    seen: set[str] = set()
    for token in extra_special:
        if not token:
            raise ValueError("--extra-special has an empty token name")
        if token in seen:
            raise ValueError(f"--extra-special names {token!r} twice")
        if token in SPECIAL_TOKENS:
            raise ValueError(f"--extra-special token {token!r} is already a special token of the synthetic tokenizer")
        if token in _SYNTAX_SPECIALS.get(tool_syntax, ()):
            raise ValueError(f"--extra-special token {token!r} is already added by --tool-syntax {tool_syntax}")
        if token in _REASONING_SPECIALS.get(reasoning, ()):
            raise ValueError(f"--extra-special token {token!r} is already added by --reasoning {reasoning}")
        if token in byte_tokens:
            raise ValueError(f"--extra-special token {token!r} is already a byte token of the synthetic tokenizer")
        seen.add(token)


def chatml_frontend() -> ct.FrontendContract:
    """No tool syntax, with ChatML boundaries (the frontend think-tag reasoning is added to without tools)."""
    frontend = frontend_declarations.plain()
    frontend.template_tokens.message_end = "<|im_end|>"
    frontend.template_tokens.assistant_open = "<|im_start|>assistant\n"
    return frontend


def json_tags_frontend() -> ct.FrontendContract:
    """The JSON-tag tool syntax with ``<tool_call>`` / ``</tool_call>`` markers and ChatML boundaries."""
    frontend = frontend_declarations.json_tags()
    frontend.template_tokens.message_end = "<|im_end|>"
    frontend.template_tokens.assistant_open = "<|im_start|>assistant\n"
    return frontend


def recipient_header_frontend() -> ct.FrontendContract:
    """Recipient-header frames with ATEM calls, as the recipient-header template writes them."""
    frontend = frontend_declarations.recipient_header()
    frontend.template_tokens.message_end = "<|end|>"
    frontend.template_tokens.assistant_open = "<|start|>assistant"
    return frontend


def xtml_frontend() -> ct.FrontendContract:
    """XTML tool blocks and XTML think, as the XTML template writes them."""
    frontend = frontend_declarations.xtml()
    frontend.template_tokens.message_end = "<|close|>message<|sep|>"
    frontend.template_tokens.assistant_open = '<|open|>message role="assistant"<|sep|>'
    return frontend


_SYNTAX_FRONTENDS = {
    "json-tags": (CHATML_JSON_TOOLS_TEMPLATE, json_tags_frontend),
    "recipient-header": (RECIPIENT_HEADER_TEMPLATE, recipient_header_frontend),
    "xtml": (XTML_TEMPLATE, xtml_frontend),
}


def tool_syntax_frontend(tool_syntax: str) -> ct.FrontendContract | None:
    """The frontend a synthetic core of ``tool_syntax`` declares (None for ``none``: no tool or reasoning
    syntax).

    Raises:
        ValueError: an unknown tool syntax.
    """
    if tool_syntax not in TOOL_SYNTAXES:
        raise ValueError(f"unknown tool syntax {tool_syntax!r}; known: {', '.join(TOOL_SYNTAXES)}")
    if tool_syntax not in _SYNTAX_FRONTENDS:
        return None
    return _SYNTAX_FRONTENDS[tool_syntax][1]()


_THINK_TEMPLATES = {"none": CHATML_THINK_TEMPLATE, "json-tags": CHATML_JSON_TOOLS_THINK_TEMPLATE}


def synthetic_frontend(tool_syntax: str, reasoning: str = "none") -> tuple[str, ct.FrontendContract | None]:
    """The chat template and frontend (None: no tool or reasoning syntax) of a synthetic core of
    ``tool_syntax`` and ``reasoning``. Think-tag reasoning is not terminal: a tool-call opener inside
    reasoning is reasoning text, and the model closes ``</think>`` before it calls.

    Raises:
        ValueError: an unknown tool syntax, or a reasoning :func:`check_reasoning` refuses.
    """
    frontend = tool_syntax_frontend(tool_syntax)
    check_reasoning(reasoning, tool_syntax)
    if reasoning == "none":
        template = _SYNTAX_FRONTENDS[tool_syntax][0] if tool_syntax in _SYNTAX_FRONTENDS else CHATML_TEMPLATE
        return template, frontend
    thinking = frontend_declarations.with_think_tags(
        frontend if frontend is not None else chatml_frontend(), open_tag=THINK_OPEN, close_tag=THINK_CLOSE
    )
    return _THINK_TEMPLATES[tool_syntax], thinking


def synthetic_declaration(
    shape_name: str,
    *,
    seed: int = 0,
    extra_special: tuple[str, ...] = (),
    tool_syntax: str = "none",
    reasoning: str = "none",
) -> TextModelDeclaration:
    """The declaration of a synthetic core of a named shape (optionally with a tool-call syntax, and with
    think-tag reasoning: ``reasoning="think-tags"`` adds ``<think>`` and ``</think>`` as special tokens after
    the tool syntax's, think-tag reasoning and a template with a thinking switch).

    Raises:
        ValueError: an unknown tool syntax, reasoning or shape, a reasoning :func:`check_reasoning` refuses,
            extra special tokens :func:`check_extra_special` refuses, or more tokens than the shape has
            logits.
    """
    from ignition.build import TextModelDeclaration

    template, frontend = synthetic_frontend(tool_syntax, reasoning)
    check_extra_special(extra_special, tool_syntax, reasoning)
    extra_special = (*extra_special, *_SYNTAX_SPECIALS[tool_syntax], *_REASONING_SPECIALS[reasoning])

    if shape_name not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape_name!r}; known shapes: {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    tokenizer = byte_level_tokenizer(extra_special)
    if tokenizer.vocab_size > shape.vocab:
        raise ValueError(f"shape {shape_name!r} has {shape.vocab} logits, the tokenizer needs {tokenizer.vocab_size}")
    return TextModelDeclaration(
        served_name=f"llama-synthetic-{shape_name}",
        shape=shape,
        weights=random_weights(shape, seed),
        tokenizer_json=tokenizer.json,
        chat_template=template,
        frontend=frontend,
        sampled_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        description=f"Synthetic Llama shape {shape_name!r} with seeded random weights (seed {seed})",
    )
