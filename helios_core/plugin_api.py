"""The plugin API: the one module a Helios plugin imports, and its version.

Owns the stable surface between the serving core and frontend plugins (tool parsers, reasoning
parsers, constrained tool-call grammars, reasoning envelopes, image preparations, image layouts).
Every name here is re-exported from the implementation modules under :mod:`helios_core.plugins`
(``types``, ``images``, ``sections``, ``pipeline``, ``grammar``, ``tag_grammar``, ``frontend_contract``);
plugins never import those directly.

* Values crossing the boundary: ``GeneratedPiece`` in, ``OutputDelta`` / ``ToolCallDelta`` out,
  ``ParsedOutput`` / ``ToolCall`` at the end, ``ToolSpec`` for the request's tools,
  ``EnvelopeState`` for the prompt's open assistant envelope and ``ParserContext`` bundling them.
* The parser protocols (``ReasoningParser``, ``ToolParser``) and the factory types a plugin
  registers; ``Register`` is the callback every registration hook receives.
* Grammar hooks: ``ToolGrammarFactory`` (``ToolGrammarRequest -> GrammarFragment | None``) and
  ``ReasoningEnvelopeFactory`` (``FrontendContract -> ReasoningEnvelope``), with ``GrammarWriter``
  and the tag-grammar building blocks (``tag_call_rules``, ``value_rule``, ``tag_parameters``).
* Parser building blocks: ``partial_suffix_length``, ``coerce_text``, ``ToolCallWriter``,
  ``SectionToolParser``, ``scan_tagged_section`` and friends.
* Image plugins (since 1.1): ``VisionSettings`` (what both image factories are built from),
  ``DecodedImage`` in, ``PreparedImage`` between the two, ``ImagePlacement`` out, the protocols
  ``ImagePreparer`` and ``ImageLayout``, ``ImagePreparationFactory`` / ``ImageLayoutFactory``
  (``VisionSettings -> ImagePreparer / ImageLayout``), ``ImageInputError``, the first-party
  tensor names ``PATCHES``, ``PATCH_ROWS``, ``PATCH_COLUMNS`` and ``placement_problems`` (the checks
  the server applies to every placement).
* ``contract``: the frontend part of the contract (``FrontendContract``, its syntax messages and
  the selection enums with their values).
* ``OutputPipeline``: how the core composes one request's parsers (for tests and harnesses).

Versioning: ``PLUGIN_API_VERSION`` is ``(major, minor)``. A minor release only adds names or
hooks; a major release may remove or change one. A plugin module may declare the version it was
written against as ``HELIOS_PLUGIN_API = (major, minor)``; the host refuses it at startup (isolated,
with an error naming both versions) when the major differs or the minor is newer than this one.
Changes here are API changes: add, never rename or remove, without a major release.
"""

from __future__ import annotations

from helios_core.errors import StartupError
from helios_core.plugins import frontend_contract as contract
from helios_core.plugins.grammar import (
    ANSWER_RULE,
    COMPACT_JSON,
    AnswerFrames,
    DelimitedEnvelope,
    DelimitedReasoning,
    GrammarFragment,
    GrammarUnsupported,
    GrammarWriter,
    ReasoningEnvelope,
    ReasoningEnvelopeFactory,
    ToolChoice,
    ToolGrammarError,
    ToolGrammarFactory,
    ToolGrammarRequest,
)
from helios_core.plugins.images import (
    PATCH_COLUMNS,
    PATCH_ROWS,
    PATCHES,
    DecodedImage,
    ImageInputError,
    ImageLayout,
    ImagePlacement,
    ImagePreparer,
    PreparedImage,
    VisionSettings,
    placement_problems,
)
from helios_core.plugins.pipeline import FinishHint, OutputPipeline, PipelineResult
from helios_core.plugins.sections import (
    STRING_TYPES,
    CallScan,
    ParamScan,
    SectionScan,
    SectionToolParser,
    TagGrammar,
    ToolCallWriter,
    coerce_text,
    decode_json_value,
    dump_json,
    new_call_id,
    parse_attributes,
    partial_suffix_length,
    require_syntax,
    scan_tagged_section,
    schema_type,
    strip_wrapping_newline,
)
from helios_core.plugins.tag_grammar import (
    FUNCTION_NAME,
    PARAMETER_KEY,
    regex_literal,
    tag_call_rules,
    tag_parameters,
    value_rule,
)
from helios_core.plugins.types import (
    CLOSED_ENVELOPE,
    EnvelopeState,
    GeneratedPiece,
    ImageLayoutFactory,
    ImagePreparationFactory,
    OutputDelta,
    ParsedOutput,
    ParserContext,
    ReasoningParser,
    ReasoningParserFactory,
    Register,
    TokenizerVocabulary,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolParserFactory,
    ToolSpec,
    Vocabulary,
)
from helios_core.plugins.version import PLUGIN_API_DECLARATION, PLUGIN_API_VERSION

__all__ = [
    "ANSWER_RULE",
    "CLOSED_ENVELOPE",
    "COMPACT_JSON",
    "FUNCTION_NAME",
    "PARAMETER_KEY",
    "PATCHES",
    "PATCH_COLUMNS",
    "PATCH_ROWS",
    "PLUGIN_API_DECLARATION",
    "PLUGIN_API_VERSION",
    "STRING_TYPES",
    "AnswerFrames",
    "CallScan",
    "DecodedImage",
    "DelimitedEnvelope",
    "DelimitedReasoning",
    "EnvelopeState",
    "FinishHint",
    "GeneratedPiece",
    "GrammarFragment",
    "GrammarUnsupported",
    "GrammarWriter",
    "ImageInputError",
    "ImageLayout",
    "ImageLayoutFactory",
    "ImagePlacement",
    "ImagePreparationFactory",
    "ImagePreparer",
    "OutputDelta",
    "OutputPipeline",
    "ParamScan",
    "ParsedOutput",
    "ParserContext",
    "PipelineResult",
    "PreparedImage",
    "ReasoningEnvelope",
    "ReasoningEnvelopeFactory",
    "ReasoningParser",
    "ReasoningParserFactory",
    "Register",
    "SectionScan",
    "SectionToolParser",
    "StartupError",
    "TagGrammar",
    "TokenizerVocabulary",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallWriter",
    "ToolChoice",
    "ToolGrammarError",
    "ToolGrammarFactory",
    "ToolGrammarRequest",
    "ToolParser",
    "ToolParserFactory",
    "ToolSpec",
    "VisionSettings",
    "Vocabulary",
    "coerce_text",
    "contract",
    "decode_json_value",
    "dump_json",
    "new_call_id",
    "parse_attributes",
    "partial_suffix_length",
    "placement_problems",
    "regex_literal",
    "require_syntax",
    "scan_tagged_section",
    "schema_type",
    "strip_wrapping_newline",
    "tag_call_rules",
    "tag_parameters",
    "value_rule",
]
