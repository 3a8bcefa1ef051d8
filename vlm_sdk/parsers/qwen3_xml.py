"""Qwen3-Coder's XML tool calls, as the Qwen3.5 and Qwen3-Coder chat templates ask for them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The tags around a call are Hermes' (`hermes.py`), so the free reading ("auto") is Hermes' with this
body reader: a call counts once its closing tag has come (or the output ends after a whole call), its
function is one of the request's tools and its body is only parameters; anything else stays content.
A parameter's text is its value less one newline on each side; the function's schema types it as vLLM's
qwen3_coder parser does (`convert`): string (or untyped) values are the text itself, "null" is null,
integers, numbers and booleans are read as such (a text that is not one stays a string), objects and
arrays as JSON (else a Python literal, else the string). The arguments are the JSON of those values in
the order written, `json.dumps(..., ensure_ascii=False)`, as vLLM returns them.

Forced calls (`tool_choice` "required" or a named function) are written by `tool_grammar`: parameters in
the schema's order, the required ones always, string values free text (without "</parameter>"), others
JSON following their schema. Their stream sends each name once its tag is complete and each parameter's
piece of the arguments once its value is (`{"city": "Paris"`, then `, ...`, then `}`).
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Callable, Mapping, Sequence

from vlm_sdk.outputs import ToolCall, ToolCallDelta
from vlm_sdk.parsers.hermes import CLOSE, OPEN, new_call_id
from vlm_sdk.parsers.types import ParsedDelta

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_BODY = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOL_TYPES = frozenset({"boolean", "bool", "binary"})


def _type(schema: Any) -> str:
    """A property's type as vLLM's parser reads it ("string" when it names none); of a list of types,
    the first that is not "null"."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower() if kind is not None else "string"


def is_raw(schema: Any) -> bool:
    """Whether a property's value is written as bare text (not as JSON)."""
    return _type(schema) in _STRING_TYPES


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def convert(text: str, schema: Any) -> Any:
    """A parameter's value from its text, typed by its property schema (None: not in the schema)."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = _type(schema)
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in _BOOL_TYPES:
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    return value if _jsonable(value) else text


def _value_text(raw: str) -> str:
    """A parameter's text less the newline the template writes on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _properties(parameters: Mapping[str, Any]) -> Mapping[str, Any]:
    props = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def _argument_piece(first: bool, key: str, value: Any) -> str:
    return ("{" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


class XmlCallReader:
    """The body between <tool_call> and </tool_call> -> (name, arguments JSON), or None when it is not a
    call to one of the tools (`tools`: name -> its parameters schema)."""

    def __init__(self, tools: Mapping[str, Mapping[str, Any]]):
        self.tools = tools

    def __call__(self, body: str) -> tuple[str, str] | None:
        m = _BODY.match(body)
        if m is None or m.group(1) not in self.tools:
            return None
        name, inner = m.group(1), m.group(2)
        props = _properties(self.tools[name])
        args: dict[str, Any] = {}
        pos = 0
        for p in _PARAM.finditer(inner):
            if inner[pos:p.start()].strip():  # text between parameters: not a call
                return None
            key = p.group(1)
            args[key] = convert(_value_text(p.group(2)), props.get(key))
            pos = p.end()
        if inner[pos:].strip():
            return None
        return name, json.dumps(args, ensure_ascii=False)


# -- forced calls ("required", a named function) ------------------------------------------------------
_END = "\\n<\\/parameter>\\n"  # a raw value's end, in a Lark regex


def _raw_value(schema: Any) -> str:
    """The Lark lexeme of a bare-text value and its closing tag: one lexeme, so that the value cannot hold
    "</parameter>" (a lexer ends it at the first). An enum of strings is its values; minLength and
    maxLength bound its characters; other constraints (pattern, format) are not enforced on bare text."""
    schema = schema if isinstance(schema, Mapping) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return " | ".join(json.dumps(v + "\n" + PARAMETER_END + "\n") for v in enum)
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    chars = f"{{{int(low)},{'' if high is None else int(high)}}}"
    return f"/(?s:.{chars}){_END}/ & ~/(?s:.*)<\\/parameter>(?s:..+)/"


def tool_grammar(tools: Sequence[tuple[str, Mapping[str, Any]]], parallel: bool, whitespace: str | None = None,
                 tag: Callable[[str], str] = json.dumps) -> str:
    """Lark text for one call (or, with `parallel`, one or more) to one of `tools` ((name, parameters
    schema) pairs) in the XML form: parameters in the schema's order, optional ones optional; a bare-text
    value as `_raw_value`, a JSON one following its schema (`whitespace` between its tokens)."""
    lines = ["start: call" + (' ("\\n" call)*' if parallel else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, schema) in enumerate(tools):
        props = _properties(schema)
        required = set(schema.get("required", ())) if isinstance(schema, Mapping) else set()
        params = []
        for k, (key, prop) in enumerate(props.items()):
            head = json.dumps(f"{PARAMETER}{key}>\n")
            if is_raw(prop):
                lines += [f"p_{i}_{k}: {head} RAW_{i}_{k}", f"RAW_{i}_{k}: {_raw_value(prop)}"]
            else:
                prop = dict(prop) if isinstance(prop, Mapping) else {}
                if whitespace is not None and "x-guidance" not in prop:
                    prop["x-guidance"] = {"whitespace_pattern": whitespace}
                lines.append(f"p_{i}_{k}: {head} %json {json.dumps(prop, ensure_ascii=False)} "
                             f"{json.dumps(chr(10) + PARAMETER_END + chr(10))}")
            params.append(f"p_{i}_{k}" + ("" if key in required else "?"))
        head, tail = json.dumps(f"\n{FUNCTION}{name}>\n"), json.dumps(f"{FUNCTION_END}\n")
        lines.append(" ".join([f"call_{i}:", tag(OPEN), head, *params, tail, tag(CLOSE)]))
    return "\n".join(lines) + "\n"


_FORCED_HEAD = re.compile(r"\s*" + re.escape(OPEN) + r"\n" + re.escape(FUNCTION) + r"([^>\n]*)>\n")
_FORCED_PARAM = re.compile(re.escape(PARAMETER) + r"([^>\n]*)>\n(.*?)\n" + re.escape(PARAMETER_END) + r"\n",
                           re.DOTALL)
_FORCED_TAIL = FUNCTION_END + "\n" + CLOSE


def forced_pieces(text: str, tools: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, bool]]:
    """(name, arguments so far, whole) of each call in a text the grammar wrote, possibly cut short: the
    arguments hold the parameters whose values are complete."""
    calls, pos = [], 0
    while (m := _FORCED_HEAD.match(text, pos)) is not None:
        name, pos = m.group(1), m.end()
        props, args = _properties(tools.get(name, {})), ""
        while (p := _FORCED_PARAM.match(text, pos)) is not None:
            args += _argument_piece(not args, p.group(1), convert(p.group(2), props.get(p.group(1))))
            pos = p.end()
        whole = text.startswith(_FORCED_TAIL, pos)
        if whole:
            args = (args or "{") + "}"
            pos += len(_FORCED_TAIL)
        calls.append((name, args, whole))
        if not whole:
            break
        pos += text.startswith("\n", pos)
    return calls


def parse_forced(text: str, tools: Mapping[str, Mapping[str, Any]],
                 make_id: Callable[[], str] = new_call_id) -> list[ToolCall]:
    """The calls of an output the tool grammar wrote (possibly cut short: the last call's arguments are
    the complete parameters so far)."""
    return [ToolCall(make_id(), name, args) for name, args, _ in forced_pieces(text, tools)]


class XmlForcedStream:
    """The streaming form of `parse_forced`: each name once its tag is complete, then a piece of the
    arguments per complete parameter. The text so far is read again on each feed (a forced call is as
    long as max_tokens allows, and what was sent is a prefix of what is read)."""

    def __init__(self, tools: Mapping[str, Mapping[str, Any]], make_id: Callable[[], str] = new_call_id):
        self.tools, self.make_id = tools, make_id
        self._text = ""
        self._sent: list[str] = []  # the arguments sent so far, per call
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        for index, (name, args, _) in enumerate(forced_pieces(self._text, self.tools)):
            if index == len(self._sent):
                out.tool_calls.append(ToolCallDelta(index, self.make_id(), name))
                self._sent.append("")
                self.num_calls = len(self._sent)
            if len(args) > len(self._sent[index]):
                out.tool_calls.append(ToolCallDelta(index, arguments=args[len(self._sent[index]):]))
                self._sent[index] = args
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()
