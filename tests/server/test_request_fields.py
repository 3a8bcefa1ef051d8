"""Every field of OpenAI's chat request (the installed `openai` package's `CompletionCreateParams`) is
honoured or refused with 400 unsupported_parameter naming it: none is dropped in silence. A field the
openai package adds later fails `test_every_field_is_classified` until it is given a row here."""
import typing

import pytest
from openai.types.chat import completion_create_params

from vlm_sdk.server.protocol import APIError, parse_chat_request

MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {"model": "m", "messages": MESSAGES}

# honoured: a value the server acts on (or, for tags, accepts by definition: see protocol.ACCEPTED_TAGS)
HONOURED = {
    "messages": MESSAGES, "model": "m", "max_tokens": 5, "max_completion_tokens": 5, "temperature": 0.5,
    "top_p": 0.9, "seed": 3, "stop": ["x"], "stream": True, "stream_options": {"include_usage": True},
    "metadata": {"k": "v"}, "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k",
    "parallel_tool_calls": False, "tool_choice": "none", "function_call": "none",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "response_format": {"type": "json_object"}, "modalities": ["text"], "store": False, "service_tier": "auto",
    "prompt_cache_retention": "in_memory", "n": 2, "logprobs": True, "top_logprobs": 3,
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"1": 5},
}
# refused: a value that asks for what this server cannot do
REFUSED = {
    "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low",
    "moderation": {"model": "omni-moderation-latest"}, "store": True, "service_tier": "flex",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
}


def _openai_fields() -> set[str]:
    return set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))


def _parse(body):
    return parse_chat_request(body, "m", max_model_len=100, limit_images=4)


def test_every_field_is_classified():
    fields = _openai_fields()
    assert "tools" in fields and "response_format" in fields  # the field list really is OpenAI's
    missing = sorted(fields - set(HONOURED) - set(REFUSED))
    assert not missing, f"OpenAI chat fields neither honoured nor refused here: {missing}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_field_is_a_400_naming_it(name):
    with pytest.raises(APIError) as e:
        _parse({**BASE, name: REFUSED[name]})
    assert e.value.status == 400
    body = e.value.body()["error"]
    assert (body["code"], body["param"], body["type"]) == ("unsupported_parameter", name, "invalid_request_error")
    assert repr(name) in body["message"] or f"'{name}'" in body["message"]


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_honoured_field_is_accepted(name):
    # top_logprobs alone and stream_options without stream are 400s of their own
    needs = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}}.get(name, {})
    _parse({**BASE, **needs, name: HONOURED[name]})


def test_honoured_fields_reach_the_request():
    req = _parse({**BASE, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                  "stop": ["x"], "stream": True, "stream_options": {"include_usage": True}})
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, tuple(p.stop)) == (7, 0.5, 0.9, 3, ("x",))
    assert req.stream and req.include_usage


def test_chat_options_reach_the_request():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = _parse({**BASE, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}},
                  "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False},
                  "cache_salt": "tenant-a"})
    o = req.options
    assert ([t.name for t in o.tools], o.tool_choice, o.tool_name) == (["f"], "function", "f")
    assert (o.parallel_tool_calls, dict(o.chat_template_kwargs), o.cache_salt) == (False, {"enable_thinking": False},
                                                                                  "tenant-a")
