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
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_core.container.writer import ResourceInput, write_core
from helios_core.contract import EXPORTED_CONTRACT_VERSION, prepare_contract
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf
from ignition import __version__ as toolkit_version
from ignition.preparation import contract as decl
from ignition.preparation.program import ManifestBuilder, ProgramBuilder, View, binding, prefix
from ignition.recipes.llama import Capacities
from ignition.recipes.synthetic import CHATML_TEMPLATE, byte_level_tokenizer

Weights = Mapping[str, npt.NDArray[np.float32]]
Progress = Callable[[str, int, int], None]

RECURRENT_TARGETS = ("reference",)
"""Targets this recipe builds kernels for."""


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
    rng = np.random.default_rng(seed)

    def normal(*dims: int, scale: float) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    h, d, f = shape.hidden, shape.state, shape.ffn
    weights = {
        "token_embd.weight": normal(shape.vocab, h, scale=1.0),
        "output_norm.weight": (1.0 + normal(h, scale=0.05)).astype(np.float32),
        "output.weight": normal(shape.vocab, h, scale=h**-0.5),
    }
    for layer in range(shape.layers):
        names = tensor_names(layer)
        weights[names["mix_norm"]] = (1.0 + normal(h, scale=0.05)).astype(np.float32)
        weights[names["w_gate"]] = normal(d, h, scale=2.0 * h**-0.5)
        weights[names["w_in"]] = normal(d, h, scale=h**-0.5)
        weights[names["w_out"]] = normal(h, d, scale=d**-0.5)
        weights[names["ffn_norm"]] = (1.0 + normal(h, scale=0.05)).astype(np.float32)
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


class RecurrentProgramWriter:
    """Writes the programs of the recurrent model into a ManifestBuilder."""

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
        self._declare_weights(weights)
        state = mf.BUFFER_ROLE_PERSISTENT_STATE
        self.states = [
            builder.buffer(
                f"recurrent.state{layer}",
                state,
                mf.DTYPE_F32,
                [caps.max_rows, shape.state],
                leading_symbol=mf.DIM_SYMBOL_STATE_ROWS,
            )
            for layer in range(shape.layers)
        ]
        zeros = np.zeros((caps.max_rows, shape.state), dtype=np.float32)
        self.zero_rows = builder.weight("layout.zero_state", zeros, "constants")
        self.snapshots: decl.SnapshotViews | None = None
        self.continuation: list[View] = []
        if caps.snapshots > 0:
            self.snapshots = decl.declare_snapshots(builder, self.text_caps, caps.snapshots)
            self.continuation = [
                builder.buffer(
                    f"continuation.state{layer}",
                    state,
                    mf.DTYPE_F32,
                    [caps.snapshots, shape.state],
                    leading_symbol=mf.DIM_SYMBOL_SNAPSHOT_ROWS,
                )
                for layer in range(shape.layers)
            ]
        self.scratch = self._declare_scratch()

    def _declare_weights(self, weights: Weights) -> None:
        w = self.builder.weight
        self.tok_embd = w("tok_embd", weights["token_embd.weight"], "weights.embed")
        self.layer_weights: list[dict[str, View]] = []
        for layer in range(self.shape.layers):
            names = tensor_names(layer)
            self.layer_weights.append(
                {key: w(name, weights[name], f"weights.layer{layer}") for key, name in names.items()}
            )
        self.out_norm = w("output_norm.weight", weights["output_norm.weight"], "weights.head")
        self.lm_head = w("output.weight", weights["output.weight"], "weights.head")

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
    def _decoder(self, prog: ProgramBuilder, rows: int, tokens: int, ids: View, *, packed: bool) -> None:
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

    def _sample_and_complete(self, prog: ProgramBuilder, rows: int, tokens: int) -> None:
        """Final norm and LM head on each lane's last token, sampling, pending token, completion record."""
        s, sh, sc = self.shape, self.shared, self.scratch
        r = rows
        last_index, last_h, logits = prefix(sc.last_index, r), prefix(sc.last_h, r), prefix(sc.logits, r)
        ids = prefix(sh.out_sampled_ids, r)
        prog.node("lane_last_index", {"query_length": prefix(sh.query_length, r), "out": last_index})
        prog.node("gather_rows", {"x": prefix(sc.h, tokens), "index": last_index, "out": last_h})
        prog.node(
            "rmsnorm", {"x": last_h, "weight": self.out_norm, "out": last_h}, {"eps": s.rms_eps}, name="final_norm"
        )
        prog.node("linear", {"x": last_h, "weight": self.lm_head, "out": logits}, name="lm_head")
        settings = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty")
        prog.node(
            "sample",
            {
                "logits": logits,
                **{name: prefix(getattr(sh, name), r) for name in (*settings, "presence_penalty")},
                "prompt_presence": sh.prompt_presence,
                "output_counts": sh.output_counts,
                "rows": prefix(sh.state_rows, r),
                "seed": prefix(sh.seed, r),
                "step": prefix(sh.sampling_step, r),
                "active": prefix(sh.sample_active, r),
                "allowed_mask": prefix(sh.grammar_mask, r),
                "constrained": prefix(sh.constrained, r),
                "ids": ids,
                "logprob": prefix(sh.out_logprobs, r),
                "top_ids": prefix(sh.out_top_ids, r),
                "top_logprobs": prefix(sh.out_top_logprobs, r),
            },
            {"vocab_limit": self.sampled_size, "top_n": self.caps.top_logprobs},
        )
        prog.node(
            "copy_rows",
            {
                "src": ids,
                "dst_rows": prefix(sh.state_rows, r),
                "when": prefix(sh.sample_active, r),
                "dst": sh.pending_tokens,
            },
            name="store_pending_token",
        )
        prog.node(
            "completion_lanes",
            {
                "generation": prefix(sh.generation, r),
                "sample_active": prefix(sh.sample_active, r),
                "last_index": last_index,
                "positions": prefix(sh.positions, tokens),
                "submission_sequence": sh.submission_sequence,
                "out_generation": prefix(sh.out_generation, r),
                "out_emitted": prefix(sh.out_emitted, r),
                "out_consumed": prefix(sh.out_consumed, r),
                "out_draft_cursor": prefix(sh.out_draft_cursor, r),
                "out_reserved": prefix(sh.out_reserved, r),
                "out_sequence": sh.out_sequence,
            },
        )

    def _prompt_scores(self, prog: ProgramBuilder, tokens: int) -> None:
        sh, sc = self.shared, self.scratch
        all_logits, normed = prefix(sc.all_logits, tokens), prefix(sc.xn, tokens)
        eps = {"eps": self.shape.rms_eps}
        prog.node(
            "rmsnorm", {"x": prefix(sc.h, tokens), "weight": self.out_norm, "out": normed}, eps, name="score_norm"
        )
        prog.node("linear", {"x": normed, "weight": self.lm_head, "out": all_logits}, name="score_head")
        prog.node(
            "log_softmax_gather",
            {
                "logits": all_logits,
                "targets": prefix(sh.score_targets, tokens),
                "out": prefix(sh.out_prompt_scores, tokens),
            },
            {"vocab_limit": self.sampled_size},
        )

    # -- programs --------------------------------------------------------------------------------------
    def _recurrent_accesses(self, mode: int) -> list[ct.StateAccess]:
        return [ct.StateAccess(view=recurrent_view(layer), mode=mode) for layer in range(self.shape.layers)]  # type: ignore[arg-type]

    def _graph(
        self,
        name: str,
        operation: int,
        rows: int,
        tokens: int,
        bindings: list[ct.ValueBinding],
        accesses: list[ct.StateAccess],
        *,
        generating: bool = True,
        pending: bool = False,
    ) -> ct.GraphContract:
        graph = ct.GraphContract(name=name, operation=operation)  # type: ignore[arg-type]
        graph.bindings.extend(bindings)
        graph.state_accesses.extend(accesses)
        graph.extents.batch_capacity = rows
        graph.extents.token_capacity = 1 if operation == ct.OPERATION_DECODE else tokens
        graph.extents.packed_token_capacity = tokens
        graph.state_rows_per_request = 1
        graph.resource_dependencies.extend(sorted(self.builder.weight_resources))
        if generating:
            graph.rng_reservations.extend(decl.target_rng())
            graph.logprobs.sampled = True
            graph.logprobs.top_n = self.caps.top_logprobs
        if pending:
            graph.pending_token.CopyFrom(ct.PendingTokenSource(state_view=decl.PENDING_TOKEN_VIEW))
        return graph

    def write(self) -> list[ct.GraphContract]:
        """Write every program; returns their graph contracts."""
        caps, sh = self.caps, self.shared
        b = caps.max_rows
        graphs: list[ct.GraphContract] = []

        init = ProgramBuilder("initialize", ct.OPERATION_INITIALIZE)
        state_rows = prefix(sh.state_rows, b)
        init.node(
            "init_sampling_state",
            {
                "prompt_histogram": prefix(sh.prompt_histogram, b),
                "rows": state_rows,
                "prompt_presence": sh.prompt_presence,
                "output_counts": sh.output_counts,
            },
        )
        for layer, state in enumerate(self.states):  # a new request's history starts from zero
            init.node(
                "copy_rows",
                {"src": self.zero_rows, "dst_rows": state_rows, "dst": state},
                name=f"l{layer}.reset_state",
            )
        self.builder.add_program(init)
        graphs.append(
            self._graph(
                "initialize",
                ct.OPERATION_INITIALIZE,
                b,
                b,
                decl.admission_bindings(),
                [
                    ct.StateAccess(view=decl.PROMPT_PRESENCE_VIEW, mode=ct.ACCESS_MODE_WRITE),
                    ct.StateAccess(view=decl.OUTPUT_COUNTS_VIEW, mode=ct.ACCESS_MODE_WRITE),
                    *self._recurrent_accesses(ct.ACCESS_MODE_WRITE),
                ],
                generating=False,
            )
        )

        generating = decl.sampling_state_accesses() + self._recurrent_accesses(ct.ACCESS_MODE_READ_WRITE)
        host_fed = decl.lane_bindings() + token_bindings(host_tokens=True) + decl.sampling_bindings()
        for tokens in caps.prefill_tokens:
            for operation, label in (
                (ct.OPERATION_PREFILL, "prefill"),
                (ct.OPERATION_MIXED, "mixed"),
                (ct.OPERATION_RESUME, "resume"),
                (ct.OPERATION_SCORED_PREFILL, "scored_prefill"),
            ):
                name = f"{label}_p{tokens}"
                prog = ProgramBuilder(name, operation)
                self._decoder(prog, b, tokens, prefix(sh.input_ids, tokens), packed=True)
                bindings = list(host_fed)
                if operation == ct.OPERATION_SCORED_PREFILL:
                    self._prompt_scores(prog, tokens)
                    bindings.append(
                        binding("score_targets", ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS, decl.PACKED, padding=-1)
                    )
                self._sample_and_complete(prog, b, tokens)
                self.builder.add_program(prog)
                graphs.append(self._graph(name, operation, b, tokens, bindings, generating))

        for rows in caps.decode_rows:
            name = f"decode_b{rows}"
            prog = ProgramBuilder(name, ct.OPERATION_DECODE)
            ids = prefix(self.scratch.ids, rows)
            prog.node(
                "gather_rows",
                {"x": sh.pending_tokens, "index": prefix(sh.state_rows, rows), "out": ids},
                name="load_pending_token",
            )
            self._decoder(prog, rows, rows, View(ids.buffer, (rows,)), packed=False)
            self._sample_and_complete(prog, rows, rows)
            self.builder.add_program(prog)
            bindings = decl.lane_bindings() + token_bindings(host_tokens=False) + decl.sampling_bindings()
            graphs.append(self._graph(name, ct.OPERATION_DECODE, rows, rows, bindings, generating, pending=True))
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
            prog.node(
                "completion_copy_lanes",
                {
                    "generation": prefix(sh.generation, 1),
                    "consumed": prefix(snap.consumed, 1),
                    "submission_sequence": sh.submission_sequence,
                    "out_generation": prefix(sh.out_generation, 1),
                    "out_emitted": prefix(sh.out_emitted, 1),
                    "out_consumed": prefix(sh.out_consumed, 1),
                    "out_draft_cursor": prefix(sh.out_draft_cursor, 1),
                    "out_reserved": prefix(sh.out_reserved, 1),
                    "out_sequence": sh.out_sequence,
                },
            )
            self.builder.add_program(prog)
            accesses = [ct.StateAccess(view=v, mode=mode) for v in sampling_views] + self._recurrent_accesses(mode)  # type: ignore[arg-type]
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
        eos_token_ids=[tokenizer.special_ids["<|im_end|>"], tokenizer.special_ids["<|endoftext|>"]],
        description=f"Synthetic gated linear-recurrent shape {shape_name!r} with seeded random weights (seed {seed})",
    )


def check_recurrent_targets(targets: Sequence[str]) -> None:
    """Refuse targets this recipe has no kernels for.

    Raises:
        ValueError: a target outside :data:`RECURRENT_TARGETS`.
    """
    unsupported = [t for t in targets if t not in RECURRENT_TARGETS]
    if unsupported:
        raise ValueError(
            f"recurrent-synthetic is built for the targets {', '.join(RECURRENT_TARGETS)} only; "
            f"build without {', '.join(unsupported)}"
        )


def assemble_recurrent(
    model: RecurrentDeclaration, caps: Capacities
) -> tuple[ct.ServingContract, ManifestBuilder, list[ResourceInput]]:
    """The serving contract, execution manifest and resources of a recurrent core (reference target)."""
    builder = ManifestBuilder()
    writer = RecurrentProgramWriter(builder, model.shape, caps, model.weights, sampled_size=model.sampled_size)
    graphs = writer.write()
    resources = [
        ResourceInput(id=rid, kind=cb.RESOURCE_KIND_WEIGHTS, data=res.payload())
        for rid, res in sorted(builder.weight_resources.items())
    ]
    resources.append(ResourceInput(id="tokenizer", kind=cb.RESOURCE_KIND_TOKENIZER, data=model.tokenizer_json.encode()))
    resources.append(
        ResourceInput(id="chat_template", kind=cb.RESOURCE_KIND_CHAT_TEMPLATE, data=model.chat_template.encode())
    )
    identity = hashlib.sha256(b"gated-linear-recurrence")
    for resource in resources:
        identity.update(resource.id.encode())
        identity.update(hashlib.sha256(resource.data).digest())

    shape = model.shape
    contract_model = ct.ModelContract(version=EXPORTED_CONTRACT_VERSION)
    contract_model.vocabulary.sampled_size = model.sampled_size
    contract_model.vocabulary.logits_width = shape.vocab
    contract_model.vocabulary.histogram_width = shape.vocab
    contract_model.vocabulary.mask_words = -(-shape.vocab // 32)
    contract_model.input_vocabulary.size = model.sampled_size
    contract_model.cache.page_tokens = caps.page_tokens
    recurrent = contract_model.cache.regions.add(name="recurrent", kind=ct.HISTORY_KIND_RECURRENT)
    recurrent.planes.extend(state.buffer for state in writer.states)
    if writer.continuation:  # snapshot rows: the recurrent state at an exact endpoint (no partial pages)
        continuation = contract_model.cache.regions.add(name="continuation", kind=ct.HISTORY_KIND_CONTINUATION)
        continuation.planes.extend(row.buffer for row in writer.continuation)
    contract_model.graphs.extend(graphs)
    contract_model.frontend.CopyFrom(
        ct.FrontendContract(
            tool_parser=ct.TOOL_PARSER_NONE,
            reasoning_parser=ct.REASONING_PARSER_NONE,
            image_preparation=ct.IMAGE_PREPARATION_NONE,
            image_layout=ct.IMAGE_LAYOUT_NONE,
        )
    )
    contract_model.state_views.extend(writer.state_views())

    serving = ct.ServingContract(
        served_name=model.served_name,
        cache_identity=identity.hexdigest()[:32],
        context_tokens=caps.context,
        prefill_tokens=max(caps.prefill_tokens),
        page_capacity=caps.cache_pages,
        snapshot_capacity=caps.snapshots,
        max_concurrency=caps.max_rows,
    )
    serving.defaults.max_output_tokens = model.max_output_tokens
    serving.defaults.eos_token_ids.extend(model.eos_token_ids)
    serving.model.CopyFrom(contract_model)
    return serving, builder, resources


def build_recurrent_core(
    model: RecurrentDeclaration,
    out: Path,
    *,
    caps: Capacities,
    signing_key: Ed25519PrivateKey,
    namespace: str,
    layout: Literal["payload", "logical-v6", "logical-v4"] = "payload",
    core_key: bytes | None = None,
    targets: Sequence[str] = ("reference",),
    progress: Progress | None = None,
) -> ct.ServingContract:
    """Assemble, validate (with Helios' own contract rules), sign and write a recurrent core."""
    check_recurrent_targets(targets)
    serving, builder, resources = assemble_recurrent(model, caps)
    prepare_contract(
        serving,
        builder.manifest,
        [cb.ExecutableResource(id=r.id, kind=r.kind, decoded_nbytes=len(r.data)) for r in resources],  # type: ignore[arg-type]
    )
    write_core(
        out,
        namespace=namespace,
        contract=serving,
        execution=builder.manifest,
        resources=resources,
        signing_key=signing_key,
        layout=layout,
        core_key=core_key,
        description=model.description,
        rebuild=cb.RebuildManifest(toolkit_version=toolkit_version),
        progress=progress,
    )
    return serving
