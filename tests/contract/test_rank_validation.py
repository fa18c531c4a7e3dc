"""Tensor-parallel buffer declarations: replicated and per-rank buffers, resource ranks, runtime rank support.

The golden payload-v3 core made a two-rank core: ``blk.0.attn_q.weight`` declared once per rank, each
reading its own rank's resource; every other buffer stays replicated.
"""

from __future__ import annotations

import re

import pytest

from helios_core.contract import RuntimeCapabilities, check_runtime_support
from helios_core.errors import ContractError, UnsupportedFeatureError
from helios_core.wire import manifest_pb2 as mf

PER_RANK = "blk.0.attn_q.weight"


def two_ranks(parts, *, name: str = PER_RANK) -> mf.BufferDecl:
    """Make ``parts`` a two-rank core whose ``name`` is declared per rank; returns rank 1's declaration."""
    parts.execution.ranks = 2
    rank0 = parts.buffer(name)
    resource = next(r for r in parts.resources if r.id == rank0.resource_id)
    copy = type(resource)()
    copy.CopyFrom(resource)
    copy.id = f"{resource.id}.rank1"
    copy.rank = 1
    parts.resources.append(copy)
    rank1 = parts.execution.buffers.add()
    rank1.CopyFrom(rank0)
    rank1.rank = 1
    rank1.resource_id = copy.id
    return rank1


def rejects(parts, message: str) -> None:
    with pytest.raises(ContractError, match=re.escape(message)):
        parts.prepare()


def test_a_name_declared_once_per_rank_is_a_per_rank_buffer(parts) -> None:
    two_ranks(parts)
    prepared = parts.prepare()
    assert prepared.ranks == 2
    assert prepared.buffers[PER_RANK].rank == 0  # rank 0's declaration stands for the name
    assert prepared.buffers["tok_embd"].rank == 0  # declared once: replicated


def test_a_per_rank_name_missing_a_rank(parts) -> None:
    rank1 = two_ranks(parts)
    parts.execution.ranks = 3
    rejects(
        parts,
        f"buffer {PER_RANK!r} is declared 2 times (ranks [0, 1]); a per-rank buffer is declared once for each "
        "rank 0..2",
    )
    parts.execution.ranks = 2
    rank1.rank = 0
    rejects(
        parts,
        f"buffer {PER_RANK!r} is declared 2 times (ranks [0, 0]); a per-rank buffer is declared once for each "
        "rank 0..1",
    )


def test_a_rank_beyond_the_cores_ranks(parts) -> None:
    rank1 = two_ranks(parts)
    rank1.rank = 2
    rejects(parts, f"buffer {PER_RANK!r} names rank 2; the core has 2 ranks")


def test_a_name_declared_once_for_another_rank_than_zero(parts) -> None:
    parts.execution.ranks = 2
    parts.buffer("tok_embd").rank = 1
    rejects(
        parts,
        "buffer 'tok_embd' is declared once, for rank 1; a replicated buffer has rank 0 and a per-rank buffer "
        "is declared once for each rank 0..1",
    )


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda decl: setattr(decl, "dtype", mf.DTYPE_BF16), "dtype"),
        (lambda decl: decl.shape[0].__setattr__("size", 16), "shape"),
        (
            lambda decl: (setattr(decl, "dtype", mf.DTYPE_BF16), decl.shape[0].__setattr__("size", 16)),
            "dtype and shape",
        ),
    ],
)
def test_per_rank_declarations_must_agree(parts, change, what: str) -> None:
    change(two_ranks(parts))
    rejects(parts, f"per-rank buffer {PER_RANK!r}: rank 1's declaration differs from rank 0's in {what}")


def test_per_rank_declarations_must_agree_in_role(parts) -> None:
    rank1 = two_ranks(parts)
    rank1.role = mf.BUFFER_ROLE_SCRATCH
    rejects(parts, f"per-rank buffer {PER_RANK!r}: rank 1's declaration differs from rank 0's in role")


def test_only_weights_and_resource_filled_buffers_are_per_rank(parts) -> None:
    parts.execution.ranks = 2
    scratch = parts.buffer("scratch.h")
    parts.execution.buffers.add().CopyFrom(scratch)
    parts.execution.buffers[-1].rank = 1
    rejects(
        parts,
        "per-rank buffer 'scratch.h' has role BUFFER_ROLE_SCRATCH; only weights and resource-filled (STATE_INIT) "
        "buffers may be declared per rank",
    )


def test_a_per_rank_declaration_reads_its_own_ranks_resource(parts) -> None:
    rank1 = two_ranks(parts)
    rank1.resource_id = parts.buffer(PER_RANK).resource_id  # rank 0's resource
    rejects(
        parts,
        f"per-rank buffer {PER_RANK!r} of rank 1 reads resource 'weights.layer0', which belongs to rank 0",
    )


def test_a_replicated_buffer_reads_a_rank_zero_resource(parts) -> None:
    two_ranks(parts)
    parts.buffer("tok_embd").resource_id = "weights.layer0.rank1"
    rejects(
        parts,
        "replicated buffer 'tok_embd' reads resource 'weights.layer0.rank1' of rank 1; every rank loads it, so "
        "it must belong to rank 0",
    )


def test_a_resource_of_a_rank_the_core_lacks(parts) -> None:
    next(r for r in parts.resources if r.id == "weights.head").rank = 1
    rejects(parts, "resource 'weights.head' names rank 1; the core has 1 ranks")


def test_a_one_rank_core_still_refuses_a_name_declared_twice(parts) -> None:
    parts.execution.buffers.add().CopyFrom(parts.buffer("scratch.h"))
    rejects(parts, "buffer 'scratch.h' is declared twice")


def test_thread_ranks_support_any_count_and_a_limited_backend_says_why(parts) -> None:
    two_ranks(parts)
    prepared = parts.prepare()
    check_runtime_support(prepared, RuntimeCapabilities())
    limited = RuntimeCapabilities(ranks=1, ranks_limit="the CUDA backend runs one rank until multi-GPU is supported")
    with pytest.raises(UnsupportedFeatureError) as caught:
        check_runtime_support(prepared, limited)
    assert str(caught.value) == (
        "the core needs 2 tensor-parallel ranks; this runtime has 1 (the CUDA backend runs one rank until "
        "multi-GPU is supported)"
    )
