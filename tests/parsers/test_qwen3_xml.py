"""Qwen3-Coder's XML tool calls (Qwen3.5's templates) read as vLLM's qwen3_coder parser reads them: the
cases of vLLM's tests/tool_use/test_qwen3coder_tool_parser.py (the texts and the arguments it expects),
typed by each function's schema; the streaming form fed every split of the text gives the whole-text
result; where we read differently from vLLM (a call to an unknown function, a broken call, text after a
call) it is said below. The forced grammar on the tiny Qwen3.5 tokenizer accepts what it must and
nothing else, and what it writes reads back as the call."""
import itertools
import json

import pytest

from vlm_sdk.engine.structured_output import GrammarCompiler
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.outputs import ToolCall
from vlm_sdk.parsers import OutputFormat
from vlm_sdk.parsers.qwen3_xml import convert, tool_grammar
from vlm_sdk.sampling_params import StructuredOutputs

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}},
           "required": ["city", "state"]}
AREA = {"type": "object", "properties": {"shape": {"type": "string"}, "dimensions": {"type": "object"},
                                         "precision": {"type": "integer"}}}
TYPES = {"type": "object", "properties": {"int_param": {"type": "integer"}, "float_param": {"type": "float"},
                                          "bool_param": {"type": "boolean"}, "str_param": {"type": "string"},
                                          "obj_param": {"type": "object"}}}
SCHEMAS = (("get_current_weather", WEATHER), ("calculate_area", AREA), ("test_types", TYPES))
FREE = OutputFormat(tool_parser="qwen3_coder", tool_names=tuple(n for n, _ in SCHEMAS), tool_schemas=SCHEMAS)


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _xml(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _streamed(fmt: OutputFormat, pieces) -> tuple:
    stream = fmt.stream(_ids())
    content, calls = "", {}
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    return None, content, [ToolCall(*calls[i]) for i in sorted(calls)]


def _read(fmt: OutputFormat, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) of the whole text, after checking every split streams the same."""
    whole = fmt.parse(text, _ids())
    for k in range(len(text) + 1):
        assert _streamed(fmt, [text[:k], text[k:]]) == whole, f"split at {k}"
    assert _streamed(fmt, list(text)) == whole
    _, content, calls = whole
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
VLLM_CASES = [  # (id, text, content, calls): vLLM's expected content None is our ""
    ("single_tool", _xml("get_current_weather", **DALLAS), "", [("get_current_weather", DALLAS)]),
    ("single_tool_with_content", "Sure! Let me check the weather for you." + _xml("get_current_weather", **DALLAS),
     "Sure! Let me check the weather for you.", [("get_current_weather", DALLAS)]),
    ("single_tool_multiline_param",
     _xml("calculate_area", shape="rectangle", dimensions='{"width": 10, \n "height": 20}', precision=2), "",
     [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})]),
    ("parallel_tools", _xml("get_current_weather", **DALLAS) + "\n" +
     _xml("get_current_weather", city="Orlando", state="FL", unit="fahrenheit"), "",
     [("get_current_weather", DALLAS), ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})]),
    ("tool_with_typed_params", "Let me calculate that area for you." +
     _xml("calculate_area", shape="circle", dimensions='{"radius": 15.5}', precision=3),
     "Let me calculate that area for you.",
     [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})]),
    ("type_conversion", _xml("test_types", int_param=42, float_param=3.14, bool_param="true",
                             str_param="hello world", obj_param='{"key": "value"}'), "",
     [("test_types", {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                      "obj_param": {"key": "value"}})]),
    ("no_tools", "This is a test without tools", "This is a test without tools", []),
]


@pytest.mark.parametrize("text,content,calls", [c[1:] for c in VLLM_CASES], ids=[c[0] for c in VLLM_CASES])
def test_matches_vllm(text, content, calls):
    assert _read(FREE, text) == (content, calls)


def test_the_arguments_text_is_vllms_json_dumps():
    _, _, [call] = FREE.parse(_xml("get_current_weather", city="Zürich", state="ZH"), _ids())
    assert call.arguments == json.dumps({"city": "Zürich", "state": "ZH"}, ensure_ascii=False)


DIFFERENT = [  # (id, text, content, calls): where vLLM would return something else
    # vLLM reads any function name; a call must name one of the request's tools (as our Hermes reading)
    ("unknown_function", "x " + _xml("rm_rf", path="/"), "x " + _xml("rm_rf", path="/"), []),
    # vLLM drops the text after the first call; we keep the content around valid calls (Hermes' rule)
    ("text_after", _xml("get_current_weather", **DALLAS) + "\nDone.", "Done.", [("get_current_weather", DALLAS)]),
    # vLLM's fallback reads a bare <function=...> as a call; the template writes the tags, so here it is text
    ("no_tags", "<function=calculate_area>\n<parameter=precision>\n4\n</parameter>\n</function>",
     "<function=calculate_area>\n<parameter=precision>\n4\n</parameter>\n</function>", []),
    # a body with text outside the parameters is not a call: it stays content, tags and all
    ("stray_text", "<tool_call>\n<function=calculate_area>\noops<parameter=shape>\nx\n</parameter>\n</function>\n"
                   "</tool_call>",
     "<tool_call>\n<function=calculate_area>\noops<parameter=shape>\nx\n</parameter>\n</function>\n</tool_call>", []),
    # the output ended after a whole call without its closing tag: a call (as vLLM reads it)
    ("unclosed_call", "<tool_call>\n<function=calculate_area>\n<parameter=precision>\n4\n</parameter>\n</function>\n",
     "", [("calculate_area", {"precision": 4})]),
    # an unclosed parameter ends at the next one or at </function>, as vLLM's regex reads it
    ("unclosed_parameter", "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nsq\n<parameter=precision>\n1"
                           "\n</function>\n</tool_call>", "", [("calculate_area", {"shape": "sq", "precision": 1})]),
]


@pytest.mark.parametrize("text,content,calls", [c[1:] for c in DIFFERENT], ids=[c[0] for c in DIFFERENT])
def test_deliberate_differences(text, content, calls):
    assert _read(FREE, text) == (content, calls)


@pytest.mark.parametrize("text,schema,value", [
    ("null", {"type": "integer"}, None), ("7", None, "7"), ("seven", {"type": "integer"}, "seven"),
    ("3.0", {"type": "number"}, 3), ("2.5", {"type": "number"}, 2.5), ("nan", {"type": "number"}, "nan"),
    ("TRUE", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, False),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("{'a': 1}", {"type": "object"}, {"a": 1}),
    ("{1, 2}", {"type": "object"}, "{1, 2}"), ("5", {"type": ["integer", "null"]}, 5), ("5", {"enum": [5]}, "5"),
])
def test_values_typed_by_the_schema_as_vllm_does(text, schema, value):
    assert convert(text, schema) == value and type(convert(text, schema)) is type(value)


FORCED = OutputFormat(tool_parser="qwen3_coder", tool_names=("get_current_weather", "calculate_area"),
                      tool_schemas=SCHEMAS[:2], forced=True)


@pytest.mark.parametrize("text,calls", [
    (_xml("calculate_area", shape="sq", precision=2), [("calculate_area", '{"shape": "sq", "precision": 2}')]),
    (_xml("calculate_area") + "\n" + _xml("get_current_weather", city="a\nb", state="TX"),
     [("calculate_area", "{}"), ("get_current_weather", '{"city": "a\\nb", "state": "TX"}')]),
    ("<tool_call>\n<function=calculate_area>\n<parameter=shape>\nsq\n</parameter>\n<parameter=prec",
     [("calculate_area", '{"shape": "sq"')]),  # cut by max_tokens: the complete parameters so far
    ("<tool_call>\n<function=calculate_area>\n", [("calculate_area", "")]),
    ("<tool_call>\n<function=calcu", []),
])
def test_forced_calls_stream_a_piece_per_parameter(text, calls):
    whole = FORCED.parse(text, _ids())
    for k in range(len(text) + 1):
        assert _streamed(FORCED, [text[:k], text[k:]]) == whole
    assert [(c.name, c.arguments) for c in whole[2]] == calls


@pytest.fixture(scope="module")
def matcher_for(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints("qwen3_5"))
    assert "<tool_call>" in tok.get_added_vocab()  # the tag is a special token: llguidance's `<tool_call>`
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tok, 1024, [eos])

    def accepts(grammar: str, text: str) -> bool:
        m = compiler.compile(StructuredOutputs("grammar", grammar, "tool_choice")).matcher()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.consume_token(eos)
    return accepts


def test_the_forced_grammar_takes_the_format_and_the_schema(matcher_for):
    tag = (lambda t: t if t in ("<tool_call>", "</tool_call>") else json.dumps(t))
    weather = dict(WEATHER, properties=dict(WEATHER["properties"], city={"type": "string", "maxLength": 8}))
    one = tool_grammar([("get_current_weather", weather), ("calculate_area", AREA)], False, None, tag)
    many = tool_grammar([("calculate_area", AREA)], True, None, tag)
    ok = _xml("get_current_weather", city="Dallas", state="T\nX", unit="celsius")
    assert matcher_for(one, ok)
    assert matcher_for(one, _xml("get_current_weather", city="Dallas", state="TX"))  # unit is optional
    assert matcher_for(one, _xml("calculate_area", dimensions='{"w": [1, 2]}', precision=-3))
    assert matcher_for(many, _xml("calculate_area") + "\n" + _xml("calculate_area", precision=1))
    assert not matcher_for(one, ok + "\n" + ok)  # one call without parallel calls
    assert not matcher_for(one, _xml("get_current_weather", city="Dallas"))  # state is required
    assert not matcher_for(one, _xml("get_current_weather", state="TX", city="Dallas"))  # the schema's order
    assert not matcher_for(one, ok.replace("celsius", "kelvin"))  # the enum
    assert not matcher_for(one, ok.replace("Dallas", "Dallas, Texas"))  # maxLength 8
    assert not matcher_for(one, _xml("calculate_area", precision="2.5"))  # an integer
    assert not matcher_for(one, _xml("get_current_weather", city="a</parameter>b", state="TX"))
    assert not matcher_for(one, "Sure. " + ok)
