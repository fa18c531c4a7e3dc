"""Engine-level helpers of the runtime tests: signed tiny cores built in a test, models started on the
reference backend and closed after the test, greedy requests, and the solo-versus-concurrent comparison.

A test module builds its core once (``build_signed_core`` with an Ignition builder, a declaration and
its capacities), starts models with ``run`` (the ``started`` fixture of ``tests/runtime/conftest.py``
closes them), and compares what requests served together produce with what each produces alone:
``solo_tokens`` runs each prompt by itself, ``submit_all`` queues every prompt at once, and
``assert_each_finishes_at_length`` checks every stream's tokens and end. ``FailingRank`` wraps a rank's
backend so that its next runs raise, for the rank-failure tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from ignition.build import build_core
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import synthetic_declaration

from helios_core.backends.reference import ReferenceBackend
from helios_core.container.keys import generate_keys, load_private_key
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings
from helios_core.runtime.engine import Engine, RequestStream
from helios_core.runtime.messages import Event, ExecutionFailed, Finished, PreparedRequest, SamplingParams, TokenEvent
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.startup import RunningModel, start

GREEDY = SamplingParams(temperature=0.0)
F32 = npt.NDArray[np.float32]


class SignedCore(NamedTuple):
    """A core built and signed in a test, and the trust settings that accept it (no decryption key)."""

    path: Path
    trust: TrustSettings


class FailingRank:
    """A rank's backend whose next ``failures`` runs raise ``FloatingPointError`` (then it runs normally)."""

    def __init__(self, backend: ReferenceBackend, failures: int = 1) -> None:
        self.backend = backend
        self.failures = failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def run(self, program: str, frame: int) -> None:
        if self.failures:
            self.failures -= 1
            raise FloatingPointError("overflow in the rank's projection")
        self.backend.run(program, frame)


def build_signed_core(
    builder: Callable[..., Any],
    declaration: Any,
    caps: Any,
    directory: Path,
    namespace: str,
    *,
    name: str = "tiny",
) -> SignedCore:
    """Build ``declaration`` with an Ignition ``builder`` (``build_core``, ``build_recurrent_core``, ...)
    into ``directory/<name>.core``, signed with fresh keys kept in ``directory/<name>.keys``."""
    keys = generate_keys(directory / f"{name}.keys")
    path = directory / f"{name}.core"
    builder(declaration, path, caps=caps, signing_key=load_private_key(keys["signing"]), namespace=namespace)
    return SignedCore(path, TrustSettings((keys["public"],), namespace, None))


SNAPSHOT_CAPS = Capacities(
    max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64, snapshots=4
)
"""Pages of 4 tokens, a 64-token context, prefill P16, decode B1/B2/B4, 32 cache pages and 4 snapshot rows."""


def build_snapshot_core(directory: Path, namespace: str) -> SignedCore:
    """The tiny synthetic core (seed 5) with :data:`SNAPSHOT_CAPS`: snapshot, restore and RESUME programs."""
    return build_signed_core(build_core, synthetic_declaration("tiny", seed=5), SNAPSHOT_CAPS, directory, namespace)


def run(core: SignedCore, started: list[RunningModel], **options: Any) -> RunningModel:
    """Start ``core`` on the reference backend with ``options`` (:class:`LoadOptions` fields); the model is
    added to ``started`` to be closed after the test."""
    model = start(core.path, core.trust, LoadOptions(**options), backend="reference")
    started.append(model)
    return model


def request(
    request_id: str, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams = GREEDY
) -> PreparedRequest:
    """A request that generates exactly ``max_tokens`` tokens (end of sequence ignored), greedy by default."""
    return PreparedRequest(request_id, list(prompt), max_tokens, sampling, ignore_eos=True)


def prompt_of(index: int, length: int = 11) -> list[int]:
    """A deterministic prompt of ``length`` ids, different for each ``index``."""
    return [(29 * index + 5 * i + 7) % 250 + 3 for i in range(length)]


def token_ids(events: Iterable[Event]) -> list[int]:
    """The generated token ids among ``events``, in order."""
    return [event.token_id for event in events if isinstance(event, TokenEvent)]


def tokens_and_end(engine: Engine, prepared: PreparedRequest) -> tuple[list[int], Finished | ExecutionFailed]:
    """Serve ``prepared`` alone: its token ids and the event that ended it (finished or failed)."""
    events = list(engine.submit(prepared))
    end = events[-1]
    assert isinstance(end, Finished | ExecutionFailed), end
    return token_ids(events), end


def tokens_and_reuse(engine: Engine, request_id: str, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
    """Serve a greedy request alone, which must finish by ``length``: its token ids and how many prompt
    tokens it reused from the prefix cache."""
    events = list(engine.submit(request(request_id, prompt, max_tokens)))
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason == "length", finished
    return token_ids(events), finished.reused_prompt_tokens


def chain_keys(allocator: PageAllocator, tokens: Sequence[int]) -> list[bytes]:
    """The prefix-cache keys of ``tokens`` page by page, in chain order (as the allocator publishes them)."""
    keys: list[bytes] = []
    parent: bytes | None = None
    for first in range(0, len(tokens), allocator.page_tokens):
        parent = allocator.chain_hash(parent, list(tokens[first : first + allocator.page_tokens]))
        keys.append(parent)
    return keys


def solo_tokens(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: SamplingParams = GREEDY
) -> list[list[int]]:
    """The tokens of each prompt served alone, one request after the other (ids ``solo0``, ``solo1``, ...)."""
    return [
        engine.generate(request(f"solo{index}", prompt, max_tokens, sampling)).token_ids
        for index, prompt in enumerate(prompts)
    ]


def submit_all(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: SamplingParams = GREEDY
) -> list[RequestStream]:
    """Queue every prompt before reading any stream, so they are served together (ids ``r0``, ``r1``, ...)."""
    return [engine.submit(request(f"r{index}", prompt, max_tokens, sampling)) for index, prompt in enumerate(prompts)]


def assert_each_finishes_at_length(streams: Sequence[RequestStream], expected: Sequence[list[int]]) -> None:
    """Every stream ends ``Finished`` by ``length`` with exactly its expected token ids."""
    for stream, tokens in zip(streams, expected, strict=True):
        events = list(stream)
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert token_ids(events) == tokens


def assert_pages_released(engine: Engine) -> None:
    """The page allocator's invariants hold and no request holds a page any more."""
    engine.allocator.check()
    assert engine.allocator.referenced_pages == 0


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """RMS normalization over the last axis, in float32 (the independent forward passes' norm)."""
    normed: F32 = (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight).astype(np.float32)
    return normed
