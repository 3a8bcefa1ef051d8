"""vLLM's /tokenize, /detokenize and /version.

    POST /tokenize    {"prompt": "..."} (tokenized as /v1/completions tokenizes a prompt) or {"messages":
                      [...], "tools", "chat_template_kwargs", ...} (the prompt a chat request would run:
                      template, images fetched and expanded to their tokens) -> {"count", "max_model_len",
                      "tokens", "parts" (text tokens, each image's and each video's tokens, frames and grid,
                      as the render endpoints count them: server/render.py), "token_strs" (with
                      "return_token_strs": true)}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": text} (special tokens kept, as vLLM decodes)
    GET  /version     {"version"}

Both POSTs are admitted as the chat endpoint is (API key, the body limits, 503 while draining): a
messages body costs what the chat request's prompt costs, so it goes through the same checks (image
counts and pixels, tools, the media policy) and the same prompt threads. A prompt that can never fit
the context is the chat endpoint's 400 context_length_exceeded, whose message gives its length.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from vlm_sdk import __version__
from vlm_sdk.multimodal.prompts import TextPrompt
from vlm_sdk.server import protocol
from vlm_sdk.server.protocol import bad_request, clip
from vlm_sdk.server.render import parse_chat, too_long


class TokenizeEndpoints:
    """`server`: the `OpenAIServer` whose engine, config and media fetcher they share."""

    def __init__(self, server):
        self.server = server

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self.server._tracked(self._tokenize, request)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self.server._tracked(self._detokenize, request)

    async def _tokenize(self, request: web.Request) -> web.Response:
        server = self.server
        body = await server.admit(request)
        self._check_model(body)
        strs = protocol.json_bool(body, "return_token_strs")
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("send either 'prompt' (a text, tokenized as /v1/completions does) or 'messages' (the "
                              "prompt a chat request would run)", "prompt")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad_request(f"'prompt' must be a string, got {clip(repr(prompt))}", "prompt")
            if body.get("add_special_tokens") is False:
                raise bad_request("'add_special_tokens' false is not supported here: a prompt is tokenized as "
                                  "/v1/completions tokenizes it (with the tokenizer's special tokens); leave it out",
                                  "add_special_tokens", "unsupported_parameter")
            rendered = await server.engine.render(TextPrompt(prompt))
            param = "prompt"
        else:
            req = parse_chat(server, body)
            messages = await server.resolve_media(req.messages, req.options.cache_salt)
            rendered = await server.engine.render(messages, None, req.options)
            param = "messages"
        refusal = too_long(rendered, param)
        if refusal is not None:
            raise refusal
        tokens = rendered.token_ids
        out = {"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens,
               "parts": rendered.to_dict()["parts"]}
        if strs:
            out["token_strs"] = await asyncio.to_thread(self._convert, tokens)
        return web.json_response(out)

    async def _detokenize(self, request: web.Request) -> web.Response:
        server = self.server
        body = await server.admit(request)
        self._check_model(body)
        tokens = body.get("tokens")
        processor = server.engine.output_processor
        size = len(processor.tokenizer)
        if not isinstance(tokens, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in tokens):
            raise bad_request(f"'tokens' must be a list of token ids, got {clip(repr(tokens))}", "tokens")
        bad = [t for t in tokens if not 0 <= t < size]
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise bad_request(f"token id(s) {shown} in 'tokens' are outside the vocabulary: its ids are 0 to "
                              f"{size - 1}", "tokens")

        def decode() -> str:
            with processor.lock:
                return processor.tokenizer.decode(tokens, skip_special_tokens=False)
        return web.json_response({"prompt": await asyncio.to_thread(decode)})

    def _convert(self, tokens: list[int]) -> list[str]:
        processor = self.server.engine.output_processor
        with processor.lock:
            return processor.tokenizer.convert_ids_to_tokens(tokens)

    def _check_model(self, body: dict) -> None:
        """`model` may be left out (vLLM's tokenize requests make it optional); given, it must be ours."""
        if isinstance(body, dict) and body.get("model") is None:
            return
        protocol.check_model(body, self.server.model_name)
