"""`ReplicaSetLLM`: the engine the OpenAI server talks to when replicas serve, an `EngineClient`
(vlm_sdk/engine_client.py: build_prompt, generate, chat_stream, stats, args, output_processor,
is_alive, on_death, shutdown, as `AsyncLLM`), each call sent through Ray Serve's handle to the replica
the router picks.

Errors: a replica's own refusal (`InvalidRequestError`, `InputTooLongError`, ...) is raised as itself;
a replica that dies fails the requests it held with `ReplicaLostError` (HTTP 503, code replica_lost),
and Serve replaces it while the others go on serving.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import ray
from ray.exceptions import RayActorError, RayTaskError

from vlm_sdk.engine.output.output_processor import OutputProcessor
from vlm_sdk.errors import InvalidRequestError, ReplicaLostError
from vlm_sdk.hub import resolve_model
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.multimodal.prompts import as_prompt
from vlm_sdk.replicas.routing import RoutingConfig
from vlm_sdk.replicas.stats import combine
from vlm_sdk.sampling_params import SamplingParams


def _raise_cause(e: Exception, what: str):
    """A replica's exception as the caller should see it."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, Exception) and not isinstance(e.cause, RayActorError):
        raise e.cause from None
    if isinstance(e, (RayActorError, RayTaskError)):
        raise ReplicaLostError(f"the replica serving this request died during {what}; the other replicas go on "
                               f"serving and Ray Serve starts a replacement: retry the request "
                               f"({type(e).__name__})") from None
    raise e


class ReplicaSetLLM:
    def __init__(self, handle, model: str, board, routing: RoutingConfig, args, on_shutdown=None):
        """`args`: the replicas' `EngineArgs` (as a replica reports them: its per-request limits)."""
        self._handle = handle
        self.args = args
        self._board = board
        self.routing = routing
        self.output_processor = OutputProcessor(load_tokenizer(resolve_model(model, args.revision)))
        self._on_shutdown = on_shutdown  # deletes the Serve application (and the cluster it started)
        self._closed = False
        self._stats: dict = {}
        self._stats_at = float("-inf")

    def with_routing(self, routing: RoutingConfig) -> "ReplicaSetLLM":
        """The same replicas, each request routed by `routing.policy` (the router reads it per request);
        shutting the copy down leaves the replicas running. The benchmark compares policies with it."""
        copy = object.__new__(ReplicaSetLLM)
        copy.__dict__.update(self.__dict__, routing=routing, _on_shutdown=None, _stats={}, _stats_at=float("-inf"))
        return copy

    # -- EngineClient (what the server uses) -----------------------------------------------------------
    async def build_prompt(self, request, params: SamplingParams | None = None, options=None,
                           group: str | None = None) -> PromptInputs:
        self._check_open()
        try:
            return await self._handle.build_prompt.remote(request, params, options, group,
                                                          routing_policy=self.routing.policy)
        except (RayTaskError, RayActorError) as e:
            _raise_cause(e, "prompt building")

    async def render(self, request, params: SamplingParams | None = None, options=None, group: str | None = None):
        """One replica's dry run (routed as build_prompt is): its cache, not the others'."""
        self._check_open()
        try:
            return await self._handle.render.remote(request, params, options, group,
                                                    routing_policy=self.routing.policy)
        except (RayTaskError, RayActorError) as e:
            _raise_cause(e, "render")

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, group: str | None = None) -> AsyncIterator:
        self._check_open()
        if not isinstance(prompt, PromptInputs):
            prompt = await self.build_prompt(as_prompt(prompt), params, group=group)
        stream = self._handle.options(stream=True).generate.remote(prompt, params, request_id, group,
                                                                    routing_policy=self.routing.policy)
        done = False
        try:
            async for out in stream:
                yield out
            done = True
        except (RayTaskError, RayActorError) as e:
            done = True
            _raise_cause(e, "generation")
        finally:
            if not done:  # closed early or cancelled: the replica's stream is cancelled, which aborts it
                stream.cancel()

    async def chat_stream(self, messages, params: SamplingParams | None = None, request_id: str | None = None,
                          **chat_options):
        from vlm_sdk.chat_options import ChatOptions
        prompt = await self.build_prompt(messages, params, ChatOptions(**chat_options))
        async for out in self.generate(prompt, params, request_id):
            yield out

    def stats(self) -> dict:
        """The replicas' stats combined (stats.combine), read at most every `stats_period_s`."""
        now = time.monotonic()
        if now - self._stats_at >= self.routing.stats_period_s or not self._stats:
            stale_s = max(10 * self.routing.stats_period_s, 5.0)
            per_replica = ray.get(self._board.read.remote(stale_s), timeout=10)
            if per_replica or not self._stats:
                self._stats, self._stats_at = combine(per_replica), now
        return self._stats

    def replica_pids(self) -> dict[str, int]:
        """Every replica that has reported -> its process id (the dead ones too)."""
        return ray.get(self._board.pids.remote(), timeout=10)

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def on_death(self, callback) -> None:
        """Never called: a replica that dies is replaced by Serve, and the set keeps serving."""

    async def shutdown(self, timeout: float | None = None) -> bool:
        if not self._closed:
            self._closed = True
            if self._on_shutdown is not None:  # blocking Ray calls: off the event loop
                await asyncio.get_running_loop().run_in_executor(None, self._on_shutdown)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("the replicas have been shut down")
