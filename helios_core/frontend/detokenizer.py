"""Incremental detokenization: the text each generated token completes.

Owns turning a growing list of token ids into text pieces without re-decoding the whole output per
token and without ever emitting half of a UTF-8 character: a byte-level token that ends inside a
multi-byte character yields "" until the character completes. Special tokens are decoded as their
text (reasoning and tool envelopes are matched and parsed before presentation); which of them have no
text in a request's output (:func:`hidden_special_ids`: those no output syntax spells) is decided
here once per engine and applied by the request's gate or stream.

Two paths give the same text. For a tokenizer whose decoder is the plain byte-level one, decoding is
the concatenation of each token's bytes, read as UTF-8 with invalid sequences replaced:
:class:`TokenBytes` holds every token's bytes (built and checked against the tokenizer once at
startup) and a piece costs one table lookup: a token of whole characters has its text precomputed,
and only the bytes of characters split across tokens pass through an incremental UTF-8 decoder. Any
other tokenizer decodes a short window of recent ids twice per token through the tokenizer.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tokenizers import Tokenizer, decoders

from helios_core.wire import contract_pb2 as ct

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6
"""Tokens kept before the unread ones, so merges across the boundary decode correctly."""


def _unicode_to_byte() -> dict[str, int]:
    """The byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + shifted)
            shifted += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


class TokenBytes:
    """The bytes each token id decodes to under a plain byte-level decoder (immutable, shared)."""

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = tuple(table)
        self._texts = tuple(_complete_text(token) for token in self._table)
        """Each token's text when its bytes are whole UTF-8 characters on their own, else None."""

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def stream(self) -> tuple[Callable[[int], str], Callable[[], str]]:
        """``(push, flush)`` of one incremental decoding: ``push(id)`` returns the text the id's bytes
        complete, read as UTF-8 with invalid sequences replaced (ids outside the table have no bytes);
        ``flush()`` what an unfinished character leaves at the end. While no partial character is
        pending, a token of whole characters is its precomputed text."""
        table, texts, size = self._table, self._texts, len(self._table)
        utf8_decode = codecs.utf_8_decode
        pending = b""

        def push(token_id: int) -> str:
            nonlocal pending
            if not 0 <= token_id < size:
                return ""
            if pending:
                data = pending + table[token_id]
            else:
                text = texts[token_id]
                if text is not None:
                    return text
                data = table[token_id]
            text, used = utf8_decode(data, "replace", False)
            pending = data[used:]
            return text

        def flush() -> str:
            nonlocal pending
            text = utf8_decode(pending, "replace", True)[0] if pending else ""
            pending = b""
            return text

        return push, flush

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenBytes | None:
        """The table of ``tokenizer``, or ``None`` when its decoder is not the plain byte-level one or
        the table does not decode every single token exactly as the tokenizer does."""
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            return None
        alphabet = _unicode_to_byte()
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        table: list[bytes] = []
        for token_id in range(size):
            token = tokenizer.id_to_token(token_id)
            if token is None:
                table.append(b"")
            elif all(char in alphabet for char in token):
                table.append(bytes(alphabet[char] for char in token))
            else:
                table.append(token.encode("utf-8"))
        ids = list(range(size))
        expected = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        if any(table[i].decode("utf-8", "replace") != text for i, text in zip(ids, expected, strict=True)):
            return None
        return cls(table)


def _complete_text(token: bytes) -> str | None:
    """``token`` decoded when it is whole UTF-8 characters, else None (its text depends on its neighbours)."""
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return None


class IncrementalDetokenizer:
    """Text pieces for ids appended one at a time (through ``token_bytes`` when given)."""

    push: Callable[[int], str]
    """Append a token id; returns the newly complete text (possibly "")."""

    def __init__(self, tokenizer: Tokenizer, token_bytes: TokenBytes | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._flush_bytes: Callable[[], str] | None = None
        if token_bytes is None:
            self.push = self._push_window
        else:
            self.push, self._flush_bytes = token_bytes.stream()

    def _push_window(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=False)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=False)
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            piece = full_text[len(prefix_text) :]
            self._read_offset = len(self._ids)
            self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end (an incomplete character decodes as U+FFFD)."""
        if self._flush_bytes is not None:
            return self._flush_bytes()
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=False)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=False)
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


def hidden_special_ids(tokenizer: Tokenizer, syntax_texts: Iterable[str]) -> frozenset[int]:
    """The ids of ``tokenizer``'s special tokens whose text no output syntax spells: the tokens a client
    does not see in generated text (vLLM's ``skip_special_tokens``). A special token inside one of
    ``syntax_texts`` (a tool-call opener, a reasoning delimiter, a frame control) keeps its text, since
    the output parsers read it."""
    texts = [text for text in syntax_texts if text]
    return frozenset(
        token_id
        for token_id, token in tokenizer.get_added_tokens_decoder().items()
        if token.special and not any(token.content in text for text in texts)
    )


def output_syntax_texts(frontend: ct.FrontendContract) -> list[str]:
    """Every text the core's output syntax declares: each string of its tool syntax and reasoning syntax
    (recipient-header frames included) and each string of its plugin parameters (a third-party parser's
    markers)."""
    texts: list[str] = []
    messages: list[Message] = [frontend.tool_syntax, frontend.reasoning_syntax]
    while messages:
        for descriptor, value in messages.pop().ListFields():
            repeated = isinstance(value, Sequence) and not isinstance(value, str)
            if descriptor.type == FieldDescriptor.TYPE_STRING:
                texts.extend(value if repeated else [value])
            elif descriptor.type == FieldDescriptor.TYPE_MESSAGE:
                messages.extend(value if repeated else [value])
    if frontend.plugin_parameters_json:
        try:
            values: list[Any] = [json.loads(frontend.plugin_parameters_json)]
        except ValueError:  # validation refuses such a core; nothing to add
            values = []
        while values:
            value = values.pop()
            if isinstance(value, str):
                texts.append(value)
            elif isinstance(value, dict):
                values.extend([*value.keys(), *value.values()])
            elif isinstance(value, list):
                values.extend(value)
    return texts
