"""Program-writing steps every text recipe shares, whatever its layers and history.

Owns :class:`TextProgramWriter`, the base of the recipes' program writers
(:class:`~ignition.recipes.llama.LlamaProgramWriter`, and through it the latent recipe's;
:class:`~ignition.recipes.recurrent.RecurrentProgramWriter`): the graph contract of a program; the
final norm, LM head, sampling, pending token and completion record of a generating program; prompt
scores; the ``initialize``, prompt (``prefill_p{P}``, ``mixed_p{P}``, ``resume_p{P}``,
``scored_prefill_p{P}``) and ``decode_b{B}`` programs; the completion record of a snapshot or restore;
and the float32 weights of a recipe whose arrays need no packing. A writer supplies its decoder and
the parts that depend on its history (token bindings, state accesses, what ``initialize`` resets)
through the hooks of the class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from helios_core.wire import contract_pb2 as ct
from ignition.preparation import contract as decl
from ignition.preparation.program import ManifestBuilder, ProgramBuilder, View, binding, prefix

if TYPE_CHECKING:
    from ignition.recipes.llama import Capacities

Weights = Mapping[str, npt.NDArray[np.float32]]

PROMPT_PROGRAMS = (
    (ct.OPERATION_PREFILL, "prefill"),
    (ct.OPERATION_MIXED, "mixed"),
    (ct.OPERATION_RESUME, "resume"),
    (ct.OPERATION_SCORED_PREFILL, "scored_prefill"),
)
"""The programs written for every prefill size P (``{label}_p{P}``), in this order."""


class TextShape(Protocol):
    """What the shared steps read of a recipe's shape."""

    @property
    def vocab(self) -> int: ...

    @property
    def layers(self) -> int: ...

    @property
    def rms_eps(self) -> float: ...


class HeadScratch(Protocol):
    """The scratch buffers the shared steps write: the residual stream and its normalised copy [P, H],
    each lane's last token index, hidden state and logits, every packed row's logits, and the
    decode programs' pending ids."""

    h: View
    xn: View
    last_index: View
    last_h: View
    logits: View
    all_logits: View
    ids: View
    sampled_ids: View | None
    """[B, 1] ids a non-speculative program samples when the completion record is wider than one id."""
    sampled_logprob: View | None
    """[B, 1] their logprobs (as ``sampled_ids``)."""


class TextProgramWriter:
    """The program-writing steps the text recipes share; a subclass declares the attributes below in
    its constructor and writes its decoder (:meth:`_decoder`)."""

    builder: ManifestBuilder
    shape: TextShape
    caps: Capacities
    shared: decl.SharedViews
    scratch: HeadScratch
    sampled_size: int
    tok_embd: View
    layer_weights: list[dict[str, View]]
    out_norm: View
    lm_head: View
    record_rows: dict[int, View]
    """Row tables that place results narrower than the completion record in it (see ``_into_record``)."""
    fused: bool = False
    """Whether the programs are kernel graphs (fused final norm and LM head)."""
    host_pending: bool = False
    """Whether the decode programs take each lane's pending token from the host (``input_ids`` bound to
    ``PENDING_TOKEN``) instead of the device's pending-token state."""

    # -- hooks -----------------------------------------------------------------------------------------
    def _decoder(self, prog: ProgramBuilder, rows: int, tokens: int, ids: View) -> None:
        """Embedding and every layer over ``tokens`` packed tokens of ``rows`` lanes, into ``scratch.h``."""
        raise NotImplementedError

    def _step_decoder(self, prog: ProgramBuilder, rows: int, ids: View) -> None:
        """The decoder of a decode program: one token a lane."""
        self._decoder(prog, rows, rows, ids)

    def _token_bindings(self, *, host_tokens: bool) -> list[ct.ValueBinding]:
        """The packed-token inputs of a generating program (with the host's tokens when it feeds them)."""
        return decl.packed_token_bindings(host_tokens=host_tokens)

    def _history_accesses(self, mode: int) -> list[ct.StateAccess]:
        """The accesses, in ``mode``, to history state beyond the sampling state (none by default)."""
        return []

    def _initialize_history(self, prog: ProgramBuilder, state_rows: View) -> None:
        """Nodes of ``initialize`` that set up the admitted requests' history state (none by default)."""

    # -- declarations ----------------------------------------------------------------------------------
    def _declare_float_weights(self, weights: Weights, layer_names: Callable[[int], dict[str, str]]) -> None:
        """The token embedding, each layer's arrays (``layer_names(layer)``: key to array name) in the
        resource ``weights.layer{L}``, the final norm and the LM head, all stored as float32."""
        w = self.builder.weight
        self.tok_embd = w("tok_embd", weights["token_embd.weight"], "weights.embed")
        self.layer_weights = []
        for layer in range(self.shape.layers):
            names = layer_names(layer)
            self.layer_weights.append(
                {key: w(name, weights[name], f"weights.layer{layer}") for key, name in names.items()}
            )
        self.out_norm = w("output_norm.weight", weights["output_norm.weight"], "weights.head")
        self.lm_head = w("output.weight", weights["output.weight"], "weights.head")

    # -- dataflow --------------------------------------------------------------------------------------
    def _sampling_inputs(self, r: int, rows: View) -> dict[str, View]:
        """The arguments every sampling operator (``sample``, ``sample_verify`` and its sampled form)
        takes for ``r`` lanes: their settings, the penalties' state, state ``rows``, seeds, counters and
        active flags."""
        sh = self.shared
        return {
            "temperature": prefix(sh.temperature, r),
            "top_k": prefix(sh.top_k, r),
            "top_p": prefix(sh.top_p, r),
            "min_p": prefix(sh.min_p, r),
            "repetition_penalty": prefix(sh.repetition_penalty, r),
            "frequency_penalty": prefix(sh.frequency_penalty, r),
            "presence_penalty": prefix(sh.presence_penalty, r),
            "prompt_presence": sh.prompt_presence,
            "output_counts": sh.output_counts,
            "rows": rows,
            "seed": prefix(sh.seed, r),
            "step": prefix(sh.sampling_step, r),
            "active": prefix(sh.sample_active, r),
        }

    def _sample_and_complete(self, prog: ProgramBuilder, rows: int, tokens: int) -> None:
        """Final norm and LM head on each lane's last token, sampling, pending token, completion."""
        s, sh, sc = self.shape, self.shared, self.scratch
        r = rows
        last_index = prefix(sc.last_index, r)
        last_h = prefix(sc.last_h, r)
        logits = prefix(sc.logits, r)
        wide = sc.sampled_ids is not None and sc.sampled_logprob is not None
        # With a record wider than one id a lane, the ids and logprobs go to scratch and then to column 0.
        ids = prefix(sc.sampled_ids, r) if sc.sampled_ids is not None else prefix(sh.out_sampled_ids, r)
        logprob = prefix(sc.sampled_logprob, r) if sc.sampled_logprob is not None else prefix(sh.out_logprobs, r)
        prog.node("lane_last_index", {"query_length": prefix(sh.query_length, r), "out": last_index})
        prog.node("gather_rows", {"x": prefix(sc.h, tokens), "index": last_index, "out": last_h})
        if self.fused:
            prog.node(
                "rmsnorm_linear",
                {"x": last_h, "norm_weight": self.out_norm, "weight": self.lm_head, "out": logits},
                {"eps": s.rms_eps},
                name="lm_head",
            )
        else:
            prog.node(
                "rmsnorm", {"x": last_h, "weight": self.out_norm, "out": last_h}, {"eps": s.rms_eps}, name="final_norm"
            )
            prog.node("linear", {"x": last_h, "weight": self.lm_head, "out": logits}, name="lm_head")
        prog.node(
            "sample",
            {
                "logits": logits,
                **self._sampling_inputs(r, prefix(sh.state_rows, r)),
                "allowed_mask": prefix(sh.grammar_mask, r),
                "constrained": prefix(sh.constrained, r),
                "ids": ids,
                "logprob": logprob,
                "top_ids": prefix(sh.out_top_ids, r),
                "top_logprobs": prefix(sh.out_top_logprobs, r),
            },
            {"vocab_limit": self.sampled_size, "top_n": self.caps.top_logprobs},
        )
        if wide:
            self._into_record(prog, ids, sh.out_sampled_ids, "record_ids")
            self._into_record(prog, logprob, sh.out_logprobs, "record_logprobs")
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

    def _into_record(self, prog: ProgramBuilder, values: View, record: View, name: str) -> None:
        """Copy ``values`` [r, W] (W dividing the record's width R) to the record's first W columns.

        The record [B, R] is viewed as [B x R / W, W]; lane i's row goes to row i x R / W
        (``record_rows[W]``, see :meth:`~ignition.recipes.llama.LlamaProgramWriter._declare_speculative`).
        """
        lanes, width = values.shape
        rows_total, record_width = record.shape
        prog.node(
            "copy_rows",
            {
                "src": values,
                "dst_rows": prefix(self.record_rows[width], lanes),
                "dst": View(record.buffer, (rows_total * record_width // width, width)),
            },
            name=name,
        )

    def _prompt_scores(self, prog: ProgramBuilder, tokens: int) -> None:
        """Final norm and LM head over every packed row, then each row's log-probability of its target."""
        sh, sc = self.shared, self.scratch
        all_logits = prefix(sc.all_logits, tokens)
        self._norm_and_head(prog, tokens, all_logits, "score_norm", "score_head")
        prog.node(
            "log_softmax_gather",
            {
                "logits": all_logits,
                "targets": prefix(sh.score_targets, tokens),
                "out": prefix(sh.out_prompt_scores, tokens),
            },
            {"vocab_limit": self.sampled_size},
        )

    def _norm_and_head(self, prog: ProgramBuilder, tokens: int, logits: View, norm_name: str, head_name: str) -> None:
        """The final norm and LM head over the first ``tokens`` rows of the residual stream into ``logits``:
        one fused node named ``head_name`` in a kernel graph, else RMSNorm into ``scratch.xn`` (named
        ``norm_name``) and the head's linear (``head_name``)."""
        s, sc = self.shape, self.scratch
        if self.fused:
            prog.node(
                "rmsnorm_linear",
                {"x": prefix(sc.h, tokens), "norm_weight": self.out_norm, "weight": self.lm_head, "out": logits},
                {"eps": s.rms_eps},
                name=head_name,
            )
            return
        normed = prefix(sc.xn, tokens)
        prog.node(
            "rmsnorm",
            {"x": prefix(sc.h, tokens), "weight": self.out_norm, "out": normed},
            {"eps": s.rms_eps},
            name=norm_name,
        )
        prog.node("linear", {"x": normed, "weight": self.lm_head, "out": logits}, name=head_name)

    def _completion_copy_lanes(self, prog: ProgramBuilder, consumed: View) -> None:
        """The completion record of a snapshot or restore: one lane, its endpoint ``consumed`` [1]."""
        sh = self.shared
        prog.node(
            "completion_copy_lanes",
            {
                "generation": prefix(sh.generation, 1),
                "consumed": consumed,
                "submission_sequence": sh.submission_sequence,
                "out_generation": prefix(sh.out_generation, 1),
                "out_emitted": prefix(sh.out_emitted, 1),
                "out_consumed": prefix(sh.out_consumed, 1),
                "out_draft_cursor": prefix(sh.out_draft_cursor, 1),
                "out_reserved": prefix(sh.out_reserved, 1),
                "out_sequence": sh.out_sequence,
            },
        )

    # -- programs --------------------------------------------------------------------------------------
    def _graph(
        self,
        name: str,
        operation: int,
        rows: int,
        tokens: int,
        bindings: list[ct.ValueBinding],
        accesses: list[ct.StateAccess],
        *,
        pending: bool = False,
        generating: bool = True,
    ) -> ct.GraphContract:
        """The graph contract of a program of ``rows`` lanes and ``tokens`` packed tokens: a generating
        program reserves the target's random draws and reports logprobs; with ``pending`` each lane's
        first token is the device-owned pending token."""
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

    def _write_generating_programs(self) -> list[ct.GraphContract]:
        """Write ``initialize``, the prompt programs of every prefill size and ``decode_b{B}`` of every
        decode row count; returns their graph contracts."""
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
        self._initialize_history(init, state_rows)
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
                    *self._history_accesses(ct.ACCESS_MODE_WRITE),
                ],
                generating=False,
            )
        )

        generating = decl.sampling_state_accesses() + self._history_accesses(ct.ACCESS_MODE_READ_WRITE)
        host_fed = decl.lane_bindings() + self._token_bindings(host_tokens=True) + decl.sampling_bindings()
        for tokens in caps.prefill_tokens:
            for operation, label in PROMPT_PROGRAMS:
                name = f"{label}_p{tokens}"
                prog = ProgramBuilder(name, operation)
                self._decoder(prog, b, tokens, prefix(sh.input_ids, tokens))
                bindings = list(host_fed)
                if operation == ct.OPERATION_SCORED_PREFILL:
                    self._prompt_scores(prog, tokens)
                    bindings.append(
                        binding("score_targets", ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS, decl.PACKED, padding=-1)
                    )
                self._sample_and_complete(prog, b, tokens)
                self.builder.add_program(prog)
                graphs.append(self._graph(name, operation, b, tokens, bindings, generating))

        device_fed = decl.lane_bindings() + self._token_bindings(host_tokens=False) + decl.sampling_bindings()
        for rows in caps.decode_rows:
            name = f"decode_b{rows}"
            prog = ProgramBuilder(name, ct.OPERATION_DECODE)
            if self.host_pending:
                self._step_decoder(prog, rows, prefix(sh.input_ids, rows))
            else:
                ids = prefix(self.scratch.ids, rows)
                prog.node(
                    "gather_rows",
                    {"x": sh.pending_tokens, "index": prefix(sh.state_rows, rows), "out": ids},
                    name="load_pending_token",
                )
                self._step_decoder(prog, rows, View(ids.buffer, (rows,)))
            self._sample_and_complete(prog, rows, rows)
            self.builder.add_program(prog)
            if self.host_pending:
                fed = [*device_fed, binding("input_ids", ct.VALUE_SOURCE_PENDING_TOKEN, decl.PACKED, padding=0)]
                graph = self._graph(name, ct.OPERATION_DECODE, rows, rows, fed, generating)
                graph.pending_token.binding_destination = "input_ids"
                graphs.append(graph)
            else:
                graphs.append(self._graph(name, ct.OPERATION_DECODE, rows, rows, device_fed, generating, pending=True))
        return graphs
