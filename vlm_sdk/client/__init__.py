"""`AsyncClient`: talk to `vlm-sdk serve` (or any OpenAI-compatible server) from asyncio.

    async with AsyncClient("http://127.0.0.1:8000") as client:
        result = await client.chat(messages, max_tokens=64, temperature=0)
        async for delta in client.chat_stream(messages, max_tokens=64):
            print(delta.text, end="")
        done = await client.completions("Once upon a time", max_tokens=16)   # POST /v1/completions

Messages are the ones the Python API takes: local images (`PIL.Image`, a path, raw bytes, a
`file://` URL) are sent as base64 data URLs in OpenAI `image_url` parts, local videos (a path, raw
bytes, a `file://` URL) in vLLM `video_url` parts, with their per-item options (the part's other keys);
`http(s)://` and `data:` URLs pass through untouched (client/images.py). A
completion's prompt is a text, token ids, or a list of either, with no chat template. Failures are
typed (client/errors.py): an HTTP error raises the `APIError` subclass of its status, a connection
failure or timeout `APIConnectionError`. Importing this package does not import torch.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

import aiohttp

from vlm_sdk.client.errors import (APIConnectionError, APIError, AuthenticationError, BadRequestError,
                                   ContextLengthExceededError, NotFoundError, RequestTooLargeError, ServerError,
                                   error_from)
from vlm_sdk.client.images import encode_messages, to_data_url
from vlm_sdk.client.results import (ChatDelta, ChatResult, CompletionChoice, CompletionDelta, CompletionResult,
                                    Usage)
from vlm_sdk.client.wire import chat_delta, completion_delta, completion_result, json_or_raise, sse_events

__all__ = ["AsyncClient", "APIError", "APIConnectionError", "AuthenticationError", "BadRequestError",
           "ContextLengthExceededError", "NotFoundError", "RequestTooLargeError", "ServerError", "error_from",
           "ChatDelta", "ChatResult", "CompletionChoice", "CompletionDelta", "CompletionResult", "Usage",
           "encode_messages", "to_data_url"]


class AsyncClient:
    """One `aiohttp.ClientSession` (made on first use, inside the running loop) for all requests;
    `close()` or leaving `async with` closes it. `timeout` bounds a whole request, a stream
    included; `connect_timeout` the TCP connect; `max_connections` the requests in flight at once."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0,
                 connect_timeout: float = 10.0, max_connections: int = 100):
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url  # accept OpenAI-style ".../v1" too
        self.api_key = api_key
        self.timeout, self.connect_timeout, self.max_connections = timeout, connect_timeout, max_connections
        self._session: aiohttp.ClientSession | None = None
        self._model: str | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- public API -------------------------------------------------------------------------------
    async def models(self) -> list[str]:
        async with self._request("GET", "/v1/models") as resp:
            data = await json_or_raise(resp)
        return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]

    async def health(self) -> bool:
        """True when GET /health answers 200; False on any other status or no answer at all."""
        try:
            async with self._request("GET", "/health") as resp:
                return resp.status == 200
        except APIConnectionError:
            return False

    async def chat(self, messages: list[dict], *, model: str | None = None, max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   seed: int | None = None, stop: str | list[str] | None = None, **extra) -> ChatResult:
        """One completion. Parameters left None take the server's defaults; `extra` goes into the
        request body as is (e.g. `ignore_eos=True`). `model` defaults to the server's first model."""
        t0 = time.perf_counter()
        body = await self._body(messages, model, extra, max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        async with self._request("POST", "/v1/chat/completions", body) as resp:
            data = await json_or_raise(resp)
        try:
            choice = data["choices"][0]
            ordered = sorted(data["choices"], key=lambda c: c.get("index") or 0)
            texts = tuple(c["message"].get("content") or "" for c in ordered)
            message = choice["message"]
            return ChatResult(message.get("content") or "", choice.get("finish_reason"),
                              Usage.from_json(data.get("usage")), data.get("model", body["model"]),
                              data.get("id", ""), time.perf_counter() - t0, texts,
                              tuple(message.get("tool_calls") or ()), message.get("reasoning_content"))
        except (KeyError, IndexError, TypeError, AttributeError):
            raise APIError(f"unexpected chat completion: {json.dumps(data)[:200]}", status=200) from None

    async def chat_stream(self, messages: list[dict], *, model: str | None = None, max_tokens: int | None = None,
                          temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                          seed: int | None = None, stop: str | list[str] | None = None,
                          **extra) -> AsyncIterator[ChatDelta]:
        """Deltas as the server streams them; the last carries `usage`. Leaving early (`break`,
        `aclose()`, cancellation) closes the connection, which makes the server abort the request
        and free its KV blocks; `contextlib.aclosing` makes that immediate rather than at garbage
        collection. An error the server sends mid-stream raises its `APIError`."""
        body = await self._body(messages, model, extra, max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        async for data in self._stream("/v1/chat/completions", body):
            yield chat_delta(data)

    async def completions(self, prompt: str | list[int] | list[str] | list[list[int]], *, model: str | None = None,
                          max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                          seed: int | None = None, stop: str | list[str] | None = None, echo: bool | None = None,
                          logprobs: int | None = None, n: int | None = None, **extra) -> CompletionResult:
        """POST /v1/completions: the prompt (a text, token ids, or a list of either: one choice per
        prompt and sample) completed with no chat template. Parameters left None take the server's
        defaults (max_tokens: 16); `extra` goes into the body as is (e.g. `top_k=5`)."""
        t0 = time.perf_counter()
        body = await self._completion_body(prompt, model, extra, max_tokens=max_tokens, temperature=temperature,
                                           top_p=top_p, seed=seed, stop=stop, echo=echo, logprobs=logprobs, n=n)
        async with self._request("POST", "/v1/completions", body) as resp:
            data = await json_or_raise(resp)
        return completion_result(data, body["model"], time.perf_counter() - t0)

    async def completions_stream(self, prompt: str | list[int] | list[str] | list[list[int]], *,
                                 model: str | None = None, max_tokens: int | None = None,
                                 temperature: float | None = None, top_p: float | None = None,
                                 seed: int | None = None, stop: str | list[str] | None = None,
                                 echo: bool | None = None, logprobs: int | None = None, n: int | None = None,
                                 **extra) -> AsyncIterator[CompletionDelta]:
        """`completions` streamed: deltas of the choices as they come (told apart by `index`), the last
        carrying `usage`. Leaving early aborts every choice on the server, as `chat_stream` does."""
        body = await self._completion_body(prompt, model, extra, max_tokens=max_tokens, temperature=temperature,
                                           top_p=top_p, seed=seed, stop=stop, echo=echo, logprobs=logprobs, n=n)
        async for data in self._stream("/v1/completions", body):
            yield completion_delta(data)

    async def _stream(self, path: str, body: dict) -> AsyncIterator[str]:
        """The SSE events of a streamed request, with usage asked for, up to [DONE]. Leaving early
        (`break`, `aclose()`, cancellation) closes the connection, which makes the server abort the
        request and free its KV blocks."""
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        async with self._request("POST", path, body) as resp:
            if resp.status != 200:
                await json_or_raise(resp)
            done = False
            try:
                async for data in sse_events(resp):
                    if data == "[DONE]":
                        break
                    yield data
                done = True  # [DONE], or the server ended the stream: nothing more is coming
            finally:
                if not done:
                    resp.close()  # drop the connection rather than drain it: the server aborts

    # -- internals --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _request(self, method: str, path: str, body: dict | None = None):
        """The response, with connection failures and timeouts (also while reading it) turned
        into `APIConnectionError`."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                # sock_connect, not connect: waiting for a free pooled connection is not a connect failure
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout))
        url = self.base_url + path
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with self._session.request(method, url, json=body, headers=headers) as resp:
                yield resp
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if isinstance(e, asyncio.TimeoutError):
                what = f"timed out (timeout={self.timeout:g} s, connect_timeout={self.connect_timeout:g} s)"
            else:
                what = f"failed: {type(e).__name__}: {e}"
            raise APIConnectionError(f"{method} {url} {what}") from e

    async def _model_name(self, model: str | None) -> str:
        if model is None:
            # fetched once; two concurrent first calls may both ask, which is harmless
            if self._model is None:
                names = await self.models()
                if not names:
                    raise APIError(f"{self.base_url}/v1/models lists no model; pass model=...")
                self._model = names[0]
            model = self._model
        return model

    async def _body(self, messages, model: str | None, extra: dict, **params) -> dict:
        model = await self._model_name(model)
        messages = await asyncio.to_thread(encode_messages, messages)  # encoding big images: off the loop
        return _with_params({"model": model, "messages": messages, **extra}, params)

    async def _completion_body(self, prompt, model: str | None, extra: dict, **params) -> dict:
        model = await self._model_name(model)
        prompt = [list(p) if isinstance(p, tuple) else p for p in prompt] if isinstance(prompt, (list, tuple)) \
            else prompt
        return _with_params({"model": model, "prompt": prompt, **extra}, params)


def _with_params(body: dict, params: dict) -> dict:
    body.update({k: list(v) if isinstance(v, tuple) else v for k, v in params.items() if v is not None})
    return body
