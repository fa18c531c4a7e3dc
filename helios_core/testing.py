"""Test harness for frontend plugin authors (and Helios's own frontend tests).

Owns ``FrontendHarness``: given a ``tokenizers.Tokenizer``, a ``FrontendContract`` (selections and
syntax data), the request's tools and the prompt's open envelope, it resolves the selected
implementations through a real ``PluginHost`` and runs the real ``OutputPipeline`` over text
chunks or token ids, doing the host's incremental detokenization. It returns the streamed deltas,
the final ``ParsedOutput`` and the finish reason, and checks that streaming at every split point
gives the unstreamed result. ``byte_level_tokenizer`` builds a small tokenizer whose added tokens
are single tokens, so token-versus-text delimiter rules can be tested for real.

Example::

    harness = FrontendHarness(tokenizer, frontend, tools=[ToolSpec("f", schema)], plugins=[my_plugin])
    result = harness.run_text(["<tool_call>", "..."])
    harness.check_split_invariance("<tool_call>...</tool_call>")

Owns ``ImageHarness`` too, for image preparation and image layout plugins: given a
``FrontendContract`` (``image_frontend`` writes one that selects only images) and a
``VisionContract``, it builds the selected preparation and layout through a real ``PluginHost``
from the same ``VisionSettings`` the server builds, runs pixels -> ``PreparedImage`` ->
``ImagePlacement`` and checks the placement as the server does (``PlacementMismatch``)::

    harness = ImageHarness(image_frontend(100001, contract.IMAGE_LAYOUT_RASTER_SPAN), vision, plugins=[my_plugin])
    run = harness.run(pixels)            # [height, width, 3] uint8
    run.prepared.patches, run.placement.token_ids, run.placement.tensors["patches"]
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from helios_core.plugin_api import (
    CLOSED_ENVELOPE,
    DecodedImage,
    EnvelopeState,
    GeneratedPiece,
    ImageLayout,
    ImagePlacement,
    ImagePreparer,
    OutputDelta,
    ParsedOutput,
    PreparedImage,
    TokenizerVocabulary,
    ToolSpec,
    VisionSettings,
    contract,
)
from helios_core.plugins.host import PluginHost, SelectedFrontend
from helios_core.plugins.images import placement_problems


class StreamMismatch(AssertionError):
    """Streaming changed the result, or the deltas do not add up to it."""


@dataclass(frozen=True)
class HarnessResult:
    """One run: every streamed delta (``finish`` deltas last), the final parse and finish reason."""

    deltas: list[OutputDelta]
    output: ParsedOutput
    finish_reason: str


def byte_level_tokenizer(special_tokens: Sequence[str] = ()) -> Any:
    """A byte-level BPE tokenizer without merges: every byte is one token, and each of
    ``special_tokens`` is one added token (so it encodes as one token wherever it is spelled)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if special_tokens:
        tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer


class FrontendHarness:
    """Runs the real output pipeline of ``frontend`` (see the module docstring).

    ``plugins``: objects registered in-process on the harness's plugin host (for a plugin under
    test that is not installed). ``host``: a prepared host instead (it must not be started).
    Entry-point autoload of third-party plugins is off unless ``autoload=True``."""

    def __init__(
        self,
        tokenizer: Any,
        frontend: contract.FrontendContract,
        *,
        tools: Sequence[ToolSpec] = (),
        envelope: EnvelopeState = CLOSED_ENVELOPE,
        structured_answer: bool = False,
        plugins: Sequence[object] = (),
        host: PluginHost | None = None,
        autoload: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocabulary = TokenizerVocabulary(tokenizer)
        self.tools = tuple(tools)
        self.envelope = envelope
        self.structured_answer = structured_answer
        self.host = host or PluginHost(autoload=autoload)
        for plugin in plugins:
            self.host.plugin_manager.register(plugin)
        self.selected: SelectedFrontend = self.host.resolve(frontend, self.vocabulary)

    # -- tokens -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (added tokens are single tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def pieces(self, ids: Sequence[int]) -> list[GeneratedPiece]:
        """Incremental detokenization as the host does it: a piece's text is ``""`` while the
        decoded text ends in an incomplete UTF-8 sequence."""
        pieces = []
        emitted = ""
        for end in range(1, len(ids) + 1):
            decoded = self.tokenizer.decode(list(ids[:end]), skip_special_tokens=False)
            if decoded.endswith("\ufffd") or not decoded.startswith(emitted):
                pieces.append(GeneratedPiece(ids[end - 1], ""))
                continue
            pieces.append(GeneratedPiece(ids[end - 1], decoded[len(emitted) :]))
            emitted = decoded
        return pieces

    # -- runs ---------------------------------------------------------------------------------

    def run_pieces(self, chunks: Sequence[Sequence[GeneratedPiece]]) -> HarnessResult:
        """Feed each chunk as one scheduling round, then finish."""
        pipeline = self.selected.pipeline(
            self.vocabulary, tools=self.tools, envelope=self.envelope, structured_answer=self.structured_answer
        )
        deltas: list[OutputDelta] = []
        for chunk in chunks:
            deltas.extend(pipeline.feed(chunk))
        result = pipeline.finish()
        deltas.extend(result.deltas)
        return HarnessResult(deltas, result.output, result.finish_hint)

    def run_tokens(self, chunks: Sequence[Sequence[int]]) -> HarnessResult:
        """Feed token-id chunks (detokenized incrementally across chunks)."""
        ids = [token for chunk in chunks for token in chunk]
        pieces = self.pieces(ids)
        split: list[Sequence[GeneratedPiece]] = []
        at = 0
        for chunk in chunks:
            split.append(pieces[at : at + len(chunk)])
            at += len(chunk)
        return self.run_pieces(split)

    def run_text(self, chunks: Sequence[str] | str) -> HarnessResult:
        """Feed text chunks, each tokenized on its own (an added token's spelling split across two
        chunks is therefore plain text)."""
        texts = [chunks] if isinstance(chunks, str) else list(chunks)
        return self.run_tokens([self.encode(text) for text in texts])

    # -- checks -------------------------------------------------------------------------------

    def check_split_invariance(self, text: str) -> HarnessResult:
        """Check that feeding ``text``'s tokens in two chunks split at every token boundary, and one
        token per chunk, gives the unstreamed result, and that every run's deltas add up to its
        result. Returns the unstreamed result; raises ``StreamMismatch``."""
        pieces = self.pieces(self.encode(text))
        whole = self.run_pieces([pieces])
        check_deltas(whole)
        runs = [[pieces[:at], pieces[at:]] for at in range(1, len(pieces))]
        runs.append([[piece] for piece in pieces])
        for chunks in runs:
            streamed = self.run_pieces(chunks)
            check_deltas(streamed)
            if comparable(streamed) != comparable(whole):
                where = f"split after token {len(chunks[0])}" if len(chunks) == 2 else "one token per chunk"
                raise StreamMismatch(f"{where}: {comparable(streamed)} != {comparable(whole)}")
        return whole


def comparable(result: HarnessResult) -> tuple[Any, ...]:
    """The result with call ids removed (they are random)."""
    output = result.output
    calls = tuple((call.name, call.arguments) for call in output.tool_calls)
    return output.reasoning, output.content, calls, result.finish_reason


def check_deltas(result: HarnessResult) -> None:
    """The deltas add up to the result: reasoning and content concatenate, each call's id and name
    come once in its first delta, and its argument fragments concatenate to valid JSON."""
    reasoning = "".join(d.reasoning or "" for d in result.deltas) or None
    content = "".join(d.content or "" for d in result.deltas) or None
    if (reasoning, content) != (result.output.reasoning, result.output.content):
        raise StreamMismatch(f"deltas give {(reasoning, content)!r}, the result says {result.output!r}")
    calls: dict[int, list[str]] = {}
    for delta in result.deltas:
        for piece in delta.tool_calls:
            first = piece.index not in calls
            if first != (piece.id is not None and piece.name is not None):
                raise StreamMismatch(f"call {piece.index}: id and name must come exactly once, first")
            if first and not re.fullmatch(r"call_[0-9a-f]{24}", piece.id or ""):
                raise StreamMismatch(f"call id {piece.id!r} is not call_ + 24 hex digits")
            calls.setdefault(piece.index, []).append(piece.arguments)
    if len(calls) != len(result.output.tool_calls):
        raise StreamMismatch("the deltas and the result disagree on the number of calls")
    for index, call in enumerate(result.output.tool_calls):
        arguments = "".join(calls.get(index, []))
        if arguments != call.arguments:
            raise StreamMismatch(f"call {index}: fragments give {arguments!r}, the result says {call.arguments!r}")
        try:
            parsed = json.loads(arguments)
        except ValueError as exc:
            raise StreamMismatch(f"call {index}: arguments are not JSON: {arguments!r}") from exc
        if not isinstance(parsed, dict):
            raise StreamMismatch(f"call {index}: arguments are not a JSON object: {arguments!r}")


# -- image plugins ---------------------------------------------------------------------------------


class PlacementMismatch(AssertionError):
    """An image preparation or layout broke its protocol (patch rows, feature offsets, tensors)."""


def image_frontend(
    image_preparation: int, image_layout: int, *, plugin_parameters_json: str = ""
) -> contract.FrontendContract:
    """A ``FrontendContract`` selecting the two image implementations and no tool or reasoning syntax."""
    return contract.FrontendContract(
        tool_parser=contract.TOOL_PARSER_NONE,
        reasoning_parser=contract.REASONING_PARSER_NONE,
        image_preparation=cast(contract.ImagePreparation, image_preparation),
        image_layout=cast(contract.ImageLayout, image_layout),
        plugin_parameters_json=plugin_parameters_json,
    )


@dataclass(frozen=True)
class ImageRun:
    """One image through the selected plugins: the decoded image, its patches and its placement."""

    image: DecodedImage
    prepared: PreparedImage
    placement: ImagePlacement


class ImageHarness:
    """Builds and runs the image preparation and layout ``frontend`` selects (see the module docstring).

    ``sentinel_ids``: the input vocabulary's image sentinel ids the settings carry. ``plugins`` and
    ``host`` as for ``FrontendHarness``; building the two factories raises what they raise (a
    ``StartupError`` for unusable settings)."""

    def __init__(
        self,
        frontend: contract.FrontendContract,
        vision: contract.VisionContract,
        *,
        sentinel_ids: Sequence[int] = (),
        plugins: Sequence[object] = (),
        host: PluginHost | None = None,
        autoload: bool = False,
    ) -> None:
        self.host = host or PluginHost(autoload=autoload)
        for plugin in plugins:
            self.host.plugin_manager.register(plugin)
        self.selected: SelectedFrontend = self.host.resolve(frontend)
        self.settings = VisionSettings.of(frontend, vision, tuple(sentinel_ids))
        self.preparer: ImagePreparer = self.selected.image_preparation.factory(self.settings)
        self.layout: ImageLayout = self.selected.image_layout.factory(self.settings)

    def prepare(self, pixels: npt.NDArray[np.uint8] | DecodedImage) -> PreparedImage:
        """The preparation's patches of ``pixels``, checked: a 2-D patch array and the image's digest."""
        image = pixels if isinstance(pixels, DecodedImage) else DecodedImage.of(pixels)
        prepared = self.preparer.prepare(image)
        if np.ndim(prepared.patches) != 2:
            raise PlacementMismatch(f"patches must be [patch count, patch width], not {np.shape(prepared.patches)}")
        if prepared.digest != image.digest:
            raise PlacementMismatch("the prepared image does not carry the decoded image's digest")
        return prepared

    def place(self, prepared: PreparedImage) -> ImagePlacement:
        """The layout's placement of ``prepared``, checked as the server checks it: tokens present,
        feature offsets distinct and inside ``token_ids``, exactly the layout's ``tensor_names``,
        each with ``patch_count`` leading rows."""
        placement = self.layout.place(prepared)
        problems = placement_problems(placement, self.layout.tensor_names)
        if problems:
            raise PlacementMismatch("; ".join(problems))
        return placement

    def run(self, pixels: npt.NDArray[np.uint8] | DecodedImage) -> ImageRun:
        """Pixels (``[height, width, 3]`` uint8, or a decoded image) through both plugins."""
        image = pixels if isinstance(pixels, DecodedImage) else DecodedImage.of(pixels)
        prepared = self.prepare(image)
        return ImageRun(image, prepared, self.place(prepared))
