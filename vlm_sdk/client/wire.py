"""Reading the server's answers: a JSON body or its error, SSE events, stream chunks as deltas."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

import aiohttp

from vlm_sdk.client.errors import APIError, error_from
from vlm_sdk.client.results import ChatDelta, CompletionChoice, CompletionDelta, CompletionResult, Usage


async def json_or_raise(resp: aiohttp.ClientResponse) -> Any:
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


def _event(data: str) -> dict:
    """One stream event's JSON object; an error the server sent in-band raises its `APIError`."""
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        raise APIError(f"unexpected stream event: {data[:200]}", status=200)
    if "error" in chunk:
        raise error_from(None, chunk["error"], data)
    return chunk


def chat_delta(data: str) -> ChatDelta:
    chunk = _event(data)
    choices = chunk.get("choices") or []
    if not choices:
        return ChatDelta("", None, Usage.from_json(chunk.get("usage")))
    choice = choices[0]
    delta = choice.get("delta") or {}
    return ChatDelta(delta.get("content") or "", choice.get("finish_reason"), Usage.from_json(chunk.get("usage")),
                     choice.get("index") or 0, delta.get("reasoning_content") or "", tuple(delta.get("tool_calls") or ()))


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
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




def completion_delta(data: str) -> CompletionDelta:
    chunk = _event(data)
    choices = chunk.get("choices") or []
    if not choices:
        return CompletionDelta("", None, Usage.from_json(chunk.get("usage")))
    choice = choices[0]
    return CompletionDelta(choice.get("text") or "", choice.get("finish_reason"), Usage.from_json(chunk.get("usage")),
                           choice.get("index") or 0, choice.get("logprobs"))


def completion_result(data: dict, model: str, latency_s: float) -> CompletionResult:
    try:
        choices = tuple(CompletionChoice(int(c.get("index") or 0), c.get("text") or "", c.get("finish_reason"),
                                         c.get("logprobs")) for c in data["choices"])
        if not choices:
            raise KeyError("choices")
    except (KeyError, TypeError, AttributeError, ValueError):
        raise APIError(f"unexpected completion: {json.dumps(data)[:200]}", status=200) from None
    return CompletionResult(tuple(sorted(choices, key=lambda c: c.index)), Usage.from_json(data.get("usage")),
                            data.get("model", model), data.get("id", ""), latency_s)
