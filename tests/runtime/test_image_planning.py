"""Planning, admission and prefix reuse of prompts with images, on the golden fixture core's scheduler.

The fixture core (4 slots, a context of 64 tokens in pages of 4, ``prefill_p16`` and ``mixed_p16``
of 4 lanes and 16 packed tokens) is given image programs by hand: ``prefill_p16`` binds an image
tensor of 8 patches (4 features, two patches a feature) and the vision contract holds 6 feature slots a
request; ``mixed_p16`` binds no image source. Nothing is executed: each round is completed with the
results a validated completion record would give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from helios_core.contract import LoadOptions, PreparedContract, select
from helios_core.loading import VerifiedCore, open_core
from helios_core.runtime.completion import LaneResult
from helios_core.runtime.messages import AdmissionRejected, Finished, ImageTensor, PreparedRequest, PromptImage
from helios_core.runtime.messages import SamplingParams as Sampling
from helios_core.runtime.native_model import NativeModel
from helios_core.runtime.pages import PageAllocator
from helios_core.runtime.plan import RoundPlan
from helios_core.runtime.scheduler import Scheduler
from helios_core.runtime.stats import SchedulerStats
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .conftest import FIXTURES, fixture_settings

GREEDY = Sampling(temperature=0.0)
PATCHES = 8
WIDTH = 12


@pytest.fixture(scope="module")
def verified() -> Iterator[VerifiedCore]:
    core = open_core(FIXTURES / "payload-v3.core", fixture_settings(), check_resources=False)
    yield core
    core.close()


def vision_contract(contract: PreparedContract, imaging: Sequence[str] = ("prefill_p16",)) -> PreparedContract:
    """``contract`` with an image tensor bound by the ``imaging`` programs and 6 feature slots a request."""
    model = ct.ModelContract()
    model.CopyFrom(contract.model)
    model.vision.feature_slots = 6
    model.vision.patches_per_feature = 2
    model.vision.patch_capacities.append(PATCHES)
    graphs = dict(contract.graphs)
    for name in imaging:
        graph_contract = ct.GraphContract()
        graph_contract.CopyFrom(graphs[name].contract)
        graph_contract.bindings.add(
            destination="patches",
            source=ct.VALUE_SOURCE_IMAGE_TENSOR,
            indexing=ct.INDEXING_SCALAR,
            image_output="patches",
        )
        graphs[name] = dataclasses.replace(
            graphs[name], contract=graph_contract, patch_capacity=PATCHES, feature_capacity=4
        )
    entry = mf.TransportEntry(name="patches", dtype=mf.DTYPE_F32, shape=[PATCHES, WIDTH])
    return dataclasses.replace(contract, model=model, graphs=graphs, transport={**contract.transport, "patches": entry})


def make_scheduler(
    verified: VerifiedCore, *, images: bool = True, imaging: Sequence[str] = ("prefill_p16",), **options: Any
) -> Scheduler:
    contract = vision_contract(verified.contract, imaging) if images else verified.contract
    load = LoadOptions(**options)
    selection = select(verified.contract, load)
    model = NativeModel.load(verified.core, verified.contract, selection, backend="null", cache_pages=load.cache_pages)
    try:
        allocator = PageAllocator(model.cache_pages, contract.model.cache.page_tokens, contract.serving.cache_identity)
    finally:
        model.close()
    graphs = {name: contract.graphs[name] for name in selection.graphs}
    return Scheduler(contract, dataclasses.replace(selection, graphs=graphs), allocator, SchedulerStats())


def image(start: int, features: int = 4, digest: bytes = b"A", *, patches: int | None = None) -> PromptImage:
    """A span [open, feature x features, close] at ``start``."""
    count = 2 * features if patches is None else patches
    pixels = np.full((count, WIDTH), float(digest[0]), dtype=np.float32)
    return PromptImage(
        start=start,
        length=features + 2,
        feature_tokens=list(range(1, features + 1)),
        patch_count=count,
        digest=digest,
        tensors=[ImageTensor.of("patches", pixels)],
    )


def request(
    request_id: str, length: int, images: Sequence[PromptImage], max_tokens: int = 2, **fields: Any
) -> PreparedRequest:
    prompt = [1 + (i % 200) for i in range(length)]
    return PreparedRequest(request_id, prompt, max_tokens, GREEDY, ignore_eos=True, images=list(images), **fields)


def complete(scheduler: Scheduler, round_: RoundPlan, token: int = 7) -> list[Any]:
    results = [LaneResult(token, -0.5) if e.samples else LaneResult(-1, 0.0) for e in round_.expectation_list()]
    return scheduler.complete(round_, results)


def next_round(scheduler: Scheduler) -> RoundPlan:
    round_ = scheduler.next_round()
    assert round_ is not None
    return round_


def chunks(round_: RoundPlan) -> list[tuple[int, int, list[list[int]]]]:
    """Per lane: first and last-plus-one position, and each of its images' feature positions."""
    return [
        (lane.positions[0], lane.positions[-1] + 1, [list(im.feature_positions) for im in lane.images])
        for lane in round_.lane_list()
    ]


def test_a_chunk_ends_before_an_image_span_it_would_split(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    assert scheduler.add(request("r", 20, [image(12)])) is None  # span [12, 18): the budget of 16 would cut it
    complete(scheduler, next_round(scheduler))  # initialize
    first = next_round(scheduler)
    assert (first.graph.name, chunks(first)) == ("prefill_p16", [(0, 12, [])])
    complete(scheduler, first)
    second = next_round(scheduler)
    assert (second.graph.name, chunks(second)) == ("prefill_p16", [(12, 20, [[13, 14, 15, 16]])])
    lane_image = second.lane_list()[0].images[0]
    assert list(lane_image.feature_offsets) == [1, 2, 3, 4]
    assert lane_image.tensors["patches"].shape == (PATCHES, WIDTH)


def test_a_round_holds_no_more_patches_than_its_program(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    assert scheduler.add(request("a", 7, [image(1, 2)])) is None  # 4 patches
    assert scheduler.add(request("b", 7, [image(2, 3)])) is None  # 6 patches: 10 do not fit 8
    complete(scheduler, next_round(scheduler))
    first = next_round(scheduler)
    assert chunks(first) == [(0, 7, [[2, 3]]), (0, 2, [])]  # b stops before its image
    complete(scheduler, first)
    second = next_round(scheduler)
    assert chunks(second) == [(2, 7, [[3, 4, 5]])]


def test_a_mixed_round_without_image_programs_does_not_starve_an_image(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    assert scheduler.add(request("text", 5, [], max_tokens=8)) is None
    complete(scheduler, next_round(scheduler))
    complete(scheduler, next_round(scheduler))  # text prefilled: it decodes from now on
    assert scheduler.add(request("pic", 8, [image(0)])) is None
    complete(scheduler, next_round(scheduler))  # initialize pic
    round_ = next_round(scheduler)  # mixed_p16 takes no image: a plain prefill round computes the span
    assert (round_.graph.name, list(round_.request_ids), chunks(round_)) == (
        "prefill_p16",
        ["pic"],
        [(0, 8, [[1, 2, 3, 4]])],
    )
    complete(scheduler, round_)
    after = next_round(scheduler)
    assert after.graph.operation == ct.OPERATION_DECODE and len(after) == 2


def test_a_mixed_round_that_carries_an_image_keeps_lane_objects(verified: VerifiedCore) -> None:
    """A batch carries no images: a mixed round with one has its decode lanes as the planner builds a lane."""
    scheduler = make_scheduler(verified, imaging=("prefill_p16", "mixed_p16"))
    assert scheduler.add(request("text", 5, [], max_tokens=8)) is None
    complete(scheduler, next_round(scheduler))
    complete(scheduler, next_round(scheduler))  # text prefilled: it decodes from now on
    assert scheduler.add(request("pic", 8, [image(0)])) is None
    complete(scheduler, next_round(scheduler))  # initialize pic
    round_ = next_round(scheduler)
    assert (round_.graph.name, list(round_.request_ids), chunks(round_)) == (
        "mixed_p16",
        ["text", "pic"],
        [(5, 6, []), (0, 8, [[1, 2, 3, 4]])],
    )
    assert isinstance(round_.lanes, tuple)
    text = next(s for s in scheduler.running if s.request_id == "text")
    assert round_.lanes[0] == scheduler.planner.lane(text, range(5, 6), sample=True)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([image(0, 4, patches=10)], "image 0 has 10 patches; the largest patch capacity of the prefill programs is 8"),
        ([image(0, 15, patches=8)], "image 0's span of 17 tokens exceeds the 16 tokens a prefill round computes"),
        ([image(0), image(6)], "the prompt's images have 8 features; the core holds 6 image feature slots per request"),
        (
            [image(0), image(3)],
            "image 1's span [3, 9) is empty, overlaps an earlier image's or lies outside the prompt's 20 tokens",
        ),
        (
            [image(16)],
            "image 0's span [16, 22) is empty, overlaps an earlier image's or lies outside the prompt's 20 tokens",
        ),
    ],
)
def test_admission_refuses_images_that_can_never_fit(verified: VerifiedCore, images, message: str) -> None:
    scheduler = make_scheduler(verified)
    rejected = scheduler.add(request("r", 20, images))
    assert rejected == AdmissionRejected("r", message, param="messages", permanent=True)


def test_admission_refuses_an_image_without_its_tensor(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    bare = image(0)
    wrong = PromptImage(
        bare.start,
        bare.length,
        bare.feature_tokens,
        bare.patch_count,
        bare.digest,
        [ImageTensor.of("patches", np.zeros((PATCHES, WIDTH + 1), np.float32))],
    )
    missing = PromptImage(bare.start, bare.length, bare.feature_tokens, bare.patch_count, bare.digest, [])
    assert scheduler.add(request("w", 20, [wrong])) == AdmissionRejected(
        "w", "image 0's 'patches' tensor has shape [8, 13]; the core's programs take [8, 12]", "messages", True
    )
    assert scheduler.add(request("m", 20, [missing])) == AdmissionRejected(
        "m", "image 0 has no 'patches' tensor, which the core's programs take", "messages", True
    )


def test_a_core_without_image_programs_refuses_images(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified, images=False)
    assert scheduler.add(request("r", 20, [image(0)])) == AdmissionRejected(
        "r", "this core's programs take no images", "messages", True
    )


def run_to_end(scheduler: Scheduler, request_id: str) -> Finished:
    for _ in range(40):
        round_ = next_round(scheduler)
        for event in complete(scheduler, round_):
            if isinstance(event, Finished) and event.request_id == request_id:
                return event
    raise AssertionError(f"{request_id} did not finish")


def test_prefix_reuse_needs_the_same_image(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    # 22 tokens, an image span [4, 10): pages 1 and 2 hold its tokens.
    assert scheduler.add(request("first", 22, [image(4, digest=b"A")])) is None
    assert run_to_end(scheduler, "first").reused_prompt_tokens == 0
    assert scheduler.add(request("same", 22, [image(4, digest=b"A")])) is None
    assert run_to_end(scheduler, "same").reused_prompt_tokens == 20  # 5 complete pages, the last token computed
    assert scheduler.add(request("other", 22, [image(4, digest=b"B")])) is None
    assert run_to_end(scheduler, "other").reused_prompt_tokens == 4  # only the page before the span


def test_prefix_reuse_never_ends_inside_an_image_span(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    assert scheduler.add(request("first", 22, [image(4, digest=b"A")])) is None
    run_to_end(scheduler, "first")
    # The same 10 tokens, then others: the published pages [0, 8) match, but the span [4, 10) continues
    # past them, so reuse stops at its start (page 1 is computed again, with the image).
    prompt = request("cut", 30, []).prompt_ids[:8] + [250] * 22
    assert scheduler.add(PreparedRequest("cut", prompt, 2, GREEDY, ignore_eos=True, images=[image(4)])) is None
    complete(scheduler, next_round(scheduler))  # initialize
    round_ = next_round(scheduler)
    assert chunks(round_) == [(4, 20, [[5, 6, 7, 8]])]


class _Recorder:
    """A prefix-index listener that keeps every stored page's key and tokens."""

    def __init__(self) -> None:
        self.stored: list[tuple[bytes, bytes | None, list[int]]] = []

    def page_stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int], page_tokens: int) -> None:
        self.stored.append((key, parent, list(tokens)))

    def page_removed(self, key: bytes) -> None:
        pass

    def all_cleared(self) -> None:
        pass


def test_published_page_keys_carry_the_image_digest(verified: VerifiedCore) -> None:
    scheduler = make_scheduler(verified)
    recorder = _Recorder()
    scheduler.allocator.attach_events(recorder)
    assert scheduler.add(request("a", 14, [image(4, digest=b"A")])) is None
    run_to_end(scheduler, "a")
    assert scheduler.add(request("b", 14, [image(4, digest=b"B")])) is None
    run_to_end(scheduler, "b")
    allocator = scheduler.allocator
    tokens = list(request("a", 14, []).prompt_ids)
    first = allocator.chain_hash(None, tokens[:4])
    with_a = allocator.chain_hash(first, tokens[4:8], [(0, b"A")])
    with_b = allocator.chain_hash(first, tokens[4:8], [(0, b"B")])
    a_last = allocator.chain_hash(with_a, tokens[8:12], [(-4, b"A")])
    b_last = allocator.chain_hash(with_b, tokens[8:12], [(-4, b"B")])
    # "a" publishes three complete pages; "b" shares only the first (the other two hold its own image)
    assert [key for key, _, _ in recorder.stored] == [first, with_a, a_last, with_b, b_last]
    assert with_a != allocator.chain_hash(first, tokens[4:8])
