"""vLLM's extensions of OpenAI's responses that its users rely on, in vLLM's shapes, for both endpoints.

    return_token_ids   chat: "prompt_token_ids" beside "choices" (a stream: in each choice's first chunk),
                       each choice's "token_ids" (a stream: each chunk's new ones); completions: both
                       inside each choice
    prompt_logprobs    chat: "prompt_logprobs" beside "choices"; completions: inside each choice; a
                       list with null for the first prompt token, then per token {"<id>": {"logprob",
                       "rank", "decoded_token"}}: the prompt token first, then the k most likely
    echo (chat)        the last message's content before each choice's, when that message is the
                       assistant's (the turn the reply continues), as vLLM's chat echo prepends it

Made as JSON text off the event loop when large (a 32k-token prompt with k = 20 is 700k entries): a
block of positions at a time, with a pause after each, as the logprobs of a body are.
"""
from __future__ import annotations

import json
import math
import time

from vlm_sdk.outputs import PromptLogprobs
from vlm_sdk.server.logprobs import BODY_PAUSE_S, TokenSpeller

_BLOCK = 64  # prompt positions made between pauses


class RawJSON(str):
    """A member's value already encoded as JSON (server/response_body.py writes it as it is)."""


def echo_text(messages: list) -> str:
    """What chat `echo` prepends: the last message's content when it is the assistant's (its text parts
    joined by newlines, as vLLM joins them), else nothing."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def prompt_logprobs_json(plp: PromptLogprobs, speller: TokenSpeller) -> RawJSON:
    """vLLM's prompt_logprobs list as JSON text (see the module docstring), read from the arrays a block
    of positions at a time; -inf is written -9999.0."""
    parts = ["null"]
    for start in range(1, len(plp), _BLOCK):
        end = start + _BLOCK
        rows = zip(plp.token_ids[start:end].tolist(), plp.logprobs[start:end].tolist(), plp.ranks[start:end].tolist())
        for ids, values, rank in rows:
            members, seen = [], set()
            for j, (token, value) in enumerate(zip(ids, values)):
                if token in seen:  # the prompt token among the k most likely: listed once, first
                    continue
                seen.add(token)
                members.append(f'"{token}":{{"logprob":{_number(value)},"rank":{rank if j == 0 else j},'
                               f'"decoded_token":{json.dumps(speller.spell(token)[0])}}}')
            parts.append("{" + ",".join(members) + "}")
        time.sleep(BODY_PAUSE_S)
    return RawJSON("[" + ",".join(parts) + "]")


def _number(value: float) -> str:
    return repr(value) if math.isfinite(value) else "-9999.0"
