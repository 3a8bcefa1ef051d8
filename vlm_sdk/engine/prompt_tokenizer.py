"""The tokenizer prompt building uses: serialised across threads, and never holding the GIL for long.

Only prompt building (`LLMEngine.build_prompt`, on callers' threads or AsyncLLM's executor) uses it;
the engine thread never does, and the `OutputProcessor` detokenizes with an instance of its own.

A fast tokenizer's `encode` of a long text holds the GIL for all of it (tokenizers' `Tokenizer.encode`
does not release it), transformers' wrapper converts several lists of every token id afterwards, and
freeing the backend's `Encoding` takes ~0.15 s per million tokens, all with the GIL held: for a
30 MB prompt that froze every other thread, the engine step included, for seconds. Texts of
`LONG_TEXT_CHARS` or more are therefore tokenized in a child process (`TokenizerProcess`, with a
lock of its own, so short prompts never queue behind a huge one); when `max_tokens` is set and the
text alone has more tokens, `PromptTooLong` is raised from the count, before any ids are converted:
the prompt could never fit, whatever its images. Same ids as `tokenizer.encode(text,
add_special_tokens=...)` otherwise (a test checks it).
"""
from __future__ import annotations

import threading

from vlm_sdk.engine.tokenizer_process import TokenizerProcess

LONG_TEXT_CHARS = 1 << 20


class PromptTooLong(Exception):
    """The text alone tokenizes to `num_tokens` > `PromptTokenizer.max_tokens`."""

    def __init__(self, num_tokens: int):
        super().__init__(f"{num_tokens} text tokens")
        self.num_tokens = num_tokens


class PromptTokenizer:
    """Fast tokenizers raise "Already borrowed" when two threads use one at once; serialise them.
    Long texts use a copy of the backend behind a lock of their own, so a short prompt is never
    queued behind a huge one's tokenization."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._lock = threading.Lock()
        backend = getattr(tokenizer, "_tokenizer", None)  # tokenizers.Tokenizer of a fast tokenizer
        self._long = None if backend is None else TokenizerProcess(backend.to_str())
        self.max_tokens: int | None = None  # the engine sets max_model_len: longer texts raise PromptTooLong

    def encode(self, text, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or self._long is None or not isinstance(text, str) or len(text) < LONG_TEXT_CHARS:
            with self._lock:
                return self._tok.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        n, ids = self._long.encode(text, add_special_tokens, self.max_tokens)  # in a child process
        if ids is None:
            raise PromptTooLong(n)
        return ids

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tok.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)
