"""The grammar that makes a model write Hermes-style tool calls (`hermes.py`) whose arguments follow each
function's JSON Schema: what `tool_choice` "required" and a named function are enforced with.

    start: call ("\\n" call)*          one call without parallel_tool_calls (and for a named function)
    call: call_0 | call_1 | ...
    call_0: <tool_call> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}\\n" </tool_call>
    args_0: %json {...the function's parameters...}

Lark as llguidance reads it (`%json` inlines a JSON Schema). The text around the arguments is the
chat templates' own rendering of a call, so a forced call reads to the model like one it chose. The
tags are written as the tokenizer has them (`tag`): llguidance treats an added token of the form
<...> as a special token, which only `<name>` matches (Qwen's tokenizers have <tool_call> as one).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from vlm_sdk.parsers.hermes import ARGS_PREFIX, CLOSE, HEAD, OPEN, TAIL


def tool_grammar(tools: Sequence[tuple[str, Mapping[str, Any]]], parallel: bool, whitespace: str | None = None,
                 tag: Callable[[str], str] = json.dumps) -> str:
    """Lark text for one call (or, with `parallel`, one or more) to one of `tools` ((name, parameters
    schema) pairs). `whitespace`: the regex allowed between JSON tokens of the arguments, unless a
    schema sets its own through llguidance's "x-guidance" key. `tag(text)`: a tag in Lark (a string
    literal, or the special token `<text>`)."""
    lines = ["start: call" + (' ("\\n" call)*' if parallel else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, schema) in enumerate(tools):
        schema = dict(schema)
        if whitespace is not None and "x-guidance" not in schema:
            schema["x-guidance"] = {"whitespace_pattern": whitespace}
        head, tail = json.dumps(HEAD[len(OPEN):] + name + ARGS_PREFIX), json.dumps(TAIL[:-len(CLOSE)])
        lines.append(f"call_{i}: {tag(OPEN)} {head} args_{i} {tail} {tag(CLOSE)}")
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"
