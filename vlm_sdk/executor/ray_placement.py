"""Where the Ray executor's ranks go: the Ray cluster it joins and the placement group that holds one
bundle per rank (after vLLM's ray_utils).

    cluster    the one this process already joined (a Ray Serve replica, a script's ray.init), else
               `ray.init()`: the cluster RAY_ADDRESS names, else the one `ray start --head` runs on this
               node, else a new local one (shut down with the engine)
    placement  the placement group this process runs in, when it has one (a Ray Serve replica's, whose
               bundle 0 holds the replica itself, i.e. rank 0): bundles 1..N-1 take ranks 1..N-1. Else a
               new group of N bundles (one GPU each on CUDA, one CPU on the CPU) with the strategy
               `ray_placement_strategy`; bundle 0 is pinned to this node and reserves rank 0's device
               (rank 0 runs in this process, not in an actor), the others are ranks 1..N-1's
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from vlm_sdk.errors import InvalidRequestError, RayNotInstalledError

logger = logging.getLogger("vlm_sdk")

INSTALL_HINT = ("distributed_executor_backend='ray' (--distributed-executor-backend ray) runs the tensor-parallel "
                "ranks as Ray actors, and Ray is not installed: pip install 'vlm-sdk[ray]' (or pip install ray), or "
                "leave the backend out to run the ranks as processes on this machine (torchrun runs them on "
                "several machines without Ray)")
_PLACEMENT_SECONDS = 120.0  # the longest the cluster may take to find room for every bundle


def require_ray() -> None:
    """Raise `RayNotInstalledError` saying how to install Ray unless `ray` imports."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise RayNotInstalledError(f"{INSTALL_HINT} ({e})") from None


def join_cluster() -> bool:
    """Join a Ray cluster unless this process is in one already; True when this call joined (or
    started) it, so the engine's shutdown leaves it again."""
    import ray
    if ray.is_initialized():
        return False
    ray.init(include_dashboard=False)
    return True


@dataclass(frozen=True)
class Placement:
    """The placement group and which of its bundles hold ranks 1..N-1 (`bundles[r - 1]` is rank r's);
    `owned`: created here, removed at shutdown."""
    group: Any
    bundles: tuple[int, ...]
    owned: bool
    resources: tuple[dict, ...]  # each rank's bundle, as placed (rank 1 first)

    def rank_options(self, rank: int, on_cuda: bool) -> dict:
        """`ray.remote(...).options(**...)` for the actor of rank `rank` > 0: in its bundle, holding
        its GPU (Ray then sets CUDA_VISIBLE_DEVICES to it) or one CPU."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                    placement_group_bundle_index=self.bundles[rank - 1])
        resources = {"num_gpus": 1, "num_cpus": 0} if on_cuda else {"num_cpus": 1}
        return {"scheduling_strategy": strategy, **resources}

    def rank0_gpu(self) -> int:
        """The index (in this process's CUDA_VISIBLE_DEVICES) of the GPU Ray gave bundle 0 of a group made
        here: rank 0 runs on it, so no rank actor on this node is given the same GPU. (In a group of its
        own, a Serve replica's, Ray made that GPU this process's only visible one: cuda:0.)"""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        probe = ray.remote(_gpu_ids).options(num_gpus=1, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=0))
        gpu = str(ray.get(probe.remote(), timeout=_PLACEMENT_SECONDS)[0])
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if not visible:
            return int(gpu)
        if gpu not in visible:
            raise InvalidRequestError(
                f"Ray gave rank 0 GPU {gpu} of this node, which this process does not see (CUDA_VISIBLE_DEVICES="
                f"{','.join(visible)}): start the engine with the GPUs `ray start` was given visible (or unset "
                f"CUDA_VISIBLE_DEVICES)", param="distributed_executor_backend")
        return visible.index(gpu)

    def remove(self) -> None:
        if not self.owned:
            return
        from ray.util import remove_placement_group
        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - the cluster is gone already
            pass


def _gpu_ids() -> list:
    """In a Ray task: the GPUs Ray gave it."""
    import ray
    return ray.get_gpu_ids()


def rank_bundle(on_cuda: bool) -> dict:
    """The resources one rank > 0 holds (a Ray Serve replica's bundles 1..N-1 are these too)."""
    return {"GPU": 1.0} if on_cuda else {"CPU": 1.0}


def place_ranks(size: int, on_cuda: bool, strategy: str) -> Placement:
    """The placement of ranks 1..`size`-1: in this process's placement group when it has one, else in
    a new one (see the module's docstring). Refused, naming the bundles, when the group cannot hold
    them or the cluster finds no room within `_PLACEMENT_SECONDS`."""
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group
    device_key = "GPU" if on_cuda else "CPU"
    current = get_current_placement_group()
    if current is not None:
        specs = current.bundle_specs
        usable = [i for i in range(1, len(specs)) if specs[i].get(device_key, 0) >= 1]
        if len(usable) < size - 1:
            raise InvalidRequestError(
                f"tensor_parallel_size={size} on Ray inside a placement group needs bundles 1..{size - 1} to hold a "
                f"{device_key} each (bundle 0 is this process's, rank 0's), but the group's bundles are {specs}: give "
                f"the deployment one bundle per rank (vlm_sdk.replicas does)", param="tensor_parallel_size")
        picked = tuple(usable[:size - 1])
        return Placement(current, picked, False, tuple(specs[i] for i in picked))
    this_node = ray.util.get_node_ip_address()
    # bundle 0 reserves rank 0's device on this node: the pin is a sliver of the node's own resource
    specs = [{**rank_bundle(on_cuda), f"node:{this_node}": 0.001}] + [rank_bundle(on_cuda) for _ in range(size - 1)]
    group = placement_group(specs, strategy=strategy)
    if not group.wait(timeout_seconds=_PLACEMENT_SECONDS):
        from ray.util import remove_placement_group
        remove_placement_group(group)
        raise InvalidRequestError(
            f"the Ray cluster found no room for tensor_parallel_size={size} within {_PLACEMENT_SECONDS:g} s: "
            f"bundles {specs} with strategy {strategy} (bundle 0 on this node, {this_node}), cluster resources "
            f"{ray.cluster_resources()}. Add nodes (ray start --address ...), free {device_key}s, or pick another "
            f"--ray-placement-strategy (STRICT_SPREAD needs a node per rank)", param="tensor_parallel_size")
    logger.info("tensor parallel on Ray: placement group of %d bundles (%s), strategy %s", size, device_key, strategy)
    return Placement(group, tuple(range(1, size)), True, tuple(specs[1:]))
