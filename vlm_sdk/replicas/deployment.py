"""`EngineReplica`: one Ray Serve replica, an `AsyncLLM` (tensor parallel inside it as without Ray).

The server's process builds no prompt and runs no model: `build_prompt` (image decoding, the chat
template, tokenizing) and `generate` both run here; the built prompt travels back and forth so that
the router can key it (routing.py) and the replica that generates need not build it again.
"""
from __future__ import annotations

import os

from vlm_sdk.async_llm import AsyncLLM
from vlm_sdk.engine.gil import set_server_switch_interval
from vlm_sdk.engine.heap import bound_server_heap


class EngineReplica:
    def __init__(self, model: str, engine_args: dict, board=None):
        from ray import serve
        bound_server_heap()  # a serving process, as `vlm-sdk serve`'s (engine/heap.py, engine/gil.py)
        set_server_switch_interval()
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.llm = AsyncLLM(model, **engine_args)
        self._board = board  # stats.StatsBoard actor: where the server reads every replica's stats

    def info(self) -> dict:
        return {"replica": self.replica_id, "pid": os.getpid(), "stats": self.llm.stats(), "args": self.llm.args}

    async def build_prompt(self, request, params=None, options=None, group=None, routing_policy=None):
        return await self.llm.build_prompt(request, params, options, group=group)

    async def render(self, request, params=None, options=None, group=None, routing_policy=None):
        return await self.llm.render(request, params, options, group=group)

    async def generate(self, prompt, params=None, request_id=None, group=None, routing_policy=None):
        async for out in self.llm.generate(prompt, params, request_id, group=group):
            yield out

    def record_routing_stats(self) -> dict:
        """Serve calls this every `request_routing_stats_period_s`; the router reads what it returns."""
        stats = self.llm.stats()
        if self._board is not None:
            self._board.put.remote(self.replica_id, stats, os.getpid())
        total = stats["kv_blocks_total"]
        return {"in_flight": stats["num_running"] + stats["num_waiting"],
                "kv_usage": stats["kv_blocks_used"] / total if total else 0.0}

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; raising marks the replica unhealthy and Serve
        replaces it."""
        if not self.llm.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: its engine has stopped (its error is in the replica's log)")
