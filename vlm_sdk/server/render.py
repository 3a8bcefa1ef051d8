"""vLLM's dry runs, with the capacity answers vLLM leaves out.

    POST /v1/chat/completions/render   a chat body -> one object
    POST /v1/completions/render        a completions body -> a list, one per prompt

Each object has vLLM's fields (vllm/entrypoints/serve/render/serving.py, its GenerateRequest): request_id,
token_ids, features (null for text: {"mm_hashes": {modality: [hash]}, "mm_placeholders": {modality:
[{"offset", "length"}]}, "kwargs_data": null: nothing is encoded, so no tensors travel}), sampling_params,
model, stream, stream_options, cache_salt, priority; then ours (engine/render.py `RenderedRequest.to_dict`):
num_tokens, parts (text tokens, each image, each video with its frames and grid), kv (blocks and bytes per
cache group to the request's end), prefix_cache (the hit it would get now), fits (now / ever, the free blocks
and slots) and error (null, or the too-long error's message and fixes: the render still answers 200, since
the refusal is its answer). Admitted as the chat endpoint is (API key, body limits, media policy, the same
prompt threads); nothing is encoded or scheduled.
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid

from aiohttp import web

from vlm_sdk.chat_options import ToolLimits
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.server import completions as wire
from vlm_sdk.server import protocol
from vlm_sdk.server.protocol import APIError, bad_request

_JSON = (int, float, str, bool, type(None))


class RenderEndpoints:
    """`server`: the `OpenAIServer` whose engine, config and media fetcher they share."""

    def __init__(self, server):
        self.server = server

    async def chat(self, request: web.Request) -> web.Response:
        return await self.server._tracked(self._chat, request)

    async def completions(self, request: web.Request) -> web.Response:
        return await self.server._tracked(self._completions, request)

    async def _chat(self, request: web.Request) -> web.Response:
        server = self.server
        body = await server.admit(request)
        req = parse_chat(server, body)
        messages = await server.resolve_media(req.messages, req.options.cache_salt)
        rendered = await server.engine.render(messages, req.params, req.options)
        return web.json_response(vllm_object(rendered, "chatcmpl", server.model_name, req.params, req.stream,
                                             body.get("stream_options"), body.get("priority", 0)))

    async def _completions(self, request: web.Request) -> web.Response:
        server = self.server
        body = await server.admit(request)
        c, args = server.config, server.engine.args
        req = wire.parse_completion_request(body, server.model_name, c.max_stop_strings, c.max_stop_chars, c.max_n,
                                            c.max_completion_prompts, max_logit_bias=args.max_logit_bias,
                                            max_stop_token_ids=args.max_stop_token_ids,
                                            max_model_len=server.max_model_len,
                                            max_sequences=c.max_sequences_per_request)
        group = wire.new_completion_id()
        many = len(req.prompts) > 1

        async def one(i: int, prompt):
            try:
                return await server.engine.render(prompt, req.params, req.options, group)
            except InvalidRequestError as e:
                raise bad_request(f"prompt {i}: {e}" if many else str(e), e.param or "prompt") from None
        rendered = await asyncio.gather(*(one(i, p) for i, p in enumerate(req.prompts)))
        return web.json_response([vllm_object(r, "cmpl", server.model_name, req.params, req.stream,
                                              body.get("stream_options"), body.get("priority", 0))
                                  for r in rendered])


def parse_chat(server, body) -> protocol.ChatRequest:
    """The chat endpoint's parse, with its limits (shared with /tokenize)."""
    c, args = server.config, server.engine.args
    return protocol.parse_chat_request(
        {**body, "model": body.get("model") or server.model_name} if isinstance(body, dict) else body,
        server.model_name, server.max_model_len, c.limit_images, c.max_stop_strings, c.max_stop_chars, c.max_n,
        max_logit_bias=args.max_logit_bias, max_stop_token_ids=args.max_stop_token_ids, limit_videos=c.limit_videos,
        max_sequences=c.max_sequences_per_request, tool_limits=ToolLimits(args.max_tools, args.max_tool_bytes))


def too_long(rendered, param: str = "messages") -> APIError | None:
    """The 400 context_length_exceeded the generating endpoints give for this request, or None."""
    if rendered.error is None:
        return None
    return APIError(400, rendered.error.message, "invalid_request_error", param, "context_length_exceeded")


def vllm_object(rendered, prefix: str, model: str, params, stream: bool, stream_options, priority) -> dict:
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": rendered.token_ids,
            "features": features(rendered), "sampling_params": sampling_dict(params), "model": model,
            "stream": bool(stream), "stream_options": stream_options if stream else None,
            "cache_salt": rendered.cache_salt, "priority": priority, **rendered.to_dict()}


def features(rendered) -> dict | None:
    """vLLM's MultiModalFeatures: per modality each item's hash and placeholder range; None for text."""
    if not rendered.parts:
        return None
    hashes: dict[str, list] = {}
    places: dict[str, list] = {}
    for part in rendered.parts:
        hashes.setdefault(part.kind, []).append(part.hash)
        places.setdefault(part.kind, []).append({"offset": part.offset, "length": part.length})
    return {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": None}


def sampling_dict(params) -> dict:
    """The request's sampling settings as JSON (structured outputs by their kind only)."""
    out = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if isinstance(v, tuple):
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        out[f.name] = v if isinstance(v, (*_JSON, list)) else type(v).__name__
    return out
