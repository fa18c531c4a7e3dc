"""The ``helios plugins [--json]`` command: lists every plugin the host sees.

Owns only the command's arguments and output; the main CLI adds it with ``add_plugins_command``.
One line per plugin entry point: its distribution's name and version, the entry point
(``name = module``), the status and the identifiers (``(no identifiers declared)`` for a failed
plugin that declares none), then any error and the conflicts that plugin is part of.
Exit code 0, also when a plugin failed (failures are listed); 1 when two plugins conflict, whether
or not a core selects the identifier.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from helios_core.plugins.host import PluginHost

NO_DECLARED_IDENTIFIERS = "(no identifiers declared)"
"""What a line shows in place of the identifiers of a failed plugin that declares none."""


def add_plugins_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``plugins`` to the ``helios`` subcommands; its ``handler`` default returns the exit code."""
    parser = sub.add_parser("plugins", help="list installed plugins and the identifiers they provide")
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")
    handler: Callable[[argparse.Namespace], int] = run_plugins_command
    parser.set_defaults(handler=handler)


def run_plugins_command(args: argparse.Namespace, *, host: PluginHost | None = None, out: TextIO | None = None) -> int:
    """Print the plugin listing; returns the exit code."""
    stream = out or sys.stdout
    host = host or PluginHost()
    listing = host.describe()
    if getattr(args, "json", False):
        stream.write(json.dumps(listing, indent=2) + "\n")
    else:
        for entry in listing:
            stream.write(_line(entry) + "\n")
    return 1 if host.conflicts else 0


def _line(entry: dict[str, Any]) -> str:
    """``DIST VERSION: ENTRY = MODULE [STATUS] KIND=IDS ...``, then the error and conflicts if any.

    The distribution and the entry point together name the plugin: one distribution (the built-ins'
    ``helios`` among them) may ship several entry points.
    """
    identifiers = entry["identifiers"]
    if isinstance(identifiers, dict):
        shown = " ".join(f"{kind}={','.join(map(str, ids))}" for kind, ids in identifiers.items()) or "-"
    else:  # a failed plugin without identifier declarations
        shown = NO_DECLARED_IDENTIFIERS
    entry_point = entry["entry_point"] or "(registered in process)"
    line = f"{entry['name']} {entry['version'] or '?'}: {entry_point} [{entry['status']}] {shown}"
    if entry["error"]:
        line += f" error: {entry['error']}"
    for conflict in entry["conflicts"]:
        line += f" conflict: {conflict}"
    return line
