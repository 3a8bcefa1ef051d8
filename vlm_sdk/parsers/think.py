"""Reasoning in a `<think>...</think>` block (Qwen3 thinking models, DeepSeek-R1 and their kin).

The block is open from the first generated token when the chat template opened it (Qwen3-VL-Thinking
ends its generation prompt with `<think>\\n`; `opened`), else the model may open it itself. Everything
up to the end tag is reasoning; the answer follows it, its leading whitespace dropped (the templates
render `</think>\\n\\n` before it). An output cut before the end tag (max_tokens) is all reasoning.

    opened   output                                 reasoning          answer
    yes      "look...\\n</think>\\n\\nIt is red."       "look...\\n"        "It is red."
    yes      "look, still looking"                  "look, still..."   ""
    no       "<think>\\nhm</think>\\nRed."              "\\nhm"             "Red."
    no       "Red."                                 None               "Red."
    no       "Answer first. <think>then</think> ok"  "then"             "Answer first. ok"
    yes      "first <think>then</think> ok"          "first then"       "ok"

The first `<think>` is the block's start wherever it comes (as vLLM's qwen3 and deepseek_r1 parsers
read it), and is dropped; the text before it is kept: the answer's when the block was not open yet,
the reasoning's when it was (vLLM drops it), and only whitespace before it is dropped.
With `tool_tag` (Qwen3 with tools under tool_choice "auto"), that tag followed by the start of a call
(`<tool_call>\\n{"` as Hermes writes it, or `<tool_call>\\n<function=` as Qwen3.5 does) also ends the
reasoning, as vLLM's qwen3 parser ends it: a model that calls a tool without closing its thought. The
call is the answer's, read by the tool parser; the tag alone, mentioned in a thought, is not.

`split` is the whole-text form; `ThinkStream` the streaming one, which holds back only text that may
still be (part of) a tag, or a tool tag whose next characters say whether it opens a call. `split` runs
the stream over the whole text, so any split of a text gives `split`'s result.
"""
from __future__ import annotations

import json
from typing import Callable

from vlm_sdk.parsers.types import partial_tag


def split(text: str, opened: bool, start: str = "<think>", end: str = "</think>",
          tool_tag: str | None = None) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; reasoning None when no block was open."""
    stream = ThinkStream(opened, start, end, tool_tag)
    r1, a1 = stream.feed(text)
    r2, a2 = stream.finish()
    return (r1 + r2 if stream.saw_reasoning else None), a1 + a2


_FUNCTION = "<function"  # Qwen3.5's XML call after the tag (<function=name>), which vLLM's lookahead also takes


def _opens_call(after: str, finished: bool) -> bool | None:
    """Whether the text after a tool tag begins a call: a JSON object (whitespace, "{", whitespace, a
    key's quote: Hermes) or `<function=` / `<function ` (Qwen3.5's XML form); None while the text so far
    cannot tell."""
    rest = after.lstrip()
    if not rest:
        return False if finished else None
    if rest[0] == "<":
        head = rest[:len(_FUNCTION) + 1]
        if len(head) <= len(_FUNCTION):
            return None if not finished and _FUNCTION.startswith(head) else False
        return head.startswith(_FUNCTION) and head[-1] in "= \t\n\r"
    if rest[0] != "{":
        return False
    rest = rest[1:].lstrip()
    if not rest:
        return False if finished else None
    return rest[0] == '"'


class ThinkStream:
    """`feed(text)` -> (reasoning, answer) that became certain; `finish()` -> the rest."""

    _START, _TEXT, _ANSWER_START, _ANSWER = range(4)

    def __init__(self, opened: bool, start: str = "<think>", end: str = "</think>", tool_tag: str | None = None):
        self.opened, self.start, self.end, self.tool_tag = opened, start, end, tool_tag
        self._state = self._START
        self._held = ""  # text not yet classified
        self._in_block = opened  # text goes to the reasoning
        self._start_pending = True  # the start tag has not come yet
        self.saw_reasoning = opened  # a block was open at some point: reasoning is "" rather than None

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._scan(finished=False)

    def finish(self) -> tuple[str, str]:
        return self._scan(finished=True)

    def _scan(self, finished: bool) -> tuple[str, str]:
        reasoning, answer = [], []
        while True:
            held = self._held
            if self._state == self._START:
                stripped = held.lstrip()
                if stripped.startswith(self.start):
                    self._held = stripped[len(self.start):]
                    self._open_block()
                    self._state = self._TEXT
                    continue
                if not finished and self.start.startswith(stripped):  # whitespace, or a part of the tag: wait
                    break
                self._state = self._TEXT
                continue
            if self._state == self._TEXT:
                out = reasoning if self._in_block else answer
                tag, at = self._first_tag(held)
                if tag is None:  # send all but what may begin a tag
                    keep = 0 if finished else max((partial_tag(held, t) for t in self._tags()), default=0)
                    out.append(held[:len(held) - keep])
                    self._held = held[len(held) - keep:]
                    break
                out.append(held[:at])
                rest = held[at + len(tag):]
                if tag == self.start:
                    self._held = rest
                    self._open_block()
                elif tag == self.end:
                    self._held, self._state = rest, self._ANSWER_START
                else:  # the tool tag: a call opens, or it was text
                    opens = _opens_call(rest, finished)
                    if opens is None:
                        self._held = held[at:]
                        break
                    if opens:
                        self._held, self._state = held[at:], self._ANSWER
                    else:
                        out.append(tag)
                        self._held = rest
                continue
            if self._state == self._ANSWER_START:
                self._held = held.lstrip()
                if not self._held:
                    break
                self._state = self._ANSWER
                continue
            answer.append(held)
            self._held = ""
            break
        return "".join(reasoning), "".join(answer)

    def _open_block(self) -> None:
        self._in_block = self.saw_reasoning = True
        self._start_pending = False

    def _tags(self) -> list[str]:
        """The tags that mean something now: the start tag until it has come; inside the block its end
        tag, and the tool tag when reasoning ends at a call."""
        tags = [self.start] if self._start_pending else []
        if self._in_block:
            tags.append(self.end)
            if self.tool_tag is not None:
                tags.append(self.tool_tag)
        return tags

    def _first_tag(self, text: str) -> tuple[str | None, int]:
        best, at = None, -1
        for tag in self._tags():
            i = text.find(tag)
            if i >= 0 and (best is None or i < at):
                best, at = tag, i
        return best, at


def prefix_grammar(opened: bool, answer: str, start: str = "<think>", end: str = "</think>",
                   tag: Callable[[str], str] = json.dumps) -> str:
    """Lark text (llguidance) for free reasoning, then the grammar `answer` names (`@answer`, a
    nested grammar): up to the end tag when the block is open, else an optional block the model may
    open as its first words. `tag(text)` writes a tag in Lark: a special token (`<...>`, which no
    regex matches, so free text then the token) or a string literal (then a lazy lexeme ending at
    the first end tag)."""
    end_tag = tag(end)
    if end_tag.startswith('"'):
        rules, block = f"think[lazy]: /(.|\\n)*{_regex_escape(end)}/\n", "think"
    else:
        rules, block = "THINK: /(.|\\n)+/\n", f"THINK? {end_tag}"
    body = f"{block} NL?" if opened else f"({tag(start)} {block} NL?)?"
    return f"start: {body} {answer}\n{rules}NL: /\\n+/\n"


def _regex_escape(text: str) -> str:
    """`text` as a literal inside Lark's /.../ (escaped for the regex and the slashes)."""
    return "".join("\\" + ch if ch in "\\/.^$*+?()[]{}|" else ch for ch in text)
