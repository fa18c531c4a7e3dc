"""Write the golden fixture cores in ``tests/fixtures/cores/``.

Run once per new fixture (``python tools/make_fixture_cores.py``); the files
are committed and every later version of Helios must keep loading them, so
never regenerate an existing fixture: add a new one instead. The keys in that
folder are test material only.

Fixtures: payload format 2 with contract versions 1, 2 and 3; logical-resource
cores with ProtectedIndex 6 and 4; a core with an unfamiliar execution-ABI
label; a core whose attention is a sliding window of 8 tokens (all the tiny
synthetic Llama shape with seeded weights); the tiny ``recurrent-synthetic``
shape, whose history is a recurrent region of state rows; and the tiny
``latent-synthetic`` shape, whose history is a paged-latent region read through a
page-table view shifted by one column; and the tiny ``vision-synthetic`` shape with
image inputs, once with fixed tiles, once with dynamic resolution (merged 2 x 2
patches) and once selecting the third-party example layout 100001; and the tiny synthetic Llama
shape (seed 7) built for two tensor-parallel ranks (``--tensor-parallel 2``: per-rank weight
declarations and resources, one weight catalog a rank, ``all_reduce`` nodes).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "contrib" / "ignition"))
sys.path.insert(0, str(ROOT))

from ignition.build import assemble  # noqa: E402
from ignition.recipes.latent import assemble_latent, latent_declaration  # noqa: E402
from ignition.recipes.llama import Capacities  # noqa: E402
from ignition.recipes.recurrent import assemble_recurrent, recurrent_declaration  # noqa: E402
from ignition.recipes.synthetic import synthetic_declaration  # noqa: E402
from ignition.recipes.vision import assemble_vision, vision_declaration  # noqa: E402

from helios_core.container.keys import generate_keys, load_core_key, load_private_key  # noqa: E402
from helios_core.container.writer import ResourceInput, write_core  # noqa: E402
from helios_core.wire import container_pb2 as cb  # noqa: E402
from helios_core.wire import contract_pb2 as ct  # noqa: E402
from helios_core.wire import manifest_pb2 as mf  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "cores"
NAMESPACE = "helios-fixtures/golden"
CAPACITIES = Capacities(
    max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64, snapshots=0
)
WINDOWED = Capacities(
    max_rows=4,
    prefill_tokens=(16,),
    decode_rows=(1, 2, 4),
    page_tokens=4,
    cache_pages=32,
    context=64,
    snapshots=0,
    window=8,
)
RECURRENT = Capacities(
    max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64, snapshots=2
)
LATENT = Capacities(
    max_rows=4, prefill_tokens=(16,), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=32, context=64, snapshots=0
)

VISION = Capacities(
    max_rows=4, prefill_tokens=(16, 64), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=64, context=128, snapshots=0
)
VISION_FIXTURES = (
    ("vision-tiles.core", "tiles"),
    ("vision-dynamic.core", "dynamic"),
    ("vision-example-layout.core", "100001"),
)
"""Each vision fixture and its ``--layout``."""


def downgrade(serving: ct.ServingContract, version: int) -> ct.ServingContract:
    """Express the same declaration as an older exporter wrote it (implicit defaults left out)."""
    older = ct.ServingContract()
    older.CopyFrom(serving)
    model = older.model
    model.version = version
    for graph in model.graphs:
        ext = graph.extents
        if graph.operation != ct.OPERATION_SPECULATIVE and ext.packed_token_capacity == ext.batch_capacity * max(
            ext.token_capacity, 1
        ):
            ext.packed_token_capacity = 0
    if version == 1:
        model.vocabulary.histogram_width = 0
        model.vocabulary.mask_words = 0
    return older


def nonces(seed: bytes):  # type: ignore[no-untyped-def]
    counter = 0

    def source(count: int) -> bytes:
        nonlocal counter
        counter += 1
        return hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()[:count]

    return source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="overwrite existing fixtures (never for released ones)")
    args = parser.parse_args(argv)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    key_dir = FIXTURES / "keys"
    if not (key_dir / "signing.pem").exists():
        generate_keys(key_dir)
    signing = load_private_key(key_dir / "signing.pem")
    core_key = load_core_key(key_dir / "core.key")

    model = synthetic_declaration("tiny", seed=7)
    serving, builder, resources = assemble(model, CAPACITIES)
    manifest = builder.manifest

    def write(
        name: str,
        contract: ct.ServingContract,
        execution: mf.ExecutionManifest,
        layout: str,
        written: list[ResourceInput] | None = None,
        catalogs: list[cb.WeightCatalog] | None = None,
    ) -> None:
        path = FIXTURES / name
        if path.exists() and not args.force:
            print(f"kept {path.name} (exists)")
            return
        write_core(
            path,
            namespace=NAMESPACE,
            contract=contract,
            execution=execution,
            resources=resources if written is None else written,
            signing_key=signing,
            layout=layout,  # type: ignore[arg-type]
            core_key=core_key if layout == "logical-v4" else None,
            description=f"golden fixture {name}",
            weight_catalogs=catalogs or [],
            nonce_source=nonces(name.encode()),
        )
        print(f"wrote {path.name} ({path.stat().st_size} bytes)")

    write("payload-v3.core", serving, manifest, "payload")
    write("contract-v2.core", downgrade(serving, 2), manifest, "payload")
    write("contract-v1.core", downgrade(serving, 1), manifest, "payload")
    write("logical-v6.core", serving, manifest, "logical-v6")
    write("logical-v4.core", serving, manifest, "logical-v4")
    future = mf.ExecutionManifest()
    future.CopyFrom(manifest)
    future.abi_label = "helios-exec-99-unfamiliar"
    write("abi-label.core", serving, future, "payload")
    windowed, windowed_builder, windowed_resources = assemble(model, WINDOWED)
    if windowed_resources != resources:
        raise SystemExit("the windowed core's resources differ from the others'")
    write("sliding-window.core", windowed, windowed_builder.manifest, "payload")
    recurrent, recurrent_builder, recurrent_resources = assemble_recurrent(
        recurrent_declaration("tiny", seed=7), RECURRENT
    )
    write("recurrent-tiny.core", recurrent, recurrent_builder.manifest, "payload", recurrent_resources)
    latent, latent_builder, latent_resources = assemble_latent(
        latent_declaration("tiny", seed=7, page_offset=1), LATENT
    )
    write("latent-tiny.core", latent, latent_builder.manifest, "payload", latent_resources)
    for name, layout in VISION_FIXTURES:
        vision, vision_builder, vision_resources = assemble_vision(
            vision_declaration("tiny", layout=layout, seed=7), VISION
        )
        write(name, vision, vision_builder.manifest, "payload", vision_resources)
    ranked, ranked_builder, ranked_resources = assemble(model, CAPACITIES, tensor_parallel=2)
    write(
        "tp2-tiny.core", ranked, ranked_builder.manifest, "payload", ranked_resources, ranked_builder.weight_catalogs()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
