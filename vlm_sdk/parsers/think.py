"""Reasoning in a `<think>...</think>` block (Qwen3 thinking models, DeepSeek-R1 and their kin).

The block is open from the first generated token when the chat template opened it (Qwen3-VL-Thinking
ends its generation prompt with `<think>\\n`; `opened`), else the model may open it itself as its
first words (a hybrid template with thinking on). Everything up to the end tag is reasoning; the
answer follows it, its leading whitespace dropped (the templates render `</think>\\n\\n` before it).
An output cut before the end tag (max_tokens) is all reasoning and no answer.

    opened   output                              reasoning        answer
    yes      "look...\\n</think>\\n\\nIt is red."    "look...\\n"      "It is red."
    yes      "look, still looking"               "look, still..."  ""
    no       "<think>\\nhm</think>\\nRed."           "\\nhm"           "Red."
    no       "Red."                              None             "Red."

`split` is the whole-text form; `ThinkStream` the streaming one, which holds back only text that may
still be (part of) a tag. Fed any split of a text, the stream gives `split`'s result.
"""
from __future__ import annotations

import json
from typing import Callable

from vlm_sdk.parsers.types import partial_tag


def split(text: str, opened: bool, start: str = "<think>", end: str = "</think>") -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; reasoning None when no block was open."""
    stripped = text.lstrip()
    if stripped.startswith(start):  # the model opened it (again: a template-opened block is not nested)
        text, opened = stripped[len(start):], True
    if not opened:
        return None, text
    reasoning, tag, answer = text.partition(end)
    return reasoning, answer.lstrip() if tag else ""


class ThinkStream:
    """`feed(text)` -> (reasoning, answer) that became certain; `finish()` -> the rest."""

    _START, _REASONING, _ANSWER_START, _ANSWER = range(4)

    def __init__(self, opened: bool, start: str = "<think>", end: str = "</think>"):
        self.opened, self.start, self.end = opened, start, end
        self._state = self._START
        self._held = ""  # text not yet classified
        self.saw_reasoning = False  # a block was open at some point: reasoning is "" rather than None

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = answer = ""
        if self._state == self._START:
            stripped = self._held.lstrip()
            if stripped.startswith(self.start):
                self._held = stripped[len(self.start):]
                self._state = self._REASONING
            elif self.start.startswith(stripped):  # whitespace, or a part of the tag: wait
                return "", ""
            else:
                self._state = self._REASONING if self.opened else self._ANSWER
            self.saw_reasoning = self._state == self._REASONING
        if self._state == self._REASONING:
            before, tag, after = self._held.partition(self.end)
            if not tag:
                keep = partial_tag(self._held, self.end)
                reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning, self._held, self._state = before, after, self._ANSWER_START
        if self._state == self._ANSWER_START:
            self._held = self._held.lstrip()
            if not self._held:
                return reasoning, ""
            self._state = self._ANSWER
        answer, self._held = self._held, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == self._START:  # only whitespace or part of the start tag came
            if self.opened:
                self.saw_reasoning = True
                return held, ""
            return "", held
        if self._state == self._REASONING:  # cut before the end tag: all of it is reasoning
            return held, ""
        return "", held if self._state == self._ANSWER else ""


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
