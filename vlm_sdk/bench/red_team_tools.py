"""Issue 41's tool rows for `vlm-sdk bench-serve --red-team` (vlm_sdk/bench/red_team.py runs them
beside its victim stream, in its row format: name, request bodies, how many at once, plain probes).

    41.7  tool lists priced before they are paid for: 10,000 tools sharing one schema, 2,000 distinct
          (max_tools), 100 tools of 12 KB (max_tool_bytes), 128 distinct tools with a forced call (the
          largest list allowed: refused for length on a small model, with nothing compiled), 4 MB of
          tool-call arguments (the length guard counts them)
    41.9  tool turns and template kwargs: arguments nested 100,000 deep or holding "\\ud800", duplicate
          call ids, chat_template_kwargs {"namespace": 1} and {"self": 1}

Each was a 500 or minutes of work before; each is now a 400 naming the field or the setting.
"""
from __future__ import annotations

import json

_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tool(name: str, schema: dict = _SCHEMA, description: str = "a tool") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def _distinct(n: int, description: str = "a tool") -> list[dict]:
    return [_tool(f"tool_{i}", {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4}}},
                  description) for i in range(n)]


def _turn(arguments: str, second_id: str | None = None) -> list[dict]:
    """The question, an assistant message calling get_weather with `arguments`, and the tool's answer."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]
    if second_id is not None:
        calls.append({"id": second_id, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}})
    return _QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls},
                        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def tool_rows(model: str, scale: float) -> list[tuple[str, list[bytes], int, bool]]:
    """Rows 41.7 and 41.9, in red_team.rows' format. `scale` < 1 sends fewer of the repeated requests."""
    repeat = max(1, round(4 * scale))

    def body(**fields) -> bytes:
        return json.dumps({"model": model, "messages": _QUESTION, "max_tokens": 8, **fields}).encode()
    weather = [_tool("get_weather")]
    return [
        ("41.7 tool lists", [body(tools=[_tool(f"t{i}") for i in range(10_000)])] * repeat
         + [body(tools=_distinct(2_000))] * repeat
         + [body(tools=[_tool(f"t{i}", description="d" * 12_000) for i in range(100)]),
            body(tools=_distinct(128, "x" * 100), tool_choice="required"),
            body(messages=_turn(json.dumps({"city": "x" * (4 << 20)})), tools=weather)], 2, False),
        ("41.9 tool turns, template kwargs", [
            body(messages=_turn('{"city": ' + "[" * 100_000 + "]" * 100_000 + "}"), tools=weather),
            body(messages=_turn('{"city": "\\ud800"}'), tools=weather),
            body(messages=_turn('{"city": "Oslo"}', second_id="call_1"), tools=weather),
            body(chat_template_kwargs={"namespace": 1}), body(chat_template_kwargs={"self": 1})], 1, False),
    ]
