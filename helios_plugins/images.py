"""First-party image preparations (PATCH_GRID, FIXED_TILE) and image layouts (RASTER_SPAN, MERGED_GRID).

Owns the pixel arithmetic of the built-in image algorithms; everything they read comes from the
core's ``VisionContract`` (``VisionSettings.vision``), and every setting is checked when the factory
builds, so an unusable core fails at startup (``StartupError`` naming the field) rather than on a
request.

Preparations (pixels to patches):

* ``IMAGE_PREPARATION_PATCH_GRID`` (dynamic resolution): resizes (Pillow, bicubic) so that both sides
  are multiples of ``patch_size * merge_edge`` (``merge_edge = isqrt(patches_per_feature)``) and the
  area lies within ``[min_pixels, max_pixels]``, keeping the aspect ratio as closely as the block
  size allows; patches come in merge-block order: each run of ``patches_per_feature`` consecutive
  patches is one ``merge_edge x merge_edge`` block, blocks in raster order, raster order inside a block.
* ``IMAGE_PREPARATION_FIXED_TILE``: resizes to a square of side ``isqrt(max_pixels)`` (a multiple of
  ``patch_size``); patches in raster order.

Both normalise each channel as ``(pixel / 255 - mean[c]) / std[c]`` and flatten a patch as
``patch[c, y, x]`` (channel, then pixel row, then pixel column): ``3 * patch_size**2`` float32 values.

Layouts (patches to a token span and tensors), both with token ids ``[open] + [feature] * F +
[close]`` (the first atomic span, the first feature id, ``F = patches / patches_per_feature``) and
the tensors ``patches``, ``patch_rows`` and ``patch_cols`` (each patch's true row and column in the
resized image's patch grid):

* ``IMAGE_LAYOUT_RASTER_SPAN`` reads patches in raster order (FIXED_TILE's): patch ``i`` sits at
  ``(i // columns, i % columns)`` and each run of ``patches_per_feature`` patches is one feature.
* ``IMAGE_LAYOUT_MERGED_GRID`` reads patches in merge-block order (PATCH_GRID's): each feature is one
  ``merge_edge x merge_edge`` block; ``patches_per_feature`` must be a perfect square.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from helios_core.plugin_api import (
    PATCH_COLUMNS,
    PATCH_ROWS,
    PATCHES,
    DecodedImage,
    ImageInputError,
    ImagePlacement,
    PreparedImage,
    Register,
    StartupError,
    VisionSettings,
    contract,
)

HELIOS_PLUGIN_API = (1, 1)

CHANNELS = 3


# -- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PixelSettings:
    """The checked ``ImageSettings`` of a core."""

    patch_size: int
    min_pixels: int
    max_pixels: int
    mean: npt.NDArray[np.float32]
    std: npt.NDArray[np.float32]

    @property
    def patch_width(self) -> int:
        """Values per patch row: ``3 * patch_size**2``."""
        return CHANNELS * self.patch_size * self.patch_size


def pixel_settings(settings: VisionSettings, kind: str) -> PixelSettings:
    """``vision.settings`` checked; ``StartupError`` naming every unusable field."""
    image = settings.vision.settings
    problems: list[str] = []
    if image.patch_size <= 0:
        problems.append("vision.settings.patch_size must be positive")
    if len(image.mean) != CHANNELS:
        problems.append(f"vision.settings.mean needs {CHANNELS} entries (one per RGB channel), not {len(image.mean)}")
    if len(image.std) != CHANNELS:
        problems.append(f"vision.settings.std needs {CHANNELS} entries (one per RGB channel), not {len(image.std)}")
    elif any(not math.isfinite(value) or value == 0 for value in image.std):
        problems.append(f"vision.settings.std entries must be finite and non-zero, not {list(image.std)}")
    if any(not math.isfinite(value) for value in image.mean):
        problems.append(f"vision.settings.mean entries must be finite, not {list(image.mean)}")
    if image.max_pixels <= 0:
        problems.append("vision.settings.max_pixels must be positive")
    if image.min_pixels > image.max_pixels:
        problems.append(f"vision.settings.min_pixels {image.min_pixels} is larger than max_pixels {image.max_pixels}")
    if image.temporal_patch > 1:
        problems.append(
            f"vision.settings.temporal_patch {image.temporal_patch} is not supported: {kind} prepares single frames"
        )
    if problems:
        raise StartupError(f"image preparation {kind}: " + "; ".join(problems))
    return PixelSettings(
        int(image.patch_size),
        int(image.min_pixels),
        int(image.max_pixels),
        np.asarray(list(image.mean), dtype=np.float32),
        np.asarray(list(image.std), dtype=np.float32),
    )


def merge_edge(patches_per_feature: int, owner: str) -> int:
    """``isqrt(patches_per_feature)``; ``StartupError`` when it is not a positive perfect square."""
    edge = math.isqrt(patches_per_feature) if patches_per_feature > 0 else 0
    if edge == 0 or edge * edge != patches_per_feature:
        raise StartupError(
            f"{owner}: vision.patches_per_feature {patches_per_feature} must be a positive perfect square "
            "(each feature merges a square block of patches)"
        )
    return edge


# -- pixel work ----------------------------------------------------------------------------------


def resize(pixels: npt.NDArray[np.uint8], height: int, width: int) -> npt.NDArray[np.uint8]:
    """``pixels`` resized to ``height x width`` with Pillow's bicubic filter (unchanged when equal)."""
    if pixels.shape[0] == height and pixels.shape[1] == width:
        return pixels
    from PIL import Image

    resized = Image.fromarray(np.ascontiguousarray(pixels)).resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8)


def normalise(pixels: npt.NDArray[np.uint8], settings: PixelSettings) -> npt.NDArray[np.float32]:
    """``[3, height, width]`` float32 of ``(pixel / 255 - mean[c]) / std[c]``."""
    scaled = pixels.astype(np.float32) / np.float32(255.0)
    normalised = (scaled - settings.mean) / settings.std
    return np.ascontiguousarray(normalised.transpose(2, 0, 1), dtype=np.float32)


def cut_patches(planes: npt.NDArray[np.float32], patch_size: int, edge: int) -> npt.NDArray[np.float32]:
    """Patches of ``planes`` (``[3, H, W]``, both sides multiples of ``patch_size * edge``) as
    ``[patches, 3 * patch_size**2]`` in merge-block order with blocks of ``edge x edge`` patches
    (``edge`` 1: raster order)."""
    channels, height, width = planes.shape
    block_rows, block_cols = height // (patch_size * edge), width // (patch_size * edge)
    grid = planes.reshape(channels, block_rows, edge, patch_size, block_cols, edge, patch_size)
    # -> block row, block column, row in block, column in block, channel, pixel row, pixel column
    ordered = grid.transpose(1, 4, 2, 5, 0, 3, 6)
    return np.ascontiguousarray(ordered.reshape(-1, channels * patch_size * patch_size), dtype=np.float32)


def fit_dimensions(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized ``(height, width)``: multiples of ``factor``, the area within ``[min_pixels,
    max_pixels]``, the aspect ratio kept as closely as possible. ``ImageInputError`` when no such
    size exists for this aspect ratio."""
    rows = max(1, round(height / factor))
    cols = max(1, round(width / factor))
    block = factor * factor
    if rows * cols * block > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        rows = max(1, math.floor(height / shrink / factor))
        cols = max(1, math.floor(width / shrink / factor))
    elif rows * cols * block < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        rows = max(1, math.ceil(height * grow / factor))
        cols = max(1, math.ceil(width * grow / factor))
    # A very long or tall image holds its short side at one block; shorten the long side instead.
    while rows * cols * block > max_pixels and max(rows, cols) > 1:
        if rows >= cols:
            rows -= 1
        else:
            cols -= 1
    area = rows * cols * block
    if not min_pixels <= area <= max_pixels:
        raise ImageInputError(
            f"a {width}x{height} image cannot be resized to multiples of {factor} pixels with an area within "
            f"[{min_pixels}, {max_pixels}] (its aspect ratio is too extreme)"
        )
    return rows * factor, cols * factor


# -- preparations --------------------------------------------------------------------------------


class PatchGridPreparer:
    """IMAGE_PREPARATION_PATCH_GRID (see the module docstring)."""

    accepts_images = True

    def __init__(self, settings: VisionSettings) -> None:
        self.pixels = pixel_settings(settings, "PATCH_GRID")
        self.edge = merge_edge(int(settings.vision.patches_per_feature), "image preparation PATCH_GRID")
        self.factor = self.pixels.patch_size * self.edge
        if self.pixels.max_pixels < self.factor * self.factor:
            raise StartupError(
                f"image preparation PATCH_GRID: vision.settings.max_pixels {self.pixels.max_pixels} cannot hold "
                f"one {self.factor}x{self.factor} block of patches (patch_size x merge edge)"
            )

    def prepare(self, image: DecodedImage) -> PreparedImage:
        height, width = fit_dimensions(
            image.height, image.width, self.factor, self.pixels.min_pixels, self.pixels.max_pixels
        )
        planes = normalise(resize(image.pixels, height, width), self.pixels)
        patches = cut_patches(planes, self.pixels.patch_size, self.edge)
        grid = (height // self.pixels.patch_size, width // self.pixels.patch_size)
        return PreparedImage(patches, grid, image.digest)


class FixedTilePreparer:
    """IMAGE_PREPARATION_FIXED_TILE (see the module docstring)."""

    accepts_images = True

    def __init__(self, settings: VisionSettings) -> None:
        self.pixels = pixel_settings(settings, "FIXED_TILE")
        self.side = math.isqrt(self.pixels.max_pixels)
        if self.side % self.pixels.patch_size != 0:
            raise StartupError(
                f"image preparation FIXED_TILE: the tile side isqrt(vision.settings.max_pixels) = {self.side} "
                f"is not a multiple of vision.settings.patch_size {self.pixels.patch_size}"
            )
        if self.side * self.side < self.pixels.min_pixels:
            raise StartupError(
                f"image preparation FIXED_TILE: the {self.side}x{self.side} tile is smaller than "
                f"vision.settings.min_pixels {self.pixels.min_pixels}"
            )

    def prepare(self, image: DecodedImage) -> PreparedImage:
        planes = normalise(resize(image.pixels, self.side, self.side), self.pixels)
        patches = cut_patches(planes, self.pixels.patch_size, 1)
        edge = self.side // self.pixels.patch_size
        return PreparedImage(patches, (edge, edge), image.digest)


# -- layouts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanTokens:
    """The token layout data a span layout writes: opener, feature id, closer."""

    open_id: int
    feature_id: int
    close_id: int
    patches_per_feature: int

    @classmethod
    def of(cls, settings: VisionSettings, owner: str) -> SpanTokens:
        """The first atomic span and feature id; ``StartupError`` naming what is missing."""
        vision = settings.vision
        layout = vision.token_layout
        problems = []
        if not layout.atomic_spans:
            problems.append("vision.token_layout declares no atomic span (the image span's open and close ids)")
        if not layout.feature_ids:
            problems.append("vision.token_layout declares no feature id")
        if vision.patches_per_feature <= 0:
            problems.append("vision.patches_per_feature must be positive")
        if problems:
            raise StartupError(f"{owner}: " + "; ".join(problems))
        span = layout.atomic_spans[0]
        return cls(int(span.open_id), int(layout.feature_ids[0]), int(span.close_id), int(vision.patches_per_feature))

    def span(self, features: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Token ids ``[open] + [feature] * features + [close]`` and the feature tokens' offsets."""
        return (
            (self.open_id, *([self.feature_id] * features), self.close_id),
            tuple(range(1, features + 1)),
        )

    def features(self, image: PreparedImage, owner: str) -> int:
        """The image's feature count; ``ImageInputError`` when its patches do not split into features."""
        patch_count = int(image.patches.shape[0])
        rows, cols = image.grid
        if patch_count == 0 or patch_count != rows * cols:
            raise ImageInputError(f"{owner}: the image has {patch_count} patches for a {rows}x{cols} patch grid")
        if patch_count % self.patches_per_feature:
            raise ImageInputError(
                f"{owner}: the image's {patch_count} patches do not split into features of "
                f"{self.patches_per_feature} patches"
            )
        return patch_count // self.patches_per_feature


def placement(
    tokens: SpanTokens, image: PreparedImage, features: int, rows: npt.NDArray[Any], cols: npt.NDArray[Any]
) -> ImagePlacement:
    """The span and the three first-party tensors of ``image`` (patches in the given order)."""
    token_ids, feature_tokens = tokens.span(features)
    tensors = {
        PATCHES: np.ascontiguousarray(image.patches, dtype=np.float32),
        PATCH_ROWS: np.ascontiguousarray(rows, dtype=np.int32),
        PATCH_COLUMNS: np.ascontiguousarray(cols, dtype=np.int32),
    }
    return ImagePlacement(token_ids, feature_tokens, tensors, int(image.patches.shape[0]))


class RasterSpanLayout:
    """IMAGE_LAYOUT_RASTER_SPAN (see the module docstring)."""

    accepts_images = True
    tensor_names = frozenset({PATCHES, PATCH_ROWS, PATCH_COLUMNS})

    def __init__(self, settings: VisionSettings) -> None:
        self.tokens = SpanTokens.of(settings, "image layout RASTER_SPAN")

    def place(self, image: PreparedImage) -> ImagePlacement:
        features = self.tokens.features(image, "image layout RASTER_SPAN")
        cols = image.grid[1]
        index = np.arange(image.patches.shape[0])
        return placement(self.tokens, image, features, index // cols, index % cols)


class MergedGridLayout:
    """IMAGE_LAYOUT_MERGED_GRID (see the module docstring)."""

    accepts_images = True
    tensor_names = frozenset({PATCHES, PATCH_ROWS, PATCH_COLUMNS})

    def __init__(self, settings: VisionSettings) -> None:
        self.tokens = SpanTokens.of(settings, "image layout MERGED_GRID")
        self.edge = merge_edge(self.tokens.patches_per_feature, "image layout MERGED_GRID")

    def place(self, image: PreparedImage) -> ImagePlacement:
        features = self.tokens.features(image, "image layout MERGED_GRID")
        rows, cols = image.grid
        if rows % self.edge or cols % self.edge:
            raise ImageInputError(
                f"image layout MERGED_GRID: a {rows}x{cols} patch grid does not split into "
                f"{self.edge}x{self.edge} merge blocks"
            )
        return placement(self.tokens, image, features, *merge_block_positions(rows, cols, self.edge))


def merge_block_positions(rows: int, cols: int, edge: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Grid row and column of each patch of a ``rows x cols`` grid in merge-block order."""
    block_row, block_col, inner_row, inner_col = np.meshgrid(
        np.arange(rows // edge), np.arange(cols // edge), np.arange(edge), np.arange(edge), indexing="ij"
    )
    patch_rows = (block_row * edge + inner_row).reshape(-1).astype(np.int32)
    patch_cols = (block_col * edge + inner_col).reshape(-1).astype(np.int32)
    return patch_rows, patch_cols


# -- registration --------------------------------------------------------------------------------


def patch_grid(settings: VisionSettings) -> PatchGridPreparer:
    """Factory of IMAGE_PREPARATION_PATCH_GRID."""
    return PatchGridPreparer(settings)


def fixed_tile(settings: VisionSettings) -> FixedTilePreparer:
    """Factory of IMAGE_PREPARATION_FIXED_TILE."""
    return FixedTilePreparer(settings)


def raster_span(settings: VisionSettings) -> RasterSpanLayout:
    """Factory of IMAGE_LAYOUT_RASTER_SPAN."""
    return RasterSpanLayout(settings)


def merged_grid(settings: VisionSettings) -> MergedGridLayout:
    """Factory of IMAGE_LAYOUT_MERGED_GRID."""
    return MergedGridLayout(settings)


def helios_register_image_preparations(register: Register) -> None:
    """Provide IMAGE_PREPARATION_PATCH_GRID and IMAGE_PREPARATION_FIXED_TILE."""
    register(contract.IMAGE_PREPARATION_PATCH_GRID, patch_grid, name="patch-grid")
    register(contract.IMAGE_PREPARATION_FIXED_TILE, fixed_tile, name="fixed-tile")


def helios_register_image_layouts(register: Register) -> None:
    """Provide IMAGE_LAYOUT_RASTER_SPAN and IMAGE_LAYOUT_MERGED_GRID."""
    register(contract.IMAGE_LAYOUT_RASTER_SPAN, raster_span, name="raster-span")
    register(contract.IMAGE_LAYOUT_MERGED_GRID, merged_grid, name="merged-grid")
