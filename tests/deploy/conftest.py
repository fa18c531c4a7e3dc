"""The deployment suite runs only under ``tox -e deploy`` (which sets ``HELIOS_DEPLOY_TESTS=1`` and
installs its schema packages); the default ``pytest`` run leaves it out."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("HELIOS_DEPLOY_TESTS") == "1" else ["test_*.py"]
