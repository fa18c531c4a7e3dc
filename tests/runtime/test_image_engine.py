"""Serving prompts with images end to end on the ``vision-tiles`` fixture core (reference backend).

The core takes 16x16 images cut into 16 patches of 4x4 pixels, one feature a patch; a span is
``[open] + [feature] x 16 + [close]`` (ids 260, 262, 261). Its image programs compute the features from
the packed patches in the program, so the tokens a request generates depend on its image.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from helios_core.runtime.messages import (
    ExecutionFailed,
    Finished,
    ImageTensor,
    PreparedRequest,
    PromptImage,
    SamplingParams,
    TokenEvent,
)
from helios_core.runtime.pages import PrefixMatch, inside_span
from helios_core.runtime.residency import Residency
from helios_core.runtime.startup import RunningModel

GREEDY = SamplingParams(temperature=0.0)
OPEN, FEATURE, CLOSE = 260, 262, 261
PATCHES = 16


def tile_image(seed: int, start: int) -> PromptImage:
    """A random 16-patch image whose span starts at prompt index ``start``."""
    rng = np.random.default_rng(seed)
    grid = np.arange(PATCHES, dtype=np.int32)
    tensors = [
        ImageTensor.of("patches", rng.standard_normal((PATCHES, 48)).astype(np.float32)),
        ImageTensor.of("patch_rows", grid // 4),
        ImageTensor.of("patch_cols", grid % 4),
    ]
    return PromptImage(start, PATCHES + 2, list(range(1, PATCHES + 1)), PATCHES, bytes([seed]) * 16, tensors)


def image_request(request_id: str, seed: int, head: Sequence[int] = tuple(range(3, 17))) -> PreparedRequest:
    """``head``, an image span, then 17 text tokens; 6 greedy tokens."""
    prompt = [*head, OPEN, *[FEATURE] * PATCHES, CLOSE, *range(30, 47)]
    return PreparedRequest(request_id, prompt, 6, GREEDY, ignore_eos=True, images=[tile_image(seed, len(head))])


def served(model: RunningModel, requests: Sequence[PreparedRequest]) -> list[tuple[list[int], int]]:
    """Queue every request before reading any stream: each one's tokens and reused prompt tokens."""
    streams = [model.engine.submit(request) for request in requests]
    outcomes = []
    for stream in streams:
        events = list(stream)
        end = events[-1]
        assert isinstance(end, Finished) and end.reason == "length", end
        outcomes.append(([e.token_id for e in events if isinstance(e, TokenEvent)], end.reused_prompt_tokens))
    return outcomes


def test_an_image_request_generates_the_same_tokens_alone_and_beside_others(
    start_fixture: Callable[..., RunningModel],
) -> None:
    batch = [
        image_request("pic1", 1, head=range(60, 74)),
        image_request("pic3", 3),
        PreparedRequest("text", list(range(100, 140)), 6, GREEDY, ignore_eos=True),
        image_request("pic5", 5, head=range(80, 82)),
    ]
    alone = [served(start_fixture("vision-tiles"), [request])[0][0] for request in batch]
    together = [tokens for tokens, _ in served(start_fixture("vision-tiles"), batch)]
    assert together == alone
    assert alone[0] != alone[1]  # the image decides the tokens


def test_a_shared_image_prefix_is_reused_and_a_different_image_is_not(
    start_fixture: Callable[..., RunningModel],
) -> None:
    model = start_fixture("vision-tiles")
    ((first, first_reused),) = served(model, [image_request("first", 1)])
    ((same, same_reused),) = served(model, [image_request("same", 1)])
    ((other, other_reused),) = served(model, [image_request("other", 2)])
    assert (first_reused, same_reused) == (0, 48)  # 12 complete pages of 4; the last prompt token is computed
    assert same == first
    assert other_reused == 12  # the pages before the image span only
    assert other != first


def _spans_request(request_id: str, seeds: Sequence[int], head: Sequence[int]) -> PreparedRequest:
    """``head``, one image span a seed, back to back, then 17 text tokens; 6 greedy tokens."""
    prompt, images = list(head), []
    for seed in seeds:
        images.append(tile_image(seed, len(prompt)))
        prompt += [OPEN, *[FEATURE] * PATCHES, CLOSE]
    return PreparedRequest(request_id, [*prompt, *range(30, 47)], 6, GREEDY, ignore_eos=True, images=images)


def test_a_reused_prefix_cut_back_before_one_span_is_cut_again_before_the_span_it_lands_in(
    start_fixture: Callable[..., RunningModel],
) -> None:
    """Two images, then a third: the shared pages end inside the second span (its last page holds the first
    token after it), whose first page boundary lies inside the first span, so the reuse goes back to the
    page before the first span. The request runs (it used to wait for a chunk that never came, and held up
    every other request) and generates what it does without any reuse."""
    head = range(3, 10)  # 7 tokens: spans at 7..25 and 25..43, pages of 4
    model = start_fixture("vision-tiles")
    done: list[list[tuple[list[int], int]]] = []
    worker = threading.Thread(
        target=lambda: done.append(
            served(model, [_spans_request("two", (1, 2), head)])
            + served(model, [_spans_request("three", (1, 2, 3), head)])
        ),
        daemon=True,
    )
    worker.start()
    worker.join(120)
    assert done, "the request reusing the two images' prefix never finished"
    (_, two_reused), (three, three_reused) = done[0]
    assert (two_reused, three_reused) == (0, 4)  # the one page before the first span
    ((alone, _),) = served(start_fixture("vision-tiles"), [_spans_request("alone", (1, 2, 3), head)])
    assert three == alone


def test_a_request_whose_prefill_cannot_continue_fails_alone_and_the_others_are_served(
    start_fixture: Callable[..., RunningModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a request ever sit at a position no prefill chunk can start from (here: a reuse cut left inside
    an image span, which the residency no longer makes), it fails with an execution error naming the position
    (the last page boundary inside the first span),
    and the text request queued behind it is served; before, both waited forever."""

    def cut_once(self: Residency, match: PrefixMatch, images: Sequence[PromptImage]) -> PrefixMatch:
        cut = inside_span(images, match.tokens)
        if cut is None:
            return match
        keep = cut.start // self.page_tokens
        return PrefixMatch(match.pages[:keep], match.hashes[:keep], keep * self.page_tokens)

    monkeypatch.setattr(Residency, "_outside_spans", cut_once)
    head = range(3, 10)
    model = start_fixture("vision-tiles")
    served(model, [_spans_request("two", (1, 2), head)])
    ends: list[list[object]] = []

    def serve() -> None:
        streams = [
            model.engine.submit(_spans_request("three", (1, 2, 3), head)),
            model.engine.submit(PreparedRequest("text", list(range(3, 40)), 6, GREEDY, ignore_eos=True)),
        ]
        ends.append([list(stream)[-1] for stream in streams])

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    worker.join(120)
    assert ends, "the requests never finished"
    stuck, text = ends[0]
    assert isinstance(stuck, ExecutionFailed)
    assert "prefill cannot continue from position 24 towards 78:" in stuck.message
    assert isinstance(text, Finished) and text.reason == "length"
