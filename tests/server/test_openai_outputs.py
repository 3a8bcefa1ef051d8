"""What the parsers make of given model text, through the official `openai` client against `vlm-sdk serve`
(issue 50 points 5-7): a tiny Qwen2.5-VL whose weights write known scripts (tests/scripted_checkpoint.py;
the model, engine, sampler, detokenizer, parsers and server all real), served with the qwen3 reasoning
parser. Whole and streamed answers alike; the parsers' every-split equality is in
tests/parsers/test_vllm_cases.py and test_output_parsers.py.

- point 5: under "auto" a call's arguments are the model's text, not re-serialised (vLLM streams them so;
  `{"location":"San…` stayed `{"location": "San…` here);
- point 6: a Qwen3 thought that opens a call without closing ends at the call, which is returned (vLLM's
  qwen3 parser: tool_call_with_think_no_end); it was kept as reasoning and the call lost;
- point 7: the text around a run of calls keeps one separator (`Let me check.Done` lost it)."""
import json

import pytest
from openai import OpenAI

from scripted_checkpoint import scripted_checkpoint
from server_helpers import API_KEY
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

ARGUMENTS = ['"arguments": {"location":', '"San Francisco, CA"}}\n</tool_call>']
SCRIPTS = {
    "compact_arguments": ['<tool_call>\n{"name": "get_weather", '] + ARGUMENTS,
    "call_ends_the_thought": ["<think>The user wants the weather.", " I should call get_weather.\n",
                              '<tool_call>\n{"name": "get_weather", "arguments": {"location":"Paris"}}', "\n</tool_call>"],
    "separator": ["Let me check.\n",
                  '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Oslo"}}\n</tool_call>\n',
                  '<tool_call>\n{"name": "search", "arguments": {"q": "Oslo"}}\n</tool_call>',
                  "\nDone, waiting for the results."],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in San Francisco?"}]


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("scripted") / "ckpt"
    firsts = scripted_checkpoint(tiny_ckpt, ckpt, list(SCRIPTS.values()))
    config = ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny")
    with BackgroundServer(ckpt, config, reasoning_parser="qwen3") as s:
        yield s, dict(zip(SCRIPTS, firsts))


def _answer(served, script: str) -> tuple:
    """(whole message, its finish_reason, the streamed (reasoning, content, calls, finish_reason))."""
    srv, firsts = served
    client = OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=20,
                  logit_bias={str(firsts[script]): 100})
    whole = client.chat.completions.create(**kwargs).choices[0]
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            content += c.delta.content or ""
            for piece in c.delta.tool_calls or ():
                if piece.id is not None:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    return whole.message, whole.finish_reason, (reasoning or None, content or None,
                                                [tuple(calls[i]) for i in sorted(calls)], finish)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def test_auto_call_arguments_as_the_model_wrote_them(served):
    message, finish, streamed = _answer(served, "compact_arguments")
    expected = [("get_weather", '{"location":"San Francisco, CA"}')]  # byte for byte, no space added
    assert (_calls(message), message.content, finish) == (expected, None, "tool_calls")
    assert streamed == (None, None, expected, "tool_calls")


def test_a_call_opened_in_an_unclosed_thought_ends_it(served):
    message, finish, streamed = _answer(served, "call_ends_the_thought")
    thought = "The user wants the weather. I should call get_weather.\n"
    expected = [("get_weather", '{"location":"Paris"}')]
    extra = message.model_extra or {}
    assert (extra.get("reasoning"), extra.get("reasoning_content")) == (thought, thought)
    assert (_calls(message), message.content, finish) == (expected, None, "tool_calls")
    assert streamed == (thought, None, expected, "tool_calls")


def test_text_around_calls_keeps_its_separator(served):
    message, finish, streamed = _answer(served, "separator")
    text = "Let me check.\nDone, waiting for the results."
    expected = [("get_weather", '{"location": "Oslo"}'), ("search", '{"q": "Oslo"}')]
    assert (message.content, _calls(message), finish) == (text, expected, "tool_calls")
    assert streamed == (None, text, expected, "tool_calls")
    assert all(isinstance(json.loads(args), dict) for _, args in expected)
