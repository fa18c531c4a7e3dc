"""Structured output: llguidance grammars and the per-request token masks they produce.

Owns these and nothing else:

* :class:`GrammarCompiler`, built once at startup from the core's tokenizer and vocabulary
  geometry (the llguidance tokenizer conversion is the expensive part), compiles a format
  (:mod:`helios_core.frontend.formats`, re-exported here) into an immutable :class:`Grammar`;
  schema errors surface eagerly as :class:`PromptError`. Compiling is the slow step (tens to
  hundreds of milliseconds for a large schema), so it never runs on the model worker: preparation
  compiles (or ``Engine.submit`` on its caller's thread) and the request carries the
  :class:`Grammar`; the worker only instantiates a matcher from it (:meth:`Grammar.matcher`).
* :class:`GrammarLimits`: the work llguidance may spend, per token and in all, on one request's
  grammar. A grammar that needs more fails that request (its lexer or parser error), so no schema
  can stall the worker, and every request beside it, on one token.
* :class:`GrammarMatcher`, one per request, produces the per-step allowed-token bitmask in the
  layout the sampling kernels read (``int32 [mask_words]``; bit ``b`` of word ``w`` allows id
  ``32*w + b``, LSB first; ids at or above the sampled vocabulary size are never allowed; EOS ids
  are allowed exactly when the grammar accepts termination) and advances on sampled tokens; for a
  speculative round it also gives the masks along a run of proposals from a copy of its state
  (:meth:`GrammarMatcher.masks_along`), never advancing its own.

Composition, knowing no syntax family: a tool call is the fragment its tool plugin wrote
(``ToolCallFormat.grammar``); a structured answer is its JSON schema (``%json``). When the core's
reasoning plugin declares delimited reasoning (:func:`envelope_reasoning`), the grammar admits it
before either (``start: reasoning? answer``): the open marker (omitted when the prompt already
opened reasoning), free text that never spells the close marker (nor the terminal marker, which
would end reasoning implicitly), the close marker, at most two newlines, then the answer and EOS.
Only the output limit bounds the reasoning. When the reasoning plugin frames the answer
(:class:`AnswerFrames`), the frames' fragment is the grammar and the answer fills its ``answer``
rule. Every marker a fragment names is matched as the added tokens it spells (as text in between).

A structured answer is an opaque grammar-constrained document: the grammar constrains bytes, so
text that happens to spell a protocol delimiter inside it is answer text. Reasoning/tool parsing
and presentation live elsewhere.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from helios_core.errors import ContractError, HeliosError, PromptError
from helios_core.frontend.formats import (
    AnswerFrames,
    ResponseFormat,
    ToolCallFormat,
    read_prepared_format,
)
from helios_core.plugins.grammar import ANSWER_RULE, COMPACT_JSON, GrammarFragment
from helios_core.plugins.tag_grammar import regex_literal
from helios_core.wire import contract_pb2 as ct

__all__ = [
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarLimits",
    "GrammarMatcher",
]

Mask = npt.NDArray[np.int32]

_CALL_RULE = "helios_call"  # a tool-call fragment's start, renamed inside a composed grammar
_FRAMES_RULE = "helios_frames"  # an answer-frames fragment's start, renamed likewise
_START = re.compile(r"(?m)^start(?=[ \t]*:)")
_RESERVED = re.compile(r"(?im)^(helios_\w*|answer)[ \t]*:")
_BARE_SCHEMAS = 256  # schemas whose bare grammars a compiler keeps (GrammarCompiler.schema_grammar)


def _unspellable_specials(tokenizer_json: str) -> str:
    """The tokenizer JSON llguidance reads, with each special added token's content replaced by a spelling no
    text contains (a private-use character around its id). llguidance tokenizes the text a grammar forces
    with this tokenizer: with the real spellings, text that spells a special token (a schema's
    ``"<|im_end|>"`` enum value, a tool named so) would tokenize as that control token, which the grammar
    then refuses; so the text stays text, written with ordinary tokens. Grammars name special tokens by
    id (``<[2]>``), never by spelling, so nothing else changes."""
    data = json.loads(tokenizer_json)
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    for entry in data.get("added_tokens") or ():
        if entry.get("special"):
            spelling = f"\ue000{entry['id']}\ue000"
            if isinstance(vocab, dict) and vocab.get(entry["content"]) == entry["id"]:
                del vocab[entry["content"]]  # the model's own entry for the token keeps its id
                vocab[spelling] = entry["id"]
            entry["content"] = spelling
    return json.dumps(data, ensure_ascii=False)


class GrammarError(HeliosError):
    """A sampled token the request's grammar does not allow, or a matcher in an error state.

    Masked sampling never produces one; seeing it means the mask and the sampler disagree (a
    sampling or validation failure of the request, not an invalid request).
    """


@dataclass(frozen=True)
class _Geometry:
    """Vocabulary geometry shared by every matcher of one compiler (read-only arrays)."""

    sampled_size: int
    mask_words: int
    llg_words: int  # words of llguidance's own mask (covers its n_vocab, >= mask_words)
    keep: Mask  # bits of ids < sampled_size
    eos: Mask  # bits of the EOS ids
    not_eos: Mask
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser and lexer limits for every grammar of one compiler.

    The per-token bounds make a matcher that needs more work for one mask fail instead (its request
    ends with a :class:`GrammarError` naming llguidance's error, or a 400 when preparation's first-mask
    check meets it); the rest bound compilation and the lexer's memory. Speeds are llguidance's own
    estimates: lexer fuel about 14 units per microsecond, Earley items about 20 per microsecond.
    """

    step_lexer_fuel: int = 150_000
    """Lexer work of one mask (about 11 ms; llguidance's default is 200 000)."""
    step_max_items: int = 50_000
    """Earley items of one mask (about 2.5 ms; llguidance's default)."""
    max_lexer_states: int = 150_000
    """Lexer states one request may build in all (1 to 2 kB each; llguidance's default is 250 000).
    Both lexer bounds still admit nested repetitions such as ``^(([a-z]{1,60}){1,60})$``."""
    initial_lexer_fuel: int = 1_000_000
    """Lexer work of compiling a grammar (about 20 ms; llguidance's default)."""

    def llguidance(self) -> llguidance.LLParserLimits:
        """These limits as llguidance reads them."""
        return llguidance.LLParserLimits(
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            initial_lexer_fuel=self.initial_lexer_fuel,
        )


def _bits(ids: Sequence[int] | npt.NDArray[np.int64], words: int) -> Mask:
    flags = np.zeros(words * 32, dtype=np.uint8)
    flags[np.asarray(ids, dtype=np.int64)] = 1
    packed = np.packbits(flags, bitorder="little")  # byte k holds ids 8k..8k+7, LSB first
    return packed.view("<u4").astype(np.int32)


class GrammarCompiler:
    """Compiles response formats against one tokenizer; build once at startup and share.

    Args:
        tokenizer: the core's frontend tokenizer.
        sampled_size: ids ``>= sampled_size`` are never sampled (padding of the logits).
        logits_width: width of the logits row; masks have ``ceil(logits_width / 32)`` words.
        eos_token_ids: the core's EOS ids; allowed exactly when the grammar accepts termination.
        limits: the work llguidance may spend on a grammar (:class:`GrammarLimits`).

    Raises:
        ContractError: inconsistent geometry, or a tokenizer llguidance cannot convert.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        sampled_size: int,
        logits_width: int,
        eos_token_ids: Sequence[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        self.limits = limits if limits is not None else GrammarLimits()
        self._llg_limits = self.limits.llguidance()
        if not 1 <= sampled_size <= logits_width:
            raise ContractError(f"sampled_size must lie in [1, logits_width={logits_width}], not {sampled_size}")
        eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        if not eos:
            raise ContractError("structured output needs at least one EOS token id")
        bad = [t for t in eos if not 0 <= t < sampled_size]
        if bad:
            raise ContractError(f"EOS token ids {bad} lie outside the sampled vocabulary [0, {sampled_size})")
        mask_words = (logits_width + 31) // 32
        n_vocab = max(int(tokenizer.get_vocab_size(with_added_tokens=True)), logits_width)
        llg_words = (n_vocab + 31) // 32
        plain = Tokenizer.from_str(_unspellable_specials(tokenizer.to_str()))
        plain.no_padding()
        plain.no_truncation()
        try:
            self._llg = llguidance.LLTokenizer(plain.to_str(), n_vocab=n_vocab, eos_token=list(eos))
        except (ValueError, RuntimeError) as exc:
            raise ContractError(f"llguidance cannot use the frontend tokenizer: {exc}") from exc
        keep = _bits(np.arange(sampled_size), mask_words)
        eos_bits = _bits(eos, mask_words)
        for array in (keep, eos_bits):
            array.flags.writeable = False
        not_eos = ~eos_bits
        not_eos.flags.writeable = False
        self._geometry = _Geometry(
            sampled_size=sampled_size,
            mask_words=mask_words,
            llg_words=llg_words,
            keep=keep,
            eos=eos_bits,
            not_eos=not_eos,
            eos_ids=eos,
        )
        self._any_object: dict[tuple[str, str, str, bool] | None, Grammar] = {}
        self._bare_schemas: dict[str, Grammar] = {}
        """:meth:`schema_grammar`'s grammars by schema text (at most ``_BARE_SCHEMAS``)."""
        added = sorted(
            ((token.content, int(index)) for index, token in tokenizer.get_added_tokens_decoder().items()),
            key=lambda item: -len(item[0]),
        )
        # sampled added tokens by their first character, longest first
        self._added_by_initial: dict[str, list[tuple[str, int]]] = {}
        for content, index in added:
            if content and index < sampled_size:
                self._added_by_initial.setdefault(content[0], []).append((content, index))

    @property
    def mask_words(self) -> int:
        """Words of every mask this compiler's matchers produce."""
        return self._geometry.mask_words

    def vocabulary_mask(self, excluding: Iterable[int] = (), *, only: Iterable[int] | None = None) -> Mask:
        """The sampled vocabulary (or the ids ``only`` of it) without the ids ``excluding``, read-only, in
        the matchers' layout; ids outside the sampled vocabulary are never allowed anyway and are ignored."""
        g = self._geometry
        if only is None and not excluding:
            return g.keep  # read-only already: shared, not copied
        out: Mask = g.keep.copy()
        if only is not None:
            np.bitwise_and(out, _bits([int(t) for t in only if 0 <= int(t) < g.sampled_size], g.mask_words), out=out)
        banned = [int(t) for t in excluding if 0 <= int(t) < g.sampled_size]
        if banned:
            np.bitwise_and(out, ~_bits(banned, g.mask_words), out=out)
        out.flags.writeable = False
        return out

    @property
    def sampled_size(self) -> int:
        """Ids at or above this are never allowed."""
        return self._geometry.sampled_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids, allowed exactly when a grammar accepts termination."""
        return self._geometry.eos_ids

    def owns(self, grammar: Grammar) -> bool:
        """Whether ``grammar`` was compiled by this compiler (its masks fit this vocabulary)."""
        return grammar.geometry is self._geometry

    def compile_prepared(self, text: str) -> Grammar | None:
        """Compile ``PreparedRequest.response_format`` (:func:`read_prepared_format`'s text, envelope and
        frames included); None when it constrains nothing (a ``text`` format).

        Raises:
            PromptError: as :meth:`compile`, or the text is not a prepared format.
        """
        prepared = read_prepared_format(text)
        if prepared.format is None:
            return None
        return self.compile(
            prepared.format,
            reasoning=prepared.reasoning,
            initially_reasoning=prepared.initially_reasoning,
            frames=prepared.frames,
        )

    def compile(
        self,
        fmt: ResponseFormat | ToolCallFormat,
        *,
        reasoning: ct.ReasoningSyntax | None = None,
        initially_reasoning: bool = False,
        frames: AnswerFrames | None = None,
    ) -> Grammar:
        """Compile and validate ``fmt``'s schema now (not at the first token).

        ``reasoning``: the delimited reasoning of the core (see :func:`envelope_reasoning`); the
        grammar then admits a reasoning envelope before the answer. ``initially_reasoning``: the
        prompt opened reasoning, so generation starts inside it (no open marker first).
        ``frames``: the frames a :class:`ResponseFormat` answer is written in.

        Raises:
            PromptError: the schema is not valid JSON, a fragment is malformed, or llguidance
                rejects the grammar (its message).
        """
        key = None
        if reasoning is not None:
            key = (reasoning.open, reasoning.close, reasoning.terminal_marker, initially_reasoning)
        if isinstance(fmt, ToolCallFormat):
            where = "tools" if fmt.choice is None else f"tools ({fmt.choice})"
            rules = self._fragment_rules(fmt.grammar, _CALL_RULE, where)
            try:
                return self._compile_lark(rules, _CALL_RULE, where, reasoning, initially_reasoning)
            except PromptError as exc:
                raise self._tool_schema_error(fmt) or exc from None
        where = "response_format.json_schema.schema" if fmt.kind == "json_schema" else "response_format"
        if frames is not None:
            rules = [*self._fragment_rules(frames.grammar, _FRAMES_RULE, where), self._answer_rule(fmt, where)]
            return self._compile_lark(rules, _FRAMES_RULE, where, None, False)
        cached = self._any_object.get(key)
        if fmt.kind == "json_object" and cached is not None:
            return cached
        if reasoning is None:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(bounded_whitespace(fmt.schema))
            except (ValueError, TypeError) as exc:
                raise PromptError(f"{where}: {exc}") from exc
            compiled = self._matcher_grammar(grammar, where)
        else:
            rules = [self._answer_rule(fmt, where)]
            compiled = self._compile_lark(rules, ANSWER_RULE, where, reasoning, initially_reasoning)
        if fmt.kind == "json_object":
            self._any_object[key] = compiled  # the same grammar for every request: compile it once
        return compiled

    def schema_grammar(self, schema: Mapping[str, Any], where: str) -> Grammar:
        """The grammar of one JSON schema alone: no reasoning envelope, frames or tool syntax around it.

        Where such framing comes first (free reasoning text, a tool block's opener and name), the
        first masks of the whole grammar never reach the schema; preparation also runs the first steps
        of this one so that a schema whose matcher fails at once (a ``$ref`` loop) is refused before
        generation. Kept per distinct schema text (a request's tools are mostly the last one's).

        Raises:
            PromptError: the schema does not compile on its own.
        """
        try:
            key = json.dumps(schema, sort_keys=True)
        except (ValueError, TypeError) as exc:
            raise PromptError(f"{where}: {exc}") from exc
        cached = self._bare_schemas.get(key)
        if cached is not None:
            return cached
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(bounded_whitespace(schema))
        except (ValueError, TypeError) as exc:
            raise PromptError(f"{where}: {_first_line(str(exc))}") from exc
        compiled = self._matcher_grammar(grammar, where)
        if len(self._bare_schemas) >= _BARE_SCHEMAS:
            self._bare_schemas.clear()
        self._bare_schemas[key] = compiled
        return compiled

    @staticmethod
    def _answer_rule(fmt: ResponseFormat, where: str) -> str:
        """``answer: %json SCHEMA``."""
        try:
            return f"{ANSWER_RULE}: %json {json.dumps(bounded_whitespace(fmt.schema))}"
        except (ValueError, TypeError) as exc:
            raise PromptError(f"{where}: {exc}") from exc

    def _tool_schema_error(self, fmt: ToolCallFormat) -> PromptError | None:
        """The refusal naming the first callable function whose parameters schema does not compile on its
        own, or None when each does (the call grammar failed for another reason)."""
        for name, schema in fmt.tools:
            if fmt.choice is not None and name != fmt.choice:
                continue
            where = f"tools: function {name!r} parameters"
            try:
                self.schema_grammar({**schema, "x-guidance": dict(COMPACT_JSON)}, where)
            except PromptError as exc:
                return exc
        return None

    def _fragment_rules(self, fragment: GrammarFragment, entry: str, where: str) -> list[str]:
        """``fragment`` with its ``start`` renamed ``entry``, and a rule for each of its markers.

        Raises:
            PromptError: the fragment does not define ``start`` exactly once, or defines a rule
                the core reserves.
        """
        reserved = _RESERVED.search(fragment.lark)
        if reserved is not None:
            raise PromptError(f"{where}: the syntax's grammar defines {reserved.group(1)!r}, a rule the core reserves")
        lark, count = _START.subn(entry, fragment.lark)
        if count != 1:
            raise PromptError(f"{where}: the syntax's grammar must define the rule 'start' exactly once")
        return [lark, *(f"{name}: {self._marker(text)}" for name, text in fragment.markers)]

    def _compile_lark(
        self,
        rules: list[str],
        body: str,
        where: str,
        reasoning: ct.ReasoningSyntax | None,
        initially_reasoning: bool,
    ) -> Grammar:
        """``start: reasoning? BODY`` (or ``start: BODY`` without a reasoning syntax), then EOS."""
        if reasoning is None:
            head = [f"start: {body}"]
        else:
            forbidden = [reasoning.close] + ([reasoning.terminal_marker] if reasoning.terminal_marker else [])
            spelled = "|".join(regex_literal(text) for text in forbidden)
            opener = "" if initially_reasoning else f"{self._marker(reasoning.open)} "
            head = [
                f"start: helios_thought {body}" if initially_reasoning else f"start: helios_thought? {body}",
                f"helios_thought: {opener}HELIOS_THOUGHT? {self._marker(reasoning.close)} HELIOS_GAP?",
                f"HELIOS_THOUGHT: /(?s:.+)/ & ~/(?s:.*({spelled}).*)/",
                "HELIOS_GAP: /\\n{1,2}/",
            ]
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark("\n".join([*head, *rules]))
        except (ValueError, TypeError) as exc:
            raise PromptError(f"{where}: {_first_line(str(exc))}") from exc
        return self._matcher_grammar(grammar, where)

    def _matcher_grammar(self, grammar: str, where: str) -> Grammar:
        prototype = llguidance.LLMatcher(self._llg, grammar, log_level=0, limits=self._llg_limits)
        if prototype.is_error():
            raise PromptError(f"{where}: {_first_line(prototype.get_error())}")
        return Grammar(prototype=prototype, geometry=self._geometry, source=grammar)

    def _marker(self, text: str) -> str:
        """A Lark term matching ``text``: each added token it spells as that token (the longest at
        each position), the text between them as literal text."""
        terms: list[str] = []
        literal = ""
        at = 0
        while at < len(text):
            token = self._added_at(text, at)
            if token is None:
                literal += text[at]
                at += 1
                continue
            if literal:
                terms.append(json.dumps(literal, ensure_ascii=False))
                literal = ""
            terms.append(f"<[{token[0]}]>")
            at += token[1]
        if literal or not terms:
            terms.append(json.dumps(literal, ensure_ascii=False))
        return terms[0] if len(terms) == 1 else "(" + " ".join(terms) + ")"

    def _added_at(self, text: str, at: int) -> tuple[int, int] | None:
        """(id, length) of the longest sampled added token spelled at ``text[at:]``, or ``None``."""
        for content, token in self._added_by_initial.get(text[at], ()):
            if text.startswith(content, at):
                return token, len(content)
        return None


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated grammar; share it and call :meth:`matcher` per request.

    Built off the model worker (:meth:`GrammarCompiler.compile`); :meth:`matcher` is the only part
    the worker runs (a copy of the prototype: tens of microseconds, whatever the schema's size).
    """

    prototype: Any  # llguidance.LLMatcher in its initial state; only ever deep-copied
    geometry: _Geometry
    source: str  # llguidance's grammar text (diagnostics)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the document."""
        with self._lock:
            copy = self.prototype.deep_copy()
        return GrammarMatcher(copy, self.geometry)


class GrammarMatcher:
    """Per-request grammar state; not thread-safe (one request, one worker at a time).

    Per step: :meth:`mask` (upload to the device), sample, :meth:`advance` with the sampled id.
    """

    def __init__(self, matcher: Any, geometry: _Geometry) -> None:
        self._matcher = matcher
        self._geometry = geometry
        self._scratch: Mask = np.zeros(geometry.llg_words, dtype=np.int32)
        self._mask: Mask | None = None

    def mask(self) -> Mask:
        """Allowed ids of the next token: read-only ``int32 [mask_words]`` in the kernels' layout.

        Cached until the next :meth:`advance`. Raises :class:`GrammarError` if the matcher is in
        an error state.
        """
        if self._mask is None:
            self._mask = self._compute()
        return self._mask

    def _compute(self, matcher: Any = None) -> Mask:
        """The mask of ``matcher`` (this request's own when None) in the kernels' layout."""
        g = self._geometry
        scratch = self._scratch
        matcher = self._matcher if matcher is None else matcher
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():
            raise GrammarError(f"grammar matcher failed: {_first_line(matcher.get_error())}")
        out: Mask = np.bitwise_and(scratch[: g.mask_words], g.keep)
        if matcher.is_accepting():
            np.bitwise_or(out, g.eos, out=out)
        else:
            np.bitwise_and(out, g.not_eos, out=out)
        out.flags.writeable = False
        return out

    def masks_along(self, tokens: Sequence[int]) -> list[Mask]:
        """The masks a speculative lane's positions sample under, without advancing this matcher.

        ``masks[0]`` is :meth:`mask`; ``masks[j]`` the mask after ``tokens[:j]`` were consumed. The walk
        stops before the first token that is an EOS id, lies outside the sampled vocabulary, is not
        allowed where it stands, or leaves a state the matcher cannot continue from (an error, or no id
        allowed): ``len(masks) - 1`` is how many of ``tokens`` may be offered. A copy of the matcher
        advances; this request's grammar state (and its cached mask) is untouched.
        """
        masks = [self.mask()]
        if not tokens:
            return masks
        g = self._geometry
        copy = self._matcher.deep_copy()
        for token_id in tokens:
            token = int(token_id)
            if not 0 <= token < g.sampled_size or token in g.eos_ids:
                break
            if not (int(masks[-1][token >> 5]) >> (token & 31)) & 1:
                break
            if not copy.consume_token(token):
                break
            try:
                following = self._compute(copy)
            except GrammarError:
                break
            if not following.any():
                break
            masks.append(following)
        return masks

    def advance(self, token_id: int) -> None:
        """Consume the sampled ``token_id``.

        Raises:
            GrammarError: the id is outside the sampled vocabulary or not allowed here.
        """
        g = self._geometry
        token = int(token_id)
        if not 0 <= token < g.sampled_size:
            raise GrammarError(f"token id {token} lies outside the sampled vocabulary [0, {g.sampled_size})")
        allowed = self.mask()
        if not (int(allowed[token >> 5]) >> (token & 31)) & 1:
            raise GrammarError(f"token id {token} is not allowed by the response grammar at this point")
        if not self._matcher.consume_token(token):
            raise GrammarError(f"grammar rejected token id {token}: {_first_line(self._matcher.get_error())}")
        self._mask = None

    @property
    def is_accepting(self) -> bool:
        """Whether the document so far is complete (EOS may end it)."""
        return bool(self._matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """Whether nothing but EOS can follow: the matcher stopped, or it accepts and only EOS is allowed."""
        if self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        return bool(np.array_equal(self.mask(), self._geometry.eos))


ANSWER_WHITESPACE: Mapping[str, Any] = {"whitespace_flexible": True, "whitespace_pattern": r"(\r?\n)?[ \t]{0,32}"}
"""The whitespace a constrained answer's JSON may hold between two of its tokens: at most one line break and
32 spaces or tabs (compact and pretty-printed JSON both fit), so a sampler cannot fill the output with
whitespace (llguidance's default admits any amount)."""


def bounded_whitespace(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with :data:`ANSWER_WHITESPACE` under its ``x-guidance`` key, unless the schema sets
    llguidance's options itself (its own ``x-guidance`` is used as it is)."""
    if "x-guidance" in schema:
        return dict(schema)
    return {**schema, "x-guidance": dict(ANSWER_WHITESPACE)}


def _first_line(message: str) -> str:
    """llguidance errors append a multi-line parser dump; keep the human-readable first line, completed by
    the dump's ``error: ...`` line where the first one only introduces it (``regex parse error:``)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown llguidance error"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    if lines[0].endswith(":") and detail is not None:
        return f"{lines[0]} {detail.removeprefix('error:').strip()}"
    return lines[0]
