"""Build a HuggingFace ``tokenizers.Tokenizer`` from a GGUF file's vocabulary.

This module owns the translation of GGUF tokenizer metadata
(``tokenizer.ggml.*`` and ``tokenizer.chat_template``) into a
:class:`tokenizers.Tokenizer` that produces the same token ids as llama.cpp's
own tokenizer for that file, plus the chat template and special token ids.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the
pre-tokenizer families llama.cpp defines in ``llama-vocab.cpp``:

* ``smollm`` (and ``starcoder``, ``refact``, ``command-r``, ``codeshell``,
  ``exaone``, ``minerva``, which share its rules): every digit is split off on
  its own (regex ``\\p{N}``), then the GPT-2 regex
  ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)``
  applies to what is left. In ``tokenizers`` terms:
  ``Digits(individual_digits=True)`` followed by ``ByteLevel(use_regex=True)``.
* ``gpt2`` (and ``mpt``, ``olmo``, ``jais``): the GPT-2 regex alone.

Only ``smollm`` is verified token-for-token (SmolLM2-135M-Instruct, against
llama.cpp and against transformers' GGUF loader); the others follow the same
llama.cpp table but are untested here.

Token types (``tokenizer.ggml.token_type``) map as llama.cpp treats them:
CONTROL and UNKNOWN tokens become *special* added tokens (always matched as a
single id in the input, skipped by ``decode(..., skip_special_tokens=True)``);
USER_DEFINED tokens become non-special added tokens (also always matched).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ignition.gguf import GGUFError, GGUFFile, read_gguf

if TYPE_CHECKING:
    from os import PathLike

__all__ = [
    "GGUFTokenizer",
    "GGUFTokenizerError",
    "TokenType",
    "load_gguf_tokenizer",
    "tokenizer_from_gguf",
]

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) grouped by identical rules.
_DIGITS_THEN_GPT2: Final = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_GPT2_ONLY: Final = frozenset({"gpt2", "mpt", "olmo", "jais"})


class GGUFTokenizerError(GGUFError):
    """The GGUF tokenizer metadata is missing, malformed or unsupported."""


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class GGUFTokenizer:
    """A tokenizer built from GGUF metadata, with its chat-related settings."""

    tokenizer: Tokenizer
    #: ``tokenizer.chat_template`` (a Jinja2 template), or None if absent.
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    #: ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (the post-processor
    #: of :attr:`tokenizer` applies them when ``add_special_tokens=True``).
    add_bos_token: bool
    add_eos_token: bool
    #: ids of CONTROL/UNKNOWN tokens (registered as special added tokens).
    special_token_ids: frozenset[int]

    def token_text(self, token_id: int | None) -> str | None:
        """The vocabulary string of ``token_id`` (None for None)."""
        return None if token_id is None else self.tokenizer.id_to_token(token_id)


def _optional_id(gguf: GGUFFile, key: str, n_vocab: int) -> int | None:
    if key not in gguf.metadata:
        return None
    value = gguf.get_int(key)
    if not 0 <= value < n_vocab:
        raise GGUFTokenizerError(f"{key} = {value} is outside the vocabulary (size {n_vocab})")
    return value


def _optional_bool(gguf: GGUFFile, key: str, default: bool) -> bool:
    return gguf.get_bool(key) if key in gguf.metadata else default


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    # ByteLevel(use_regex=True) splits with the GPT-2 regex, then maps bytes
    # to the GPT-2 byte alphabet the vocabulary is written in.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_ONLY:
        return byte_level
    raise GGUFTokenizerError(
        f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(_DIGITS_THEN_GPT2 | _GPT2_ONLY))}"
    )


def _merges(raw: list[str]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for i, line in enumerate(raw):
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise GGUFTokenizerError(f"tokenizer.ggml.merges[{i}] = {line!r} is not 'left right'")
        merges.append((parts[0], parts[1]))
    return merges


def _bos_eos_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.PostProcessor:
    def template(seq: str, type_id: int) -> str:
        parts = [f"${seq}:{type_id}"]
        if bos is not None:
            parts.insert(0, f"{tokens[bos]}:{type_id}")
        if eos is not None:
            parts.append(f"{tokens[eos]}:{type_id}")
        return " ".join(parts)

    return processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=[(tokens[i], i) for i in sorted({i for i in (bos, eos) if i is not None})],
    )


def tokenizer_from_gguf(gguf: GGUFFile) -> GGUFTokenizer:
    """Build the byte-level BPE tokenizer described by ``gguf``'s metadata.

    Raises:
        GGUFTokenizerError: unsupported tokenizer model / pre-tokenizer, or
            inconsistent vocabulary metadata.
    """
    model = gguf.get_str("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFTokenizerError(f"unsupported tokenizer.ggml.model {model!r}; only 'gpt2' (BPE)")
    pre = gguf.get_str("tokenizer.ggml.pre") if "tokenizer.ggml.pre" in gguf.metadata else "default"

    tokens = gguf.get_str_list("tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    if "tokenizer.ggml.token_type" in gguf.metadata:
        types = gguf.get_int_list("tokenizer.ggml.token_type")
        if len(types) != n_vocab:
            raise GGUFTokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens")
    else:
        types = [int(TokenType.NORMAL)] * n_vocab

    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        if text in vocab:
            raise GGUFTokenizerError(
                f"duplicate token {text!r} (ids {vocab[text]} and {token_id}) in tokenizer.ggml.tokens"
            )
        vocab[text] = token_id
    merges = _merges(gguf.get_str_list("tokenizer.ggml.merges"))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()

    special_ids: set[int] = set()
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for token_id, (text, ttype) in enumerate(zip(tokens, types, strict=True)):
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN):
            special_ids.add(token_id)
            special.append(AddedToken(text, special=True, normalized=False))
        elif ttype == TokenType.USER_DEFINED:
            user_defined.append(AddedToken(text, special=False, normalized=False))
    if special:
        tokenizer.add_special_tokens(special)
    if user_defined:
        tokenizer.add_tokens(user_defined)
    for added in (*special, *user_defined):
        kept_id = tokenizer.token_to_id(added.content)
        if kept_id is None or tokens[kept_id] != added.content:
            raise GGUFTokenizerError(f"added token {added.content!r} did not keep its vocabulary id")

    bos = _optional_id(gguf, "tokenizer.ggml.bos_token_id", n_vocab)
    eos = _optional_id(gguf, "tokenizer.ggml.eos_token_id", n_vocab)
    add_bos = _optional_bool(gguf, "tokenizer.ggml.add_bos_token", False)
    add_eos = _optional_bool(gguf, "tokenizer.ggml.add_eos_token", False)
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise GGUFTokenizerError("add_bos_token/add_eos_token set but the token id is missing")
    if add_bos or add_eos:
        tokenizer.post_processor = _bos_eos_processor(tokens, bos if add_bos else None, eos if add_eos else None)

    chat_template = gguf.get_str("tokenizer.chat_template") if "tokenizer.chat_template" in gguf.metadata else None
    return GGUFTokenizer(
        tokenizer=tokenizer,
        chat_template=chat_template,
        bos_token_id=bos,
        eos_token_id=eos,
        unk_token_id=_optional_id(gguf, "tokenizer.ggml.unknown_token_id", n_vocab),
        pad_token_id=_optional_id(gguf, "tokenizer.ggml.padding_token_id", n_vocab),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        special_token_ids=frozenset(special_ids),
    )


def load_gguf_tokenizer(path: str | PathLike[str]) -> GGUFTokenizer:
    """Read the GGUF file at ``path`` and build its tokenizer."""
    return tokenizer_from_gguf(read_gguf(path))
