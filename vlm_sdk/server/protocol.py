"""The OpenAI wire format's request side: chat-completions bodies in, errors out, and the request
fields both endpoints share (model, stream, stop, sampling fields, n); the response bodies are
server/chat_responses.py's and server/completions.py's.

Every way a body can be wrong ends in an `APIError` with OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` and an HTTP status; `error_from_exception` maps the
engine's typed errors onto the same shape, so a user's mistake is always a 4xx that says what to fix.
"""
from __future__ import annotations

from dataclasses import dataclass

from vlm_sdk.chat_options import ChatOptions, ToolLimits, parse_tools
from vlm_sdk.engine.input.sampling_check import check_counts
from vlm_sdk.errors import (EngineDeadError, InputTooLongError, InvalidImageError, InvalidRequestError,
                            InvalidVideoError, ReplicaLostError, VLMError)
from vlm_sdk.sampling_params import MAX_LOGPROBS, SamplingParams, listed
from vlm_sdk.server.config import accepted_sources

# fields whose non-default value we cannot honour (other unknown fields are accepted and change nothing)
UNSUPPORTED = {  # field -> the values that mean "off", which are all we can honour
    "functions": (None,),  # the deprecated form of tools: send 'tools'
    "audio": (None,),
}
# the rest of OpenAI's chat request (openai's CompletionCreateParams; README "Request fields") that this
# server cannot honour, refused rather than dropped: a client that asked for tools or audio must
# not take free text for an answer. Values listed are those that ask for nothing beyond plain text.
UNSUPPORTED.update({
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),  # no served family has a reasoning budget to set
    "verbosity": (None,),
    "moderation": (None,),
    "store": (None, False),  # nothing is stored: there is no API to fetch a completion back
    "service_tier": (None, "auto", "default"),
    "prompt_cache_retention": (None, "in_memory"),  # the prefix cache lives in memory only
    "prompt_cache_options": (None,),  # breakpoints and TTLs: the prefix cache is automatic
})
# vLLM's extra chat fields this server does not act on, refused beyond their defaults (README "Request
# fields" says why); the reason is part of the message
UNSUPPORTED_WHY = {
    "chat_template": "a request may not bring its own Jinja template (vLLM refuses one too unless started with "
                     "--trust-request-chat-template); the model's chat template is used",
    "add_special_tokens": "the prompt is the chat template's text with no BOS or other special tokens added (what "
                          "false, vLLM's default for chat, means)",
    "continue_final_message": "the prompt always opens a new assistant turn after the messages",
    "add_generation_prompt": "the prompt always opens a new assistant turn after the messages",
}
UNSUPPORTED.update({"chat_template": (None,), "add_special_tokens": (None, False),
                    "continue_final_message": (None, False), "add_generation_prompt": (None, True)})
# accepted and without effect by their definition: metadata and user ids tag a request (nothing is
# stored or billed), prompt_cache_key routes to a cache (ours matches any shared prefix by content;
# vLLM's cache_salt is the field that keeps tenants apart)
ACCEPTED_TAGS = ("metadata", "user", "safety_identifier", "prompt_cache_key")
# tools and what the chat template is given, and the prefix-cache salt (vlm_sdk/chat_options.py)
CHAT_OPTION_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "cache_salt")


class APIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# a request's key for its (prompt tokens, completion tokens), set where its response counts them: the
# request log's line (app.py) reads it. A typed key where aiohttp has them (3.12+): a str key warns
try:
    from aiohttp.web import RequestKey
    USAGE = RequestKey("vlm_usage", tuple)
except ImportError:
    USAGE = "vlm_usage"

def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def over_http(message: str) -> str:
    """An image or video error as a client of the server reads it: the sources the Python API accepts
    (a PIL image, a path, bytes) named as the server accepts them (server/config.py accepted_sources)."""
    from vlm_sdk.multimodal.image_io import ACCEPTED_SOURCES
    from vlm_sdk.multimodal.video_container import ACCEPTED_VIDEO_SOURCES
    for kind, accepted in (("image", ACCEPTED_SOURCES), ("video", ACCEPTED_VIDEO_SOURCES)):
        message = message.replace(f"accepted: {accepted}", accepted_sources(kind))
    return message


def error_from_exception(exc: BaseException) -> APIError:
    """The engine's typed errors as HTTP errors; anything else is the server's fault (500, no details)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InputTooLongError):
        return APIError(400, str(exc), "invalid_request_error", "messages", "context_length_exceeded")
    if isinstance(exc, InvalidVideoError):
        return APIError(400, over_http(str(exc)), "invalid_request_error", "messages", "invalid_video")
    if isinstance(exc, InvalidImageError):
        return APIError(400, over_http(str(exc)), "invalid_request_error", "messages", "invalid_image")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), "invalid_request_error", exc.param, None)
    if isinstance(exc, ReplicaLostError):  # the server serves on: only this request failed
        return APIError(503, str(exc), "server_error", None, "replica_lost")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine has stopped and cannot take requests; see the server log and restart "
                             "the server", "server_error", None, "engine_dead")
    if isinstance(exc, VLMError):
        return APIError(400, str(exc), "invalid_request_error")
    return APIError(500, "internal server error; the request was not completed (details are in the server log)",
                    "server_error", None, "internal_error")


@dataclass(frozen=True)
class ChatRequest:
    messages: list
    params: SamplingParams
    stream: bool
    include_usage: bool
    num_images: int
    options: ChatOptions
    max_tokens_param: str = "max_tokens"  # the name the client gave max_tokens under (errors use it)
    num_videos: int = 0
    echo: bool = False  # vLLM's: each choice's content starts with the last message's, when it is the assistant's
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the response


def parse_chat_request(body: object, model_name: str, max_model_len: int, limit_images: int,
                       max_stop_strings: int = 4, max_stop_chars: int = 256, max_n: int = 8, *,
                       max_logit_bias: int | None = None, max_stop_token_ids: int | None = None,
                       max_response_logprobs: int | None = None, limit_videos: int = 2,
                       max_sequences: int | None = None, tool_limits: ToolLimits | None = None) -> ChatRequest:
    """Validate a decoded JSON body. `max_tokens` left out is None: as long as the context allows (the
    engine stops at max_model_len), as in vLLM; a too-long error then sizes its fixes for
    `DEFAULT_MAX_TOKENS` output tokens and says so. At most `max_stop_strings` stop strings of at most
    `max_stop_chars` characters each, and at most `max_n` choices (and `max_sequences`). `max_logit_bias` /
    `max_stop_token_ids`: the engine's limits, checked here before the entries are converted one by
    one (the engine checks them again, with the vocabulary). `max_response_logprobs`: the most logprob
    entries a non-streamed response may hold (`check_response_size`). `tool_limits`: the engine's
    max_tools / max_tool_bytes, checked while the tools are converted (it stops at the limit)."""
    check_model(body, model_name)
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in off:
            why = UNSUPPORTED_WHY.get(name)
            raise bad_request(f"'{name}'={clip(repr(value))} is not supported by this server"
                              f"{': ' + why if why else ''}; leave it out", name, "unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    num_images = count_images(messages)
    if num_images > limit_images:
        raise bad_request(f"the request has {num_images} images; this server accepts at most {limit_images} per "
                          f"request (server setting --limit-images)", "messages", "too_many_images")
    num_videos = count_images(messages, ("video", "video_url"))
    if num_videos > limit_videos:
        raise bad_request(f"the request has {num_videos} videos; this server accepts at most {limit_videos} per "
                          f"request (server setting --limit-videos)", "messages", "too_many_videos")
    stream, include_usage = parse_stream(body)
    check_stop(body.get("stop"), max_stop_strings, max_stop_chars)
    check_entry_counts(body, max_logit_bias, max_stop_token_ids)
    params = _sampling_params(body, max_model_len)
    check_n(params.n, max_n)
    check_sequences(1, params.n, max_sequences)
    if max_response_logprobs is not None and not stream:
        check_response_size(params, max_model_len, max_response_logprobs)
    return ChatRequest(messages, params, stream, include_usage, num_images, _chat_options(body, tool_limits),
                       max_tokens_param(body), num_videos, json_bool(body, "echo"), json_bool(body, "return_token_ids"))


def json_bool(body: dict, name: str) -> bool:
    """A true/false field (null or left out: false)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {clip(repr(value))}", name)
    return bool(value)


def prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: k most likely tokens listed at each prompt position (0-20), with the prompt
    token itself; not with a stream (vLLM refuses it there too). -1 (every token of the vocabulary) is
    refused: vLLM refuses it as well unless its max_logprobs is raised, and here the cap is 20."""
    value = json_int(body.get("prompt_logprobs"))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"'prompt_logprobs' must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens "
                          f"listed at each prompt position, beside the prompt's own), got {clip(repr(value))}",
                          "prompt_logprobs")
    if stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true (as in vLLM); send the request "
                          "without streaming", "prompt_logprobs")
    return value


def check_model(body: object, model_name: str) -> None:
    """The body is a JSON object naming the served model (400, or 404 for another model)."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {_json_type(body)}")
    model = body.get("model")
    if model is None:
        raise bad_request(f"'model' is required; this server serves {model_name!r}", "model")
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got a JSON {_json_type(model)}", "model")
    if model != model_name:
        raise APIError(404, f"model {clip(model)!r} does not exist; this server serves {model_name!r}",
                       "invalid_request_error", "model", "model_not_found")


def parse_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage). `stream_options` without `stream: true` is a 400, as in vLLM: the
    client asked for something about a stream it will not get."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, got {clip(repr(stream))}", "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        if opts and not stream:
            raise bad_request("'stream_options' can only be set when 'stream' is true; leave it out or set "
                              "\"stream\": true", "stream_options")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_request("'stream_options.include_usage' must be true or false", "stream_options")
    return stream, include_usage


def check_entry_counts(body: dict, max_logit_bias: int | None, max_stop_token_ids: int | None) -> None:
    """`logit_bias` / `stop_token_ids` within the engine's limits, counted before any entry is converted
    (a 2,000,000-entry object took 25 s to convert on the loop)."""
    for name, limit in (("logit_bias", max_logit_bias), ("stop_token_ids", max_stop_token_ids)):
        value = body.get(name)
        if limit is not None and isinstance(value, (dict, list)):
            try:
                check_counts(name, len(value), limit)
            except InvalidRequestError as e:
                raise bad_request(str(e), name, f"too_many_{name}") from None


def check_response_size(params: SamplingParams, max_model_len: int, limit: int, prompts: int = 1) -> None:
    """A non-streamed response holds every token's logprob entries at once (in memory, then in one
    body): prompts x n x max_tokens x (top_logprobs + 1) of them at most, with max_tokens left out
    counted as max_model_len. Streamed, each chunk carries its own tokens' entries."""
    if params.logprobs is None:
        return
    tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    entries = prompts * params.n * tokens * (params.logprobs + 1)
    if entries > limit:
        shown = f"max_tokens {tokens}" if params.max_tokens is not None else f"max_tokens unset, up to {tokens}"
        many = f"{prompts} prompts x " if prompts > 1 else ""
        raise bad_request(
            f"a non-streamed response with logprobs may hold at most {limit} logprob entries (server setting "
            f"--max-response-logprobs); this one could hold {many}n {params.n} x {shown} x (top_logprobs "
            f"{params.logprobs} + 1) = {entries}. Stream it (\"stream\": true), or lower n, max_tokens or "
            f"the logprobs asked for", "logprobs", "response_too_large")


def check_prompt_logprobs_size(params: SamplingParams, prompt_tokens: int, limit: int | None) -> None:
    """A response with prompt_logprobs holds (k + 1) entries per prompt token, counted against the same
    --max-response-logprobs, once the prompt's length is known (before it runs)."""
    if params.prompt_logprobs is None or limit is None:
        return
    entries = prompt_tokens * (params.prompt_logprobs + 1)
    if entries > limit:
        raise bad_request(
            f"a response with prompt_logprobs may hold at most {limit} logprob entries (server setting "
            f"--max-response-logprobs); this prompt's {prompt_tokens} tokens x (prompt_logprobs "
            f"{params.prompt_logprobs} + 1) = {entries}. Lower prompt_logprobs or send a shorter prompt",
            "prompt_logprobs", "response_too_large")


def check_n(n: int, max_n: int) -> None:
    if n > max_n:  # each choice is a sequence in the batch: a cap keeps one request from filling it
        raise bad_request(f"'n' is {n}; this server accepts at most {max_n} choices per request "
                          f"(server setting --max-n)", "n", "too_many_choices")


def check_sequences(prompts: int, n: int, limit: int | None) -> None:
    """A request's fan-out, its prompts x n sequences, within --max-sequences-per-request."""
    if limit is not None and prompts * n > limit:
        asked = f"{prompts} prompts x 'n' {n} = {prompts * n}" if prompts > 1 else f"'n' {n}"
        raise bad_request(f"the request asks for {asked} sequences; this server runs at most {limit} per request "
                          f"(server setting --max-sequences-per-request); send fewer prompts or a lower n, or split "
                          f"the request", "n", "too_many_sequences")


def max_tokens_param(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def check_output_room(prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    """A 400 naming the numbers when the prompt and `max_tokens` together exceed max_model_len, as vLLM
    answers (the engine would stop at max_model_len and report "length" without saying why). None:
    up to the context's end, nothing to check."""
    if max_tokens is None or prompt_tokens + max_tokens <= max_model_len:
        return
    room = max_model_len - prompt_tokens
    fix = (f"set '{param}' to at most {room}, or leave it out to generate up to the end of the context"
           if room >= 1 else "shorten the prompt")
    raise bad_request(f"'{param}' is {max_tokens}, but the prompt has {prompt_tokens} tokens and this server's "
                      f"context holds {max_model_len} (max_model_len), which leaves room for {max(room, 0)} "
                      f"({prompt_tokens} + {max_tokens} > {max_model_len}); {fix}", param,
                      "context_length_exceeded")


def _chat_options(body: dict, tool_limits: ToolLimits | None) -> ChatOptions:
    try:
        tools = parse_tools(body.get("tools"), tool_limits)  # counted, and measured as converted
    except InvalidRequestError as e:
        code = None
        if tool_limits is not None and e.param == "tools" and isinstance(body.get("tools"), list):
            code = "too_many_tools" if len(body["tools"]) > tool_limits.max_tools else "tools_too_large"
        raise bad_request(str(e), e.param, code) from None
    try:
        return ChatOptions(**{**{k: body.get(k) for k in CHAT_OPTION_FIELDS}, "tools": tools})
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from None


def count_images(messages: list, kinds: tuple[str, ...] = ("image", "image_url")) -> int:
    """Parts of the given types (default: images) in `messages`. Counting images, a video given as a
    list of frames counts its frames: each is fetched and decoded as an image."""
    count = 0
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind in kinds:
                    count += 1
                elif kind == "video" and "image" in kinds and isinstance(p.get("video"), list):
                    count += len(p["video"])
    return count


def check_stop(stop, max_count: int, max_chars: int) -> None:
    """A request's stop strings within the server's caps (their type is SamplingParams' to check)."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > max_count:
        raise bad_request(f"'stop' has {len(stops)} strings; this server accepts at most {max_count} per request "
                          f"(server setting --max-stop-strings)", "stop", "too_many_stop_strings")
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > max_chars:
            raise bad_request(f"'stop' string {i} is {len(s)} characters; this server accepts at most {max_chars} "
                              f"per stop string (server setting --max-stop-chars)", "stop", "stop_string_too_long")


# fields copied into SamplingParams as they are (it validates them and names the field on error)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "n",
                    "response_format", "structured_outputs")
# vLLM's older names for structured_outputs' keys, accepted so its clients work unchanged
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _sampling_params(body: dict, max_model_len: int) -> SamplingParams:
    name = max_tokens_param(body)
    max_tokens = body.get(name)
    return sampling_params(body, _logprobs(body), None if max_tokens is None else json_int(max_tokens), name,
                           prompt_logprobs(body, body.get("stream") is True))


def sampling_params(body: dict, logprobs: int | None, max_tokens, max_tokens_name: str = "max_tokens",
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The body's sampling fields as `SamplingParams`, with the endpoint's own reading of `logprobs`
    and `max_tokens` (given under `max_tokens_name`); a bad value is a 400 naming its field."""
    name = max_tokens_name
    kwargs = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    for k in ("top_k", "seed", "min_tokens", "n"):
        if k in kwargs:
            kwargs[k] = json_int(kwargs[k])
    if isinstance(kwargs.get("stop_token_ids"), list):
        kwargs["stop_token_ids"] = [json_int(t) for t in kwargs["stop_token_ids"]]
    kwargs["logprobs"] = logprobs
    guided = {key: body[name] for name, key in _GUIDED.items() if body.get(name) is not None}
    if guided:
        if "structured_outputs" in kwargs:
            raise bad_request("use 'structured_outputs' or the guided_* fields, not both", "structured_outputs")
        kwargs["structured_outputs"] = guided
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    kwargs["max_tokens"] = max_tokens
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        if e.param == "max_tokens" and name != "max_tokens":  # reported under the name the client sent
            raise bad_request(str(e).replace("'max_tokens'", f"'{name}'", 1), name) from None
        raise bad_request(str(e), e.param) from None


def _logprobs(body: dict) -> int | None:
    """OpenAI's pair: `logprobs` true turns them on, `top_logprobs` (0-20) needs it."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request(f"'logprobs' must be true or false, got {clip(repr(on))}", "logprobs")
    if top is not None and not on:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    top = json_int(top) if top is not None else 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}, got {clip(repr(top))}",
                          "top_logprobs")
    return top if on else None


def _logit_bias(bias) -> dict[int, object]:
    """JSON object keys are strings: {"1234": -100} maps token 1234 (SamplingParams checks the values).
    Every key that is not a token id is named in one error (the first five and a count), as vLLM does."""
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers from -100 to 100", "logit_bias")
    # ASCII digits only: str.isdigit() is also true of "²" (int() refuses it) and "١٢٣" (int() reads 123)
    bad = [key for key in bias if not (key.isascii() and key.isdigit())]
    if bad:
        raise bad_request(f"'logit_bias' keys must be token ids written in the digits 0-9; these are not: "
                          f"{listed(bad)}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def json_int(value):
    """JSON has one number type: 16.0 is the integer 16."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; `cached_tokens` are the prompt tokens served from the prefix cache
    (counted inside `prompt_tokens`, as OpenAI counts them)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
