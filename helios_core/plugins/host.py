"""The plugin host: loads plugins once at startup and resolves a core's frontend selections.

Owns the four registries (tool parsers, reasoning parsers, image preparations, image layouts),
each keyed by enum identifier, and the record of every plugin it saw. Nothing here runs per
request: ``SelectedFrontend.pipeline`` builds a request's ``OutputPipeline`` from the factories
resolved at startup.

Startup, in order:

1. Entry points of group ``helios`` are found. The ``helios`` distribution's own entry points (the
   built-ins in ``helios_plugins``) always load; when they are not installed (a bare source tree)
   the built-in modules are registered directly. Other distributions load unless
   ``HELIOS_DISABLE_PLUGIN_AUTOLOAD=1`` (or ``autoload=False``); ``HELIOS_PLUGINS`` (or
   ``allowlist=``), a comma-separated list of distribution names, limits which ones load (set but
   empty: none).
2. A plugin that fails to import, to register with pluggy, or raises inside a registration hook, or
   registers an identifier outside its range, is isolated: it is recorded ``failed`` with the error,
   its registrations are discarded, and startup continues. It becomes fatal only when the core
   selects an identifier that no loaded plugin provides; the error then names the failed plugins
   that declare that identifier. Declarations live in a second entry-point group,
   ``helios.identifiers``, whose entries are named ``KIND.NUMBER`` (``tool_parser.100002``) and
   point at the plugin module; the host reads them without importing anything, so a broken
   plugin's identifiers are known. A failed plugin without declarations is listed with identifiers
   ``"unknown"`` and named in every missing-identifier error.
3. Two providers of one identifier are a conflict: resolving fails naming both, unless the operator
   picks one with ``prefer={identifier: "plugin or implementation name"}``.
4. ``resolve`` maps a ``FrontendContract`` to the selected factories, refusing zero, missing
   identifiers and mismatched pairings, and (given a vocabulary) trial-builds the parsers so
   unusable syntax data fails at startup rather than on a request.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Final, Literal, Protocol

import pluggy

from helios_core.contract.prepared import REQUIRED_TOOL_PARSER, THIRD_PARTY_IDENTIFIERS
from helios_core.errors import StartupError
from helios_core.plugin_api import (
    CLOSED_ENVELOPE,
    EnvelopeState,
    OutputPipeline,
    ParserContext,
    ReasoningParser,
    ToolParser,
    ToolSpec,
    Vocabulary,
    contract,
)
from helios_core.plugins import hookspecs

ENTRY_POINT_GROUP: Final = "helios"
"""Entry points of plugin modules."""

DECLARATION_GROUP: Final = "helios.identifiers"
"""Entry points ``KIND.NUMBER = module`` declaring the identifiers a distribution provides."""

BUILTIN_DISTRIBUTION: Final = "helios"
BUILTIN_MODULES: Final = (
    "helios_plugins.none",
    "helios_plugins.reasoning_think_tags",
    "helios_plugins.tool_function_tags",
    "helios_plugins.tool_argument_tags",
    "helios_plugins.tool_dsml",
    "helios_plugins.tool_json_tags",
    "helios_plugins.xtml",
    "helios_plugins.recipient_header",
)
"""The built-in plugin modules (registered directly only when their entry points are missing)."""

ENV_ALLOWLIST: Final = "HELIOS_PLUGINS"
ENV_DISABLE_AUTOLOAD: Final = "HELIOS_DISABLE_PLUGIN_AUTOLOAD"

Kind = Literal["tool_parser", "reasoning_parser", "image_preparation", "image_layout"]
KINDS: Final[tuple[Kind, ...]] = ("tool_parser", "reasoning_parser", "image_preparation", "image_layout")
_HOOK_OF: Final[Mapping[Kind, str]] = {
    "tool_parser": "helios_register_tool_parsers",
    "reasoning_parser": "helios_register_reasoning_parsers",
    "image_preparation": "helios_register_image_preparations",
    "image_layout": "helios_register_image_layouts",
}
_ENUM_OF: Final[Mapping[Kind, Any]] = {
    "tool_parser": contract.ToolParser,
    "reasoning_parser": contract.ReasoningParser,
    "image_preparation": contract.ImagePreparation,
    "image_layout": contract.ImageLayout,
}
REQUIRED_REASONING_PARSER: Final[Mapping[int, int]] = {
    contract.TOOL_PARSER_ATEM: contract.REASONING_PARSER_RECIPIENT_HEADER,
}
"""Tool parsers whose calls only exist inside one reasoning parser's frames."""


class _HeliosPluginManager(pluggy.PluginManager):
    """Accepts plain functions named like a hook specification as implementations (as pytest does),
    so plugins need no pluggy marker and import only ``plugin_api``."""

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        options = super().parse_hookimpl_opts(plugin, name)
        if options is None and name in _HOOK_OF.values() and callable(getattr(plugin, name, None)):
            return {}
        return options


def kind_label(kind: Kind) -> str:
    """``tool_parser`` -> ``tool parser``."""
    return kind.replace("_", " ")


class EntryPointLike(Protocol):
    """What the host reads of an entry point (``importlib.metadata.EntryPoint`` or a test fake)."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> str: ...

    @property
    def group(self) -> str: ...

    def load(self) -> Any: ...


@dataclass(frozen=True)
class Provider:
    """One registered implementation."""

    kind: Kind
    identifier: int
    name: str
    factory: Callable[..., Any]
    plugin: str


@dataclass
class PluginRecord:
    """What ``helios plugins`` shows about one plugin."""

    name: str
    version: str | None
    entry_point: str | None
    builtin: bool
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    declared: dict[str, list[int]] | None = None
    provided: list[Provider] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    def identifiers(self) -> dict[str, list[int]] | Literal["unknown"]:
        """Registered identifiers when loaded; otherwise declared ones or ``"unknown"``."""
        if self.status == "ok":
            found: dict[str, list[int]] = {}
            for provider in self.provided:
                found.setdefault(provider.kind, []).append(provider.identifier)
            return {kind: sorted(ids) for kind, ids in found.items()}
        return self.declared if self.declared is not None else "unknown"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "entry_point": self.entry_point,
            "builtin": self.builtin,
            "status": self.status,
            "error": self.error,
            "identifiers": self.identifiers(),
            "implementations": [{"kind": p.kind, "identifier": p.identifier, "name": p.name} for p in self.provided],
            "conflicts": list(self.conflicts),
        }


@dataclass(frozen=True)
class SelectedFrontend:
    """The implementations a core's frontend selects, resolved at startup."""

    frontend: contract.FrontendContract
    tool_parser: Provider
    reasoning_parser: Provider
    image_preparation: Provider
    image_layout: Provider

    def context(
        self,
        vocabulary: Vocabulary,
        *,
        tools: Sequence[ToolSpec] = (),
        envelope: EnvelopeState = CLOSED_ENVELOPE,
        structured_answer: bool = False,
    ) -> ParserContext:
        """The parser context of one request."""
        return ParserContext(self.frontend, vocabulary, tuple(tools), envelope, structured_answer)

    def pipeline(
        self,
        vocabulary: Vocabulary,
        *,
        tools: Sequence[ToolSpec] = (),
        envelope: EnvelopeState = CLOSED_ENVELOPE,
        structured_answer: bool = False,
    ) -> OutputPipeline:
        """A fresh output pipeline for one request."""
        context = self.context(vocabulary, tools=tools, envelope=envelope, structured_answer=structured_answer)
        reasoning: ReasoningParser = self.reasoning_parser.factory(context)
        tool: ToolParser = self.tool_parser.factory(context)
        return OutputPipeline(reasoning, tool, structured_answer=structured_answer)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _distribution(entry_point: EntryPointLike) -> tuple[str, str | None]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return entry_point.name, None
    name = dist.metadata["Name"] if getattr(dist, "metadata", None) is not None else None
    return str(name or getattr(dist, "name", entry_point.name)), getattr(dist, "version", None)


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginHost:
    """Loads plugins and holds the registries (see the module docstring).

    ``entry_points`` replaces the installed entry points (tests pass fakes); ``environ`` replaces
    ``os.environ`` for the two switches. Plugins registered on ``plugin_manager`` before ``start``
    take part like entry-point plugins."""

    def __init__(
        self,
        *,
        prefer: Mapping[int, str] | None = None,
        autoload: bool | None = None,
        allowlist: Collection[str] | None = None,
        entry_points: Iterable[EntryPointLike] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.prefer = dict(prefer or {})
        self.autoload = autoload if autoload is not None else env.get(ENV_DISABLE_AUTOLOAD, "") not in ("1", "true")
        if allowlist is None and ENV_ALLOWLIST in env:
            allowlist = [name for name in env[ENV_ALLOWLIST].split(",") if name.strip()]
        self.allowlist = None if allowlist is None else {_normalise(name.strip()) for name in allowlist}
        self._entry_points = None if entry_points is None else list(entry_points)
        self.plugin_manager: pluggy.PluginManager = _HeliosPluginManager(hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.registries: dict[Kind, dict[int, Provider]] = {kind: {} for kind in KINDS}
        self.conflicts: list[str] = []
        self._candidates: dict[Kind, dict[int, list[Provider]]] = {kind: {} for kind in KINDS}
        self._started = False

    # -- loading ------------------------------------------------------------------------------

    def start(self) -> PluginHost:
        """Load plugins and fill the registries (once). Never raises for a plugin's failure."""
        if self._started:
            return self
        self._started = True
        entry_points = self._installed_entry_points()
        declarations = self._declarations(entry_points)
        plugins = [ep for ep in entry_points if ep.group == ENTRY_POINT_GROUP]
        builtin = [ep for ep in plugins if _normalise(_distribution(ep)[0]) == BUILTIN_DISTRIBUTION]
        if not builtin:
            self._register_builtin_modules()
        for ep in plugins:
            dist, version = _distribution(ep)
            is_builtin = _normalise(dist) == BUILTIN_DISTRIBUTION
            allowed = self.allowlist is None or _normalise(dist) in self.allowlist
            if not is_builtin and not (self.autoload and allowed):
                continue
            key = f"{dist}:{ep.name}"
            record = PluginRecord(dist, version, f"{ep.name} = {ep.value}", is_builtin)
            record.declared = declarations.get(_normalise(dist))
            self.records[key] = record
            try:
                plugin = ep.load()
                self.plugin_manager.register(plugin, name=key)
            except Exception as exc:  # isolate any failure of third-party code
                record.status, record.error = "failed", _describe_error(exc)
        for plugin in self.plugin_manager.get_plugins():
            name = self.plugin_manager.get_name(plugin) or repr(plugin)
            if name not in self.records:
                self.records[name] = PluginRecord(name, None, None, builtin=False)
        self._collect()
        self._choose()
        return self

    def _installed_entry_points(self) -> list[EntryPointLike]:
        if self._entry_points is not None:
            return self._entry_points
        found: list[EntryPointLike] = []
        for group in (ENTRY_POINT_GROUP, DECLARATION_GROUP):
            found.extend(importlib.metadata.entry_points(group=group))
        return found

    @staticmethod
    def _declarations(entry_points: Iterable[EntryPointLike]) -> dict[str, dict[str, list[int]]]:
        declared: dict[str, dict[str, list[int]]] = {}
        for ep in entry_points:
            if ep.group != DECLARATION_GROUP:
                continue
            kind, _, number = ep.name.partition(".")
            if kind in KINDS and number.isdigit():
                dist = _normalise(_distribution(ep)[0])
                declared.setdefault(dist, {}).setdefault(kind, []).append(int(number))
        return declared

    def _register_builtin_modules(self) -> None:
        try:
            version: str | None = importlib.metadata.version(BUILTIN_DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            version = None
        for module_name in BUILTIN_MODULES:
            key = f"{BUILTIN_DISTRIBUTION}:{module_name.rsplit('.', 1)[-1]}"
            record = PluginRecord(BUILTIN_DISTRIBUTION, version, module_name, builtin=True)
            self.records[key] = record
            try:
                module: ModuleType = importlib.import_module(module_name)
                self.plugin_manager.register(module, name=key)
            except Exception as exc:
                record.status, record.error = "failed", _describe_error(exc)

    def _collect(self) -> None:
        staged: dict[str, list[Provider]] = {}
        failed: dict[str, str] = {}
        for kind in KINDS:
            caller = getattr(self.plugin_manager.hook, _HOOK_OF[kind])
            for impl in caller.get_hookimpls():
                plugin = impl.plugin_name
                if plugin in failed:
                    continue
                register = self._registrar(kind, plugin, staged.setdefault(plugin, []))
                try:
                    impl.function(*[{"register": register}[arg] for arg in impl.argnames])
                except Exception as exc:  # isolate a hook that raises
                    failed[plugin] = _describe_error(exc)
        for plugin, providers in staged.items():
            record = self.records[plugin]
            if plugin in failed:
                record.status, record.error = "failed", failed[plugin]
                continue
            record.provided = providers
            for provider in providers:
                self._candidates[provider.kind].setdefault(provider.identifier, []).append(provider)

    def _registrar(self, kind: Kind, plugin: str, into: list[Provider]) -> Callable[..., None]:
        enum = _ENUM_OF[kind]
        dist = self.records[plugin].name

        def register(identifier: int, factory: Callable[..., Any], *, name: str) -> None:
            if isinstance(identifier, bool) or not isinstance(identifier, int):
                raise TypeError(f"{kind_label(kind)} identifier must be an int, not {identifier!r}")
            if identifier <= 0 or (identifier not in enum.values() and identifier not in THIRD_PARTY_IDENTIFIERS):
                raise ValueError(
                    f"{kind_label(kind)} identifier {identifier} is neither a built-in value nor in the "
                    f"third-party range {THIRD_PARTY_IDENTIFIERS.start}-{THIRD_PARTY_IDENTIFIERS.stop - 1}"
                )
            if not callable(factory):
                raise TypeError(f"{kind_label(kind)} {identifier}: factory {factory!r} is not callable")
            into.append(Provider(kind, identifier, str(name), factory, dist))

        return register

    def _choose(self) -> None:
        for kind in KINDS:
            for identifier, providers in sorted(self._candidates[kind].items()):
                if len(providers) == 1:
                    self.registries[kind][identifier] = providers[0]
                    continue
                picked = self.prefer.get(identifier)
                chosen = [p for p in providers if picked is not None and picked in (p.plugin, p.name)]
                if len(chosen) == 1:
                    self.registries[kind][identifier] = chosen[0]
                    continue
                providers = sorted(providers, key=lambda p: (p.plugin, p.name))
                names = " and ".join(f"{p.plugin!r} ({p.name})" for p in providers)
                message = (
                    f"{kind_label(kind)} {identifier} is provided by both {names}; uninstall one or pick one "
                    f"with prefer={{{identifier}: {providers[0].plugin!r}}}"
                )
                self.conflicts.append(message)
                for record in self.records.values():
                    if record.name in {p.plugin for p in providers}:
                        record.conflicts.append(message)

    # -- resolution ---------------------------------------------------------------------------

    def resolve(self, frontend: contract.FrontendContract, vocabulary: Vocabulary | None = None) -> SelectedFrontend:
        """The selected implementations of ``frontend``; raises ``StartupError`` naming the problem."""
        self.start()
        if self.conflicts:
            raise StartupError("; ".join(self.conflicts))
        chosen: dict[Kind, Provider] = {}
        problems: list[str] = []
        for kind in KINDS:
            identifier = int(getattr(frontend, kind))
            if identifier == 0:
                problems.append(f"the core selects no {kind_label(kind)} (identifier 0 never selects)")
                continue
            provider = self.registries[kind].get(identifier)
            if provider is None:
                problems.append(self._missing(kind, identifier))
            else:
                chosen[kind] = provider
        problems.extend(self._pairing_problems(frontend))
        if problems:
            raise StartupError("; ".join(problems))
        selected = SelectedFrontend(
            frontend,
            chosen["tool_parser"],
            chosen["reasoning_parser"],
            chosen["image_preparation"],
            chosen["image_layout"],
        )
        if vocabulary is not None:
            self._trial(selected, vocabulary)
        return selected

    def _missing(self, kind: Kind, identifier: int) -> str:
        message = f"{kind_label(kind)} {identifier} is selected by the core but no installed plugin provides it"
        declaring = [
            r for r in self.records.values() if r.status == "failed" and identifier in (r.declared or {}).get(kind, [])
        ]
        unknown = [r for r in self.records.values() if r.status == "failed" and r.declared is None]
        if declaring:
            message += "; " + ", ".join(f"plugin {r.name!r} declares it but failed: {r.error}" for r in declaring)
        elif unknown:
            message += "; plugins that failed and declare no identifiers: " + ", ".join(
                f"{r.name!r} ({r.error})" for r in unknown
            )
        return message

    @staticmethod
    def _pairing_problems(frontend: contract.FrontendContract) -> list[str]:
        problems = []
        required_tool = REQUIRED_TOOL_PARSER.get(frontend.reasoning_parser)
        if required_tool is not None and frontend.tool_parser != required_tool:
            problems.append(
                f"reasoning parser {contract.ReasoningParser.Name(frontend.reasoning_parser)} requires tool parser "
                f"{contract.ToolParser.Name(required_tool)} (they share frames), not {frontend.tool_parser}"
            )
        required_reasoning = REQUIRED_REASONING_PARSER.get(frontend.tool_parser)
        if required_reasoning is not None and frontend.reasoning_parser != required_reasoning:
            problems.append(
                f"tool parser {contract.ToolParser.Name(frontend.tool_parser)} requires reasoning parser "
                f"{contract.ReasoningParser.Name(required_reasoning)} (its calls live in recipient frames), "
                f"not {frontend.reasoning_parser}"
            )
        return problems

    @staticmethod
    def _trial(selected: SelectedFrontend, vocabulary: Vocabulary) -> None:
        context = selected.context(vocabulary)
        for provider in (selected.reasoning_parser, selected.tool_parser):
            try:
                provider.factory(context)
            except Exception as exc:
                raise StartupError(
                    f"{kind_label(provider.kind)} {provider.identifier} ({provider.name} from {provider.plugin!r}) "
                    f"rejects the core's syntax data: {exc}"
                ) from exc

    # -- reporting ----------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One dict per plugin: name, version, entry point, identifiers, status and error."""
        self.start()
        return [record.as_dict() for _, record in sorted(self.records.items())]


def load_plugins(**options: Any) -> PluginHost:
    """A started ``PluginHost`` (options as ``PluginHost``)."""
    return PluginHost(**options).start()


def describe_plugins(host: PluginHost | None = None) -> list[dict[str, Any]]:
    """The ``helios plugins`` listing of ``host`` (default: a host over the installed plugins)."""
    return (host or PluginHost()).describe()
