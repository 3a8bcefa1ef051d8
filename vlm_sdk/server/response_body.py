"""A large non-streamed response, encoded off the event loop and sent a piece at a time.

A completion with logprobs holds n x tokens x (top_logprobs + 1) entries: 8 choices of 4,000 tokens
with 20 alternatives are 52 MB of JSON, which `json.dumps` writes in one C call that keeps the GIL
for seconds, so every other client would wait. Here the body is cut into pieces (the head, each
choice, the tail), each made on an executor thread a block of 16 tokens at a time with a short sleep
after each (server/logprobs.py: the engine and the loop get the GIL back within a block's work, not
after a 5 ms switch interval) and written as soon as it is made (chunked transfer encoding), so at
most one choice's bytes are held at a time.

    {"id":..,"object":..,"created":..,"model":..,"choices":[   head
    {"index":0,..,"logprobs":{"content":[{..},{..},..]},..}    one piece per choice
    ,{"index":1,..}
    ],"usage":{..}}                                            tail
"""
from __future__ import annotations

import asyncio
import json
from functools import partial

from aiohttp import web

from vlm_sdk.outputs import LogprobsView
from vlm_sdk.server.completions import LegacyLogprobs
from vlm_sdk.server.logprobs import TokenSpeller
from vlm_sdk.server.vllm_extras import RawJSON

# non-streamed bodies without logprobs and with less text than this are encoded on the loop at once
INLINE_TEXT_CHARS = 1 << 16


def is_small(outputs: list) -> bool:
    return all(o.token_logprobs is None for o in outputs) and sum(len(o.text) for o in outputs) < INLINE_TEXT_CHARS


async def send_in_pieces(request: web.Request, body: dict, make_choice, executor=None) -> web.StreamResponse:
    """Send `body` (a completion whose "choices" hold placeholders), choice i as the bytes of
    `make_choice(i)`, each made on `executor` (the server's one body thread: two bodies at once would
    only contend for the GIL with the engine thread)."""
    loop = asyncio.get_running_loop()
    keys = list(body)
    at = keys.index("choices")
    head = _members(body, keys[:at]) + ("," if at else "") + '"choices":['
    tail = "]" + "".join("," + _member(body, k) for k in keys[at + 1:]) + "}"
    resp = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await resp.prepare(request)
    await resp.write(("{" + head).encode())
    for i in range(len(body["choices"])):
        piece = await loop.run_in_executor(executor, make_choice, i)
        await resp.write(("," if i else "").encode() + piece)
    await resp.write(tail.encode())
    await resp.write_eof()
    return resp


def chat_choice(choice: dict, logprobs: LogprobsView | None, speller: TokenSpeller) -> bytes:
    """A chat choice's JSON, its logprobs (`RequestOutput.token_logprobs`) filled in a block at a time."""
    return _choice(choice, None if logprobs is None else partial(speller.content_json, logprobs))


def completion_choice(choice: dict, logprobs: LogprobsView | None, speller: TokenSpeller) -> bytes:
    """A /v1/completions choice's JSON, its logprobs in the legacy shape, filled in a block at a time."""
    return _choice(choice, None if logprobs is None else partial(LegacyLogprobs(speller).entries_json, logprobs))


def _choice(choice: dict, logprobs_json) -> bytes:
    """`choice` as JSON, its "logprobs" member the text `logprobs_json()` makes (None: as it is)."""
    parts = []
    for key in choice:
        if key == "logprobs" and logprobs_json is not None:
            parts.append('"logprobs":' + logprobs_json())
        else:
            parts.append(_member(choice, key))
    return ("{" + ",".join(parts) + "}").encode()


def _member(body: dict, key: str) -> str:
    value = body[key]
    return json.dumps(key) + ":" + (value if isinstance(value, RawJSON) else json.dumps(value))


def _members(body: dict, keys: list[str]) -> str:
    return ",".join(_member(body, k) for k in keys)
