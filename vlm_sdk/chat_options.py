"""A chat request's options beside its messages and sampling: tools, how they may be used, what the chat
template is given, and the prefix-cache salt. OpenAI's and vLLM's fields, checked here whatever entry
point they come from (`LLM.chat`, `AsyncLLM`, the HTTP server), each error naming its field.

    tools                 [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice           "auto" (default with tools) | "none" | "required" | {"type": "function",
                          "function": {"name": ...}}
    parallel_tool_calls   False: at most one call (default True)
    chat_template_kwargs  extra variables for the chat template, e.g. {"enable_thinking": False}
    cache_salt            requests with different salts never share a prefix-cache block or an image's
                          vision embeddings (vLLM's field): tenants that must not see each other's cache

A request's tools are bounded (`ToolLimits`: `max_tools`, `max_tool_bytes`) before any is rendered or
compiled; `parse_tools` counts them first and stops converting once their bytes pass the limit, so
a body of 10,000 tools is refused in microseconds, not after half a second of conversion.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from vlm_sdk.errors import InvalidRequestError, limit_text

# OpenAI's rule for function names; it also keeps a name free of JSON escapes inside a call's text
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
# a function's arguments when it declares none ("parameters" left out, null or {}): only {}, as vLLM's
# forced-call schema has it (its {"type": "object", "properties": {}} compiled strictly)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# names a template kwarg may not take: the request's own fields fill some (messages, tools); the others
# are parameters of transformers' apply_chat_template / render_jinja_template / jinja2's Template.render
# (`self`: "got multiple values for argument"), or the template's own globals, which a variable of the
# same name would hide from it (Qwen's templates call namespace(); {"namespace": 1} broke them with a 500).
# tests/engine/test_chat_options.py checks this covers the installed transformers' and jinja2's names
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "chat_template", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "self"})
TEMPLATE_GLOBALS = frozenset({"namespace", "range", "dict", "lipsum", "cycler", "joiner", "raise_exception",
                              "strftime_now"})


def _refuse(param: str, rule: str, value: Any = None, shown: bool = True) -> None:
    text = repr(value)
    text = text if len(text) <= 80 else text[:80] + "..."
    raise InvalidRequestError(f"'{param}' {rule}" + (f", got {text}" if shown else ""), param=param)


@dataclass(frozen=True)
class Tool:
    """One function the model may call: `parameters` is its arguments' JSON Schema (an object schema;
    `NO_PARAMETERS` for a function that declares none);
    `spec` the tool as the chat template renders it (OpenAI's shape); `chars` / `nbytes` its compact JSON
    text's length in characters and UTF-8 bytes (what a template that renders it writes at least)."""
    name: str
    parameters: Mapping[str, Any]
    spec: Mapping[str, Any]
    chars: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class ToolLimits:
    """What one request's tools may hold: `max_tools` of them, `max_bytes` of JSON together (engine settings
    max_tools, max_tool_bytes; their defaults are EngineArgs')."""
    max_tools: int
    max_bytes: int

    def check_count(self, count: int) -> None:
        if count > self.max_tools:
            raise InvalidRequestError(
                f"'tools' holds {count} tools; this engine accepts at most {self.max_tools} per request "
                f"({limit_text('max_tools', self.max_tools)}): each is rendered into the prompt and its schema "
                f"compiled; send the tools this turn needs", param="tools")

    def check_bytes(self, nbytes: int, complete: bool = True) -> None:
        if nbytes > self.max_bytes:
            size = f"{nbytes:,} bytes" if complete else f"over {nbytes:,} bytes"
            raise InvalidRequestError(
                f"'tools' is {size} of JSON (names, descriptions and parameter schemas); this engine accepts at "
                f"most {self.max_bytes:,} per request ({limit_text('max_tool_bytes', self.max_bytes)}): all of "
                f"it is rendered into the prompt and each schema compiled; send fewer or smaller tools",
                param="tools")

    def check(self, tools) -> None:
        """Parsed `tools` (a sequence of `Tool`) within both limits."""
        self.check_count(len(tools))
        self.check_bytes(sum(t.nbytes for t in tools))


def parse_tools(value: Any, limits: ToolLimits | None = None) -> tuple[Tool, ...]:
    """`tools` as sent (a list of OpenAI tool objects, or `Tool`s) -> `Tool`s, each error naming its field.
    With `limits`, the count is checked first and the conversion stops at the tool whose bytes pass
    `limits.max_bytes`, so refusing a huge list costs no more than the limit's worth of work."""
    tools = value or ()
    if not isinstance(tools, (list, tuple)):
        _refuse("tools", "must be an array of tool objects", tools)
    if limits is not None:
        limits.check_count(len(tools))
    out, total = [], 0
    for i, t in enumerate(tools):
        tool = t if isinstance(t, Tool) else _tool(t, i)
        total += tool.nbytes
        if limits is not None:
            limits.check_bytes(total, complete=i == len(tools) - 1)
        out.append(tool)
    return tuple(out)


def _tool(value: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, Mapping):
        _refuse(where, 'must be an object {"type": "function", "function": {"name", "parameters"}}', value)
    if value.get("type", "function") != "function":
        _refuse(f"{where}.type", 'must be "function" (the only kind of tool)', value.get("type"))
    fn = value.get("function")
    if not isinstance(fn, Mapping):
        _refuse(f"{where}.function", 'must be an object {"name", "description", "parameters"}', fn)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        _refuse(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes", name)
    if not isinstance(fn.get("description", ""), str):
        _refuse(f"{where}.function.description", "must be a string", fn.get("description"))
    params = fn.get("parameters")
    params = {} if params is None else params  # null: no parameters, as vLLM reads it
    if not isinstance(params, Mapping):
        _refuse(f"{where}.function.parameters", "must be a JSON Schema object", params)
    if params.get("type", "object") != "object":
        _refuse(f"{where}.function.parameters", 'must describe an object (a function\'s arguments): "type" '
                                                 'must be "object"', params.get("type"))
    try:  # JSON values only: the template renders it with tojson, the grammar compiler reads it as JSON
        text = json.dumps({"type": "function", "function": dict(fn)}, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"))
        nbytes = len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError) as e:  # also a lone surrogate (UnicodeEncodeError)
        _refuse(f"{where}.function", f"must hold JSON values only, in valid Unicode ({type(e).__name__}: "
                                     f"{str(e)[:120]})", shown=False)
    spec = json.loads(text)
    params = spec["function"].get("parameters") or {}
    schema = {"type": "object", **params} if params else NO_PARAMETERS
    return Tool(name, MappingProxyType(schema), MappingProxyType(spec), len(text), nbytes)


@dataclass(frozen=True)
class ChatOptions:
    """Checked and normalised on construction; `tool_choice` is then "none", "auto", "required" or
    "function" (with `tool_name` set), and "none" whenever there are no tools."""
    tools: tuple[Tool, ...] | list | None = None
    tool_choice: str | Mapping | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    cache_salt: str | None = None
    tool_name: str | None = None  # the function a named tool_choice forces

    def __post_init__(self):
        tools = parse_tools(self.tools)
        seen = set()
        for i, t in enumerate(tools):
            if t.name in seen:
                _refuse(f"tools[{i}].function.name", "repeats the name of an earlier tool; tool names must be "
                                                    "unique", t.name)
            seen.add(t.name)
        object.__setattr__(self, "tools", tools)
        self._set_choice(tools, seen)
        parallel = True if self.parallel_tool_calls is None else self.parallel_tool_calls
        if not isinstance(parallel, bool):
            _refuse("parallel_tool_calls", "must be true or false", parallel)
        object.__setattr__(self, "parallel_tool_calls", parallel)
        kwargs = self.chat_template_kwargs or {}
        if not isinstance(kwargs, Mapping) or any(not isinstance(k, str) for k in kwargs):
            _refuse("chat_template_kwargs", "must be an object of template variables", kwargs)
        clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
        if clash:
            _refuse("chat_template_kwargs", f"may not set {', '.join(clash)}: the request's own fields (messages, "
                                            f"tools) or the template renderer's own arguments fill them", shown=False)
        hidden = sorted(TEMPLATE_GLOBALS.intersection(kwargs))
        if hidden:
            _refuse("chat_template_kwargs", f"may not set {', '.join(hidden)}: the chat template's own functions "
                                            f"go by these names, and a variable would hide them from it",
                    shown=False)
        object.__setattr__(self, "chat_template_kwargs", MappingProxyType(dict(kwargs)))
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            _refuse("cache_salt", "must be a non-empty string", salt)

    def _set_choice(self, tools: tuple[Tool, ...], names: set) -> None:
        choice, name = self.tool_choice, self.tool_name
        if isinstance(choice, Mapping):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str):
                _refuse("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                       '{"name": ...}}', choice)
            choice = "function"
        elif choice is None:
            choice = "auto" if tools else "none"
        elif choice not in TOOL_CHOICES and not (choice == "function" and name):
            _refuse("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                   '{"name": ...}}', choice)
        if choice != "none" and not tools:
            _refuse("tool_choice", f"is {choice!r} but the request has no 'tools'; send the tools, or leave "
                                   f"tool_choice out", shown=False)
        if choice == "function" and name not in names:
            _refuse("tool_choice", f"names the function {name!r}, which is not among the request's tools "
                                   f"({', '.join(sorted(names))})", shown=False)
        object.__setattr__(self, "tool_choice", choice)
        object.__setattr__(self, "tool_name", name if choice == "function" else None)

    @property
    def uses_tools(self) -> bool:
        """The tools reach the model and its output is read for calls (not with tool_choice "none")."""
        return self.tool_choice != "none"

    @property
    def forced(self) -> bool:
        """A call is required (any tool, or the named one): the grammar writes it."""
        return self.tool_choice in ("required", "function")

    @property
    def tool_chars(self) -> int:
        """The characters the tools' definitions add to a prompt that renders them (at least)."""
        return sum(t.chars for t in self.tools) if self.uses_tools else 0

    def forced_tools(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.tool_choice != "function" or t.name == self.tool_name)


NO_OPTIONS = ChatOptions()
