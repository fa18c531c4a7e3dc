"""Incremental detokenization: the text each generated token completes.

Owns turning a growing list of token ids into text pieces without re-decoding the whole output per
token and without ever emitting half of a UTF-8 character: a byte-level token that ends inside a
multi-byte character yields "" until the character completes. Special tokens are decoded as their
text (reasoning and tool envelopes are matched and parsed before presentation); whether a client
sees them is the output pipeline's decision.

Two paths give the same text. For a tokenizer whose decoder is the plain byte-level one, decoding is
the concatenation of each token's bytes, read as UTF-8 with invalid sequences replaced:
:class:`TokenBytes` holds every token's bytes (built and checked against the tokenizer once at
startup) and a piece costs one table lookup and an incremental UTF-8 decode. Any other tokenizer
decodes a short window of recent ids twice per token through the tokenizer.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer, decoders

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

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def pusher(self, decode: Callable[[bytes], str]) -> Callable[[int], str]:
        """``push(id)``: ``decode`` of the id's bytes (ids outside the table have none)."""
        table, size = self._table, len(self._table)

        def push(token_id: int) -> str:
            return decode(table[token_id]) if 0 <= token_id < size else ""

        return push

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


class IncrementalDetokenizer:
    """Text pieces for ids appended one at a time (through ``token_bytes`` when given)."""

    push: Callable[[int], str]
    """Append a token id; returns the newly complete text (possibly "")."""

    def __init__(self, tokenizer: Tokenizer, token_bytes: TokenBytes | None = None) -> None:
        self._tokenizer = tokenizer
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.push = self._push_window if token_bytes is None else token_bytes.pusher(self._utf8.decode)

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
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=False)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=False)
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
