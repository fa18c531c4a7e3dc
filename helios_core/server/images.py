"""The server-side image frontend: a prompt's decoded images to its layout spans and vision tensors.

Owns :class:`ImageFrontend`, built once at startup from the core's contract and its selected image
plugins, and used on frontend threads after prompt encoding:

* :meth:`ImageFrontend.of` builds the ``VisionSettings`` and the selected preparation and layout
  (their factories' failures become a ``StartupError`` naming the plugin), reads the largest patch
  capacity (the leading extent of the ``IMAGE_TENSOR`` destinations, else the largest
  ``vision.patch_capacities`` entry) and checks that the layout's ``tensor_names`` cover every
  ``image_output`` an ``IMAGE_TENSOR`` binding names. A small trial image is prepared and placed so that a layout
  that breaks its protocol, or tensor rows that do not fit their destinations, fail at startup
  rather than on every request.
* :meth:`ImageFrontend.expand` prepares and places each image, replaces the prompt's image sentinels
  in order by the placements' tokens and returns the ``PromptImage`` of each (its tensors as
  ``ImageTensor`` bytes). A sentinel count that differs from the image count, an image above
  ``vision.features_per_window`` or the largest patch capacity, and a request above
  ``vision.feature_slots`` raise ``ImageInputError`` (with ``index`` the image at fault, where one
  is); the HTTP layer answers it with a 400.

A placement that breaks the layout protocol (tensor names, leading rows, feature offsets) is a
defect of the plugin, not of the request: it raises :class:`ImagePlacementError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from helios_core.contract.prepared import PreparedContract
from helios_core.errors import StartupError
from helios_core.plugins.host import Provider, SelectedFrontend, kind_label
from helios_core.plugins.images import (
    DecodedImage,
    ImageInputError,
    ImageLayout,
    ImagePlacement,
    ImagePreparer,
    VisionSettings,
    placement_problems,
)
from helios_core.runtime.messages import ImageTensor, PromptImage
from helios_core.wire import contract_pb2 as ct

__all__ = ["ImageFrontend", "ImagePlacementError"]

TRIAL_SIDE = 16
"""Side of the mid-grey square prepared and placed at startup."""


class ImagePlacementError(RuntimeError):
    """An image layout returned a placement that breaks the layout protocol (a plugin defect)."""


@dataclass(frozen=True)
class _TensorDestination:
    """One IMAGE_TENSOR binding: the graph, its destination and the destination's shape."""

    graph: str
    destination: str
    image_output: str
    shape: tuple[int, ...]


def _tensor_destinations(contract: PreparedContract) -> list[_TensorDestination]:
    found = []
    for name, graph in sorted(contract.graphs.items()):
        for binding in graph.contract.bindings:
            if binding.source != ct.VALUE_SOURCE_IMAGE_TENSOR:
                continue
            entry = contract.transport.get(binding.destination)
            shape = tuple(int(size) for size in entry.shape) if entry is not None else ()
            found.append(_TensorDestination(name, binding.destination, binding.image_output, shape))
    return found


def _build(provider: Provider, settings: VisionSettings) -> Any:
    """The provider's factory applied to ``settings``; any failure is a ``StartupError`` naming it."""
    try:
        return provider.factory(settings)
    except StartupError as exc:
        raise StartupError(
            f"{kind_label(provider.kind)} {provider.identifier} ({provider.name} from {provider.plugin!r}): {exc}"
        ) from exc
    except Exception as exc:
        raise StartupError(
            f"{kind_label(provider.kind)} {provider.identifier} ({provider.name} from {provider.plugin!r}) rejects "
            f"the core's vision data: {type(exc).__name__}: {exc}"
        ) from exc


class ImageFrontend:
    """A core's image preparation and layout with its capacities (see the module docstring)."""

    def __init__(
        self,
        settings: VisionSettings,
        preparer: ImagePreparer | None,
        layout: ImageLayout | None,
        *,
        patch_capacity: int | None,
    ) -> None:
        self.settings = settings
        self.preparer = preparer
        self.layout = layout
        self.accepts_images: bool = preparer is not None and layout is not None
        self.sentinel_ids: frozenset[int] = frozenset(settings.sentinel_ids)
        self.features_per_window = int(settings.vision.features_per_window)
        self.feature_slots = int(settings.vision.feature_slots)
        self.patch_capacity = patch_capacity
        """The largest patch capacity of the core's graphs (None: the core declares none)."""

    @classmethod
    def of(cls, contract: PreparedContract, selected: SelectedFrontend) -> ImageFrontend:
        """Build the selected image plugins over the core's vision data; ``StartupError`` on unusable data."""
        model = contract.model
        sentinels = tuple(int(sentinel) for sentinel in model.input_vocabulary.image_sentinel_ids)
        try:
            settings = VisionSettings.of(selected.frontend, model.vision, sentinels)
        except ValueError as exc:
            raise StartupError(f"frontend.plugin_parameters_json: {exc}") from exc
        preparer = _build(selected.image_preparation, settings)
        layout = _build(selected.image_layout, settings)
        accepts = [bool(getattr(built, "accepts_images", True)) for built in (preparer, layout)]
        if not any(accepts):
            return cls(settings, None, None, patch_capacity=None)
        if not all(accepts):
            text_only = selected.image_preparation if not accepts[0] else selected.image_layout
            raise StartupError(
                f"{kind_label(text_only.kind)} {text_only.identifier} ({text_only.name}) takes no images but the "
                "core's other image selection does: select NONE for both or neither"
            )
        if not sentinels:
            raise StartupError("the core selects image plugins but input_vocabulary declares no image sentinel id")
        for built, provider, method in (
            (preparer, selected.image_preparation, "prepare"),
            (layout, selected.image_layout, "place"),
        ):
            if not callable(getattr(built, method, None)):
                raise StartupError(
                    f"{kind_label(provider.kind)} {provider.identifier} ({provider.name}) built {built!r}, which has "
                    f"no {method}() method"
                )
        destinations = _tensor_destinations(contract)
        names = frozenset(getattr(layout, "tensor_names", frozenset()))
        uncovered = sorted({d.image_output for d in destinations} - names)
        if uncovered:
            provider = selected.image_layout
            raise StartupError(
                f"the core's IMAGE_TENSOR bindings name image outputs {uncovered} that image layout "
                f"{provider.identifier} ({provider.name}) does not produce (it produces {sorted(names)})"
            )
        capacities = [d.shape[0] for d in destinations if d.shape]
        if not capacities:
            capacities = [int(capacity) for capacity in model.vision.patch_capacities]
        frontend = cls(settings, preparer, layout, patch_capacity=max(capacities) if capacities else None)
        frontend._trial(destinations)
        return frontend

    def _trial(self, destinations: Sequence[_TensorDestination]) -> None:
        """Prepare and place a small mid-grey square: a placement that breaks the layout protocol, a
        plugin that fails with anything but ``ImageInputError``, or tensor rows that do not fit the
        destinations' trailing shapes are a ``StartupError``. A trial image the plugins or capacities
        refuse (``ImageInputError``) proves nothing about other images and is not an error."""
        trial = DecodedImage.of(np.full((TRIAL_SIDE, TRIAL_SIDE, 3), 128, dtype=np.uint8))
        try:
            _, (image,) = self.expand(sorted(self.sentinel_ids)[:1], [trial])
        except ImageInputError:
            return
        except Exception as exc:
            raise StartupError(
                f"the core's image plugins fail on a {TRIAL_SIDE}x{TRIAL_SIDE} image: {type(exc).__name__}: {exc}"
            ) from exc
        shapes = {tensor.name: tuple(tensor.shape[1:]) for tensor in image.tensors}
        for destination in destinations:
            trailing = destination.shape[1:]
            produced = shapes.get(destination.image_output)
            if produced is not None and produced != trailing:
                raise StartupError(
                    f"graph {destination.graph!r} binds image output {destination.image_output!r} to "
                    f"{destination.destination!r} with rows of shape {list(trailing)}, but the image layout "
                    f"writes rows of shape {list(produced)}"
                )

    def expand(self, prompt_ids: Sequence[int], images: Sequence[DecodedImage]) -> tuple[list[int], list[PromptImage]]:
        """The prompt with each image sentinel replaced by its image's span, and the spans in prompt
        order; ``ImageInputError`` (see the module docstring)."""
        sentinels = [at for at, token in enumerate(prompt_ids) if token in self.sentinel_ids]
        if not images and not sentinels:
            return list(prompt_ids), []
        if not self.accepts_images:
            raise ImageInputError("this model does not accept image inputs")
        if len(sentinels) != len(images):
            raise ImageInputError(
                f"the rendered prompt has {len(sentinels)} image placeholders but the request carries "
                f"{len(images)} images"
            )
        placements = [self._place(index, image) for index, image in enumerate(images)]
        total = sum(p.feature_count for p in placements)
        if total > self.feature_slots:
            raise ImageInputError(
                f"the request's images need {total} image features, more than the model's {self.feature_slots}"
            )
        expanded: list[int] = []
        prompt_images: list[PromptImage] = []
        previous = 0
        for at, image, placed in zip(sentinels, images, placements, strict=True):
            expanded.extend(prompt_ids[previous:at])
            start = len(expanded)
            expanded.extend(placed.token_ids)
            tensors = [ImageTensor.of(name, np.asarray(placed.tensors[name])) for name in sorted(placed.tensors)]
            prompt_images.append(
                PromptImage(
                    start, len(placed.token_ids), list(placed.feature_tokens), placed.patch_count, image.digest, tensors
                )
            )
            previous = at + 1
        expanded.extend(prompt_ids[previous:])
        return expanded, prompt_images

    def _place(self, index: int, image: DecodedImage) -> ImagePlacement:
        """One image prepared, placed and checked against the per-image capacities."""
        if self.preparer is None or self.layout is None:
            raise ImageInputError("this model does not accept image inputs", index=index)
        try:
            placed = self.layout.place(self.preparer.prepare(image))
        except ImageInputError as exc:
            if exc.index is None:
                exc.index = index
            raise
        problems = placement_problems(placed, self.layout.tensor_names)
        if problems:
            raise ImagePlacementError(
                f"the image layout's placement of image {index} is invalid: " + "; ".join(problems)
            )
        if placed.feature_count > self.features_per_window:
            raise ImageInputError(
                f"image {index} needs {placed.feature_count} image features, more than the model's "
                f"{self.features_per_window} per image",
                index=index,
            )
        if self.patch_capacity is not None and placed.patch_count > self.patch_capacity:
            raise ImageInputError(
                f"image {index} has {placed.patch_count} patches, more than the model's largest capacity of "
                f"{self.patch_capacity}",
                index=index,
            )
        return placed
