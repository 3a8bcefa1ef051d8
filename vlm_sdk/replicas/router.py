"""`CacheAwareRouter`: Ray Serve's request-router extension point running the rule of routing.py.

Serve builds one in every process that holds a handle to the replicas (here: the HTTP server) with
`initialize_state(**RoutingConfig fields)`, keeps its replica set current (a replica that dies is
dropped at once: `on_replica_actor_died`) and asks `choose_replicas` for ranks of replicas; within a
rank it takes the one with the shortest queue that accepts. Each replica's `record_routing_stats`
(deployment.py) reports its engine's running + waiting requests and KV usage every
`stats_period_s`; Serve's own count of requests in flight per replica is current to the request.
"""
from __future__ import annotations

import time
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vlm_sdk.replicas.routing import AffinityTable, Load, RoutingConfig, prompt_keys, rank_replicas

_FORGET_S = 60.0  # a request ranked but never routed (cancelled while queued) stops counting after this


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
        # internal request id -> (its keys, the replica ranked first, when), until Serve reports where it
        # went (a request cancelled before that is dropped after _FORGET_S)
        self._chosen: dict[str, tuple[list[str], str, float]] = {}
        # generations ranked first on a replica (tentatively, until routed) or sent to it and not yet
        # finished: a burst of new conversations is spread before any has reached a replica
        self._in_flight: dict[str, int] = {}
        self._sent: dict[str, str] = {}  # internal request id -> the replica it went to, until it ends
        self._turn = 0  # round robin's position

    def _load(self, rid: str, replica: RunningReplica) -> Load:
        stats = replica.routing_stats or {}
        return Load(self._in_flight.get(rid, 0), float(stats.get("kv_usage", 0.0)), int(stats.get("in_flight", 0)))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if not by_id:
            return []
        prompt = _prompt_of(pending_request)  # None: prompt building, which any replica does alike
        if prompt is not None and _policy_of(pending_request, self.config.policy) == "round_robin":
            order = sorted(by_id)
            self._turn += 1
            first = order[self._turn % len(order)]
            return [[by_id[first]]] + [[by_id[r]] for r in order if r != first]
        keys = prompt_keys(prompt, self.config.chunk_tokens, self.config.prefix_tokens) if prompt is not None else []
        ranks = rank_replicas(self.affinity.owner(keys), {rid: self._load(rid, r) for rid, r in by_id.items()},
                              self.affinity.counts(), self.config)
        request_id = pending_request.metadata.internal_request_id if prompt is not None else None
        if request_id is not None and request_id not in self._chosen:
            self._forget_old()
            first = ranks[0][0]
            self._chosen[request_id] = (keys, first, time.monotonic())
            self._in_flight[first] = self._in_flight.get(first, 0) + 1
            self.affinity.record(keys, first)  # tentatively: the next request of a burst sees it
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def _forget_old(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (_, _, t) in self._chosen.items() if now - t > _FORGET_S]:
            self._in_flight[self._chosen.pop(request_id)[1]] -= 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        keys, first, _ = self._chosen.pop(request_id, ([], None, 0.0))
        if first is None:
            return
        rid = replica_id.to_full_id_str()
        self._in_flight[first] -= 1
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._sent[request_id] = rid
        if rid != first and keys:
            self.affinity.record(keys, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._sent.pop(internal_request_id, None)
        if rid is not None:
            self._in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.to_full_id_str()
        self.affinity.forget(rid)
        self._in_flight.pop(rid, None)
