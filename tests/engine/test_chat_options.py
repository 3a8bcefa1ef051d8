"""`ChatOptions` and tool turns in messages: every malformed tool, tool_choice, template kwarg, salt and
tool message is refused with an error naming its field; good ones are normalised."""
import json

import pytest

from vlm_sdk.chat_options import ChatOptions
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.messages import parse_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _refused(param: str, **kw) -> str:
    with pytest.raises(InvalidRequestError) as e:
        ChatOptions(**kw)
    assert e.value.param == param, str(e.value)
    return str(e.value)


def test_defaults_and_normalised_choice():
    assert ChatOptions().tool_choice == "none" and not ChatOptions().uses_tools
    o = ChatOptions(tools=[WEATHER])
    assert (o.tool_choice, o.parallel_tool_calls, o.uses_tools, o.forced) == ("auto", True, True, False)
    named = ChatOptions(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.tool_choice, named.tool_name, named.forced) == ("function", "get_weather", True)
    assert ChatOptions(tools=[WEATHER], tool_choice="none").uses_tools is False
    # no parameters (left out, null or {}, issue 50 points 3 and 4): a function whose arguments are {} only,
    # as vLLM's forced-call schema has it
    for fn in ({"name": "now"}, {"name": "now", "parameters": None}, {"name": "now", "parameters": {}}):
        tool = ChatOptions(tools=[{"type": "function", "function": fn}]).tools[0]
        assert dict(tool.parameters) == {"type": "object", "properties": {}, "additionalProperties": False}
        assert tool.spec["function"].get("parameters") == fn.get("parameters")  # the template gets them as sent


def test_malformed_tools_name_their_field():
    _refused("tools", tools={"type": "function"})
    _refused("tools[0]", tools=["get_weather"])
    _refused("tools[0].type", tools=[{"type": "retrieval", "function": WEATHER["function"]}])
    _refused("tools[0].function", tools=[{"type": "function"}])
    _refused("tools[0].function.name", tools=[{"type": "function", "function": {"description": "no name"}}])
    _refused("tools[0].function.name", tools=[{"type": "function", "function": {"name": "get weather!"}}])
    _refused("tools[0].function.parameters", tools=[{"type": "function", "function": {"name": "f", "parameters": []}}])
    _refused("tools[0].function.parameters",
             tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    text = _refused("tools[1].function.name", tools=[WEATHER, WEATHER])
    assert "unique" in text


def test_tool_choice_and_other_fields():
    text = _refused("tool_choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "search"}})
    assert "'search'" in text and "get_weather" in text
    _refused("tool_choice", tool_choice="required")  # no tools
    _refused("tool_choice", tools=[WEATHER], tool_choice="sometimes")
    _refused("parallel_tool_calls", tools=[WEATHER], parallel_tool_calls="yes")
    _refused("chat_template_kwargs", chat_template_kwargs=["enable_thinking"])
    assert "tools" in _refused("chat_template_kwargs", chat_template_kwargs={"tools": []})
    _refused("cache_salt", cache_salt="")
    _refused("cache_salt", cache_salt=7)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_turns_reach_the_template_with_decoded_arguments():
    msgs, _ = parse_messages([{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "r"},
                              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert msgs[1] == {"role": "assistant", "content": "", "reasoning_content": "r", "reasoning": "r", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("arguments", ["", None, "{}"])
def test_a_call_without_arguments_is_accepted(arguments):
    """vLLM reads "" and null arguments as {} (issue 50 point 1: "" was a 400)."""
    call = {**CALL, "function": {"name": "now", "arguments": arguments}}
    msgs, _ = parse_messages([{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_reasoning_in_either_field_reaches_the_template_under_both():
    """vLLM's name `reasoning` or its older `reasoning_content`, with or without tool calls."""
    for field in ("reasoning", "reasoning_content"):
        msgs, _ = parse_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", field: "r"}])
        assert msgs[1] == {"role": "assistant", "content": "yes", "reasoning": "r", "reasoning_content": "r"}
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([{"role": "assistant", "content": "", "reasoning": 3}])
    assert e.value.param == "messages[0].reasoning"


@pytest.mark.parametrize("messages,param", [
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "x"}], "messages[1].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "x"}],
     "messages[1].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "hi"},
      {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[2].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "tool_calls": "call_1"}], "messages[0].tool_calls"),
])
def test_bad_tool_turns_name_the_field(messages, param):
    with pytest.raises(InvalidRequestError) as e:
        parse_messages(messages)
    assert e.value.param == param and param in str(e.value)


def test_template_kwargs_may_not_take_the_renderers_own_names():
    """Every name transformers' apply_chat_template / render_jinja_template take as parameters, `self`
    (jinja2's Template.render), and every global of the template's environment (namespace(), range(), ...:
    a variable of the same name hides it; {"namespace": 1} was a 500 on Qwen's template) is refused."""
    import inspect

    import jinja2.sandbox
    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils

    from vlm_sdk.chat_options import RESERVED_TEMPLATE_VARIABLES, TEMPLATE_GLOBALS
    params = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    params |= set(inspect.signature(chat_template_utils.render_jinja_template).parameters)
    params |= set(inspect.signature(jinja2.Template.render).parameters)
    params -= {"kwargs", "args"}
    env_globals = set(jinja2.sandbox.ImmutableSandboxedEnvironment().globals)
    env_globals |= set(chat_template_utils._cached_compile_jinja_template("x").environment.globals)
    assert params <= RESERVED_TEMPLATE_VARIABLES, sorted(params - RESERVED_TEMPLATE_VARIABLES)
    assert env_globals <= TEMPLATE_GLOBALS, sorted(env_globals - TEMPLATE_GLOBALS)
    for name in ("namespace", "self", "range", "padding", "conversations"):
        assert name in _refused("chat_template_kwargs", chat_template_kwargs={name: 1})
    assert ChatOptions(chat_template_kwargs={"enable_thinking": False, "ns": 1}).chat_template_kwargs["ns"] == 1


def test_tool_limits_are_checked_before_the_tools_are_converted():
    from vlm_sdk.chat_options import ToolLimits, parse_tools
    limits = ToolLimits(max_tools=128, max_bytes=4096)
    broken = [WEATHER] * 10_000
    broken[5] = "not a tool"
    with pytest.raises(InvalidRequestError) as e:  # counted first: tools[5] is never looked at
        parse_tools(broken, limits)
    assert e.value.param == "tools" and "holds 10000 tools" in str(e.value)
    assert "max_tools=128" in str(e.value) and "--max-tools" in str(e.value)
    big = {"type": "function", "function": {"name": "f", "description": "d" * 3000}}
    with pytest.raises(InvalidRequestError) as e:  # stopped at the second tool: the third is never read
        parse_tools([big, big, "not a tool"], limits)
    seen = 2 * parse_tools([big])[0].nbytes
    assert f"is over {seen:,} bytes" in str(e.value) and "max_tool_bytes=4096" in str(e.value)
    assert "--max-tool-bytes" in str(e.value)
    tools = parse_tools([WEATHER, big], limits)
    assert [t.nbytes for t in tools] == [len(json.dumps(dict(t.spec), separators=(",", ":")).encode()) for t in tools]
    with pytest.raises(InvalidRequestError):
        limits.check(tools + tools)  # what the engine checks again, from the parsed tools
    options = ChatOptions(tools=list(tools))
    assert options.tool_chars == sum(t.chars for t in tools)
    assert ChatOptions(tools=list(tools), tool_choice="none").tool_chars == 0  # not rendered


def test_measure_counts_what_tool_turns_render():
    from vlm_sdk.multimodal.messages import measure
    args = json.dumps({"text": "x" * 5000})
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "reasoning_content": "r" * 100,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c", "content": "y" * 700}]
    assert measure(messages) == (2 + 100 + len("get_weather") + len(args) + 700, 0)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("arguments,words", [
    ('{"a": ' + DEEP + "}", "nests deeper than 64 levels"),  # was a RecursionError: a 500
    ('{"a": "\\ud800"}', "lone surrogate U+D800"),  # was an encoding error in the template: a 500
    ('{"a": ' + "[" * 70 + "]" * 70 + "}", "nests deeper than 64 levels"),
])
def test_bad_call_arguments_name_the_field(arguments, words):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([{"role": "assistant", "tool_calls": [call]}])
    assert e.value.param == "messages[0].tool_calls[0].function.arguments" and words in str(e.value)


def test_duplicate_call_ids_are_refused():
    calls = [CALL, {**CALL, "function": {"name": "search", "arguments": "{}"}}]
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([{"role": "assistant", "tool_calls": calls}])
    assert e.value.param == "messages[0].tool_calls[1].id" and "call 0" in str(e.value)
