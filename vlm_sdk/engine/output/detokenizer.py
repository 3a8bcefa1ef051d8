"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte characters (one emoji can span several byte-level
tokens). With a fast tokenizer, `tokenizers.decoders.DecodeStream` does it in Rust: each step
returns the newly complete text, or None while the bytes so far end inside a character. Otherwise
(or if the stream refuses a token) we decode a short window `ids[prefix:]` and emit only what
extends the text of `ids[prefix:read]`; while the window ends in U+FFFD (an incomplete UTF-8
sequence) we emit nothing and wait for the next token. The concatenated deltas, flushed at the
end, equal `tokenizer.decode(all_ids)`.
"""
from __future__ import annotations

from contextlib import nullcontext

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

REPLACEMENT = "\ufffd"
WINDOW_CONTEXT = 5  # tokens of already-emitted text the window method decodes again for context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        """`tokenizer`: transformers' tokenizer, or anything with its `decode`; a `backend`
        (tokenizers.Tokenizer) and `lock` attribute, when present, serve the DecodeStream path."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "_tokenizer", None)
        self._lock = getattr(tokenizer, "lock", None) or nullcontext()
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if DecodeStream is not None and self._backend is not None else None)
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
        if self._stream is not None:
            try:
                with self._lock:
                    piece = self._stream.step(self._backend, token_id)
            except Exception:  # a decoder the stream cannot follow: the window method from here on
                self._stream = None
            else:
                if piece:
                    self.text += piece
                    self.read_offset = len(self.ids)
                    self.prefix_offset = max(0, self.read_offset - WINDOW_CONTEXT)
                return piece or ""
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
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
