"""The image plugins and the server-side image frontend: the first-party preparations and layouts pinned
to hand-computed numbers, ImageFrontend.expand (sentinels, capacities, digests), the plugin-author
harness, the NONE selections and every startup refusal."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from helios_core import plugin_api
from helios_core.errors import StartupError
from helios_core.plugin_api import (
    PATCH_COLUMNS,
    PATCH_ROWS,
    PATCHES,
    DecodedImage,
    ImageInputError,
    ImagePlacement,
    PreparedImage,
    Register,
    VisionSettings,
)
from helios_core.plugins import PluginHost
from helios_core.plugins import images as image_types
from helios_core.server.images import ImageFrontend, ImagePlacementError, placement_problems
from helios_core.testing import ImageHarness, PlacementMismatch, image_frontend
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from helios_plugins import images as first_party
from helios_plugins import none as none_plugin

FEATURE, OPEN, CLOSE, SENTINEL = 900, 901, 902, 999
TILE = (ct.IMAGE_PREPARATION_FIXED_TILE, ct.IMAGE_LAYOUT_RASTER_SPAN)
GRID = (ct.IMAGE_PREPARATION_PATCH_GRID, ct.IMAGE_LAYOUT_MERGED_GRID)


def vision(
    *,
    patch_size: int = 2,
    patches_per_feature: int = 1,
    min_pixels: int = 16,
    max_pixels: int = 16,
    mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] = (0.5, 0.5, 0.5),
    features_per_window: int = 64,
    feature_slots: int = 128,
    patch_capacities: tuple[int, ...] = (64,),
    feature_ids: tuple[int, ...] = (FEATURE,),
    spans: tuple[tuple[int, int], ...] = ((OPEN, CLOSE),),
    temporal_patch: int = 0,
) -> ct.VisionContract:
    contract = ct.VisionContract(
        feature_slots=feature_slots,
        features_per_window=features_per_window,
        patches_per_feature=patches_per_feature,
        patch_capacities=list(patch_capacities),
    )
    contract.token_layout.feature_ids.extend(feature_ids)
    for open_id, close_id in spans:
        contract.token_layout.atomic_spans.add(open_id=open_id, close_id=close_id)
    settings = contract.settings
    settings.patch_size = patch_size
    settings.min_pixels = min_pixels
    settings.max_pixels = max_pixels
    settings.mean.extend(mean)
    settings.std.extend(std)
    settings.temporal_patch = temporal_patch
    return contract


def harness(selection: tuple[int, int], contract: ct.VisionContract, **options: Any) -> ImageHarness:
    return ImageHarness(image_frontend(*selection), contract, sentinel_ids=(SENTINEL,), **options)


def settings_of(contract: ct.VisionContract, selection: tuple[int, int] = TILE) -> VisionSettings:
    return VisionSettings.of(image_frontend(*selection), contract, (SENTINEL,))


# A 4x4 image of four 2x2 patches: channel 0 lights the top-left patch, channel 1 every odd column,
# channel 2 the bottom pixel row; 255 normalises to 1 and 0 to -1 with mean = std = 0.5.
CHECKER = np.zeros((4, 4, 3), dtype=np.uint8)
CHECKER[0:2, 0:2, 0] = 255
CHECKER[:, 1::2, 1] = 255
CHECKER[3, :, 2] = 255
CHECKER_PATCHES = [
    # channel 0 (y0x0 y0x1 y1x0 y1x1), channel 1, channel 2
    [1, 1, 1, 1, -1, 1, -1, 1, -1, -1, -1, -1],  # row 0, column 0
    [-1, -1, -1, -1, -1, 1, -1, 1, -1, -1, -1, -1],  # row 0, column 1
    [-1, -1, -1, -1, -1, 1, -1, 1, -1, -1, 1, 1],  # row 1, column 0
    [-1, -1, -1, -1, -1, 1, -1, 1, -1, -1, 1, 1],  # row 1, column 1
]


# -- preparations ----------------------------------------------------------------------------------


def test_fixed_tile_cuts_a_two_by_two_patch_image_by_hand() -> None:
    run = harness(TILE, vision()).run(CHECKER)
    assert run.prepared.grid == (2, 2)
    assert run.prepared.patches.dtype == np.float32
    assert run.prepared.patches.tolist() == CHECKER_PATCHES
    assert run.prepared.digest == DecodedImage.of(CHECKER).digest


def test_normalisation_uses_each_channels_mean_and_std() -> None:
    pixels = np.full((4, 4, 3), (51, 102, 204), dtype=np.uint8)
    prepared = harness(TILE, vision(mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 2.0))).prepare(pixels)
    expected = [(51 / 255 - 0.1) / 0.5, (102 / 255 - 0.2) / 0.25, (204 / 255 - 0.3) / 2.0]
    row = prepared.patches[0].reshape(3, 4)
    for channel in range(3):
        assert row[channel].tolist() == pytest.approx([expected[channel]] * 4, abs=1e-6)


def test_fixed_tile_resizes_any_image_to_its_square() -> None:
    pixels = np.full((7, 5, 3), 255, dtype=np.uint8)
    prepared = harness(TILE, vision(patch_size=2, min_pixels=0, max_pixels=40)).prepare(pixels)
    # isqrt(40) = 6: a 6x6 tile of 3x3 patches; bicubic keeps a constant image constant.
    assert prepared.grid == (3, 3)
    assert prepared.patches.shape == (9, 12)
    assert np.all(prepared.patches == 1.0)


def test_patch_grid_orders_patches_in_merge_blocks() -> None:
    pixels = np.zeros((4, 4, 3), dtype=np.uint8)
    pixels[:, :, 0] = 16 * np.arange(4)[:, None] + np.arange(4)[None, :]
    contract = vision(patch_size=1, patches_per_feature=4, mean=(0, 0, 0), std=(1, 1, 1))
    run = harness(GRID, contract).run(pixels)
    assert run.prepared.grid == (4, 4)
    assert np.rint(run.prepared.patches[:, 0] * 255).astype(int).tolist() == [
        *(0, 1, 16, 17),  # block (0, 0): raster order inside the block
        *(2, 3, 18, 19),  # block (0, 1)
        *(32, 33, 48, 49),  # block (1, 0)
        *(34, 35, 50, 51),  # block (1, 1)
    ]
    placement = run.placement
    assert placement.tensors[PATCH_ROWS].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert placement.tensors[PATCH_COLUMNS].tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 0, 1, 0, 1, 2, 3, 2, 3]
    assert placement.token_ids == (OPEN, FEATURE, FEATURE, FEATURE, FEATURE, CLOSE)
    assert placement.feature_tokens == (1, 2, 3, 4)
    assert placement.patch_count == 16


@pytest.mark.parametrize(
    ("height", "width", "min_pixels", "max_pixels", "expected"),
    [
        (100, 50, 3136, 12544, (112, 56)),  # rounded to the nearest blocks
        (1000, 2000, 3136, 12544, (56, 140)),  # shrunk below max_pixels
        (10, 10, 3136, 12544, (56, 56)),  # grown to min_pixels
        (1, 5000, 784, 12544, (28, 448)),  # the short side held at one block, the long side cut to fit
    ],
)
def test_patch_grid_fits_sizes_to_blocks_within_the_pixel_range(
    height: int, width: int, min_pixels: int, max_pixels: int, expected: tuple[int, int]
) -> None:
    assert first_party.fit_dimensions(height, width, 28, min_pixels, max_pixels) == expected


def test_patch_grid_refuses_an_image_no_block_size_fits() -> None:
    with pytest.raises(ImageInputError, match=r"a 100x100 image cannot be resized to multiples of 28 pixels"):
        first_party.fit_dimensions(100, 100, 28, 2352, 2352)


def test_patch_grid_resizes_and_normalises_a_uniform_image() -> None:
    pixels = np.full((30, 20, 3), 128, dtype=np.uint8)
    contract = vision(patch_size=2, patches_per_feature=4, min_pixels=16, max_pixels=1024)
    run = harness(GRID, contract).run(pixels)
    # factor 4: 30 -> round(7.5) = 8 blocks = 32 pixels, 20 -> 5 blocks = 20 pixels (640 <= 1024)
    assert run.prepared.grid == (16, 10)
    assert run.prepared.patches.shape == (160, 12)
    assert np.allclose(run.prepared.patches, (128 / 255 - 0.5) / 0.5, atol=1e-6)
    assert run.placement.feature_count == 40


# -- layouts ---------------------------------------------------------------------------------------


def test_raster_span_places_the_checker_in_raster_order() -> None:
    placement = harness(TILE, vision()).run(CHECKER).placement
    assert placement.token_ids == (OPEN, FEATURE, FEATURE, FEATURE, FEATURE, CLOSE)
    assert placement.feature_tokens == (1, 2, 3, 4)
    assert placement.patch_count == 4
    assert sorted(placement.tensors) == [PATCH_COLUMNS, PATCH_ROWS, PATCHES]
    assert placement.tensors[PATCHES].tolist() == CHECKER_PATCHES
    assert placement.tensors[PATCH_ROWS].dtype == np.int32
    assert placement.tensors[PATCH_ROWS].tolist() == [0, 0, 1, 1]
    assert placement.tensors[PATCH_COLUMNS].tolist() == [0, 1, 0, 1]


def test_raster_span_merges_consecutive_patches_into_features() -> None:
    placement = harness(TILE, vision(patches_per_feature=2)).run(CHECKER).placement
    assert placement.token_ids == (OPEN, FEATURE, FEATURE, CLOSE)
    assert placement.feature_tokens == (1, 2)
    assert placement.patch_count == 4


def test_layouts_use_the_first_span_and_feature_id() -> None:
    contract = vision(feature_ids=(700, 701), spans=((710, 711), (720, 721)))
    assert harness(TILE, contract).run(CHECKER).placement.token_ids == (710, 700, 700, 700, 700, 711)


def test_raster_span_refuses_patches_that_do_not_split_into_features() -> None:
    layout = first_party.RasterSpanLayout(settings_of(vision(patches_per_feature=3)))
    image = PreparedImage(np.zeros((4, 12), dtype=np.float32), (2, 2), b"d")
    with pytest.raises(ImageInputError, match="4 patches do not split into features of 3 patches"):
        layout.place(image)


def test_merged_grid_refuses_a_grid_that_is_not_whole_blocks() -> None:
    layout = first_party.MergedGridLayout(settings_of(vision(patches_per_feature=4), GRID))
    image = PreparedImage(np.zeros((8, 12), dtype=np.float32), (2, 4), b"d")
    assert layout.place(image).token_ids == (OPEN, FEATURE, FEATURE, CLOSE)
    with pytest.raises(ImageInputError, match=r"a 1x8 patch grid does not split into 2x2 merge blocks"):
        layout.place(PreparedImage(np.zeros((8, 12), dtype=np.float32), (1, 8), b"d"))


# -- startup refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "contract", "message"),
    [
        (first_party.fixed_tile, vision(patch_size=0), "vision.settings.patch_size must be positive"),
        (first_party.fixed_tile, vision(mean=(0.5, 0.5)), "vision.settings.mean needs 3 entries"),
        (first_party.patch_grid, vision(std=(0.5,) * 4), "vision.settings.std needs 3 entries"),
        (
            first_party.fixed_tile,
            vision(std=(0.5, 0.0, 0.5)),
            "vision.settings.std entries must be finite and non-zero",
        ),
        (
            first_party.patch_grid,
            vision(min_pixels=32, max_pixels=16),
            "vision.settings.min_pixels 32 is larger than max_pixels 16",
        ),
        (first_party.fixed_tile, vision(max_pixels=0, min_pixels=0), "vision.settings.max_pixels must be positive"),
        (first_party.fixed_tile, vision(temporal_patch=2), "temporal_patch 2 is not supported"),
        (
            first_party.fixed_tile,
            vision(patch_size=3, max_pixels=16),
            "the tile side isqrt(vision.settings.max_pixels) = 4 is not a multiple of vision.settings.patch_size 3",
        ),
        (
            first_party.patch_grid,
            vision(patches_per_feature=2),
            "vision.patches_per_feature 2 must be a positive perfect square",
        ),
        (
            first_party.patch_grid,
            vision(patches_per_feature=4, max_pixels=15, min_pixels=0),
            "max_pixels 15 cannot hold one 4x4 block",
        ),
        (
            first_party.merged_grid,
            vision(patches_per_feature=8),
            "image layout MERGED_GRID: vision.patches_per_feature 8 must be a positive perfect square",
        ),
        (first_party.raster_span, vision(spans=()), "vision.token_layout declares no atomic span"),
        (first_party.merged_grid, vision(feature_ids=()), "vision.token_layout declares no feature id"),
        (first_party.raster_span, vision(patches_per_feature=0), "vision.patches_per_feature must be positive"),
    ],
)
def test_factories_refuse_unusable_settings(factory: Any, contract: ct.VisionContract, message: str) -> None:
    with pytest.raises(StartupError, match=re.escape(message)):
        factory(settings_of(contract))


def test_the_host_registers_the_first_party_image_plugins() -> None:
    host = PluginHost(autoload=False).start()
    assert {
        kind: {identifier: provider.name for identifier, provider in host.registries[kind].items()}
        for kind in ("image_preparation", "image_layout")
    } == {
        "image_preparation": {1: "none", 2: "patch-grid", 3: "fixed-tile"},
        "image_layout": {1: "none", 2: "raster-span", 3: "merged-grid"},
    }


# -- the NONE selections and the plugin API --------------------------------------------------------


def test_none_factories_take_vision_settings_and_refuse_images() -> None:
    built = none_plugin.text_only(settings_of(vision()))
    assert built.accepts_images is False
    assert built.tensor_names == frozenset()


def test_the_plugin_api_exports_every_image_name_at_minor_one() -> None:
    assert plugin_api.PLUGIN_API_VERSION == (1, 1)
    assert set(image_types.__all__) <= set(plugin_api.__all__)
    for name in image_types.__all__:
        assert getattr(plugin_api, name) is getattr(image_types, name)
    from helios_core.plugins import types

    assert types.ImagePreparationFactory is image_types.ImagePreparationFactory
    assert types.ImageLayoutFactory is image_types.ImageLayoutFactory


# -- the harness -----------------------------------------------------------------------------------


class ShortRows:
    """A layout whose patch_rows tensor misses a row and whose feature offset lies outside its span."""

    tensor_names = frozenset({PATCHES, PATCH_ROWS})

    def place(self, image: PreparedImage) -> ImagePlacement:
        count = image.patches.shape[0]
        tensors = {PATCHES: image.patches, PATCH_ROWS: np.zeros(count - 1, dtype=np.int32)}
        return ImagePlacement((OPEN, FEATURE, CLOSE), (1, 3), tensors, count)


class ShortRowsPlugin:
    @staticmethod
    def helios_register_image_layouts(register: Register) -> None:
        register(100_077, lambda settings: ShortRows(), name="short-rows")


def test_the_harness_checks_a_third_party_placement() -> None:
    broken = ImageHarness(
        image_frontend(ct.IMAGE_PREPARATION_FIXED_TILE, 100_077), vision(), plugins=[ShortRowsPlugin()]
    )
    assert broken.selected.image_layout.name == "short-rows"
    with pytest.raises(PlacementMismatch) as info:
        broken.run(CHECKER)
    assert str(info.value) == (
        "feature_tokens [3] lie outside token_ids (length 3); tensor 'patch_rows' has shape (3,), not 4 leading rows"
    )


def test_placement_problems_names_missing_and_extra_tensors() -> None:
    placement = ImagePlacement((1,), (), {PATCHES: np.zeros((2, 3))}, 2)
    assert placement_problems(placement, frozenset({PATCH_ROWS})) == [
        "tensors ['patches'] differ from the layout's tensor_names ['patch_rows']"
    ]
    assert placement_problems(ImagePlacement((), (0, 0), {}, 0)) == [
        "token_ids is empty",
        "feature_tokens [0, 0] lie outside token_ids (length 0)",
        "feature_tokens repeats an offset",
    ]


def test_the_harness_raises_the_factorys_startup_error() -> None:
    with pytest.raises(StartupError, match=re.escape("vision.settings.patch_size must be positive")):
        harness(TILE, vision(patch_size=0))


# -- ImageFrontend ---------------------------------------------------------------------------------


def core(
    contract: ct.VisionContract,
    selection: tuple[int, int] = TILE,
    *,
    sentinels: tuple[int, ...] = (SENTINEL,),
    destinations: dict[str, tuple[str, tuple[int, ...]]] | None = None,
) -> tuple[Any, Any]:
    """A prepared-contract stand-in (model, graphs with bindings, transport) and its selection."""
    frontend = image_frontend(*selection)
    model = ct.ModelContract(vision=contract, frontend=frontend)
    model.input_vocabulary.image_sentinel_ids.extend(sentinels)
    graph = ct.GraphContract(name="prefill")
    transport = {}
    for destination, (output, shape) in (destinations or {}).items():
        graph.bindings.add(
            destination=destination,
            source=ct.VALUE_SOURCE_IMAGE_TENSOR,
            indexing=ct.INDEXING_SCALAR,
            image_output=output,
        )
        transport[destination] = mf.TransportEntry(name=destination, dtype=mf.DTYPE_F32, shape=list(shape))
    prepared = SimpleNamespace(model=model, graphs={"prefill": SimpleNamespace(contract=graph)}, transport=transport)
    return prepared, PluginHost(autoload=False).resolve(frontend)


def frontend_of(contract: ct.VisionContract, selection: tuple[int, int] = TILE, **options: Any) -> ImageFrontend:
    return ImageFrontend.of(*core(contract, selection, **options))


def uniform(value: int, height: int = 4, width: int = 4) -> DecodedImage:
    return DecodedImage.of(np.full((height, width, 3), value, dtype=np.uint8))


def test_expand_replaces_each_sentinel_by_its_span() -> None:
    images = frontend_of(vision(patches_per_feature=2))
    assert images.accepts_images
    assert images.sentinel_ids == frozenset({SENTINEL})
    first, second = DecodedImage.of(CHECKER), uniform(7)
    ids, placed = images.expand([5, SENTINEL, 6, 7, SENTINEL], [first, second])
    span = [OPEN, FEATURE, FEATURE, CLOSE]
    assert ids == [5, *span, 6, 7, *span]
    assert [(p.start, p.length, p.feature_tokens, p.patch_count) for p in placed] == [
        (1, 4, [1, 2], 4),
        (7, 4, [1, 2], 4),
    ]
    assert [p.digest for p in placed] == [first.digest, second.digest]
    tensors = {tensor.name: tensor for tensor in placed[0].tensors}
    assert [tensor.name for tensor in placed[0].tensors] == [PATCH_COLUMNS, PATCH_ROWS, PATCHES]
    assert (tensors[PATCHES].dtype, tensors[PATCHES].shape) == ("float32", [4, 12])
    assert tensors[PATCHES].array().tolist() == CHECKER_PATCHES
    assert tensors[PATCH_ROWS].array().tolist() == [0, 0, 1, 1]
    assert (tensors[PATCH_COLUMNS].dtype, tensors[PATCH_COLUMNS].array().tolist()) == ("int32", [0, 1, 0, 1])


def test_expand_leaves_a_text_prompt_alone() -> None:
    assert frontend_of(vision()).expand([1, 2, 3], []) == ([1, 2, 3], [])


def test_digests_follow_the_pixels() -> None:
    images = frontend_of(vision())
    _, placed = images.expand([SENTINEL, SENTINEL, SENTINEL], [uniform(3), uniform(3), uniform(4)])
    assert placed[0].digest == placed[1].digest
    assert placed[0].digest != placed[2].digest
    assert len(placed[0].digest) == 32


@pytest.mark.parametrize(("sentinels", "count"), [(1, 2), (2, 1), (0, 1)])
def test_expand_refuses_a_sentinel_count_that_differs_from_the_images(sentinels: int, count: int) -> None:
    with pytest.raises(ImageInputError) as info:
        frontend_of(vision()).expand([1] + [SENTINEL] * sentinels, [uniform(1)] * count)
    assert str(info.value) == (
        f"the rendered prompt has {sentinels} image placeholders but the request carries {count} images"
    )
    assert info.value.index is None


def test_expand_enforces_the_per_image_feature_capacity() -> None:
    # PATCH_GRID, patch 2, one patch per feature: a 4x4 image is 4 features, a 4x8 one 8.
    images = frontend_of(vision(features_per_window=4, max_pixels=64, min_pixels=0), GRID)
    assert images.expand([SENTINEL], [uniform(1)])[1][0].feature_count == 4
    with pytest.raises(ImageInputError) as info:
        images.expand([SENTINEL, SENTINEL], [uniform(1), uniform(1, 4, 8)])
    assert str(info.value) == "image 1 needs 8 image features, more than the model's 4 per image"
    assert info.value.index == 1


def test_expand_enforces_the_request_feature_slots() -> None:
    images = frontend_of(vision(feature_slots=8))
    assert len(images.expand([SENTINEL, SENTINEL], [uniform(1), uniform(2)])[1]) == 2
    with pytest.raises(ImageInputError) as info:
        images.expand([SENTINEL] * 3, [uniform(1)] * 3)
    assert str(info.value) == "the request's images need 12 image features, more than the model's 8"
    assert info.value.index is None


def test_the_patch_capacity_is_the_largest_image_tensor_destination() -> None:
    bound = {"vision.patches": (PATCHES, (6, 12)), "vision.rows": (PATCH_ROWS, (6,))}
    images = frontend_of(vision(max_pixels=64, min_pixels=0, patch_capacities=(1000,)), GRID, destinations=bound)
    assert images.patch_capacity == 6
    assert images.expand([SENTINEL], [uniform(1)])[1][0].patch_count == 4
    with pytest.raises(ImageInputError) as info:
        images.expand([SENTINEL, SENTINEL], [uniform(1), uniform(1, 4, 8)])
    assert str(info.value) == "image 1 has 8 patches, more than the model's largest capacity of 6"
    assert info.value.index == 1


def test_without_image_tensor_bindings_the_patch_capacity_is_the_largest_declared() -> None:
    assert frontend_of(vision(patch_capacities=(4, 9, 6))).patch_capacity == 9


def test_a_preparation_error_names_its_image() -> None:
    # min = max = 12 pixels of 2x2 patches: a 2x6 image fits (three patches), a square one cannot.
    settings = settings_of(vision(min_pixels=12, max_pixels=12), GRID)
    images = ImageFrontend(
        settings, first_party.patch_grid(settings), first_party.merged_grid(settings), patch_capacity=None
    )
    assert images.expand([SENTINEL], [uniform(1, 2, 6)])[1][0].patch_count == 3
    with pytest.raises(ImageInputError) as info:
        images.expand([SENTINEL, SENTINEL], [uniform(1, 2, 6), uniform(1)])
    assert str(info.value) == (
        "a 4x4 image cannot be resized to multiples of 2 pixels with an area within [12, 12] "
        "(its aspect ratio is too extreme)"
    )
    assert info.value.index == 1


def test_a_trial_image_the_capacities_refuse_is_not_a_startup_error() -> None:
    images = frontend_of(vision(features_per_window=2))
    with pytest.raises(ImageInputError, match=r"^image 0 needs 4 image features, more than the model's 2 per image$"):
        images.expand([SENTINEL], [uniform(1)])


def test_a_text_only_core_refuses_images() -> None:
    images = frontend_of(vision(), (ct.IMAGE_PREPARATION_NONE, ct.IMAGE_LAYOUT_NONE), sentinels=())
    assert not images.accepts_images
    assert images.expand([1, 2], []) == ([1, 2], [])
    with pytest.raises(ImageInputError, match=r"^this model does not accept image inputs$"):
        images.expand([1, 2], [uniform(1)])


def test_a_broken_placement_is_a_plugin_defect_not_a_client_error() -> None:
    host = PluginHost(autoload=False)
    host.plugin_manager.register(ShortRowsPlugin())
    prepared, _ = core(vision())
    frontend = image_frontend(ct.IMAGE_PREPARATION_FIXED_TILE, 100_077)
    prepared.model.frontend.CopyFrom(frontend)
    with pytest.raises(
        StartupError, match="fail on a 16x16 image: ImagePlacementError: the image layout's placement of image 0"
    ):
        ImageFrontend.of(prepared, host.resolve(frontend))
    images = ImageFrontend(
        settings_of(vision()),
        first_party.fixed_tile(settings_of(vision())),
        ShortRows(),
        patch_capacity=None,
    )
    with pytest.raises(ImagePlacementError, match="tensor 'patch_rows' has shape"):
        images.expand([SENTINEL], [uniform(1)])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"destinations": {"vision.depth": ("patch_depth", (4, 1))}},
            "the core's IMAGE_TENSOR bindings name image outputs ['patch_depth'] that image layout 2 (raster-span) "
            "does not produce (it produces ['patch_cols', 'patch_rows', 'patches'])",
        ),
        (
            {"destinations": {"vision.patches": (PATCHES, (4, 27))}},
            "graph 'prefill' binds image output 'patches' to 'vision.patches' with rows of shape [27], but the image "
            "layout writes rows of shape [12]",
        ),
        ({"sentinels": ()}, "the core selects image plugins but input_vocabulary declares no image sentinel id"),
    ],
)
def test_image_frontend_refuses_unusable_core_data(options: dict[str, Any], message: str) -> None:
    with pytest.raises(StartupError) as info:
        frontend_of(vision(), **options)
    assert str(info.value) == message


def test_image_frontend_names_the_plugin_whose_factory_refuses() -> None:
    with pytest.raises(StartupError) as info:
        frontend_of(vision(patch_size=0))
    assert str(info.value) == (
        "image preparation 3 (fixed-tile from 'helios'): image preparation FIXED_TILE: "
        "vision.settings.patch_size must be positive"
    )


def test_image_frontend_refuses_a_half_text_only_selection() -> None:
    with pytest.raises(StartupError, match=r"image layout 1 \(none\) takes no images"):
        frontend_of(vision(), (ct.IMAGE_PREPARATION_FIXED_TILE, ct.IMAGE_LAYOUT_NONE))
