"""The ``vision-synthetic`` recipe: its contract, and its programs against an independent forward pass.

The golden vision fixtures (``tests/fixtures/cores/vision-*.core``, tiny shape, seed 7) run their
programs directly on the reference backend: the text bindings are packed by the runtime's packer, the
image bindings (``IMAGE_TENSOR`` and ``IMAGE_FEATURE_INDICES``) by this module as the vision design
defines them, from patches cut here by hand. The greedy tokens of prompts with one and with two images
equal those of a numpy forward pass written here from the weights read back through the container
API: the vision tower, the merge, the projector, feature rows in place of the feature tokens'
embeddings, then the Llama decoder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import SHAPES
from ignition.recipes.vision import assemble_vision, vision_declaration

from helios_core.backends.reference import ReferenceBackend
from helios_core.container.keys import generate_keys, load_private_key
from helios_core.container.writer import write_core
from helios_core.frontend.bootstrap import Bootstrap
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.runtime.messages import SamplingParams
from helios_core.runtime.packing import GraphPacker, Lane, Submission
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from tests.ignition.vision_oracle import (
    END,
    FEATURE,
    IMAGE,
    START,
    ImageInput,
    core_weights,
    cut_patches,
    oracle_greedy,
    placed,
    random_pixels,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "cores"
GOLDEN = TrustSettings((FIXTURES / "keys" / "signing.pub.pem",), "helios-fixtures/golden", None)
F32 = npt.NDArray[np.float32]
GREEDY = SamplingParams(temperature=0.0)
SHAPE = SHAPES["tiny"]
GENERATED = 8

IMAGE_SOURCES = (ct.VALUE_SOURCE_IMAGE_TENSOR, ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES)


# -- the programs on the reference backend ---------------------------------------------------------------
def stage_images(
    graph: ct.GraphContract, staging: Mapping[str, np.ndarray], images: Sequence[tuple[int, ImageInput]]
) -> None:
    """The image bindings of one lane's round (``images``: each image's first feature token as a packed
    index, and the image): tensors concatenated along their leading axis, padding after them; each feature
    token's row of the round's feature sequence, padding for every other packed token."""
    for bound in graph.bindings:
        destination = staging[bound.destination]
        if bound.source == ct.VALUE_SOURCE_IMAGE_TENSOR:
            destination[...] = bound.padding
            if images:
                values = np.concatenate([image.tensors[bound.image_output] for _, image in images])
                destination[: values.shape[0]] = values
        elif bound.source == ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES:
            flat = destination.reshape(-1)
            flat[:] = bound.padding
            row = 0
            for first, image in images:
                flat[first : first + image.features] = np.arange(row, row + image.features)
                row += image.features


class ProgramDriver:
    """One request (slot 0, state row 0, page i holding positions 4i..4i+3) run program by program."""

    def __init__(self, verified: VerifiedCore) -> None:
        self.contract = verified.contract
        self.backend = ReferenceBackend(verified.contract, verified.core, cache_pages=64, state_rows=4)
        self.sequence = 0
        self.pages = list(range(self.contract.serving.context_tokens // self.contract.model.cache.page_tokens))

    def close(self) -> None:
        self.backend.close()

    def run(self, name: str, lane: Lane, images: Sequence[tuple[int, ImageInput]] = ()) -> int:
        """Run program ``name`` for ``lane``; returns the lane's sampled id."""
        graph = self.contract.graphs[name]
        text = ct.GraphContract()
        text.CopyFrom(graph.contract)
        del text.bindings[:]
        text.bindings.extend(b for b in graph.contract.bindings if b.source not in IMAGE_SOURCES)
        staging = self.backend.transport(0)
        self.sequence += 1
        GraphPacker(dataclasses.replace(graph, contract=text), staging).pack(
            Submission([lane], self.sequence), 0, staging
        )
        transport = self.contract.execution.transport
        staging[transport.submission_sequence_entry].reshape(-1)[0] = self.sequence
        stage_images(graph.contract, staging, images)
        self.backend.run(name, 0)
        record = self.backend.completion(0)
        return int(record[mf.COMPLETION_FIELD_SAMPLED_IDS].reshape(graph.extents.batch_capacity, -1)[0, 0])

    def lane(self, first: int, tokens: Sequence[int], *, sample: bool) -> Lane:
        positions = list(range(first, first + max(len(tokens), 1)))
        return Lane(
            slot=0, generation=1, state_row=0, positions=positions, cache_slots=positions, page_table=self.pages,
            tokens=list(tokens), sample=sample, sampling=GREEDY, consumed=first,
        )  # fmt: skip

    def generate(
        self,
        prompt: Sequence[int],
        chunks: Sequence[tuple[str, int]],
        images: Sequence[tuple[int, ImageInput]],
        count: int,
    ) -> list[int]:
        """Greedy tokens of ``prompt``: ``initialize``, one program a chunk (``chunks``: each program and the
        prompt index its chunk ends at; the images whose spans lie in a chunk go with it), then decode."""
        width = self.contract.histogram_width
        histogram = np.minimum(np.bincount(np.asarray(prompt), minlength=width), 255).astype(np.uint8)
        self.run("initialize", msgspec.structs.replace(self.lane(0, [], sample=False), positions=[], cache_slots=[],
                                                   prompt_histogram=histogram))  # fmt: skip
        start, token = 0, -1
        for name, end in chunks:
            inside = [(first - start, image) for first, image in images if start <= first < end]
            token = self.run(name, self.lane(start, prompt[start:end], sample=end == len(prompt)), inside)
            start = end
        generated = [token]
        for step in range(1, count):
            position = len(prompt) + step - 1
            lane = msgspec.structs.replace(self.lane(position, [], sample=True), sampling_step=step)
            generated.append(self.run("decode_b1", lane))
        return generated


@pytest.fixture(scope="module")
def cores() -> Iterator[dict[str, VerifiedCore]]:
    opened = {
        name: open_core(FIXTURES / f"vision-{name}.core", GOLDEN) for name in ("tiles", "dynamic", "example-layout")
    }
    yield opened
    for core in opened.values():
        core.close()


def chat_prompt(verified: VerifiedCore, parts: list[dict[str, str]]) -> list[int]:
    bootstrap = Bootstrap.load(verified.core, verified.contract)
    return bootstrap.encode_prompt([{"role": "user", "content": parts}])


def generate(verified: VerifiedCore, prompt: list[int], chunks: Sequence[tuple[str, int]],
             images: Sequence[tuple[int, ImageInput]]) -> list[int]:  # fmt: skip
    driver = ProgramDriver(verified)
    try:
        return driver.generate(prompt, chunks, images, GENERATED)
    finally:
        driver.close()


# -- the contract ----------------------------------------------------------------------------------------
def test_the_tiles_core_declares_its_vision_contract_and_image_programs(cores: dict[str, VerifiedCore]) -> None:
    contract = cores["tiles"].contract
    model = contract.model
    assert (contract.sampled_size, model.input_vocabulary.size, list(model.input_vocabulary.image_sentinel_ids)) == (
        259, 263, [IMAGE]
    )  # fmt: skip
    vision = model.vision
    assert (vision.feature_slots, vision.features_per_window, vision.patches_per_feature) == (64, 16, 1)
    assert list(vision.patch_capacities) == [16, 64]
    assert list(vision.token_layout.feature_ids) == [FEATURE]
    assert [(s.open_id, s.close_id) for s in vision.token_layout.atomic_spans] == [(START, END)]
    settings = vision.settings
    assert (settings.patch_size, settings.min_pixels, settings.max_pixels, settings.temporal_patch) == (4, 256, 256, 1)
    assert len(settings.mean) == len(settings.std) == 3
    assert (model.frontend.image_preparation, model.frontend.image_layout) == (
        ct.IMAGE_PREPARATION_FIXED_TILE, ct.IMAGE_LAYOUT_RASTER_SPAN
    )  # fmt: skip
    image_programs = sorted(name for name in contract.graphs if name.startswith("image_"))
    assert image_programs == [
        "image_mixed_p16_c16", "image_mixed_p64_c16", "image_mixed_p64_c64",
        "image_prefill_p16_c16", "image_prefill_p64_c16", "image_prefill_p64_c64",
    ]  # fmt: skip
    graph = contract.graphs["image_prefill_p64_c64"]
    assert (
        graph.operation == ct.OPERATION_PREFILL
        and contract.graphs["image_mixed_p64_c64"].operation == ct.OPERATION_MIXED
    )
    image = [
        (b.destination, b.source, b.indexing, b.padding, b.image_output)
        for b in graph.contract.bindings
        if b.source in IMAGE_SOURCES
    ]
    assert image == [
        ("patches_c64", ct.VALUE_SOURCE_IMAGE_TENSOR, ct.INDEXING_SCALAR, 0, "patches"),
        ("patch_rows_c64", ct.VALUE_SOURCE_IMAGE_TENSOR, ct.INDEXING_SCALAR, 0, "patch_rows"),
        ("patch_cols_c64", ct.VALUE_SOURCE_IMAGE_TENSOR, ct.INDEXING_SCALAR, 0, "patch_cols"),
        ("image_feature_indices", ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES, ct.INDEXING_PACKED_TOKEN, -1, ""),
    ]
    assert [tuple(contract.transport[name].shape) for name in ("patches_c64", "patch_rows_c64", "patches_c16")] == [
        (64, 48), (64,), (16, 48)
    ]  # fmt: skip
    text_bindings = [b for b in graph.contract.bindings if b.source not in IMAGE_SOURCES]
    assert text_bindings == list(contract.graphs["prefill_p64"].contract.bindings)
    for name, other in contract.graphs.items():  # text-only programs stay beside the image programs, image-free
        if not name.startswith("image_"):
            assert not any(b.source in IMAGE_SOURCES for b in other.contract.bindings), name
    weights = core_weights(cores["tiles"])
    assert not weights["tok_embd"][[IMAGE, FEATURE]].any()  # feature rows are the features exactly
    assert weights["tok_embd"][[START, END]].any()


def test_the_dynamic_and_example_layout_cores_select_their_layouts(cores: dict[str, VerifiedCore]) -> None:
    dynamic = cores["dynamic"].contract.model
    assert (dynamic.frontend.image_preparation, dynamic.frontend.image_layout) == (
        ct.IMAGE_PREPARATION_PATCH_GRID, ct.IMAGE_LAYOUT_MERGED_GRID
    )  # fmt: skip
    vision = dynamic.vision
    assert (vision.patches_per_feature, list(vision.patch_capacities), vision.features_per_window) == (4, [64, 256], 16)
    assert (vision.settings.min_pixels, vision.settings.max_pixels) == (64, 1024)
    assert sorted(n for n in cores["dynamic"].contract.graphs if n.startswith("image_prefill")) == [
        "image_prefill_p16_c64", "image_prefill_p64_c256", "image_prefill_p64_c64"
    ]  # fmt: skip
    example = cores["example-layout"].contract.model
    assert (example.frontend.image_preparation, example.frontend.image_layout) == (
        ct.IMAGE_PREPARATION_FIXED_TILE, 100001
    )  # fmt: skip
    assert example.vision == cores["tiles"].contract.model.vision


def test_the_chat_template_renders_image_parts_as_the_sentinel(cores: dict[str, VerifiedCore]) -> None:
    verified = cores["tiles"]
    prompt = chat_prompt(verified, [{"type": "text", "text": "Hi"}, {"type": "image"}, {"type": "text", "text": "?"}])
    assert prompt == [257, *b"user\nHi", IMAGE, *b"?", 258, *b"\n", 257, *b"assistant\n"]
    bootstrap = Bootstrap.load(verified.core, verified.contract)
    typed = bootstrap.encode_prompt([{"role": "user", "content": "<|image|>"}])  # client text stays text
    assert typed == [257, *b"user\n<|image|>", 258, *b"\n", 257, *b"assistant\n"]


# -- the programs against the forward pass ---------------------------------------------------------------
def test_one_image_gives_the_forward_pass_tokens(cores: dict[str, VerifiedCore]) -> None:
    verified = cores["tiles"]
    image = cut_patches(random_pixels(1, 16, 16), verified.contract.model.vision)
    assert (image.tensors["patches"].shape, image.features) == ((16, 48), 16)
    prompt, images = placed(chat_prompt(verified, [{"type": "text", "text": "Look:"}, {"type": "image"}]), [image])
    assert len(prompt) == 42 and images[0][0] == 12
    # The text before the span on a text-only program, then the span and the rest on an image program.
    tokens = generate(verified, prompt, [("prefill_p16", 11), ("image_prefill_p64_c16", len(prompt))], images)
    assert tokens == oracle_greedy(verified, prompt, images, GENERATED)
    without = generate(verified, prompt, [("prefill_p16", 11), ("image_prefill_p64_c16", len(prompt))], [])
    assert without != tokens  # the features decide the tokens


def test_two_images_in_one_round_give_the_forward_pass_tokens(cores: dict[str, VerifiedCore]) -> None:
    verified = cores["tiles"]
    vision = verified.contract.model.vision
    first, second = (cut_patches(random_pixels(seed, 16, 16), vision) for seed in (2, 3))
    parts = [{"type": "image"}, {"type": "text", "text": "vs"}, {"type": "image"}]
    prompt, images = placed(chat_prompt(verified, parts), [first, second])
    assert len(prompt) == 57
    tokens = generate(verified, prompt, [("image_prefill_p64_c64", len(prompt))], images)
    assert tokens == oracle_greedy(verified, prompt, images, GENERATED)
    swapped = generate(verified, prompt, [("image_prefill_p64_c64", len(prompt))], [images[0], (images[1][0], first)])
    assert swapped == oracle_greedy(verified, prompt, [images[0], (images[1][0], first)], GENERATED)
    assert swapped != tokens


def test_dynamic_images_of_two_sizes_give_the_forward_pass_tokens(cores: dict[str, VerifiedCore]) -> None:
    verified = cores["dynamic"]
    vision = verified.contract.model.vision
    wide = cut_patches(random_pixels(4, 16, 24), vision)  # 4 x 6 patches: 2 x 3 merged features
    small = cut_patches(random_pixels(5, 8, 8), vision)  # one feature
    assert (wide.features, small.features) == (6, 1)
    assert list(wide.tensors["patch_rows"][:8]) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert list(wide.tensors["patch_cols"][:8]) == [0, 1, 0, 1, 2, 3, 2, 3]
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    prompt, images = placed(chat_prompt(verified, parts), [wide, small])
    tokens = generate(verified, prompt, [("image_prefill_p64_c64", len(prompt))], images)
    assert tokens == oracle_greedy(verified, prompt, images, GENERATED)
    # Each image in a round of its own: the feature rows start at 0 again in the second round.
    split = images[1][0] - 1  # the second span's start
    assert (split, len(prompt)) == (17, 33)
    chunks = [("image_prefill_p64_c64", split), ("image_prefill_p16_c64", len(prompt))]
    assert generate(verified, prompt, chunks, images) == tokens


def test_the_example_layout_core_runs_the_tiles_programs(cores: dict[str, VerifiedCore]) -> None:
    example, tiles = cores["example-layout"], cores["tiles"]
    image = cut_patches(random_pixels(6, 16, 16), example.contract.model.vision)
    prompt, images = placed(chat_prompt(example, [{"type": "image"}, {"type": "text", "text": "?"}]), [image])
    chunks = [("image_prefill_p64_c16", len(prompt))]
    tokens = generate(example, prompt, chunks, images)
    assert tokens == oracle_greedy(example, prompt, images, GENERATED)
    assert tokens == generate(tiles, prompt, chunks, images)


def test_the_kernel_graph_gives_the_operator_graph_tokens(tmp_path: Path, cores: dict[str, VerifiedCore]) -> None:
    caps = Capacities(max_rows=4, prefill_tokens=(16, 64), decode_rows=(1, 2, 4), page_tokens=4, cache_pages=64,
                      context=128, snapshots=0)  # fmt: skip
    serving, builder, resources = assemble_vision(vision_declaration("tiny", layout="dynamic", seed=7), caps,
                                                  kernel_graph=True)  # fmt: skip
    nodes = [n.op.name for n in next(p for p in builder.manifest.programs if p.name == "image_prefill_p64_c64").nodes]
    assert nodes[:7] == ["linear", "embedding", "add", "embedding", "add", "rmsnorm_swiglu_mlp_add", "rmsnorm_linear"]
    assert nodes[7:10] == ["embedding", "gather_rows", "add"]
    keys = generate_keys(tmp_path / "keys")
    path = tmp_path / "kernel.core"
    write_core(path, namespace="helios-tests/vision", contract=serving, execution=builder.manifest,
               resources=resources, signing_key=load_private_key(keys["signing"]))  # fmt: skip
    kernel = open_core(path, TrustSettings((keys["public"],), "helios-tests/vision", None))
    try:
        vision = kernel.contract.model.vision
        images = [cut_patches(random_pixels(seed, 16, 16), vision) for seed in (7, 8)]
        prompt, placed_images = placed(chat_prompt(kernel, [{"type": "image"}, {"type": "image"}]), images)
        chunks = [("image_prefill_p64_c64", len(prompt))]
        assert generate(kernel, prompt, chunks, placed_images) == generate(
            cores["dynamic"], prompt, chunks, placed_images
        )
    finally:
        kernel.close()


# -- the command line ------------------------------------------------------------------------------------
def test_the_command_line_builds_the_recipe_and_refuses_what_it_has_no_programs_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ignition.cli import main

    out = tmp_path / "tiny.core"
    assert (
        main(["build", "vision-synthetic", "--out", str(out), "--quiet", "--layout", "dynamic", "--context", "64"]) == 0
    )
    assert "21 programs" in capsys.readouterr().out
    refused = tmp_path / "refused.core"
    for options, error in (
        (["--layout", "7"], "--layout must be tiles, dynamic or a third-party layout id in 100000-199999, got '7'"),
        (["--layout", ""], "--layout must be tiles, dynamic or a third-party layout id in 100000-199999, got ''"),
        (["--shape", "1b"], "unknown vision shape '1b'; known shapes: tiny, small"),
        (["--window", "4"], "vision-synthetic does not take --window"),
        (["--speculative", "history", "--draft-tokens", "1"], "vision-synthetic does not take --speculative"),
        (["--tool-syntax", "xtml"], "vision-synthetic does not take --tool-syntax xtml"),
    ):
        assert main(["build", "vision-synthetic", "--out", str(refused), *options]) == 1
        assert capsys.readouterr().err == f"ignition: error: {error}\n"
    assert main(["build", "llama-synthetic", "--out", str(refused), "--layout", "tiles"]) == 1
    assert capsys.readouterr().err == "ignition: error: --layout belongs to vision-synthetic\n"
    assert not refused.exists() and not (tmp_path / "refused.core.keys").exists()  # refused before any key
