"""The tokenizer prompt building uses: serialised across threads, never holding the GIL for long, and
never doing more work than a prompt that could fit needs.

Only prompt building (`LLMEngine.build_prompt`, on callers' threads or AsyncLLM's executors) uses it;
the engine thread never does, and the `OutputProcessor` detokenizes with an instance of its own.

A fast tokenizer's `encode` of a long text holds the GIL for all of it (tokenizers' `Tokenizer.encode`
does not release it), transformers' wrapper converts several lists of every token id afterwards, and
freeing the backend's `Encoding` takes ~0.15 s per million tokens, all with the GIL held: for a
30 MB prompt that froze every other thread, the engine step included, for seconds. And the shared
tokenizer is used under one lock: a text just under 1 MiB held it for 1.6 s, and every new request
waited that long (issue 41 row 8). Texts of `CHILD_TEXT_CHARS` (16 KiB) or more are therefore
tokenized in child processes (`TokenizerProcesses`: `TOKENIZER_PROCESSES` of them, each with its own
pipe), never under the shared lock: what the lock guards is at most a 16 KiB text (~10 ms on the CI
machine, 30 ms for CJK text), so no request waits behind a long one, and two long texts are
tokenized at once.

Bounded work: with `max_tokens` set (the engine's max_model_len), a long text that cannot fit is
refused (`PromptTooLong`) before it is tokenized whole. First, for a text of `LONG_TEXT_CHARS` or
more (1 MiB), from its length alone: no token covers
more than `chars_per_token` characters (`chars_per_token`, from tokenizer.json). Then from a prefix:
a prefix cut after a newline or space is tokenized (in the child); when it alone has more than
`max_tokens` tokens, with a margin for the tokens at the cut, the text is refused with that count as
a lower bound. The prefix grows fourfold until that proves it or the whole text is reached, so a
30 MB text costs about as much as a text of max_model_len tokens. Same ids as
`tokenizer.encode(text, add_special_tokens=...)` otherwise (a test checks it).

Special-token text that `SpecialText.escape` marked in the messages is read as plain text here
(see engine/input/special_text.py).
"""
from __future__ import annotations

import itertools
import json
import threading

from vlm_sdk.engine.input.special_text import ESC, SpecialText
from vlm_sdk.engine.input.tokenizer_process import TokenizerProcesses

LONG_TEXT_CHARS = 1 << 20  # refused from its length alone when it cannot fit
CHILD_TEXT_CHARS = 16 << 10  # tokenized in a child process (see the module docstring); AsyncLLM's long pool
TOKENIZER_PROCESSES = 2  # as many long texts tokenized at once as AsyncLLM has threads for them
# tokens a prefix's count may exceed the whole text's by: BPE merges near the cut differ from the
# whole text's (a cut inside a long word can change a few of its pieces), and add_special_tokens
PREFIX_MARGIN = 64
# first prefix: this many characters per token allowed, more than any natural text needs, so one
# prefix usually settles it
_FIRST_PREFIX_CHARS_PER_TOKEN = 8

# characters of the original text one normalized character may come from: NFC/NFKC compose up to 4
# code points into one; these others never merge characters
_NORMALIZER_FACTORS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}


class PromptTooLong(Exception):
    """The text alone tokenizes to `num_tokens` > `PromptTokenizer.max_tokens` tokens; `exact` False:
    at least `num_tokens` (counting stopped once the text could not fit)."""

    def __init__(self, num_tokens: int, exact: bool = True):
        super().__init__(f"{'' if exact else 'at least '}{num_tokens} text tokens")
        self.num_tokens = num_tokens
        self.exact = exact


def chars_per_token(spec: dict) -> int | None:
    """An upper bound on the characters of text one token covers, from a tokenizer.json `spec`: the
    longest vocabulary entry or added token (a byte-level entry has a character per byte, at least as
    many as the characters those bytes encode), times what the normalizer may merge. None when no
    bound holds (a normalizer that may delete characters, or a model without a vocabulary list)."""
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        pieces = vocab.keys()
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        pieces = (entry[0] for entry in vocab)
    else:
        return None
    added = (t.get("content", "") for t in spec.get("added_tokens") or ())
    longest = max(map(len, itertools.chain(pieces, added)), default=0)
    factor = _normalizer_factor(spec.get("normalizer"))
    return None if factor is None or longest == 0 else longest * factor


def _normalizer_factor(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", ()):
            f = _normalizer_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a string pattern becomes its (non-empty) content: at most that much shorter
        pattern = (normalizer.get("pattern") or {}).get("String")
        return len(pattern) if pattern and normalizer.get("content") else None
    return _NORMALIZER_FACTORS.get(kind)


class PromptTokenizer:
    """Fast tokenizers raise "Already borrowed" when two threads use one at once; serialise them.
    Texts of CHILD_TEXT_CHARS or more go to copies of the backend in child processes instead, so a
    short prompt is never queued behind a long one's tokenization. `special_text`: None when special-token text in
    messages may become control tokens (`EngineArgs.allow_special_tokens_in_text`)."""

    def __init__(self, tokenizer, special_tokens_as_text: bool = True):
        self._tok = tokenizer
        self._lock = threading.Lock()
        backend = getattr(tokenizer, "_tokenizer", None)  # tokenizers.Tokenizer of a fast tokenizer
        spec = None if backend is None else backend.to_str()
        self._long = None if spec is None else TokenizerProcesses(spec, TOKENIZER_PROCESSES)
        self.chars_per_token = None if spec is None else chars_per_token(json.loads(spec))
        specials = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
        self.special_text = SpecialText(specials) if special_tokens_as_text and specials else None
        self._text_ids: dict[str, list[int]] = {}  # special-token text -> its ids as plain text
        self.max_tokens: int | None = None  # the engine sets max_model_len: longer texts raise PromptTooLong

    def check_length(self, chars: int) -> None:
        """`PromptTooLong` (a lower bound) when `chars` characters of text, at least LONG_TEXT_CHARS,
        hold more tokens than `max_tokens` whatever they say. Shorter texts are tokenized, for an
        exact count."""
        cpt, limit = self.chars_per_token, self.max_tokens
        if cpt is not None and limit is not None and chars >= LONG_TEXT_CHARS and chars > limit * cpt:
            raise PromptTooLong(-(-chars // cpt), exact=False)

    def encode(self, text, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            with self._lock:
                return self._tok.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        if self.special_text is not None and ESC in text:
            return self._encode_segments(text, add_special_tokens)
        return self._encode(text, add_special_tokens, self.max_tokens)

    def _encode_segments(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        for piece, is_special_text in self.special_text.segments(text):
            if is_special_text:
                ids += self._as_text(piece)
                continue
            room = None if self.max_tokens is None else self.max_tokens - len(ids)
            if room is not None and room < 0:
                raise PromptTooLong(len(ids), exact=False)
            ids += self._encode(piece, False, room)
        if add_special_tokens:  # what the tokenizer puts around one text, around all of it
            with self._lock:
                bare, full = self._tok.encode("a", add_special_tokens=False), self._tok.encode("a")
            at = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
            ids = full[:at] + ids + full[at + len(bare):]
        return ids

    def _as_text(self, special: str) -> list[int]:
        ids = self._text_ids.get(special)
        if ids is None:
            with self._lock:
                ids = self._tok.encode(special, add_special_tokens=False, split_special_tokens=True)
            self._text_ids[special] = ids
        return ids

    def _encode(self, text: str, add_special_tokens: bool, limit: int | None) -> list[int]:
        if self._long is None or len(text) < CHILD_TEXT_CHARS:
            with self._lock:
                return self._tok.encode(text, add_special_tokens=add_special_tokens)
        if limit is not None:
            self.check_length(len(text))
            size = (limit + PREFIX_MARGIN) * _FIRST_PREFIX_CHARS_PER_TOKEN
            while size < len(text):
                n, _ = self._long.encode(text[:_cut(text, size)], add_special_tokens, 0)  # the count only
                if n - PREFIX_MARGIN > limit:
                    raise PromptTooLong(n - PREFIX_MARGIN, exact=False)
                size *= 4
        n, ids = self._long.encode(text, add_special_tokens, limit)  # in a child process, the lock not held
        if ids is None:
            raise PromptTooLong(n)
        return ids

    @property
    def wrapped(self):
        """The transformers tokenizer inside (for tools that need its own type, e.g. llguidance)."""
        return self._tok

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tok.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _cut(text: str, size: int) -> int:
    """Where to end a prefix of about `size` characters: after its last newline or space in its last
    quarter (a boundary every pre-tokenizer keeps), else at `size`."""
    for sep in ("\n", " "):
        at = text.rfind(sep, size - size // 4, size)
        if at >= 0:
            return at + 1
    return size
