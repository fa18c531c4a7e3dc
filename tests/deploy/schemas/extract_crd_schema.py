"""Extract one served version's ``openAPIV3Schema`` from a CustomResourceDefinition YAML file.

Usage: ``python extract_crd_schema.py CRD.yaml VERSION OUT.json``. Descriptions are dropped (they
are most of a CRD's size and play no part in validation); everything else is kept as it is, the
``x-kubernetes-*`` extensions included. The README beside this file records which CRDs the schemas
here came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: _without_descriptions(value)
            for key, value in node.items()
            if not (key == "description" and isinstance(value, str))
        }
    if isinstance(node, list):
        return [_without_descriptions(item) for item in node]
    return node


def extract(crd_path: Path, version: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text(encoding="utf-8"))
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema: dict[str, Any] = _without_descriptions(entry["schema"]["openAPIV3Schema"])
            return schema
    raise SystemExit(f"{crd_path}: no version {version!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        raise SystemExit("usage: extract_crd_schema.py CRD.yaml VERSION OUT.json")
    crd_path, version, out = Path(argv[0]), argv[1], Path(argv[2])
    out.write_text(json.dumps(extract(crd_path, version), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
