"""The message channel between the server side and the model worker.

Owns the msgspec structs that cross that boundary: the prepared request the
frontend hands to the worker, and the events the worker sends back. Nothing
else crosses it, so the worker can run in a thread or its own process
without either side changing. Terminal events keep distinct kinds: a normal
finish (EOS, output limit, host stop, cancellation), an admission rejection
and an execution failure never share a type, so no status code is ever
derived from error text. A steady decode round's tokens cross once for the
whole round (:class:`RoundTokens`); each request stream expands its own lane
into the :class:`TokenEvent` it stands for, so readers see the same events. A prompt's images cross as
:class:`PromptImage` spans with their vision tensors as bytes (:class:`ImageTensor`). The request's sampling
settings (:class:`~helios_core.sampling.SamplingParams`, re-exported here) are defined in
:mod:`helios_core.sampling`, which the frontend imports too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from helios_core.contract.boundaries import PromptLayout
from helios_core.sampling import SamplingParams as SamplingParams  # defined below the frontend

FinishReason = Literal["stop", "length", "cancelled"]


class ImageTensor(msgspec.Struct, frozen=True, gc=False):
    """One named vision tensor of one image (an ``IMAGE_TENSOR`` output of the image layout), as bytes
    so that it crosses a process boundary; its leading axis has one row per patch of the image."""

    name: str
    dtype: str
    """numpy dtype name (``float32``, ``int32``)."""
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, name: str, array: npt.NDArray[Any]) -> ImageTensor:
        contiguous = np.ascontiguousarray(array)
        return cls(name, contiguous.dtype.name, list(contiguous.shape), contiguous.tobytes())

    def array(self) -> npt.NDArray[Any]:
        """The tensor as a read-only numpy array."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class PromptImage(msgspec.Struct, frozen=True, gc=False):
    """One image of a prompt after layout: an atomic span of prompt tokens and what feeds its features."""

    start: int
    """Index into ``prompt_ids`` of the span's first token."""
    length: int
    """Tokens of the span (never split by a prefill chunk or a prefix-reuse cut)."""
    feature_tokens: list[int]
    """Offsets into the span of the tokens that receive image features, in feature order."""
    patch_count: int
    """Leading rows of each tensor."""
    digest: bytes
    """The image content's identity: prefix reuse of the span's tokens requires the same digest."""
    tensors: list[ImageTensor]

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def feature_count(self) -> int:
        return len(self.feature_tokens)


class PreparedRequest(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A request after frontend preparation: ids, limits and sampling, ready for admission."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    ignore_eos: bool = False
    min_tokens: int = 0
    """The first this many output tokens are never an EOS id or a single-id token stop (they are masked out
    where they would be sampled), and no stop is looked for in them (vLLM-style)."""
    banned_ids: list[int] = []
    """Ids never sampled (``logit_bias`` -100): masked out of every round."""
    only_ids: list[int] = []
    """When not empty, the only ids sampled (``logit_bias`` 100): every other id is masked out of every round."""
    skip_special_tokens: bool = True
    """Generated special tokens that are no part of the core's output syntax have no text (vLLM-style)."""
    string_stops: list[str] = []
    """Validated string stops (at most four)."""
    token_stops: list[list[int]] = []
    """Validated stop token sequences (single ids are sequences of one)."""
    response_format: str | None = None
    """A validated structured-output format as JSON text (what :attr:`grammar` was compiled from)."""
    observe_timestamps: bool = False
    """Stamp each generated token (host monotonic nanoseconds from the runtime origin)."""
    top_logprobs: int = -1
    """Top alternatives to report per generated token (0 up to the programs' ``top_n``); -1 = not requested."""
    prompt_logprobs: bool = False
    """Score every prompt token given its prefix (scored prefill; disables prefix reuse for the request)."""
    grammar: Any = None
    """``response_format`` compiled off the model worker: a :class:`helios_core.frontend.structured.Grammar`
    of the engine's grammar compiler, set by preparation, else by ``Engine.submit`` on its caller's
    thread. The worker only instantiates a matcher from it. It lives in this process alone and does not
    encode: a request that crosses a process boundary goes without it (``msgspec.structs.replace(request,
    grammar=None)``) and is compiled again from ``response_format`` where it is submitted."""
    layout: PromptLayout | None = None
    """The rendered chat prompt's structure (message roles and ends, tools, stripped reasoning, a continued
    assistant message), set by chat preparation; None for a prompt no template rendered (a raw completion
    prompt, token ids). The scheduler cuts prefix reuse at the boundaries the core's rules allow for it and
    resumes a continued assistant message's content (:meth:`Scheduler.add
    <helios_core.runtime.scheduler.Scheduler.add>`)."""
    images: list[PromptImage] = []
    """The prompt's images in prompt order (non-overlapping spans of ``prompt_ids``); empty for text."""


Piece = tuple[int, str]
"""A presented token id and the text it completes (after stop handling)."""


class TokenEvent(msgspec.Struct, frozen=True, tag="token", gc=False):
    """One generated token, in order, with what it releases for presentation.

    ``token_id`` is the raw sampled id (observation and usage count every one, EOS and stop tokens
    included). ``pieces`` are the (id, text) pairs presentation may show now: usually this token,
    nothing while a possible stop is buffered, several when a buffered prefix is released.

    The pieces and the top alternatives are tuples of numbers and strings, which the cyclic collector
    stops tracking at its first pass: events a slow reader leaves queued (a quarter of a million at 256
    requests of a thousand tokens) then cost the collector's full passes nothing, and those passes run
    on whichever thread allocates, the model worker's included.
    """

    request_id: str
    token_id: int
    logprob: float
    pieces: tuple[Piece, ...] = ()
    timestamp_ns: int = -1
    top: tuple[tuple[int, float], ...] = ()
    """The top alternatives (id, logprob), best first, when the request asked for them."""


class PromptScores(msgspec.Struct, frozen=True, tag="prompt_scores", gc=False):
    """The prompt's target logprobs, sent once before the first token when ``prompt_logprobs`` was asked.

    ``scores[i]`` is the logprob of prompt token ``i + 1`` given tokens ``0..i`` (so ``len = prompt - 1``).
    """

    request_id: str
    scores: list[float]


class Finished(msgspec.Struct, frozen=True, tag="finished", gc=False):
    """The request ended normally; ``reason`` says how."""

    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    reused_prompt_tokens: int = 0
    pieces: list[Piece] = []
    """Text released at termination (an unmatched stop prefix flushed on EOS or the output limit)."""


class AdmissionRejected(msgspec.Struct, frozen=True, tag="rejected", gc=False):
    """The request lies outside the prepared capacities; other requests are unaffected."""

    request_id: str
    message: str
    param: str | None = None
    """The request field a client changes to fit (``max_tokens``, ``messages``), when one does."""
    permanent: bool = False
    """Resending the same request can never succeed (a capacity of the core, not a passing shortage)."""


class ExecutionFailed(msgspec.Struct, frozen=True, tag="failed", gc=False):
    """Model execution, device or output validation failed for this request."""

    request_id: str
    message: str


Event = TokenEvent | PromptScores | Finished | AdmissionRejected | ExecutionFailed
TERMINAL_EVENTS = (Finished, AdmissionRejected, ExecutionFailed)


class RoundTokens(msgspec.Struct, frozen=True, gc=False):
    """One decode round's tokens for every request of its cohort, delivered once per round.

    The worker puts this one object on the stream of every request in ``lanes``; each stream reads
    its own lane and yields the :class:`TokenEvent` it stands for (:meth:`event`): the lane's token,
    its logprob and the one piece ``(token, text)``, no timestamp and no top alternatives. Building
    the per-request events thus happens on the reader's side, not on the worker's. Only rounds whose
    every lane presents exactly that are delivered this way; the lists are never modified.
    """

    lanes: dict[str, int]
    """Each request's lane index (shared by the rounds of one cohort)."""
    token_ids: list[int]
    logprobs: list[float]
    texts: list[str] | None
    """The text each lane's token completes in the worker; None when every lane's is empty."""

    def event(self, request_id: str, text: Callable[[int], str] | None = None) -> TokenEvent:
        """The TokenEvent of ``request_id``'s lane; its text from ``text`` when given (a stream that
        detokenizes its request's tokens itself), else from the round."""
        lane = self.lanes[request_id]
        token = self.token_ids[lane]
        if text is not None:
            return TokenEvent(request_id, token, self.logprobs[lane], ((token, text(token)),), -1)
        piece = self.texts[lane] if self.texts is not None else ""
        return TokenEvent(request_id, token, self.logprobs[lane], ((token, piece),), -1)


Outgoing = Event | RoundTokens
"""What the worker publishes to request streams: events, or a decode round's tokens for many streams."""


# -- the model worker's inbox -------------------------------------------------------------------------
class Submit(msgspec.Struct, frozen=True, tag="submit", gc=False):
    """A request for the worker (its stream is already registered with the engine)."""

    request: PreparedRequest


class Cancel(msgspec.Struct, frozen=True, tag="cancel", gc=False):
    """Cancel a request by id (no effect when it already ended)."""

    request_id: str


class Stop(msgspec.Struct, frozen=True, tag="stop", gc=False):
    """End the worker after the round in flight; what remains is cancelled."""


WorkerMessage = Submit | Cancel | Stop
"""Everything the engine's API puts on the worker's inbox."""
