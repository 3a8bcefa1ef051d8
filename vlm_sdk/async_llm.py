"""`AsyncLLM`: the engine on its own thread, streamed to asyncio callers.

    caller task --chat_stream--> executor: build_prompt (image decode, tokenize, size check)
                             --> command queue --> engine thread: add / abort, step(), step(), ...
    caller task <-- asyncio.Queue per request <-- loop.call_soon_threadsafe(outputs)

The event loop never runs model or image work. Leaving `async for` early, or cancelling the task,
aborts the request: its KV blocks are freed before the engine's next step.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from vlm_sdk.config import EngineArgs
from vlm_sdk.engine.llm_engine import LLMEngine
from vlm_sdk.errors import EngineDeadError, InvalidRequestError
from vlm_sdk.outputs import RequestOutput
from vlm_sdk.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(str(model), EngineArgs.from_kwargs(**engine_args))
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlm-prep")
        self._dead: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vlm-engine", daemon=True)
        self._thread.start()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(("stop", None, None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._prep.shutdown(wait=False)

    # -- public API -------------------------------------------------------------------------------
    async def chat_stream(self, messages, params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as tokens arrive; the last one has `finish_reason` set."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._prep, self.engine.build_prompt, messages)
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._commands.put(("add", request_id, (prompt, params or SamplingParams())))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id, None))

    async def chat(self, messages, params: SamplingParams | None = None,
                   request_id: str | None = None) -> RequestOutput:
        last = None
        async for out in self.chat_stream(messages, params, request_id):
            last = out
        last.delta_text = last.text
        return last

    def stats(self) -> dict:
        return self.engine.stats()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- engine thread ----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self._dead!r}") from self._dead
        if self._closed:
            raise EngineDeadError("this AsyncLLM was shut down")

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished()
                while True:
                    try:
                        cmd, rid, payload = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if cmd == "stop":
                        for r in list(engine.requests):
                            engine.abort(r)
                        return
                    if cmd == "abort":
                        engine.abort(rid)
                    elif cmd == "add":
                        try:
                            engine.add_request(payload[0], payload[1], request_id=rid)
                        except Exception as e:  # a bad request fails its caller alone
                            self._deliver(rid, e)
                for out in engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # engine failure: tell every caller, keep the cause
            self._dead = e
            err = EngineDeadError(f"the engine stopped after an internal error: {e!r}")
            err.__cause__ = e
            for rid in list(self._streams):
                self._deliver(rid, err)
