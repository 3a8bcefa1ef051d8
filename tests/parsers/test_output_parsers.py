"""The output parsers on model texts in the published formats: Hermes tool calls as Qwen2.5-VL and
Qwen3-VL write them (the chat templates' own rendering of a call; some texts in the shape of vLLM's
hermes-parser fixtures), Qwen3 think blocks (a template that opens the block, one that does not, a
model that opens it itself, a block cut by max_tokens), each read by the whole-text form and checked
against the expected parts, and the streaming form fed the same text split at every character
boundary (and one character at a time) giving exactly the whole-text result."""
import itertools
import json

import pytest

from vlm_sdk.outputs import ToolCall
from vlm_sdk.parsers import REASONING_FORMATS, OutputFormat

QWEN3 = REASONING_FORMATS["qwen3"]
NAMES = ("get_weather", "search")


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _streamed(fmt: OutputFormat, pieces) -> tuple:
    """(reasoning or None, content, calls) assembled from the stream's deltas as a client would."""
    stream = fmt.stream(_ids())
    reasoning = content = ""
    calls: dict[int, list] = {}
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:  # the first piece of a call: its id and name, once
                assert piece.index not in calls and piece.name is not None
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order
    return (reasoning if stream.saw_reasoning else None), content, [ToolCall(*calls[i]) for i in sorted(calls)]


def _check_every_split(fmt: OutputFormat, text: str):
    whole = fmt.parse(text, _ids())
    for k in range(len(text) + 1):
        assert _streamed(fmt, [text[:k], text[k:]]) == whole, f"split at {k}: {text[:k]!r} | {text[k:]!r}"
    assert _streamed(fmt, list(text)) == whole
    return whole


def _call(i, name, args):
    return ToolCall(f"call_{i}", name, json.dumps(args, ensure_ascii=False))


# (text, expected content, expected calls): free calls (tool_choice "auto")
FREE = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "", [_call(0, "get_weather", {"city": "Paris", "days": 2})]),
    ("I'll look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
     '<tool_call>\n{"name": "search", "arguments": {"q": "Louvre opening hours"}}\n</tool_call>',
     "I'll look both up.", [_call(0, "get_weather", {"city": "Paris"}), _call(1, "search", {"q": "Louvre opening hours"})]),
    ('The receipt is from a café. <tool_call>\n{"name": "search", "arguments": {"q": "café"}}\n</tool_call> '
     "Then I will sum it up.", "The receipt is from a café. Then I will sum it up.", [_call(0, "search", {"q": "café"})]),
    # a run of calls leaves one separator between the texts around it: the whitespace before its first
    # call, else the one after its last (issue 50 point 7: "Let me check.Done" lost it)
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search", "arguments": {"q": "Oslo"}}\n</tool_call>\nDone, waiting for the results.',
     "Let me check.\nDone, waiting for the results.",
     [_call(0, "get_weather", {"city": "Oslo"}), _call(1, "search", {"q": "Oslo"})]),
    ('Checking.<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n\nFound it.',
     "Checking.\n\nFound it.", [_call(0, "search", {"q": "a"})]),
    ('Before.<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>After.', "Before.After.",
     [_call(0, "search", {"q": "a"})]),
    # a broken call after a valid one is text: the run before it leaves its separator
    ('A\n<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n<tool_call>{"name": 1}</tool_call>',
     'A\n<tool_call>{"name": 1}</tool_call>', [_call(0, "search", {"q": "a"})]),
    # the arguments as the model wrote them (issue 50 point 5): compact, spaced, key order and all
    ('<tool_call>\n{"name": "get_weather", "arguments": {"location":"San Francisco","unit":"celsius"}}\n</tool_call>',
     "", [ToolCall("call_0", "get_weather", '{"location":"San Francisco","unit":"celsius"}')]),
    ('<tool_call>{"arguments": {\n  "q" : "x"\n}, "name": "search"}</tool_call>', "",
     [ToolCall("call_0", "search", '{\n  "q" : "x"\n}')]),
    # broken JSON (a brace short) stays content, tags and all
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', []),
    # a function the request does not have, and text that only mentions the tag
    ('Use <tool_call> tags like this: <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok',
     'Use <tool_call> tags like this: <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok', []),
    # a broken call, then a valid one: the first is text
    ('<tool_call>{"name": get_weather}</tool_call>\n<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
     '<tool_call>{"name": get_weather}</tool_call>', [_call(0, "search", {"q": "x"})]),
    # the output ended after a whole call without its closing tag (counted), or inside one (text)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "", [_call(0, "get_weather", {"city": "Oslo"})]),
    ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', 'Sure. <tool_call>\n{"name": '
     '"get_weather", "arguments": {"city": "Os', []),
    # arguments the model serialised itself are decoded once
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', "", [_call(0, "search", {"q": "x"})]),
    ("The image shows a red bus on a bridge.", "The image shows a red bus on a bridge.", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", FREE, ids=[f"free{i}" for i in range(len(FREE))])
def test_free_calls(text, content, calls):
    fmt = OutputFormat(tool_parser="hermes", tool_names=NAMES)
    assert _check_every_split(fmt, text) == (None, content, calls)


def test_parallel_off_keeps_the_first_call():
    fmt = OutputFormat(tool_parser="hermes", tool_names=NAMES, parallel=False)
    assert _check_every_split(fmt, FREE[1][0]) == (None, "I'll look both up.", [_call(0, "get_weather", {"city": "Paris"})])


# forced calls (tool_choice "required" / named): what the tool grammar writes, whole or cut by max_tokens
FORCED = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     [ToolCall("call_0", "get_weather", '{"city": "Paris", "days": 2}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "R}o\\"me",\n  "tags": [{"a": "]"}]\n}}\n</tool_call>'
     '\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
     [ToolCall("call_0", "get_weather", '{\n  "city": "R}o\\"me",\n  "tags": [{"a": "]"}]\n}'),
      ToolCall("call_1", "search", '{"q": "x"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [ToolCall("call_0", "get_weather", '{"city": "Par')]),
    ('<tool_call>\n{"name": "get_weather", "argu', [ToolCall("call_0", "get_weather", "")]),
    ('<tool_call>\n{"name": "get_wea', []),
]


@pytest.mark.parametrize("text,calls", FORCED, ids=[f"forced{i}" for i in range(len(FORCED))])
def test_forced_calls_stream_their_arguments(text, calls):
    fmt = OutputFormat(tool_parser="hermes", tool_names=NAMES, forced=True)
    assert _check_every_split(fmt, text) == (None, "", calls)


def test_forced_call_streams_name_first_then_fragments():
    stream = OutputFormat(tool_parser="hermes", tool_names=NAMES, forced=True).stream(_ids())
    first = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(p.id, p.name, p.arguments) for p in first.tool_calls] == [("call_0", "get_weather", ""), (None, None, '{"ci')]
    assert [p.arguments for p in stream.feed('ty": 1}}\n</tool_call>').tool_calls] == ['ty": 1}']


# reasoning: (opened by the prompt, text, reasoning, answer)
THINK = [
    (True, "The user asks about the chart.\nSales rise in spring.\n</think>\n\nSales peak in spring.",
     "The user asks about the chart.\nSales rise in spring.\n", "Sales peak in spring."),
    (True, "Counting the apples: one, two, thr", "Counting the apples: one, two, thr", ""),  # cut by max_tokens
    (True, "</think>\n\nRed.", "", "Red."),
    (True, "<think>\nhmm\n</think>\n\nRed.", "\nhmm\n", "Red."),  # the model opened it again
    (False, "<think>\nLet me look.\n</think>\n\nA bus.", "\nLet me look.\n", "A bus."),  # hybrid, thinking on
    (False, "A bus on a bridge.", None, "A bus on a bridge."),
    (False, "  <thin", None, "  <thin"),
    (False, "", None, ""),
    (True, "", "", ""),
]


@pytest.mark.parametrize("opened,text,reasoning,answer", THINK, ids=[f"think{i}" for i in range(len(THINK))])
def test_reasoning_split(opened, text, reasoning, answer):
    fmt = OutputFormat(reasoning=QWEN3, reasoning_open=opened)
    assert _check_every_split(fmt, text) == (reasoning, answer, [])


def test_reasoning_then_tool_calls():
    text = ("The user wants the weather; I should call the tool.\n</think>\n\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    for forced in (False, True):
        fmt = OutputFormat(reasoning=QWEN3, reasoning_open=True, tool_parser="hermes", tool_names=NAMES,
                           forced=forced)
        reasoning, content, calls = _check_every_split(fmt, text)
        assert reasoning == "The user wants the weather; I should call the tool.\n"
        assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == ("", [("get_weather", {"city": "Paris"})])
    # a call opened inside the reasoning ends it (vLLM's qwen3 parser; tests/parsers/test_vllm_cases.py)
    fmt = OutputFormat(reasoning=QWEN3, reasoning_open=True, tool_parser="hermes", tool_names=NAMES)
    inside = 'I will search.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    assert _check_every_split(fmt, inside) == ("I will search.\n", "", [_call(0, "search", {"q": "x"})])
    # the tag alone, mentioned in a thought, is reasoning
    mention = "The format is <tool_call> then JSON.\n</think>\n\nOK."
    assert _check_every_split(fmt, mention) == ("The format is <tool_call> then JSON.\n", "OK.", [])
