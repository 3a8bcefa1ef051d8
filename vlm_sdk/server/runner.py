"""Running the server: `ServerRunner` binds it to a socket, `serve` runs `vlm-sdk serve` (signals,
graceful drain). `vlm_sdk.server.background.BackgroundServer` runs one on a thread of its own.

Shutdown order on SIGTERM/SIGINT: stop listening and refuse new chat requests (503; connections
stay open until the end, as aiohttp stops reading a body being uploaded on a closing one), give
in-flight requests up to `shutdown_timeout` seconds to finish, abort the rest (streams get
finish_reason "abort" and [DONE]), then cancel whatever handler is still stuck on a client that does
not read, and stop the engine thread. Every stage after the drain is bounded, so
the process exits within `shutdown_timeout` + 2 s whatever the clients do.

Engine death (an internal error, a lost tensor-parallel rank): the engine fails every open request
and logs its traceback once; `vlm-sdk serve` then lets the handlers send those errors, stops, and
exits with status 1, so that a supervisor restarts it instead of a server that answers 503 forever.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

from aiohttp import web

from vlm_sdk.async_llm import AsyncLLM
from vlm_sdk.hub import display_name
from vlm_sdk.server.app import OpenAIServer
from vlm_sdk.server.config import ServerConfig, server_engine_args
from vlm_sdk.server.connections import LimitedAppRunner

logger = logging.getLogger("vlm_sdk.server")

# after the drain: streams aborted by the engine get this long to send their last chunk, and aiohttp
# this long (twice: wait, then cancel) for a handler stuck writing to a client that does not read
_FINISH_S = 0.25
EXIT_ENGINE_DEAD = 1


def served_name(model: str, config: ServerConfig) -> str:
    return config.served_model_name or display_name(model)


class ServerRunner:
    """An `OpenAIServer` bound to a socket on the running loop."""

    def __init__(self, engine: AsyncLLM, config: ServerConfig, model_name: str):
        self.server = OpenAIServer(engine, config, model_name)
        self.config = config
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        server = self._runner.server if self._runner is not None else None
        return len(server.connections) if server is not None else 0

    async def start(self) -> str:
        # the engine is built: what is alive now lives as long as the server. Out of the collector's way,
        # a full collection scans only what requests allocate (over torch's and transformers' objects
        # one held the GIL, and so every stream, for 0.3-0.6 s)
        gc.collect()
        gc.freeze()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
        self._runner = LimitedAppRunner(self.server.app, handler_cancellation=True, access_log=None,
                                        shutdown_timeout=_FINISH_S, max_connections=self.config.max_connections,
                                        keep_alive_timeout=self.config.keep_alive_timeout,
                                        on_error=self.server.metrics.error)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.url

    async def stop(self, drain_s: float | None = None) -> None:
        """Drain: stop listening, refuse new requests, wait up to `drain_s`
        (default shutdown_timeout) for in-flight ones, then stop the engine, which ends what is left
        with finish_reason "abort" (streams still get their last chunk and [DONE]), and close the
        connections, cancelling handlers stuck on clients that do not read."""
        self.server.draining = True
        if self._runner is None:
            return
        drain_s = self.config.shutdown_timeout if drain_s is None else drain_s
        for site in list(self._runner.sites):
            await site.stop()
        if not await self.server.wait_idle(drain_s):
            logger.warning("%d request(s) still running after %g s (--shutdown-timeout): aborting them",
                           self.server.in_flight, drain_s)
            await self.server.engine.shutdown(timeout=_FINISH_S)
            await self.server.wait_idle(_FINISH_S)
        await self._runner.cleanup()
        self._runner = None
        gc.unfreeze()  # what the process finalises at exit is finalised as usual (nanobind counts it)


def serve(model: str, config: ServerConfig, replicas=None, routing=None, **engine_args) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, return 0. `replicas`
    (`vlm_sdk.replicas.launch.ReplicaConfig`): data-parallel replicas on Ray Serve, routed by `routing`
    (`vlm_sdk.replicas.routing.RoutingConfig`), instead of one engine in this process."""
    if replicas is not None:
        from vlm_sdk.replicas import require_ray
        require_ray()  # before anything loads: the error says how to install it
        from vlm_sdk.replicas.launch import serve_replicas
        engine = serve_replicas(model, replicas, routing, **server_engine_args(engine_args))
    else:
        engine = AsyncLLM(model, **server_engine_args(engine_args))
    return asyncio.run(_serve(engine, config, served_name(model, config)))


async def _serve(engine: AsyncLLM, config: ServerConfig, name: str) -> int:
    runner = ServerRunner(engine, config, name)
    # before the URL is printed (a supervisor may signal as soon as it reads it): until then SIGTERM is
    # Ray's handler of a replica set (sys.exit(15)) or the default (death), not the graceful drain
    stop, dead = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await runner.start()
    except OSError as e:  # port taken, address not local, no permission
        await runner.stop()
        await engine.shutdown()
        print(f"error: cannot listen on {config.host}:{config.port}: {e.strerror or e}; choose another --port "
              f"or --host", file=sys.stderr)
        return 2
    s = engine.stats()
    print(f"[vlm-sdk] serving {name!r} at {url} (OpenAI API under {url}/v1); KV cache {s['kv_blocks_total']} "
          f"blocks x {s['kv_block_size']} tokens = {s['kv_capacity_tokens']} tokens, max_model_len "
          f"{s['max_model_len']}" + (f" ({s['num_replicas']} replicas together)" if "num_replicas" in s else ""),
          flush=True)
    engine.on_death(lambda _err: loop.call_soon_threadsafe(dead.set))
    await _first(stop.wait(), dead.wait())
    if dead.is_set():
        print(f"[vlm-sdk] the engine stopped (its error is logged above); open requests were failed; exiting "
              f"with status {EXIT_ENGINE_DEAD} so that a supervisor can restart the server", file=sys.stderr,
              flush=True)
        await runner.stop(drain_s=min(config.shutdown_timeout, 1.0))  # the failed requests send their errors
        await engine.shutdown(timeout=_FINISH_S)
        return EXIT_ENGINE_DEAD
    s = engine.stats()
    running = s["num_running"] + s["num_waiting"]
    print(f"[vlm-sdk] shutting down: {running} request(s) in flight get up to {config.shutdown_timeout:g} s "
          f"(--shutdown-timeout)", file=sys.stderr, flush=True)
    deadline = loop.time() + config.shutdown_timeout + 1.5  # the promise is shutdown_timeout + 2 s
    await runner.stop()
    if not await engine.shutdown(timeout=max(0.1, deadline - loop.time())):
        logger.warning("the engine thread is still in a step; exiting without it")
    print("[vlm-sdk] stopped", file=sys.stderr, flush=True)
    return 0


async def _first(*coros) -> None:
    """Wait until one of `coros` finishes; cancel the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
