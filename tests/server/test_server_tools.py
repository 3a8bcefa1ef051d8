"""Tool calling over HTTP with the official `openai` package on the tiny Qwen2.5-VL server (its chat
template carries the published tool sections): a named tool_choice and "required" return calls whose
arguments validate against the function's JSON Schema (jsonschema), streamed and not, with n > 1; a
full round trip (call -> tool message -> answer) renders the tool result into the next prompt; "auto"
on a model that writes broken calls answers 200 with the text as content; malformed tools, a
tool_choice naming an absent function and a tool message without its call are 400s naming the field;
a model whose chat template renders no tools refuses them."""
import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEY, post
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10}}, "required": ["query"],
          "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny")) as s:
        yield s


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _streamed_calls(stream) -> dict[int, tuple[str, list, list]]:
    """choice index -> (finish_reason, [(id, name, arguments)], names seen per call) from the chunks."""
    calls, finish, names = {}, {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content  # a forced call has no content
            for piece in choice.delta.tool_calls or ():
                per = calls.setdefault(choice.index, {})
                if piece.id is not None:
                    per[piece.index] = [piece.id, piece.function.name, piece.function.arguments or ""]
                    names.setdefault((choice.index, piece.index), []).append(piece.function.name)
                else:
                    assert piece.function.name is None  # the name comes once
                    per[piece.index][2] += piece.function.arguments
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return {i: (finish[i], [tuple(per[k]) for k in sorted(per)], names) for i, per in calls.items()}


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_schema_valid_arguments(srv, stream):
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                                n=3, seed=11, temperature=1.0, max_tokens=200, stream=stream)
    if not stream:
        assert len(resp.choices) == 3
        for choice in resp.choices:
            assert choice.finish_reason == "stop"  # OpenAI's for a named function
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
            _valid("get_weather", call.function.arguments)
        return
    got = _streamed_calls(resp)
    assert sorted(got) == [0, 1, 2]
    for finish, calls, names in got.values():
        assert finish == "stop" and len(calls) == 1 and calls[0][1] == "get_weather"
        _valid("get_weather", calls[0][2])
    assert all(len(n) == 1 for _, _, names in got.values() for n in names.values())


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_calls_to_known_tools(srv, stream):
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                n=3, seed=5, temperature=1.0, max_tokens=300, stream=stream)
    results = ([(c.finish_reason, [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls])
                for c in resp.choices] if not stream else [(f, calls) for f, calls, _ in _streamed_calls(resp).values()])
    assert len(results) == 3
    for finish, calls in results:
        assert finish == "tool_calls" and calls
        assert len({cid for cid, _, _ in calls}) == len(calls)  # ids unique
        for _, name, arguments in calls:
            _valid(name, arguments)


def test_parallel_tool_calls_false_is_one_call(srv):
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, n=4, seed=2, temperature=1.0, max_tokens=200)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        _valid(call.function.name, call.function.arguments)


def test_round_trip_call_tool_answer(srv):
    client = _client(srv)
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, seed=1,
                                           max_tokens=200)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    history = MESSAGES + [assistant.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, seed=1, max_tokens=6)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the second prompt is the first one, the call as the template renders it, and the tool's result
    engine = srv.engine.engine
    prompt = srv.call(srv.engine.build_prompt(history, None, _options()))
    text = engine.inputs.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    args = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nSunny, 21 degrees\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert "# Tools" in text and '"name": "search"' in text
    assert answer.usage.prompt_tokens == len(prompt.token_ids)


def _options():
    from vlm_sdk.chat_options import ChatOptions
    return ChatOptions(tools=TOOLS)


def test_auto_with_broken_calls_is_content_not_500(srv):
    # the tokenizer's <tool_call> token pushed up: the random model opens calls it never completes
    tool_call = srv.engine.tokenizer.convert_tokens_to_ids("<tool_call>")
    resp = _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=3, max_tokens=40,
                                                logit_bias={str(tool_call): 8}, n=2)
    for choice in resp.choices:
        assert choice.message.tool_calls is None and "<tool_call>" in choice.message.content
        assert choice.finish_reason in ("stop", "length")
    chunks = list(_client(srv).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=3,
                                                       max_tokens=40, logit_bias={str(tool_call): 8}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == resp.choices[0].message.content


@pytest.mark.parametrize("change,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "translate"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MESSAGES + [{"role": "tool", "tool_call_id": "call_x", "content": "18 C"}]},
     "messages[1].tool_call_id"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_bad_tool_requests_are_400_naming_the_field(srv, change, param):
    change = dict(change)
    status, body = post(srv.url, {"model": "tiny", "messages": MESSAGES, **change})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    extra = {k: change.pop(k) for k in list(change) if k == "chat_template_kwargs"}  # vLLM's, not OpenAI's
    with pytest.raises(openai.BadRequestError):
        _client(srv).chat.completions.create(model="tiny", **{"messages": MESSAGES, **change}, extra_body=extra)


def test_a_template_without_tools_refuses_them(internvl_ckpt):
    with BackgroundServer(internvl_ckpt, ServerConfig(port=0)) as s:
        status, body = post(s.url, {"model": s.model_name, "messages": MESSAGES, "tools": TOOLS}, key=None)
        assert status == 400 and body["error"]["param"] == "tools"
        assert "does not render 'tools'" in body["error"]["message"]
        status, body = post(s.url, {"model": s.model_name, "messages": MESSAGES, "tools": TOOLS,
                                    "tool_choice": "none", "max_tokens": 2}, key=None)
        assert status == 200  # tool_choice "none": the tools are not rendered, so nothing is refused


def test_async_client_reads_calls(srv):
    import asyncio

    from vlm_sdk.client import AsyncClient

    async def main():
        async with AsyncClient(srv.url, API_KEY) as client:
            whole = await client.chat(MESSAGES, model="tiny", max_tokens=200, seed=6, tools=TOOLS, tool_choice=NAMED)
            pieces = [d async for d in client.chat_stream(MESSAGES, model="tiny", max_tokens=200, seed=6,
                                                          tools=TOOLS, tool_choice=NAMED)]
        return whole, pieces
    whole, pieces = asyncio.run(main())
    (call,) = whole.tool_calls
    assert whole.finish_reason == "stop" and call["function"]["name"] == "get_weather"
    _valid("get_weather", call["function"]["arguments"])
    streamed = "".join(t["function"].get("arguments") or "" for d in pieces for t in d.tool_calls)
    _valid("get_weather", streamed)
    assert [t["function"]["name"] for d in pieces for t in d.tool_calls if "id" in t] == ["get_weather"]


def test_functions_without_parameters_and_calls_without_arguments(srv):
    """vLLM's: an assistant call sent back with "" (or "{}", or null) arguments is accepted (issue 50 point 1:
    "" was a 400); a tool whose parameters are null is one without parameters (point 3: a 400), and a forced
    call to a function without parameters carries {} only (point 4: {} let any object through)."""
    client = _client(srv)
    for arguments in ("", "{}", None):
        history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
        tools = [{"type": "function", "function": {"name": "now", "parameters": None}}]
        resp = client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=2)
        assert resp.choices[0].finish_reason in ("stop", "length")
    for parameters in (None, {}):
        tools = [{"type": "function", "function": {"name": "now", "parameters": parameters}}]
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, n=2, seed=5, temperature=1.0, max_tokens=40)
        for choice in resp.choices:
            assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
                [("now", {})]
