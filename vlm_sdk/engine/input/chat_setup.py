"""What a chat request's options do to its prompt, its grammar and the reading of its output.

Once per engine, from the chat template and `EngineArgs`:
    tool parser        `tool_call_parser`, else the template's own format ("hermes" when it writes
                       <tool_call>); whether the template renders `tools` at all (a probe render)
    reasoning parser   `reasoning_parser`, else "qwen3" when the template has a <think> block
Per request (`InputProcessor.build_prompt`):
    prepare(options)   check the tools against this model and its limits (max_tools, max_tool_bytes; a
                       template that renders none: 400 naming the field) -> the template's variables
    (the prompt is built and its length checked: the tools' definitions count, as rendered)
    check_tools        the tools' parameter schemas checked as ONE grammar in the grammar process, each
                       distinct schema once (`schemas_grammar`), cached by content; a schema llguidance
                       cannot compile is a 400 naming tools[i].function.parameters
    finish(prompt)     whether the prompt opened the reasoning block (its last tokens); the output's
                       `OutputFormat`; the grammar: a forced tool call (tool_choice "required" / a
                       named function: one grammar over the forced tools) or the request's own
                       structured output, after free reasoning

So a request with N tools costs at most two compiles (the check and a forced call's grammar), however
large N, and none before its prompt is known to fit.

Structured outputs and reasoning: the grammar starts with the reasoning, unconstrained up to the end
tag, then the answer's grammar (`parsers.think.prefix_grammar`, one llguidance grammar nesting the
other). Chosen over starting the matcher once the reasoning has ended: the grammar itself knows where
the reasoning ends (the end tag, as the special token the tokenizer has or as text), the state of the
block at the first token is decided once from the prompt, and the engine and worker stay as they
are. The cost: a mask at every reasoning step (llguidance's threads, like any other), and inside the
reasoning the tokenizer's other tag tokens (<tool_call>, ...) are masked, so the model spells such a
tag in plain pieces there if it writes one at all.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from concurrent.futures import Future
from typing import Sequence

from vlm_sdk.chat_options import ChatOptions, Tool, ToolLimits
from vlm_sdk.engine.input.prompt_tokenizer import PromptTokenizer
from vlm_sdk.engine.structured_output import JSON_WHITESPACE, GrammarCompiler
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.image_key import salted_key
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.parsers import REASONING_FORMATS, TOOL_PARSERS, OutputFormat
from vlm_sdk.parsers.output_format import XML_PARSERS, tool_grammar_for
from vlm_sdk.parsers.think import prefix_grammar
from vlm_sdk.sampling_params import SamplingParams, StructuredOutputs

_PROBE_MARK = "probe_field_7f3a"  # a property name: found in the render, the template writes the schemas
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "parameters": {
    "type": "object", "properties": {_PROBE_MARK: {"type": "string"}}}}}
_TAIL_TOKENS = 8  # prompt tokens read back to see whether the template opened the reasoning block


def _choice(name: str | None, known, what: str, param: str) -> str | None:
    if name is None or name == "none":
        return None
    if name not in known:
        raise InvalidRequestError(f"{param}={name!r} is not a {what}; use one of {', '.join(sorted(known))} or "
                                  f"'none'", param=param)
    return name


class ChatSetup:
    def __init__(self, tokenizer: PromptTokenizer, grammars: GrammarCompiler, tool_call_parser: str | None,
                 reasoning_parser: str | None, tool_limits: ToolLimits):
        self.tokenizer, self.grammars, self.tool_limits = tokenizer, grammars, tool_limits
        template = getattr(tokenizer.wrapped, "chat_template", None) or ""
        template = template if isinstance(template, str) else json.dumps(template)
        # the template's call form chooses the parser: Qwen3-Coder's XML (<tool_call><function=name>
        # <parameter=key>, Qwen3.5's templates) or Hermes' JSON between the same tags
        xml_tools = "<function=" in template and "<parameter=" in template
        auto_tools = ("qwen3_coder" if xml_tools else "hermes") if "<tool_call>" in template else None
        self.tool_parser = (auto_tools if tool_call_parser is None else
                            _choice(tool_call_parser, TOOL_PARSERS, "tool-call parser", "tool_call_parser"))
        self.renders_tools, self.renders_schemas = self._renders_tools()
        # tags that are one added token of the form <...>: llguidance reads them as special tokens
        added = getattr(tokenizer.wrapped, "get_added_vocab", dict)()
        self._special_tags = {t for t in added if t.startswith("<") and t.endswith(">")}
        auto_reasoning = "qwen3" if "<think>" in template else None
        name = (auto_reasoning if reasoning_parser is None else
                _choice(reasoning_parser, REASONING_FORMATS, "reasoning parser", "reasoning_parser"))
        self.reasoning = REASONING_FORMATS[name] if name is not None else None

    def _renders_tools(self) -> tuple[bool, bool]:
        """(whether the template renders `tools` at all, whether it writes their parameter schemas)."""
        probe = [{"role": "user", "content": "x"}]
        try:
            plain = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            with_tools = self.tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False,
                                                            add_generation_prompt=True)
        except Exception:  # a template that cannot render this probe is judged by its requests
            return True, False
        return plain != with_tools, _PROBE_MARK in with_tools

    def tool_chars(self, options: ChatOptions) -> int:
        """Characters the tools' definitions surely add to the prompt (for the length guard's lower bound):
        their compact JSON when the template writes the schemas, else none counted."""
        return options.tool_chars if self.renders_schemas else 0

    # -- per request ----------------------------------------------------------------------------------
    def check_tools(self, options: ChatOptions) -> Future | None:
        """The tools' parameter schemas checked in the grammar process as one grammar (`schemas_grammar`):
        a future that fails with the `InvalidRequestError` naming tools[i].function.parameters of a schema
        llguidance cannot compile. None without tools in use. Cached by content: the same tools again
        cost nothing."""
        if not options.uses_tools:
            return None
        text, line_params = schemas_grammar(options.tools)
        return self.grammars.submit(StructuredOutputs("grammar", text, "tools"), validate_only=True,
                                    line_params=line_params)

    def prepare(self, options: ChatOptions, params: SamplingParams) -> dict[str, Any]:
        """Check `options` against this model and its tool limits; the chat template's variables. Nothing is
        compiled here: the schemas are checked once the prompt is known to fit (`check_tools`)."""
        kwargs = dict(options.chat_template_kwargs)
        self.tool_limits.check(options.tools)
        if not options.uses_tools:
            return kwargs
        if not self.renders_tools:
            raise InvalidRequestError(
                "this model's chat template does not render 'tools', so the model would never see them; serve "
                "it with a chat template that has a tool section, or leave 'tools' out", param="tools")
        if self.tool_parser is None:
            raise InvalidRequestError(
                "no tool-call parser is set for this model's format, so its calls could not be read; start the "
                f"engine with tool_call_parser (flag --tool-call-parser) set to one of {', '.join(TOOL_PARSERS)}",
                param="tools")
        if options.forced and params.grammar is not None:
            raise InvalidRequestError(
                f"tool_choice {options.tool_choice!r} makes the output a tool call, which cannot also follow "
                f"'{params.grammar.param}'; leave one of them out", param="tool_choice")
        if params.grammar is not None:  # "auto": the format would rule the calls out, silently
            raise InvalidRequestError(
                f"'{params.grammar.param}' together with tools (tool_choice 'auto') is not supported: the format "
                f"would leave the model no way to call a tool; send tool_choice 'none' to answer in the format, "
                f"or leave '{params.grammar.param}' out", param=params.grammar.param)
        special = self.tokenizer.special_text
        specs = [dict(t.spec) for t in options.tools]
        kwargs["tools"] = special.escape_tree(specs) if special is not None else specs
        return kwargs

    def finish(self, prompt: PromptInputs, options: ChatOptions, params: SamplingParams, compile: bool = True) -> None:
        """Salt the prompt's image keys and set its output format and grammar (in place). `compile`: check
        the tools' schemas and compile `prompt.grammar` here, waiting for the grammar workers (LLM);
        False: the caller does both (AsyncLLM awaits them on the grammar workers)."""
        if options.cache_salt is not None:
            prompt.cache_salt = options.cache_salt
            for image in prompt.images:
                if image.key is not None:
                    image.key = salted_key(image.key, options.cache_salt)
        tools = options.uses_tools
        if compile and tools:
            self.check_tools(options).result()  # a bad schema fails here, named, before the forced grammar
        if self.reasoning is None and not tools:
            return
        opened = self.reasoning is not None and (self.reasoning.always_open or self._prompt_opens(prompt))
        prompt.output_format = OutputFormat(
            reasoning=self.reasoning, reasoning_open=opened, tool_parser=self.tool_parser if tools else None,
            tool_names=tuple(t.name for t in options.tools) if tools else (), forced=tools and options.forced,
            named=options.tool_choice == "function", parallel=options.parallel_tool_calls,
            tool_schemas=(tuple((t.name, t.parameters) for t in options.tools)
                          if tools and self.tool_parser in XML_PARSERS else ()))
        grammar = params.grammar
        if tools and options.forced:
            grammar = StructuredOutputs("grammar", tool_grammar_for(self.tool_parser)(
                [(t.name, t.parameters) for t in options.forced_tools()],
                options.parallel_tool_calls and options.tool_choice == "required", JSON_WHITESPACE, self._tag),
                "tool_choice")
        if grammar is not None and self.reasoning is not None:
            r = self.reasoning
            grammar = dataclasses.replace(grammar, prefix=prefix_grammar(opened, "@answer", r.start, r.end, self._tag))
        if grammar is not None:
            prompt.grammar = grammar
            if compile:
                self.grammars.compile(grammar)  # a bad one fails here, before the request is queued

    def _tag(self, text: str) -> str:
        """A tag in a Lark grammar: the special token when the tokenizer has it as one, else text."""
        return text if text in self._special_tags else json.dumps(text)

    def _prompt_opens(self, prompt: PromptInputs) -> bool:
        tail = self.tokenizer.decode(prompt.token_ids[-_TAIL_TOKENS:], skip_special_tokens=False)
        return tail.rstrip().endswith(self.reasoning.start)


def schemas_grammar(tools: Sequence[Tool]) -> tuple[str, tuple[str, ...]]:
    """(Lark text accepting the arguments of any of `tools`, the field each of its lines came from): each
    distinct schema once, `t<j>: %json {...}` on a line of its own, so that llguidance's error, which
    names the line, names the tool (its first tool with that schema). What compiling each schema on its
    own would check, at the cost of one compile: 10,000 tools sharing one schema cost one small grammar."""
    distinct: dict[str, int] = {}  # schema text -> the first tool index with it
    for i, tool in enumerate(tools):
        distinct.setdefault(json.dumps(dict(tool.parameters)), i)  # ASCII: no character breaks its line
    lines = ["start: " + " | ".join(f"t{j}" for j in range(len(distinct)))]
    lines += [f"t{j}: %json {schema}" for j, schema in enumerate(distinct)]
    return "\n".join(lines) + "\n", ("tools",) + tuple(f"tools[{i}].function.parameters" for i in distinct.values())
