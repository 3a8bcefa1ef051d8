"""`CacheAwareRouter`: Ray Serve's request-router extension point running the rule of routing.py.

Serve builds one in every process that holds a handle to the replicas (here: the HTTP server) with
`initialize_state(**RoutingConfig fields)`, keeps its replica set current (a replica that dies is
dropped at once: `on_replica_actor_died`) and asks `choose_replicas` for ranks of replicas; within a
rank it takes the one with the shortest queue that accepts. Each replica's `record_routing_stats`
(deployment.py) reports its engine's running + waiting requests and KV usage every
`stats_period_s`; Serve's own count of requests in flight per replica is current to the request.
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vlm_sdk.replicas.routing import AffinityTable, Load, RoutingConfig, prompt_keys, rank_replicas


def _prompt_of(pending_request: Optional[PendingRequest]):
    """The built prompt (`PromptInputs`) a `generate` call carries; None for other calls."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if hasattr(arg, "token_ids") and hasattr(arg, "images"):
            return arg
    return None


def _policy_of(pending_request: Optional[PendingRequest], default: str) -> str:
    """A request may name its policy (`routing_policy=`): the benchmark and the tests compare policies
    on the same replicas."""
    if pending_request is None:
        return default
    return pending_request.kwargs.get("routing_policy") or default


class CacheAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **config):
        self.config = RoutingConfig(**config)
        self.affinity = AffinityTable(self.config.affinity_entries)
        self._keys: dict[str, list[str]] = {}  # internal request id -> its keys, until it is routed
        self._turn = 0  # round robin's position

    def _load(self, replica: RunningReplica) -> Load:
        stats = replica.routing_stats or {}
        in_flight = max(self.replica_queue_len_cache.get(replica.replica_id) or 0, stats.get("in_flight", 0))
        return Load(in_flight, float(stats.get("kv_usage", 0.0)))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if not by_id:
            return []
        if _policy_of(pending_request, self.config.policy) == "round_robin":
            order = sorted(by_id)
            self._turn += 1
            first = order[self._turn % len(order)]
            return [[by_id[first]]] + [[by_id[r]] for r in order if r != first]
        prompt = _prompt_of(pending_request)
        keys = prompt_keys(prompt, self.config.chunk_tokens, self.config.prefix_tokens) if prompt is not None else []
        if keys:
            self._keys[pending_request.metadata.internal_request_id] = keys
        owner = self.affinity.owner(keys)
        ranks = rank_replicas(owner, {rid: self._load(r) for rid, r in by_id.items()}, self.config)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = self._keys.pop(pending_request.metadata.internal_request_id, None)
        if keys:
            self.affinity.record(keys, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.to_full_id_str())
