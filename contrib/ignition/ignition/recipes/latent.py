"""The ``latent-synthetic`` recipe: a small decoder with compressed latent attention history.

Owns the model's attention dataflow written as op-catalogue nodes, its shapes (``tiny`` for tests,
``small``), its seeded weights, and the contract that declares its history as a PAGED_LATENT region.
Everything but attention is the Llama recipe's (:class:`~ignition.recipes.llama.LlamaProgramWriter`:
embedding, RMSNorm, SwiGLU feed-forward, final norm, LM head, sampling and completion).

Attention in the manner of multi-head latent attention, simplified: each layer projects a token's
normalised hidden state ``x`` down to a latent ``c = W_dkv x`` of width ``d_c`` and stores only that
in the cache (``latent_cache_write``); at attention time every visible record is projected up to
keys ``W_uk c`` and values ``W_uv c`` per head (``latent_attention``). There are no rotary position
embeddings (no decoupled RoPE keys): position enters only through causal masking. A cache page of
``page_tokens`` tokens holds ``page_tokens / R`` latent records, ``R = tokens_per_record`` (1 by
default, one record per token; with ``R > 1`` a record is the mean of its R tokens' latents and a token
attends only to the records whose tokens all lie at or before it).

With ``page_offset`` k > 0, attention reads its pages through a second page-table entry
``latent_page_table`` whose view is shifted by k columns (the first k columns hold -1): the programs
read page ``j`` of a lane at column ``k + j``.

Programs: ``initialize``, ``prefill_p{P}``, ``mixed_p{P}``, ``resume_p{P}``, ``scored_prefill_p{P}``
and ``decode_b{B}``, as the Llama recipe writes them; no speculative, self-drafting or snapshot
programs (a preempted request is recomputed from its tokens).

Targets: ``reference`` and ``sm_90a`` (:data:`GPU_TARGETS`); a GPU target gives every node of the same
operator graph its launches (the latent kernels are :mod:`ignition.kernels.latent`).
"""

from __future__ import annotations

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
    check_recipe_targets,
    core_resources,
    default_frontend,
    lower_for_targets,
    serving_contract,
    text_model_contract,
    validate_and_write,
)
from ignition.preparation import contract as decl
from ignition.preparation.program import ManifestBuilder, ProgramBuilder, View, binding, prefix
from ignition.recipes.llama import Capacities, LlamaProgramWriter, LlamaShape, _TokenLayout
from ignition.recipes.synthetic import (
    CHATML_TEMPLATE,
    byte_level_tokenizer,
    embedding_and_head_weights,
    norm_gain,
    seeded_normal,
)

Weights = Mapping[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class LatentShape:
    """Hyperparameters: a Llama-family decoder whose attention history is a latent of ``latent_dim``."""

    base: LlamaShape
    latent_dim: int


SHAPES: dict[str, LatentShape] = {
    "tiny": LatentShape(
        LlamaShape(
            vocab=320, hidden=32, layers=2, heads=4, kv_heads=4, head_dim=8, ffn=64, rope_theta=10000.0, rms_eps=1e-5
        ),
        latent_dim=12,
    ),
    "small": LatentShape(
        LlamaShape(
            vocab=512, hidden=128, layers=4, heads=8, kv_heads=8, head_dim=16, ffn=384, rope_theta=10000.0,
            rms_eps=1e-5,
        ),
        latent_dim=48,
    ),
}  # fmt: skip
"""Named shapes (``--shape``)."""


def tensor_names(layer: int) -> dict[str, str]:
    """Array names of one layer."""
    return {
        "attn_norm": f"blk.{layer}.attn_norm.weight",
        "wq": f"blk.{layer}.attn_q.weight",
        "w_dkv": f"blk.{layer}.attn_kv_down.weight",
        "w_uk": f"blk.{layer}.attn_k_up.weight",
        "w_uv": f"blk.{layer}.attn_v_up.weight",
        "wo": f"blk.{layer}.attn_output.weight",
        "ffn_norm": f"blk.{layer}.ffn_norm.weight",
        "w_gate": f"blk.{layer}.ffn_gate.weight",
        "w_up": f"blk.{layer}.ffn_up.weight",
        "w_down": f"blk.{layer}.ffn_down.weight",
    }


def random_weights(shape: LatentShape, seed: int) -> dict[str, npt.NDArray[np.float32]]:
    """Seeded random weights from one sequential stream (scales keep activations well conditioned)."""
    normal = seeded_normal(seed)
    s = shape.base
    h, width, c = s.hidden, s.heads * s.head_dim, shape.latent_dim
    weights = embedding_and_head_weights(normal, s.vocab, h)
    for layer in range(s.layers):
        names = tensor_names(layer)
        weights[names["attn_norm"]] = norm_gain(normal, h)
        weights[names["ffn_norm"]] = norm_gain(normal, h)
        weights[names["wq"]] = normal(width, h, scale=h**-0.5)
        weights[names["w_dkv"]] = normal(c, h, scale=h**-0.5)
        weights[names["w_uk"]] = normal(width, c, scale=c**-0.5)
        weights[names["w_uv"]] = normal(width, c, scale=c**-0.5)
        weights[names["wo"]] = normal(h, width, scale=width**-0.5)
        weights[names["w_gate"]] = normal(s.ffn, h, scale=h**-0.5)
        weights[names["w_up"]] = normal(s.ffn, h, scale=h**-0.5)
        weights[names["w_down"]] = normal(h, s.ffn, scale=s.ffn**-0.5)
    return weights


def check_latent_options(tokens_per_record: int, page_tokens: int, page_offset: int) -> None:
    """Refuse a record size or page-table offset the latent programs cannot use.

    Raises:
        ValueError: ``tokens_per_record`` below 1 or not dividing ``page_tokens``, or a negative
            ``page_offset``.
    """
    if tokens_per_record < 1 or page_tokens % tokens_per_record:
        raise ValueError(
            f"--tokens-per-record must be at least 1 and divide --page-tokens {page_tokens}, got {tokens_per_record}"
        )
    if page_offset < 0:
        raise ValueError(f"--page-offset must be 0 or positive, got {page_offset}")


class LatentProgramWriter(LlamaProgramWriter):
    """The Llama programs with latent attention in every layer."""

    def __init__(
        self,
        builder: ManifestBuilder,
        shape: LatentShape,
        caps: Capacities,
        weights: Weights,
        *,
        sampled_size: int,
        tokens_per_record: int = 1,
        page_offset: int = 0,
    ) -> None:
        if caps.speculative_widths or caps.snapshots or caps.window:
            raise ValueError("latent-synthetic builds no speculative, snapshot or sliding-window programs")
        check_latent_options(tokens_per_record, caps.page_tokens, page_offset)
        self.latent_shape = shape
        self.tokens_per_record = tokens_per_record
        self.page_offset = page_offset
        super().__init__(builder, shape.base, caps, weights, sampled_size=sampled_size, bf16=False)
        self.latent_table: View | None = None
        if page_offset:
            self.latent_table = builder.transport_entry(
                "latent_page_table", mf.DTYPE_I32, [caps.max_rows, page_offset + caps.pages_per_row]
            )

    def _declare_weights(self, weights: Weights, bf16: bool) -> None:
        self._declare_float_weights(weights, tensor_names)

    def _declare_cache(self) -> None:
        c = self.caps
        records = c.page_tokens // self.tokens_per_record
        self.k_planes: list[View] = []
        self.v_planes: list[View] = []
        self.latent_planes = [
            self.builder.buffer(
                f"cache.latent{layer}",
                mf.BUFFER_ROLE_CACHE_PLANE,
                mf.DTYPE_F32,
                [c.cache_pages, records, self.latent_shape.latent_dim],
                leading_symbol=mf.DIM_SYMBOL_CACHE_PAGES,
            )
            for layer in range(self.shape.layers)
        ]

    def _decoder(
        self,
        prog: ProgramBuilder,
        rows: int,
        tokens: int,
        ids: View,
        layout: _TokenLayout | None = None,
        layers: int | None = None,
        label: str = "",
    ) -> None:
        """Embedding and every layer over ``tokens`` packed tokens of ``rows`` lanes (host-fed layout)."""
        s, sc, sh = self.shape, self.scratch, self.shared
        where = layout or self._host_layout()
        p = tokens
        width = s.heads * s.head_dim
        h, xn = prefix(sc.h, p), prefix(sc.xn, p)
        q, attn = prefix(sc.q, p), prefix(sc.attn, p)
        q2 = View(q.buffer, (p, width))
        latent = View(sc.k.buffer, (p, self.latent_shape.latent_dim))
        table = prefix(self.latent_table, rows) if self.latent_table is not None else prefix(sh.page_table, rows)
        prog.node("embedding", {"table": self.tok_embd, "ids": ids, "out": h}, name=f"{label}embedding")
        for layer, lw in enumerate(self.layer_weights[:layers]):
            prog.node(
                "rmsnorm",
                {"x": h, "weight": lw["attn_norm"], "out": xn},
                {"eps": s.rms_eps},
                name=f"{label}l{layer}.attn_norm",
            )
            prog.node("linear", {"x": xn, "weight": lw["wq"], "out": q2}, name=f"{label}l{layer}.q")
            prog.node("linear", {"x": xn, "weight": lw["w_dkv"], "out": latent}, name=f"{label}l{layer}.kv_down")
            prog.node(
                "latent_cache_write",
                {"latent": latent, "slots": prefix(where.cache_slots, p), "plane": self.latent_planes[layer]},
                {"tokens_per_record": self.tokens_per_record},
                name=f"{label}l{layer}.cache_write",
            )
            prog.node(
                "latent_attention",
                {
                    "q": q,
                    "plane": self.latent_planes[layer],
                    "w_uk": lw["w_uk"],
                    "w_uv": lw["w_uv"],
                    "page_table": table,
                    "token_row": prefix(where.token_rows, p),
                    "token_position": prefix(where.positions, p),
                    "out": attn,
                },
                {
                    "scale": float(s.head_dim) ** -0.5,
                    "tokens_per_record": self.tokens_per_record,
                    "page_offset": self.page_offset,
                },
                name=f"{label}l{layer}.attention",
            )
            self._output_and_feed_forward(prog, layer, p, label)

    def write(self) -> list[ct.GraphContract]:
        graphs = super().write()
        if self.latent_table is not None:  # the shifted view is packed wherever the page table is
            for graph in graphs:
                if any(b.source == ct.VALUE_SOURCE_PAGE_TABLE for b in graph.bindings):
                    graph.bindings.append(
                        binding("latent_page_table", ct.VALUE_SOURCE_PAGE_TABLE, ct.INDEXING_SUBMISSION_ROW, padding=-1)
                    )
        return graphs


@dataclass(frozen=True)
class LatentDeclaration:
    """A latent core's recipe output before assembly."""

    served_name: str
    shape: LatentShape
    weights: Weights
    tokenizer_json: str
    chat_template: str
    sampled_size: int
    eos_token_ids: Sequence[int]
    tokens_per_record: int = 1
    page_offset: int = 0
    max_output_tokens: int = 512
    description: str = ""
    frontend: ct.FrontendContract | None = None
    """The frontend the core declares: its tool and reasoning parsers (None: neither; never image inputs)."""


def latent_declaration(
    shape_name: str, *, seed: int = 0, tokens_per_record: int = 1, page_offset: int = 0
) -> LatentDeclaration:
    """The declaration of a ``latent-synthetic`` core of a named shape.

    Raises:
        ValueError: an unknown shape name.
    """
    if shape_name not in SHAPES:
        raise ValueError(f"unknown latent shape {shape_name!r}; known shapes: {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    tokenizer = byte_level_tokenizer()
    return LatentDeclaration(
        served_name=f"latent-synthetic-{shape_name}",
        shape=shape,
        weights=random_weights(shape, seed),
        tokenizer_json=tokenizer.json,
        chat_template=CHATML_TEMPLATE,
        sampled_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        tokens_per_record=tokens_per_record,
        page_offset=page_offset,
        description=f"Synthetic latent-attention shape {shape_name!r} with seeded random weights (seed {seed})",
    )


GPU_TARGETS = ("sm_90a",)
"""GPU targets with kernels for every operator of the latent programs (``latent_cache_write`` and
``latent_attention`` in :mod:`ignition.kernels.latent`)."""


def check_latent_targets(targets: Sequence[str]) -> None:
    """Refuse targets this recipe has no kernels for.

    Raises:
        ValueError: a target other than ``reference`` and :data:`GPU_TARGETS`.
    """
    check_recipe_targets("latent-synthetic", targets, ("reference", *GPU_TARGETS))


def assemble_latent(
    model: LatentDeclaration,
    caps: Capacities,
    *,
    gpu_targets: Sequence[str] = (),
    progress: Progress | None = None,
) -> tuple[ct.ServingContract, ManifestBuilder, list[ResourceInput]]:
    """The serving contract, execution manifest and resources of a latent core; every node of the
    operator graph also gets the launches of each of ``gpu_targets``."""
    builder = ManifestBuilder()
    writer = LatentProgramWriter(
        builder,
        model.shape,
        caps,
        model.weights,
        sampled_size=model.sampled_size,
        tokens_per_record=model.tokens_per_record,
        page_offset=model.page_offset,
    )
    graphs = writer.write()
    modules = lower_for_targets(builder, gpu_targets, progress)
    resources = core_resources(builder, model.tokenizer_json, model.chat_template, modules)
    identity = cache_identity(
        resources,
        family=b"latent-attention",
        settings=[f"page_tokens={caps.page_tokens} tokens_per_record={model.tokens_per_record}".encode()],
    )
    contract_model = text_model_contract(model.sampled_size, model.shape.base.vocab, caps.page_tokens)
    region = contract_model.cache.regions.add(
        name="latent", kind=ct.HISTORY_KIND_PAGED_LATENT, tokens_per_record=model.tokens_per_record
    )
    region.planes.extend(plane.buffer for plane in writer.latent_planes)
    contract_model.cache.page_table_views.add(
        buffer="page_table", page_offset=0, region="latent", pages_per_row=caps.pages_per_row
    )
    if writer.latent_table is not None:
        contract_model.cache.page_table_views.add(
            buffer="latent_page_table",
            page_offset=model.page_offset,
            region="latent",
            pages_per_row=caps.pages_per_row,
        )
    contract_model.graphs.extend(graphs)
    contract_model.frontend.CopyFrom(model.frontend or default_frontend())
    contract_model.state_views.extend(decl.state_views(writer.text_caps))
    serving = serving_contract(
        model.served_name,
        identity,
        caps,
        contract_model,
        eos_token_ids=model.eos_token_ids,
        max_output_tokens=model.max_output_tokens,
    )
    return serving, builder, resources


def build_latent_core(
    model: LatentDeclaration,
    out: Path,
    *,
    caps: Capacities,
    signing_key: Ed25519PrivateKey,
    namespace: str,
    layout: Layout = "payload",
    core_key: bytes | None = None,
    targets: Sequence[str] = ("reference",),
    progress: Progress | None = None,
) -> ct.ServingContract:
    """Assemble, validate (with Helios' own contract rules), sign and write a latent core."""
    check_latent_targets(targets)
    gpu_targets = [t for t in targets if t != "reference"]
    serving, builder, resources = assemble_latent(model, caps, gpu_targets=gpu_targets, progress=progress)
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
