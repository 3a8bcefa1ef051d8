"""`AsyncLLM`: the engine on its own thread, streamed to asyncio callers.

    caller task --chat_stream--> prep pool: build_prompt (image decode, tokenize, size check)
                             --> command queue --> engine thread: add / abort, step(), step(), ...
    caller task <-- asyncio.Queue per request <-- loop.call_soon_threadsafe(EngineOutputs: token ids)
    caller task: RequestOutputState.process -> RequestOutput (detokenize, stop strings, delta)

Once constructed (the constructor loads the weights on the calling thread, like `LLM`), the event
loop runs no model or image work. The engine thread never touches a tokenizer: text is made in each
stream's coroutine by the `OutputProcessor`, with a tokenizer of its own, so a long prompt being
tokenized on the executor never holds up a step or another stream's text. A stop string found
there queues a "stop" for the engine, which frees the request's blocks. Closing a stream early (`break` out of `async for`, which CPython
finalises at once; `contextlib.aclosing` makes it explicit) or cancelling its task queues an abort,
which the engine thread applies before its next step, freeing the request's KV blocks.

Prompt building has four pools of two threads (engine/input/prep_pool.py), chosen from the request's
part counts before any of its work: requests with a video go to the video one, with images to the
image one, with a text of CHILD_TEXT_CHARS (16 KiB) or more to the long one (tokenized in a child
process), the rest to the text one, so an image never waits behind a video and a short text prompt
never waits behind any of them. Within a pool one request (`group`: one
/v1/completions request's prompts) holds at most one thread, and freed threads take the next job
round-robin across requests. A caller that goes away while its prompt is built (a server client that
disconnects cancels its handler) cancels it: not started, it never runs; running, the images it has
not decoded yet are skipped. A structured output's grammar is awaited first, from the grammar workers
of its own (engine/structured_output.py): no prompt thread waits behind a grammar.

Admission is fair too: the engine's waiting queue (engine/core/waiting_queue.py) takes the sequences
of one request (the n samples of a call, or a `group`) round-robin with other requests', and no
request holds more than three quarters of max_num_seqs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator

from vlm_sdk.chat_options import ChatOptions
from vlm_sdk.engine import render as dry_run
from vlm_sdk.engine.llm_engine import LLMEngine
from vlm_sdk.engine.output.output_processor import OutputProcessor
from vlm_sdk.engine.input.prep_pool import PrepPools
from vlm_sdk.errors import EngineDeadError, InvalidRequestError
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.models.registry import engine_args as make_engine_args
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.multimodal.messages import count_parts
from vlm_sdk.multimodal.prompts import RawPrompt, TextPrompt, TokensPrompt, as_prompt
from vlm_sdk.outputs import RequestOutput
from vlm_sdk.sampling_params import SamplingParams

logger = logging.getLogger("vlm_sdk")


def _check_params(params) -> SamplingParams:
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


# stop strings of more characters than this get their matcher built on the text pool, not the loop
_LOOP_STOP_CHARS = 4096
_PREP_JOIN_S = 2.0  # the most shutdown waits for the prompt threads to end (see prep_pool.FairPool._run)


def _raise(err: BaseException):
    raise err


def _put_all(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)


@dataclass
class _Stream:
    user_id: str  # the id the caller sees in its outputs
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(str(model), make_engine_args(**engine_args))
        self.inputs = self.engine.inputs  # prompts are built here, off the engine thread
        self.output_processor = OutputProcessor(load_tokenizer(self.engine.checkpoint.model_dir))
        self._commands: queue.Queue = queue.Queue()
        # keyed by a unique engine id, so a reused user id never receives an older request's outputs
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        # text, long text, image and video: fair between requests; a thread per image preprocessing process
        self._prep = PrepPools(image_threads=self.engine.args.preprocess_workers)
        # guards _dead/_closed against the enqueueing of commands: nothing is queued after the engine
        # thread's final drain, so no caller waits on a thread that is gone
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._closed = False
        self._death_callbacks: list = []
        self._thread = threading.Thread(target=self._run, name="vlm-engine", daemon=True)
        self._thread.start()
        # a tensor-parallel rank that dies fails every open request at once, even mid-step or idle
        self.engine.executor.set_failure_callback(self._on_rank_failure)

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Abort what is running (its streams end with finish_reason "abort"), stop the thread and end
        every tensor-parallel rank process. With `timeout`, wait at most that long for the engine
        thread (a step stuck in a kernel or a collective cannot be interrupted; the thread is a
        daemon and does not keep the process alive); False if it had not ended by then."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(("stop", None, None))
        self._prep.close()
        loop = asyncio.get_running_loop()
        start = loop.time()
        await loop.run_in_executor(None, self._thread.join, timeout)
        # a prompt thread still ending when the interpreter exits can abort it (prep_pool.FairPool._run)
        left = _PREP_JOIN_S if timeout is None else max(0.0, min(_PREP_JOIN_S, timeout - (loop.time() - start)))
        await loop.run_in_executor(None, self._prep.join, left)
        return not self._thread.is_alive()

    def on_death(self, callback) -> None:
        """Call `callback(error)` once if the engine dies (an internal error or a lost rank; not on
        `shutdown`), from an engine-owned thread, after every open request has been failed: a
        server exits then, so that its supervisor restarts it. Runs now if it is already dead."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._death_callbacks.append(callback)
        if dead is not None:
            callback(dead)

    # -- public API -------------------------------------------------------------------------------
    async def build_prompt(self, request, params: SamplingParams | None = None,
                           options: ChatOptions | None = None, group=None) -> PromptInputs:
        """Validate, decode images and tokenize off the event loop; raises the request's own error
        (`InvalidRequestError`, `InvalidImageError`, `InputTooLongError`, whose fixes fit the prompt
        and `params.max_tokens`) before anything is queued. `request`: chat messages, or a
        `TextPrompt` / `TokensPrompt` (no chat template; see `InputProcessor.build_prompt`). `options`:
        tools, chat_template_kwargs, cache_salt (`ChatOptions`), for chat messages. `group`: any
        hashable naming the request this prompt is part of (e.g. one of several prompts of one HTTP
        request), whose prompts then take one prep thread at a time; default: a request of its own."""
        self._check_alive()
        self.inputs.check_params(params)
        chat = options is not None and not isinstance(request, (TextPrompt, TokensPrompt))
        if chat:  # max_tools / max_tool_bytes before any work
            self.inputs.chat.tool_limits.check(options.tools)
        # params' grammar first, on the grammar workers: a bad schema fails before any image is decoded and
        # no prep thread waits; the tools' schemas once the prompt (which they lengthen) is known to fit
        await self._compile([params.grammar] if params is not None and params.grammar is not None else [])
        prompt = await self._prepare(request, options, group, partial(
            self.inputs.build_prompt, request, params, options=options, compile_grammar=False))
        checking = self.inputs.chat.check_tools(options) if chat else None
        if checking is not None:  # one grammar for all the tools' schemas, cached by content
            await asyncio.wrap_future(checking)
        return prompt

    async def render(self, request, params: SamplingParams | None = None, options: ChatOptions | None = None,
                     group=None):
        """The dry run of one request (`LLM.render`'s `RenderedRequest`): built on a prep pool as
        `build_prompt` builds it (no grammar compiled, a too-long prompt returned), then read on the
        engine thread between steps: nothing is scheduled or taken."""
        self._check_alive()
        self.inputs.check_params(params)
        chat = options is not None and not isinstance(request, (TextPrompt, TokensPrompt))
        if chat:
            self.inputs.chat.tool_limits.check(options.tools)
        built = await self._prepare(request, options, group, partial(dry_run.build, self.inputs, request, params,
                                                                     options))
        done = asyncio.get_running_loop().create_future()
        with self._lock:
            self._check_alive()
            self._commands.put(("render", done, (built, params)))
        return await done

    async def _prepare(self, request, options: ChatOptions | None, group, job):
        """`job(cancelled=event)` on the prep pool the request's part counts choose (counted, nothing read:
        before any work), one thread per `group` at a time; awaited without holding the loop."""
        if isinstance(request, (TextPrompt, TokensPrompt)):
            chars, images, videos = (len(request.text) if isinstance(request, TextPrompt) else 0), 0, 0
        else:
            chars, images, videos = count_parts(request)
            chars += self.inputs.chat.tool_chars(options) if options is not None else 0
        cancelled = threading.Event()
        future = self._prep.pool_for(chars, images, videos).submit(object() if group is None else group,
                                                                   partial(job, cancelled=cancelled))
        try:
            return await asyncio.wrap_future(future)  # cancelled here, a job not started leaves the pool's queue
        except asyncio.CancelledError:
            cancelled.set()  # a running one skips the images it has not decoded
            raise

    async def chat_stream(self, messages, params: SamplingParams | None = None, request_id: str | None = None,
                          **chat_options) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as tokens arrive; the last one has `finish_reason` set. `chat_options`:
        tools, tool_choice, parallel_tool_calls, chat_template_kwargs, cache_salt (`ChatOptions`); each
        output then carries its parsed parts (`delta_content`, `delta_reasoning_content`,
        `delta_tool_calls`, ...)."""
        params = _check_params(params)
        prompt = await self.build_prompt(messages, params, ChatOptions(**chat_options))
        async for out in self.generate(prompt, params, request_id):
            yield out

    async def generate(self, prompt: PromptInputs | str | list[int] | RawPrompt, params: SamplingParams | None = None,
                       request_id: str | None = None, group=None) -> AsyncIterator[RequestOutput]:
        """Stream the completion of a prompt: one made by `build_prompt`, or a text or token ids
        (a `TextPrompt` / `TokensPrompt`, built here with no chat template). Closing the iterator
        early aborts the request. With `params.n` > 1 the n samples (`params.sample(i)`: seed + i)
        stream interleaved, told apart by `index`, until all have finished; closing it aborts all of
        them. `group`: as `build_prompt`'s; the samples of every `generate` of one group share one
        fair share of admission (engine/core/waiting_queue.py); default: this call's n samples."""
        params = _check_params(params)
        if not isinstance(prompt, PromptInputs):
            prompt = await self.build_prompt(as_prompt(prompt), params, group=group)
        keys = [f"async-{next(self._ids)}" for _ in range(params.n)]
        group = keys[0] if group is None else group
        user_id = request_id or keys[0]
        samples = [params.sample(i) for i in range(params.n)] if params.n > 1 else [params]
        new_states = partial(self._new_states, user_id, prompt, keys, samples)
        if sum(map(len, params.stop)) > _LOOP_STOP_CHARS:  # their automaton takes a while to build
            states = await asyncio.wrap_future(self._prep.text.submit(group, new_states))
        else:
            states = new_states()
        # structured outputs (the prompt's own grammar first: a forced tool call, or a format after reasoning):
        # compiled on the grammar workers (usually found in the cache by now), never on the engine thread
        spec = prompt.grammar if prompt.grammar is not None else params.grammar
        grammar = (await self._compile([spec]))[0] if spec is not None else None
        if request_id is not None and any(s.user_id == request_id for s in self._streams.values()):
            raise InvalidRequestError(f"request id {request_id!r} is already streaming")
        stream = _Stream(user_id, asyncio.get_running_loop(), asyncio.Queue())  # one queue for the n samples
        with self._lock:
            self._check_alive()  # it may have stopped while the prompt was being built
            for key in keys:
                self._streams[key] = stream
            # one command: the n samples join the same step, so the first's prompt blocks (and its
            # encoded image) are hit by the others instead of being computed n times
            self._commands.put(("add", keys, (prompt, samples, grammar, group)))
        running = set(keys)
        try:
            while running:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                state = states[item.request_id]
                out = state.process(item)  # token ids -> text, stop strings, delta
                if out is None:
                    continue
                if state.finished_by_stop_string:  # the engine has not finished it: tell it
                    self._send(("abort", item.request_id, "stop"))
                if out.finished:
                    running.discard(item.request_id)
                yield out
        finally:
            for key in keys:
                self._streams.pop(key, None)
            for key in running:  # closed early or failed: every sample still running is aborted
                self._send(("abort", key, "abort"))

    async def _compile(self, specs: list) -> list:
        """The compiled grammars of `specs`, awaited without holding a thread: the grammar workers compile
        them (engine/structured_output.py), beside the prompt pools; the first error raises."""
        return [await asyncio.wrap_future(self.inputs.grammars.submit(spec)) for spec in specs]

    def _new_states(self, user_id: str, prompt: PromptInputs, keys: list[str], samples: list) -> dict:
        return {key: self.output_processor.new_request(user_id, prompt.token_ids, sp, index=i,
                                                       output_format=prompt.output_format)
                for i, (key, sp) in enumerate(zip(keys, samples))}

    def _send(self, command: tuple) -> None:
        """Queue a command for the engine thread unless it is gone."""
        with self._lock:
            if not (self._closed or self._dead):
                self._commands.put(command)

    async def chat(self, messages, params: SamplingParams | None = None, request_id: str | None = None,
                   **chat_options) -> RequestOutput:
        """The final output; with `params.n` > 1 it is sample 0, and `outputs` holds all n.
        `chat_options`: as `chat_stream`'s."""
        final: dict[int, RequestOutput] = {}
        async for out in self.chat_stream(messages, params, request_id, **chat_options):
            if out.finished:
                final[out.index] = out
        outputs = [final[i] for i in sorted(final)]
        for out in outputs:
            out.set_whole()
        outputs[0].outputs = outputs
        return outputs[0]

    def stats(self) -> dict:
        """Live KV and queue numbers (see `LLMEngine.stats`). Once the engine is dead its requests
        have been failed, so none counts as running or waiting, even while a stuck thread has not
        yet cleared the scheduler."""
        s = self.engine.stats()
        if self._dead is not None:
            s.update(num_running=0, num_waiting=0)
        return s

    @property
    def memory_report(self):
        """`StartupMemory`: weights, activation peak and KV cache as measured at start-up (`.format()`
        is the table the engine logged, `.to_dict()` has `vlm-sdk plan`'s JSON keys)."""
        return self.engine.memory_report

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and accepts requests."""
        return self._dead is None and not self._closed and self._thread.is_alive()

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def args(self):
        """The `EngineArgs` this engine runs with (its per-request limits among them)."""
        return self.engine.args

    # -- engine thread ----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self._dead!r}") from self._dead
        if self._closed:
            raise EngineDeadError("this AsyncLLM was shut down; create a new one")

    def _deliver(self, key: str, item) -> None:
        self._deliver_many([(key, item)])

    def _deliver_many(self, items: list) -> None:
        """One wake-up per event loop per step, not one per request: at 64 streams that is what
        keeps a server's loop free for its sockets."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for key, item in items:
            stream = self._streams.get(key)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed; nobody is listening
                pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished()
                while True:
                    try:
                        cmd, key, payload = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if cmd == "stop":
                        for rid in list(engine.requests):
                            self._deliver(rid, engine.abort(rid))
                        self._final_drain(EngineDeadError("this AsyncLLM was shut down"))
                        engine.shutdown()
                        return
                    if cmd == "fail":  # a rank died while this thread waited for work
                        raise payload
                    if cmd == "abort":
                        engine.abort(key, payload)
                    elif cmd == "add":
                        self._add(key, *payload)
                    elif cmd == "render":  # read between steps, on this thread: the cache is still
                        built, params = payload
                        dry_run.settle(key, lambda: dry_run.render(engine, built, params))
                outputs = engine.step()  # token ids only: the streams make the text
                if outputs:
                    self._deliver_many([(out.request_id, out) for out in outputs])
        except BaseException as e:  # engine failure: tell every caller, keep the cause
            with self._lock:
                rank_failure = self._dead is not None  # that rank has logged its own traceback
                self._dead = self._dead or e
            if rank_failure:
                logger.error("the engine stopped: %s", e)
            else:
                logger.error("the engine stopped after an internal error; every open request fails",
                             exc_info=e)
            err = EngineDeadError(f"the engine stopped after an internal error: {e!r}")
            err.__cause__ = e
            for key in list(self._streams):
                self._deliver(key, err)
            self._final_drain(err)
            self._release_requests()
            engine.shutdown()
            self._announce_death(e)

    def _add(self, keys: list[str], prompt: PromptInputs, samples: list, grammar, group) -> None:
        """Add a request's samples; a bad request fails its caller alone, and none of its samples runs."""
        added = []
        try:
            for key, sp in zip(keys, samples):
                self.engine.add_request(prompt, sp, request_id=key, grammar=grammar, group=group)
                added.append(key)
        except Exception as e:
            for key in added:
                self.engine.abort(key)
            self._deliver(keys[0], e)

    def _release_requests(self) -> None:
        """Finish what the dead engine still holds, so that its queues and KV blocks read as empty;
        its bookkeeping may be half-updated by the failed step, so a failure here changes nothing."""
        try:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        except Exception as e:
            logger.warning("could not clear the dead engine's requests: %r", e)

    def _announce_death(self, err: BaseException) -> None:
        with self._lock:
            callbacks, self._death_callbacks = self._death_callbacks, []
        for callback in callbacks:
            callback(err)

    def _on_rank_failure(self, err: EngineDeadError) -> None:
        """From the executor's watcher thread: a rank process ended. Fail every open stream now (the
        engine thread may be blocked in a collective until distributed_timeout) and wake the thread."""
        with self._lock:
            if self._closed or self._dead is not None:
                return
            self._dead = err
            self._commands.put(("fail", None, err))
        for key in list(self._streams):
            self._deliver(key, err)
        # the engine thread may stay in a collective until distributed_timeout: announce now
        self._announce_death(err)

    def _final_drain(self, err: EngineDeadError) -> None:
        """Fail whatever was queued before the thread ends; the lock keeps anything new out."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    cmd, key, _ = self._commands.get_nowait()
                except queue.Empty:
                    return
                if cmd == "add":
                    self._deliver(key[0], err)
                elif cmd == "render":
                    dry_run.settle(key, lambda: _raise(err))
