"""Import layering of the serving core: no package imports a higher layer, no two packages import each other.

Every ``helios_core`` module's imports are read from its source (module level, inside functions and
under ``TYPE_CHECKING`` alike) and mapped to packages: ``helios_core/<package>/...`` or the top-level
module ``helios_core/<name>.py``. The layers, lowest first:

wire, dtypes, errors, sampling < container < ops < contract < loading < backends < frontend
< plugins, plugin_api, testing < runtime < server < cli

A package may import its own layer and the layers below. ``ops`` (the op catalogue, which imports
only the sampling declaration of the bottom layer) sits below ``contract``, whose validation reads the catalogue.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "helios_core"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("helios_core", "wire", "dtypes", "errors", "sampling"),
    ("container",),
    ("ops",),
    ("contract",),
    ("loading",),
    ("backends",),
    ("frontend",),
    ("plugins", "plugin_api", "testing"),
    ("runtime",),
    ("server",),
    ("cli",),
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}

KNOWN_UPWARD_IMPORTS = frozenset(
    {
        "helios_core.frontend.formats -> helios_core.plugins.grammar",
        "helios_core.frontend.formats -> helios_core.plugins.host",
        "helios_core.frontend.structured -> helios_core.plugins.grammar",
        "helios_core.frontend.structured -> helios_core.plugins.tag_grammar",
    }
)
"""Frontend modules that still import the plugin layer above them (the grammar pieces they use belong at
or below the frontend). Each entry must still exist: remove it here once its import is gone."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(module: str) -> str:
    """The package a ``helios_core`` module belongs to (``helios_core`` itself for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(module: str, source: str, *, is_package: bool = False) -> set[str]:
    """The ``helios_core`` modules ``module`` (whose text is ``source``) imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "helios_core":  # ``from helios_core import errors``: each name is a module
                found.update(f"helios_core.{alias.name}" for alias in node.names)
            else:
                found.add(base)
    return {name for name in found if name == "helios_core" or name.startswith("helios_core.")}


def core_imports() -> dict[str, set[str]]:
    """Every ``helios_core`` module and the ``helios_core`` modules it imports."""
    imports: dict[str, set[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        module = _module_name(path)
        text = path.read_text(encoding="utf-8")
        imports[module] = imported_modules(module, text, is_package=path.name == "__init__.py")
    return imports


def upward_imports(imports: Mapping[str, Iterable[str]]) -> list[str]:
    """``importer -> imported`` for every import of a package in a higher layer (or in no layer)."""
    found = []
    for module, targets in imports.items():
        for target in sorted(targets):
            low, high = RANK.get(_package(module)), RANK.get(_package(target))
            if low is None or high is None or high > low:
                found.append(f"{module} -> {target}")
    return sorted(found)


def package_cycles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Groups of two or more packages that import each other, directly or through others, each group
    listed with the imports that join it."""
    edges: dict[str, dict[str, list[str]]] = {}
    for module, targets in imports.items():
        for target in targets:
            source, destination = _package(module), _package(target)
            if source != destination:
                edges.setdefault(source, {}).setdefault(destination, []).append(f"{module} -> {target}")
    packages = sorted(set(edges) | {d for targets in edges.values() for d in targets})

    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in edges.get(stack.pop(), {}):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    reach = {package: reachable(package) for package in packages}
    groups: list[list[str]] = []
    placed: set[str] = set()
    for package in packages:
        if package in placed or package not in reach[package]:
            continue
        group = sorted(p for p in packages if p in reach[package] and package in reach[p])
        placed.update(group)
        joining = sorted(line for a in group for b, lines in edges.get(a, {}).items() if b in group for line in lines)
        groups.append(joining)
    return groups


def test_no_package_imports_a_higher_layer() -> None:
    upward = upward_imports(core_imports())
    assert [line for line in upward if line not in KNOWN_UPWARD_IMPORTS] == []
    assert sorted(KNOWN_UPWARD_IMPORTS - set(upward)) == []  # a fixed import leaves the known list


def test_no_two_packages_import_each_other() -> None:
    assert package_cycles(core_imports()) == []


def test_every_package_has_a_layer() -> None:
    packages = {_package(module) for module in core_imports()}
    assert sorted(packages - set(RANK)) == []


def test_the_checks_catch_an_upward_import_and_a_cycle() -> None:
    frontend = "helios_core.frontend.bootstrap"
    source = "from helios_core.runtime.messages import SamplingParams\nfrom . import stops\n"
    imports = {
        frontend: imported_modules(frontend, source),
        "helios_core.runtime.engine": {"helios_core.frontend.bootstrap"},
    }
    assert imports[frontend] == {"helios_core.runtime.messages", "helios_core.frontend"}
    assert upward_imports(imports) == ["helios_core.frontend.bootstrap -> helios_core.runtime.messages"]
    assert package_cycles(imports) == [
        [
            "helios_core.frontend.bootstrap -> helios_core.runtime.messages",
            "helios_core.runtime.engine -> helios_core.frontend.bootstrap",
        ]
    ]
