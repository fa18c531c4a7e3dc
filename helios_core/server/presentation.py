"""Presentation: engine events to OpenAI ``chat.completion`` and ``text_completion`` JSON and SSE.

Owns one presenter per response: :class:`Presenter` for chat, :class:`CompletionPresenter` for legacy
completions (described at the end). The chat :class:`Presenter` It feeds each token event's released pieces (EOS pieces
dropped, they are termination, not text) through the request's ``OutputPipeline`` (reasoning and
tool parsers) and shapes the deltas:

* content, ``reasoning_content`` and ``tool_calls`` (a streamed call sends ``id``, ``type`` and
  ``name`` once in its first fragment, then argument fragments);
* ``finish_reason``: ``length`` at the output limit; ``tool_calls`` when the model ended (EOS) after
  parsed calls; ``stop`` otherwise, including a host stop (string or token stop) after calls;
* observation (``return_token_ids``): JSON adds top-level ``prompt_token_ids`` and
  ``choices[0].token_ids``; SSE sends the prompt ids in the first chunk and one metadata-only
  chunk per generated id (``delta={}``, ``choices[0].token_ids=[id]``, plus
  ``token_timestamps_ns=[t]`` when timed); text deltas carry no ids. Observed terminal responses
  carry ``reused_prompt_tokens`` and usage; timed ones a top-level ``performance`` object;
* logprobs (``logprobs: true``): ``choices[0].logprobs.content`` holds one entry per *presented*
  token, ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``: ``token`` is the
  token's presented text (so the entries concatenate to the released text), alternatives are the
  tokenizer's decoding of their single id. EOS tokens and tokens swallowed by a matched stop are
  never presented and have no entry. In SSE an entry rides on the first delta chunk sent after its
  token is released (a token held by a possible stop gets its entry when the stop is ruled out and
  its text is released); entries whose text produced no delta ride on the next delta chunk or, at
  the end, on the terminal choice chunk;
* prompt logprobs (``prompt_logprobs: 0``): a top-level ``prompt_logprobs`` list aligned with the
  prompt ids (``null`` for the first token, then each token's logprob given its prefix), in the
  JSON body or in the first SSE chunk;
* usage: always in JSON; in SSE a final usage-only chunk (``choices=[]``) when
  ``stream_options.include_usage`` (earlier chunks ``usage: null``), else on the observed terminal
  choice chunk.

Every SSE ``data:`` payload is one line whatever the text: JSON escapes ``\\r``, ``\\n`` and the
other control characters, and :func:`sse_json` also escapes U+0085, U+2028 and U+2029, which some
line splitters (Python's ``str.splitlines``, for one) treat as line ends.

Legacy completions (:class:`CompletionPresenter`) present plain text: the released pieces (EOS
pieces dropped) concatenate, no reasoning or tool parser runs. ``choices[0]`` is ``{index, text,
logprobs, finish_reason}`` (``length`` at the output limit, else ``stop``); with echo the prompt text
comes first (JSON: in ``text``; SSE: one chunk before the generated text). Logprobs take the legacy
form ``{tokens, token_logprobs, top_logprobs, text_offset}``: one position per presented token (its
presented text, so the tokens concatenate to the generated text), ``top_logprobs`` a dict of the
alternatives' texts (the tokenizer's decoding of each id) and the sampled token's presented text,
``text_offset`` the character offset of the token's text in the choice's whole text (echo
included). Echoed prompt tokens come first: the text each prompt id completes, ``null`` logprob and
top dict for the first, then each token's logprob given its prefix (its dict holds only itself).
In SSE the positions ride on the chunk carrying their text (those whose text is empty on the next
text chunk, or the terminal chunk); chunks are ``text_completion`` objects and the usage chunk
(``choices: []``) follows the terminal chunk when ``stream_options.include_usage``. Observation
(``return_token_ids``, timestamps) takes chat's shapes except that the prompt's ids, and the prompt logprobs
a completion asks for, ride in the choice (``choices[0].prompt_token_ids``, ``choices[0].prompt_logprobs``;
SSE: the first chunk's choice), where vLLM's completions put them; a generated id's own chunk has ``text: ""``.

Errors are not presented here: the app raises them (JSON) or turns them into one SSE error event
through :mod:`helios_core.server.errors`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
from tokenizers import Tokenizer

from helios_core.plugin_api import GeneratedPiece, OutputDelta, OutputPipeline, ParsedOutput
from helios_core.runtime.messages import Finished, Piece, PromptScores, TokenEvent
from helios_core.server.preparation import Frontend, Prepared, prompt_pieces

__all__ = ["CompletionPresenter", "Presenter", "ResponsePresenter", "sse_data", "sse_error", "sse_json"]

_ENCODER = msgspec.json.Encoder()

_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))
"""UTF-8 of the characters JSON leaves raw that line splitters may break at, and their JSON escapes.
The encoded JSON is valid UTF-8, so each byte sequence is exactly that character, inside a string."""


def sse_json(payload: Any) -> bytes:
    """``payload`` as JSON that is one line for every line splitter."""
    data = _ENCODER.encode(payload)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse_data(payload: Any) -> bytes:
    """One SSE ``data:`` event."""
    return b"data: " + sse_json(payload) + b"\n\n"


def sse_error(body: dict[str, Any]) -> bytes:
    """The terminal SSE ``error`` event (no ``[DONE]`` follows it)."""
    return b"event: error\ndata: " + sse_json(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

_NULL = b"null"
_CONTENT = b'"delta":{"content":'
_CHAT_TAIL = b'},"logprobs":null,"finish_reason":null'


class _EventPresenter:
    """What every response's presenter shares: observed tokens, logprob matching, usage."""

    _before: bytes
    _after: bytes
    """A one-choice SSE chunk's constant bytes around its choice fields (set by ``_start``: :meth:`_chunk_frame`)."""

    def __init__(
        self,
        prepared: Prepared,
        frontend: Frontend,
        *,
        response_id: str,
        created: int,
        model: str,
        ingress_ns: int,
        enqueue_ns: int,
        choice_index: int = 0,
        closes: bool = True,
    ) -> None:
        """``choice_index``: the choice this presenter writes (``n`` > 1: one presenter a choice);
        ``closes``: its stream's last chunks end the response (the usage chunk and ``[DONE]``). With
        several choices none closes: the service ends the response once every choice finished."""
        self._prepared = prepared
        self.index = choice_index
        self._closes = closes
        self.finished: Finished | None = None
        """The request's terminal event, once presented (its usage counts in a response of several choices)."""
        self._hidden_ids = frozenset() if prepared.request.ignore_eos else frontend.eos_token_ids
        self._id = response_id
        self._created = created
        self._model = model
        self._ingress_ns = ingress_ns
        self._enqueue_ns = enqueue_ns
        self.token_ids: list[int] = []
        self.timestamps: list[int] = []
        self._last_token: int | None = None
        self._tokenizer: Tokenizer = frontend.bootstrap.tokenizer
        self._unpresented: deque[TokenEvent] = deque()
        """Observed token events whose pieces are not presented yet (logprobs only)."""
        self._prompt_logprobs: list[float | None] | None = None
        self._start(prepared, frontend)

    def _chunk_frame(self, object_name: str) -> tuple[bytes, bytes]:
        """The constant bytes around a one-choice SSE chunk's choice fields: everything before the
        choice's second key (``data: {"id":...,"choices":[{"index":0,``) and everything after its
        last (``}]``, ``"usage":null`` when the usage comes last, the closing brace and the blank
        line). Joined around the choice's fields they are byte for byte :func:`sse_data` of the whole
        chunk, whose key order they keep; only the changing fields are encoded per chunk."""
        header = sse_json({"id": self._id, "object": object_name, "created": self._created, "model": self._model})
        before = b"data: " + header[:-1] + b',"choices":[{"index":%d,' % self.index
        after = b'}],"usage":null}\n\n' if self._prepared.include_usage else b"}]}\n\n"
        return before, after

    def _start(self, prepared: Prepared, frontend: Frontend) -> None:
        """The state a kind of response adds (called last by the constructor)."""

    def _tail(self) -> bytes:
        """The bytes after a one-choice chunk's choice fields: :meth:`_chunk_frame`'s, or with
        ``continuous_usage_stats`` the usage so far in place of ``null``."""
        if not self._prepared.continuous_usage:
            return self._after
        return b'}],"usage":' + sse_json(self._running_usage()) + b"}\n\n"

    def _running_usage(self) -> dict[str, int]:
        """The usage so far (``stream_options.continuous_usage_stats``): the prompt and the tokens observed."""
        prompt = len(self._prepared.request.prompt_ids)
        completion = len(self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _pieces(self, pieces: Sequence[Piece]) -> list[GeneratedPiece]:
        return [GeneratedPiece(token_id, text) for token_id, text in pieces if token_id not in self._hidden_ids]

    def _observe(self, event: TokenEvent) -> None:
        self.token_ids.append(event.token_id)
        self.timestamps.append(event.timestamp_ns)
        self._last_token = event.token_id
        if self._prepared.logprobs:
            self._unpresented.append(event)

    def prompt_scores(self, event: PromptScores) -> None:
        """Take the prompt's scores (before the first token)."""
        self._prompt_logprobs = [None, *event.scores]

    def _presented_event(self, token_id: int) -> TokenEvent | None:
        """The observed event of a presented piece's token (events are matched in order; an event no
        presented piece claims, a token swallowed by a stop, is passed over), None if there is none."""
        while self._unpresented:
            candidate = self._unpresented.popleft()
            if candidate.token_id == token_id:
                return candidate
        return None

    def _alternative_text(self, token_id: int) -> str:
        """An alternative's text: the tokenizer's decoding of its single id (special tokens kept)."""
        text: str = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _usage(self, finished: Finished) -> dict[str, Any]:
        return usage([finished])

    def _observe_generated(self, body: dict[str, Any], choice: dict[str, Any], finished: Finished) -> None:
        """A JSON response's observation of its generation: ``choice`` takes the generated ids (and their
        timestamps), ``body`` the reused prompt tokens (and ``performance``)."""
        prepared = self._prepared
        if prepared.return_token_ids:
            choice["token_ids"] = self.token_ids
            body["reused_prompt_tokens"] = finished.reused_prompt_tokens
        if prepared.return_token_timestamps:
            choice["token_timestamps_ns"] = self.timestamps
            body["performance"] = self._performance(finished)

    def _terminal_observation(self, finished: Finished) -> dict[str, Any]:
        """The top-level fields an observed stream's terminal chunk adds: ``reused_prompt_tokens`` and the usage
        (unless a usage chunk follows) with ``return_token_ids``, ``performance`` with timestamps."""
        prepared = self._prepared
        extra: dict[str, Any] = {}
        if prepared.return_token_ids:
            extra["reused_prompt_tokens"] = finished.reused_prompt_tokens
            if not prepared.include_usage and self._closes:
                extra["usage"] = self._usage(finished)
        if prepared.return_token_timestamps:
            extra["performance"] = self._performance(finished)
        return extra

    def _observed_chunk(self, event: TokenEvent, empty_choice: bytes) -> bytes:
        """The chunk observing one generated id: the choice's ``empty_choice`` fields, ``token_ids`` and, when
        timed, ``token_timestamps_ns``."""
        observed = empty_choice + b',"token_ids":[%d]' % event.token_id
        if self._prepared.return_token_timestamps:
            observed += b',"token_timestamps_ns":[%d]' % event.timestamp_ns
        return self._before + observed + self._tail()

    def stream_close(self, presenters: Sequence[_EventPresenter]) -> list[bytes]:
        """The chunks that end a stream once every choice (``presenters``, each finished) ended: the usage
        chunk of them all (with ``stream_options.include_usage``, or an observed stream of several choices,
        whose terminal chunks carry none) and ``[DONE]``."""
        out: list[bytes] = []
        if self._prepared.include_usage or (self._prepared.return_token_ids and not self._closes):
            out.append(self._usage_chunk(usage(_finished(presenters))))
        out.append(SSE_DONE)
        return out

    def _usage_chunk(self, totals: dict[str, Any]) -> bytes:
        """The chunk carrying the response's usage (``choices: []``)."""
        raise NotImplementedError

    def _performance(self, finished: Finished) -> dict[str, int]:
        return {
            "ingress_ns": self._ingress_ns,
            "enqueue_ns": self._enqueue_ns,
            "reused_prompt_tokens": finished.reused_prompt_tokens,
        }


class Presenter(_EventPresenter):
    """Turns one chat request's events into its OpenAI response."""

    def _start(self, prepared: Prepared, frontend: Frontend) -> None:
        self._pipeline: OutputPipeline = prepared.pipeline(frontend)
        self._calls_started: set[int] = set()
        self._logprobs: list[dict[str, Any]] = []
        """JSON: every entry; SSE: entries not yet sent on a chunk."""
        self._before, self._after = self._chunk_frame("chat.completion.chunk")

    # -- shared -----------------------------------------------------------------------------------
    def _present_logprobs(self, pieces: Sequence[Piece]) -> None:
        """Queue the logprob entries of the presented pieces (matched to their token events in order)."""
        if not self._prepared.logprobs:
            return
        for token_id, text in pieces:
            if token_id < 0 or token_id in self._hidden_ids:
                continue  # released tail text of earlier tokens, or EOS (text of tokens before it may follow)
            event = self._presented_event(token_id)
            if event is None:
                continue
            entry = _logprob_entry(text, event.logprob)
            entry["top_logprobs"] = [_logprob_entry(self._alternative_text(alt), logprob) for alt, logprob in event.top]
            self._logprobs.append(entry)

    def _choice_logprobs(self) -> dict[str, Any] | None:
        """Take the queued entries as a choice's ``logprobs`` (None when logprobs are off or none are queued)."""
        if not self._logprobs:
            return None
        entries, self._logprobs = self._logprobs, []
        return {"content": entries, "refusal": None}

    def _finish_reason(self, finished: Finished, hint: str) -> str:
        if finished.reason == "length":
            return "length"
        ended_by_eos = self._last_token is not None and self._last_token in self._hidden_ids
        if hint == "tool_calls" and ended_by_eos:
            return "tool_calls"
        return "stop"

    # -- JSON -------------------------------------------------------------------------------------
    def collect(self, event: TokenEvent) -> None:
        """Non-stream: take one token event."""
        self._observe(event)
        self._present_logprobs(event.pieces)
        self._pipeline.feed(self._pieces(event.pieces))

    def completion(self, finished: Finished) -> dict[str, Any]:
        """Non-stream: the ``chat.completion`` object after the terminal event."""
        self.finished = finished
        self._present_logprobs(finished.pieces)
        self._pipeline.feed(self._pieces(finished.pieces))
        result = self._pipeline.finish()
        message = _message(result.output)
        logprobs = self._choice_logprobs()
        if self._prepared.logprobs and logprobs is None:
            logprobs = {"content": [], "refusal": None}
        choice: dict[str, Any] = {
            "index": self.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(finished, result.finish_hint),
        }
        body: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "usage": self._usage(finished),
        }
        if self._prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs
        if self._prepared.return_token_ids:
            body["prompt_token_ids"] = list(self._prepared.request.prompt_ids)
        self._observe_generated(body, choice, finished)
        return body

    # -- SSE --------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self._prepared.include_usage:
            chunk["usage"] = self._running_usage() if self._prepared.continuous_usage else None
        chunk.update(extra)
        return chunk

    def _choice(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        choice.update(extra)
        return choice

    def first_chunk(self) -> bytes:
        """The opening chunk: the assistant role (and the prompt ids when observed; with several choices,
        the prompt's fields on the first choice's opening chunk only, as JSON has them once)."""
        extra: dict[str, Any] = {}
        if self._prepared.return_token_ids and self.index == 0:
            extra["prompt_token_ids"] = list(self._prepared.request.prompt_ids)
        if self._prompt_logprobs is not None and self.index == 0:
            extra["prompt_logprobs"] = self._prompt_logprobs
        return sse_data(self._chunk([self._choice({"role": "assistant", "content": ""})], **extra))

    def stream_token(self, event: TokenEvent) -> list[bytes]:
        """The chunks of one token event: its id observation, then its text deltas."""
        self._observe(event)
        out: list[bytes] = []
        if self._prepared.return_token_ids:  # {"delta":{},...,"token_ids":[id]} (and its timestamp)
            out.append(self._observed_chunk(event, b'"delta":{},"logprobs":null,"finish_reason":null'))
        self._present_logprobs(event.pieces)
        out.extend(self._delta_chunks(self._pipeline.feed(self._pieces(event.pieces))))
        return out

    def stream_finish(self, finished: Finished) -> list[bytes]:
        """The last chunks: remaining deltas, the terminal choice chunk, usage, ``[DONE]``."""
        self._present_logprobs(finished.pieces)
        deltas = self._pipeline.feed(self._pieces(finished.pieces))
        result = self._pipeline.finish()
        out = self._delta_chunks([*deltas, *result.deltas])
        extra = self._terminal_observation(finished)
        terminal = self._choice({}, self._finish_reason(finished, result.finish_hint))
        terminal["logprobs"] = self._choice_logprobs()  # entries no delta carried
        out.append(sse_data(self._chunk([terminal], **extra)))
        self.finished = finished
        if self._closes:
            out.extend(self.stream_close([self]))
        return out

    def _usage_chunk(self, totals: dict[str, Any]) -> bytes:
        return sse_data(self._chunk([], usage=totals))

    def _delta_chunks(self, deltas: list[OutputDelta]) -> list[bytes]:
        chunks = []
        for delta in deltas:
            fields = self._delta(delta)
            if not delta.tool_calls and len(fields) == 1 and "content" in fields and not self._logprobs:
                # the common chunk, a content delta without logprobs: only the text is encoded
                chunks.append(self._before + _CONTENT + sse_json(delta.content) + _CHAT_TAIL + self._tail())
                continue
            logprobs = self._choice_logprobs()
            encoded = _NULL if logprobs is None else sse_json(logprobs)
            body = b'"delta":' + sse_json(fields) + b',"logprobs":' + encoded + b',"finish_reason":null'
            chunks.append(self._before + body + self._tail())
        return chunks

    def _delta(self, delta: OutputDelta) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.content:
            out["content"] = delta.content
        if delta.tool_calls:
            calls: dict[int, dict[str, Any]] = {}  # one entry a call in a chunk, its pieces' arguments joined
            for piece in delta.tool_calls:
                entry = calls.get(piece.index)
                if entry is not None:
                    entry["function"]["arguments"] += piece.arguments
                elif piece.index not in self._calls_started and piece.id is not None:
                    self._calls_started.add(piece.index)
                    calls[piece.index] = {
                        "index": piece.index,
                        "id": piece.id,
                        "type": "function",
                        "function": {"name": piece.name, "arguments": piece.arguments},
                    }
                else:
                    calls[piece.index] = {"index": piece.index, "function": {"arguments": piece.arguments}}
            out["tool_calls"] = list(calls.values())
        return out


class _Position(NamedTuple):
    """One token's place in legacy logprobs."""

    token: str
    logprob: float | None
    top: dict[str, float] | None
    offset: int


class CompletionPresenter(_EventPresenter):
    """Turns one legacy completions request's events into its ``text_completion`` response."""

    def _start(self, prepared: Prepared, frontend: Frontend) -> None:
        self._frontend = frontend
        self._echo = prepared.echo or ""
        self._texts: list[str] = []
        """The generated text presented so far, piece by piece."""
        self._length = len(self._echo)
        """Characters of the choice's text so far (the echo included): the next token's offset."""
        self._positions: list[_Position] = []
        """JSON: every generated position; SSE: positions not yet sent on a chunk."""
        self._before, self._after = self._chunk_frame("text_completion")

    def _feed(self, pieces: Sequence[Piece]) -> str:
        """Present ``pieces``: their text (EOS pieces dropped), their logprob positions queued."""
        texts: list[str] = []
        for token_id, text in pieces:
            if token_id in self._hidden_ids:
                continue
            event = self._presented_event(token_id) if self._prepared.logprobs and token_id >= 0 else None
            if event is not None:
                position = _Position(text, _reported(event.logprob), self._top(text, event), self._length)
                self._positions.append(position)
            texts.append(text)
            self._length += len(text)
        joined = "".join(texts)
        self._texts.append(joined)
        return joined

    def _top(self, text: str, event: TokenEvent) -> dict[str, float]:
        top: dict[str, float] = {}
        for alternative, logprob in event.top:
            top.setdefault(self._alternative_text(alternative), _reported(logprob))
        top.setdefault(text, _reported(event.logprob))
        return top

    def _prompt_positions(self) -> list[_Position]:
        """The echoed prompt's positions (echo with logprobs only; the scores arrived first)."""
        scores = self._prompt_logprobs
        if scores is None or self._prepared.echo is None:
            return []
        positions = []
        offset = 0
        for piece, score in zip(prompt_pieces(self._frontend, self._prepared.request.prompt_ids), scores, strict=True):
            positions.append(_Position(piece, score, None if score is None else {piece: score}, offset))
            offset += len(piece)
        return positions

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The queued positions in legacy form (None when none are queued)."""
        if not self._positions:
            return None
        positions, self._positions = self._positions, []
        return _legacy_logprobs(positions)

    def _finish_reason(self, finished: Finished) -> str:
        return "length" if finished.reason == "length" else "stop"

    # -- JSON -------------------------------------------------------------------------------------
    def collect(self, event: TokenEvent) -> None:
        """Non-stream: take one token event."""
        self._observe(event)
        self._feed(event.pieces)

    def completion(self, finished: Finished) -> dict[str, Any]:
        """Non-stream: the ``text_completion`` object after the terminal event."""
        self.finished = finished
        self._feed(finished.pieces)
        logprobs = None
        if self._prepared.logprobs:
            logprobs = _legacy_logprobs([*self._prompt_positions(), *self._positions])
        choice: dict[str, Any] = {
            "index": self.index,
            "text": self._echo + "".join(self._texts),
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(finished),
        }
        choice.update(self._prompt_observation())
        body: dict[str, Any] = {
            "id": self._id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "usage": self._usage(finished),
        }
        self._observe_generated(body, choice, finished)
        return body

    def _prompt_observation(self) -> dict[str, Any]:
        """The choice fields about the prompt: ``prompt_token_ids`` (``return_token_ids``) and
        ``prompt_logprobs`` (asked with ``prompt_logprobs``), as vLLM's completions place them."""
        fields: dict[str, Any] = {}
        if self._prepared.return_token_ids:
            fields["prompt_token_ids"] = list(self._prepared.request.prompt_ids)
        if self._prepared.choice_prompt_logprobs:
            fields["prompt_logprobs"] = self._prompt_logprobs
        return fields

    # -- SSE --------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self._prepared.include_usage:
            chunk["usage"] = self._running_usage() if self._prepared.continuous_usage else None
        chunk.update(extra)
        return sse_data(chunk)

    def _choice(self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_chunk(self) -> bytes:
        """The echoed prompt's chunk (with its logprobs when asked) and the prompt's observation fields;
        nothing without echo or observation."""
        observation = self._prompt_observation()
        if self._prepared.echo is None and not observation:
            return b""
        echoed = self._prepared.echo is not None
        logprobs = _legacy_logprobs(self._prompt_positions()) if self._prepared.logprobs and echoed else None
        return self._chunk([{**self._choice(self._echo, logprobs), **observation}])

    def stream_token(self, event: TokenEvent) -> list[bytes]:
        """The chunks of one token event: its id observation, then its released text (none while nothing is
        released)."""
        self._observe(event)
        out: list[bytes] = []
        if self._prepared.return_token_ids:  # {"text":"",...,"token_ids":[id]} (and its timestamp)
            out.append(self._observed_chunk(event, b'"text":"","logprobs":null,"finish_reason":null'))
        text = self._feed(event.pieces)
        if text:
            out.append(self._text_chunk(text))
        return out

    def _text_chunk(self, text: str) -> bytes:
        """The chunk of released text (and the queued positions): :meth:`_chunk` of its choice, with only
        the changing fields encoded."""
        logprobs = self._take_logprobs()
        encoded = _NULL if logprobs is None else sse_json(logprobs)
        body = b'"text":' + sse_json(text) + b',"logprobs":' + encoded + b',"finish_reason":null'
        return self._before + body + self._tail()

    def stream_finish(self, finished: Finished) -> list[bytes]:
        """The last chunks: remaining text, the terminal choice chunk, usage, ``[DONE]``."""
        text = self._feed(finished.pieces)
        out = [self._text_chunk(text)] if text else []
        extra = self._terminal_observation(finished)
        terminal = self._choice("", self._take_logprobs(), self._finish_reason(finished))
        out.append(self._chunk([terminal], **extra))
        self.finished = finished
        if self._closes:
            out.extend(self.stream_close([self]))
        return out

    def _usage_chunk(self, totals: dict[str, Any]) -> bytes:
        return self._chunk([], usage=totals)


ResponsePresenter = Presenter | CompletionPresenter
"""The presenter of any response the service delivers."""


def usage(ended: Sequence[Finished]) -> dict[str, Any]:
    """A response's ``usage`` over its choices' terminal events: the prompt once (and the first choice's
    reused prompt tokens), the completion tokens of every choice."""
    first = ended[0]
    completion = sum(finished.completion_tokens for finished in ended)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.reused_prompt_tokens},
    }


def _finished(presenters: Sequence[_EventPresenter]) -> list[Finished]:
    ended = [presenter.finished for presenter in presenters]
    if any(finished is None for finished in ended):
        raise ValueError("a response's usage needs every choice's terminal event")
    return [finished for finished in ended if finished is not None]


def merge_choices(bodies: Sequence[dict[str, Any]], presenters: Sequence[ResponsePresenter]) -> dict[str, Any]:
    """One JSON response of several choices: the first body's fields, every body's choice (in index order),
    the usage of them all."""
    merged = dict(bodies[0])
    merged["choices"] = [choice for body in bodies for choice in body["choices"]]
    merged["usage"] = usage(_finished(presenters))
    return merged


def _legacy_logprobs(positions: list[_Position]) -> dict[str, Any]:
    return {
        "tokens": [position.token for position in positions],
        "token_logprobs": [position.logprob for position in positions],
        "top_logprobs": [position.top for position in positions],
        "text_offset": [position.offset for position in positions],
    }


LOGPROB_FLOOR = -9999.0
"""The logprob reported for an id the distribution rules out (a grammar-masked alternative: -inf), so
every reported logprob is a JSON number, as vLLM reports it."""


def _reported(logprob: float) -> float:
    """``logprob`` as reported: at least :data:`LOGPROB_FLOOR`."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _logprob_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _reported(logprob), "bytes": list(text.encode("utf-8"))}


def _message(output: ParsedOutput) -> dict[str, Any]:
    # OpenAI's content is null beside tool calls only: an empty answer without calls is ""
    content = output.content if output.content is not None or output.tool_calls else ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if output.reasoning is not None:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in output.tool_calls
        ]
    return message
