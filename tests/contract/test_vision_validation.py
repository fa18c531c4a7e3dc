"""Vision contract and image binding validation: one test per rule, each a minimal edit of payload-v3.

``make_vision`` turns the golden fixture into a consistent vision core (a raster-span layout, a vision
contract, and the four image sources bound by its prefill program); every test then breaks exactly
one rule and checks the exact problem message.
"""

from __future__ import annotations

import re

import pytest

from helios_core.contract import RuntimeCapabilities, check_runtime_support
from helios_core.errors import ContractError, UnsupportedFeatureError
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

PATCHES = 8
MERGE = 2
VOCABULARY = 264
FEATURE_ID = 262
OPEN_ID, CLOSE_ID = 260, 261


def rejects(parts, message: str) -> None:
    """prepare_contract raises ContractError naming exactly ``message`` among its problems."""
    with pytest.raises(ContractError) as info:
        parts.prepare()
    assert re.search(rf"(: |; ){re.escape(message)}(;|$)", str(info.value)), str(info.value)


def make_vision(parts, graph: str = "prefill_p16") -> None:
    model = parts.model
    model.frontend.image_preparation = ct.IMAGE_PREPARATION_FIXED_TILE
    model.frontend.image_layout = ct.IMAGE_LAYOUT_RASTER_SPAN
    model.input_vocabulary.size = VOCABULARY  # ids past the sampled range [0, 259)
    model.input_vocabulary.image_sentinel_ids.append(VOCABULARY - 1)
    vision = model.vision
    vision.feature_slots = 8
    vision.features_per_window = 4
    vision.patches_per_feature = MERGE
    vision.patch_capacities.append(PATCHES)
    vision.token_layout.feature_ids.append(FEATURE_ID)
    vision.token_layout.atomic_spans.add(open_id=OPEN_ID, close_id=CLOSE_ID)
    parts.add_entry("patches", mf.DTYPE_F32, (PATCHES, 12))
    parts.add_entry("patch_rows", mf.DTYPE_I32, (PATCHES,))
    parts.add_entry("feature_rows", mf.DTYPE_I32, (16,))
    parts.add_entry("feature_positions", mf.DTYPE_I32, (PATCHES // MERGE,))
    parts.add_entry("feature_slot", mf.DTYPE_I32, (4,))
    bindings = parts.graph(graph).bindings
    bindings.add(
        destination="patches", source=ct.VALUE_SOURCE_IMAGE_TENSOR, indexing=ct.INDEXING_SCALAR, image_output="patches"
    )
    bindings.add(
        destination="patch_rows",
        source=ct.VALUE_SOURCE_IMAGE_TENSOR,
        indexing=ct.INDEXING_SCALAR,
        image_output="patch_rows",
    )
    bindings.add(
        destination="feature_rows",
        source=ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES,
        indexing=ct.INDEXING_PACKED_TOKEN,
        padding=-1,
    )
    bindings.add(
        destination="feature_positions",
        source=ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES,
        indexing=ct.INDEXING_SCALAR,
        padding=-1,
    )
    bindings.add(
        destination="feature_slot",
        source=ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT,
        indexing=ct.INDEXING_SUBMISSION_ROW,
        padding=-1,
    )


def test_a_consistent_vision_core_validates_and_is_supported(parts) -> None:
    make_vision(parts)
    prepared = parts.prepare()
    check_runtime_support(prepared, RuntimeCapabilities())
    assert prepared.graphs["prefill_p16"].patch_capacity == PATCHES
    assert prepared.graphs["prefill_p16"].feature_capacity == PATCHES // MERGE
    assert prepared.graphs["prefill_p16"].takes_images
    assert prepared.graphs["decode_b4"].patch_capacity == 0
    assert not prepared.graphs["decode_b4"].takes_images


def test_a_runtime_without_vision_refuses_the_core(parts) -> None:
    make_vision(parts)
    with pytest.raises(UnsupportedFeatureError, match="the core declares image inputs"):
        check_runtime_support(parts.prepare(), RuntimeCapabilities(vision=False))


def test_image_preparation_and_layout_agree(parts) -> None:
    parts.model.frontend.image_preparation = ct.IMAGE_PREPARATION_PATCH_GRID
    rejects(parts, "frontend: image_preparation and image_layout must both be NONE or both name implementations")


def test_vision_core_needs_a_vision_contract(parts) -> None:
    make_vision(parts)
    parts.model.ClearField("vision")
    rejects(parts, "vision: a core with an image layout must declare its vision contract")


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("feature_slots", "vision.feature_slots must be positive"),
        ("features_per_window", "vision.features_per_window must be positive"),
        ("patches_per_feature", "vision.patches_per_feature must be at least 1"),
    ],
)
def test_vision_capacities_positive(parts, field: str, message: str) -> None:
    make_vision(parts)
    setattr(parts.model.vision, field, 0)
    rejects(parts, message)


def test_features_per_window_within_feature_slots(parts) -> None:
    make_vision(parts)
    parts.model.vision.features_per_window = 9
    rejects(parts, "vision.features_per_window 9 exceeds feature_slots 8")


def test_patch_capacities_listed(parts) -> None:
    make_vision(parts)
    parts.model.vision.ClearField("patch_capacities")
    rejects(parts, "vision.patch_capacities must list at least one capacity")
    rejects(parts, "graph 'prefill_p16': patch capacity 8 is not one of vision.patch_capacities []")


def test_patch_capacity_multiple_of_patches_per_feature(parts) -> None:
    make_vision(parts)
    parts.model.vision.patch_capacities.append(9)
    rejects(parts, "vision.patch_capacities: 9 is not a positive multiple of patches_per_feature 2")


def test_graph_patch_capacity_divisible(parts) -> None:
    make_vision(parts)
    parts.model.vision.patches_per_feature = 3
    parts.model.vision.patch_capacities[:] = [6]
    rejects(parts, "graph 'prefill_p16': patch capacity 8 is not a multiple of patches_per_feature 3")


def test_feature_ids_required_and_inside_the_input_vocabulary(parts) -> None:
    make_vision(parts)
    parts.model.vision.token_layout.feature_ids[:] = [264]
    rejects(parts, "vision.token_layout: feature id 264 lies outside the input vocabulary [0, 264)")
    parts.model.vision.token_layout.ClearField("feature_ids")
    rejects(parts, "vision.token_layout.feature_ids must name at least one token")


def test_atomic_span_ids_inside_the_input_vocabulary(parts) -> None:
    make_vision(parts)
    parts.model.vision.token_layout.atomic_spans[0].close_id = 300
    rejects(parts, "vision.token_layout: atomic span id 300 lies outside the input vocabulary [0, 264)")


def test_vision_core_needs_an_image_sentinel(parts) -> None:
    make_vision(parts)
    parts.model.input_vocabulary.ClearField("image_sentinel_ids")
    rejects(parts, "input_vocabulary: a core with an image layout must declare an image sentinel id")


@pytest.mark.parametrize(
    ("destination", "indexing", "message"),
    [
        ("patches", ct.INDEXING_SUBMISSION_ROW, "IMAGE_TENSOR needs SCALAR indexing, not SUBMISSION_ROW"),
        ("feature_rows", ct.INDEXING_SCALAR, "IMAGE_FEATURE_INDICES needs PACKED_TOKEN indexing, not SCALAR"),
        (
            "feature_positions",
            ct.INDEXING_PACKED_TOKEN,
            "IMAGE_CONTEXT_INDICES needs SCALAR indexing, not PACKED_TOKEN",
        ),
        (
            "feature_slot",
            ct.INDEXING_PHYSICAL_REQUEST_ROW,
            "IMAGE_FEATURE_SLOT needs SUBMISSION_ROW or ACTIVE_ROW indexing, not PHYSICAL_REQUEST_ROW",
        ),
    ],
)
def test_image_source_indexing(parts, destination: str, indexing: int, message: str) -> None:
    make_vision(parts)
    parts.binding("prefill_p16", destination).indexing = indexing
    rejects(parts, f"graph 'prefill_p16' binding {destination!r}: {message}")


def test_feature_slot_with_active_row_indexing_validates(parts) -> None:
    make_vision(parts)
    parts.binding("prefill_p16", "feature_slot").indexing = ct.INDEXING_ACTIVE_ROW
    parts.prepare()


def test_image_tensor_leading_extents_agree(parts) -> None:
    make_vision(parts)
    parts.entry("patch_rows").shape[:] = [PATCHES * 2]
    rejects(
        parts,
        "graph 'prefill_p16': IMAGE_TENSOR destinations have different leading extents [8, 16]; all hold the "
        "graph's patch capacity",
    )


def test_patch_capacity_listed_in_the_vision_contract(parts) -> None:
    make_vision(parts)
    parts.entry("patches").shape[:] = [16, 12]
    parts.entry("patch_rows").shape[:] = [16]
    rejects(parts, "graph 'prefill_p16': patch capacity 16 is not one of vision.patch_capacities [8]")


def test_feature_sources_need_image_tensors(parts) -> None:
    make_vision(parts)
    bindings = parts.graph("prefill_p16").bindings
    for binding in [b for b in bindings if b.source == ct.VALUE_SOURCE_IMAGE_TENSOR]:
        bindings.remove(binding)
    rejects(parts, "graph 'prefill_p16': image feature sources need IMAGE_TENSOR bindings (the graph's patch capacity)")
    rejects(parts, "vision: a core with an image layout needs a prefill program that binds IMAGE_TENSOR")


def test_context_indices_hold_the_feature_capacity(parts) -> None:
    make_vision(parts)
    parts.entry("feature_positions").shape[:] = [3]
    rejects(parts, "graph 'prefill_p16' binding 'feature_positions': 3 entries cannot hold feature capacity 4")


def test_decode_programs_take_no_images(parts) -> None:
    make_vision(parts)
    parts.add_entry("decode_patches", mf.DTYPE_F32, (PATCHES, 12))
    parts.graph("decode_b4").bindings.add(
        destination="decode_patches",
        source=ct.VALUE_SOURCE_IMAGE_TENSOR,
        indexing=ct.INDEXING_SCALAR,
        image_output="patches",
    )
    rejects(parts, "graph 'decode_b4': decode programs take no images")


@pytest.mark.parametrize("value", [100_000, 199_999])
def test_third_party_image_identifiers_are_accepted(parts, value: int) -> None:
    make_vision(parts)
    parts.model.frontend.image_preparation = value
    parts.model.frontend.image_layout = value
    check_runtime_support(parts.prepare(), RuntimeCapabilities())


def test_image_sources_validate_with_an_image_layout(parts) -> None:
    make_vision(parts)
    parts.prepare()
    parts.model.frontend.image_layout = ct.IMAGE_LAYOUT_NONE
    parts.model.frontend.image_preparation = ct.IMAGE_PREPARATION_NONE
    rejects(parts, "graph 'prefill_p16' binding 'feature_slot': image sources need a selected image layout")


def test_image_sentinels_need_embedding_rows(parts) -> None:
    # A legacy completion's prompt ids reach the model unexpanded, image sentinels included, so the
    # token embedding table holds a row for every input id: a sentinel is no exception.
    make_vision(parts)
    parts.prepare()  # sentinel 263 has a row of tok_embd's 320
    parts.model.input_vocabulary.size = 321
    parts.model.input_vocabulary.image_sentinel_ids[:] = [320]
    rejects(
        parts,
        "input_vocabulary.size 321 exceeds the 320 rows of embedding table 'tok_embd': program 'prefill_p16' "
        "node 'embedding' embeds input ids (PROMPT_TOKENS in 'input_ids'), so an id in [320, 321) would fail "
        "the gather",
    )


def test_embeddings_of_image_tensors_are_not_held_to_the_input_vocabulary(parts) -> None:
    # A vision tower's position tables (rows of patch rows or columns) are embedding nodes too; their ids
    # are image tensors, not input ids, so their few rows are fine.
    make_vision(parts)
    node = parts.program("prefill_p16").nodes.add(name="vision.row_embed")
    node.op.name = "embedding"
    node.op.version = 1
    node.args.add(name="table", view=mf.BufferView(buffer="tok_embd", shape=[4, 32]))
    node.args.add(name="ids", view=mf.BufferView(buffer="patch_rows", shape=[PATCHES]))
    node.args.add(name="out", view=mf.BufferView(buffer="scratch.h", shape=[PATCHES, 32]))
    parts.prepare()
    node.args[1].view.buffer = "input_ids"  # the same four rows gathering prompt ids
    rejects(
        parts,
        f"input_vocabulary.size {VOCABULARY} exceeds the 4 rows of embedding table 'tok_embd': program "
        "'prefill_p16' node 'vision.row_embed' embeds input ids (PROMPT_TOKENS in 'input_ids'), so an id in "
        f"[4, {VOCABULARY}) would fail the gather",
    )
