"""An output read by its prompt's `OutputFormat` (tools, a reasoning model) in OpenAI's shapes: the
message of a completion and the delta of a stream chunk.

    message  {"role": "assistant", "content": "..." | null, "reasoning": "...", "reasoning_content": "...",
              "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]}
    delta    {"reasoning": "...", "reasoning_content": "..."} / {"content": "..."} / {"tool_calls": [{"index",
             "id", "type", "function": {"name", "arguments": ""}}]} then {"tool_calls": [{"index",
             "function": {"arguments": "..."}}]}: a call's id and name once, its arguments in fragments

The reasoning goes under both of vLLM's names: `reasoning` (its name now) and `reasoning_content` (its
older one, which many clients still read), as vLLM sent both during its rename (the openai client
keeps unknown fields); content is null when the output was only reasoning or tool calls.
"""
from __future__ import annotations

from vlm_sdk.outputs import RequestOutput


def message(out: RequestOutput) -> dict:
    msg = {"role": "assistant", "content": out.content}
    if out.reasoning_content is not None:
        msg["reasoning"] = msg["reasoning_content"] = out.reasoning_content
    if out.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in out.tool_calls]
    if not out.content and (out.tool_calls or out.reasoning_content is not None):
        msg["content"] = None
    return msg


def delta(out: RequestOutput) -> dict:
    """What `out` adds to the message; {} when nothing (its text may all be held back for now)."""
    d = {}
    if out.delta_reasoning_content:
        d["reasoning"] = d["reasoning_content"] = out.delta_reasoning_content
    if out.delta_content:
        d["content"] = out.delta_content
    if out.delta_tool_calls:
        calls = []
        for piece in out.delta_tool_calls:
            call = {"index": piece.index}
            if piece.id is not None:
                call.update(id=piece.id, type="function", function={"name": piece.name, "arguments": piece.arguments})
            else:
                call["function"] = {"arguments": piece.arguments}
            calls.append(call)
        d["tool_calls"] = calls
    return d
