"""The plugin host: loads plugins once at startup and resolves a core's frontend selections.

Owns the registries (tool parsers, reasoning parsers, image preparations, image layouts, and the
optional tool grammars and reasoning envelopes keyed by their parser's identifier), each keyed by
enum identifier, and the record of every plugin it saw. Nothing here runs per
request: ``SelectedFrontend.pipeline`` builds a request's ``OutputPipeline`` from the factories
resolved at startup.

Startup, in order:

1. Entry points of group ``helios`` are found. The ``helios`` distribution's own entry points (the
   built-ins in ``helios_plugins``) always load; when they are not installed (a bare source tree)
   the built-in modules are registered directly. Other distributions load unless
   ``HELIOS_DISABLE_PLUGIN_AUTOLOAD=1`` (or ``autoload=False``); ``HELIOS_PLUGINS`` (or
   ``allowlist=``), a comma-separated list of distribution names, limits which ones load (set but
   empty: none).
2. A plugin that fails to import, to register with pluggy, or raises inside a registration hook,
   registers an identifier outside its range, or declares a ``HELIOS_PLUGIN_API`` version this core
   does not provide (another major, or a newer minor), is isolated: it is recorded ``failed`` with the error,
   its registrations are discarded, and startup continues. The built-ins' range is the enum values;
   every other plugin's (any distribution but ``helios``, and plugins registered in process) is
   ``THIRD_PARTY_IDENTIFIERS``, so a third-party plugin registering a built-in identifier fails and
   the built-in keeps serving it. Any ``BaseException`` a plugin raises
   counts (``SystemExit``, ``GeneratorExit``, ``KeyboardInterrupt``, custom subclasses), except the
   ``KeyboardInterrupt`` of an operator's Ctrl-C (SIGINT) arriving while plugins load, which stops
   startup as it would anywhere else. It becomes fatal only when the core
   selects an identifier that no loaded plugin provides; the error then names the failed plugins
   that declare that identifier. Declarations live in a second entry-point group,
   ``helios.identifiers``, whose entries are named ``KIND.NUMBER`` (``tool_parser.100002``) and
   point at the plugin module; the host reads them without importing anything, so a broken
   plugin's identifiers are known. A failed plugin without declarations is listed with identifiers
   ``"unknown"`` and named in every missing-identifier error.
3. Two providers of one identifier are a conflict, listed on both plugins' records and in
   ``conflicts``. Resolving a core that selects that identifier (or whose selected parser's grammar
   it is) fails naming both, unless the operator picks one with
   ``prefer={identifier: "plugin or implementation name"}``; cores selecting other identifiers are
   not affected.
4. ``resolve`` maps a ``FrontendContract`` to the selected factories (with the grammars registered
   for the selected parsers, if any), refusing zero, missing identifiers and mismatched pairings
   (contract pairings, and a tool parser registered with ``requires=`` another reasoning parser),
   and (given a vocabulary) trial-builds the parsers so unusable syntax data fails at startup
   rather than on a request.

Per request, ``SelectedFrontend.pipeline`` builds the parsers; a factory that raises or returns no
parser is a ``ParserPluginError`` naming the implementation, and the ``OutputPipeline`` checks every
parser call the same way (see :mod:`helios_core.plugins.pipeline`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import pkgutil
import signal
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any, Final, Literal, Protocol

import pluggy

from helios_core.contract.prepared import REQUIRED_TOOL_PARSER, THIRD_PARTY_IDENTIFIERS
from helios_core.errors import StartupError
from helios_core.plugins import frontend_contract as contract
from helios_core.plugins import hookspecs
from helios_core.plugins.pipeline import OutputPipeline, ParserPluginError, ParserSource
from helios_core.plugins.types import (
    CLOSED_ENVELOPE,
    EnvelopeState,
    ParserContext,
    ReasoningParser,
    ToolParser,
    ToolSpec,
    Vocabulary,
)
from helios_core.plugins.version import PLUGIN_API_DECLARATION, PLUGIN_API_VERSION

ENTRY_POINT_GROUP: Final = "helios"
"""Entry points of plugin modules."""

DECLARATION_GROUP: Final = "helios.identifiers"
"""Entry points ``KIND.NUMBER = module`` declaring the identifiers a distribution provides."""

BUILTIN_DISTRIBUTION: Final = "helios"
BUILTIN_PACKAGE: Final = "helios_plugins"
"""The package of the built-in plugins: each of its modules that defines a registration hook is a
plugin (registered directly only when the built-in entry points are missing)."""

ENV_ALLOWLIST: Final = "HELIOS_PLUGINS"
ENV_DISABLE_AUTOLOAD: Final = "HELIOS_DISABLE_PLUGIN_AUTOLOAD"

Kind = Literal[
    "tool_parser", "reasoning_parser", "image_preparation", "image_layout", "tool_grammar", "reasoning_envelope"
]
KINDS: Final[tuple[Kind, ...]] = ("tool_parser", "reasoning_parser", "image_preparation", "image_layout")
"""The kinds a core selects (each by its own ``FrontendContract`` field)."""

GRAMMAR_KINDS: Final[tuple[Kind, ...]] = ("tool_grammar", "reasoning_envelope")
"""Optional kinds keyed by the identifier of the parser they belong to (``GRAMMAR_OF``)."""

ALL_KINDS: Final[tuple[Kind, ...]] = KINDS + GRAMMAR_KINDS
GRAMMAR_OF: Final[Mapping[Kind, Kind]] = {"tool_grammar": "tool_parser", "reasoning_envelope": "reasoning_parser"}
_HOOK_OF: Final[Mapping[Kind, str]] = {
    "tool_parser": "helios_register_tool_parsers",
    "reasoning_parser": "helios_register_reasoning_parsers",
    "image_preparation": "helios_register_image_preparations",
    "image_layout": "helios_register_image_layouts",
    "tool_grammar": "helios_register_tool_grammars",
    "reasoning_envelope": "helios_register_reasoning_envelopes",
}
_ENUM_OF: Final[Mapping[Kind, Any]] = {
    "tool_parser": contract.ToolParser,
    "reasoning_parser": contract.ReasoningParser,
    "image_preparation": contract.ImagePreparation,
    "image_layout": contract.ImageLayout,
    "tool_grammar": contract.ToolParser,
    "reasoning_envelope": contract.ReasoningParser,
}


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
    """The distribution (or the name a plugin was registered under in process)."""
    requires: int | None = None
    """The reasoning parser a tool parser only works with (``register(..., requires=...)``)."""
    record_key: str = ""
    """The key of the registering plugin's record in ``PluginHost.records`` (``distribution:entry
    point``, or the in-process name): it tells apart the entry points of one distribution."""

    def source(self) -> ParserSource:
        """This implementation as a ``ParserSource`` (how a ``ParserPluginError`` names it)."""
        return ParserSource(kind_label(self.kind), self.identifier, self.name, self.plugin)


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
        """Registered identifiers of the selectable kinds when loaded (grammars are listed among the
        implementations); otherwise declared ones or ``"unknown"``."""
        if self.status == "ok":
            found: dict[str, list[int]] = {}
            for provider in self.provided:
                if provider.kind in KINDS:
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
    tool_grammar: Provider | None = None
    """The selected tool parser's constrained call grammar (``ToolGrammarFactory``), if any."""
    reasoning_envelope: Provider | None = None
    """The selected reasoning parser's envelope (``ReasoningEnvelopeFactory``), if any."""

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
        single_call: bool = False,
    ) -> OutputPipeline:
        """A fresh output pipeline for one request (``single_call``: present its first tool call only)."""
        context = self.context(vocabulary, tools=tools, envelope=envelope, structured_answer=structured_answer)
        reasoning: ReasoningParser = _build_parser(self.reasoning_parser, context)
        tool: ToolParser = _build_parser(self.tool_parser, context)
        return OutputPipeline(
            reasoning,
            tool,
            structured_answer=structured_answer,
            single_call=single_call,
            reasoning_source=self.reasoning_parser.source(),
            tool_source=self.tool_parser.source(),
        )


def _build_parser(provider: Provider, context: ParserContext) -> Any:
    """One request's parser from ``provider``'s factory: a factory that raises, or returns something
    without callable ``feed`` and ``finish``, is a ``ParserPluginError`` naming the implementation."""
    try:
        parser = provider.factory(context)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plugin's own failure, SystemExit included: this request's error
        raise ParserPluginError(f"{provider.source()} failed to build a parser: {_describe_error(exc)}") from exc
    if not (callable(getattr(parser, "feed", None)) and callable(getattr(parser, "finish", None))):
        raise ParserPluginError(
            f"{provider.source()} factory returned {type(parser).__name__}, not a parser with feed() and finish()"
        )
    return parser


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _distribution(entry_point: EntryPointLike) -> tuple[str, str | None]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return entry_point.name, None
    name = dist.metadata["Name"] if getattr(dist, "metadata", None) is not None else None
    return str(name or getattr(dist, "name", entry_point.name)), getattr(dist, "version", None)


def _describe_error(exc: BaseException) -> str:
    """``Type: message`` on one line (``Type`` alone when there is no message)."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


@contextlib.contextmanager
def _operator_interrupts() -> Iterator[Callable[[], bool]]:
    """Tell an operator's SIGINT apart from a plugin raising ``KeyboardInterrupt`` itself.

    Yields a function that says whether SIGINT arrived inside the block. In the main thread the
    block runs under a SIGINT handler that notes the signal and then does what the previous handler
    did; a signal is never delivered to another thread, so there nothing is noted.
    """
    received = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield received.is_set
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_interrupt(signum: int, frame: FrameType | None) -> None:
        if previous == signal.SIG_IGN:
            return
        received.set()
        if callable(previous):
            previous(signum, frame)  # Python's default handler raises KeyboardInterrupt
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield received.is_set
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


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
        self.registries: dict[Kind, dict[int, Provider]] = {kind: {} for kind in ALL_KINDS}
        self.conflicts: list[str] = []
        """Every unresolved clash (two providers of one identifier), selected or not."""
        self._conflict_of: dict[tuple[Kind, int], str] = {}
        self._candidates: dict[Kind, dict[int, list[Provider]]] = {kind: {} for kind in ALL_KINDS}
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
        with _operator_interrupts() as interrupted:
            if not builtin:
                self._register_builtin_modules(interrupted)
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
                except BaseException as exc:  # isolate any failure of third-party code, SystemExit included
                    if interrupted():
                        raise
                    record.status, record.error = "failed", _describe_error(exc)
            for plugin in self.plugin_manager.get_plugins():
                name = self.plugin_manager.get_name(plugin) or repr(plugin)
                if name not in self.records:
                    self.records[name] = PluginRecord(name, None, None, builtin=False)
            self._collect(interrupted)
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

    def _register_builtin_modules(self, interrupted: Callable[[], bool]) -> None:
        try:
            version: str | None = importlib.metadata.version(BUILTIN_DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            version = None
        package = importlib.import_module(BUILTIN_PACKAGE)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda found: found.name):
            entry_name, module_name = info.name, f"{BUILTIN_PACKAGE}.{info.name}"
            key = f"{BUILTIN_DISTRIBUTION}:{entry_name}"
            record = PluginRecord(BUILTIN_DISTRIBUTION, version, f"{entry_name} = {module_name}", builtin=True)
            try:
                module: ModuleType = importlib.import_module(module_name)
                if not any(callable(getattr(module, hook, None)) for hook in _HOOK_OF.values()):
                    continue  # a helper module of the built-ins, not a plugin
                self.records[key] = record
                self.plugin_manager.register(module, name=key)
            except BaseException as exc:
                if interrupted():
                    raise
                self.records[key] = record
                record.status, record.error = "failed", _describe_error(exc)

    def _collect(self, interrupted: Callable[[], bool]) -> None:
        staged: dict[str, list[Provider]] = {}
        failed: dict[str, str] = {}
        for plugin_object in self.plugin_manager.get_plugins():
            refusal = _api_version_refusal(plugin_object)
            if refusal is not None:
                failed[self.plugin_manager.get_name(plugin_object) or repr(plugin_object)] = refusal
        for kind in ALL_KINDS:
            caller = getattr(self.plugin_manager.hook, _HOOK_OF[kind])
            for impl in caller.get_hookimpls():
                plugin = impl.plugin_name
                if plugin in failed:
                    continue
                register = self._registrar(kind, plugin, staged.setdefault(plugin, []))
                try:
                    impl.function(*[{"register": register}[arg] for arg in impl.argnames])
                except BaseException as exc:  # isolate a hook that raises, SystemExit included
                    if interrupted():
                        raise
                    failed[plugin] = _describe_error(exc)
        for plugin, reason in failed.items():
            if plugin not in staged and plugin in self.records:
                self.records[plugin].status, self.records[plugin].error = "failed", reason
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
        record = self.records[plugin]
        dist = record.name

        def register(identifier: int, factory: Callable[..., Any], *, name: str, requires: int | None = None) -> None:
            if isinstance(identifier, bool) or not isinstance(identifier, int):
                raise TypeError(f"{kind_label(kind)} identifier must be an int, not {identifier!r}")
            problem = _identifier_problem(kind, identifier, enum, builtin=record.builtin, name=str(name))
            if problem is not None:
                raise ValueError(problem)
            if not callable(factory):
                raise TypeError(f"{kind_label(kind)} {identifier}: factory {factory!r} is not callable")
            if requires is not None and (
                kind != "tool_parser" or isinstance(requires, bool) or not isinstance(requires, int)
            ):
                raise TypeError(f"{kind_label(kind)} {identifier}: requires= names a reasoning parser of a tool parser")
            into.append(Provider(kind, identifier, str(name), factory, dist, requires, plugin))

        return register

    def _choose(self) -> None:
        for kind in ALL_KINDS:
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
                    f"{kind_label(kind)} {identifier} is provided by both {names}; uninstall one, or load only "
                    f"one: {ENV_ALLOWLIST}={providers[0].plugin} (a comma-separated list of the plugins to load)"
                )
                self.conflicts.append(message)
                self._conflict_of[(kind, identifier)] = message
                involved = {p.record_key for p in providers}
                for key, record in self.records.items():
                    if key in involved:
                        record.conflicts.append(message)

    # -- resolution ---------------------------------------------------------------------------

    def resolve(self, frontend: contract.FrontendContract, vocabulary: Vocabulary | None = None) -> SelectedFrontend:
        """The selected implementations of ``frontend``; raises ``StartupError`` naming the problem."""
        self.start()
        chosen: dict[Kind, Provider] = {}
        problems: list[str] = []
        for kind in KINDS:
            identifier = int(getattr(frontend, kind))
            if identifier == 0:
                problems.append(f"the core selects no {kind_label(kind)} (identifier 0 never selects)")
                continue
            provider = self.registries[kind].get(identifier)
            if (kind, identifier) in self._conflict_of:
                problems.append(self._conflict_of[(kind, identifier)])
            elif provider is None:
                problems.append(self._missing(kind, identifier))
            else:
                chosen[kind] = provider
        for grammar_kind in GRAMMAR_KINDS:
            clash = self._conflict_of.get((grammar_kind, int(getattr(frontend, GRAMMAR_OF[grammar_kind]))))
            if clash is not None:
                problems.append(clash)
        problems.extend(self._pairing_problems(frontend, chosen.get("tool_parser")))
        if problems:
            raise StartupError("; ".join(problems))
        selected = SelectedFrontend(
            frontend,
            chosen["tool_parser"],
            chosen["reasoning_parser"],
            chosen["image_preparation"],
            chosen["image_layout"],
            tool_grammar=self.grammar("tool_grammar", frontend.tool_parser),
            reasoning_envelope=self.grammar("reasoning_envelope", frontend.reasoning_parser),
        )
        if vocabulary is not None:
            self._trial(selected, vocabulary)
        return selected

    def grammar(self, kind: Kind, identifier: int) -> Provider | None:
        """The ``tool_grammar`` or ``reasoning_envelope`` registered for the parser ``identifier``
        (``None`` also when two plugins clash over it: ``resolve`` refuses a core selecting it)."""
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"{kind!r} is not a grammar kind")
        self.start()
        return self.registries[kind].get(identifier)

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
    def _pairing_problems(frontend: contract.FrontendContract, tool: Provider | None) -> list[str]:
        problems = []
        required_tool = REQUIRED_TOOL_PARSER.get(frontend.reasoning_parser)
        if required_tool is not None and frontend.tool_parser != required_tool:
            problems.append(
                f"reasoning parser {contract.ReasoningParser.Name(frontend.reasoning_parser)} requires tool parser "
                f"{contract.ToolParser.Name(required_tool)} (they share frames), not {frontend.tool_parser}"
            )
        required_reasoning = tool.requires if tool is not None else None
        if required_reasoning is not None and frontend.reasoning_parser != required_reasoning:
            problems.append(
                f"tool parser {_label(contract.ToolParser, frontend.tool_parser)} requires reasoning parser "
                f"{_label(contract.ReasoningParser, required_reasoning)} (its calls live in that parser's frames), "
                f"not {frontend.reasoning_parser}"
            )
        return problems

    @staticmethod
    def _trial(selected: SelectedFrontend, vocabulary: Vocabulary) -> None:
        context = selected.context(vocabulary)
        with _operator_interrupts() as interrupted:
            for provider in (selected.reasoning_parser, selected.tool_parser):
                try:
                    provider.factory(context)
                except BaseException as exc:  # SystemExit and custom BaseExceptions too: a startup failure
                    if interrupted():
                        raise
                    raise StartupError(
                        f"{kind_label(provider.kind)} {provider.identifier} ({provider.name} from "
                        f"{provider.plugin!r}) rejects the core's syntax data: {_describe_error(exc)}"
                    ) from exc

    # -- reporting ----------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One dict per plugin: name, version, entry point, identifiers, status and error."""
        self.start()
        return [record.as_dict() for _, record in sorted(self.records.items())]


def _identifier_problem(kind: Kind, identifier: int, enum: Any, *, builtin: bool, name: str) -> str | None:
    """Why a plugin may not register ``identifier``, or ``None``: the built-in plugins (distribution
    ``helios``) register the enum's values, every other plugin numbers in ``THIRD_PARTY_IDENTIFIERS``."""
    label = f"{kind_label(kind)} {identifier} ({name})"
    third_party = f"{THIRD_PARTY_IDENTIFIERS.start}-{THIRD_PARTY_IDENTIFIERS.stop - 1}"
    is_enum_value = identifier > 0 and identifier in enum.values()
    if builtin:
        if is_enum_value:
            return None
        return f"{label} is not a built-in {kind_label(kind)} value; a built-in plugin registers only those"
    if identifier in THIRD_PARTY_IDENTIFIERS:
        return None
    if is_enum_value:
        return (
            f"{label} is a built-in identifier, reserved for Helios's built-in plugins; a third-party plugin "
            f"registers identifiers in the third-party range {third_party}"
        )
    return f"{label} is outside the third-party range {third_party} that third-party plugins register in"


def _label(enum: Any, value: int) -> str:
    """The enum name of a built-in ``value``, else the number (a third-party identifier)."""
    return str(enum.Name(value)) if value in enum.values() else str(value)


def _api_version_refusal(plugin: object) -> str | None:
    """Why ``plugin``'s declared ``HELIOS_PLUGIN_API`` version cannot be served, or ``None``."""
    declared = getattr(plugin, PLUGIN_API_DECLARATION, None)
    if declared is None:
        return None
    major, minor = PLUGIN_API_VERSION
    if (
        not isinstance(declared, tuple)
        or len(declared) != 2
        or not all(isinstance(part, int) and not isinstance(part, bool) and part >= 0 for part in declared)
    ):
        return f"{PLUGIN_API_DECLARATION} must be a (major, minor) tuple of non-negative integers, not {declared!r}"
    if declared[0] != major or declared[1] > minor:
        return (
            f"written for plugin API {declared[0]}.{declared[1]}, but this Helios provides plugin API "
            f"{major}.{minor} (a plugin needs the same major version and at most this minor version)"
        )
    return None


_INSTALLED: list[PluginHost] = []
_INSTALLED_LOCK = threading.Lock()


def installed_host() -> PluginHost:
    """A started host over the installed plugins, built once per process (for callers that hold no
    host of their own, such as a syntax's default grammar lookup)."""
    with _INSTALLED_LOCK:
        if not _INSTALLED:
            _INSTALLED.append(PluginHost().start())
        return _INSTALLED[0]


def load_plugins(**options: Any) -> PluginHost:
    """A started ``PluginHost`` (options as ``PluginHost``)."""
    return PluginHost(**options).start()


def describe_plugins(host: PluginHost | None = None) -> list[dict[str, Any]]:
    """The ``helios plugins`` listing of ``host`` (default: a host over the installed plugins)."""
    return (host or PluginHost()).describe()
