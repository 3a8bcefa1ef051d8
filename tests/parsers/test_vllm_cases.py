"""Our parsers on vLLM's own parser test inputs, with vLLM's expected values (tests/reasoning/
test_qwen3_reasoning_parser.py, test_deepseekr1_reasoning_parser.py, tests/tool_parsers/
test_hermes_tool_parser.py in vllm-project/vllm), and the inputs issue 50 found lost or split
differently. Where we answer differently on purpose the case says so and why (README "Where we answer
differently"); vLLM's `content: None` is our "" (the server sends null for it).

Every input is also a property check: the streaming form fed the text split at every character (and
one character at a time, and at random cut points) gives exactly the whole-text result."""
import itertools
import json
import random

import pytest

from vlm_sdk.outputs import ToolCall
from vlm_sdk.parsers import REASONING_FORMATS, OutputFormat

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _streamed(fmt: OutputFormat, pieces) -> tuple:
    stream = fmt.stream(_ids())
    reasoning = content = ""
    calls: dict[int, list] = {}
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    return (reasoning if stream.saw_reasoning else None), content, [ToolCall(*calls[i]) for i in sorted(calls)]


def _read(fmt: OutputFormat, text: str) -> tuple:
    """The whole-text result, after checking every split of `text` gives it."""
    whole = fmt.parse(text, _ids())
    for k in range(len(text) + 1):
        assert _streamed(fmt, [text[:k], text[k:]]) == whole, f"split at {k}: {text[:k]!r} | {text[k:]!r}"
    assert _streamed(fmt, list(text)) == whole
    rng = random.Random(len(text))
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        assert _streamed(fmt, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]) == whole
    return whole


# -- vLLM's qwen3 reasoning parser -----------------------------------------------------------------------
# vLLM's parser assumes the template opened the block (thinking on) unless told enable_thinking=False;
# ours reads the prompt: `opened` is whether its last tokens opened the block.
TOOL_CALL_BODY = ("<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n"
                  "</tool_call>")
QWEN3_CASES = [  # (id, opened, output, vLLM's reasoning, vLLM's content)
    ("without_start_token", True, "This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("without_start_token_complete_reasoning", True, "This is a reasoning section</think>",
     "This is a reasoning section", None),
    ("with_think", False, "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("with_think_opened", True, "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("without_think", True, "This is the rest", "This is the rest", None),
    ("complete_reasoning", False, "<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("multiline_reasoning", False, "<think>This is a reasoning\nsection</think>This is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat"),
    ("only_open_tag", False, "<think>This is a reasoning section", "This is a reasoning section", None),
    ("truncated_no_start_token", True, "This is a reasoning section", "This is a reasoning section", None),
    ("tool_call_no_think_end", True, "I need to read the file.\n\n" + TOOL_CALL_BODY,
     "I need to read the file.\n\n", TOOL_CALL_BODY),
    ("tool_call_with_think_no_end", False, "<think>I need to read the file.\n\n" + TOOL_CALL_BODY,
     "I need to read the file.\n\n", TOOL_CALL_BODY),
    # thinking disabled (enable_thinking=False: the template closed the block in the prompt)
    ("thinking_disabled_plain_content", False, "This is plain content", None, "This is plain content"),
    ("thinking_disabled_with_tool_call", False, "I need to read the file.\n\n" + TOOL_CALL_BODY, None,
     "I need to read the file.\n\n" + TOOL_CALL_BODY),
]


@pytest.mark.parametrize("opened,output,reasoning,content", [c[1:] for c in QWEN3_CASES],
                         ids=[c[0] for c in QWEN3_CASES])
def test_qwen3_matches_vllm(opened, output, reasoning, content):
    # tools read under "auto", as vLLM's qwen3 parser always ends the reasoning at a call
    fmt = OutputFormat(reasoning=QWEN3, reasoning_open=opened, tool_parser="hermes", tool_names=("bash",))
    got_reasoning, got_content, calls = _read(fmt, output)
    assert (got_reasoning, got_content) == (reasoning, content or "")
    assert calls == []  # the XML form is not Hermes: its text is the content, as the tool parser left it


# -- vLLM's deepseek_r1 reasoning parser (the output always starts inside the block) -----------------------
R1_CASES = [  # (id, output, vLLM's reasoning, vLLM's content); streaming and whole-text alike where vLLM's differ
    ("simple_reasoning", "This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("complete_reasoning", "This is a reasoning section</think>", "This is a reasoning section", None),
    ("no_content_token", "This is content", "This is content", None),
    ("multiple_lines", "This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("shortest", "</think>This is the rest", "", "This is the rest"),  # vLLM's stream: reasoning None
    ("reasoning_with_think", "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("complete_reasoning_with_think", "<think>This is a reasoning section</think>", "This is a reasoning section",
     None),
    ("multiple_lines_with_think", "<think>This\nThat</think>This is the rest\nThat", "This\nThat",
     "This is the rest\nThat"),
    ("think_no_end", "<think>This is a reasoning section", "This is a reasoning section", None),
    ("empty", "", "", None),  # vLLM's stream: reasoning None
]


@pytest.mark.parametrize("output,reasoning,content", [c[1:] for c in R1_CASES], ids=[c[0] for c in R1_CASES])
def test_deepseek_r1_matches_vllm(output, reasoning, content):
    fmt = OutputFormat(reasoning=R1, reasoning_open=True)
    assert _read(fmt, output) == (reasoning, content or "", [])


# deliberate differences (README "Where we answer differently"), each with vLLM's answer beside ours
DIFFERENT = [
    # vLLM: content "\nThis is the rest" (its stream: reasoning "\nThis is a reasoning section"). Ours drops
    # the whitespace between the end tag and the answer (the templates render "</think>\n\n" before it)
    ("new_line", OutputFormat(reasoning=R1, reasoning_open=True),
     "\n<think>This is a reasoning section</think>\nThis is the rest", ("This is a reasoning section",
                                                                         "This is the rest", [])),
    # vLLM (qwen3 and deepseek_r1): reasoning "then thought", content " rest", "Answer first. " dropped.
    # Ours keeps the text before the block: the answer's when the block was not open yet...
    ("answer_before_block", OutputFormat(reasoning=QWEN3, reasoning_open=False),
     "Answer first. <think>then thought</think> rest", ("then thought", "Answer first. rest", [])),
    # ...the reasoning's when it was
    ("reasoning_before_block", OutputFormat(reasoning=QWEN3, reasoning_open=True),
     "Answer first. <think>then thought</think> rest", ("Answer first. then thought", "rest", [])),
    ("r1_before_block", OutputFormat(reasoning=R1, reasoning_open=True),
     "Answer first. <think>then thought</think> rest", ("Answer first. then thought", "rest", [])),
    # vLLM without the enable_thinking=False flag takes a block the template did not open for reasoning
    # (its WITHOUT_THINK case); ours knows from the prompt that none was open
    ("not_opened", OutputFormat(reasoning=QWEN3, reasoning_open=False), "This is the rest",
     (None, "This is the rest", [])),
]


@pytest.mark.parametrize("fmt,output,expected", [c[1:] for c in DIFFERENT], ids=[c[0] for c in DIFFERENT])
def test_deliberate_differences(fmt, output, expected):
    assert _read(fmt, output) == expected


# -- issue 50 point 6: a Qwen3 thought that calls a tool without closing ---------------------------------
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}}}


@pytest.mark.parametrize("opened,prefix", [(True, ""), (False, "<think>")])
def test_qwen3_reasoning_ends_at_a_call(opened, prefix):
    """vLLM ends the reasoning at <tool_call> and returns the call; the call was lost as reasoning."""
    text = (prefix + "The user wants the weather in San Francisco. I should call get_weather.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"location":"San Francisco, CA"}}\n</tool_call>')
    fmt = OutputFormat(reasoning=QWEN3, reasoning_open=opened, tool_parser="hermes", tool_names=("get_weather",))
    assert _read(fmt, text) == ("The user wants the weather in San Francisco. I should call get_weather.\n", "",
                                [ToolCall("call_0", "get_weather", '{"location":"San Francisco, CA"}')])
    # deepseek_r1 has no such rule in vLLM, nor here; without tools in use there is no call to read
    for other in (OutputFormat(reasoning=R1, reasoning_open=True, tool_parser="hermes", tool_names=("get_weather",)),
                  OutputFormat(reasoning=QWEN3, reasoning_open=True)):
        reasoning, content, calls = _read(other, text.removeprefix(prefix))
        assert (reasoning, content, calls) == (text.removeprefix(prefix), "", [])


def test_qwen3_tag_without_a_call_is_reasoning():
    fmt = OutputFormat(reasoning=QWEN3, reasoning_open=True, tool_parser="hermes", tool_names=("get_weather",))
    for thought in ("Calls go in <tool_call> tags.", "Wrap it: <tool_call> {not json", "<tool_call>\n<func",
                    "<tool_call>\n{"):
        assert _read(fmt, thought) == (thought, "", [])


# -- vLLM's hermes tool parser -----------------------------------------------------------------------------
NAMES = ("final_answer", "get_current_temperature", "get_weather", "search", "f", "get_db_config", "do_thing")
HERMES_CASES = [  # (id, output, content, [(name, arguments as vLLM returns them, or None: compare as JSON)])
    ("just_forward_text", "This is some prior text that has nothing to do with tool calling.",
     "This is some prior text that has nothing to do with tool calling.", []),
    ("bug_19056", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>', "",
     [("final_answer", '{"trigger": true}')]),
    # vLLM's streamed arguments are the model's text; its whole-text form re-serialises them ('{"location":
    # "San...'); ours passes them on as written in both (issue 50 point 5)
    ("streaming", '<tool_call>{"name": "get_current_temperature","arguments": {"location":"San Francisco, '
                  'California, United States", "unit": "celsius"}}</tool_call>', "",
     [("get_current_temperature", '{"location":"San Francisco, California, United States", "unit": "celsius"}')]),
    ("content_then_call", 'Sure, let me check the weather.<tool_call>{"name": "get_weather", '
                          '"arguments": {"city": "NYC"}}</tool_call>', "Sure, let me check the weather.",
     [("get_weather", '{"city": "NYC"}')]),
    ("multiple_calls", '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
                       '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>', "",
     [("search", '{"q": "cats"}'), ("search", '{"q": "dogs"}')]),
    ("until_eos", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}', "",
     [("final_answer", '{"trigger": true}')]),
    ("invalid_json", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
     '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}', []),
    ("serialized_arguments", '<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": '
                             '\\"max_connections\\"}"}\n</tool_call>', "",
     [("get_db_config", '{"param": "max_connections"}')]),
    ("content_and_call_in_one_chunk", 'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "Hi!",
     [("f", '{"x": 1}')]),
    ("no_tool_call", "This is not a tool call.", "This is not a tool call.", []),
]


@pytest.mark.parametrize("output,content,calls", [c[1:] for c in HERMES_CASES], ids=[c[0] for c in HERMES_CASES])
def test_hermes_matches_vllm(output, content, calls):
    fmt = OutputFormat(tool_parser="hermes", tool_names=NAMES)
    _, got_content, got_calls = _read(fmt, output)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict)


def test_hermes_non_object_arguments_stay_text():
    """A deliberate difference: vLLM returns a call whose arguments are '"hello"' (a JSON string); ours keeps
    the text as content, as for any call whose arguments are not an object: OpenAI's arguments are an
    object's JSON, and a client that runs `f(**json.loads(arguments))` would fail on anything else."""
    fmt = OutputFormat(tool_parser="hermes", tool_names=NAMES)
    for args in ('"hello"', '"{hello world}"', '"[oops"', '[1, 2]', '3'):
        text = '<tool_call>{"name": "do_thing", "arguments": ' + args + '}</tool_call>'
        assert _read(fmt, text) == (None, text, [])
