"""`BackgroundServer`: a server on a thread of its own with its own event loop, for tests, samples
and benchmarks that need a real HTTP endpoint in-process."""
from __future__ import annotations

import asyncio
import threading

from vlm_sdk.async_llm import AsyncLLM  # built here; the server is typed on EngineClient
from vlm_sdk.engine_client import EngineClient
from vlm_sdk.server.app import OpenAIServer
from vlm_sdk.server.config import ServerConfig, server_engine_args
from vlm_sdk.server.runner import ServerRunner, served_name


class BackgroundServer:
    """A server on a thread of its own, with its own event loop:

        with BackgroundServer(model_dir, ServerConfig(port=0), num_blocks=64) as srv:
            ... srv.url, srv.model_name, srv.stats() ...
    """

    def __init__(self, model, config: ServerConfig | None = None, engine=None, **engine_args):
        """`engine`: one already built (an `AsyncLLM`, or a `ReplicaSetLLM` of data-parallel replicas)
        instead of one built here from `engine_args`; it is shut down with the server."""
        self.model = str(model)
        self._given_engine = engine
        self.config = config or ServerConfig(port=0)
        self.engine_args = engine_args
        self.model_name = served_name(self.model, self.config)
        self.engine: EngineClient | None = None
        self.runner: ServerRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.runner.url

    @property
    def server(self) -> OpenAIServer:
        return self.runner.server

    def stats(self) -> dict:
        return self.engine.stats()

    def __enter__(self) -> "BackgroundServer":
        self.engine_args.setdefault("show_progress", False)
        self.engine = self._given_engine or AsyncLLM(self.model, **server_engine_args(self.engine_args))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vlm-server", daemon=True)
        self._thread.start()
        self.runner = ServerRunner(self.engine, self.config, self.model_name)
        try:
            self.call(self.runner.start())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def call(self, coro, timeout: float | None = 60.0):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __exit__(self, *exc) -> None:
        async def stop():
            if self.runner is not None:
                await self.runner.stop()
            await self.engine.shutdown()
        try:
            self.call(stop(), timeout=self.config.shutdown_timeout + 30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
