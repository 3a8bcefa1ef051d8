"""The legacy completions wire format (POST /v1/completions), as OpenAI defines it and vLLM serves it:
request bodies in, `text_completion` bodies and SSE chunks out.

    prompt      a string, a list of strings, a list of token ids or a list of lists of ids; each
                prompt is completed with no chat template and no images (multimodal/prompts.py)
    choices     n per prompt: choice index = prompt index * n + sample index (vLLM's order)
    max_tokens  16 when left out or null (OpenAI's and vLLM's default); 0 only with echo: the
                prompt comes back and nothing is generated
    echo        the prompt's text before each choice's text (a token-id prompt's is its decoding)
    logprobs    k in 0..20: per generated token its text, logprob and a {token text: logprob} map of
                the k most likely tokens and the sampled one (OpenAI's "up to logprobs + 1"), and
                text_offset, each token's start counted as vLLM counts it (the lengths of the token
                texts before it). echo with logprobs (the prompt's in the legacy shape) is refused
                rather than answered with holes; vLLM's prompt_logprobs gives the prompt's
    vLLM's      return_token_ids, prompt_logprobs (server/vllm_extras.py), inside each choice
    suffix      refused (no served family fills in the middle), as vLLM refuses it; best_of only
                when it equals n (any other asks for server-side ranking, which is not built)

Every field of OpenAI's request (the openai package's completion_create_params) is honoured or
refused with 400 unsupported_parameter; the sampling fields and vLLM's extras (top_k, stop_token_ids,
ignore_eos, min_tokens, repetition_penalty, structured outputs, ..., and cache_salt) are read as the
chat endpoint reads them (server/protocol.py).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from vlm_sdk.chat_options import NO_OPTIONS, ChatOptions
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.prompts import RawPrompt, parse_prompts
from vlm_sdk.outputs import LogprobsView
from vlm_sdk.sampling_params import MAX_LOGPROBS, SamplingParams
from vlm_sdk.server.logprobs import BODY_PAUSE_S, Logprobs, TokenSpeller, logprobs_rows
from vlm_sdk.server.protocol import (bad_request, check_entry_counts, check_model, check_n, check_response_size,
                                     check_sequences, check_stop, clip, json_bool, json_int, parse_stream,
                                     prompt_logprobs, sampling_params, usage)

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's for this endpoint


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[RawPrompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    generate: bool  # False: echo with max_tokens 0, the prompts come back as they are
    options: ChatOptions = NO_OPTIONS  # cache_salt only: vLLM's field, keeping tenants' cached blocks apart
    return_token_ids: bool = False  # vLLM's: each choice's prompt_token_ids and token_ids

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


def parse_completion_request(body: object, model_name: str, max_stop_strings: int = 4, max_stop_chars: int = 256,
                             max_n: int = 8, max_prompts: int = 64, *, max_logit_bias: int | None = None,
                             max_stop_token_ids: int | None = None, max_response_logprobs: int | None = None,
                             max_model_len: int | None = None, max_sequences: int | None = None) -> CompletionRequest:
    """Validate a decoded JSON body (400, or 404 for another model). The per-request budgets are the
    chat endpoint's (`protocol.check_entry_counts`, `protocol.check_response_size` over every prompt)."""
    check_model(body, model_name)
    check_chat_only_fields(body)
    if body.get("suffix") is not None:
        raise bad_request(f"'suffix'={clip(repr(body['suffix']))} is not supported by this server (no served "
                          f"model fills in the middle); leave it out", "suffix", "unsupported_parameter")
    if body.get("prompt") is None:
        raise bad_request("'prompt' is required: a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids", "prompt")
    try:
        prompts = parse_prompts(_ids_as_ints(body["prompt"]))
    except InvalidRequestError as e:
        raise bad_request(str(e), "prompt") from None
    if len(prompts) > max_prompts:
        raise bad_request(f"'prompt' holds {len(prompts)} prompts; this server accepts at most {max_prompts} per "
                          f"request (server setting --max-completion-prompts)", "prompt", "too_many_prompts")
    stream, include_usage = parse_stream(body)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request(f"'echo' must be true or false, got {clip(repr(echo))}", "echo")
    logprobs = _logprobs(body.get("logprobs"))
    if echo and logprobs is not None:
        raise bad_request("'echo' with 'logprobs' asks for the prompt tokens' logprobs in the legacy shape, which "
                          "this server does not give; leave out one of them (vLLM's 'prompt_logprobs' gives them)",
                          "logprobs", "unsupported_parameter")
    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else json_int(max_tokens)
    generate = not (echo and max_tokens == 0)
    check_stop(body.get("stop"), max_stop_strings, max_stop_chars)
    check_entry_counts(body, max_logit_bias, max_stop_token_ids)
    params = sampling_params(body, logprobs, max_tokens if generate else None,
                             prompt_logprobs=prompt_logprobs(body, stream) if generate else None)
    check_n(params.n, max_n)
    check_sequences(len(prompts), params.n, max_sequences)
    if max_response_logprobs is not None and generate and not stream:
        check_response_size(params, max_model_len, max_response_logprobs, len(prompts))
    best_of = json_int(body.get("best_of"))
    if best_of is not None and best_of != params.n:
        raise bad_request(f"'best_of'={clip(repr(best_of))} asks the server to rank {best_of} completions and "
                          f"return the best {params.n}, which this server does not do; leave it out or set it "
                          f"equal to 'n'", "best_of", "unsupported_parameter")
    try:
        options = ChatOptions(cache_salt=body.get("cache_salt"))
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from None
    return CompletionRequest(prompts, params, stream, include_usage, bool(echo), generate, options,
                             json_bool(body, "return_token_ids"))


# the chat endpoint's fields (the openai package's chat params that its completions params lack, and
# vLLM's chat extras), which mean nothing without a chat template or messages: refused, never dropped (a
# client that sent tools must not take free text for a call); field -> the values that ask for nothing
CHAT_ONLY = {
    "messages": (None,), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "chat_template_kwargs": (None, {}), "chat_template": (None,), "add_generation_prompt": (None,),
    "continue_final_message": (None, False), "documents": (None,), "functions": (None,),
    "function_call": (None, "none"), "max_completion_tokens": (None,), "top_logprobs": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "moderation": (None,), "store": (None, False),
    "service_tier": (None, "auto", "default"), "prompt_cache_retention": (None, "in_memory"),
    "prompt_cache_options": (None,),
}
_CHAT_ONLY_HINT = {"max_completion_tokens": "send 'max_tokens'", "top_logprobs": "send 'logprobs': k"}


def check_chat_only_fields(body: dict) -> None:
    """A 400 naming the first chat-only field that asks for something (README "Request fields")."""
    for name, off in CHAT_ONLY.items():
        value = body.get(name)
        if value is not None and value not in off:
            hint = _CHAT_ONLY_HINT.get(name, "send it to /v1/chat/completions, or leave it out")
            raise bad_request(f"'{name}'={clip(repr(value))} is a chat completions field: /v1/completions "
                              f"completes a prompt as it is, with no chat template or messages, so it would "
                              f"be ignored; {hint}", name, "unsupported_parameter")


def _ids_as_ints(prompt):
    """JSON has one number type: token id 16.0 is 16 (in a list of ids, or a list of lists)."""
    if isinstance(prompt, list):
        return [_ids_as_ints(p) if isinstance(p, list) else json_int(p) for p in prompt]
    return prompt


def _logprobs(value) -> int | None:
    """The legacy field: how many most likely tokens to list per position (null: no logprobs)."""
    if value is None:
        return None
    value = json_int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens listed "
                          f"per position) or null, got {clip(repr(value))}", "logprobs")
    return value


# -- responses -------------------------------------------------------------------------------------
def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None, **extras) -> dict:
    """`extras`: vLLM's fields a request asked for (prompt_token_ids, token_ids, prompt_logprobs)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **extras}


def completion_body(cid: str, model: str, created: int, choices: list[dict], prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class ChunkWriter:
    """SSE lines of one streamed completion: a chunk per choice update (its new text, and its
    finish_reason on its last), the usage chunk (choices: []) when asked, then [DONE]. With
    include_usage every other chunk has "usage": null, as OpenAI streams it."""

    def __init__(self, cid: str, model: str, created: int, include_usage: bool):
        self.head = {"id": cid, "object": "text_completion", "created": created, "model": model}
        self.include_usage = include_usage

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
               **extras) -> str:
        body = {**self.head, "choices": [choice(index, text, finish_reason, logprobs, **extras)]}
        if self.include_usage:
            body["usage"] = None
        return event(body)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> str:
        return event({**self.head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})


def event(payload: dict) -> str:
    return "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n"


DONE = "data: [DONE]\n\n"


class LegacyLogprobs:
    """A choice's logprobs in the legacy shape {tokens, token_logprobs, top_logprobs, text_offset}, one
    choice at a time: `offset` carries on across a stream's chunks. A logprob of -inf (a token cut by
    top-k / top-p) is written as -9999.0, as OpenAI and vLLM write it (JSON has no -inf)."""

    def __init__(self, speller: TokenSpeller):
        self.speller = speller

    def entries(self, logprobs: Logprobs, offset: int = 0, start: int = 0) -> tuple[dict, int]:
        """(the logprobs object of tokens `start`.., the text offset after them)."""
        tokens, values, tops, offsets = [], [], [], []
        for token, value, alternatives in logprobs_rows(logprobs, start):
            text = self.speller.spell(token)[0]
            tops.append({self.speller.spell(t)[0]: _finite(v) for t, v in alternatives} | {text: _finite(value)})
            tokens.append(text)
            values.append(_finite(value))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset

    def entries_json(self, logprobs: LogprobsView) -> str:
        """`entries(logprobs)[0]` as JSON text, for a large body (server/response_body.py): made a block
        of tokens at a time with a pause after each, as `TokenSpeller.content_json` is, so that the
        engine thread is not kept waiting for the GIL (one `json.dumps` of a 4,000-token choice
        would hold it for tens of milliseconds)."""
        columns: dict[str, list[str]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for start in range(0, len(logprobs), LogprobsView.BLOCK):
            block, offset = self.entries(LogprobsView(logprobs.columns, min(start + LogprobsView.BLOCK, len(logprobs))),
                                         offset, start)
            for key, parts in columns.items():
                parts.append(json.dumps(block[key])[1:-1])
            time.sleep(BODY_PAUSE_S)
        return "{" + ",".join(f'"{key}":[' + ",".join(parts) + "]" for key, parts in columns.items()) + "}"


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0
