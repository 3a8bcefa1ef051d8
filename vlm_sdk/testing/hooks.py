"""Test and benchmark hooks into a running engine's ranks. The engine itself never reaches a rank's
objects (it speaks to them through vlm_sdk/protocol/ and the executor's commands); a test that must
look at or patch rank 0's model, runner or kernel set asks the executor to run a function on the ranks
and return what it finds (vLLM's `collective_rpc` with a callable)."""
from __future__ import annotations

from typing import Any


def _this_worker(worker: Any) -> Any:
    return worker


def local_worker(engine: Any) -> Any:
    """Rank 0's `Worker` (vlm_sdk/worker/worker.py) of an `LLMEngine` with one rank, whose worker
    lives in this process: its `.model`, `.runner`, `.ops`, `.caches`. Under tensor parallelism the
    other ranks' workers live in other processes: ask for plain data instead
    (`engine.executor.collective_rpc("held_state")`)."""
    if engine.executor.world_size != 1:
        raise RuntimeError(f"local_worker needs one rank; this engine has {engine.executor.world_size}: use "
                           f"engine.executor.collective_rpc(<method name>) for plain data from every rank")
    return engine.executor.collective_rpc(_this_worker)[0]


def fail_on_rank(worker: Any, rank: int, message: str) -> None:
    """A command (`collective_rpc(fail_on_rank, rank, message)`) that raises `RuntimeError(message)` on
    rank `rank` only: how tests make one rank fail the way a bug in its step would."""
    if worker.tp.rank == rank:
        raise RuntimeError(message)


def held_experts(worker: Any) -> list[tuple[int, int]]:
    """[start, stop) of the experts each sparse MoE layer of this rank's model holds (all of them, or
    under expert parallelism this rank's): plain data, for `collective_rpc(held_experts)`."""
    from vlm_sdk.layers.moe import SparseMoeBlock
    ranges = [m.expert_range() for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
    return [(r.start, r.stop) for r in ranges]
