"""Special tokens typed in message text stay text.

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>`) around each message, and the
rendered prompt is tokenized as one string, so the same characters typed inside a message would
become control tokens too: a user could end their turn and write a system turn of their own. So
before the template runs, `escape` replaces the text of each special token inside message text by
an escape (ESC and a code naming the token); after the template, `segments` splits the rendered
text at the escapes, and the tokenizer reads those parts as plain text (special tokens off) and the
rest as before. An ESC the user typed is doubled, so it stays itself. A prompt with no such text is
tokenized exactly as before.
"""
from __future__ import annotations

import re
from typing import Iterator

ESC = "\U0010FFFD"  # the last private-use character, which no template or tokenizer gives a meaning
_CODE = 0x100000  # ESC + chr(_CODE + i): the text of special token i


class SpecialText:
    """`escape` message text; `segments` of the rendered prompt: (text, is_special_token_text)."""

    def __init__(self, specials: list[str]):
        self.specials = list(specials)
        names = sorted({ESC, *self.specials}, key=len, reverse=True)  # the longest first, as the tokenizer matches
        self._pattern = re.compile("|".join(map(re.escape, names)))
        self._codes = {s: ESC + chr(_CODE + i) for i, s in enumerate(self.specials)}
        self._codes[ESC] = ESC + ESC

    def escape(self, text: str) -> str:
        if self._pattern.search(text) is None:
            return text
        return self._pattern.sub(lambda m: self._codes[m.group()], text)

    def escape_tree(self, value):
        """`value` (JSON-like: dicts, lists, strings) with every string escaped, keys included."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape(k) if isinstance(k, str) else k: self.escape_tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape_tree(v) for v in value]
        return value

    def segments(self, text: str) -> Iterator[tuple[str, bool]]:
        plain: list[str] = []
        start = 0
        while True:
            at = text.find(ESC, start)
            if at < 0 or at + 1 == len(text):
                plain.append(text[start:])
                break
            plain.append(text[start:at])
            code = text[at + 1]
            index = ord(code) - _CODE
            if code == ESC:
                plain.append(ESC)
            elif 0 <= index < len(self.specials):
                if any(plain):
                    yield "".join(plain), False
                plain = []
                yield self.specials[index], True
            else:  # not one of ours (a template that cut an escape in two): left as it is
                plain.append(ESC + code)
            start = at + 2
        if any(plain):
            yield "".join(plain), False
