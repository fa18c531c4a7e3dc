"""Passthrough implementations: TOOL_PARSER_NONE, REASONING_PARSER_NONE and the text-only image
selections (IMAGE_PREPARATION_NONE, IMAGE_LAYOUT_NONE).

Owns the parsers for cores without a tool or reasoning syntax: every generated piece's text is
answer content, and no tool call is ever parsed (the request layer refuses ``tools`` for such a
core). The image selections build, from the core's ``VisionSettings``, an object whose
``accepts_images`` is False: the server refuses image inputs for such a core.
"""

from __future__ import annotations

from helios_core.plugin_api import GeneratedPiece, OutputDelta, ParserContext, Register, VisionSettings, contract

HELIOS_PLUGIN_API = (1, 1)


class NoReasoning:
    """Every piece's text is content."""

    def feed(self, piece: GeneratedPiece) -> list[OutputDelta]:
        return [OutputDelta(content=piece.text)] if piece.text else []

    def finish(self) -> list[OutputDelta]:
        return []


class NoTools:
    """Content passes through unchanged."""

    def feed(self, text: str) -> list[OutputDelta]:
        return [OutputDelta(content=text)] if text else []

    def finish(self) -> list[OutputDelta]:
        return []


class TextOnly:
    """The image preparation and layout of a text-only core: image inputs are refused (it neither
    prepares nor places an image, and provides no tensors)."""

    accepts_images = False
    tensor_names: frozenset[str] = frozenset()


def no_reasoning(context: ParserContext) -> NoReasoning:
    """Factory of REASONING_PARSER_NONE."""
    return NoReasoning()


def no_tools(context: ParserContext) -> NoTools:
    """Factory of TOOL_PARSER_NONE."""
    return NoTools()


def text_only(settings: VisionSettings) -> TextOnly:
    """Factory of IMAGE_PREPARATION_NONE and IMAGE_LAYOUT_NONE."""
    return TextOnly()


def helios_register_tool_parsers(register: Register) -> None:
    """Provide TOOL_PARSER_NONE."""
    register(contract.TOOL_PARSER_NONE, no_tools, name="none")


def helios_register_reasoning_parsers(register: Register) -> None:
    """Provide REASONING_PARSER_NONE."""
    register(contract.REASONING_PARSER_NONE, no_reasoning, name="none")


def helios_register_image_preparations(register: Register) -> None:
    """Provide IMAGE_PREPARATION_NONE."""
    register(contract.IMAGE_PREPARATION_NONE, text_only, name="none")


def helios_register_image_layouts(register: Register) -> None:
    """Provide IMAGE_LAYOUT_NONE."""
    register(contract.IMAGE_LAYOUT_NONE, text_only, name="none")
