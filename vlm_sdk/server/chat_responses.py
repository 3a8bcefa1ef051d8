"""The chat-completions response bodies and SSE chunks (`chat.completion`, `chat.completion.chunk`)."""
from __future__ import annotations

import json
import time
import uuid

from vlm_sdk.server.protocol import usage


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_body(cid: str, model: str, text: str | dict, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int, logprobs: dict | None = None) -> dict:
    """`text`: the answer, or the whole message (server/parsed_output.py `message`)."""
    msg = text if isinstance(text, dict) else {"role": "assistant", "content": text}
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def with_choices(body: dict, outputs: list, logprobs=lambda out: None, message=lambda out: out.text) -> dict:
    """A completion body with every one of n choices, in index order, each made as `completion_body`
    makes choice 0 (`logprobs(out)`: its logprobs object, or None; `message(out)` its text or
    message); the usage it holds already counts the prompt once."""
    def choice(out) -> dict:
        made = completion_body(body["id"], body["model"], message(out), out.finish_reason, 0, 0, 0,
                               logprobs(out))["choices"][0]
        return {**made, "index": out.index}
    body["choices"] = [choice(out) for out in outputs]
    return body


class ChunkWriter:
    """SSE lines of one streamed completion. Only the delta text changes between chunks, so the rest
    of each line is formatted once: per token the server then encodes one short string."""

    def __init__(self, cid: str, model: str, created: int, include_usage: bool):
        self.cid, self.model, self.created, self.include_usage = cid, model, created, include_usage
        head = json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model},
                          separators=(",", ":"))[:-1]
        tail = ',"usage":null}' if include_usage else "}"
        self._content_prefix = "data: " + head + ',"choices":[{"index":'
        self._content_suffix = '},"logprobs":null,"finish_reason":null}]' + tail + "\n\n"

    def event(self, payload: dict) -> str:
        return "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n"

    def role(self, index: int = 0, prompt_token_ids: list[int] | None = None) -> str:
        """A choice's first chunk; with vLLM's return_token_ids, the prompt's token ids beside it."""
        body = chunk_body(self.cid, self.model, self.created, {"role": "assistant", "content": ""}, None,
                          self.include_usage, index)
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = prompt_token_ids
        return self.event(body)

    def content(self, text: str, index: int = 0, logprobs: dict | None = None,
                token_ids: list[int] | None = None) -> str:
        if logprobs is not None or token_ids is not None:  # the rare case: a body of its own
            return self.delta({"content": text}, index, logprobs, token_ids)
        return f'{self._content_prefix}{index},"delta":{{"content":{json.dumps(text)}{self._content_suffix}'

    def delta(self, delta: dict, index: int = 0, logprobs: dict | None = None, token_ids: list[int] | None = None,
              finish_reason: str | None = None) -> str:
        """A chunk of any delta (reasoning, tool calls: server/parsed_output.py); `token_ids`: vLLM's
        return_token_ids, the tokens generated since the choice's last chunk."""
        body = chunk_body(self.cid, self.model, self.created, delta, finish_reason, self.include_usage, index)
        choice = body["choices"][0]
        choice["logprobs"] = logprobs
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self.event(body)

    def finish(self, reason: str, index: int = 0, delta: dict | None = None, logprobs: dict | None = None,
               token_ids: list[int] | None = None) -> str:
        """A choice's last chunk: its finish_reason with the text of its last tokens (`delta`), as vLLM
        streams it."""
        return self.delta(delta or {}, index, logprobs, token_ids, reason)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> str:
        return self.event(usage_chunk_body(self.cid, self.model, self.created, prompt_tokens, completion_tokens,
                                           cached_tokens))

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"


def chunk_body(cid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               include_usage: bool, index: int = 0) -> dict:
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk_body(cid: str, model: str, created: int, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
