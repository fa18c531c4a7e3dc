"""Plugin hosting: hook specifications, the startup-time host and the ``helios plugins`` command.

Plugins themselves import only ``helios_core.plugin_api``; this package is the core's side.
"""

from helios_core.plugins.host import (
    DECLARATION_GROUP,
    ENTRY_POINT_GROUP,
    ENV_ALLOWLIST,
    ENV_DISABLE_AUTOLOAD,
    PluginHost,
    PluginRecord,
    Provider,
    SelectedFrontend,
    describe_plugins,
    load_plugins,
)

__all__ = [
    "DECLARATION_GROUP",
    "ENTRY_POINT_GROUP",
    "ENV_ALLOWLIST",
    "ENV_DISABLE_AUTOLOAD",
    "PluginHost",
    "PluginRecord",
    "Provider",
    "SelectedFrontend",
    "describe_plugins",
    "load_plugins",
]
