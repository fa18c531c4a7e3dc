"""Tests of the example image layout, written with the Helios plugin-author harness."""

from __future__ import annotations

import helios_example_image_layout
import numpy as np
import pytest

from helios_core.errors import StartupError
from helios_core.plugin_api import PreparedImage
from helios_core.testing import ImageHarness, image_frontend
from helios_core.wire import contract_pb2 as ct

FEATURE, OPEN, CLOSE = 900, 901, 902


def vision(patches_per_feature: int = 1) -> ct.VisionContract:
    """3x3 tiles of 1-pixel patches, normalised to pixel / 255."""
    contract = ct.VisionContract(
        feature_slots=64, features_per_window=16, patches_per_feature=patches_per_feature, patch_capacities=[9]
    )
    contract.token_layout.feature_ids.append(FEATURE)
    contract.token_layout.atomic_spans.add(open_id=OPEN, close_id=CLOSE)
    settings = contract.settings
    settings.patch_size, settings.min_pixels, settings.max_pixels = 1, 9, 9
    settings.mean.extend([0.0, 0.0, 0.0])
    settings.std.extend([1.0, 1.0, 1.0])
    return contract


def harness(layout: int, patches_per_feature: int = 1) -> ImageHarness:
    frontend = image_frontend(ct.IMAGE_PREPARATION_FIXED_TILE, layout)
    return ImageHarness(frontend, vision(patches_per_feature), plugins=[helios_example_image_layout])


PIXELS = np.zeros((3, 3, 3), dtype=np.uint8)
PIXELS[:, :, 0] = 10 * np.arange(3)[:, None] + np.arange(3)[None, :]  # channel 0 spells 10 * row + column


def channel_zero(run_tensor: np.ndarray) -> list[int]:
    return np.rint(run_tensor[:, 0] * 255).astype(int).tolist()


def test_features_go_column_by_column() -> None:
    run = harness(helios_example_image_layout.IDENTIFIER).run(PIXELS)
    placement = run.placement
    assert placement.token_ids == (OPEN, *[FEATURE] * 9, CLOSE)
    assert placement.feature_tokens == tuple(range(1, 10))
    assert channel_zero(placement.tensors["patches"]) == [0, 10, 20, 1, 11, 21, 2, 12, 22]
    assert placement.tensors["patch_rows"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert placement.tensors["patch_cols"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_the_output_differs_from_raster_span_only_in_order() -> None:
    column = harness(helios_example_image_layout.IDENTIFIER).run(PIXELS).placement
    raster = harness(ct.IMAGE_LAYOUT_RASTER_SPAN).run(PIXELS).placement
    assert column.token_ids == raster.token_ids
    assert set(column.tensors) == set(raster.tensors) == {"patches", "patch_rows", "patch_cols"}
    assert channel_zero(raster.tensors["patches"]) == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert channel_zero(column.tensors["patches"]) != channel_zero(raster.tensors["patches"])
    pairs = {(r, c) for r, c in zip(column.tensors["patch_rows"], column.tensors["patch_cols"], strict=True)}
    assert pairs == {(r, c) for r, c in zip(raster.tensors["patch_rows"], raster.tensors["patch_cols"], strict=True)}


def test_a_wide_grid_keeps_rows_and_columns_apart() -> None:
    layout = harness(helios_example_image_layout.IDENTIFIER).layout
    patches = np.arange(6, dtype=np.float32).reshape(6, 1)  # raster order of a 2x3 grid
    placement = layout.place(PreparedImage(patches, (2, 3), b"digest"))
    assert placement.tensors["patches"][:, 0].tolist() == [0, 3, 1, 4, 2, 5]
    assert placement.tensors["patch_rows"].tolist() == [0, 1, 0, 1, 0, 1]
    assert placement.tensors["patch_cols"].tolist() == [0, 0, 1, 1, 2, 2]


def test_consecutive_patches_merge_into_features() -> None:
    placement = harness(helios_example_image_layout.IDENTIFIER, patches_per_feature=3).run(PIXELS).placement
    assert placement.token_ids == (OPEN, FEATURE, FEATURE, FEATURE, CLOSE)
    assert placement.feature_tokens == (1, 2, 3)
    assert placement.patch_count == 9


def test_missing_token_layout_fails_at_build() -> None:
    contract = vision()
    contract.token_layout.ClearField("atomic_spans")
    frontend = image_frontend(ct.IMAGE_PREPARATION_FIXED_TILE, helios_example_image_layout.IDENTIFIER)
    with pytest.raises(StartupError, match="needs an atomic span and a feature id"):
        ImageHarness(frontend, contract, plugins=[helios_example_image_layout])
