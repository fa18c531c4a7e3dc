"""The ``recurrent-synthetic`` recipe: a small gated linear-recurrent language model with seeded weights.

Owns the model's dataflow written as op-catalogue nodes, its shapes (``tiny`` for tests, ``small``),
its seeded weights, and the contract that declares its history as a RECURRENT region: one float32
state row of width D per request and layer, persistent state whose rows the runtime partitions by
request (``state_rows_per_request`` 1). The core has no cache planes and no page tables: the runtime's
pages only count the tokens a request holds.

Each layer, over the residual stream ``h``::

    u = rmsnorm(h, mix_norm)
    s_t = a_t * s_(t-1) + (1 - a_t) * (W_in u_t),   a_t = sigmoid(W_gate u_t)   (per channel, width D)
    h = h + W_out s_t
    h = h + W_down (silu(W_ffn_gate v) * W_ffn_up v),   v = rmsnorm(h, ffn_norm)

then the final norm, the LM head and sampling, as in the Llama recipe. The input-dependent decay
``a_t`` is the gate of a minimal GRU (no reset gate, no hidden-to-hidden matrix), so a whole prompt
chunk is one ``gated_recurrence_scan`` a layer and a decode round one ``gated_recurrence_step``.

Programs: ``initialize`` (sampling state rows, and every recurrent state row of the admitted requests
set to zero), ``prefill_p{P}``, ``mixed_p{P}``, ``resume_p{P}``, ``scored_prefill_p{P}``,
``decode_b{B}``, and with snapshots ``snapshot`` / ``restore``: a snapshot copies the request's
recurrent state rows, pending token and sampling state into continuation rows at its exact consumed
endpoint (the whole committed history: there are no pages to keep), a restore copies them back.

Targets: ``reference`` and ``sm_90a`` (:data:`GPU_TARGETS`); a GPU target gives every node of the same
operator graph its launches (the recurrence kernels are :mod:`ignition.kernels.recurrence`).
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
from ignition.recipes.common import TextProgramWriter
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import (
    CHATML_TEMPLATE,
    byte_level_tokenizer,
    embedding_and_head_weights,
    norm_gain,
    seeded_normal,
)

Weights = Mapping[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class RecurrentShape:
    """Hyperparameters of the gated linear-recurrent decoder."""

    vocab: int
    hidden: int
    layers: int
    state: int
    """D: the recurrence's width (channels of one state row)."""
    ffn: int
    rms_eps: float = 1e-5


SHAPES: dict[str, RecurrentShape] = {
    "tiny": RecurrentShape(vocab=320, hidden=32, layers=2, state=32, ffn=64),
    "small": RecurrentShape(vocab=512, hidden=128, layers=4, state=128, ffn=384),
}


def tensor_names(layer: int) -> dict[str, str]:
    """Array names of one layer."""
    return {
        "mix_norm": f"blk.{layer}.mix_norm.weight",
        "w_gate": f"blk.{layer}.rec_gate.weight",
        "w_in": f"blk.{layer}.rec_in.weight",
        "w_out": f"blk.{layer}.rec_out.weight",
        "ffn_norm": f"blk.{layer}.ffn_norm.weight",
        "ffn_gate": f"blk.{layer}.ffn_gate.weight",
        "ffn_up": f"blk.{layer}.ffn_up.weight",
        "ffn_down": f"blk.{layer}.ffn_down.weight",
    }


def random_weights(shape: RecurrentShape, seed: int) -> dict[str, npt.NDArray[np.float32]]:
    """Seeded weights (one sequential stream of standard normals, in this order; tests pin the tokens)."""
    normal = seeded_normal(seed)
    h, d, f = shape.hidden, shape.state, shape.ffn
    weights = embedding_and_head_weights(normal, shape.vocab, h)
    for layer in range(shape.layers):
        names = tensor_names(layer)
        weights[names["mix_norm"]] = norm_gain(normal, h)
        weights[names["w_gate"]] = normal(d, h, scale=2.0 * h**-0.5)
        weights[names["w_in"]] = normal(d, h, scale=h**-0.5)
        weights[names["w_out"]] = normal(h, d, scale=d**-0.5)
        weights[names["ffn_norm"]] = norm_gain(normal, h)
        weights[names["ffn_gate"]] = normal(f, h, scale=h**-0.5)
        weights[names["ffn_up"]] = normal(f, h, scale=h**-0.5)
        weights[names["ffn_down"]] = normal(h, f, scale=f**-0.5)
    return weights


def recurrent_view(layer: int) -> str:
    """The state view of layer ``layer``'s recurrent state rows."""
    return f"recurrent_state_l{layer}"


def token_bindings(*, host_tokens: bool) -> list[ct.ValueBinding]:
    """Positions and lane membership of packed tokens (and the host's tokens when fed): no page table
    or cache slots, the history lives in state rows."""
    found = [
        binding("positions", ct.VALUE_SOURCE_PROMPT_POSITIONS, decl.PACKED, padding=0),
        binding("token_rows", ct.VALUE_SOURCE_TOKEN_ROW, decl.PACKED, padding=-1),
    ]
    if host_tokens:
        found.insert(0, binding("input_ids", ct.VALUE_SOURCE_PROMPT_TOKENS, decl.PACKED, padding=0))
    return found


def state_copy_bindings(row_source: int, row_destination: str) -> list[ct.ValueBinding]:
    """A snapshot's or restore's inputs: the request's state row, its endpoint and the snapshot row."""
    return [
        binding("state_rows", ct.VALUE_SOURCE_LIVE_STATE_ROWS, decl.SUB, padding=-1),
        binding("generation", ct.VALUE_SOURCE_GENERATION, decl.SUB, padding=-1),
        binding(row_destination, row_source, decl.SUB, padding=-1),
        binding("consumed", ct.VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT, decl.SUB, padding=0),
    ]


@dataclass
class _Scratch:
    h: View
    xn: View
    gate: View
    x: View
    mixed: View
    o: View
    ffn_gate: View
    ffn_up: View
    act: View
    last_index: View
    last_h: View
    logits: View
    all_logits: View
    ids: View
    sampled_ids: View | None = None
    """None: the completion record is one id a lane (no speculative programs)."""
    sampled_logprob: View | None = None


class RecurrentProgramWriter(TextProgramWriter):
    """Writes the programs of the recurrent model into a ManifestBuilder."""

    shape: RecurrentShape
    scratch: _Scratch

    def __init__(
        self, builder: ManifestBuilder, shape: RecurrentShape, caps: Capacities, weights: Weights, *, sampled_size: int
    ) -> None:
        if not 0 < sampled_size <= shape.vocab:
            raise ValueError(f"sampled_size {sampled_size} must lie in (0, {shape.vocab}]")
        if caps.speculative_widths or caps.window:
            raise ValueError("the recurrent recipe has no speculative programs and no attention window")
        self.builder, self.shape, self.caps, self.sampled_size = builder, shape, caps, sampled_size
        self.text_caps = decl.TextCapacities(
            max_rows=caps.max_rows,
            max_packed_tokens=max(max(caps.prefill_tokens), max(caps.decode_rows)),
            pages_per_row=1,
            vocab_width=shape.vocab,
            top_logprobs=caps.top_logprobs,
        )
        self.shared = decl.declare_paged_text(builder, self.text_caps)
        self._declare_float_weights(weights, tensor_names)
        self.states = self._state_buffers("recurrent", caps.max_rows, mf.DIM_SYMBOL_STATE_ROWS)
        zeros = np.zeros((caps.max_rows, shape.state), dtype=np.float32)
        self.zero_rows = builder.weight("layout.zero_state", zeros, "constants")
        self.snapshots: decl.SnapshotViews | None = None
        self.continuation: list[View] = []
        if caps.snapshots > 0:
            self.snapshots = decl.declare_snapshots(builder, self.text_caps, caps.snapshots)
            self.continuation = self._state_buffers("continuation", caps.snapshots, mf.DIM_SYMBOL_SNAPSHOT_ROWS)
        self.scratch = self._declare_scratch()

    def _state_buffers(self, group: str, rows: int, leading_symbol: int) -> list[View]:
        """One persistent float32 buffer ``{group}.state{L}`` of ``rows`` state rows a layer."""
        return [
            self.builder.buffer(
                f"{group}.state{layer}",
                mf.BUFFER_ROLE_PERSISTENT_STATE,
                mf.DTYPE_F32,
                [rows, self.shape.state],
                leading_symbol=leading_symbol,
            )
            for layer in range(self.shape.layers)
        ]

    def _declare_scratch(self) -> _Scratch:
        s, c = self.shape, self.caps
        p, b = self.text_caps.max_packed_tokens, c.max_rows

        def buf(name: str, dims: Sequence[int], dtype: int = mf.DTYPE_F32) -> View:
            return self.builder.buffer(f"scratch.{name}", mf.BUFFER_ROLE_SCRATCH, dtype, dims)

        return _Scratch(
            h=buf("h", [p, s.hidden]),
            xn=buf("xn", [p, s.hidden]),
            gate=buf("gate", [p, s.state]),
            x=buf("x", [p, s.state]),
            mixed=buf("mixed", [p, s.state]),
            o=buf("o", [p, s.hidden]),
            ffn_gate=buf("ffn_gate", [p, s.ffn]),
            ffn_up=buf("ffn_up", [p, s.ffn]),
            act=buf("act", [p, s.ffn]),
            last_index=buf("last_index", [b], mf.DTYPE_I32),
            last_h=buf("last_h", [b, s.hidden]),
            logits=buf("logits", [b, s.vocab]),
            all_logits=buf("all_logits", [max(c.prefill_tokens), s.vocab]),
            ids=buf("ids", [b, 1], mf.DTYPE_I32),
        )

    # -- dataflow --------------------------------------------------------------------------------------
    def _decoder(self, prog: ProgramBuilder, rows: int, tokens: int, ids: View, *, packed: bool = True) -> None:
        """Embedding and every layer over ``tokens`` packed tokens of ``rows`` lanes: a packed block per
        lane (``gated_recurrence_scan``) or, with ``packed`` False, one token a lane (``gated_recurrence_step``)."""
        s, sc, sh = self.shape, self.scratch, self.shared
        p = tokens
        h, xn, o = prefix(sc.h, p), prefix(sc.xn, p), prefix(sc.o, p)
        gate, x, mixed = prefix(sc.gate, p), prefix(sc.x, p), prefix(sc.mixed, p)
        fg, fu, act = prefix(sc.ffn_gate, p), prefix(sc.ffn_up, p), prefix(sc.act, p)
        state_rows = prefix(sh.state_rows, rows)
        prog.node("embedding", {"table": self.tok_embd, "ids": ids, "out": h})
        for layer, lw in enumerate(self.layer_weights):
            eps = {"eps": s.rms_eps}
            prog.node("rmsnorm", {"x": h, "weight": lw["mix_norm"], "out": xn}, eps, name=f"l{layer}.mix_norm")
            prog.node("linear", {"x": xn, "weight": lw["w_gate"], "out": gate}, name=f"l{layer}.gate")
            prog.node("linear", {"x": xn, "weight": lw["w_in"], "out": x}, name=f"l{layer}.input")
            if packed:
                prog.node(
                    "gated_recurrence_scan",
                    {
                        "gate": gate,
                        "x": x,
                        "token_row": prefix(sh.token_rows, p),
                        "rows": state_rows,
                        "state": self.states[layer],
                        "out": mixed,
                    },
                    name=f"l{layer}.recurrence",
                )
            else:
                prog.node(
                    "gated_recurrence_step",
                    {"gate": gate, "x": x, "rows": state_rows, "state": self.states[layer], "out": mixed},
                    name=f"l{layer}.recurrence",
                )
            prog.node("linear", {"x": mixed, "weight": lw["w_out"], "out": o}, name=f"l{layer}.out")
            prog.node("add", {"a": h, "b": o, "out": h}, name=f"l{layer}.mix_residual")
            prog.node("rmsnorm", {"x": h, "weight": lw["ffn_norm"], "out": xn}, eps, name=f"l{layer}.ffn_norm")
            prog.node("linear", {"x": xn, "weight": lw["ffn_gate"], "out": fg}, name=f"l{layer}.ffn_gate")
            prog.node("linear", {"x": xn, "weight": lw["ffn_up"], "out": fu}, name=f"l{layer}.ffn_up")
            prog.node("silu_mul", {"gate": fg, "up": fu, "out": act}, name=f"l{layer}.silu_mul")
            prog.node("linear", {"x": act, "weight": lw["ffn_down"], "out": o}, name=f"l{layer}.ffn_down")
            prog.node("add", {"a": h, "b": o, "out": h}, name=f"l{layer}.ffn_residual")

    # -- programs --------------------------------------------------------------------------------------
    def _step_decoder(self, prog: ProgramBuilder, rows: int, ids: View) -> None:
        self._decoder(prog, rows, rows, ids, packed=False)

    def _token_bindings(self, *, host_tokens: bool) -> list[ct.ValueBinding]:
        return token_bindings(host_tokens=host_tokens)

    def _history_accesses(self, mode: int) -> list[ct.StateAccess]:
        """Every layer's recurrent state rows."""
        return [ct.StateAccess(view=recurrent_view(layer), mode=mode) for layer in range(self.shape.layers)]  # type: ignore[arg-type]

    def _initialize_history(self, prog: ProgramBuilder, state_rows: View) -> None:
        """A new request's history starts from zero."""
        for layer, state in enumerate(self.states):
            prog.node(
                "copy_rows",
                {"src": self.zero_rows, "dst_rows": state_rows, "dst": state},
                name=f"l{layer}.reset_state",
            )

    def write(self) -> list[ct.GraphContract]:
        """Write every program; returns their graph contracts."""
        graphs = self._write_generating_programs()
        if self.snapshots is not None:
            graphs.extend(self._snapshot_programs(self.snapshots))
        return graphs

    def _snapshot_programs(self, snap: decl.SnapshotViews) -> list[ct.GraphContract]:
        """``snapshot`` and ``restore``: one request a round, its whole committed state, no sampling."""
        sh = self.shared
        state_row = prefix(sh.state_rows, 1)
        copies = [
            *(
                (f"state{layer}", live, saved)
                for layer, (live, saved) in enumerate(zip(self.states, self.continuation, strict=True))
            ),
            ("pending_tokens", sh.pending_tokens, snap.pending_tokens),
            ("prompt_presence", sh.prompt_presence, snap.prompt_presence),
            ("output_counts", sh.output_counts, snap.output_counts),
        ]
        sampling_views = (decl.PENDING_TOKEN_VIEW, decl.PROMPT_PRESENCE_VIEW, decl.OUTPUT_COUNTS_VIEW)
        graphs: list[ct.GraphContract] = []
        for name, operation, source, rows, mode in (
            (
                "snapshot",
                ct.OPERATION_SNAPSHOT,
                ct.VALUE_SOURCE_SNAPSHOT_DESTINATION,
                snap.snapshot_rows,
                ct.ACCESS_MODE_READ,
            ),
            ("restore", ct.OPERATION_RESTORE, ct.VALUE_SOURCE_RESTORE_SOURCE, snap.restore_rows, ct.ACCESS_MODE_WRITE),
        ):
            prog = ProgramBuilder(name, operation)
            for label, live, saved in copies:
                if operation == ct.OPERATION_SNAPSHOT:
                    args = {"src": live, "src_rows": state_row, "dst_rows": rows, "dst": saved}
                else:
                    args = {"src": saved, "src_rows": rows, "dst_rows": state_row, "dst": live}
                prog.node("copy_rows", args, name=f"{name}_{label}")
            self._completion_copy_lanes(prog, prefix(snap.consumed, 1))
            self.builder.add_program(prog)
            accesses = [ct.StateAccess(view=v, mode=mode) for v in sampling_views] + self._history_accesses(mode)  # type: ignore[arg-type]
            bindings = state_copy_bindings(source, rows.buffer)
            graphs.append(self._graph(name, operation, 1, 1, bindings, accesses, generating=False))
        return graphs

    def state_views(self) -> list[ct.StateView]:
        """The shared sampling-state views and one view of each layer's recurrent state rows."""
        row_bytes = 4 * self.shape.state
        recurrent = [
            ct.StateView(
                name=recurrent_view(layer),
                buffer=state.buffer,
                byte_offset=0,
                row_stride=row_bytes,
                byte_extent=row_bytes,
            )
            for layer, state in enumerate(self.states)
        ]
        return decl.state_views(self.text_caps) + recurrent


@dataclass(frozen=True)
class RecurrentDeclaration:
    """A recurrent core's recipe output before assembly."""

    served_name: str
    shape: RecurrentShape
    weights: Weights
    tokenizer_json: str
    chat_template: str
    sampled_size: int
    eos_token_ids: Sequence[int]
    max_output_tokens: int = 512
    description: str = ""
    frontend: ct.FrontendContract | None = None
    """The frontend the core declares: its tool and reasoning parsers (None: neither; never image inputs)."""


def recurrent_declaration(shape_name: str, *, seed: int = 0) -> RecurrentDeclaration:
    """The declaration of a ``recurrent-synthetic`` core of a named shape.

    Raises:
        ValueError: an unknown shape name.
    """
    if shape_name not in SHAPES:
        raise ValueError(f"unknown recurrent shape {shape_name!r}; known shapes: {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    tokenizer = byte_level_tokenizer()
    return RecurrentDeclaration(
        served_name=f"recurrent-synthetic-{shape_name}",
        shape=shape,
        weights=random_weights(shape, seed),
        tokenizer_json=tokenizer.json,
        chat_template=CHATML_TEMPLATE,
        sampled_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        description=f"Synthetic gated linear-recurrent shape {shape_name!r} with seeded random weights (seed {seed})",
    )


GPU_TARGETS = ("sm_90a",)
"""GPU targets with kernels for every operator of the recurrent programs (``gated_recurrence_scan`` and
``gated_recurrence_step`` in :mod:`ignition.kernels.recurrence`)."""


def check_recurrent_targets(targets: Sequence[str]) -> None:
    """Refuse targets this recipe has no kernels for.

    Raises:
        ValueError: a target other than ``reference`` and :data:`GPU_TARGETS`.
    """
    check_recipe_targets("recurrent-synthetic", targets, ("reference", *GPU_TARGETS))


def assemble_recurrent(
    model: RecurrentDeclaration,
    caps: Capacities,
    *,
    gpu_targets: Sequence[str] = (),
    progress: Progress | None = None,
) -> tuple[ct.ServingContract, ManifestBuilder, list[ResourceInput]]:
    """The serving contract, execution manifest and resources of a recurrent core; every node of the
    operator graph also gets the launches of each of ``gpu_targets``."""
    builder = ManifestBuilder()
    writer = RecurrentProgramWriter(builder, model.shape, caps, model.weights, sampled_size=model.sampled_size)
    graphs = writer.write()
    modules = lower_for_targets(builder, gpu_targets, progress)
    resources = core_resources(builder, model.tokenizer_json, model.chat_template, modules)
    contract_model = text_model_contract(model.sampled_size, model.shape.vocab, caps.page_tokens)
    recurrent = contract_model.cache.regions.add(name="recurrent", kind=ct.HISTORY_KIND_RECURRENT)
    recurrent.planes.extend(state.buffer for state in writer.states)
    if writer.continuation:  # snapshot rows: the recurrent state at an exact endpoint (no partial pages)
        continuation = contract_model.cache.regions.add(name="continuation", kind=ct.HISTORY_KIND_CONTINUATION)
        continuation.planes.extend(row.buffer for row in writer.continuation)
    contract_model.graphs.extend(graphs)
    contract_model.frontend.CopyFrom(model.frontend or default_frontend())
    contract_model.state_views.extend(writer.state_views())
    serving = serving_contract(
        model.served_name,
        cache_identity(resources, family=b"gated-linear-recurrence"),
        caps,
        contract_model,
        eos_token_ids=model.eos_token_ids,
        max_output_tokens=model.max_output_tokens,
    )
    return serving, builder, resources


def build_recurrent_core(
    model: RecurrentDeclaration,
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
    """Assemble, validate (with Helios' own contract rules), sign and write a recurrent core."""
    check_recurrent_targets(targets)
    gpu_targets = [t for t in targets if t != "reference"]
    serving, builder, resources = assemble_recurrent(model, caps, gpu_targets=gpu_targets, progress=progress)
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
