"""The plugin API's version (re-exported by :mod:`helios_core.plugin_api`, checked by the host).

Owns ``PLUGIN_API_VERSION``, ``(major, minor)``: a minor release only adds names or hooks, a major
one may remove or change one. A plugin module may declare the version it was written against as
``HELIOS_PLUGIN_API = (major, minor)``; the host refuses it when the major differs or its minor is
newer than this one.
"""

from __future__ import annotations

from typing import Final

__all__ = ["PLUGIN_API_DECLARATION", "PLUGIN_API_VERSION"]

PLUGIN_API_VERSION: Final = (1, 1)
"""``(major, minor)`` of the plugin API.

1.1 added the image plugin surface (``VisionSettings``, ``DecodedImage``, ``PreparedImage``,
``ImagePlacement``, ``ImagePreparer``, ``ImageLayout``, ``ImageInputError``, the tensor names) and
made the image factories ``VisionSettings -> ImagePreparer / ImageLayout`` (they took the
``FrontendContract`` and returned an untyped object before; no third-party image plugin used them)."""

PLUGIN_API_DECLARATION: Final = "HELIOS_PLUGIN_API"
"""The module attribute in which a plugin declares the API version it was written against."""
