"""`ChatOptions` and tool turns in messages: every malformed tool, tool_choice, template kwarg, salt and
tool message is refused with an error naming its field; good ones are normalised."""
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
    # no parameters: a function without arguments
    assert dict(ChatOptions(tools=[{"type": "function", "function": {"name": "now"}}]).tools[0].parameters) == \
        {"type": "object", "properties": {}}


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
    assert msgs[1] == {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


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
