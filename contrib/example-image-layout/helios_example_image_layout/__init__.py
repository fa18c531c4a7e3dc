"""Example Helios plugin: a column-major image layout under third-party identifier 100001.

The layout reads patches in raster order (``IMAGE_PREPARATION_FIXED_TILE``'s) and lays the image out
column by column: patch ``(row, column)`` of an ``R x C`` grid becomes the ``column * R + row``-th
patch, the ``patches`` rows are reordered the same way, and each run of ``patches_per_feature``
patches in that order is one feature. It writes the tensors the first-party ``RASTER_SPAN`` layout
writes (``patches``, ``patch_rows``, ``patch_cols``, the two position tensors holding each patch's
true grid row and column) and the same token span (``[open] + [feature] * F + [close]`` from the first
atomic span and feature id), so a core built for ``RASTER_SPAN`` can select it with
``frontend.image_layout = 100001``. The module imports only ``helios_core.plugin_api`` and numpy.
"""

from __future__ import annotations

import numpy as np

from helios_core.plugin_api import (
    PATCH_COLUMNS,
    PATCH_ROWS,
    PATCHES,
    ImageInputError,
    ImagePlacement,
    PreparedImage,
    Register,
    StartupError,
    VisionSettings,
)

HELIOS_PLUGIN_API = (1, 1)
IDENTIFIER = 100001


class ColumnSpanLayout:
    """Features in column-major order over a raster-ordered patch grid."""

    tensor_names = frozenset({PATCHES, PATCH_ROWS, PATCH_COLUMNS})

    def __init__(self, settings: VisionSettings) -> None:
        vision = settings.vision
        layout = vision.token_layout
        if not layout.atomic_spans or not layout.feature_ids:
            raise StartupError("column-span layout: vision.token_layout needs an atomic span and a feature id")
        if vision.patches_per_feature <= 0:
            raise StartupError("column-span layout: vision.patches_per_feature must be positive")
        span = layout.atomic_spans[0]
        self.open_id, self.close_id = int(span.open_id), int(span.close_id)
        self.feature_id = int(layout.feature_ids[0])
        self.patches_per_feature = int(vision.patches_per_feature)

    def place(self, image: PreparedImage) -> ImagePlacement:
        rows, cols = image.grid
        count = int(image.patches.shape[0])
        if count != rows * cols:
            raise ImageInputError(f"column-span layout: {count} patches for a {rows}x{cols} grid")
        if count == 0 or count % self.patches_per_feature:
            raise ImageInputError(
                f"column-span layout: {count} patches do not split into features of {self.patches_per_feature}"
            )
        # Column-major order: all rows of column 0, then column 1, ...; raster index = row * cols + col.
        patch_cols, patch_rows = np.divmod(np.arange(count), rows)
        order = patch_rows * cols + patch_cols
        features = count // self.patches_per_feature
        return ImagePlacement(
            token_ids=(self.open_id, *([self.feature_id] * features), self.close_id),
            feature_tokens=tuple(range(1, features + 1)),
            tensors={
                PATCHES: np.ascontiguousarray(image.patches[order], dtype=np.float32),
                PATCH_ROWS: patch_rows.astype(np.int32),
                PATCH_COLUMNS: patch_cols.astype(np.int32),
            },
            patch_count=count,
        )


def column_span(settings: VisionSettings) -> ColumnSpanLayout:
    """Factory of image layout 100001."""
    return ColumnSpanLayout(settings)


def helios_register_image_layouts(register: Register) -> None:
    """Provide image layout 100001."""
    register(IDENTIFIER, column_span, name="column-span")
