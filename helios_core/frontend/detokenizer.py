"""Incremental detokenization: the text each generated token completes.

Owns turning a growing list of token ids into text pieces without re-decoding the whole output per
token and without ever emitting half of a UTF-8 character: a byte-level token that ends inside a
multi-byte character yields "" until the character completes. Special tokens are decoded as their
text (reasoning and tool envelopes are matched and parsed before presentation); whether a client
sees them is the output pipeline's decision.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6
"""Tokens kept before the unread ones, so merges across the boundary decode correctly."""


class IncrementalDetokenizer:
    """Text pieces for ids appended one at a time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Append ``token_id``; returns the newly complete text (possibly "")."""
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
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=False)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=False)
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
