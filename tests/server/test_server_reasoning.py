"""Reasoning output over HTTP with the official `openai` package on a tiny Qwen3-VL checkpoint carrying
the published Qwen3-VL-Thinking template (its generation prompt opens the <think> block): the
reasoning parser is chosen from the template; `reasoning_content` / `delta.reasoning_content` split
from the answer, streamed equal to not streamed; a block cut by max_tokens is all reasoning and no
content; structured outputs and a forced tool call constrain the answer after the reasoning, not the
reasoning; chat_template_kwargs reach the template."""
import json

import jsonschema
import pytest
from openai import OpenAI

from helpers import image
from server_helpers import API_KEY, data_url
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig
from vlm_sdk.testing import make_tiny_checkpoint

MESSAGES = [{"role": "user", "content": "How many apples are in the bowl?"}]
ANSWER = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 20},
                                           "fruit": {"enum": ["apple", "pear"]}},
          "required": ["count", "fruit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_thinking"), family="qwen3_vl", chat_template="thinking")


@pytest.fixture(scope="module")
def srv(thinking_ckpt):
    # no prefix caching: a request repeated with the same seed computes exactly the same steps
    with BackgroundServer(thinking_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny"),
                          enable_prefix_caching=False) as s:
        yield s


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _end_bias(srv, bias: float) -> dict:
    """A logit bias that makes the random model close its reasoning after a few tokens."""
    return {str(srv.engine.tokenizer.convert_tokens_to_ids("</think>")): bias}


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_parser_from_the_template(srv):
    chat = srv.engine.engine.inputs.chat
    assert chat.reasoning is not None and chat.reasoning.name == "qwen3" and chat.tool_parser == "hermes"


def test_block_cut_by_max_tokens_is_all_reasoning(srv):
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=4,
                                                logit_bias=_end_bias(srv, -100))
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    reasoning = _extra(choice.message, "reasoning_content")
    assert isinstance(reasoning, str) and reasoning and resp.usage.completion_tokens == 12


@pytest.mark.parametrize("bias", [-100, 4])
def test_streamed_reasoning_equals_the_message(srv, bias):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=40, seed=9, n=2, temperature=1.0,
                  logit_bias=_end_bias(srv, bias))
    whole = _client(srv).chat.completions.create(**kwargs)
    parts = {i: ["", ""] for i in range(2)}
    finish = {}
    for chunk in _client(srv).chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            # vLLM's new name and its old one, both sent (issue 50 point 2)
            assert _extra(c.delta, "reasoning") == _extra(c.delta, "reasoning_content")
            parts[c.index][0] += _extra(c.delta, "reasoning_content") or ""
            parts[c.index][1] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole.choices:
        assert _extra(c.message, "reasoning") == _extra(c.message, "reasoning_content")
        assert (parts[c.index][0], parts[c.index][1] or None) == (_extra(c.message, "reasoning_content"),
                                                                c.message.content)
        assert finish[c.index] == c.finish_reason
    if bias > 0:  # the reasoning closed: an answer followed in some choice
        assert any(c.message.content for c in whole.choices)


def test_structured_output_applies_after_the_reasoning(srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, n=4, seed=1,
                                                temperature=1.0, max_tokens=200, logit_bias=_end_bias(srv, 3))
    free = 0
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
        reasoning = _extra(choice.message, "reasoning_content")
        assert isinstance(reasoning, str)
        free += bool(reasoning.strip()) and not reasoning.lstrip().startswith("{")
    assert free > 0  # the reasoning itself was free text, not held to the schema


def test_forced_tool_call_after_reasoning(srv):
    tools = [{"type": "function", "function": {"name": "count_fruit", "parameters": ANSWER}}]
    resp = _client(srv).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False, n=3, seed=7,
        temperature=1.0, max_tokens=300, logit_bias=_end_bias(srv, 3))
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "count_fruit"
        jsonschema.validate(json.loads(call.function.arguments), ANSWER)
        assert isinstance(_extra(choice.message, "reasoning_content"), str)


def test_chat_template_kwargs_reach_the_template(srv):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image(64, 64, 1))}},
                                         {"type": "text", "text": "What is it?"}]}]
    plain = _client(srv).chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    numbered = _client(srv).chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                                    extra_body={"chat_template_kwargs": {"add_vision_id": True}})
    picture = srv.engine.tokenizer.encode("Picture 1: ", add_special_tokens=False)
    assert numbered.usage.prompt_tokens - plain.usage.prompt_tokens == len(picture)
