"""Prefix-affinity request routing for the Helios replicas (a Ray Serve custom request router).

Requests whose prompts start alike should reach the same replica, whose Helios reuses the cached
pages of that prefix. The ingress computes an affinity key, the first characters of the prompt or of
the conversation (:func:`helios_ray.deployment.affinity_key`), and passes it as the keyword argument
``affinity_key``. The router ranks the replicas by rendezvous hashing of the key with each replica's
id: the top replica is preferred, the others form the fallback rank that Ray Serve uses (least
loaded first) when the preferred one has no free slot. Replica churn moves only the keys of the
replicas that came or went. Requests without a key go to the least loaded replica.

A request the ingress resends because a replica's Helios could not be reached names the replicas it
already tried (keyword argument ``excluded_replicas``); they are left out of the candidates while
any other replica remains.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

__all__ = ["PrefixAffinityRouter", "rendezvous_order"]


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replicas: list[str]) -> list[str]:
    """``replicas`` from most to least preferred for ``key`` (highest random weight first)."""
    return sorted(replicas, key=lambda replica: (_weight(key, replica), replica), reverse=True)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):  # type: ignore[misc]
    """Prefer the replica that rendezvous hashing assigns to the request's affinity key."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = {} if pending_request is None else pending_request.kwargs
        excluded = set(kwargs.get("excluded_replicas") or ())
        if excluded:
            remaining = [replica for replica in candidate_replicas if replica.replica_id.unique_id not in excluded]
            candidate_replicas = remaining or candidate_replicas
        key = kwargs.get("affinity_key")
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        order = rendezvous_order(key, list(by_id))
        return [[by_id[order[0]]], [by_id[replica] for replica in order[1:]]]
