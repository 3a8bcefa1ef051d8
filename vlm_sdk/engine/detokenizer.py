"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte characters (one emoji can span several byte-level
tokens). We decode a short window `ids[prefix:]` and emit only what extends the text of
`ids[prefix:read]`; while the window ends in U+FFFD (an incomplete UTF-8 sequence) we emit nothing
and wait for the next token. The concatenated deltas equal `tokenizer.decode(all_ids)`.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.text_is_final = False  # set when a stop string cut the text: nothing more is appended

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly complete text (may be empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if new_text.endswith(REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (a truly invalid byte sequence decodes to U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
