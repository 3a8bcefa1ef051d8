"""Running the server: `ServerRunner` binds it to a socket, `serve` runs `vlm-sdk serve` (signals,
graceful drain). `vlm_sdk.server.background.BackgroundServer` runs one on a thread of its own.

Shutdown order on SIGTERM/SIGINT: stop listening and refuse new chat requests (503), give in-flight
requests up to `shutdown_timeout` seconds to finish, cancel the rest (which aborts them and frees
their KV blocks), stop the engine thread.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from vlm_sdk.async_llm import AsyncLLM
from vlm_sdk.server.app import OpenAIServer
from vlm_sdk.server.config import ServerConfig, server_engine_args

logger = logging.getLogger("vlm_sdk.server")


def served_name(model: str, config: ServerConfig) -> str:
    return config.served_model_name or Path(model).resolve().name


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

    async def start(self) -> str:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
        self._runner = web.AppRunner(self.server.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.config.shutdown_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        """Drain: stop listening and refuse new requests, wait up to shutdown_timeout for in-flight
        ones, then stop the engine, which ends what is left with finish_reason "abort" (streams still
        get their last chunk and [DONE]), and close the connections."""
        self.server.draining = True
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()
        if not await self.server.wait_idle(self.config.shutdown_timeout):
            logger.warning("%d request(s) still running after %g s (--shutdown-timeout): aborting them",
                           self.server.in_flight, self.config.shutdown_timeout)
            await self.server.engine.shutdown()
            await self.server.wait_idle(5.0)
        await self._runner.cleanup()
        self._runner = None


def serve(model: str, config: ServerConfig, **engine_args) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, return 0."""
    engine = AsyncLLM(model, **server_engine_args(engine_args))
    return asyncio.run(_serve(engine, config, served_name(model, config)))


async def _serve(engine: AsyncLLM, config: ServerConfig, name: str) -> int:
    runner = ServerRunner(engine, config, name)
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
          f"{s['max_model_len']}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    s = engine.stats()
    running = s["num_running"] + s["num_waiting"]
    print(f"[vlm-sdk] shutting down: {running} request(s) in flight get up to {config.shutdown_timeout:g} s "
          f"(--shutdown-timeout)", file=sys.stderr, flush=True)
    await runner.stop()
    await engine.shutdown()
    print("[vlm-sdk] stopped", file=sys.stderr, flush=True)
    return 0
