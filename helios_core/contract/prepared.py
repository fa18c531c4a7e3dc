"""PreparedContract: the decoded, validated serving contract and execution manifest.

Owns the rules that make a core's declaration consistent: versions, enum
identifiers, vocabulary geometry, cache and state views, value bindings
against the transport, speculative extents, tuned bindings, the agreement of
graph contracts with the execution catalog, and operator versions. Nothing
here knows a model family: every check is about geometry or dataflow.

Two levels of checking:

* :func:`prepare_contract` checks that the declaration is consistent. An
  inconsistent core raises :class:`~helios_core.errors.ContractError`.
* :func:`check_runtime_support` checks that this runtime implements what the
  core declares (history kinds, operations, operators, rank count); the first
  unimplemented feature raises
  :class:`~helios_core.errors.UnsupportedFeatureError` naming it. Startup runs
  both; ``helios verify`` runs the first.

Contract versions (see ``docs/contract.md``): version 1 has no speculative
programs, tuned bindings or prefix-boundary rules, and may leave the
histogram and mask geometry and every packed-token capacity implicit; version
2 adds speculative generation, confidence and tuned bindings; version 3 adds
prefix-boundary rules and completion-cursor lag and requires every
packed-token capacity to be explicit. Implicit values default as documented
on :func:`_effective_extents` and :func:`_vocabulary_geometry`.

Its size: every validation rule of the contract is one function here, in the order the spec lists
them, over one decoded contract; the rules cross-reference each other's derived extents, so they
stay in one module with one decode.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from helios_core.dtypes import FLOAT_DTYPES, INTEGER_DTYPES, NUMPY_DTYPES, dtype_name
from helios_core.errors import ContractError, UnsupportedFeatureError
from helios_core.ops.catalogue import CATALOGUE, known_versions
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

SUPPORTED_CONTRACT_VERSIONS: Final = (1, 2, 3)
"""Semantic contract versions this runtime loads."""

EXPORTED_CONTRACT_VERSION: Final = 3
"""The version exporters write."""

THIRD_PARTY_IDENTIFIERS: Final = range(100_000, 200_000)
"""Frontend identifier numbers reserved for third-party plugins."""

GENERATING_OPERATIONS: Final = frozenset(
    {
        ct.OPERATION_PREFILL,
        ct.OPERATION_SCORED_PREFILL,
        ct.OPERATION_RESUME,
        ct.OPERATION_DECODE,
        ct.OPERATION_SPECULATIVE,
        ct.OPERATION_MIXED,
    }
)
"""Operations that sample a token and therefore produce the pending token."""

REQUIRED_OPERATIONS: Final = (ct.OPERATION_INITIALIZE, ct.OPERATION_PREFILL, ct.OPERATION_DECODE)
"""Operations every core has a program of: the scheduler runs ``initialize`` as the first round of every
admitted request (it resets the request's state rows: sampling state, prompt histogram, recurrent
state), then prefills its prompt and decodes (``docs/runtime-design.md``, Scheduling)."""

INPUT_ID_SOURCES: Final = frozenset(
    {
        ct.VALUE_SOURCE_PROMPT_TOKENS,
        ct.VALUE_SOURCE_SCORED_PREFILL_TARGETS,
        ct.VALUE_SOURCE_PENDING_TOKEN,
        ct.VALUE_SOURCE_CANDIDATE_IDS,
    }
)
"""Sources whose values are ids of a request's tokens, each anywhere in the input vocabulary (prompt ids,
the completed pending token, proposals copied from the history)."""

FLOAT_SOURCES: Final = frozenset(
    {
        ct.VALUE_SOURCE_TEMPERATURE,
        ct.VALUE_SOURCE_TOP_P,
        ct.VALUE_SOURCE_MIN_P,
        ct.VALUE_SOURCE_REPETITION_PENALTY,
        ct.VALUE_SOURCE_FREQUENCY_PENALTY,
        ct.VALUE_SOURCE_PRESENCE_PENALTY,
    }
)
"""Sources whose values are floating point; every other non-image source is integral."""

COMPLETION_FED_SOURCES: Final = frozenset(
    {
        ct.VALUE_SOURCE_PENDING_TOKEN,
        ct.VALUE_SOURCE_CANDIDATE_IDS,
        ct.VALUE_SOURCE_CANDIDATE_COUNT,
        ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS,
    }
)
"""Sources whose values are the tokens an earlier round sampled (the completed pending token, proposals
copied from the history): the host knows them only once that round's completion record is read."""

IMAGE_SOURCES: Final = frozenset(
    {
        ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES,
        ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES,
        ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT,
        ct.VALUE_SOURCE_IMAGE_TENSOR,
    }
)
"""Sources that need a selected image layout."""

IMAGE_SOURCE_INDEXING: Final[Mapping[int, frozenset[int]]] = MappingProxyType(
    {
        ct.VALUE_SOURCE_IMAGE_TENSOR: frozenset({ct.INDEXING_SCALAR}),
        ct.VALUE_SOURCE_IMAGE_FEATURE_INDICES: frozenset({ct.INDEXING_PACKED_TOKEN}),
        ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES: frozenset({ct.INDEXING_SCALAR}),
        ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT: frozenset({ct.INDEXING_SUBMISSION_ROW, ct.INDEXING_ACTIVE_ROW}),
    }
)
"""The indexing each image source is packed with (``docs/contract.md``)."""

IMAGE_OPERATIONS: Final = frozenset(
    {ct.OPERATION_PREFILL, ct.OPERATION_SCORED_PREFILL, ct.OPERATION_RESUME, ct.OPERATION_MIXED}
)
"""Operations whose rounds compute prompt tokens, so may carry images."""

LENGTH_SOURCES: Final = frozenset({ct.VALUE_SOURCE_QUERY_LENGTH, ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT})

PAGED_HISTORY_KINDS: Final = frozenset({ct.HISTORY_KIND_PAGED_KV, ct.HISTORY_KIND_PAGED_LATENT})

PAGED_PLANE_KINDS: Final[Mapping[int, str]] = MappingProxyType(
    {
        ct.HISTORY_KIND_PAGED_KV: "paged-kv",
        ct.HISTORY_KIND_PAGED_LATENT: "paged-latent",
        ct.HISTORY_KIND_SLIDING_WINDOW: "sliding-window",
    }
)
"""History kinds whose planes are paged (``[CACHE_PAGES, records a page, ...]``), each with the name its
plane messages use."""


def _tool_families() -> Mapping[int, str | None]:
    """Each built-in tool parser and the ``ToolSyntax.family`` field its enum name spells
    (``TOOL_PARSER_X`` reads ``tool_syntax.x``), or ``None`` when no field is spelled (``NONE``)."""
    fields = {descriptor.name for descriptor in ct.ToolSyntax.DESCRIPTOR.oneofs_by_name["family"].fields}
    table: dict[int, str | None] = {}
    for value in ct.ToolParser.values():
        if value != ct.TOOL_PARSER_UNSPECIFIED:
            spelled = ct.ToolParser.Name(value).removeprefix("TOOL_PARSER_").lower()
            table[value] = spelled if spelled in fields else None
    return MappingProxyType(table)


TOOL_FAMILY_OF_PARSER: Final[Mapping[int, str | None]] = _tool_families()
"""The ToolSyntax family each built-in tool parser reads, read from the contract schema."""

REQUIRED_TOOL_PARSER: Final[Mapping[int, int]] = MappingProxyType(
    {
        ct.REASONING_PARSER_XTML_THINK: ct.TOOL_PARSER_XTML,
        ct.REASONING_PARSER_RECIPIENT_HEADER: ct.TOOL_PARSER_ATEM,
    }
)
"""Reasoning parsers that only work with one tool parser (they share frames)."""


@dataclass(frozen=True)
class RuntimeCapabilities:
    """What this runtime implements; startup compares the core against it."""

    ranks: int | None = None
    """The most tensor-parallel ranks the chosen backend runs; None: any count (the host runs one thread
    rank per rank of the core: the reference and null backends)."""
    ranks_limit: str = ""
    """Why ``ranks`` is limited (said in the error a core with more ranks gets)."""
    history_kinds: frozenset[int] = frozenset(
        {
            ct.HISTORY_KIND_PAGED_KV,
            ct.HISTORY_KIND_PAGED_LATENT,
            ct.HISTORY_KIND_SLIDING_WINDOW,
            ct.HISTORY_KIND_RECURRENT,
            ct.HISTORY_KIND_CONTINUATION,
        }
    )
    operations: frozenset[int] = frozenset(
        {
            ct.OPERATION_INITIALIZE,
            ct.OPERATION_PREFILL,
            ct.OPERATION_SCORED_PREFILL,
            ct.OPERATION_RESUME,
            ct.OPERATION_DECODE,
            ct.OPERATION_MIXED,
            ct.OPERATION_SNAPSHOT,
            ct.OPERATION_RESTORE,
            ct.OPERATION_SPECULATIVE,
        }
    )
    operators: frozenset[tuple[str, int]] = frozenset(CATALOGUE)
    vision: bool = True
    engram: bool = True


@dataclass(frozen=True)
class GraphExtentsView:
    """A graph's physical extents after version defaults (B, W, P, D)."""

    batch_capacity: int
    token_capacity: int
    packed_token_capacity: int
    draft_tokens: int
    verify_tokens: int
    draft_capacity: int

    @property
    def selectable_width(self) -> int:
        """The widest lane a speculative program can serve: min(D + 1, W)."""
        return min(self.draft_tokens + 1, self.token_capacity)


@dataclass(frozen=True)
class PreparedGraph:
    """One graph contract with its program and derived facts."""

    name: str
    operation: int
    contract: ct.GraphContract
    program: mf.ProgramDecl
    extents: GraphExtentsView
    length_source: int | None
    """QUERY_LENGTH or SPECULATIVE_PREFIX_LIMIT when bound, else None."""
    input_destinations: frozenset[str]
    """Transport entries this graph's own bindings write (completion dependencies derive from these)."""
    page_table_views: tuple[ct.PageTableView, ...] = ()
    """The cache's page-table views over this graph's ``PAGE_TABLE`` destinations, by page offset: each
    places a lane's pages at its own columns of the destination row (packing reads these)."""
    patch_capacity: int = 0
    """Image patches one round of this graph takes: the leading extent of its ``IMAGE_TENSOR``
    destinations (all equal, one of ``vision.patch_capacities``); 0 for a graph that binds no image
    tensor (its rounds carry no image)."""
    feature_capacity: int = 0
    """Image features one round of this graph takes: ``patch_capacity / vision.patches_per_feature``."""

    @property
    def takes_images(self) -> bool:
        """Rounds of this graph may carry images (it binds image tensors)."""
        return self.patch_capacity > 0

    @functools.cached_property
    def completion_dependencies(self) -> frozenset[int]:
        """The value sources of this graph's own bindings that need an earlier round's completion record
        (:data:`COMPLETION_FED_SOURCES`: a host-owned pending token, copied proposals). A round of a graph
        with any is planned only from completed observations: never ahead of the round before it. Derived
        from this graph's inputs alone, never from another operation's."""
        return frozenset(b.source for b in self.contract.bindings if b.source in COMPLETION_FED_SOURCES)

    @property
    def drafts_in_graph(self) -> bool:
        """The graph takes ceilings (SPECULATIVE_PREFIX_LIMIT) and drafts and allocates its prefixes itself,
        rather than verifying proposals the host copies in (QUERY_LENGTH)."""
        return self.length_source == ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT

    @property
    def operation_name(self) -> str:
        """Readable operation name (``decode``, ``prefill``...)."""
        return operation_name(self.operation)


@dataclass(frozen=True)
class PreparedContract:
    """A validated contract. Built only by :func:`prepare_contract`."""

    version: int
    serving: ct.ServingContract
    model: ct.ModelContract
    execution: mf.ExecutionManifest
    graphs: Mapping[str, PreparedGraph]
    buffers: Mapping[str, mf.BufferDecl]
    transport: Mapping[str, mf.TransportEntry]
    state_views: Mapping[str, ct.StateView]
    sampled_size: int
    logits_width: int
    histogram_width: int
    mask_words: int
    ranks: int
    resource_kinds: Mapping[str, int] = field(default_factory=dict)

    def graphs_for(self, operation: int) -> list[PreparedGraph]:
        """Graphs of one operation, smallest batch capacity first."""
        found = [g for g in self.graphs.values() if g.operation == operation]
        return sorted(found, key=lambda g: (g.extents.batch_capacity, g.extents.token_capacity, g.name))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids that end generation."""
        return tuple(self.serving.defaults.eos_token_ids)


def operation_name(operation: int) -> str:
    """Readable name of an Operation value."""
    try:
        return ct.Operation.Name(operation).removeprefix("OPERATION_").lower()  # type: ignore[arg-type]
    except ValueError:
        return f"operation#{operation}"


def _enum_name(enum: object, value: int) -> str:
    try:
        return str(enum.Name(value))  # type: ignore[attr-defined]
    except ValueError:
        return str(value)


class _Problems:
    """Collects contract problems so one error lists all of them."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self) -> None:
        if self.items:
            if len(self.items) == 1:
                raise ContractError(f"invalid contract: {self.items[0]}")
            listing = "; ".join(self.items)
            raise ContractError(f"invalid contract ({len(self.items)} problems): {listing}")


def _dims(shape: Iterable[mf.Dim]) -> list[int]:
    return [int(d.size) for d in shape]


def _buffer_nbytes(buffer: mf.BufferDecl) -> int:
    return math.prod(_dims(buffer.shape)) * NUMPY_DTYPES[buffer.dtype].itemsize


def _vocabulary_geometry(model: ct.ModelContract, problems: _Problems) -> tuple[int, int, int, int]:
    """Sampled size, logits width, histogram width, mask words.

    Version 1 may leave histogram_width and mask_words at 0: they default to
    logits_width and ceil(logits_width / 32). A version-1 logits_width of 0
    defaults to sampled_size.
    """
    vocab = model.vocabulary
    sampled = vocab.sampled_size
    logits = vocab.logits_width
    histogram = vocab.histogram_width
    mask = vocab.mask_words
    if model.version == 1:
        logits = logits or sampled
        histogram = histogram or logits
        mask = mask or -(-logits // 32)
    if sampled <= 0:
        problems.add("vocabulary.sampled_size must be positive")
    if logits < sampled:
        problems.add(f"vocabulary.logits_width {logits} is smaller than sampled_size {sampled}")
    if histogram != logits:
        problems.add(f"vocabulary.histogram_width {histogram} must equal logits_width {logits}")
    if mask != -(-logits // 32):
        problems.add(f"vocabulary.mask_words {mask} must equal ceil(logits_width / 32) = {-(-logits // 32)}")
    return sampled, logits, histogram, mask


def _effective_extents(graph: ct.GraphContract, version: int, problems: _Problems) -> GraphExtentsView:
    """Extents after version defaults.

    Versions 1 and 2 may leave packed_token_capacity at 0 for non-speculative
    programs: it defaults to batch_capacity x token_capacity. Version 3
    requires it explicitly everywhere; speculative programs always declare it.
    A token_capacity of 0 means 1. verify_tokens of 0 means token_capacity.
    """
    ext = graph.extents
    batch = ext.batch_capacity
    tokens = ext.token_capacity or 1
    packed = ext.packed_token_capacity
    is_spec = graph.operation == ct.OPERATION_SPECULATIVE
    if packed == 0:
        if version >= 3 or is_spec:
            problems.add(f"graph {graph.name!r}: packed_token_capacity (P) must be declared explicitly")
        packed = batch * tokens
    if batch <= 0:
        problems.add(f"graph {graph.name!r}: batch_capacity (B) must be positive")
    return GraphExtentsView(
        batch_capacity=batch,
        token_capacity=tokens,
        packed_token_capacity=packed,
        draft_tokens=ext.draft_tokens,
        verify_tokens=ext.verify_tokens or tokens,
        draft_capacity=ext.draft_capacity,
    )


def _known(enum: object, value: int) -> bool:
    """Whether ``value`` is a declared, specified value of ``enum``."""
    return value != 0 and value in enum.values()  # type: ignore[attr-defined]


def _check_identifier(problems: _Problems, what: str, enum: object, value: int) -> None:
    if value == 0:
        problems.add(f"frontend.{what} is unspecified (0); it must name an implementation")
        return
    builtin = value in enum.values()  # type: ignore[attr-defined]
    if not builtin and value not in THIRD_PARTY_IDENTIFIERS:
        problems.add(
            f"frontend.{what} {value} is neither a built-in identifier nor in the third-party range "
            f"{THIRD_PARTY_IDENTIFIERS.start}-{THIRD_PARTY_IDENTIFIERS.stop - 1}"
        )


def _check_frontend(model: ct.ModelContract, problems: _Problems) -> None:
    fe = model.frontend
    _check_identifier(problems, "tool_parser", ct.ToolParser, fe.tool_parser)
    _check_identifier(problems, "reasoning_parser", ct.ReasoningParser, fe.reasoning_parser)
    _check_identifier(problems, "image_preparation", ct.ImagePreparation, fe.image_preparation)
    _check_identifier(problems, "image_layout", ct.ImageLayout, fe.image_layout)

    required = REQUIRED_TOOL_PARSER.get(fe.reasoning_parser)
    if required is not None and fe.tool_parser != required:
        problems.add(
            f"frontend: reasoning parser {_enum_name(ct.ReasoningParser, fe.reasoning_parser)} requires "
            f"tool parser {_enum_name(ct.ToolParser, required)}, "
            f"not {_enum_name(ct.ToolParser, fe.tool_parser)}"
        )
    family = TOOL_FAMILY_OF_PARSER.get(fe.tool_parser, "third-party")
    if family is None and fe.HasField("tool_syntax"):
        problems.add("frontend: tool_syntax is declared but the tool parser is NONE")
    if family not in (None, "third-party"):
        declared = fe.tool_syntax.WhichOneof("family")
        if declared != family:
            problems.add(
                f"frontend: tool parser {_enum_name(ct.ToolParser, fe.tool_parser)} reads "
                f"tool_syntax.{family}, but the core declares {declared or 'no family'}"
            )
        if not fe.tool_syntax.opener:
            problems.add("frontend: tool_syntax.opener must be declared")
    if fe.reasoning_parser == ct.REASONING_PARSER_NONE and fe.HasField("reasoning_syntax"):
        problems.add("frontend: reasoning_syntax is declared but the reasoning parser is NONE")
    rs = fe.reasoning_syntax
    if fe.reasoning_parser in (ct.REASONING_PARSER_THINK_TAGS, ct.REASONING_PARSER_XTML_THINK) and not (
        rs.open and rs.close
    ):
        problems.add("frontend: reasoning_syntax.open and .close must be declared")
    if fe.reasoning_parser == ct.REASONING_PARSER_RECIPIENT_HEADER:
        header = rs.recipient_header
        for name in ("start", "message", "end", "end_of_message", "reasoning_recipient"):
            if not getattr(header, name):
                problems.add(f"frontend: reasoning_syntax.recipient_header.{name} must be declared")
    if rs.terminal_marker and rs.terminal_marker != fe.tool_syntax.opener:
        problems.add(
            f"frontend: reasoning terminal marker {rs.terminal_marker!r} must equal the tool syntax's "
            f"opener {fe.tool_syntax.opener!r}"
        )
    if fe.prefix_boundaries and model.version < 3:
        problems.add(f"frontend.prefix_boundaries needs contract version 3 (core declares {model.version})")
    for rule in fe.prefix_boundaries:
        if not rule.roles or not all(_known(ct.MessageRole, role) for role in rule.roles):
            problems.add("frontend.prefix_boundaries: every rule names one or more known roles")
        if not _known(ct.RenderingConstraint, rule.constraint):
            problems.add("frontend.prefix_boundaries: unknown or unspecified rendering constraint")
    for variable in fe.template_variables:
        try:
            json.loads(variable.json_value)
        except ValueError as exc:
            problems.add(f"frontend.template_variables[{variable.name!r}] is not JSON: {exc}")
    if fe.plugin_parameters_json:
        try:
            parameters = json.loads(fe.plugin_parameters_json)
        except ValueError as exc:
            problems.add(f"frontend.plugin_parameters_json is not JSON: {exc}")
        else:
            if not isinstance(parameters, dict):
                problems.add("frontend.plugin_parameters_json must be a JSON object")
            elif parameters and not any(
                value in THIRD_PARTY_IDENTIFIERS
                for value in (fe.tool_parser, fe.reasoning_parser, fe.image_preparation, fe.image_layout)
            ):
                # Built-in implementations take no plugin parameters, so every key is unknown.
                problems.add(
                    f"frontend.plugin_parameters_json has unknown fields {sorted(parameters)}: no selected "
                    "implementation is a plugin that declares parameters"
                )


def _check_input_vocabulary(model: ct.ModelContract, problems: _Problems) -> None:
    size = model.input_vocabulary.size
    if size <= 0:
        problems.add("input_vocabulary.size must be positive")
    sampled = model.vocabulary.sampled_size
    for sentinel in model.input_vocabulary.image_sentinel_ids:
        if sentinel >= size:
            problems.add(f"input_vocabulary: image sentinel {sentinel} lies outside [0, {size})")
        elif sentinel < sampled:
            problems.add(f"input_vocabulary: image sentinel {sentinel} lies inside the sampled range [0, {sampled})")


def _check_buffers(
    execution: mf.ExecutionManifest,
    resources: Mapping[str, cb.ExecutableResource],
    problems: _Problems,
) -> dict[str, mf.BufferDecl]:
    buffers: dict[str, mf.BufferDecl] = {}
    ranks = max(execution.ranks, 1)
    per_rank = _check_rank_buffers(execution, resources, ranks, problems)
    for buffer in execution.buffers:
        if buffer.name in buffers:
            if ranks == 1:
                problems.add(f"buffer {buffer.name!r} is declared twice")
            continue  # a per-rank name: its declarations were checked together; rank 0's enters the map
        if buffer.name in per_rank and buffer.rank != 0:
            continue  # rank 0's declaration (checked below) stands for the name
        if not _known(mf.BufferRole, buffer.role):
            problems.add(f"buffer {buffer.name!r} has unknown role {buffer.role}")
        if any(d.symbol != mf.DIM_SYMBOL_UNSPECIFIED and d.symbol not in mf.DimSymbol.values() for d in buffer.shape):
            problems.add(f"buffer {buffer.name!r} has an unknown dimension symbol")
        if buffer.dtype not in NUMPY_DTYPES:
            problems.add(f"buffer {buffer.name!r} has unknown dtype {buffer.dtype}")
            continue
        if not buffer.shape or any(d.size == 0 for d in buffer.shape):
            problems.add(f"buffer {buffer.name!r} has an empty shape")
            continue
        # Only well-formed declarations enter the map, so later checks can rely on dtype and shape.
        buffers[buffer.name] = buffer
        needs_resource = buffer.role == mf.BUFFER_ROLE_WEIGHTS
        if needs_resource and not buffer.resource_id:
            problems.add(f"weights buffer {buffer.name!r} names no resource")
        if buffer.resource_id:
            resource = resources.get(buffer.resource_id)
            if resource is None:
                problems.add(f"buffer {buffer.name!r} names unknown resource {buffer.resource_id!r}")
                continue
            expected_kind = (
                cb.RESOURCE_KIND_WEIGHTS if buffer.role == mf.BUFFER_ROLE_WEIGHTS else cb.RESOURCE_KIND_STATE_INIT
            )
            if resource.kind != expected_kind:
                problems.add(
                    f"buffer {buffer.name!r} uses resource {resource.id!r} as "
                    f"{_enum_name(cb.ResourceKind, expected_kind)}, but it is declared "
                    f"{_enum_name(cb.ResourceKind, resource.kind)}"
                )
            end = buffer.resource_offset + _buffer_nbytes(buffer)
            if end > resource.decoded_nbytes:
                problems.add(
                    f"buffer {buffer.name!r} reads bytes up to {end} of resource {resource.id!r}, "
                    f"which decodes to {resource.decoded_nbytes}"
                )
    for module in execution.modules:
        resource = resources.get(module.resource_id)
        if resource is None:
            problems.add(f"module {module.name!r} names unknown resource {module.resource_id!r}")
        elif resource.kind != cb.RESOURCE_KIND_MODULE:
            problems.add(
                f"module {module.name!r} uses resource {resource.id!r} as RESOURCE_KIND_MODULE, but it is "
                f"declared {_enum_name(cb.ResourceKind, resource.kind)}"
            )
    return buffers


_PER_RANK_SAME: Final[tuple[tuple[str, Callable[[mf.BufferDecl], object]], ...]] = (
    ("role", lambda decl: decl.role),
    ("dtype", lambda decl: decl.dtype),
    ("shape", lambda decl: [(d.size, d.symbol) for d in decl.shape]),
)
"""What every rank's declaration of a per-rank buffer must share with rank 0's."""


def _check_rank_buffers(
    execution: mf.ExecutionManifest,
    resources: Mapping[str, cb.ExecutableResource],
    ranks: int,
    problems: _Problems,
) -> frozenset[str]:
    """The tensor-parallel rules of buffer declarations; returns the per-rank names (of a core with more
    than one rank). A name declared once is replicated (rank 0, every rank allocates it); a name declared
    more than once is a per-rank buffer: exactly once for each rank 0..N-1, every declaration with the same
    role, dtype and shape, and only for weights or resource-filled (STATE_INIT) buffers. A resource belongs
    to a rank below N; a per-rank declaration reads a resource of its own rank, a replicated one a
    resource of rank 0 (shared by every rank)."""
    for resource in resources.values():
        if resource.rank >= ranks:
            problems.add(f"resource {resource.id!r} names rank {resource.rank}; the core has {ranks} ranks")
    declarations: dict[str, list[mf.BufferDecl]] = {}
    for buffer in execution.buffers:
        declarations.setdefault(buffer.name, []).append(buffer)
    per_rank: set[str] = set()
    for name, decls in declarations.items():
        out_of_range = sorted({d.rank for d in decls if d.rank >= ranks})
        if out_of_range:
            problems.add(f"buffer {name!r} names rank {out_of_range[0]}; the core has {ranks} ranks")
            continue
        if len(decls) == 1:
            if decls[0].rank != 0:
                problems.add(
                    f"buffer {name!r} is declared once, for rank {decls[0].rank}; a replicated buffer has rank 0 "
                    f"and a per-rank buffer is declared once for each rank 0..{ranks - 1}"
                )
            else:
                _check_rank_resource(decls[0], resources, 0, problems)
            continue
        if ranks == 1:
            continue  # "declared twice", reported with the other declaration problems
        declared = sorted(d.rank for d in decls)
        if declared != list(range(ranks)):
            problems.add(
                f"buffer {name!r} is declared {len(decls)} times (ranks {declared}); a per-rank buffer is "
                f"declared once for each rank 0..{ranks - 1}"
            )
            continue
        per_rank.add(name)
        by_rank = sorted(decls, key=lambda d: d.rank)
        first = by_rank[0]
        for decl in by_rank[1:]:
            differs = [what for what, key in _PER_RANK_SAME if key(decl) != key(first)]
            if differs:
                problems.add(
                    f"per-rank buffer {name!r}: rank {decl.rank}'s declaration differs from rank 0's in "
                    f"{' and '.join(differs)}"
                )
        if first.role != mf.BUFFER_ROLE_WEIGHTS and not first.resource_id:
            problems.add(
                f"per-rank buffer {name!r} has role {_enum_name(mf.BufferRole, first.role)}; only weights and "
                "resource-filled (STATE_INIT) buffers may be declared per rank"
            )
        for decl in by_rank:
            _check_rank_resource(decl, resources, decl.rank, problems, per_rank=True)
    return frozenset(per_rank)


def _check_rank_resource(
    decl: mf.BufferDecl,
    resources: Mapping[str, cb.ExecutableResource],
    rank: int,
    problems: _Problems,
    *,
    per_rank: bool = False,
) -> None:
    resource = resources.get(decl.resource_id) if decl.resource_id else None
    if resource is None or resource.rank == rank:
        return
    if per_rank:
        problems.add(
            f"per-rank buffer {decl.name!r} of rank {rank} reads resource {resource.id!r}, which belongs to "
            f"rank {resource.rank}"
        )
    else:
        problems.add(
            f"replicated buffer {decl.name!r} reads resource {resource.id!r} of rank {resource.rank}; every rank "
            "loads it, so it must belong to rank 0"
        )


def _check_transport(
    execution: mf.ExecutionManifest, buffers: Mapping[str, mf.BufferDecl], problems: _Problems
) -> dict[str, mf.TransportEntry]:
    transport = execution.transport
    entries: dict[str, mf.TransportEntry] = {}
    if transport.frames not in (1, 2):
        problems.add(f"transport.frames must be 1 or 2, not {transport.frames}")
    for entry in transport.entries:
        if entry.name in entries or entry.name in buffers:
            problems.add(f"transport entry {entry.name!r} is declared twice or shadows a buffer")
            continue
        if entry.dtype not in NUMPY_DTYPES:
            problems.add(f"transport entry {entry.name!r} has unknown dtype {entry.dtype}")
            continue
        if not entry.shape or any(d == 0 for d in entry.shape):
            problems.add(f"transport entry {entry.name!r} has an empty shape")
            continue
        entries[entry.name] = entry
    for record in execution.completion:
        if not _known(mf.CompletionField, record.field):
            problems.add(f"completion record {record.buffer!r} has unknown field {record.field}")
        decl = buffers.get(record.buffer)
        if decl is None or decl.role != mf.BUFFER_ROLE_COMPLETION:
            problems.add(f"completion record names {record.buffer!r}, which is not a completion buffer")
    for owned in (transport.frame_index_entry, transport.submission_sequence_entry):
        if owned and owned not in entries:
            problems.add(f"transport names unknown entry {owned!r} for its own use")
    return entries


def _check_views(
    model: ct.ModelContract,
    buffers: Mapping[str, mf.BufferDecl],
    transport: Mapping[str, mf.TransportEntry],
    problems: _Problems,
) -> dict[str, ct.StateView]:
    views: dict[str, ct.StateView] = {}
    for view in model.state_views:
        if view.name in views:
            problems.add(f"state view {view.name!r} is declared twice")
            continue
        views[view.name] = view
        buffer = buffers.get(view.buffer)
        if buffer is None or buffer.role not in (mf.BUFFER_ROLE_PERSISTENT_STATE, mf.BUFFER_ROLE_TUNED):
            problems.add(f"state view {view.name!r} names {view.buffer!r}, which is not a persistent buffer")
            continue
        rows = buffer.shape[0].size
        nbytes = _buffer_nbytes(buffer)
        if view.byte_extent == 0:
            problems.add(f"state view {view.name!r} has zero extent")
        if view.row_stride and view.byte_offset + view.byte_extent > view.row_stride:
            problems.add(f"state view {view.name!r}: offset + extent exceeds its row stride")
        last_end = view.byte_offset + (rows - 1) * view.row_stride + view.byte_extent
        if last_end > nbytes:
            problems.add(
                f"state view {view.name!r} ends at byte {last_end} of {view.buffer!r}, which has {nbytes} bytes"
            )
    cache = model.cache
    if cache.page_tokens <= 0:
        problems.add("cache.page_tokens must be positive")
    region_names: set[str] = set()
    for region in cache.regions:
        region_names.add(region.name)
        if not _known(ct.HistoryKind, region.kind):
            problems.add(f"history region {region.name!r} has unknown kind {region.kind}")
        if region.kind in PAGED_HISTORY_KINDS or (region.kind == ct.HISTORY_KIND_SLIDING_WINDOW and region.planes):
            if region.tokens_per_record < 1:
                problems.add(f"history region {region.name!r}: tokens_per_record must be at least 1")
            _check_record_geometry(region, cache.page_tokens, problems)
            for plane in region.planes:
                decl = buffers.get(plane)
                if decl is None or decl.role != mf.BUFFER_ROLE_CACHE_PLANE:
                    problems.add(f"history region {region.name!r} names {plane!r}, which is not a cache plane")
                elif decl.shape[0].symbol != mf.DIM_SYMBOL_CACHE_PAGES:
                    problems.add(f"cache plane {plane!r}: its leading dimension must be CACHE_PAGES")
                else:
                    _check_plane_records(region, decl, cache.page_tokens, problems)
            if not region.planes:
                problems.add(f"history region {region.name!r} names no planes")
        if region.kind == ct.HISTORY_KIND_SLIDING_WINDOW and region.window_tokens <= 0:
            problems.add(f"sliding-window region {region.name!r} must declare window_tokens")
        if region.kind == ct.HISTORY_KIND_RECURRENT:
            _check_recurrent_region(region, buffers, problems)
    _check_view_columns(cache.page_table_views, problems)
    for table_view in cache.page_table_views:
        entry = transport.get(table_view.buffer)
        if entry is None:
            problems.add(f"page-table view names {table_view.buffer!r}, which is not a transport entry")
            continue
        if entry.dtype not in (mf.DTYPE_I32, mf.DTYPE_I64):
            problems.add(f"page-table view {table_view.buffer!r} must be an integer entry")
        if table_view.region not in region_names:
            problems.add(f"page-table view {table_view.buffer!r} names unknown region {table_view.region!r}")
        row_extent = entry.shape[-1]
        first, end = table_view.page_offset, table_view.page_offset + table_view.pages_per_row
        if table_view.pages_per_row == 0 or end > row_extent:
            problems.add(
                f"page-table view {table_view.buffer!r}: pages {first}..{end} exceed its row extent {row_extent}"
            )
    return views


def _check_record_geometry(region: ct.HistoryRegion, page_tokens: int, problems: _Problems) -> None:
    """A paged region stores one record per ``tokens_per_record`` tokens; a page (``page_tokens`` logical
    tokens) holds whole records, so page boundaries (where prefix reuse cuts) are record boundaries."""
    ratio = region.tokens_per_record
    if ratio >= 1 and page_tokens > 0 and page_tokens % ratio:
        problems.add(
            f"history region {region.name!r}: page_tokens {page_tokens} is not a multiple of its "
            f"tokens_per_record {ratio}"
        )


def _check_plane_records(region: ct.HistoryRegion, plane: mf.BufferDecl, page_tokens: int, problems: _Problems) -> None:
    """A paged plane (paged key/value, paged latent, or a sliding window's key/value) is
    ``[CACHE_PAGES, page_tokens / tokens_per_record, ...]``: one record per ``tokens_per_record`` tokens of
    each page (one a token for uncompressed planes). The kernels take the page size from this dimension
    while the runtime computes cache slots from ``page_tokens``, so the two must agree."""
    ratio = region.tokens_per_record
    kind = PAGED_PLANE_KINDS.get(region.kind)
    if kind is None or ratio < 1 or page_tokens <= 0 or page_tokens % ratio:
        return
    records = page_tokens // ratio
    if len(plane.shape) < 2 or plane.shape[1].size != records:
        found = plane.shape[1].size if len(plane.shape) >= 2 else "none"
        if ratio == 1:
            expected = f"{records} tokens a page (page_tokens {page_tokens})"
        else:
            expected = f"{records} records a page (page_tokens {page_tokens} / tokens_per_record {ratio})"
        problems.add(
            f"cache plane {plane.name!r} of {kind} region {region.name!r}: its second dimension must be "
            f"{expected}, not {found}"
        )


def _check_view_columns(views: Sequence[ct.PageTableView], problems: _Problems) -> None:
    """Views over one destination occupy disjoint columns ``[page_offset, page_offset + pages_per_row)``."""
    by_buffer: dict[str, list[ct.PageTableView]] = {}
    for view in views:
        by_buffer.setdefault(view.buffer, []).append(view)
    for buffer, shared in by_buffer.items():
        ordered = sorted(shared, key=lambda v: v.page_offset)
        for before, after in itertools.pairwise(ordered):
            if before.page_offset + before.pages_per_row > after.page_offset:
                problems.add(
                    f"page-table views over {buffer!r} overlap: columns {before.page_offset}.."
                    f"{before.page_offset + before.pages_per_row} and {after.page_offset}.."
                    f"{after.page_offset + after.pages_per_row}"
                )


def _graph_page_views(graph: ct.GraphContract, cache: ct.CacheContract) -> tuple[ct.PageTableView, ...]:
    """The page-table views over ``graph``'s PAGE_TABLE destinations, by destination and page offset."""
    tables = {b.destination for b in graph.bindings if b.source == ct.VALUE_SOURCE_PAGE_TABLE}
    found = [v for v in cache.page_table_views if v.buffer in tables]
    return tuple(sorted(found, key=lambda v: (v.buffer, v.page_offset)))


def _check_recurrent_region(
    region: ct.HistoryRegion, buffers: Mapping[str, mf.BufferDecl], problems: _Problems
) -> None:
    """A recurrent region names its state planes: persistent buffers of per-request state rows (leading
    dimension STATE_ROWS), which snapshots copy whole at exact token endpoints."""
    if not region.planes:
        problems.add(f"recurrent region {region.name!r} names no state planes")
    for plane in region.planes:
        decl = buffers.get(plane)
        if decl is None or decl.role != mf.BUFFER_ROLE_PERSISTENT_STATE:
            problems.add(f"recurrent region {region.name!r} names {plane!r}, which is not a persistent state buffer")
        elif not decl.shape or decl.shape[0].symbol != mf.DIM_SYMBOL_STATE_ROWS:
            problems.add(f"recurrent state plane {plane!r}: its leading dimension must be STATE_ROWS")


def _check_binding_geometry(
    graph: ct.GraphContract,
    binding: ct.ValueBinding,
    entry: mf.TransportEntry,
    extents: GraphExtentsView,
    sizes: tuple[int, int, int],
    problems: _Problems,
) -> None:
    _, histogram_width, mask_words = sizes
    where = f"graph {graph.name!r} binding {binding.destination!r}"
    source = binding.source
    if source in FLOAT_SOURCES and entry.dtype not in FLOAT_DTYPES:
        problems.add(f"{where}: a float source needs a float destination, not {dtype_name(entry.dtype)}")
    if source not in FLOAT_SOURCES and source != ct.VALUE_SOURCE_IMAGE_TENSOR and entry.dtype not in INTEGER_DTYPES:
        problems.add(f"{where}: an integer source needs an integer destination, not {dtype_name(entry.dtype)}")
    shape = list(entry.shape)
    leading = shape[0]
    indexing = binding.indexing
    if not _known(ct.Indexing, indexing):
        problems.add(f"{where}: unknown indexing {indexing}")
    elif indexing in (ct.INDEXING_SUBMISSION_ROW, ct.INDEXING_ACTIVE_ROW, ct.INDEXING_PHYSICAL_REQUEST_ROW):
        if leading < extents.batch_capacity:
            problems.add(f"{where}: {leading} rows cannot hold batch capacity {extents.batch_capacity}")
    elif indexing == ct.INDEXING_PACKED_TOKEN and leading < extents.packed_token_capacity:
        problems.add(f"{where}: {leading} rows cannot hold {extents.packed_token_capacity} packed tokens")
    if source == ct.VALUE_SOURCE_PROMPT_HISTOGRAM and shape[-1] != histogram_width:
        problems.add(f"{where}: histogram rows are {shape[-1]} wide, the vocabulary needs {histogram_width}")
    if source in (ct.VALUE_SOURCE_GRAMMAR_MASK, ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS):
        if entry.dtype not in (mf.DTYPE_I32, mf.DTYPE_U32):
            problems.add(f"{where}: grammar masks are 32-bit words")
        if shape[-1] != mask_words:
            problems.add(f"{where}: mask rows are {shape[-1]} words, the vocabulary needs {mask_words}")


def _check_graph(
    graph: ct.GraphContract,
    model: ct.ModelContract,
    program: mf.ProgramDecl | None,
    transport: Mapping[str, mf.TransportEntry],
    owned_entries: frozenset[str],
    views: Mapping[str, ct.StateView],
    resources: Mapping[str, cb.ExecutableResource],
    sizes: tuple[int, int, int],
    problems: _Problems,
) -> tuple[GraphExtentsView, int | None, frozenset[str]]:
    name = graph.name
    version = model.version
    if graph.operation == ct.OPERATION_UNSPECIFIED or graph.operation not in ct.Operation.values():
        problems.add(f"graph {name!r} has unknown operation {graph.operation}")
    if program is None:
        problems.add(f"graph {name!r} has no program in the execution catalog")
    elif program.operation != graph.operation:
        problems.add(
            f"graph {name!r} declares operation {operation_name(graph.operation)} but the execution "
            f"catalog's program is {operation_name(program.operation)}"
        )
    extents = _effective_extents(graph, version, problems)
    for dependency in graph.resource_dependencies:
        if dependency not in resources:
            problems.add(f"graph {name!r} depends on unknown resource {dependency!r}")

    destinations: Counter[str] = Counter()
    length_sources: list[int] = []
    for binding in graph.bindings:
        where = f"graph {name!r} binding {binding.destination!r}"
        destinations[binding.destination] += 1
        if binding.destination in owned_entries:
            problems.add(f"{where}: frame index and submission sequence belong to the transport")
            continue
        entry = transport.get(binding.destination)
        if entry is None:
            problems.add(f"{where}: destination is not a registered transport entry")
            continue
        if binding.source == ct.VALUE_SOURCE_UNSPECIFIED or binding.source not in ct.ValueSource.values():
            problems.add(f"{where}: unknown value source {binding.source}")
            continue
        if binding.source in LENGTH_SOURCES:
            length_sources.append(binding.source)
        if binding.source in IMAGE_SOURCES and model.frontend.image_layout in (
            ct.IMAGE_LAYOUT_UNSPECIFIED,
            ct.IMAGE_LAYOUT_NONE,
        ):
            problems.add(f"{where}: image sources need a selected image layout")
        if binding.source == ct.VALUE_SOURCE_IMAGE_TENSOR and not binding.image_output:
            problems.add(f"{where}: IMAGE_TENSOR needs an image_output name")
        allowed = IMAGE_SOURCE_INDEXING.get(binding.source)
        if allowed is not None and _known(ct.Indexing, binding.indexing) and binding.indexing not in allowed:
            problems.add(
                f"{where}: {_enum_name(ct.ValueSource, binding.source).removeprefix('VALUE_SOURCE_')} needs "
                f"{' or '.join(_enum_name(ct.Indexing, i).removeprefix('INDEXING_') for i in sorted(allowed))} "
                f"indexing, not {_enum_name(ct.Indexing, binding.indexing).removeprefix('INDEXING_')}"
            )
        if binding.source == ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT and graph.operation != ct.OPERATION_SPECULATIVE:
            problems.add(f"{where}: speculative prefix limits belong to speculative programs")
        _check_binding_geometry(graph, binding, entry, extents, sizes, problems)
    for destination, count in destinations.items():
        if count > 1:
            problems.add(f"graph {name!r}: destination {destination!r} is bound {count} times")

    for access in graph.state_accesses:
        if access.view not in views:
            problems.add(f"graph {name!r} accesses unknown state view {access.view!r}")
        if not _known(ct.AccessMode, access.mode):
            problems.add(f"graph {name!r}: access to {access.view!r} has unknown mode {access.mode}")

    pending = graph.pending_token
    which = pending.WhichOneof("source")
    if which == "state_view":
        modes = {a.mode for a in graph.state_accesses if a.view == pending.state_view}
        if pending.state_view not in views:
            problems.add(f"graph {name!r}: pending token view {pending.state_view!r} is not a state view")
        elif not modes & {ct.ACCESS_MODE_READ, ct.ACCESS_MODE_READ_WRITE}:
            problems.add(f"graph {name!r}: it must declare a read of its pending token view {pending.state_view!r}")
    elif which == "binding_destination":
        bound = {b.destination: b.source for b in graph.bindings}
        if bound.get(pending.binding_destination) != ct.VALUE_SOURCE_PENDING_TOKEN:
            problems.add(
                f"graph {name!r}: host-owned pending token needs a PENDING_TOKEN binding to "
                f"{pending.binding_destination!r}"
            )

    is_spec = graph.operation == ct.OPERATION_SPECULATIVE
    if is_spec:
        if version < 2:
            problems.add(f"graph {name!r}: speculative programs need contract version 2 or later")
        if len(length_sources) != 1:
            problems.add(
                f"graph {name!r}: a speculative program binds exactly one length source "
                f"(QUERY_LENGTH or SPECULATIVE_PREFIX_LIMIT), found {len(length_sources)}"
            )
        if extents.token_capacity == 1 and extents.draft_tokens != 0:
            problems.add(f"graph {name!r}: a width-one speculative program draws no proposals (D must be 0)")
        if extents.token_capacity > 1 and extents.draft_tokens == 0:
            problems.add(f"graph {name!r}: draft_tokens (D) must be declared for width {extents.token_capacity}")
        if extents.packed_token_capacity > extents.batch_capacity * extents.token_capacity:
            problems.add(f"graph {name!r}: P exceeds B x W")
    else:
        if extents.draft_tokens or graph.confidence_width:
            problems.add(f"graph {name!r}: only speculative programs draw proposals or produce confidence")
        if graph.cursor.reports_draft_cursor:
            problems.add(f"graph {name!r}: only speculative programs report a draft cursor")
    if graph.confidence_width:
        if graph.confidence_width != extents.draft_tokens:
            problems.add(
                f"graph {name!r}: confidence_width {graph.confidence_width} must equal D = {extents.draft_tokens}"
            )
        if extents.draft_capacity < extents.draft_tokens:
            problems.add(f"graph {name!r}: draft_capacity is smaller than D")
    if graph.tuned_bindings and version < 2:
        problems.add(f"graph {name!r}: tuned bindings need contract version 2 or later")
    if graph.cursor.lag_tokens and version < 3:
        problems.add(f"graph {name!r}: completion-cursor lag needs contract version 3")
    for reservation in graph.rng_reservations:
        if not reservation.stream:
            problems.add(f"graph {name!r}: an RNG reservation names no stream")
    single_source = length_sources[0] if len(length_sources) == 1 else None
    return extents, single_source, frozenset(destinations)


def _vision_core(model: ct.ModelContract) -> bool:
    """The core takes images: it selects an image layout."""
    return model.frontend.image_layout not in (ct.IMAGE_LAYOUT_NONE, ct.IMAGE_LAYOUT_UNSPECIFIED)


def _check_vision(model: ct.ModelContract, problems: _Problems) -> None:
    """A core that selects an image layout declares a usable vision contract: capacities, feature ids and
    atomic spans inside the input vocabulary, and an image sentinel for the chat template."""
    frontend = model.frontend
    preparation_none = frontend.image_preparation == ct.IMAGE_PREPARATION_NONE
    layout_none = frontend.image_layout == ct.IMAGE_LAYOUT_NONE
    if preparation_none != layout_none and ct.IMAGE_PREPARATION_UNSPECIFIED not in (
        frontend.image_preparation,
        frontend.image_layout,
    ):
        problems.add("frontend: image_preparation and image_layout must both be NONE or both name implementations")
    if not _vision_core(model):
        return
    if not model.HasField("vision"):
        problems.add("vision: a core with an image layout must declare its vision contract")
        return
    vision = model.vision
    if vision.feature_slots <= 0:
        problems.add("vision.feature_slots must be positive")
    if vision.features_per_window <= 0:
        problems.add("vision.features_per_window must be positive")
    elif vision.feature_slots and vision.features_per_window > vision.feature_slots:
        problems.add(
            f"vision.features_per_window {vision.features_per_window} exceeds feature_slots {vision.feature_slots}"
        )
    merge = vision.patches_per_feature
    if merge <= 0:
        problems.add("vision.patches_per_feature must be at least 1")
    if not vision.patch_capacities:
        problems.add("vision.patch_capacities must list at least one capacity")
    for capacity in vision.patch_capacities:
        if capacity <= 0 or (merge > 0 and capacity % merge):
            problems.add(
                f"vision.patch_capacities: {capacity} is not a positive multiple of patches_per_feature {merge}"
            )
    size = model.input_vocabulary.size
    layout = vision.token_layout
    if not layout.feature_ids:
        problems.add("vision.token_layout.feature_ids must name at least one token")
    for feature in layout.feature_ids:
        if feature >= size:
            problems.add(f"vision.token_layout: feature id {feature} lies outside the input vocabulary [0, {size})")
    for span in layout.atomic_spans:
        for token in (span.open_id, span.close_id):
            if token >= size:
                problems.add(
                    f"vision.token_layout: atomic span id {token} lies outside the input vocabulary [0, {size})"
                )
    if not model.input_vocabulary.image_sentinel_ids:
        problems.add("input_vocabulary: a core with an image layout must declare an image sentinel id")


def _image_capacities(
    graph: ct.GraphContract, model: ct.ModelContract, transport: Mapping[str, mf.TransportEntry], problems: _Problems
) -> tuple[int, int]:
    """A graph's patch capacity (the leading extent of its IMAGE_TENSOR destinations) and feature capacity
    (patch capacity / patches_per_feature); (0, 0) for a graph without image tensors."""
    name = graph.name
    bound = [b for b in graph.bindings if b.source in IMAGE_SOURCES and b.destination in transport]
    if not bound:
        return 0, 0
    if graph.operation not in IMAGE_OPERATIONS:
        problems.add(f"graph {name!r}: {operation_name(graph.operation)} programs take no images")
    tensors = [b for b in bound if b.source == ct.VALUE_SOURCE_IMAGE_TENSOR]
    if not tensors:
        problems.add(f"graph {name!r}: image feature sources need IMAGE_TENSOR bindings (the graph's patch capacity)")
        return 0, 0
    leading = sorted({int(transport[b.destination].shape[0]) for b in tensors})
    if len(leading) > 1:
        problems.add(
            f"graph {name!r}: IMAGE_TENSOR destinations have different leading extents {leading}; all hold the "
            "graph's patch capacity"
        )
        return 0, 0
    capacity = leading[0]
    vision = model.vision
    if _vision_core(model) and capacity not in vision.patch_capacities:
        problems.add(
            f"graph {name!r}: patch capacity {capacity} is not one of vision.patch_capacities "
            f"{list(vision.patch_capacities)}"
        )
    merge = vision.patches_per_feature
    if merge <= 0:
        return capacity, 0
    if capacity % merge:
        problems.add(f"graph {name!r}: patch capacity {capacity} is not a multiple of patches_per_feature {merge}")
    features = capacity // merge
    for binding in bound:
        if binding.source == ct.VALUE_SOURCE_IMAGE_CONTEXT_INDICES:
            entries = math.prod(transport[binding.destination].shape)
            if entries < features:
                problems.add(
                    f"graph {name!r} binding {binding.destination!r}: {entries} entries cannot hold feature "
                    f"capacity {features}"
                )
    return capacity, features


def _check_pending_token_producers(graphs: Sequence[ct.GraphContract], problems: _Problems) -> None:
    device_views = {g.pending_token.state_view for g in graphs if g.pending_token.WhichOneof("source") == "state_view"}
    for view in sorted(device_views):
        for graph in graphs:
            if graph.operation not in GENERATING_OPERATIONS:
                continue
            writes = {
                a.mode
                for a in graph.state_accesses
                if a.view == view and a.mode in (ct.ACCESS_MODE_WRITE, ct.ACCESS_MODE_READ_WRITE)
            }
            if not writes:
                problems.add(
                    f"graph {graph.name!r} produces the device-owned pending token but declares no write of "
                    f"state view {view!r}"
                )


def _check_tuning(
    graphs: Sequence[ct.GraphContract],
    model: ct.ModelContract,
    execution: mf.ExecutionManifest,
    buffers: Mapping[str, mf.BufferDecl],
    transport: Mapping[str, mf.TransportEntry],
    views: Mapping[str, ct.StateView],
    problems: _Problems,
) -> None:
    producers = {p.program: set(p.outputs) for p in execution.tuning}
    tuning_programs = {p.name for p in execution.tuning_programs}
    for producer in producers:
        if producer not in tuning_programs:
            problems.add(f"tuning producer {producer!r} has no program in the tuning catalog")
    written_state = {
        views[a.view].buffer
        for g in graphs
        for a in g.state_accesses
        if a.view in views and a.mode in (ct.ACCESS_MODE_WRITE, ct.ACCESS_MODE_READ_WRITE)
    }
    cache_planes = {plane for region in model.cache.regions for plane in region.planes}
    for graph in graphs:
        for tuned in graph.tuned_bindings:
            where = f"graph {graph.name!r} tuned binding {tuned.buffer!r}"
            decl = buffers.get(tuned.buffer)
            if decl is None or decl.role != mf.BUFFER_ROLE_TUNED:
                problems.add(f"{where}: not a tuned buffer")
            outputs = producers.get(tuned.producer)
            if outputs is None:
                problems.add(f"{where}: producer {tuned.producer!r} is not in the tuning catalog")
            elif tuned.buffer not in outputs:
                problems.add(f"{where}: producer {tuned.producer!r} does not declare it as an output")
            if tuned.buffer in written_state:
                problems.add(f"{where}: overlaps writable graph state")
            if tuned.buffer in cache_planes:
                problems.add(f"{where}: overlaps cache storage")


def _check_programs(
    execution: mf.ExecutionManifest,
    buffers: Mapping[str, mf.BufferDecl],
    transport: Mapping[str, mf.TransportEntry],
    problems: _Problems,
) -> None:
    modules = {m.name: m for m in execution.modules}
    for program in list(execution.programs) + list(execution.tuning_programs):
        node_names: set[str] = set()
        for node in program.nodes:
            where = f"program {program.name!r} node {node.name!r}"
            if node.name in node_names:
                problems.add(f"{where} is declared twice")
            for dependency in node.depends_on:
                if dependency not in node_names:
                    problems.add(f"{where} depends on {dependency!r}, which does not precede it")
            node_names.add(node.name)
            for arg in node.args:
                _check_view(where, arg, buffers, transport, problems)
            _check_launches(where, node, modules, buffers, transport, problems)
            spec = CATALOGUE.get((node.op.name, node.op.version))
            if spec is None:
                # Unknown operators are a runtime-support question (check_runtime_support).
                continue
            given = {arg.name for arg in node.args}
            missing = set(spec.inputs + spec.outputs) - given
            if missing:
                problems.add(f"{where} ({spec.name}) lacks arguments {sorted(missing)}")
            unknown = given - spec.tensor_args
            if unknown:
                problems.add(f"{where} ({spec.name}) has unknown arguments {sorted(unknown)}")
            attributes = {attr.name for attr in node.attributes}
            missing_attrs = set(spec.attributes) - attributes
            if missing_attrs:
                problems.add(f"{where} ({spec.name}) lacks attributes {sorted(missing_attrs)}")


def _check_attention_windows(model: ct.ModelContract, execution: mf.ExecutionManifest, problems: _Problems) -> None:
    """Attention over a sliding-window region's planes attends within its declared extent: the runtime
    releases pages outside the extent, so an attention that reads further would read released pages."""
    windows = {
        plane: region
        for region in model.cache.regions
        if region.kind == ct.HISTORY_KIND_SLIDING_WINDOW
        for plane in region.planes
    }
    if not windows:
        return
    for program in execution.programs:
        for node in program.nodes:
            if node.op.name != "paged_attention":
                continue
            region = next((windows[a.view.buffer] for a in node.args if a.view.buffer in windows), None)
            if region is None:
                continue
            window = next((a.int_value for a in node.attributes if a.name == "window"), 0)
            if not 0 < window <= region.window_tokens:
                problems.add(
                    f"program {program.name!r} node {node.name!r}: attention over sliding-window region "
                    f"{region.name!r} has window {window}, which must lie in [1, {region.window_tokens}]"
                )


def _check_input_embedding(
    model: ct.ModelContract,
    execution: mf.ExecutionManifest,
    buffers: Mapping[str, mf.BufferDecl],
    transport: Mapping[str, mf.TransportEntry],
    problems: _Problems,
) -> None:
    """Every id of the input vocabulary (image sentinels included: a legacy completion's prompt ids reach
    the model unexpanded) has a row in each embedding table that a program gathers input ids from: an
    ``embedding`` node whose ``ids`` is a transport entry its graph binds with an input-id source
    (:data:`INPUT_ID_SOURCES`). Reported once per table."""
    size = model.input_vocabulary.size
    if size <= 0:
        return
    graphs = {g.name: g for g in model.graphs}
    reported: set[str] = set()
    for program in execution.programs:
        graph = graphs.get(program.name)
        if graph is None:
            continue
        sources = {b.destination: b.source for b in graph.bindings}
        for node in program.nodes:
            if node.op.name != "embedding":
                continue
            args = {a.name: a.view for a in node.args}
            table, ids = args.get("table"), args.get("ids")
            if table is None or ids is None or table.buffer in reported:
                continue
            source = sources.get(ids.buffer)
            if source not in INPUT_ID_SOURCES or ids.buffer not in transport:
                continue
            rows = _table_rows(table, buffers, transport)
            if rows is not None and rows < size:
                reported.add(table.buffer)
                label = _enum_name(ct.ValueSource, source).removeprefix("VALUE_SOURCE_")
                problems.add(
                    f"input_vocabulary.size {size} exceeds the {rows} rows of embedding table {table.buffer!r}: "
                    f"program {program.name!r} node {node.name!r} embeds input ids ({label} in {ids.buffer!r}), "
                    f"so an id in [{rows}, {size}) would fail the gather"
                )


def _table_rows(
    view: mf.BufferView, buffers: Mapping[str, mf.BufferDecl], transport: Mapping[str, mf.TransportEntry]
) -> int | None:
    """The rows of the ``[V, H]`` table an argument view reads, or None when its declaration does not fix
    them (a symbolic leading dimension, a view that is not two-dimensional: the operator refuses those)."""
    decl = buffers.get(view.buffer)
    if decl is not None and decl.shape and decl.shape[0].symbol != mf.DIM_SYMBOL_UNSPECIFIED:
        return None
    if view.shape:
        return int(view.shape[0]) if len(view.shape) == 2 else None
    if view.element_offset:
        return None
    if decl is not None:
        declared = _dims(decl.shape)
    elif view.buffer in transport:
        declared = [int(d) for d in transport[view.buffer].shape]
    else:
        return None
    return declared[0] if len(declared) == 2 else None


def _check_launches(
    where: str,
    node: mf.Node,
    modules: Mapping[str, mf.ModuleDecl],
    buffers: Mapping[str, mf.BufferDecl],
    transport: Mapping[str, mf.TransportEntry],
    problems: _Problems,
) -> None:
    for launch in node.launches:
        module = modules.get(launch.module)
        if module is None:
            problems.add(f"{where}: launch names unknown module {launch.module!r}")
        elif module.target != launch.target:
            problems.add(f"{where}: module {launch.module!r} is built for {module.target}, not {launch.target}")
        for param in launch.params:
            if (
                param.kind == mf.PARAM_KIND_ADDRESS
                and param.buffer
                and param.buffer not in buffers
                and param.buffer not in transport
            ):
                problems.add(f"{where}: launch parameter names unknown buffer {param.buffer!r}")
        if len(launch.grid) != 3 or len(launch.block) != 3:
            problems.add(f"{where}: a launch needs three grid and three block dimensions")
        elif math.prod(launch.block) == 0 or math.prod(launch.block) > 1024:
            problems.add(f"{where}: launch block {list(launch.block)} must hold 1 to 1024 threads")


def _check_view(
    where: str,
    arg: mf.TensorArg,
    buffers: Mapping[str, mf.BufferDecl],
    transport: Mapping[str, mf.TransportEntry],
    problems: _Problems,
) -> None:
    view = arg.view
    if view.buffer in buffers:
        total = math.prod(_dims(buffers[view.buffer].shape))
    elif view.buffer in transport:
        total = math.prod(transport[view.buffer].shape)
    else:
        problems.add(f"{where} argument {arg.name!r} names unknown buffer {view.buffer!r}")
        return
    count = math.prod(view.shape) if view.shape else total
    if view.element_offset + count > total:
        problems.add(f"{where} argument {arg.name!r} reads past the end of {view.buffer!r}")


def _check_context_pages(serving: ct.ServingContract, cache: ct.CacheContract, problems: _Problems) -> None:
    """Each page-table view's row holds a request at the full context: admission refuses a request needing
    more pages than a row has, so a shorter row would refuse every request the context admits."""
    if serving.context_tokens <= 0 or cache.page_tokens <= 0:
        return
    needed = -(-serving.context_tokens // cache.page_tokens)
    for view in cache.page_table_views:
        if 0 < view.pages_per_row < needed:
            problems.add(
                f"page-table view {view.buffer!r} holds {view.pages_per_row} pages of {cache.page_tokens} tokens a "
                f"row, fewer than the {needed} a request at context_tokens {serving.context_tokens} needs"
            )


def _check_serving(serving: ct.ServingContract, graphs: Sequence[PreparedGraph], problems: _Problems) -> None:
    if not serving.served_name:
        problems.add("served_name is empty")
    names = [serving.served_name, *serving.aliases]
    if len(set(names)) != len(names):
        problems.add("served_name and aliases must be distinct")
    if serving.context_tokens <= 0:
        problems.add("context_tokens must be positive")
    if serving.prefill_tokens <= 0:
        problems.add("prefill_tokens must be positive")
    if serving.max_concurrency <= 0:
        problems.add("max_concurrency must be positive")
    if not serving.defaults.eos_token_ids:
        problems.add("defaults.eos_token_ids must name at least one token")
    by_operation: dict[int, list[PreparedGraph]] = {}
    for graph in graphs:
        by_operation.setdefault(graph.operation, []).append(graph)
    for required in REQUIRED_OPERATIONS:
        if required not in by_operation:
            problems.add(f"missing graph variant: no {operation_name(required)} program")
    decode_capacity = max((g.extents.batch_capacity for g in by_operation.get(ct.OPERATION_DECODE, [])), default=0)
    if decode_capacity and decode_capacity < serving.max_concurrency:
        problems.add(
            f"missing graph variant: max_concurrency is {serving.max_concurrency} but the widest decode "
            f"program holds {decode_capacity} rows"
        )
    if serving.snapshot_capacity:
        for required in (ct.OPERATION_SNAPSHOT, ct.OPERATION_RESTORE):
            if required not in by_operation:
                problems.add(
                    f"missing graph variant: snapshots are declared but there is no {operation_name(required)} program"
                )
    speculative = by_operation.get(ct.OPERATION_SPECULATIVE, [])
    for width in serving.speculative_widths:
        if not any(g.extents.selectable_width >= width for g in speculative):
            problems.add(f"missing graph variant: no speculative program serves width {width} (min(D + 1, W))")
    if speculative and not serving.speculative_widths:
        problems.add("speculative programs exist but speculative_widths declares none")


def prepare_contract(
    serving: ct.ServingContract,
    execution: mf.ExecutionManifest,
    resources: Sequence[cb.ExecutableResource] = (),
) -> PreparedContract:
    """Decode and validate a contract; raise ContractError listing every problem."""
    problems = _Problems()
    model = serving.model
    if model.version not in SUPPORTED_CONTRACT_VERSIONS:
        raise ContractError(
            f"unsupported contract version {model.version}; this runtime loads versions "
            f"{', '.join(map(str, SUPPORTED_CONTRACT_VERSIONS))}"
        )
    resource_map = {r.id: r for r in resources}
    sampled, logits, histogram, mask = _vocabulary_geometry(model, problems)
    _check_input_vocabulary(model, problems)
    _check_frontend(model, problems)
    buffers = _check_buffers(execution, resource_map, problems)
    transport = _check_transport(execution, buffers, problems)
    views = _check_views(model, buffers, transport, problems)
    owned = frozenset(
        e for e in (execution.transport.frame_index_entry, execution.transport.submission_sequence_entry) if e
    )
    programs = {p.name: p for p in execution.programs}
    contract_names = [g.name for g in model.graphs]
    for duplicate in sorted(n for n, c in Counter(contract_names).items() if c > 1):
        problems.add(f"graph {duplicate!r} is declared twice")
    for orphan in sorted(set(programs) - set(contract_names)):
        problems.add(f"execution program {orphan!r} has no graph contract")
    prepared_graphs: dict[str, PreparedGraph] = {}
    for graph in model.graphs:
        program = programs.get(graph.name)
        extents, length_source, inputs = _check_graph(
            graph, model, program, transport, owned, views, resource_map, (logits, histogram, mask), problems
        )
        patches, features = _image_capacities(graph, model, transport, problems)
        if program is not None:
            prepared_graphs[graph.name] = PreparedGraph(
                name=graph.name,
                operation=graph.operation,
                contract=graph,
                program=program,
                extents=extents,
                length_source=length_source,
                input_destinations=inputs,
                page_table_views=_graph_page_views(graph, model.cache),
                patch_capacity=patches,
                feature_capacity=features,
            )
    _check_vision(model, problems)
    prefills = [g for g in prepared_graphs.values() if g.operation == ct.OPERATION_PREFILL]
    if _vision_core(model) and model.HasField("vision") and not any(g.takes_images for g in prefills):
        problems.add("vision: a core with an image layout needs a prefill program that binds IMAGE_TENSOR")
    _check_pending_token_producers(list(model.graphs), problems)
    _check_engram_tables(execution, model, transport, owned, prepared_graphs, resource_map, problems)
    _check_tuning(list(model.graphs), model, execution, buffers, transport, views, problems)
    _check_programs(execution, buffers, transport, problems)
    _check_attention_windows(model, execution, problems)
    _check_input_embedding(model, execution, buffers, transport, problems)
    _check_serving(serving, list(prepared_graphs.values()), problems)
    _check_context_pages(serving, model.cache, problems)
    problems.raise_if_any()
    return PreparedContract(
        version=model.version,
        serving=serving,
        model=model,
        execution=execution,
        graphs=MappingProxyType(prepared_graphs),
        buffers=MappingProxyType(buffers),
        transport=MappingProxyType(transport),
        state_views=MappingProxyType(views),
        sampled_size=sampled,
        logits_width=logits,
        histogram_width=histogram,
        mask_words=mask,
        ranks=max(execution.ranks, 1),
        resource_kinds=MappingProxyType({r.id: r.kind for r in resources}),
    )


def check_runtime_support(contract: PreparedContract, capabilities: RuntimeCapabilities) -> None:
    """Fail with UnsupportedFeatureError naming the first feature this runtime lacks."""
    if capabilities.ranks is not None and contract.ranks > capabilities.ranks:
        limit = f" ({capabilities.ranks_limit})" if capabilities.ranks_limit else ""
        raise UnsupportedFeatureError(
            f"the core needs {contract.ranks} tensor-parallel ranks; this runtime has {capabilities.ranks}{limit}"
        )
    for region in contract.model.cache.regions:
        if region.kind not in capabilities.history_kinds:
            raise UnsupportedFeatureError(
                f"history region {region.name!r} has kind {_enum_name(ct.HistoryKind, region.kind)}, "
                "which this runtime does not implement yet"
            )
    for graph in contract.graphs.values():
        if graph.operation not in capabilities.operations:
            raise UnsupportedFeatureError(
                f"graph {graph.name!r} has operation {operation_name(graph.operation)}, which this runtime "
                "does not implement yet"
            )
    for program in list(contract.execution.programs) + list(contract.execution.tuning_programs):
        for node in program.nodes:
            key = (node.op.name, node.op.version)
            if key not in capabilities.operators:
                versions = known_versions(node.op.name)
                known = f"known versions: {list(versions)}" if versions else "unknown operator"
                raise UnsupportedFeatureError(
                    f"program {program.name!r} node {node.name!r} uses operator {node.op.name} version "
                    f"{node.op.version} ({known})"
                )
    frontend = contract.model.frontend
    if not capabilities.vision and (
        frontend.image_preparation not in (ct.IMAGE_PREPARATION_NONE,)
        or frontend.image_layout not in (ct.IMAGE_LAYOUT_NONE,)
    ):
        raise UnsupportedFeatureError("the core declares image inputs, which this runtime does not implement yet")
    if contract.execution.engram_tables and not capabilities.engram:
        raise UnsupportedFeatureError(
            "the core declares Engram staging tables, which this runtime does not implement yet"
        )


ENGRAM_FRAMES: Final = 2
"""Host staging frames of every Engram table."""

ENGRAM_DTYPES: Final = frozenset({mf.DTYPE_F32, mf.DTYPE_BF16})
"""Row dtypes an Engram table may have."""


def _check_engram_tables(
    execution: mf.ExecutionManifest,
    model: ct.ModelContract,
    transport: Mapping[str, mf.TransportEntry],
    owned: frozenset[str],
    graphs: Mapping[str, PreparedGraph],
    resources: Mapping[str, cb.ExecutableResource],
    problems: _Problems,
) -> None:
    """Engram tables: the hash (orders, heads, positive primes whose sum is the table's rows, one odd
    multiplier per offset), the host table and compression resources (kind WEIGHTS, exact sizes), two staging
    frames (the transport's), and a destination transport entry [packed tokens, gathered rows x row width]
    of the rows' dtype that no binding writes and that holds every program's packed tokens. The host hashes
    each packed token's input ids, so no program of an Engram core may read a device-owned pending token."""
    tables = list(execution.engram_tables)
    if not tables:
        return
    for graph in model.graphs:
        if graph.pending_token.WhichOneof("source") == "state_view":
            problems.add(
                f"engram: graph {graph.name!r} reads a device-owned pending token; the host hashes every input "
                "id, so the pending token must be host-owned (binding_destination)"
            )
    if execution.transport.frames != ENGRAM_FRAMES:
        problems.add(
            f"engram: tables stage through the transport's frames, which must be {ENGRAM_FRAMES}, "
            f"not {execution.transport.frames}"
        )
    bound = {b.destination for g in model.graphs for b in g.bindings}
    names: set[str] = set()
    destinations: set[str] = set()
    for table in tables:
        where = f"engram table {table.name!r}"
        if not table.name:
            problems.add("engram: a table has no name")
        elif table.name in names:
            problems.add(f"{where} is declared twice")
        names.add(table.name)
        if table.frames != ENGRAM_FRAMES:
            problems.add(f"{where}: frames must be {ENGRAM_FRAMES}, not {table.frames}")
        if table.dtype not in ENGRAM_DTYPES:
            problems.add(f"{where}: dtype must be DTYPE_F32 or DTYPE_BF16, not {_enum_name(mf.DType, table.dtype)}")
            continue
        if table.row_width == 0:
            problems.add(f"{where}: row_width must be positive")
            continue
        row_nbytes = table.row_width * NUMPY_DTYPES[table.dtype].itemsize
        if table.row_nbytes != row_nbytes:
            problems.add(
                f"{where}: row_nbytes is {table.row_nbytes}, but {table.row_width} values are {row_nbytes} bytes"
            )
        if table.max_order < 2:
            problems.add(f"{where}: max_order must be at least 2, not {table.max_order}")
            continue
        if table.heads_per_order == 0:
            problems.add(f"{where}: heads_per_order must be positive")
            continue
        gathered = (table.max_order - 1) * table.heads_per_order
        if len(table.primes) != gathered:
            problems.add(
                f"{where}: {len(table.primes)} primes, but orders 2..{table.max_order} with "
                f"{table.heads_per_order} heads need {gathered}"
            )
        for index, prime in enumerate(table.primes):
            if prime == 0 or prime >= 2**63:
                problems.add(f"{where}: prime {index} must be positive and below 2**63, not {prime}")
        if len(table.multipliers) != table.max_order:
            problems.add(
                f"{where}: {len(table.multipliers)} multipliers, but max_order {table.max_order} needs "
                f"{table.max_order} (one per offset)"
            )
        for index, multiplier in enumerate(table.multipliers):
            if multiplier % 2 == 0:
                problems.add(f"{where}: multiplier {index} must be odd, not {multiplier}")
        if table.table_rows != sum(table.primes):
            problems.add(f"{where}: table_rows is {table.table_rows}, but the primes sum to {sum(table.primes)}")
        _check_engram_resource(
            where, "resource_id", table.resource_id, table.table_rows * row_nbytes, resources, problems
        )
        if table.compression_resource_id:
            _check_engram_resource(
                where,
                "compression_resource_id",
                table.compression_resource_id,
                model.input_vocabulary.size * 4,
                resources,
                problems,
            )
        _check_engram_destination(table, where, gathered, transport, owned, bound, graphs, problems)
        if table.buffer in destinations:
            problems.add(f"{where}: destination {table.buffer!r} is another table's destination")
        destinations.add(table.buffer)


def _check_engram_resource(
    where: str,
    field_name: str,
    resource_id: str,
    nbytes: int,
    resources: Mapping[str, cb.ExecutableResource],
    problems: _Problems,
) -> None:
    resource = resources.get(resource_id)
    if resource is None:
        problems.add(f"{where}: {field_name} names unknown resource {resource_id!r}")
    elif resource.kind != cb.RESOURCE_KIND_WEIGHTS:
        problems.add(
            f"{where}: resource {resource_id!r} must be RESOURCE_KIND_WEIGHTS, not "
            f"{_enum_name(cb.ResourceKind, resource.kind)}"
        )
    elif resource.decoded_nbytes != nbytes:
        problems.add(f"{where}: resource {resource_id!r} decodes to {resource.decoded_nbytes} bytes, not {nbytes}")


def _check_engram_destination(
    table: mf.EngramTable,
    where: str,
    gathered: int,
    transport: Mapping[str, mf.TransportEntry],
    owned: frozenset[str],
    bound: set[str],
    graphs: Mapping[str, PreparedGraph],
    problems: _Problems,
) -> None:
    entry = transport.get(table.buffer)
    if entry is None or table.buffer in owned:
        problems.add(f"{where}: destination {table.buffer!r} is not a transport entry")
        return
    if table.buffer in bound:
        problems.add(f"{where}: destination {table.buffer!r} is a binding destination; Engram staging alone writes it")
    if entry.dtype != table.dtype:
        problems.add(
            f"{where}: destination {table.buffer!r} is {_enum_name(mf.DType, entry.dtype)}, the rows "
            f"{_enum_name(mf.DType, table.dtype)}"
        )
    shape = list(entry.shape)
    width = gathered * table.row_width
    if len(shape) != 2 or shape[1] != width:
        problems.add(f"{where}: destination {table.buffer!r} has shape {shape}, not [packed tokens, {width}]")
        return
    if table.rows != shape[0] * gathered:
        problems.add(f"{where}: rows is {table.rows}, but {shape[0]} packed tokens gather {shape[0] * gathered}")
    for graph in graphs.values():
        if graph.extents.packed_token_capacity > shape[0]:
            problems.add(
                f"{where}: destination {table.buffer!r} holds {shape[0]} packed tokens; graph {graph.name!r} "
                f"packs {graph.extents.packed_token_capacity}"
            )
