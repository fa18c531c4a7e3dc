"""Image inputs as plugins see them: the values between decoding, preparation and layout.

Owns the typed boundary of the two image plugin kinds (re-exported by :mod:`helios_core.plugin_api`):

* :class:`VisionSettings` is what both factories are built from: the core's frontend selection, its
  vision contract (capacities, token layout data, pixel settings), the nonsampled image sentinel ids
  of the input vocabulary and the parsed ``plugin_parameters_json``.
* :class:`DecodedImage` is a request's image after decoding: RGB pixels and a content digest.
* An image preparation (``ImagePreparer``) turns it into a :class:`PreparedImage`: normalised patches
  in the order the layout consumes them and the patch grid.
* An image layout (``ImageLayout``) turns that into an :class:`ImagePlacement`: the token span that
  replaces the image's sentinel in the prompt, which of those tokens receive image features (in
  feature order) and the named vision tensors the core's programs bind (``IMAGE_TENSOR`` sources,
  one leading row per patch of this image).

Both raise :class:`ImageInputError` for an image they cannot use; the server answers it with a 400
naming the content part. Nothing here touches the runtime: the runtime reads placements through its
own message types.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from helios_core.plugins import frontend_contract as contract

__all__ = [
    "PATCHES",
    "PATCH_COLUMNS",
    "PATCH_ROWS",
    "DecodedImage",
    "ImageInputError",
    "ImageLayout",
    "ImageLayoutFactory",
    "ImagePlacement",
    "ImagePreparationFactory",
    "ImagePreparer",
    "PreparedImage",
    "VisionSettings",
    "placement_problems",
]

PATCHES = "patches"
"""The first-party layouts' patch tensor: float32 ``[patches, channels * patch_size * patch_size]``,
each row one patch's normalised pixels (channel-major, then row, then column)."""
PATCH_ROWS = "patch_rows"
"""The first-party layouts' patch-row tensor: int32 ``[patches]``, each patch's row in its image's grid."""
PATCH_COLUMNS = "patch_cols"
"""The first-party layouts' patch-column tensor: int32 ``[patches]``, each patch's column in the grid."""


class ImageInputError(ValueError):
    """An image a request carries cannot be used (undecodable, too large, too many features, ...);
    the message says why, for the client. ``index`` is the image's position among the request's images
    (0-based, prompt order) where one image is at fault, else None."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class VisionSettings:
    """What an image preparation and an image layout are built from."""

    frontend: contract.FrontendContract
    vision: contract.VisionContract
    sentinel_ids: tuple[int, ...]
    """The input vocabulary's nonsampled image sentinel ids (where a chat template marks an image)."""
    parameters: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """``frontend.plugin_parameters_json`` parsed (empty when the core gives none)."""

    @classmethod
    def of(
        cls, frontend: contract.FrontendContract, vision: contract.VisionContract, sentinel_ids: tuple[int, ...]
    ) -> VisionSettings:
        """Settings with ``parameters`` parsed from the frontend's JSON (ValueError when it is not an object)."""
        text = frontend.plugin_parameters_json
        parameters = json.loads(text) if text else {}
        if not isinstance(parameters, dict):
            raise ValueError("plugin_parameters_json must be a JSON object")
        return cls(frontend, vision, tuple(sentinel_ids), MappingProxyType(parameters))


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """One decoded image of a request."""

    pixels: npt.NDArray[np.uint8]
    """``[height, width, 3]`` RGB."""
    digest: bytes
    """SHA-256 over the pixel shape and bytes: the image's identity for prefix reuse."""

    @classmethod
    def of(cls, pixels: npt.NDArray[np.uint8]) -> DecodedImage:
        """An image of ``pixels`` (``[height, width, 3]`` uint8) with its digest computed."""
        import hashlib

        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ImageInputError(f"pixels must be uint8 [height, width, 3], not {pixels.dtype} {pixels.shape}")
        contiguous = np.ascontiguousarray(pixels)
        digest = hashlib.sha256(repr(contiguous.shape).encode() + contiguous.tobytes()).digest()
        return cls(contiguous, digest)

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """An image after preparation: patches in the order its layout consumes them."""

    patches: npt.NDArray[np.float32]
    """``[patch count, patch width]`` normalised pixels."""
    grid: tuple[int, int]
    """Patch rows and columns of the resized image."""
    digest: bytes
    """The decoded image's digest."""


class ImagePreparer(Protocol):
    """Pixels to patches (an ``ImagePreparation`` implementation)."""

    def prepare(self, image: DecodedImage) -> PreparedImage:
        """The image's patches; raises :class:`ImageInputError` for an image it cannot use."""
        ...


@dataclass(frozen=True, eq=False)
class ImagePlacement:
    """Where one image goes in the prompt and what the programs receive for it."""

    token_ids: tuple[int, ...]
    """The tokens that replace the image's sentinel: one atomic span (never split by prefill chunks or
    prefix-reuse boundaries)."""
    feature_tokens: tuple[int, ...]
    """Offsets into ``token_ids`` of the tokens that receive image features, in feature order."""
    tensors: Mapping[str, npt.NDArray[Any]]
    """Named vision tensors (``IMAGE_TENSOR`` outputs); each has one leading row per patch."""
    patch_count: int
    """Leading rows of every tensor (patches of this image)."""

    @property
    def feature_count(self) -> int:
        return len(self.feature_tokens)


class ImageLayout(Protocol):
    """Prepared patches to a token span and vision tensors (an ``ImageLayout`` implementation)."""

    tensor_names: frozenset[str]
    """The tensor names every placement carries (checked against the core's ``IMAGE_TENSOR`` bindings
    at startup)."""

    def place(self, image: PreparedImage) -> ImagePlacement:
        """The image's placement; raises :class:`ImageInputError` for an image it cannot lay out."""
        ...


ImagePreparationFactory = Callable[[VisionSettings], ImagePreparer]
"""Builds a core's image preparation; raises ``StartupError`` on unusable settings."""

ImageLayoutFactory = Callable[[VisionSettings], ImageLayout]
"""Builds a core's image layout; raises ``StartupError`` on unusable layout data."""


def placement_problems(placement: ImagePlacement, tensor_names: frozenset[str] | set[str] | None = None) -> list[str]:
    """What is wrong with ``placement`` (empty when nothing): tokens present, feature offsets distinct
    and inside ``token_ids``, every tensor with ``patch_count`` leading rows, and (given
    ``tensor_names``) exactly those tensors."""
    problems: list[str] = []
    span = len(placement.token_ids)
    if span == 0:
        problems.append("token_ids is empty")
    outside = [offset for offset in placement.feature_tokens if not 0 <= offset < span]
    if outside:
        problems.append(f"feature_tokens {outside} lie outside token_ids (length {span})")
    if len(set(placement.feature_tokens)) != len(placement.feature_tokens):
        problems.append("feature_tokens repeats an offset")
    if placement.patch_count < 0:
        problems.append(f"patch_count {placement.patch_count} is negative")
    for name, tensor in sorted(placement.tensors.items()):
        shape = np.shape(tensor)
        if not shape or shape[0] != placement.patch_count:
            problems.append(f"tensor {name!r} has shape {tuple(shape)}, not {placement.patch_count} leading rows")
    if tensor_names is not None and set(placement.tensors) != set(tensor_names):
        problems.append(
            f"tensors {sorted(placement.tensors)} differ from the layout's tensor_names {sorted(tensor_names)}"
        )
    return problems
