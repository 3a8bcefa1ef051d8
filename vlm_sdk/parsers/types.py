"""One delta of parsed output text, and the hold-back rule the streaming parsers share."""
from __future__ import annotations

from dataclasses import dataclass, field

from vlm_sdk.outputs import ToolCallDelta


@dataclass
class ParsedDelta:
    """Text that became certain since the last feed: reasoning, answer content, tool-call pieces."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: "ParsedDelta") -> "ParsedDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def partial_tag(text: str, tag: str) -> int:
    """Characters at the end of `text` that could begin `tag` (a proper prefix of it): held back by a
    streaming parser until the next text says whether the tag follows."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
