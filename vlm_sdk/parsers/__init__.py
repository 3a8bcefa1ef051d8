"""Output parsers: a model's text read into reasoning, content and tool calls (one format per file, each
with a whole-text and a streaming form that agree), and the grammars that force a tool call.
Shared by the Python API and the server: the engine's output processor runs them."""
from vlm_sdk.parsers.output_format import (REASONING_FORMATS, TOOL_PARSERS, OutputFormat, OutputStream,
                                           ReasoningFormat)
from vlm_sdk.parsers.types import ParsedDelta

__all__ = ["REASONING_FORMATS", "TOOL_PARSERS", "OutputFormat", "OutputStream", "ParsedDelta", "ReasoningFormat"]
