"""Hook specifications of Helios plugins (pluggy project ``helios``, entry-point group ``helios``).

Owns the registration hooks. Each hook runs once, at startup, and receives a ``register``
callback: ``register(identifier, factory, *, name=...)``. ``identifier`` is a built-in enum value of
``helios_core.wire.contract_pb2`` or a number in the third-party range 100000-199999; zero never
selects anything. ``name`` is a short readable implementation name shown by ``helios plugins``.

The four parser and image hooks register what a core selects. The two grammar hooks are optional
companions keyed by the same identifiers: a tool grammar belongs to the tool parser of its
identifier (it lets ``tool_choice`` ``"required"`` or a named function constrain output to one call
in that syntax), a reasoning envelope to the reasoning parser of its identifier (it lets constrained
output hold reasoning, or the frames of the answer). Without them the core refuses those requests
with a 400, and structured answers carry no reasoning.

Plugins import only ``helios_core.plugin_api``; they implement these hooks as plain module-level
functions (or methods) named like the specifications below. Add hooks; never change one.
"""

from __future__ import annotations

import pluggy

from helios_core.plugins.types import Register

PROJECT_NAME = "helios"
"""The pluggy project name and the entry-point group plugins are found under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def helios_register_tool_parsers(register: Register) -> None:
    """Register tool parsers: ``register(identifier, factory, name=...)`` where ``factory`` is a
    ``plugin_api.ToolParserFactory`` (``ParserContext -> ToolParser``) and ``identifier`` a
    ``ToolParser`` enum value or a third-party number."""


@hookspec
def helios_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers: ``factory`` is a ``plugin_api.ReasoningParserFactory``
    (``ParserContext -> ReasoningParser``) and ``identifier`` a ``ReasoningParser`` enum value or a
    third-party number."""


@hookspec
def helios_register_image_preparations(register: Register) -> None:
    """Register image preparations (image packers: pixels to patch tensors): ``factory`` is a
    ``plugin_api.ImagePreparationFactory`` and ``identifier`` an ``ImagePreparation`` enum value or
    a third-party number."""


@hookspec
def helios_register_image_layouts(register: Register) -> None:
    """Register image layouts (token positions, feature mappings, vision tensors): ``factory`` is a
    ``plugin_api.ImageLayoutFactory`` and ``identifier`` an ``ImageLayout`` enum value or a
    third-party number."""


@hookspec
def helios_register_tool_grammars(register: Register) -> None:
    """Register constrained tool-call grammars: ``factory`` is a ``plugin_api.ToolGrammarFactory``
    (``ToolGrammarRequest -> GrammarFragment | None``) and ``identifier`` the ``ToolParser`` enum
    value or third-party number of the tool parser whose calls it writes."""


@hookspec
def helios_register_reasoning_envelopes(register: Register) -> None:
    """Register reasoning envelopes: ``factory`` is a ``plugin_api.ReasoningEnvelopeFactory``
    (``FrontendContract -> ReasoningEnvelope``) and ``identifier`` the ``ReasoningParser`` enum value
    or third-party number of the reasoning parser whose syntax it describes."""
