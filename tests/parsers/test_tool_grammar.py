"""The grammars that force a tool call, and free reasoning before an answer, compiled by llguidance
on the tiny tokenizers: with the tags as special tokens (Qwen's tokenizer has <tool_call>, </think>
as added tokens, which llguidance reads as special) and as plain text (InternVL's has neither).
A text in the format is accepted whole and may end there; arguments outside the schema, an unknown
function or a second call without parallel calls are not."""
import json

import pytest

from vlm_sdk.engine.structured_output import GrammarCompiler
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.parsers.hermes_grammar import tool_grammar
from vlm_sdk.parsers.think import prefix_grammar
from vlm_sdk.sampling_params import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module", params=["qwen", "internvl"])
def setup(request, tiny_ckpt, internvl_ckpt):
    tok = load_tokenizer(tiny_ckpt if request.param == "qwen" else internvl_ckpt)
    specials = {t for t in tok.get_added_vocab() if t.startswith("<") and t.endswith(">")}
    tag = (lambda t: t if t in specials else json.dumps(t))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return tok, GrammarCompiler(tok, 1024, [eos]), tag, eos, request.param


def _accepts(setup, grammar_text: str, text: str, prefix: str | None = None) -> bool:
    tok, compiler, _, eos, _ = setup
    matcher = compiler.compile(StructuredOutputs("grammar", grammar_text, "tool_choice", prefix)).matcher()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
        matcher.consume_token(eos)


def test_forced_calls(setup):
    tok, _, tag, _, family = setup
    assert ("<tool_call>" in tok.get_added_vocab()) == (family == "qwen")  # both branches of `tag` are run
    one = tool_grammar([("get_weather", SCHEMA), ("search", {"type": "object"})], False, None, tag)
    many = tool_grammar([("get_weather", SCHEMA)], True, None, tag)
    assert _accepts(setup, one, CALL)
    assert _accepts(setup, one, '<tool_call>\n{"name": "search", "arguments": {"q": [1, 2]}}\n</tool_call>')
    assert _accepts(setup, many, CALL + "\n" + CALL)
    assert not _accepts(setup, one, CALL + "\n" + CALL)  # parallel calls off: one
    assert not _accepts(setup, one, CALL.replace("Oslo", "Copenhagen"))  # maxLength 8
    assert not _accepts(setup, one, CALL.replace("get_weather", "get_time"))
    assert not _accepts(setup, one, "Sure! " + CALL)  # nothing before the call


def test_a_function_without_parameters_takes_only_an_empty_object(setup):
    """Parameters left out, null or {}: the forced call's arguments are {} (whitespace inside allowed),
    as vLLM's forced schema has them (issue 50 point 4: {} let any object through)."""
    from vlm_sdk.chat_options import ChatOptions
    _, _, tag, _, _ = setup
    for params in (None, {}):
        (tool,) = ChatOptions(tools=[{"type": "function", "function": {"name": "now", "parameters": params}}]).tools
        grammar = tool_grammar([(tool.name, tool.parameters)], False, None, tag)
        call = '<tool_call>\n{"name": "now", "arguments": %s}\n</tool_call>'
        assert _accepts(setup, grammar, call % "{}") and _accepts(setup, grammar, call % "{ }")
        assert not _accepts(setup, grammar, call % '{"a": 1}')
    assert _accepts(setup, tool_grammar([("now", {"type": "object"})], False, None, tag), call % '{"a": 1}')


def test_free_reasoning_then_the_answer(setup):
    _, _, tag, _, _ = setup
    calls = tool_grammar([("get_weather", SCHEMA)], False, None, tag)
    opened = prefix_grammar(True, "@answer", tag=tag)
    reasoning = "The user asks about Oslo { not json, not a call: tool_call> either\n\n"
    assert _accepts(setup, calls, reasoning + "</think>\n\n" + CALL, opened)
    assert _accepts(setup, calls, "</think>" + CALL, opened)
    assert not _accepts(setup, calls, reasoning + "</think>\n\nIt is sunny.", opened)  # the answer is held
    optional = prefix_grammar(False, "@answer", tag=tag)  # the model may open a block itself
    assert _accepts(setup, calls, CALL, optional)
    assert _accepts(setup, calls, "<think>\nhm</think>\n" + CALL, optional)
    assert not _accepts(setup, calls, "hm</think>\n" + CALL, optional)
