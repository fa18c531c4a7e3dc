"""Generate the Python bindings of the wire schema in ``proto/``.

The generated modules land in ``helios_core/wire/`` and are committed; the
test ``tests/test_proto_fresh.py`` fails when they are stale. Run:

    python tools/gen_proto.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_sources() -> list[Path]:
    """Every ``.proto`` file of the schema, in a stable order."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) over the schema into ``out_dir``."""
    from grpc_tools import protoc  # a development dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_sources()],
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repository root)")
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
