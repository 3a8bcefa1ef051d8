"""`AsyncClient`: talk to `vlm-sdk serve` (or any OpenAI-compatible chat server) from asyncio.

    async with AsyncClient("http://127.0.0.1:8000") as client:
        result = await client.chat(messages, max_tokens=64, temperature=0)
        async for delta in client.chat_stream(messages, max_tokens=64):
            print(delta.text, end="")

Messages are the ones the Python API takes: local images (`PIL.Image`, a path, raw bytes, a
`file://` URL) are sent as base64 data URLs in OpenAI `image_url` parts, with their per-image options
(the part's other keys); `http(s)://` and `data:` URLs pass through untouched. Failures are typed: an HTTP error
raises the `APIError` subclass of its status, a connection failure or timeout `APIConnectionError`.
Importing this module does not import torch.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import mimetypes
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp

from vlm_sdk.errors import InvalidImageError, VLMError


class APIError(VLMError):
    """The server answered with an error. `status` is the HTTP status (for an error sent inside a
    stream, the status its type implies); `type`, `code` and `param` are the fields of the OpenAI
    error object, or None."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | None = None, param: str | None = None):
        super().__init__(f"{message} (HTTP {status})" if status else message)
        self.message, self.status, self.type, self.code, self.param = message, status, type, code, param


class BadRequestError(APIError):
    """400: the request is malformed or a value is out of range; `param` names the field when known."""


class ContextLengthExceededError(BadRequestError):
    """400 with code "context_length_exceeded": the prompt can never fit the server's KV cache."""


class AuthenticationError(APIError):
    """401: missing or wrong API key."""


class NotFoundError(APIError):
    """404: unknown model or path."""


class RequestTooLargeError(APIError):
    """413: the request body is over the server's max_request_bytes."""


class ServerError(APIError):
    """5xx: the server failed (503: not ready or shutting down)."""


class APIConnectionError(APIError):
    """No answer: the connection was refused or dropped, or a timeout expired (`status` is None)."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 413: RequestTooLargeError}
# an error inside a 200 stream carries no status; its type says which one it would have had
_STATUS_OF_TYPE = {"invalid_request_error": 400, "BadRequestError": 400, "authentication_error": 401,
                   "not_found_error": 404, "NotFoundError": 404}


def error_from(status: int | None, error: Any, raw: str = "") -> APIError:
    """The typed error for an HTTP status and an OpenAI error object (`{"message", "type", "param",
    "code"}`); a missing or non-dict object gives a message from the status and the raw body."""
    if not isinstance(error, dict):
        return _cls(status, None)(f"HTTP {status}: {raw[:200]}" if raw else f"HTTP {status} with no body",
                                  status=status)
    code = error.get("code")
    if status is None:
        status = code if isinstance(code, int) else _STATUS_OF_TYPE.get(error.get("type"), 500)
    code = None if code is None else str(code)
    return _cls(status, code)(str(error.get("message") or raw[:200] or "no message"), status=status,
                              type=error.get("type"), code=code, param=error.get("param"))


def _cls(status: int | None, code: str | None) -> type[APIError]:
    if status == 400 and code == "context_length_exceeded":
        return ContextLengthExceededError
    if status is not None and status >= 500:
        return ServerError
    return _BY_STATUS.get(status, APIError)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # image tokens included
    completion_tokens: int
    total_tokens: int
    # prompt tokens served from the server's prefix cache (`prompt_tokens_details.cached_tokens`, part of
    # prompt_tokens); None when the server does not report it, which is not the same as none cached
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> "Usage | None":
        if not isinstance(data, dict):
            return None
        p, c = int(data.get("prompt_tokens") or 0), int(data.get("completion_tokens") or 0)
        details = data.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(p, c, int(data.get("total_tokens") or p + c), None if cached is None else int(cached))


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or "tool_calls"
    usage: Usage | None
    model: str
    id: str
    latency_s: float  # wall time of the call, image encoding included
    texts: tuple[str, ...] = ()  # with n=k (an extra body field): the k choices' texts, index order
    # with `tools=` (extra body fields): choice 0's calls as OpenAI sends them ({"id", "type",
    # "function": {"name", "arguments"}}), and its reasoning when the server splits it off
    tool_calls: tuple[dict, ...] = ()
    reasoning_content: str | None = None


@dataclass(frozen=True)
class ChatDelta:
    text: str  # the new piece of the answer; may be ""
    finish_reason: str | None = None  # set on the delta that ends the choice
    usage: Usage | None = None  # set on the final usage-only delta
    index: int = 0  # which choice, with n=k: a stream interleaves the k choices
    reasoning: str = ""  # the new piece of the reasoning (`delta.reasoning_content`)
    tool_calls: tuple[dict, ...] = ()  # `delta.tool_calls` as sent: {"index", "id", "function": {...}}


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
            data = await _json_or_raise(resp)
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
            data = await _json_or_raise(resp)
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
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        async with self._request("POST", "/v1/chat/completions", body) as resp:
            if resp.status != 200:
                await _json_or_raise(resp)
            done = False
            try:
                async for data in _sse_events(resp):
                    if data == "[DONE]":
                        break
                    yield _delta(data)
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

    async def _body(self, messages, model: str | None, extra: dict, **params) -> dict:
        if model is None:
            # fetched once; two concurrent first calls may both ask, which is harmless
            if self._model is None:
                names = await self.models()
                if not names:
                    raise APIError(f"{self.base_url}/v1/models lists no model; pass model=...")
                self._model = names[0]
            model = self._model
        messages = await asyncio.to_thread(encode_messages, messages)  # encoding big images: off the loop
        body = {"model": model, "messages": messages, **extra}
        body.update({k: list(v) if isinstance(v, tuple) else v for k, v in params.items() if v is not None})
        return body


async def _json_or_raise(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.text(errors="replace")
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if resp.status != 200:
        raise error_from(resp.status, data.get("error") if isinstance(data, dict) else None, raw)
    if not isinstance(data, dict):
        raise APIError(f"expected a JSON object from {resp.url}, got: {raw[:200]}", status=200)
    return data


def _delta(data: str) -> ChatDelta:
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        raise APIError(f"unexpected stream event: {data[:200]}", status=200)
    if "error" in chunk:
        raise error_from(None, chunk["error"], data)
    choices = chunk.get("choices") or []
    if not choices:
        return ChatDelta("", None, Usage.from_json(chunk.get("usage")))
    choice = choices[0]
    delta = choice.get("delta") or {}
    return ChatDelta(delta.get("content") or "", choice.get("finish_reason"), Usage.from_json(chunk.get("usage")),
                     choice.get("index") or 0, delta.get("reasoning_content") or "", tuple(delta.get("tool_calls") or ()))


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The `data` of each server-sent event. Lines are split here rather than with readline, whose
    64 KiB line limit a long chunk could exceed."""
    buf, data = b"", []
    async for piece in resp.content.iter_any():
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:  # a blank line ends an event
                if data:
                    yield "\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                data.append(line[5:].decode("utf-8", errors="replace").removeprefix(" "))
    if buf.startswith(b"data:"):
        data.append(buf[5:].decode("utf-8", errors="replace").strip())
    if data:
        yield "\n".join(data)


# -- images -------------------------------------------------------------------------------------------
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"), (b"BM", "image/bmp"), (b"II*\x00", "image/tiff"),
               (b"MM\x00*", "image/tiff"))


def _is_pil(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")  # a PIL image can only exist if PIL is imported already
    return pil is not None and isinstance(obj, pil.Image)


def _is_local(src: Any) -> bool:
    if isinstance(src, str):
        return not src[:8].lower().startswith(("data:", "http://", "https://"))
    return True


def encode_messages(messages: list[dict]) -> list[dict]:
    """A copy of `messages` with every image part as an OpenAI `image_url` part whose URL is a data
    URL (local images) or the URL given (http(s), data). The part's other keys (per-image options of
    the model family, e.g. a size bound) end up inside `image_url`. Blocking: call it off the event loop."""
    out = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(msg)
            continue
        out.append({**msg, "content": [_encode_part(p) for p in content]})
    return out


def _encode_part(part: Any) -> Any:
    if not isinstance(part, dict) or part.get("type") not in ("image", "image_url"):
        return part
    if part["type"] == "image":
        inner, src = {}, part.get("image")
    else:
        url = part.get("image_url")
        inner = dict(url) if isinstance(url, dict) else {}
        src = inner.get("url") if isinstance(url, dict) else url
    inner.update({k: v for k, v in part.items() if k not in ("type", "image", "image_url") and v is not None})
    inner["url"] = to_data_url(src) if _is_local(src) else src
    return {"type": "image_url", "image_url": inner}


def to_data_url(src: Any) -> str:
    """A base64 data URL for a PIL image (encoded as PNG), a path or `file://` URL (the file's bytes
    as they are), or raw bytes; the MIME type is sniffed from the bytes, else guessed from the name."""
    if _is_pil(src):
        buf = io.BytesIO()
        try:
            src.save(buf, format="PNG")
        except (OSError, KeyError, ValueError):  # a mode PNG cannot hold (CMYK, YCbCr, ...)
            buf = io.BytesIO()
            src.convert("RGB").save(buf, format="PNG")
        data, name = buf.getvalue(), "x.png"
    elif isinstance(src, (bytes, bytearray, memoryview)):
        data, name = bytes(src), ""
    elif isinstance(src, (str, os.PathLike)):
        path = Path(os.fspath(src))
        if isinstance(src, str) and src[:7].lower() == "file://":
            from urllib.parse import unquote, urlparse
            from urllib.request import url2pathname
            path = Path(url2pathname(unquote(urlparse(src).path)))
        try:
            data, name = path.read_bytes(), path.name
        except OSError as e:
            raise InvalidImageError(f"cannot read image file {str(path)!r}: {e}") from e
    else:
        raise InvalidImageError(f"cannot send a {type(src).__name__} as an image; accepted: a PIL.Image, a path, "
                                f"bytes, a data: URL or an http(s) URL")
    if not data:
        raise InvalidImageError(f"empty image data from {name or 'bytes'}")
    mime = next((m for sig, m in _SIGNATURES if data.startswith(sig)), None)
    if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    mime = mime or mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
