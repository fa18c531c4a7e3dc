"""The ``vision-synthetic`` recipe: a small vision-language model with seeded random weights.

Owns the vision tower written as op-catalogue nodes, its named shapes, the image preparations and
layouts a core can select (``--layout tiles|dynamic|<id>``), the vision contract and image bindings of
its programs, the tokenizer with image tokens and the chat template that places an image, and the
assembly of the core. The language model is the ``llama-synthetic`` model of the same shape name
(:class:`~ignition.recipes.llama.LlamaProgramWriter` writes it, weights from
:func:`~ignition.recipes.synthetic.random_weights`).

The image prefill programs compute, from the round's ``patches``, ``patch_rows`` and ``patch_cols``
(``IMAGE_TENSOR`` inputs, one row per patch)::

    x = linear(patches, patch_weight) + row_table[patch_rows] + col_table[patch_cols]
    x = x + down(silu(gate(rmsnorm(x))) * up(rmsnorm(x)))         (one SwiGLU block)
    merged = x viewed as [P / patches_per_feature, patches_per_feature * width]
    features = rmsnorm_linear(merged, projector_norm, projector_weight)   ([F, hidden])
    h = token_embedding[ids] + gather_rows(features, IMAGE_FEATURE_INDICES)

The token embedding rows of the image sentinel and the feature token are zero, so a text token's row is
unchanged and a feature token's row is exactly its feature (an index of -1 gathers a zero row).

Programs: those of ``llama-synthetic`` (``initialize``, the text-only ``prefill_p{P}``, ``mixed_p{P}``,
``resume_p{P}``, ``scored_prefill_p{P}``, ``decode_b{B}``, and ``snapshot`` / ``restore``), plus
``image_prefill_p{P}_c{C}`` and ``image_mixed_p{P}_c{C}`` for each prefill size P and each patch
capacity C whose feature capacity C / patches_per_feature is at most P (the smallest capacity where
none is): the same programs with the vision tower in front and the image bindings. Resume and scored
prefill programs take no images.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_core.container.writer import ResourceInput
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from ignition.build import (
    Layout,
    Progress,
    cache_identity,
    check_speculative_targets,
    check_window,
    core_resources,
    default_frontend,
    known_gpu_targets,
    lower_for_targets,
    serving_contract,
    text_model_contract,
    validate_and_write,
)
from ignition.preparation import contract as decl
from ignition.preparation.program import ManifestBuilder, ProgramBuilder, View, binding, prefix
from ignition.recipes.llama import Capacities, LlamaProgramWriter, LlamaShape
from ignition.recipes.synthetic import SHAPES as LLAMA_SHAPES
from ignition.recipes.synthetic import byte_level_tokenizer, json_tags_frontend, norm_gain, random_weights

Weights = Mapping[str, npt.NDArray[np.float32]]

IMAGE_TOKEN = "<|image|>"
"""The image sentinel: the chat template writes it where a message's content has an image part."""
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
"""The atomic span's delimiters: a placed image is ``VISION_START``, its feature tokens, ``VISION_END``."""
FEATURE_TOKEN = "<|image_pad|>"
"""The token that receives one image feature."""
VISION_TOKENS = (IMAGE_TOKEN, VISION_START, VISION_END, FEATURE_TOKEN)
"""Added special tokens after the ChatML ones, in this order: none of them is ever sampled."""

PATCHES = "patches"
PATCH_ROWS = "patch_rows"
PATCH_COLUMNS = "patch_cols"
"""The layout tensors the image programs bind (``IMAGE_TENSOR`` ``image_output`` names)."""

FEATURE_INDICES = "image_feature_indices"
"""The transport entry of ``IMAGE_FEATURE_INDICES``: each packed token's feature row, -1 for none."""

LAYOUT_CHOICES = ("tiles", "dynamic")
"""Named ``--layout`` values; an integer selects a third-party layout id (with the tiles preparation)."""

THIRD_PARTY_LAYOUTS = range(100000, 200000)

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
"""Per-channel normalisation of the pixels (``(pixel / 255 - mean) / std``)."""

VISION_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (as ``llama-synthetic`` writes it) whose content may be a list of parts: a ``text`` part is its
text, an ``image`` part the image sentinel."""

VISION_JSON_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a tool by replying "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] + '\\n' }}"
    "{%- if message['content'] is string or not message['content'] %}{{ message['content'] or '' }}"
    "{%- else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{%- for call in message.get('tool_calls') or [] %}{% set arguments = call['function']['arguments'] %}"
    '<tool_call>{"name": {{ call["function"]["name"] | tojson }}, "arguments": '
    "{{ arguments if arguments is string else arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The JSON-tag tools template of ``llama-synthetic`` whose content may be a list of text and image parts."""

VISION_TOOL_SYNTAXES = ("none", "json-tags")
"""Tool syntaxes a vision core may declare."""


@dataclass(frozen=True)
class VisionTower:
    """Hyperparameters of the vision tower."""

    patch_size: int
    """Square patch edge in pixels."""
    width: int
    """Width of a patch's hidden row."""
    ffn: int
    """Width of the tower's SwiGLU block."""
    rms_eps: float = 1e-5

    @property
    def patch_width(self) -> int:
        """Values of a patch row: 3 channels x patch_size x patch_size."""
        return 3 * self.patch_size * self.patch_size


TOWERS: dict[str, VisionTower] = {
    "tiny": VisionTower(patch_size=4, width=32, ffn=64),
    "small": VisionTower(patch_size=8, width=64, ffn=128),
}
"""The vision tower of each ``--shape`` (the language model is ``llama-synthetic``'s shape of that name)."""


@dataclass(frozen=True)
class ImageLayoutChoice:
    """The image preparation and layout a core selects, and the capacities they imply."""

    name: str
    preparation: int
    layout: int
    patches_per_feature: int
    min_pixels: int
    max_pixels: int
    patch_capacities: tuple[int, ...]
    features_per_window: int
    feature_slots: int
    grid_side: int
    """Rows of each position table: the longest side of any image's patch grid."""

    @property
    def merge_edge(self) -> int:
        return math.isqrt(self.patches_per_feature)


def image_layout_choice(option: str, tower: VisionTower) -> ImageLayoutChoice:
    """The layout of ``--layout option`` for ``tower``.

    ``tiles``: FIXED_TILE preparation (one square tile of 4 x 4 patches) and RASTER_SPAN layout, one
    patch a feature, 16 features an image, patch capacities 16 and 64. ``dynamic``: PATCH_GRID
    preparation and MERGED_GRID layout, 2 x 2 patches a feature, images of (2 x patch_size)^2 to
    (8 x patch_size)^2 pixels (1 to 16 features), patch capacities 64 and 256. An integer in
    100000-199999: that third-party layout id with the tiles preparation, capacities and tensors.

    Raises:
        ValueError: any other option.
    """
    size = tower.patch_size
    if option == "dynamic":
        return ImageLayoutChoice(
            name="dynamic",
            preparation=ct.IMAGE_PREPARATION_PATCH_GRID,
            layout=ct.IMAGE_LAYOUT_MERGED_GRID,
            patches_per_feature=4,
            min_pixels=(2 * size) ** 2,
            max_pixels=(8 * size) ** 2,
            patch_capacities=(64, 256),
            features_per_window=16,
            feature_slots=64,
            grid_side=(8 * size) ** 2 // (2 * size * size),  # the longest side, in patches: 32
        )
    layout: int = ct.IMAGE_LAYOUT_RASTER_SPAN
    if option != "tiles":
        try:
            layout = int(option)
        except ValueError:
            layout = 0
        if layout not in THIRD_PARTY_LAYOUTS:
            raise ValueError(
                f"--layout must be {', '.join(LAYOUT_CHOICES)} or a third-party layout id in "
                f"{THIRD_PARTY_LAYOUTS.start}-{THIRD_PARTY_LAYOUTS.stop - 1}, got {option!r}"
            )
    return ImageLayoutChoice(
        name=option,
        preparation=ct.IMAGE_PREPARATION_FIXED_TILE,
        layout=layout,
        patches_per_feature=1,
        min_pixels=(4 * size) ** 2,
        max_pixels=(4 * size) ** 2,
        patch_capacities=(16, 64),
        features_per_window=16,
        feature_slots=64,
        grid_side=4,
    )


def vision_tensor_names() -> dict[str, str]:
    """Array names of the vision tower and projector."""
    return {
        "patch": "v.patch_embd.weight",
        "row": "v.pos_row.weight",
        "col": "v.pos_col.weight",
        "ffn_norm": "v.blk.ffn_norm.weight",
        "w_gate": "v.blk.ffn_gate.weight",
        "w_up": "v.blk.ffn_up.weight",
        "w_down": "v.blk.ffn_down.weight",
        "proj_norm": "v.proj_norm.weight",
        "proj": "v.proj.weight",
    }


VISION_STREAM = 0x56495349
"""The second entry of the vision weights' seed (``default_rng((seed, VISION_STREAM))``), so they do not
repeat the language model's stream."""


def vision_weights(
    tower: VisionTower, choice: ImageLayoutChoice, hidden: int, seed: int
) -> dict[str, npt.NDArray[np.float32]]:
    """Seeded vision weights, drawn in the order of :func:`vision_tensor_names`: matrices scaled by their
    input width^-1/2, position tables by 0.5, norm gains near one."""
    rng = np.random.default_rng((seed, VISION_STREAM))

    def normal(*dims: int, scale: float) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    names = vision_tensor_names()
    width, merged = tower.width, choice.patches_per_feature * tower.width
    return {
        names["patch"]: normal(width, tower.patch_width, scale=tower.patch_width**-0.5),
        names["row"]: normal(choice.grid_side, width, scale=0.5),
        names["col"]: normal(choice.grid_side, width, scale=0.5),
        names["ffn_norm"]: norm_gain(normal, width),
        names["w_gate"]: normal(tower.ffn, width, scale=width**-0.5),
        names["w_up"]: normal(tower.ffn, width, scale=width**-0.5),
        names["w_down"]: normal(width, tower.ffn, scale=tower.ffn**-0.5),
        names["proj_norm"]: norm_gain(normal, merged),
        names["proj"]: normal(hidden, merged, scale=merged**-0.5),
    }


@dataclass(frozen=True)
class VisionDeclaration:
    """A vision core's recipe output before assembly."""

    served_name: str
    shape: LlamaShape
    tower: VisionTower
    choice: ImageLayoutChoice
    weights: Weights
    """The language model's arrays (``llama-synthetic`` names) and the vision arrays
    (:func:`vision_tensor_names`)."""
    tokenizer_json: str
    chat_template: str
    sampled_size: int
    input_size: int
    special_ids: Mapping[str, int]
    eos_token_ids: Sequence[int]
    max_output_tokens: int = 512
    description: str = ""
    tool_frontend: ct.FrontendContract | None = None
    """The tool syntax's frontend (None: no tool or reasoning syntax)."""

    def vision_contract(self) -> ct.VisionContract:
        """Capacities, token layout and pixel settings of the model contract."""
        choice, ids = self.choice, self.special_ids
        vision = ct.VisionContract(
            feature_slots=choice.feature_slots,
            features_per_window=choice.features_per_window,
            patches_per_feature=choice.patches_per_feature,
            patch_capacities=list(choice.patch_capacities),
        )
        vision.token_layout.feature_ids.append(ids[FEATURE_TOKEN])
        vision.token_layout.atomic_spans.add(open_id=ids[VISION_START], close_id=ids[VISION_END])
        settings = vision.settings
        settings.patch_size = self.tower.patch_size
        settings.min_pixels = choice.min_pixels
        settings.max_pixels = choice.max_pixels
        settings.mean.extend(IMAGE_MEAN)
        settings.std.extend(IMAGE_STD)
        settings.temporal_patch = 1
        return vision

    def frontend(self) -> ct.FrontendContract:
        """The tool syntax's frontend (else no tool or reasoning syntax) with the chosen image preparation and
        layout."""
        frontend = ct.FrontendContract()
        frontend.CopyFrom(self.tool_frontend if self.tool_frontend is not None else default_frontend())
        frontend.image_preparation = self.choice.preparation  # type: ignore[assignment]
        frontend.image_layout = self.choice.layout  # type: ignore[assignment]
        return frontend


def vision_declaration(
    shape_name: str, *, layout: str = "tiles", seed: int = 0, tool_syntax: str = "none"
) -> VisionDeclaration:
    """The declaration of a ``vision-synthetic`` core of a named shape and image layout (with JSON-tag tool
    calls for ``tool_syntax="json-tags"``: their markers are sampled tokens, added before the image tokens).

    Raises:
        ValueError: an unknown shape or layout.
    """
    if shape_name not in TOWERS:
        raise ValueError(f"unknown vision shape {shape_name!r}; known shapes: {', '.join(TOWERS)}")
    shape, tower = LLAMA_SHAPES[shape_name], TOWERS[shape_name]
    choice = image_layout_choice(layout, tower)
    if tool_syntax not in VISION_TOOL_SYNTAXES:
        raise ValueError(
            f"unknown tool syntax {tool_syntax!r} for vision-synthetic; known: {', '.join(VISION_TOOL_SYNTAXES)}"
        )
    tool_tokens = ("<tool_call>", "</tool_call>") if tool_syntax == "json-tags" else ()
    tokenizer = byte_level_tokenizer((*tool_tokens, *VISION_TOKENS))
    sampled = tokenizer.vocab_size - len(VISION_TOKENS)
    if tokenizer.vocab_size > shape.vocab:
        raise ValueError(
            f"shape {shape_name!r} has {shape.vocab} embedding rows, the tokenizer needs {tokenizer.vocab_size}"
        )
    weights = dict(random_weights(shape, seed))
    embedding = weights["token_embd.weight"].copy()
    for token in (IMAGE_TOKEN, FEATURE_TOKEN):  # feature rows are the features exactly, sentinels add nothing
        embedding[tokenizer.special_ids[token]] = 0.0
    weights["token_embd.weight"] = embedding
    weights.update(vision_weights(tower, choice, shape.hidden, seed))
    return VisionDeclaration(
        served_name=f"vision-synthetic-{shape_name}",
        shape=shape,
        tower=tower,
        choice=choice,
        weights=weights,
        tokenizer_json=tokenizer.json,
        chat_template=VISION_JSON_TOOLS_TEMPLATE if tool_tokens else VISION_CHATML_TEMPLATE,
        tool_frontend=json_tags_frontend() if tool_tokens else None,
        sampled_size=sampled,
        input_size=tokenizer.vocab_size,
        special_ids=dict(tokenizer.special_ids),
        eos_token_ids=tokenizer.eos_token_ids,
        description=(
            f"Synthetic vision-language shape {shape_name!r}, layout {choice.name!r}, with seeded random "
            f"weights (seed {seed})"
        ),
    )


def image_capacities(prefill_tokens: int, choice: ImageLayoutChoice) -> tuple[int, ...]:
    """The patch capacities of the image programs of ``prefill_tokens`` packed tokens: those whose feature
    capacity is at most P (more features than tokens could never be placed), else the smallest."""
    fitting = tuple(c for c in choice.patch_capacities if c // choice.patches_per_feature <= prefill_tokens)
    return fitting or (min(choice.patch_capacities),)


IMAGE_PROGRAMS = ((ct.OPERATION_PREFILL, "image_prefill"), (ct.OPERATION_MIXED, "image_mixed"))
"""The prompt programs written with images, for every prefill size P and patch capacity C."""


@dataclass(frozen=True)
class _VisionInputs:
    """The transport entries of one patch capacity's image tensors."""

    patches: View
    patch_rows: View
    patch_cols: View


@dataclass(frozen=True)
class _VisionScratch:
    x: View
    """[C, width] the patches' hidden rows (the residual stream of the tower)."""
    t: View
    """[C, width] a position embedding or the block's output before its residual add."""
    xn: View
    gate: View
    up: View
    act: View
    features: View
    """[C / patches_per_feature, hidden]."""
    gathered: View
    """[P, hidden] each packed token's feature row (zero for a text token)."""


class VisionProgramWriter(LlamaProgramWriter):
    """The Llama programs, plus image prefill programs whose decoder input adds image features."""

    def __init__(
        self, builder: ManifestBuilder, model: VisionDeclaration, caps: Capacities, *, bf16: bool, fused: bool
    ) -> None:
        if caps.speculative_widths or caps.window:
            raise ValueError("vision-synthetic builds no speculative or sliding-window programs")
        self.model = model
        self.tower = model.tower
        self.choice = model.choice
        self._image_rows: View | None = None
        """While an image program's decoder is written: its features [F, hidden]; None otherwise."""
        super().__init__(
            builder, model.shape, caps, model.weights, sampled_size=model.sampled_size, bf16=bf16, fused=fused
        )
        self._declare_vision_weights(model.weights, bf16)
        self.vision_inputs = {capacity: self._declare_inputs(capacity) for capacity in self.choice.patch_capacities}
        self.feature_indices = builder.transport_entry(FEATURE_INDICES, mf.DTYPE_I32, [caps.max_packed])
        self.vision_scratch = self._declare_vision_scratch()

    # -- declarations ------------------------------------------------------------------------------
    def _declare_vision_weights(self, weights: Weights, bf16: bool) -> None:
        w = self.builder.weight
        names = vision_tensor_names()
        rid = "weights.vision"
        self.patch_weight = w(names["patch"], weights[names["patch"]], rid, bf16=bf16)
        self.row_table = w(names["row"], weights[names["row"]], rid, bf16=bf16)
        self.col_table = w(names["col"], weights[names["col"]], rid, bf16=bf16)
        self.vision_norm = w(names["ffn_norm"], weights[names["ffn_norm"]], rid)
        if self.fused:
            gate_up = np.concatenate([weights[names["w_gate"]], weights[names["w_up"]]])
            self.vision_gate_up = w("v.blk.ffn_gate_up.weight", gate_up, rid, bf16=bf16)
        else:
            self.vision_gate = w(names["w_gate"], weights[names["w_gate"]], rid, bf16=bf16)
            self.vision_up = w(names["w_up"], weights[names["w_up"]], rid, bf16=bf16)
        self.vision_down = w(names["w_down"], weights[names["w_down"]], rid, bf16=bf16)
        self.projector_norm = w(names["proj_norm"], weights[names["proj_norm"]], rid)
        self.projector = w(names["proj"], weights[names["proj"]], rid, bf16=bf16)

    def _declare_inputs(self, capacity: int) -> _VisionInputs:
        entry = self.builder.transport_entry
        return _VisionInputs(
            patches=entry(f"{PATCHES}_c{capacity}", mf.DTYPE_F32, [capacity, self.tower.patch_width]),
            patch_rows=entry(f"{PATCH_ROWS}_c{capacity}", mf.DTYPE_I32, [capacity]),
            patch_cols=entry(f"{PATCH_COLUMNS}_c{capacity}", mf.DTYPE_I32, [capacity]),
        )

    def _declare_vision_scratch(self) -> _VisionScratch:
        c = max(self.choice.patch_capacities)
        width, ffn = self.tower.width, self.tower.ffn

        def buf(name: str, shape: Sequence[int]) -> View:
            return self.builder.buffer(f"scratch.vision.{name}", mf.BUFFER_ROLE_SCRATCH, mf.DTYPE_F32, shape)

        return _VisionScratch(
            x=buf("x", [c, width]),
            t=buf("t", [c, width]),
            xn=buf("xn", [c, width]),
            gate=buf("gate", [c, ffn]),
            up=buf("up", [c, ffn]),
            act=buf("act", [c, ffn]),
            features=buf("features", [c // self.choice.patches_per_feature, self.shape.hidden]),
            gathered=buf("gathered", [self.caps.max_packed, self.shape.hidden]),
        )

    # -- dataflow ----------------------------------------------------------------------------------
    def _vision_tower(self, prog: ProgramBuilder, capacity: int) -> View:
        """The tower and projector over ``capacity`` patch rows; returns the features view [F, hidden]."""
        inputs, vs, eps = self.vision_inputs[capacity], self.vision_scratch, self.tower.rms_eps
        c = capacity
        x, t, xn = prefix(vs.x, c), prefix(vs.t, c), prefix(vs.xn, c)
        prog.node("linear", {"x": inputs.patches, "weight": self.patch_weight, "out": x}, name="vision.patch_embed")
        prog.node("embedding", {"table": self.row_table, "ids": inputs.patch_rows, "out": t}, name="vision.row_embed")
        prog.node("add", {"a": x, "b": t, "out": x}, name="vision.add_row")
        prog.node("embedding", {"table": self.col_table, "ids": inputs.patch_cols, "out": t}, name="vision.col_embed")
        prog.node("add", {"a": x, "b": t, "out": x}, name="vision.add_col")
        if self.fused:
            prog.node(
                "rmsnorm_swiglu_mlp_add",
                {
                    "x": x,
                    "norm_weight": self.vision_norm,
                    "gate_up_weight": self.vision_gate_up,
                    "down_weight": self.vision_down,
                    "residual": x,
                    "out": x,
                },
                {"eps": eps},
                name="vision.mlp_residual",
            )
        else:
            gate, up, act = prefix(vs.gate, c), prefix(vs.up, c), prefix(vs.act, c)
            prog.node("rmsnorm", {"x": x, "weight": self.vision_norm, "out": xn}, {"eps": eps}, name="vision.ffn_norm")
            prog.node("linear", {"x": xn, "weight": self.vision_gate, "out": gate}, name="vision.gate")
            prog.node("linear", {"x": xn, "weight": self.vision_up, "out": up}, name="vision.up")
            prog.node("silu_mul", {"gate": gate, "up": up, "out": act}, name="vision.silu_mul")
            prog.node("linear", {"x": act, "weight": self.vision_down, "out": t}, name="vision.down")
            prog.node("add", {"a": x, "b": t, "out": x}, name="vision.ffn_residual")
        per_feature = self.choice.patches_per_feature
        features = c // per_feature
        merged = View(vs.x.buffer, (features, per_feature * self.tower.width))  # the merge: a view, no copy
        out = prefix(vs.features, features)
        prog.node(
            "rmsnorm_linear",
            {"x": merged, "norm_weight": self.projector_norm, "weight": self.projector, "out": out},
            {"eps": eps},
            name="vision.projector",
        )
        return out

    def _embed(self, prog: ProgramBuilder, ids: View, h: View, label: str) -> None:
        """The token embedding, plus each packed token's image feature row in an image program."""
        super()._embed(prog, ids, h, label)
        if self._image_rows is None or label:
            return
        tokens = h.shape[0]
        gathered = prefix(self.vision_scratch.gathered, tokens)
        prog.node(
            "gather_rows",
            {"x": self._image_rows, "index": prefix(self.feature_indices, tokens), "out": gathered},
            name="image_features",
        )
        prog.node("add", {"a": h, "b": gathered, "out": h}, name="add_image_features")

    # -- programs ----------------------------------------------------------------------------------
    def write(self) -> list[ct.GraphContract]:
        graphs = super().write()
        graphs.extend(self._image_programs())
        return graphs

    def image_bindings(self, capacity: int) -> list[ct.ValueBinding]:
        """The image inputs of a program of patch capacity ``capacity``."""
        inputs = self.vision_inputs[capacity]
        tensors = []
        for view, output in (
            (inputs.patches, PATCHES),
            (inputs.patch_rows, PATCH_ROWS),
            (inputs.patch_cols, PATCH_COLUMNS),
        ):
            tensor = binding(view.buffer, ct.VALUE_SOURCE_IMAGE_TENSOR, decl.SCALAR, padding=0)
            tensor.image_output = output
            tensors.append(tensor)
        indices = binding(FEATURE_INDICES, ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES, decl.PACKED, padding=-1)
        return [*tensors, indices]

    def _image_programs(self) -> list[ct.GraphContract]:
        caps, sh = self.caps, self.shared
        b = caps.max_rows
        accesses = decl.sampling_state_accesses() + self._history_accesses(ct.ACCESS_MODE_READ_WRITE)
        host_fed = decl.lane_bindings() + self._token_bindings(host_tokens=True) + decl.sampling_bindings()
        graphs: list[ct.GraphContract] = []
        for tokens in caps.prefill_tokens:
            for capacity in image_capacities(tokens, self.choice):
                for operation, label in IMAGE_PROGRAMS:
                    name = f"{label}_p{tokens}_c{capacity}"
                    prog = ProgramBuilder(name, operation)
                    self._image_rows = self._vision_tower(prog, capacity)
                    try:
                        self._decoder(prog, b, tokens, prefix(sh.input_ids, tokens))
                    finally:
                        self._image_rows = None
                    self._sample_and_complete(prog, b, tokens)
                    self.builder.add_program(prog)
                    bindings = host_fed + self.image_bindings(capacity)
                    graphs.append(self._graph(name, operation, b, tokens, bindings, accesses))
        return graphs


def check_vision_options(caps: Capacities, targets: Sequence[str]) -> None:
    """Refuse what the vision programs are not built for, before any key or weight is touched.

    Raises:
        ValueError: speculative widths or a sliding window (never built with images), or a target the
            Llama programs refuse.
    """
    if caps.speculative_widths:
        raise ValueError("vision-synthetic does not take --speculative")
    check_window(caps, targets)
    if caps.window:
        raise ValueError("vision-synthetic does not take --window")
    check_speculative_targets(caps, targets)


def assemble_vision(
    model: VisionDeclaration,
    caps: Capacities,
    *,
    bf16: bool = False,
    gpu_targets: Sequence[str] = (),
    kernel_graph: bool = False,
    progress: Progress | None = None,
) -> tuple[ct.ServingContract, ManifestBuilder, list[ResourceInput]]:
    """The serving contract, execution manifest and resources of a vision core (kernel graphs, lowered
    for every GPU target, when ``gpu_targets`` or ``kernel_graph``)."""
    builder = ManifestBuilder()
    writer = VisionProgramWriter(builder, model, caps, bf16=bf16, fused=kernel_graph or bool(gpu_targets))
    graphs = writer.write()
    modules = lower_for_targets(builder, gpu_targets, progress)
    resources = core_resources(builder, model.tokenizer_json, model.chat_template, modules)
    choice = model.choice
    settings = [
        b"bf16" if bf16 else b"f32",
        b"kernel-graph" if kernel_graph or gpu_targets else b"operator-graph",
        f"page_tokens={caps.page_tokens}".encode(),
        f"image_preparation={choice.preparation} image_layout={choice.layout}".encode(),
    ]
    contract_model = text_model_contract(model.sampled_size, model.shape.vocab, caps.page_tokens)
    contract_model.input_vocabulary.size = model.input_size
    contract_model.input_vocabulary.image_sentinel_ids.append(model.special_ids[IMAGE_TOKEN])
    contract_model.vision.CopyFrom(model.vision_contract())
    region = contract_model.cache.regions.add(name="kv", kind=ct.HISTORY_KIND_PAGED_KV, tokens_per_record=1)
    region.planes.extend(v.buffer for v in writer.k_planes + writer.v_planes)
    contract_model.cache.page_table_views.add(
        buffer="page_table", page_offset=0, region="kv", pages_per_row=caps.pages_per_row
    )
    if writer.snapshots is not None:
        continuation = contract_model.cache.regions.add(name="continuation", kind=ct.HISTORY_KIND_CONTINUATION)
        continuation.planes.extend(v.buffer for v in writer.continuation_k + writer.continuation_v)
    contract_model.graphs.extend(graphs)
    contract_model.frontend.CopyFrom(model.frontend())
    contract_model.state_views.extend(decl.state_views(writer.text_caps))
    serving = serving_contract(
        model.served_name,
        cache_identity(resources, family=b"vision", settings=settings),
        caps,
        contract_model,
        eos_token_ids=model.eos_token_ids,
        max_output_tokens=model.max_output_tokens,
    )
    return serving, builder, resources


def build_vision_core(
    model: VisionDeclaration,
    out: Path,
    *,
    caps: Capacities,
    signing_key: Ed25519PrivateKey,
    namespace: str,
    layout: Layout = "payload",
    core_key: bytes | None = None,
    bf16: bool = False,
    targets: Sequence[str] = ("reference",),
    progress: Progress | None = None,
) -> ct.ServingContract:
    """Assemble, validate (with Helios' own contract rules), sign and write a vision core."""
    gpu_targets = known_gpu_targets(targets)
    check_vision_options(caps, targets)
    serving, builder, resources = assemble_vision(model, caps, bf16=bf16, gpu_targets=gpu_targets, progress=progress)
    validate_and_write(
        out,
        serving,
        builder,
        resources,
        signing_key=signing_key,
        namespace=namespace,
        layout=layout,
        core_key=core_key,
        description=model.description,
        progress=progress,
    )
    return serving
