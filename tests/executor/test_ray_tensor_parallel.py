"""Tensor parallelism on Ray (`distributed_executor_backend="ray"`, vlm_sdk/executor/ray_executor.py) on
the CPU (gloo), in one local Ray cluster for the module: rank 1 is a Ray actor placed by the engine's
placement group (PACK: one machine here; STRICT_SPREAD needs a node per rank).

- two ranks give the greedy tokens of one rank (text, images, a batch); shutdown ends the actor's
  process and removes the placement group;
- killing the rank's actor mid-stream fails the stream at once with an error naming the rank and its
  actor, and the engine shuts down leaving no rank process; a rank that raises fails the call with its
  error (reported through rank 0's store);
- a Ray Serve replica with tensor_parallel_size=2 runs its rank 1 in its own placement group;
- on CUDA rank 0 takes the GPU Ray gave bundle 0 (checked on the cluster's declared GPUs); a placement
  the cluster cannot hold (STRICT_SPREAD on one node) is refused and its group removed;
- without Ray installed the backend says how to install it.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from helpers import conversations, process_alive
from vlm_sdk import LLM, AsyncLLM, SamplingParams
from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import EngineDeadError, InvalidRequestError, RayNotInstalledError
from vlm_sdk.executor import ray_placement
from vlm_sdk.executor.ray_placement import _gpu_ids, place_ranks
from vlm_sdk.testing.hooks import fail_on_rank

RAY_TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray", "show_progress": False, "num_blocks": 48}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _wait_until_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not process_alive(pid)


def test_two_ray_ranks_give_the_tokens_of_one_and_leave_nothing(tiny_ckpt, local_ray):
    convs = list(conversations().values())
    with LLM(tiny_ckpt, show_progress=False, num_blocks=48) as one:
        expected = [o.token_ids for o in one.chat(convs, GREEDY)]
    two = LLM(tiny_ckpt, **RAY_TP)
    try:
        ranks = two.engine.executor.rank_processes()
        (pid, node), = ranks.values()
        assert list(ranks) == [1] and pid != os.getpid() and node == local_ray.util.get_node_ip_address()
        assert [o.token_ids for o in two.chat(convs, GREEDY)] == expected
        assert [two.chat(c, GREEDY)[0].token_ids for c in convs[:2]] == expected[:2]
        assert two.engine.executor.collective_rpc("held_state") == [(0, 0), (0, 0)]
        group = two.engine.executor._placement.group
        assert local_ray.util.placement_group_table(group)["strategy"] == "PACK"
    finally:
        two.shutdown()
    assert _wait_until_gone(pid), f"rank 1's actor process {pid} outlived the engine's shutdown"
    assert local_ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_killing_a_rank_actor_mid_stream_fails_the_stream(tiny_ckpt, local_ray):
    async def main():
        llm = AsyncLLM(tiny_ckpt, **RAY_TP)
        executor = llm.engine.executor
        (pid, _), = executor.rank_processes().values()
        got, t_kill = 0, None
        try:
            with pytest.raises(EngineDeadError) as failed:
                async for out in llm.chat_stream(conversations()["text"], SamplingParams(max_tokens=3000,
                                                                                          ignore_eos=True)):
                    got = len(out.token_ids)
                    if got >= 3 and t_kill is None:
                        t_kill = time.monotonic()
                        local_ray.kill(executor._actors[0])
            assert time.monotonic() - t_kill < 30, "the stream outlived its rank by the collective timeout"
            assert got < 3000
        finally:
            await llm.shutdown()
        return str(failed.value), pid
    message, pid = asyncio.run(main())
    assert "tensor-parallel rank 1 (Ray actor, pid" in message and "died" in message, message
    assert "engine stopped" in message, message
    assert _wait_until_gone(pid), f"the killed rank's process {pid} is still there"


def test_a_rank_that_raises_fails_the_call_with_its_error(tiny_ckpt, local_ray):
    """The rank's RankFailure reaches rank 0 through the store: the error names the rank and its error."""
    llm = LLM(tiny_ckpt, **RAY_TP)
    (pid, _), = llm.engine.executor.rank_processes().values()
    try:
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 failed: RuntimeError: a bug on rank 1"):
            llm.engine.executor.collective_rpc(fail_on_rank, 1, "a bug on rank 1")
    finally:
        llm.shutdown()
    assert _wait_until_gone(pid), f"the failed rank's process {pid} is still there"


def test_the_ray_backend_without_ray_says_how_to_install_it(tiny_ckpt, monkeypatch):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayNotInstalledError, match=r"pip install 'vlm-sdk\[ray\]'") as refused:
        LLM(tiny_ckpt, **RAY_TP)
    assert "--distributed-executor-backend ray" in str(refused.value)


def test_the_backend_and_placement_strategy_are_checked():
    with pytest.raises(InvalidRequestError, match=r"distributed_executor_backend must be one of \[None, 'mp', 'ray'\]"):
        EngineArgs.from_kwargs(distributed_executor_backend="Ray")
    with pytest.raises(InvalidRequestError, match=r"ray_placement_strategy must be one of .*'STRICT_SPREAD'.*got 'spread'"):
        EngineArgs.from_kwargs(ray_placement_strategy="spread")


def test_a_tensor_parallel_replica_places_its_ranks_in_its_own_placement_group(tiny_ckpt, local_ray):
    """A Ray Serve replica with tensor_parallel_size=2: bundle 0 holds the replica (rank 0), bundle 1 its
    rank-1 actor (the Ray executor finds the replica's group); the replica answers as one rank does, and
    deleting it removes the group (and with it the actor)."""
    from vlm_sdk.replicas.launch import ReplicaConfig, serve_replicas
    conv = conversations()["one_image"]
    with LLM(tiny_ckpt, show_progress=False, num_blocks=48) as one:
        expected = one.chat(conv, GREEDY)[0].token_ids
    llm = serve_replicas(tiny_ckpt, ReplicaConfig(data_parallel_size=1, replica_cpus=0.5), tensor_parallel_size=2,
                         num_blocks=48)

    async def ask() -> list[int]:
        async for out in llm.chat_stream(conv, GREEDY):
            pass
        return out.token_ids
    try:
        assert asyncio.run(ask()) == expected
        groups = [g for g in local_ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [list(g["bundles"].values()) for g in groups] == [[{"CPU": 0.5}, {"CPU": 1.0}]]
    finally:
        asyncio.run(llm.shutdown())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(g["state"] == "CREATED" for g in local_ray.util.placement_group_table().values()):
        time.sleep(0.2)
    assert not [g for g in local_ray.util.placement_group_table().values() if g["state"] == "CREATED"]


def test_on_cuda_rank_0_takes_the_gpu_ray_gave_bundle_0(local_ray, monkeypatch):
    """GPU placement, on the local cluster's 2 declared GPUs (Ray's counts: no CUDA needed): bundle 0
    (rank 0, this process) and rank 1's actor get different GPUs; rank 0's index is read in this
    process's CUDA_VISIBLE_DEVICES, and a GPU it does not see is refused."""
    placement = place_ranks(2, on_cuda=True, strategy="PACK")
    try:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        rank0 = placement.rank0_gpu()
        rank1 = local_ray.get(local_ray.remote(_gpu_ids).options(**placement.rank_options(1, on_cuda=True)).remote())
        assert sorted([rank0, int(rank1[0])]) == [0, 1]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
        assert placement.rank0_gpu() == [1, 0].index(rank0)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
        with pytest.raises(InvalidRequestError, match=f"Ray gave rank 0 GPU {rank0} of this node, which this process "
                                                      f"does not see"):
            placement.rank0_gpu()
    finally:
        placement.remove()


def test_a_placement_the_cluster_cannot_hold_is_refused(local_ray, monkeypatch):
    """STRICT_SPREAD puts each rank on a node of its own: one node cannot; refused naming the bundles,
    the strategy and the cluster's resources, and the pending group is removed."""
    monkeypatch.setattr(ray_placement, "_PLACEMENT_SECONDS", 1.0)
    with pytest.raises(InvalidRequestError, match=r"found no room for tensor_parallel_size=2 within 1 s: bundles "
                                                  r"\[\{'CPU': 1.0, 'node:[0-9.]+': 0.001\}, \{'CPU': 1.0\}\] with "
                                                  r"strategy STRICT_SPREAD .* cluster resources"):
        place_ranks(2, on_cuda=False, strategy="STRICT_SPREAD")
    live = [g for g in local_ray.util.placement_group_table().values() if g["state"] in ("PENDING", "CREATED")]
    assert not live, live
