"""Packing of the four image sources from a round's lanes, on a handcrafted prefill graph.

The graph holds 3 lanes and 12 packed tokens, a patch capacity of 6 (``patches`` float32 [6, 4] and
``patch_rows`` int32 [6]) and feature capacity 3 (two patches a feature). Staging starts poisoned, so
every element a binding writes (value or padding) and every element it leaves alone is visible.
"""

from __future__ import annotations

import numpy as np
import pytest

from helios_core.contract import PreparedGraph
from helios_core.contract.prepared import GraphExtentsView
from helios_core.runtime.messages import ImageTensor, PromptImage
from helios_core.runtime.packing import GraphPacker, Lane, LaneBatch, LaneImage, Submission, image_values
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

POISON = 77
CAPACITY = 6


def image_graph(slot_indexing: int = ct.INDEXING_SUBMISSION_ROW) -> PreparedGraph:
    bind = ct.ValueBinding
    contract = ct.GraphContract(
        name="prefill_vision",
        operation=ct.OPERATION_PREFILL,
        bindings=[
            bind(
                destination="patches",
                source=ct.VALUE_SOURCE_IMAGE_TENSOR,
                indexing=ct.INDEXING_SCALAR,
                image_output="patches",
            ),
            bind(
                destination="patch_rows",
                source=ct.VALUE_SOURCE_IMAGE_TENSOR,
                indexing=ct.INDEXING_SCALAR,
                image_output="patch_rows",
                padding=-2,
            ),
            bind(
                destination="feature_rows",
                source=ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES,
                indexing=ct.INDEXING_PACKED_TOKEN,
                padding=-1,
            ),
            bind(
                destination="feature_positions",
                source=ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES,
                indexing=ct.INDEXING_SCALAR,
                padding=-1,
            ),
            bind(
                destination="feature_slot",
                source=ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT,
                indexing=slot_indexing,
                padding=-1,
            ),
        ],
    )
    extents = GraphExtentsView(
        batch_capacity=3,
        token_capacity=12,
        packed_token_capacity=12,
        draft_tokens=0,
        verify_tokens=12,
        draft_capacity=0,
    )
    return PreparedGraph(
        name="prefill_vision",
        operation=ct.OPERATION_PREFILL,
        contract=contract,
        program=mf.ProgramDecl(),
        extents=extents,
        length_source=None,
        input_destinations=frozenset(),
        patch_capacity=CAPACITY,
        feature_capacity=CAPACITY // 2,
    )


def staging() -> dict[str, np.ndarray]:
    return {
        "patches": np.full((CAPACITY, 4), POISON, dtype=np.float32),
        "patch_rows": np.full((CAPACITY,), POISON, dtype=np.int32),
        "feature_rows": np.full((12,), POISON, dtype=np.int32),
        "feature_positions": np.full((CAPACITY // 2,), POISON, dtype=np.int32),
        "feature_slot": np.full((3,), POISON, dtype=np.int32),
    }


def prompt_image(start: int, patches: int, first_value: float, digest: bytes = b"a") -> PromptImage:
    """A span [open, feature x patches/2, close] at ``start``: feature tokens at offsets 1.."""
    features = patches // 2
    pixels = np.arange(patches * 4, dtype=np.float32).reshape(patches, 4) + first_value
    rows = np.arange(patches, dtype=np.int32) + int(first_value)
    return PromptImage(
        start=start,
        length=features + 2,
        feature_tokens=list(range(1, features + 1)),
        patch_count=patches,
        digest=digest,
        tensors=[ImageTensor.of("patches", pixels), ImageTensor.of("patch_rows", rows)],
    )


def lane(slot: int, start: int, length: int, images: list[PromptImage] = ()) -> Lane:
    positions = list(range(start, start + length))
    return Lane(
        slot=slot,
        generation=1,
        state_row=slot,
        positions=positions,
        cache_slots=positions,
        page_table=[0],
        tokens=[1] * length,
        images=[LaneImage.of(image, start) for image in images],
    )


def test_lane_image_places_features_in_the_chunk() -> None:
    image = LaneImage.of(prompt_image(10, 4, 0.0), 8)
    assert image.feature_offsets == [3, 4]
    assert image.feature_positions == [11, 12]
    assert image.feature_count == 2
    assert image.patch_count == 4
    assert image.tensors["patches"].shape == (4, 4)


def test_round_images_pack_in_lane_then_prompt_order() -> None:
    graph = image_graph()
    arrays = staging()
    first = prompt_image(2, 2, 100.0)  # lane 0: chunk 0..5, one feature at position 3
    second = prompt_image(7, 4, 200.0)  # lane 2: chunk 6..11, features at positions 8 and 9
    lanes = [lane(0, 0, 5, [first]), lane(1, 20, 2), lane(2, 6, 5, [second])]
    GraphPacker(graph, arrays).pack(Submission(lanes, 1), 0, arrays)
    expected = np.concatenate([first.tensors[0].array(), second.tensors[0].array()])
    assert arrays["patches"].tolist() == expected.tolist()  # 6 patches fill the capacity exactly
    assert arrays["patch_rows"].tolist() == [100, 101, 200, 201, 202, 203]
    # packed tokens: lane 0 rows 0..4 (feature at offset 3), lane 1 rows 5..6, lane 2 rows 7..11 (offsets 2, 3)
    assert arrays["feature_rows"].tolist() == [-1, -1, -1, 0, -1, -1, -1, -1, -1, 1, 2, -1]
    assert arrays["feature_positions"].tolist() == [3, 8, 9]
    assert arrays["feature_slot"].tolist() == [0, -1, 1]


def test_unused_patch_rows_and_features_hold_the_padding() -> None:
    graph = image_graph()
    arrays = staging()
    GraphPacker(graph, arrays).pack(Submission([lane(0, 0, 5, [prompt_image(1, 2, 0.0)])], 1), 0, arrays)
    assert arrays["patches"][2:].tolist() == [[0.0] * 4] * 4  # padding 0
    assert arrays["patch_rows"].tolist() == [0, 1, -2, -2, -2, -2]
    assert arrays["feature_rows"].tolist() == [-1, -1, 0] + [-1] * 9
    assert arrays["feature_positions"].tolist() == [2, -1, -1]
    assert arrays["feature_slot"].tolist() == [0, -1, -1]  # SUBMISSION_ROW pads every row past the lanes


def test_active_row_feature_slot_leaves_the_tail() -> None:
    graph = image_graph(ct.INDEXING_ACTIVE_ROW)
    arrays = staging()
    GraphPacker(graph, arrays).pack(Submission([lane(0, 0, 3)], 1), 0, arrays)
    assert arrays["feature_slot"].tolist() == [-1, POISON, POISON]


def test_text_round_writes_padding_only() -> None:
    graph = image_graph()
    arrays = staging()
    GraphPacker(graph, arrays).pack(Submission([lane(0, 0, 4), lane(1, 0, 4)], 1), 0, arrays)
    assert arrays["patch_rows"].tolist() == [-2] * CAPACITY
    assert arrays["feature_rows"].tolist() == [-1] * 12
    assert arrays["feature_positions"].tolist() == [-1] * 3
    assert arrays["feature_slot"].tolist() == [-1, -1, -1]


def test_a_decode_batch_carries_no_images() -> None:
    graph = image_graph()
    arrays = staging()
    batch = LaneBatch(
        count=1,
        rows={ct.VALUE_SOURCE_QUERY_LENGTH: np.ones(1, dtype=np.int64), ct.VALUE_SOURCE_SLOT: np.zeros(1, np.int64)},
        tokens={},
        page_source=np.zeros((1, 1), dtype=np.int64),
        page_index=np.zeros(1, dtype=np.int64),
        page_counts=np.ones(1, dtype=np.int64),
    )
    GraphPacker(graph, arrays).pack(Submission(batch, 1), 0, arrays)
    assert arrays["patch_rows"].tolist() == [-2] * CAPACITY
    assert arrays["feature_rows"].tolist() == [-1] * 12
    assert arrays["feature_slot"].tolist() == [-1, -1, -1]


def test_patches_beyond_the_capacity_fail_the_pack() -> None:
    graph = image_graph()
    arrays = staging()
    lanes = [lane(0, 0, 4, [prompt_image(0, 4, 0.0)]), lane(1, 0, 4, [prompt_image(0, 4, 0.0)])]
    with pytest.raises(
        ValueError, match="the round's images hold more than 6 patches, the patch capacity of 'patches'"
    ):
        GraphPacker(graph, arrays).pack(Submission(lanes, 1), 0, arrays)


def test_a_tensor_of_the_wrong_shape_or_name_fails_the_pack() -> None:
    graph = image_graph()
    arrays = staging()
    image = prompt_image(0, 2, 0.0)
    wide = msgspec_replace(image, tensors=[ImageTensor.of("patches", np.zeros((2, 5), np.float32)), image.tensors[1]])
    with pytest.raises(ValueError, match=r"image tensor 'patches' has shape \[2, 5\]; 'patches' takes \[2, 4\]"):
        GraphPacker(graph, arrays).pack(Submission([lane(0, 0, 4, [wide])], 1), 0, arrays)
    missing = msgspec_replace(image, tensors=[image.tensors[0]])
    with pytest.raises(ValueError, match="an image of the round has no 'patch_rows' tensor for 'patch_rows'"):
        GraphPacker(graph, arrays).pack(Submission([lane(0, 0, 4, [missing])], 1), 0, arrays)


def test_an_image_feature_outside_its_lane_fails_the_pack() -> None:
    graph = image_graph()
    arrays = staging()
    with pytest.raises(ValueError, match="lane 0 has an image feature outside its 2 packed tokens"):
        GraphPacker(graph, arrays).pack(Submission([lane(0, 0, 2, [prompt_image(1, 4, 0.0)])], 1), 0, arrays)


def msgspec_replace(image: PromptImage, **changes: object) -> PromptImage:
    import msgspec

    return msgspec.structs.replace(image, **changes)


def test_image_values_cast_only_safely() -> None:
    assert image_values(np.array([1.5], np.float32), np.dtype(np.float16), "x").dtype == np.float16
    assert image_values(np.array([1.0], np.float32), np.dtype(np.uint16), "x").tolist() == [0x3F80]  # bf16 bits
    assert image_values(np.array([7], np.int64), np.dtype(np.int32), "x").tolist() == [7]
    with pytest.raises(ValueError, match="image tensor 'x' of dtype int64 does not fit a int32 destination"):
        image_values(np.array([2**40], np.int64), np.dtype(np.int32), "x")
    with pytest.raises(ValueError, match="image tensor 'x' of dtype float32 does not fit a int32 destination"):
        image_values(np.array([1.0], np.float32), np.dtype(np.int32), "x")


def test_prompt_images_cross_the_worker_process_pipe() -> None:
    import msgspec

    from helios_core.runtime.messages import PreparedRequest, SamplingParams, Submit
    from helios_core.runtime.remote import to_worker_decoder

    image = prompt_image(1, 2, 3.0, digest=b"\x01" * 16)
    request = PreparedRequest("r", [1, 2, 3, 4], 4, SamplingParams(), images=[image])
    decoded = to_worker_decoder().decode(msgspec.msgpack.Encoder().encode(Submit(request)))
    assert isinstance(decoded, Submit)
    assert decoded.request.images == [image]
    assert decoded.request.images[0].tensors[0].array().tolist() == image.tensors[0].array().tolist()
