"""The OpenAI-compatible HTTP server: aiohttp handlers over one `EngineClient` (vlm_sdk/engine_client.py: an
`AsyncLLM`, or `ReplicaSetLLM` replicas).

    POST /v1/chat/completions (POST /v1/completions: the same path for prompts without a chat
    template, server/completions_endpoint.py)
      read body (server/body.py: 415 unless Content-Type is application/json; 413 over
        --max-request-bytes, from Content-Length before reading; 408 past --body-timeout) -> JSON (400:
        also too deep, lone surrogates) -> parse_chat_request (400/404)
      -> MediaFetcher: http(s)/file image sources to bytes under the media policy (400)
      -> EngineClient.build_prompt, off the loop: decode, resize, tokenize, fit check (400); the prompt
         and max_tokens within max_model_len (400)
      -> EngineClient.generate: wait for the first output, so that every refusal is still an HTTP status
      -> one JSON body (with logprobs or much text: made off the loop, sent a choice at a time:
         server/response_body.py), or SSE chunks ending in [DONE]
    GET /v1/models, GET /health (503 once the engine stopped or shutdown began), GET /metrics
    POST /tokenize, POST /detokenize, GET /version: vLLM's (server/tokenize.py)
    POST /v1/chat/completions/render, /v1/completions/render: vLLM's dry runs and the capacity answers
      (server/render.py); GET /plan (the memory bar and live usage), /plan/live (server/plan_page.py)

Below the app, server/connections.py answers aiohttp's own protocol errors in the same error shape
and caps connections. The loop never runs model or image work. A client that goes away cancels its handler (aiohttp's
handler_cancellation), which closes the generator and aborts the request, freeing its KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from vlm_sdk.engine_client import EngineClient
from vlm_sdk.chat_options import ToolLimits
from vlm_sdk.engine.heap import trim_heap
from vlm_sdk.errors import EngineDeadError, VLMError
from vlm_sdk.server import chat_responses, parsed_output, protocol, response_body, vllm_extras
from vlm_sdk.server.body import read_json
from vlm_sdk.server.completions_endpoint import CompletionsEndpoint
from vlm_sdk.server.logprobs import TokenSpeller
from vlm_sdk.server.config import ServerConfig
from vlm_sdk.server.media import MediaFetcher
from vlm_sdk.server.media_uuids import MediaUUIDs
from vlm_sdk.server.plan_page import PlanPage
from vlm_sdk.server.render import RenderEndpoints
from vlm_sdk.server.tokenize import TokenizeEndpoints
from vlm_sdk.server.metrics import CONTENT_TYPE, ServerMetrics, Timing
from vlm_sdk.server.protocol import USAGE, APIError

logger = logging.getLogger("vlm_sdk.server")
_LARGE_BYTES = 1 << 20  # a request body this large is followed by a heap trim


class OpenAIServer:
    """Holds what the handlers share; `app` is the aiohttp application to run."""

    def __init__(self, engine: EngineClient, config: ServerConfig, model_name: str):
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.started = int(time.time())
        self.max_model_len = engine.stats()["max_model_len"]  # fixed once the engine is built
        self.metrics = ServerMetrics(engine.stats, model_name)
        self.media = MediaFetcher(config.media)
        self.uuids = MediaUUIDs(config.media_uuid_cache_bytes)  # vLLM's media uuids (server/media_uuids.py)
        self.draining = False  # set when shutdown begins: new generation requests get 503
        self.in_flight = 0  # chat and completion requests being handled
        self._idle = asyncio.Event()
        self._idle.set()
        self.app = web.Application(client_max_size=config.max_request_bytes, middlewares=[self._log, self._errors])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self._completions = CompletionsEndpoint(self)
        self._tokenize = TokenizeEndpoints(self)  # vLLM's /tokenize, /detokenize, /version
        self.app.router.add_post("/tokenize", self._tokenize.tokenize)
        self.app.router.add_post("/detokenize", self._tokenize.detokenize)
        self.app.router.add_get("/version", self._tokenize.version)
        self._render = RenderEndpoints(self)  # vLLM's dry runs, with the capacity answers (server/render.py)
        self.app.router.add_post("/v1/chat/completions/render", self._render.chat)
        self.app.router.add_post("/v1/completions/render", self._render.completions)
        self._plan = PlanPage(self)  # the running engine's plan with live usage (server/plan_page.py)
        self.app.router.add_get("/plan", self._plan.page)
        self.app.router.add_get("/plan/live", self._plan.live)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.prometheus)
        self.app.on_cleanup.append(self._close_media)
        self._speller: TokenSpeller | None = None
        # large non-streamed bodies are made here, one at a time (server/response_body.py)
        self.body_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-body")
        self._trim_handle: asyncio.TimerHandle | None = None
        self._trim_wanted = False  # a large body was handled since the last trim

    @property
    def speller(self) -> TokenSpeller:
        """Token ids as OpenAI's logprob entries, with the output tokenizer (built on first use)."""
        if self._speller is None:
            processor = self.engine.output_processor
            self._speller = TokenSpeller(processor.tokenizer, processor.lock)
        return self._speller

    async def _close_media(self, _app) -> None:
        await self.media.close()
        self.body_thread.shutdown(wait=False, cancel_futures=True)

    # -- the request log, errors and auth -----------------------------------------------------------
    @web.middleware
    async def _log(self, request: web.Request, handler):
        """One line per request once it is answered (a stream: once it ended): client, method, path,
        status, prompt and completion tokens where the request generated, seconds. 499: the client left
        before an answer (nginx's code)."""
        if not self.config.log_requests:
            return await handler(request)
        t0, status = time.monotonic(), 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            usage = request.get(USAGE)
            tokens = f"prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else "-"
            logger.info("%s %s %s %s %s %.3f s", request.remote or "-", request.method, request.path_qs[:200],
                        status, tokens, time.monotonic() - t0)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            return self._error_response(e)
        except web.HTTPException as e:  # routing: 404 unknown path, 405 wrong method
            if e.status < 400:
                raise
            return self._error_response(APIError(
                e.status, f"{request.method} {request.path}: {e.reason}", "invalid_request_error",
                None, "not_found" if e.status == 404 else None))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except VLMError as e:  # the request's own fault, already explained: no traceback
            return self._error_response(protocol.error_from_exception(e))
        except Exception as e:
            logger.exception("request %s %s failed", request.method, request.path)
            return self._error_response(protocol.error_from_exception(e))

    def _error_response(self, e: APIError) -> web.Response:
        self.metrics.error(e.status)
        resp = web.json_response(e.body(), status=e.status)
        if e.status in (408, 413, 415):  # the rest of the body is not wanted; don't wait for it on this connection
            resp.force_close()
        return resp

    def _check_auth(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: compare bytes, never re-encode
        # strictly; the scheme is case-insensitive (RFC 7235)
        scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
        given = given.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, key.encode("utf-8", "surrogateescape")):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                                "server was started with (--api-key)", "authentication_error", None,
                           "invalid_api_key")

    # -- endpoints ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.is_alive and not self.draining:
            return web.json_response({"status": "ok"})
        reason = "shutting down" if self.draining else "the engine has stopped"
        raise APIError(503, f"unhealthy: {reason}", "server_error", None, "unavailable")

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        self._check_auth(request)
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.started, "owned_by": "vlm-sdk",
            "max_model_len": self.max_model_len}]})

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no chat request is in flight; False if some still are after `timeout` s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(self._chat_completions, request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(self._completions.handle, request)

    async def _tracked(self, handler, request: web.Request) -> web.StreamResponse:
        """Run a generation handler, counted in `in_flight` (what shutdown waits for)."""
        self.in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if (request.content_length or 0) > _LARGE_BYTES:
                self.trim_soon()
            if self.in_flight == 0:
                self._idle.set()
                self._trim_if_idle()

    def trim_soon(self) -> None:
        """After a large body in or out: the allocator's free memory goes back to the system the next
        time no request is in flight (engine/heap.py). Never while one is: malloc_trim holds the
        allocator's lock while it walks the heap (0.1-0.4 s on a large one), and every thread that
        allocates meanwhile, the engine's among them, waits."""
        self._trim_wanted = True
        self._trim_if_idle()

    def _trim_if_idle(self) -> None:
        if not self._trim_wanted or self.in_flight or self._trim_handle is not None:
            return
        loop = asyncio.get_running_loop()

        def trim() -> None:  # half a second on, the request is gone; still idle?
            self._trim_handle = None
            if self.in_flight:
                return
            self._trim_wanted = False
            try:
                loop.run_in_executor(self.body_thread, trim_heap)
            except RuntimeError:  # shutting down: the body thread takes no more work
                pass
        self._trim_handle = loop.call_later(0.5, trim)

    async def admit(self, request: web.Request):
        """Auth and readiness (401, 503), then the JSON body (400, 408, 413, 415)."""
        self._check_auth(request)
        if self.draining or not self.engine.is_alive:
            raise APIError(503, "the server is shutting down or its engine has stopped; retry on another "
                                "replica", "server_error", None, "unavailable")
        return await read_json(request, self.config.max_request_bytes, self.config.body_timeout,
                               self.config.max_json_values)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self.admit(request)
        args = self.engine.args
        req = protocol.parse_chat_request(body, self.model_name, self.max_model_len, self.config.limit_images,
                                          self.config.max_stop_strings, self.config.max_stop_chars,
                                          self.config.max_n, max_logit_bias=args.max_logit_bias,
                                          max_stop_token_ids=args.max_stop_token_ids,
                                          max_response_logprobs=self.config.max_response_logprobs,
                                          limit_videos=self.config.limit_videos,
                                          max_sequences=self.config.max_sequences_per_request,
                                          tool_limits=ToolLimits(args.max_tools, args.max_tool_bytes))
        messages = await self.resolve_media(req.messages, req.options.cache_salt)
        prompt = await self.engine.build_prompt(messages, req.params, req.options)
        protocol.check_output_room(len(prompt.token_ids), req.params.max_tokens, self.max_model_len,
                                   req.max_tokens_param)
        protocol.check_prompt_logprobs_size(req.params, len(prompt.token_ids), self.config.max_response_logprobs)
        if req.num_images or req.num_videos:
            self.metrics.image_preprocess.observe(prompt.preprocess_seconds)
        gen = self.engine.generate(prompt, req.params)
        try:
            first = await gen.__anext__()  # the engine's own refusal still becomes an HTTP status
            timing = Timing(arrival, time.monotonic())
            parsed = prompt.output_format is not None  # reasoning / tool calls read from the text
            if req.stream:
                return await self._stream(request, req, gen, first, timing, parsed)
            return await self._complete(request, req, gen, first, timing, parsed)
        finally:
            await gen.aclose()  # a no-op once finished; otherwise aborts and frees the blocks

    async def resolve_media(self, messages: list, salt: str | None) -> list:
        """Media sources fetched under the media policy, and vLLM's uuids: kept, or put back in."""
        messages, slots = self.uuids.strip(messages)
        messages = await self.media.resolve_messages(messages)
        return self.uuids.fill(messages, slots, salt) if slots else messages

    async def _complete(self, request: web.Request, req: protocol.ChatRequest, gen, out, timing: Timing,
                        parsed: bool) -> web.StreamResponse:
        final = {}  # index -> final output; with n > 1 the choices finish in any order
        while True:
            if out.finished:
                final[out.index] = out
                if len(final) == req.params.n:
                    self.observe(timing, out)  # the request's latencies once, at its last choice
                    break
                self.metrics.finished(out.finish_reason)  # every choice's finish reason
            out = await gen.__anext__()
        outputs = [final[i] for i in range(req.params.n)]
        first = outputs[0]

        def message(o):
            return parsed_output.message(o) if parsed else o.text
        # the prompt is counted once: it was built once and the other choices shared its blocks; the
        # logprobs are filled in as the body is sent
        body = chat_responses.completion_body(
            chat_responses.new_completion_id(), self.model_name, message(first), first.finish_reason,
            len(first.prompt_token_ids), sum(len(o.token_ids) for o in outputs), first.num_cached_tokens)
        request[USAGE] = (len(first.prompt_token_ids), sum(len(o.token_ids) for o in outputs))
        if len(outputs) > 1:
            body = chat_responses.with_choices(body, outputs, message=message)
        await self._vllm_extras(body, req, outputs)
        if response_body.is_small(outputs) and "prompt_logprobs" not in body:
            return web.json_response(body)
        # logprobs or much text: encoded off the loop, a choice at a time (server/response_body.py)
        choices, speller = body["choices"], self.speller
        resp = await response_body.send_in_pieces(
            request, body, lambda i: response_body.chat_choice(choices[i], outputs[i].token_logprobs, speller),
            self.body_thread)
        self.trim_soon()
        return resp

    async def _vllm_extras(self, body: dict, req: protocol.ChatRequest, outputs: list) -> None:
        """vLLM's fields a request asked for, in a chat body (server/vllm_extras.py)."""
        echo = vllm_extras.echo_text(req.messages) if req.echo else ""
        for choice, out in zip(body["choices"], outputs):
            message = choice["message"]
            if echo:
                message["content"] = echo + (message["content"] or "")
            if req.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
        plp = outputs[0].prompt_logprobs
        if plp is not None:  # large: made on the body thread
            body["prompt_logprobs"] = await asyncio.get_running_loop().run_in_executor(
                self.body_thread, vllm_extras.prompt_logprobs_json, plp, self.speller)
        if req.return_token_ids:
            body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)

    async def _stream(self, request: web.Request, req: protocol.ChatRequest, gen, out,
                      timing: Timing, parsed: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        cid, created = chat_responses.new_completion_id(), int(time.time())
        chunks = chat_responses.ChunkWriter(cid, self.model_name, created, req.include_usage)

        async def send(line: str) -> None:
            await resp.write(line.encode())

        n = req.params.n
        ids = req.return_token_ids  # vLLM's: the prompt's ids first, then each chunk's new tokens
        for index in range(n):  # OpenAI opens every choice with its role
            await send(chunks.role(index, list(out.prompt_token_ids) if ids else None))
        echo = vllm_extras.echo_text(req.messages) if req.echo else ""
        for index in range(n if echo else 0):  # vLLM's echo: the last message, before each choice's reply
            await send(chunks.content(echo, index))
        final = {}  # index -> final output
        logprobs_sent = [0] * n  # per choice: its tokens whose logprobs were streamed
        tokens_sent = [0] * n  # per choice: its tokens whose ids were streamed (return_token_ids)
        try:
            while True:
                i = out.index
                entries = None
                if out.token_logprobs is not None and len(out.token_logprobs) > logprobs_sent[i]:
                    entries = self.speller.content(out.token_logprobs, logprobs_sent[i])
                    logprobs_sent[i] = len(out.token_logprobs)
                new_ids = out.token_ids[tokens_sent[i]:] if ids else None
                if out.finished:  # its last text and finish_reason in one chunk, as vLLM sends them
                    delta = parsed_output.delta(out) if parsed else \
                        ({"content": out.delta_text} if out.delta_text else {})
                    await send(chunks.finish(out.finish_reason, i, delta, entries, new_ids))
                    final[out.index] = out
                    if len(final) == n:
                        self.observe(timing, out)  # the request's latencies once, at its last choice
                        break
                    self.metrics.finished(out.finish_reason)  # every choice's finish reason
                elif parsed:  # reasoning, content and tool-call pieces, each in its field
                    delta = parsed_output.delta(out)
                    if delta or entries is not None:
                        await send(chunks.delta(delta, i, entries, new_ids))
                        tokens_sent[i] = len(out.token_ids)
                elif entries is not None or out.delta_text:
                    # every token's logprobs once, with the text that has come since the last chunk
                    await send(chunks.content(out.delta_text, i, entries, new_ids))
                    tokens_sent[i] = len(out.token_ids)
                out = await gen.__anext__()
        except ConnectionResetError:  # the client left; closing the generator aborts every choice
            return resp
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            err = protocol.error_from_exception(e)
            if err.status >= 500 and not isinstance(e, EngineDeadError):  # the engine logs its own death
                logger.error("stream %s failed: %r", cid, e)
            self.metrics.error(err.status)
            await send(chunks.event(err.body()))
        else:
            request[USAGE] = (len(final[0].prompt_token_ids), sum(len(o.token_ids) for o in final.values()))
            if req.include_usage:  # the prompt counted once, the completions of every choice
                first = final[0]
                await send(chunks.usage(len(first.prompt_token_ids), sum(len(o.token_ids) for o in final.values()),
                                        first.num_cached_tokens))
        await send(chunks.done())
        await resp.write_eof()
        return resp

    def observe(self, timing: Timing, out) -> None:
        """A request's latencies, once, when its last choice (`out`) finishes."""
        end = time.monotonic()
        m = self.metrics
        m.time_to_first_token.observe(timing.first_token - timing.arrival)
        m.e2e_latency.observe(end - timing.arrival)
        n = len(out.token_ids)
        if n > 1:
            m.time_per_output_token.observe((end - timing.first_token) / (n - 1))
        m.finished(out.finish_reason)

