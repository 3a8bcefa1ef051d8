"""What the client's calls return: results, stream deltas and usage, read from the server's JSON."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # image tokens included
    completion_tokens: int
    total_tokens: int
    # prompt tokens served from the server's prefix cache (`prompt_tokens_details.cached_tokens`, part of
    # prompt_tokens); None when the server does not report it, which is not the same as none cached
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> "Usage | None":
        if not isinstance(data, dict):
            return None
        p, c = int(data.get("prompt_tokens") or 0), int(data.get("completion_tokens") or 0)
        details = data.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(p, c, int(data.get("total_tokens") or p + c), None if cached is None else int(cached))


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or "tool_calls"
    usage: Usage | None
    model: str
    id: str
    latency_s: float  # wall time of the call, image encoding included
    texts: tuple[str, ...] = ()  # with n=k (an extra body field): the k choices' texts, index order
    # with `tools=` (extra body fields): choice 0's calls as OpenAI sends them ({"id", "type",
    # "function": {"name", "arguments"}}), and its reasoning when the server splits it off
    tool_calls: tuple[dict, ...] = ()
    reasoning_content: str | None = None


@dataclass(frozen=True)
class ChatDelta:
    text: str  # the new piece of the answer; may be ""
    finish_reason: str | None = None  # set on the delta that ends the choice
    usage: Usage | None = None  # set on the final usage-only delta
    index: int = 0  # which choice, with n=k: a stream interleaves the k choices
    reasoning: str = ""  # the new piece of the reasoning (`delta.reasoning_content`)
    tool_calls: tuple[dict, ...] = ()  # `delta.tool_calls` as sent: {"index", "id", "function": {...}}


@dataclass(frozen=True)
class CompletionChoice:
    index: int  # prompt i's sample j is choice i * n + j
    text: str  # with echo, the prompt's text first
    finish_reason: str | None
    # with logprobs=k: {"tokens", "token_logprobs", "top_logprobs", "text_offset"} as the server sent it
    logprobs: dict | None = None


@dataclass(frozen=True)
class CompletionResult:
    """The answer of POST /v1/completions: every choice, in index order."""
    choices: tuple[CompletionChoice, ...]
    usage: Usage | None
    model: str
    id: str
    latency_s: float  # wall time of the call

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(c.text for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


@dataclass(frozen=True)
class CompletionDelta:
    text: str  # the new piece of choice `index`'s text; may be ""
    finish_reason: str | None = None  # set on the delta that ends the choice
    usage: Usage | None = None  # set on the final usage-only delta
    index: int = 0
    logprobs: dict | None = None  # this piece's tokens, as CompletionChoice.logprobs
