"""How one request's output text is read: reasoning first, then tool calls in the answer after it.

    text -> reasoning parser (think.py)  -> reasoning
                                         -> answer -> tool parser -> content, tool calls

The tool parsers: Hermes' JSON calls (hermes.py) and Qwen3-Coder's XML calls (qwen3_xml.py), both
between <tool_call> tags.

`OutputFormat` is decided when the prompt is built (which parsers, whether the template opened the
reasoning block, the request's tools and tool_choice); `parse` reads a whole text, `stream()` gives
an `OutputStream` that reads it in deltas, and the two agree on every split of the text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from vlm_sdk.outputs import ToolCall
from vlm_sdk.parsers import hermes, hermes_grammar, qwen3_xml, think
from vlm_sdk.parsers.types import ParsedDelta


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning block's tags; `always_open`: the model's output starts inside it whatever the prompt
    says (DeepSeek-R1's convention), else the prompt decides (the template opened it or not).
    `ends_at_tool_call`: a tool call opened inside the block ends it (Qwen3 calls tools without closing
    its thought; vLLM's qwen3 parser reads it so, its deepseek_r1 parser does not)."""
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_open: bool = False
    ends_at_tool_call: bool = False


# --reasoning-parser values (vLLM's names)
REASONING_FORMATS = {"qwen3": ReasoningFormat("qwen3", ends_at_tool_call=True),
                     "deepseek_r1": ReasoningFormat("deepseek_r1", always_open=True)}
# --tool-call-parser values (vLLM's names): each a format with a free and a forced reading and a grammar
# for the latter; vLLM's qwen3_coder and qwen3_xml are two readers of the same XML form, one here
TOOL_PARSERS = ("hermes", "qwen3_coder", "qwen3_xml")
XML_PARSERS = frozenset({"qwen3_coder", "qwen3_xml"})


def tool_grammar_for(parser: str) -> Callable[..., str]:
    """The grammar builder that forces calls in `parser`'s format: (tools, parallel, whitespace, tag)."""
    return qwen3_xml.tool_grammar if parser in XML_PARSERS else hermes_grammar.tool_grammar


@dataclass(frozen=True)
class OutputFormat:
    """`reasoning_open`: the output starts inside the reasoning block. `tool_names` empty: no tool
    parsing. `forced`: the tool grammar wrote the calls (tool_choice "required" or a named function);
    `named`: a named function was forced, which OpenAI finishes with "stop" rather than "tool_calls".
    `tool_schemas`: (name, parameters schema) of each tool, for a format that types values by them (XML)."""
    reasoning: ReasoningFormat | None = None
    reasoning_open: bool = False
    tool_parser: str | None = None
    tool_names: tuple[str, ...] = ()
    forced: bool = False
    named: bool = False
    parallel: bool = True
    tool_schemas: tuple[tuple[str, Mapping[str, Any]], ...] = ()

    @property
    def xml(self) -> bool:
        return self.tool_parser in XML_PARSERS

    def schemas(self) -> dict[str, Mapping[str, Any]]:
        return dict(self.tool_schemas)

    @property
    def reads_tools(self) -> bool:
        return self.tool_parser is not None

    @property
    def reasoning_tool_tag(self) -> str | None:
        """The tag that ends the reasoning when a call opens inside it: free calls only (a forced call's
        grammar closes the reasoning first)."""
        r = self.reasoning
        if r is None or not r.ends_at_tool_call or not self.reads_tools or self.forced:
            return None
        return hermes.OPEN

    def parse(self, text: str, make_id: Callable[[], str] = hermes.new_call_id,
              ) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning or None, content, tool calls) of a whole output."""
        reasoning = None
        if self.reasoning is not None:
            r = self.reasoning
            reasoning, text = think.split(text, self.reasoning_open, r.start, r.end, self.reasoning_tool_tag)
        if not self.reads_tools:
            return reasoning, text, []
        if self.forced:
            return reasoning, "", (qwen3_xml.parse_forced(text, self.schemas(), make_id) if self.xml
                                   else hermes.parse_forced(text, make_id))
        read = qwen3_xml.XmlCallReader(self.schemas()) if self.xml else None
        content, calls = hermes.parse(text, self.tool_names, self.parallel, make_id, read)
        return reasoning, content, calls

    def stream(self, make_id: Callable[[], str] = hermes.new_call_id) -> "OutputStream":
        return OutputStream(self, make_id)


class OutputStream:
    """`feed(delta)` -> `ParsedDelta` of what became certain; `finish()` -> the rest. `saw_reasoning`:
    a reasoning block was open (the whole-text form's reasoning is then a string, else None)."""

    def __init__(self, fmt: OutputFormat, make_id: Callable[[], str]):
        r = fmt.reasoning
        self._think = (think.ThinkStream(fmt.reasoning_open, r.start, r.end, fmt.reasoning_tool_tag)
                       if r is not None else None)
        self._tools = None
        if fmt.reads_tools and fmt.forced:
            self._tools = (qwen3_xml.XmlForcedStream(fmt.schemas(), make_id) if fmt.xml
                           else hermes.HermesForcedStream(make_id))
        elif fmt.reads_tools:
            read = qwen3_xml.XmlCallReader(fmt.schemas()) if fmt.xml else None
            self._tools = hermes.HermesStream(fmt.tool_names, fmt.parallel, make_id, read)

    @property
    def saw_reasoning(self) -> bool:
        return self._think is not None and self._think.saw_reasoning

    def feed(self, text: str) -> ParsedDelta:
        reasoning = ""
        if self._think is not None:
            reasoning, text = self._think.feed(text)
        return self._answer(reasoning, text, finish=False)

    def finish(self) -> ParsedDelta:
        reasoning, text = self._think.finish() if self._think is not None else ("", "")
        return self._answer(reasoning, text, finish=True)

    def _answer(self, reasoning: str, text: str, finish: bool) -> ParsedDelta:
        if self._tools is None:
            return ParsedDelta(reasoning, text)
        out = ParsedDelta(reasoning)
        if text:
            out += self._tools.feed(text)
        if finish:
            out += self._tools.finish()
        return out
