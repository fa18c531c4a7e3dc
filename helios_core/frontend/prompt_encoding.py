"""Prompt encoding: client text never becomes control tokens, and oversize prompts cost little.

Owns turning a rendered chat template into prompt token ids:

* **Shielding client text.** Every client string that reaches the template (message contents,
  reasoning, tool-call names and arguments, tool definitions, tool-call ids) passes through
  :meth:`ClientTextShield.shield`, which replaces each spelling of an added token (the tokenizer's
  special and added tokens: ``<|im_end|>``, ``<think>``, ...) with a placeholder of private-use
  characters around a per-request random number. The template passes placeholders through like
  any text. :meth:`PromptEncoder.encode` splits the rendering at the placeholders: the template's
  own text is encoded normally (its markup becomes control tokens), the original text of each
  placeholder is encoded as plain text by a separate tokenizer copy on which every added token is
  special and ``encode_special_tokens`` is set (the shared tokenizer is never switched, since
  preparation runs on several threads). A rendering without placeholders is one template
  segment, tokenized exactly as before.
* **Bounded cost.** ``max_token_bytes`` is the longest vocabulary entry in bytes (byte-level
  vocabularies count one byte per symbol; a tokenizer with a normalizer gets a fourfold
  allowance, since normalizing can shorten text); ``lower_bound_tokens(n)`` = ``ceil(n /
  max_token_bytes)`` is at most the token count of any text of ``n`` UTF-8 bytes. Encoding with a
  ``limit`` stops once the prompt certainly holds at least ``limit`` tokens (:class:`PromptTooLong`):
  a long template segment is encoded by prefixes of doubling length, cut before a space, so a
  prompt far above the limit is never tokenized in full.
* **Raw prompts.** :meth:`PromptEncoder.encode_raw` encodes a legacy completions prompt: no chat
  template, no shielding (the client writes the model's whole input, as it could with token ids),
  the tokenizer's own special-token handling: added-token spellings encode as those tokens and the
  post-processor adds what it adds to any input (a BOS, for tokenizers configured so). The same
  bounded cost applies.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

__all__ = ["ClientTextShield", "PromptEncoder", "PromptTooLong", "utf8_length"]

_OPEN = "\ue000"
_CLOSE = "\ue001"
_PROBE_CHARS_PER_TOKEN = 8
"""First prefix probed in a long segment: this many characters per token the limit still allows."""
_PROBE_MARGIN_TOKENS = 16
"""Tokens a prefix cut may add over the same text in the whole segment (refusals allow for them)."""
_UTF8_CHUNK = 1 << 16


def utf8_length(text: str) -> int:
    """UTF-8 length of ``text`` without encoding it whole."""
    if text.isascii():
        return len(text)
    return sum(
        len(text[i : i + _UTF8_CHUNK].encode("utf-8", "surrogatepass")) for i in range(0, len(text), _UTF8_CHUNK)
    )


class PromptTooLong(Exception):
    """Encoding stopped early: the prompt holds at least ``tokens`` tokens, ``limit`` or more.

    ``utf8_bytes``: the prompt's size when the bound came from its length alone, else None."""

    def __init__(self, tokens: int, limit: int, utf8_bytes: int | None = None) -> None:
        super().__init__(f"the prompt holds at least {tokens} tokens, at or above the limit of {limit}")
        self.tokens = tokens
        self.limit = limit
        self.utf8_bytes = utf8_bytes


class ClientTextShield:
    """Placeholders for the control-token spellings inside one request's client strings."""

    def __init__(self, pattern: re.Pattern[str] | None) -> None:
        self._pattern = pattern
        self._nonce = str(secrets.randbelow(10**18)).zfill(18)
        self.literals: list[str] = []
        """The original text of placeholder ``i``."""
        self.placeholder = re.compile(re.escape(_OPEN + self._nonce) + r"(\d+)" + re.escape(_CLOSE))
        self.input_chars = 0
        """Characters of every string shielded so far (the render's input size)."""

    def shield(self, text: str) -> str:
        """``text`` with each control-token spelling replaced by a placeholder."""
        self.input_chars += len(text)
        if self._pattern is None:
            return text
        return self._pattern.sub(self._substitute, text)

    def shield_value(self, value: Any) -> Any:
        """``value`` (JSON-like: dicts, lists, strings) with every string, keys included, shielded."""
        if isinstance(value, str):
            return self.shield(value)
        if isinstance(value, dict):
            return {self.shield_value(k): self.shield_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.shield_value(item) for item in value]
        if value is not None and not isinstance(value, bool | int | float):
            self.input_chars += len(str(value))
        return value

    def _substitute(self, match: re.Match[str]) -> str:
        self.literals.append(match.group(0))
        return f"{_OPEN}{self._nonce}{len(self.literals) - 1}{_CLOSE}"


def _longest_token_bytes(tokenizer: Tokenizer) -> int:
    byte_level = "ByteLevel" in repr(tokenizer.decoder) or "ByteLevel" in repr(tokenizer.pre_tokenizer)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else set()
    longest = 1
    for text in tokenizer.get_vocab(with_added_tokens=True):
        size = len(text) if byte_level and all(ch in alphabet for ch in text) else len(text.encode("utf-8"))
        longest = max(longest, size)
    if tokenizer.normalizer is not None:
        longest *= 4
    return longest


def _literal_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that encodes every added-token spelling as plain text."""
    data = json.loads(tokenizer.to_str())
    for added in data.get("added_tokens") or []:
        added["special"] = True
    copy = Tokenizer.from_str(json.dumps(data))
    copy.encode_special_tokens = True
    return copy


class PromptEncoder:
    """Encodes renderings into prompt ids (see the module docstring); shared by preparation threads."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._literal = _literal_tokenizer(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        spellings = sorted({token.content for token in added.values() if token.content}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(s) for s in spellings)) if spellings else None
        self.max_token_bytes = _longest_token_bytes(tokenizer)

    def shield(self) -> ClientTextShield:
        """A fresh shield for one request."""
        return ClientTextShield(self._pattern)

    def lower_bound_tokens(self, utf8_bytes: int) -> int:
        """Fewest tokens any text of ``utf8_bytes`` UTF-8 bytes encodes to."""
        return math.ceil(utf8_bytes / self.max_token_bytes)

    def encode(self, rendered: str, shield: ClientTextShield | None = None, *, limit: int | None = None) -> list[int]:
        """Ids of ``rendered``; placeholders of ``shield`` encode their text as plain text.

        With ``limit``, raises PromptTooLong as soon as the prompt certainly holds ``limit`` or more
        tokens (a prompt below the limit is always encoded in full)."""
        if limit is not None:
            size = self.prompt_bytes(rendered, shield)
            bound = self.lower_bound_tokens(size)
            if bound >= limit:
                raise PromptTooLong(bound, limit, size)
        ids: list[int] = []
        for text, literal in self._segments(rendered, shield):
            remaining = None if limit is None else limit - len(ids)
            if remaining is not None and remaining <= 0:
                raise PromptTooLong(len(ids), limit or 0)
            ids.extend(self._encode_literal(text) if literal else self._encode_template(text, remaining))
        return ids

    def encode_raw(self, text: str, *, limit: int | None = None) -> list[int]:
        """Ids of a raw prompt as the tokenizer encodes a model input (see the module docstring).

        With ``limit``, raises PromptTooLong as soon as the prompt certainly holds ``limit`` or more
        tokens, as :meth:`encode` does."""
        if limit is not None:
            size = utf8_length(text)
            bound = self.lower_bound_tokens(size)
            if bound >= limit:
                raise PromptTooLong(bound, limit, size)
            self._probe(text, limit)
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def prompt_bytes(self, rendered: str, shield: ClientTextShield | None = None) -> int:
        """UTF-8 bytes of the prompt ``rendered`` stands for (each placeholder counted as its text)."""
        size = utf8_length(rendered)
        if shield is not None and shield.literals:
            for match in shield.placeholder.finditer(rendered):
                size += utf8_length(shield.literals[int(match.group(1))]) - utf8_length(match.group(0))
        return size

    def _segments(self, rendered: str, shield: ClientTextShield | None) -> Iterable[tuple[str, bool]]:
        if shield is None or not shield.literals:
            yield rendered, False
            return
        position = 0
        for match in shield.placeholder.finditer(rendered):
            if match.start() > position:
                yield rendered[position : match.start()], False
            yield shield.literals[int(match.group(1))], True
            position = match.end()
        if position < len(rendered):
            yield rendered[position:], False

    def _encode_template(self, text: str, remaining: int | None) -> list[int]:
        if remaining is not None:
            self._probe(text, remaining)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _probe(self, text: str, remaining: int) -> None:
        """Raise PromptTooLong when a prefix of ``text`` already holds ``remaining`` or more tokens."""
        length = max(remaining, 1) * _PROBE_CHARS_PER_TOKEN
        while length < len(text):
            cut = _cut_before_space(text, length)
            count = len(self.tokenizer.encode(text[:cut], add_special_tokens=False).ids)
            if count - _PROBE_MARGIN_TOKENS >= remaining:
                raise PromptTooLong(count - _PROBE_MARGIN_TOKENS, remaining)  # of this segment alone
            length *= 2

    def _encode_literal(self, text: str) -> list[int]:
        ids: Sequence[int] = self._literal.encode(text, add_special_tokens=False).ids
        if any(i in self.added_ids for i in ids):  # the model's merges spell a control token
            ids = [i for ch in text for i in self._literal.encode(ch, add_special_tokens=False).ids]
        return list(ids)


def _cut_before_space(text: str, position: int) -> int:
    """A cut at or after ``position`` right before a space that follows a non-space (``position`` if none near)."""
    window = text[position : position + 4096]
    for offset, ch in enumerate(window):
        if ch == " " and offset + position > 0 and not text[offset + position - 1].isspace():
            return position + offset
    return position
