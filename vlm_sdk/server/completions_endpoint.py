"""POST /v1/completions: the chat endpoint's path for prompts without a chat template.

    OpenAIServer.admit: auth (401), draining (503), the JSON body (400, 408, 413, 415)
    -> parse_completion_request (400/404; server/completions.py)
    -> EngineClient.build_prompt per prompt, off the loop: tokenize a text / check ids against the
       vocabulary, the family's processor, the fit check (400 context_length_exceeded, naming the
       prompt's index when there are several); each prompt + max_tokens within max_model_len (400)
    -> EngineClient.generate per prompt (n samples each), merged as their tokens come; the first output
       is awaited before any byte is sent, so the engine's own refusal is still an HTTP status
    -> one `text_completion` body, or SSE chunks + usage + [DONE]; a failure after the headers is
       sent in-band, as for chat

The same limits, errors and metrics as chat (--max-n per prompt, --max-stop-*, TTFT / TPOT / e2e and
finish reasons once per request); a client that leaves aborts every choice of every prompt.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import web

from vlm_sdk.errors import EngineDeadError, InputTooLongError, InvalidRequestError
from vlm_sdk.multimodal.prompts import TextPrompt
from vlm_sdk.server import completions as wire
from vlm_sdk.server import response_body, vllm_extras
from vlm_sdk.server.metrics import Timing
from vlm_sdk.server.protocol import (USAGE, APIError, bad_request, check_output_room, check_prompt_logprobs_size,
                                     error_from_exception)

logger = logging.getLogger("vlm_sdk.server")


class CompletionsEndpoint:
    """`server`: the `OpenAIServer` whose engine, config, metrics and speller it shares."""

    def __init__(self, server):
        self.server = server

    async def handle(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        arrival = time.monotonic()
        body = await server.admit(request)
        c, args = server.config, server.engine.args
        req = wire.parse_completion_request(body, server.model_name, c.max_stop_strings, c.max_stop_chars, c.max_n,
                                            c.max_completion_prompts, max_logit_bias=args.max_logit_bias,
                                            max_stop_token_ids=args.max_stop_token_ids,
                                            max_response_logprobs=c.max_response_logprobs,
                                            max_model_len=server.max_model_len,
                                            max_sequences=c.max_sequences_per_request)
        group = wire.new_completion_id()  # its prompts: one prep thread at a time, one share of the batch
        prompts = await self._build(req, group)
        if req.generate:
            for p in prompts:
                check_output_room(len(p.token_ids), req.params.max_tokens, server.max_model_len, "max_tokens")
            check_prompt_logprobs_size(req.params, sum(len(p.token_ids) for p in prompts) * req.params.n,
                                       c.max_response_logprobs)
        echoes = await self._echo_texts(req) if req.echo else None
        if not req.generate:
            return await self._echo_only(request, req, prompts, echoes)
        outputs = _merged(server.engine, prompts, req.params, group)
        try:
            first = await outputs.__anext__()  # the engine's own refusal still becomes an HTTP status
            timing = Timing(arrival, time.monotonic())
            if req.stream:
                return await self._stream(request, req, outputs, first, echoes, timing)
            return await self._complete(request, req, prompts, outputs, first, echoes, timing)
        finally:
            await outputs.aclose()  # a no-op once finished; otherwise aborts every choice still running

    async def _build(self, req: wire.CompletionRequest, group: str) -> list:
        """Every prompt built (all of them, before anything runs; as one request's, `group`, a thread at
        a time); the first bad prompt's error, naming its index when the request has several."""
        engine, many = self.server.engine, len(req.prompts) > 1

        async def build(i: int, prompt):
            try:
                return await engine.build_prompt(prompt, req.params, req.options, group=group)
            except InputTooLongError as e:
                e = e.with_conversation(i, "prompt") if many else e
                raise APIError(400, str(e), "invalid_request_error", "prompt", "context_length_exceeded") from None
            except InvalidRequestError as e:
                raise bad_request(f"prompt {i}: {e}" if many else str(e), e.param or "prompt") from None
        built = await asyncio.gather(*(build(i, p) for i, p in enumerate(req.prompts)), return_exceptions=True)
        for b in built:
            if isinstance(b, BaseException):
                raise b
        return built

    async def _echo_texts(self, req: wire.CompletionRequest) -> list[str]:
        """Each prompt as text: a text prompt as given, token ids decoded (off the loop)."""
        processor = self.server.engine.output_processor

        def decode(ids) -> str:
            with processor.lock:
                return processor.tokenizer.decode(list(ids), skip_special_tokens=False)
        return [p.text if isinstance(p, TextPrompt) else await asyncio.to_thread(decode, p.token_ids)
                for p in req.prompts]

    def _logprobs(self, out, offset: int = 0) -> tuple[dict | None, int]:
        if out.token_logprobs is None:
            return None, offset
        return wire.LegacyLogprobs(self.server.speller).entries(out.token_logprobs, offset)

    async def _complete(self, request: web.Request, req: wire.CompletionRequest, prompts: list, outputs, item,
                        echoes, timing: Timing) -> web.StreamResponse:
        server, n = self.server, req.params.n
        final = {}  # choice index -> final output; the choices finish in any order
        while True:
            i, out = item
            if out.finished:
                final[i * n + out.index] = out
                if len(final) == req.num_choices:
                    server.observe(timing, out)  # the request's latencies once, at its last choice
                    break
                server.metrics.finished(out.finish_reason)  # every choice's finish reason
            item = await outputs.__anext__()
        outs = [final[index] for index in range(req.num_choices)]
        extras = await self._extras(req, outs)

        def choice(index: int, logprobs: bool = True) -> dict:
            out = outs[index]
            text = echoes[index // n] + out.text if echoes else out.text
            return wire.choice(index, text, out.finish_reason, self._logprobs(out)[0] if logprobs else None,
                               **extras[index])
        # each prompt counted once (its other samples shared its blocks), the completions of every choice
        body = wire.completion_body(
            wire.new_completion_id(), server.model_name, int(time.time()), [None] * len(outs),
            sum(len(p.token_ids) for p in prompts), sum(len(o.token_ids) for o in outs),
            sum(final[p * n].num_cached_tokens for p in range(len(prompts))))
        request[USAGE] = (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
        if response_body.is_small(outs) and req.params.prompt_logprobs is None:
            body["choices"] = [choice(i) for i in range(len(outs))]
            return web.json_response(body)
        # logprobs or much text: each choice made and encoded off the loop, sent as it is made
        resp = await response_body.send_in_pieces(
            request, body, lambda i: response_body.completion_choice(choice(i, logprobs=False), outs[i].token_logprobs,
                                                                     server.speller), server.body_thread)
        server.trim_soon()
        return resp

    async def _extras(self, req: wire.CompletionRequest, outs: list) -> list[dict]:
        """Per choice, vLLM's fields the request asked for (server/vllm_extras.py): the prompt's logprobs
        (computed by sample 0 of each prompt, made on the body thread, repeated in each of its choices, as
        vLLM gives them) and the token ids."""
        n, server = req.params.n, self.server
        extras = [{} for _ in outs]
        if req.params.prompt_logprobs is not None:
            loop = asyncio.get_running_loop()
            for p in range(len(req.prompts)):
                made = await loop.run_in_executor(server.body_thread, vllm_extras.prompt_logprobs_json,
                                                  outs[p * n].prompt_logprobs, server.speller)
                for j in range(n):
                    extras[p * n + j]["prompt_logprobs"] = made
        if req.return_token_ids:
            for extra, out in zip(extras, outs):
                extra.update(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(out.token_ids))
        return extras

    async def _stream(self, request: web.Request, req: wire.CompletionRequest, outputs, item, echoes,
                      timing: Timing) -> web.StreamResponse:
        server, n = self.server, req.params.n
        resp = await _open_stream(request)
        cid = wire.new_completion_id()
        chunks = wire.ChunkWriter(cid, server.model_name, int(time.time()), req.include_usage)
        final = {}  # choice index -> final output
        opened = set()  # choices that have sent a chunk
        logprobs_sent, offsets = {}, {}  # per choice: its tokens whose logprobs were streamed, its text offset
        tokens_sent = {}  # per choice: its tokens whose ids were streamed (return_token_ids)
        try:
            while True:
                i, out = item
                index = i * n + out.index
                text = out.delta_text
                if echoes and index not in opened:  # a choice's first chunk opens with its prompt
                    text = echoes[i] + text
                sent = logprobs_sent.get(index, 0)
                logprobs = None
                if out.token_logprobs is not None and len(out.token_logprobs) > sent:
                    # every token's logprobs once, with the text that has come since the last chunk
                    logprobs, offsets[index] = wire.LegacyLogprobs(server.speller).entries(
                        out.token_logprobs, offsets.get(index, 0), start=sent)
                    logprobs_sent[index] = len(out.token_logprobs)
                if text or logprobs is not None or out.finished:
                    extras = {}
                    if req.return_token_ids:  # vLLM's: the prompt's ids in a choice's first chunk, then new ones
                        if index not in opened:
                            extras["prompt_token_ids"] = list(out.prompt_token_ids)
                        extras["token_ids"] = out.token_ids[tokens_sent.get(index, 0):]
                        tokens_sent[index] = len(out.token_ids)
                    await resp.write(chunks.choice(index, text, out.finish_reason, logprobs, **extras).encode())
                    opened.add(index)
                if out.finished:
                    final[index] = out
                    if len(final) == req.num_choices:
                        server.observe(timing, out)  # the request's latencies once, at its last choice
                        break
                    server.metrics.finished(out.finish_reason)  # every choice's finish reason
                item = await outputs.__anext__()
        except ConnectionResetError:  # the client left; closing the outputs aborts every choice
            return resp
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            err = error_from_exception(e)
            if err.status >= 500 and not isinstance(e, EngineDeadError):  # the engine logs its own death
                logger.error("stream %s failed: %r", cid, e)
            server.metrics.error(err.status)
            await resp.write(wire.event(err.body()).encode())
        else:
            request[USAGE] = (sum(len(final[p * n].prompt_token_ids) for p in range(len(req.prompts))),
                              sum(len(o.token_ids) for o in final.values()))
            if req.include_usage:
                await resp.write(chunks.usage(
                    sum(len(final[p * n].prompt_token_ids) for p in range(len(req.prompts))),
                    sum(len(o.token_ids) for o in final.values()),
                    sum(final[p * n].num_cached_tokens for p in range(len(req.prompts)))).encode())
        await resp.write(wire.DONE.encode())
        await resp.write_eof()
        return resp

    async def _echo_only(self, request: web.Request, req: wire.CompletionRequest, prompts: list,
                         echoes: list[str]) -> web.StreamResponse:
        """echo with max_tokens 0: each choice is its prompt, finished by its length limit (0)."""
        server, n = self.server, req.params.n
        choices = [wire.choice(index, echoes[index // n], "length") for index in range(req.num_choices)]
        for _ in choices:
            server.metrics.finished("length")
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        request[USAGE] = (prompt_tokens, 0)
        cid, created = wire.new_completion_id(), int(time.time())
        if not req.stream:
            return web.json_response(wire.completion_body(cid, server.model_name, created, choices, prompt_tokens,
                                                          0, 0))
        resp = await _open_stream(request)
        chunks = wire.ChunkWriter(cid, server.model_name, created, req.include_usage)
        for c in choices:
            await resp.write(chunks.choice(c["index"], c["text"], "length").encode())
        if req.include_usage:
            await resp.write(chunks.usage(prompt_tokens, 0, 0).encode())
        await resp.write(wire.DONE.encode())
        await resp.write_eof()
        return resp


async def _open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


async def _merged(engine, prompts: list, params, group: str):
    """(prompt index, RequestOutput) for every prompt's samples as their tokens come, all admitted as one
    request's (`group`: one fair share of the batch); closing it (or cancelling its consumer) aborts
    every sample still running."""
    if len(prompts) == 1:
        async with contextlib.aclosing(engine.generate(prompts[0], params, group=group)) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt) -> None:
        try:
            async with contextlib.aclosing(engine.generate(prompt, params, group=group)) as gen:
                async for out in gen:
                    queue.put_nowait((i, out))
        except Exception as e:  # the consumer raises it; cancellation ends the task quietly
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))
    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
