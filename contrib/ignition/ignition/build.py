"""Assembling a core: contract, manifest, resources, signature.

Owns the step from a recipe's declaration (shape, weights, tokenizer, chat
template, frontend and sampling metadata) to a signed core file written by
Helios' container writer. Every core it writes is validated with Helios'
own contract checks before it is signed, so a recipe error fails here rather
than at an operator's startup. The assembly steps every recipe shares (resources,
cache identity, model and serving contracts, validation and writing, the
target checks) live here, used by the Llama, recurrent and latent
recipes alike. A tensor-parallel Llama core (``tensor_parallel`` N) stores each rank's weight shards
in resources of that rank and one weight catalog a rank.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_core.container.writer import ResourceInput, write_core
from helios_core.contract import EXPORTED_CONTRACT_VERSION, prepare_contract
from helios_core.errors import ContractError
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from ignition import __version__ as toolkit_version
from ignition.preparation import contract as decl
from ignition.preparation.program import ManifestBuilder
from ignition.recipes.llama import Capacities, LlamaProgramWriter, LlamaShape, Weights, check_tensor_parallel

Layout = Literal["payload", "logical-v6", "logical-v4"]
Progress = Callable[[str, int, int], None]


@dataclass
class TextModelDeclaration:
    """Everything a recipe declares about a text model."""

    served_name: str
    shape: LlamaShape
    weights: Weights
    tokenizer_json: str
    chat_template: str
    sampled_size: int
    eos_token_ids: Sequence[int]
    sampling: ct.SamplingDefaults = field(default_factory=ct.SamplingDefaults)
    frontend: ct.FrontendContract | None = None
    max_output_tokens: int = 512
    description: str = ""
    rebuild: cb.RebuildManifest | None = None


def default_frontend() -> ct.FrontendContract:
    """A frontend with no tool or reasoning syntax and no image inputs."""
    return ct.FrontendContract(
        tool_parser=ct.TOOL_PARSER_NONE,
        reasoning_parser=ct.REASONING_PARSER_NONE,
        image_preparation=ct.IMAGE_PREPARATION_NONE,
        image_layout=ct.IMAGE_LAYOUT_NONE,
    )


REFERENCE_ONLY_TARGETS = ("reference",)
"""The targets of recipes without GPU kernels (``recurrent-synthetic``, ``latent-synthetic``)."""

SPECULATIVE_TARGETS = ("reference", "sm_90a")
"""Targets with kernels for every speculative operator: those of copied proposals
(``speculative_inputs``, ``sample_verify``, ``completion_speculative``), those of self-drafting
(``lane_positions``, ``draft_argmax``, ``draft_allocate``, ``speculative_layout``,
``completion_self_draft``) and those of sampled drafts (``draft_sample``, ``sample_verify_sampled``)."""

WINDOW_TARGETS = ("reference", "sm_90a")
"""Targets whose ``paged_attention`` honours the ``window`` attribute (sliding-window attention)."""


def check_speculative_targets(caps: Capacities, targets: Sequence[str]) -> None:
    """Refuse speculative programs for a target without kernels for the speculative operators.

    Self-drafting programs, with greedy or sampled drafts, are built for every target of
    :data:`SPECULATIVE_TARGETS`.

    Raises:
        ValueError: ``caps`` declares speculative widths and ``targets`` names a target outside
            :data:`SPECULATIVE_TARGETS`.
    """
    unsupported = [t for t in targets if t not in SPECULATIVE_TARGETS]
    if caps.speculative_widths and unsupported:
        raise ValueError(
            f"speculative programs are built for the targets {', '.join(SPECULATIVE_TARGETS)} only; "
            f"build without --speculative for {', '.join(unsupported)}"
        )


def check_window(caps: Capacities, targets: Sequence[str]) -> None:
    """Refuse a sliding window the build cannot honour.

    Raises:
        ValueError: ``caps.window`` is negative, or positive with a target outside
            :data:`WINDOW_TARGETS` or with self-drafting programs (their draft cursor is not windowed
            yet).
    """
    if caps.window < 0:
        raise ValueError(f"--window must be 0 (unlimited) or positive, got {caps.window}")
    if not caps.window:
        return
    unsupported = [t for t in targets if t not in WINDOW_TARGETS]
    if unsupported:
        raise ValueError(
            f"sliding-window attention (--window) is built for the targets {', '.join(WINDOW_TARGETS)} only; "
            f"build without --window for {', '.join(unsupported)}"
        )
    if caps.self_drafting:
        raise ValueError("sliding-window attention (--window) cannot be combined with --speculative self-draft")


def assemble(
    model: TextModelDeclaration,
    caps: Capacities,
    *,
    bf16: bool = False,
    gpu_targets: Sequence[str] = (),
    kernel_graph: bool = False,
    progress: Progress | None = None,
    tensor_parallel: int = 0,
) -> tuple[ct.ServingContract, ManifestBuilder, list[ResourceInput]]:
    """Build the serving contract, execution manifest and resources of a text model.

    With GPU targets (or ``kernel_graph``) the programs are written as kernel graphs: fused
    operators over packed projection weights, six nodes a layer. GPU targets then give every node
    the launches of each target (a collective node gets none: the runtime runs it). The reference
    backend runs either graph. ``tensor_parallel`` N >= 1 writes an N-rank core with collectives
    (:mod:`ignition.recipes.llama`); the weight catalogs are ``builder.weight_catalogs()``.

    Raises:
        ValueError: speculative widths with a target outside :data:`SPECULATIVE_TARGETS`, or a rank
            count :func:`~ignition.recipes.llama.partition_ranks` refuses (below 1, or leaving a rank
            zero padding only).
    """
    check_speculative_targets(caps, gpu_targets)
    if tensor_parallel:
        check_tensor_parallel(model.shape, tensor_parallel, model.served_name)
    builder = ManifestBuilder(tensor_parallel=tensor_parallel)
    writer = LlamaProgramWriter(
        builder,
        model.shape,
        caps,
        model.weights,
        sampled_size=model.sampled_size,
        bf16=bf16,
        fused=kernel_graph or bool(gpu_targets),
        tensor_parallel=tensor_parallel,
    )
    graphs = writer.write()
    modules = lower_for_targets(builder, gpu_targets, progress)

    resources = core_resources(builder, model.tokenizer_json, model.chat_template, modules)
    settings = [
        b"bf16" if bf16 else b"f32",
        b"kernel-graph" if kernel_graph or gpu_targets else b"operator-graph",
        f"page_tokens={caps.page_tokens}".encode(),
    ]
    if caps.window:  # windowed attention stores different keys and values for the same tokens
        settings.append(f"window={caps.window}".encode())
    if tensor_parallel:  # each rank's planes hold its own key-value heads
        settings.append(f"tensor_parallel={tensor_parallel}".encode())
    if caps.cache_dtype != "f32":  # the cached keys and values are rounded to another type
        settings.append(f"cache_dtype={caps.cache_dtype}".encode())

    contract_model = text_model_contract(model.sampled_size, model.shape.vocab, caps.page_tokens)
    if caps.window:  # the same paged planes, of which attention reads only the last window_tokens positions
        region = contract_model.cache.regions.add(
            name="kv", kind=ct.HISTORY_KIND_SLIDING_WINDOW, tokens_per_record=1, window_tokens=caps.window
        )
    else:
        region = contract_model.cache.regions.add(name="kv", kind=ct.HISTORY_KIND_PAGED_KV, tokens_per_record=1)
    region.planes.extend(v.buffer for v in writer.k_planes + writer.v_planes)
    contract_model.cache.page_table_views.add(
        buffer="page_table", page_offset=0, region="kv", pages_per_row=caps.pages_per_row
    )
    if writer.snapshots is not None:
        # Partial-page payloads of snapshots; complete pages stay in the paged "kv" region.
        continuation = contract_model.cache.regions.add(name="continuation", kind=ct.HISTORY_KIND_CONTINUATION)
        continuation.planes.extend(v.buffer for v in writer.continuation_k + writer.continuation_v)
    contract_model.graphs.extend(graphs)
    contract_model.frontend.CopyFrom(model.frontend or default_frontend())
    contract_model.state_views.extend(decl.state_views(writer.text_caps))

    serving = serving_contract(
        model.served_name,
        cache_identity(resources, settings=settings),
        caps,
        contract_model,
        eos_token_ids=model.eos_token_ids,
        max_output_tokens=model.max_output_tokens,
    )
    # The spec makes history drafting (copied proposals) a startup option that requires learned speculation
    # enabled in the core, and copied-token inputs in every wider program, which these programs bind.
    serving.speculative_widths.extend(caps.speculative_widths)
    serving.learned_speculation = bool(caps.speculative_widths)
    serving.defaults.sampling.CopyFrom(model.sampling)
    return serving, builder, resources


def known_gpu_targets(targets: Sequence[str]) -> list[str]:
    """The GPU targets among ``targets`` (all but ``reference``).

    Raises:
        ValueError: a target that is neither ``reference`` nor one the kernel compiler supports.
    """
    from ignition.kernels.compiler import SUPPORTED_TARGETS

    unknown = [t for t in targets if t != "reference" and t not in SUPPORTED_TARGETS]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; known: reference, {', '.join(SUPPORTED_TARGETS)}")
    return [t for t in targets if t != "reference"]


def build_core(
    model: TextModelDeclaration,
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
    tensor_parallel: int = 0,
) -> ct.ServingContract:
    """Assemble, validate, sign and write a core (of ``tensor_parallel`` ranks with collectives when
    positive); returns its serving contract."""
    gpu_targets = known_gpu_targets(targets)
    check_window(caps, targets)
    serving, builder, resources = assemble(
        model, caps, bf16=bf16, gpu_targets=gpu_targets, progress=progress, tensor_parallel=tensor_parallel
    )
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
        rebuild=model.rebuild,
        progress=progress,
    )
    return serving


def check_reference_only(recipe: str, targets: Sequence[str]) -> None:
    """Refuse any target but ``reference`` for a recipe that has no GPU kernels.

    Raises:
        ValueError: ``targets`` names a target other than ``reference``.
    """
    check_recipe_targets(recipe, targets, REFERENCE_ONLY_TARGETS)


def check_recipe_targets(recipe: str, targets: Sequence[str], supported: Sequence[str]) -> None:
    """Refuse targets a recipe has no kernels for.

    Raises:
        ValueError: ``targets`` names a target outside ``supported``.
    """
    unsupported = [t for t in targets if t not in supported]
    if unsupported:
        raise ValueError(
            f"{recipe} is built for the targets {', '.join(supported)} only; build without {', '.join(unsupported)}"
        )


def lower_for_targets(
    builder: ManifestBuilder, gpu_targets: Sequence[str], progress: Progress | None = None
) -> list[ResourceInput]:
    """Give every node of ``builder``'s programs the launches of each GPU target; returns the module
    resources holding their code."""
    modules: list[ResourceInput] = []
    for index, target in enumerate(gpu_targets):
        from ignition.kernels.lowering import lower_manifest

        if progress is not None:
            progress(f"kernels for {target}", index, len(gpu_targets))
        for module in lower_manifest(builder.manifest, target):
            modules.append(ResourceInput(id=module.decl.resource_id, kind=cb.RESOURCE_KIND_MODULE, data=module.data))
    return modules


def core_resources(
    builder: ManifestBuilder, tokenizer_json: str, chat_template: str, modules: Sequence[ResourceInput] = ()
) -> list[ResourceInput]:
    """A core's resources in their signed order: the weight resources by id, any kernel modules, then the
    tokenizer and the chat template."""
    resources = [
        ResourceInput(id=rid, kind=cb.RESOURCE_KIND_WEIGHTS, data=res.payload(), rank=res.rank)
        for rid, res in sorted(builder.weight_resources.items())
    ]
    resources.extend(modules)
    resources.append(ResourceInput(id="tokenizer", kind=cb.RESOURCE_KIND_TOKENIZER, data=tokenizer_json.encode()))
    resources.append(
        ResourceInput(id="chat_template", kind=cb.RESOURCE_KIND_CHAT_TEMPLATE, data=chat_template.encode())
    )
    return resources


def cache_identity(resources: Sequence[ResourceInput], *, family: bytes = b"", settings: Sequence[bytes] = ()) -> str:
    """A core's cache identity: 32 hex digits of a hash over ``family`` (what kind of history the cache
    holds), each resource's id and content hash, then the build ``settings`` that change cached values."""
    identity = hashlib.sha256(family)
    for resource in resources:
        identity.update(resource.id.encode())
        identity.update(hashlib.sha256(resource.data).digest())
    for setting in settings:
        identity.update(setting)
    return identity.hexdigest()[:32]


def text_model_contract(sampled_size: int, vocab: int, page_tokens: int) -> ct.ModelContract:
    """A model contract with a text model's vocabulary (``vocab`` logits, ``sampled_size`` of them sampled
    and accepted as input) and cache page size; the caller adds regions, graphs, frontend and state views."""
    contract_model = ct.ModelContract(version=EXPORTED_CONTRACT_VERSION)
    contract_model.vocabulary.sampled_size = sampled_size
    contract_model.vocabulary.logits_width = vocab
    contract_model.vocabulary.histogram_width = vocab
    contract_model.vocabulary.mask_words = -(-vocab // 32)
    contract_model.input_vocabulary.size = sampled_size
    contract_model.cache.page_tokens = page_tokens
    return contract_model


def serving_contract(
    served_name: str,
    identity: str,
    caps: Capacities,
    contract_model: ct.ModelContract,
    *,
    eos_token_ids: Sequence[int],
    max_output_tokens: int,
) -> ct.ServingContract:
    """The serving contract of a model contract: its name, cache identity, capacities and output defaults."""
    serving = ct.ServingContract(
        served_name=served_name,
        cache_identity=identity,
        context_tokens=caps.context,
        prefill_tokens=max(caps.prefill_tokens),
        page_capacity=caps.cache_pages,
        snapshot_capacity=caps.snapshots,
        max_concurrency=caps.max_rows,
    )
    serving.defaults.max_output_tokens = max_output_tokens
    serving.defaults.eos_token_ids.extend(eos_token_ids)
    serving.model.CopyFrom(contract_model)
    return serving


def validate_and_write(
    out: Path,
    serving: ct.ServingContract,
    builder: ManifestBuilder,
    resources: Sequence[ResourceInput],
    *,
    signing_key: Ed25519PrivateKey,
    namespace: str,
    layout: Layout,
    core_key: bytes | None,
    description: str,
    rebuild: cb.RebuildManifest | None = None,
    progress: Progress | None = None,
) -> None:
    """Validate an assembled core with the serving runtime's own contract rules, then sign and write it
    with the builder's weight catalogs; the rebuild manifest (a new one when None) records this
    toolkit's version.

    Raises:
        ContractError: the contract fails Helios' checks (:func:`shortened_contract_error`).
        CoreWriteError: the core's files cannot be written.
    """
    try:
        prepare_contract(serving, builder.manifest, [_as_resource_message(r) for r in resources])
    except ContractError as error:
        raise ContractError(shortened_contract_error(str(error))) from error
    rebuild = rebuild or cb.RebuildManifest()
    rebuild.toolkit_version = toolkit_version
    try:
        write_core(
            out,
            namespace=namespace,
            contract=serving,
            execution=builder.manifest,
            resources=resources,
            signing_key=signing_key,
            layout=layout,
            core_key=core_key,
            description=description,
            rebuild=rebuild,
            weight_catalogs=builder.weight_catalogs(),
            progress=progress,
        )
    except OSError as error:
        raise CoreWriteError(error.errno, error.strerror or str(error), str(out)) from error


class CoreWriteError(OSError):
    """Writing a core failed: ``filename`` is the core being written and ``strerror`` the reason. The
    error it replaces, its cause, may name the hidden temporary file the writer failed on, or no file
    at all (a full disk)."""


CONTRACT_PROBLEMS_SHOWN = 3
"""The contract problems a build error lists; the rest are counted."""

CONTRACT_ERROR_CHARS = 1000
"""The longest contract error line a build prints (one problem can name many buffers)."""

_PROBLEM_LISTING = re.compile(r"invalid contract \((\d+) problems\): (.*)", re.DOTALL)


def shortened_contract_error(message: str) -> str:
    """A contract error of Helios' ``prepare_contract`` cut to one line of at most
    :data:`CONTRACT_ERROR_CHARS` characters: its first :data:`CONTRACT_PROBLEMS_SHOWN` problems and the
    count of the others (a wrong capacity can give a problem for every buffer and program)."""
    listing = _PROBLEM_LISTING.fullmatch(message)
    if listing is not None:
        count, problems = int(listing.group(1)), listing.group(2).split("; ")
        if len(problems) > CONTRACT_PROBLEMS_SHOWN:
            shown = "; ".join(problems[:CONTRACT_PROBLEMS_SHOWN])
            message = f"invalid contract ({count} problems): {shown}; and {count - CONTRACT_PROBLEMS_SHOWN} more"
    message = " ".join(message.split())
    if len(message) > CONTRACT_ERROR_CHARS:
        message = message[: CONTRACT_ERROR_CHARS - 3] + "..."
    return message


def _as_resource_message(resource: ResourceInput) -> cb.ExecutableResource:
    """The signed resource description a reader will see (lengths only; hashes do not matter here)."""
    return cb.ExecutableResource(
        id=resource.id,
        kind=resource.kind,  # type: ignore[arg-type]
        decoded_nbytes=len(resource.data),
        rank=resource.rank,
    )
