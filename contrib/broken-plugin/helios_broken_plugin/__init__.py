"""A deliberately broken Helios plugin: importing it raises ImportError.

It declares tool parser 100002 in its ``helios.identifiers`` entry points, so the host lists the
identifier without importing it and fails startup only for a core that selects 100002.
"""

raise ImportError("helios-broken-plugin is broken on purpose")
