"""Passthrough implementations: TOOL_PARSER_NONE, REASONING_PARSER_NONE and the text-only image
selections (IMAGE_PREPARATION_NONE, IMAGE_LAYOUT_NONE).

Owns the parsers for cores without a tool or reasoning syntax: every generated piece's text is
answer content, and no tool call is ever parsed (the request layer refuses ``tools`` for such a
core). The image selections register a marker object saying the core is text-only.
"""

from __future__ import annotations

from helios_core.plugin_api import GeneratedPiece, OutputDelta, ParserContext, Register, contract

HELIOS_PLUGIN_API = (1, 0)


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
    """The image selection of a text-only core: image inputs are refused."""

    accepts_images = False


def no_reasoning(context: ParserContext) -> NoReasoning:
    """Factory of REASONING_PARSER_NONE."""
    return NoReasoning()


def no_tools(context: ParserContext) -> NoTools:
    """Factory of TOOL_PARSER_NONE."""
    return NoTools()


def text_only(frontend: contract.FrontendContract) -> TextOnly:
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
