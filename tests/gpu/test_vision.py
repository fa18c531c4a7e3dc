"""The ``vision-synthetic`` image programs on the GPU (sm_90a) against the reference backend.

A tiny vision core (bf16 weights, ``--targets reference,sm_90a``) is built once per layout (fixed tiles,
and dynamic resolution with 2 x 2 merged patches). Every image program (``image_prefill_p{P}_c{C}`` and
``image_mixed_p{P}_c{C}``) then runs once on both backends from identical state and staging, two lanes
each with an image: the projected image features, the logits and the greedy ids wherever the reference's
top-2 margin exceeds the logits' difference must agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helios_core.backends.cuda import CudaBackend
from helios_core.backends.cuda_driver import Context
from helios_core.backends.reference import ReferenceBackend
from helios_core.container.keys import generate_keys
from helios_core.contract import PreparedContract
from helios_core.loading import TrustSettings, VerifiedCore
from helios_core.runtime.messages import SamplingParams
from helios_core.runtime.packing import GraphPacker, Lane, Submission
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

from .harness import relative_error

NAMESPACE = "helios-tests/gpu-vision"
CACHE_PAGES = 64
STATE_ROWS = 8
IMAGE_SOURCES = (ct.VALUE_SOURCE_IMAGE_TENSOR, ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["tiles", "dynamic"])
def gpu_core(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cuda_context: Context
) -> tuple[Path, TrustSettings]:
    if cuda_context.architecture != "sm_90a":
        pytest.skip(f"the kernels are built for sm_90a; this GPU is {cuda_context.architecture}")
    from ignition.cli import main as ignition_main

    folder = tmp_path_factory.mktemp(f"gpu-vision-{request.param}")
    keys = generate_keys(folder / "keys")
    core = folder / "vision.core"
    code = ignition_main(
        [
            "build", "vision-synthetic", "--shape", "tiny", "--layout", request.param, "--targets", "reference,sm_90a",
            "--dtype", "bf16", "--max-rows", "4", "--prefill-tokens", "16,64", "--context", "128",
            "--page-tokens", "16", "--out", str(core), "--sign-key", str(keys["signing"]), "--namespace", NAMESPACE,
            "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    return core, TrustSettings((keys["public"],), NAMESPACE, None)


def _randomize_state(
    contract: PreparedContract, ref: ReferenceBackend, gpu: CudaBackend, rng: np.random.Generator
) -> None:
    """The same random cache and state on both backends."""
    for decl in contract.execution.buffers:
        if decl.role not in (mf.BUFFER_ROLE_CACHE_PLANE, mf.BUFFER_ROLE_PERSISTENT_STATE):
            continue
        target = ref.buffers[decl.name]
        if target.dtype.kind == "f":
            values = (rng.standard_normal(target.shape) * 0.5).astype(target.dtype)
        else:
            values = rng.integers(0, min(contract.sampled_size, 200), target.shape).astype(target.dtype)
        target[...] = values
        gpu.upload(decl.name, values)


def _round(contract: PreparedContract, name: str, rng: np.random.Generator) -> tuple[list[Lane], dict[str, Any]]:
    """Two prefill lanes of half the program's tokens each, each lane's first tokens an image's features;
    returns the lanes and the image transport values (by destination)."""
    graph = contract.graphs[name]
    packed = graph.extents.packed_token_capacity
    vision = contract.model.vision
    per_feature = vision.patches_per_feature
    bindings = {b.source: b for b in graph.contract.bindings if b.source in IMAGE_SOURCES}
    tensors = [b for b in graph.contract.bindings if b.source == ct.VALUE_SOURCE_IMAGE_TENSOR]
    capacity = int(contract.transport[tensors[0].destination].shape[0])
    grid = int(contract.buffers["v.pos_row.weight"].shape[0].size)
    tokens = packed // 2
    features = min(capacity // per_feature // 2, tokens)
    patches = 2 * features * per_feature
    page_tokens = contract.model.cache.page_tokens
    lanes: list[Lane] = []
    indices = np.full(packed, -1, dtype=np.int64)
    for row in range(2):
        positions = list(range(tokens))
        pages = [row * 8 + j for j in range(positions[-1] // page_tokens + 1)]
        lanes.append(
            Lane(
                slot=row,
                generation=row + 1,
                state_row=row,
                positions=positions,
                cache_slots=[pages[p // page_tokens] * page_tokens + p % page_tokens for p in positions],
                page_table=pages,
                tokens=[int(t) for t in rng.integers(0, contract.sampled_size, tokens)],
                sample=True,
                sampling=SamplingParams(temperature=0.0, seed=row),
                consumed=0,
            )
        )
        indices[row * tokens : row * tokens + features] = np.arange(row * features, (row + 1) * features)
    values: dict[str, Any] = {bindings[ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES].destination: indices}
    for binding in tensors:
        destination = contract.transport[binding.destination]
        if binding.image_output == "patches":
            width = int(destination.shape[1])
            array = np.zeros((capacity, width), dtype=np.float32)
            array[:patches] = rng.standard_normal((patches, width)).astype(np.float32)
        else:
            array = np.zeros(capacity, dtype=np.int32)
            array[:patches] = rng.integers(0, grid, patches)
        values[binding.destination] = array
    return lanes, values


def _stage(
    contract: PreparedContract, name: str, staging: Any, lanes: list[Lane], images: Mapping[str, Any], sequence: int
) -> None:
    graph = contract.graphs[name]
    text = ct.GraphContract()
    text.CopyFrom(graph.contract)
    del text.bindings[:]
    text.bindings.extend(b for b in graph.contract.bindings if b.source not in IMAGE_SOURCES)
    GraphPacker(dataclasses.replace(graph, contract=text), staging).pack(Submission(lanes, sequence), 0, staging)
    for destination, array in images.items():
        staging[destination].reshape(-1)[: array.size] = array.reshape(-1)
    transport = contract.execution.transport
    staging[transport.frame_index_entry].reshape(-1)[0] = 0
    staging[transport.submission_sequence_entry].reshape(-1)[0] = sequence


def test_every_image_program_matches_the_reference(verified: VerifiedCore) -> None:
    contract = verified.contract
    names = [name for name in contract.graphs if name.startswith("image_")]
    assert len(names) == 6
    ref = ReferenceBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS)
    gpu = CudaBackend(contract, verified.core, cache_pages=CACHE_PAGES, state_rows=STATE_ROWS, frames=2)
    try:
        for sequence, name in enumerate(names, 1):
            rng = np.random.default_rng(sequence)
            _randomize_state(contract, ref, gpu, rng)
            lanes, images = _round(contract, name, rng)
            _stage(contract, name, ref.transport(0), lanes, images, sequence)
            _stage(contract, name, gpu.transport(0), lanes, images, sequence)
            ref.run(name, 0)
            gpu.run(name, 0)
            rows = len(lanes)
            count = int(images["image_feature_indices"].max()) + 1  # the round's feature rows
            want_features = ref.buffers["scratch.vision.features"][:count]
            got_features = gpu.download("scratch.vision.features")[:count]
            assert np.abs(want_features).max() > 0.1, name
            assert relative_error(got_features, want_features) < 2e-2, name
            logits = gpu.download("scratch.logits")[:rows]
            expected = ref.buffers["scratch.logits"][:rows]
            assert relative_error(logits, expected) < 2e-2, name
            want, got = ref.completion(0), gpu.completion(0)
            want_ids = want[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(want[mf.COMPLETION_FIELD_SAMPLED_IDS].shape[0], -1)
            got_ids = got[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(want_ids.shape)
            assert int(got[mf.COMPLETION_FIELD_SUBMISSION_SEQUENCE].reshape(-1)[0]) == sequence
            sampled = contract.sampled_size
            deviation = np.abs(logits[:, :sampled] - expected[:, :sampled]).max(axis=1)
            top_two = np.sort(expected[:, :sampled], axis=1)[:, -2:]
            decided = (top_two[:, 1] - top_two[:, 0]) > 2 * deviation
            np.testing.assert_array_equal(got_ids[:rows, 0][decided], want_ids[:rows, 0][decided], err_msg=name)
    finally:
        gpu.close()
        ref.close()
