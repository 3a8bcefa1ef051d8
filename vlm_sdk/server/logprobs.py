"""A request's logprobs in OpenAI's shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`, read
from the compact `RequestOutput.token_logprobs` (or a list of `TokenLogprob`s).

A token's `bytes` are its own bytes, which may be part of a UTF-8 character (byte-level BPE splits
them); `token` is those bytes decoded with replacement. Token ids are looked up once and cached.
"""
from __future__ import annotations

import json
import math
import threading
import time
from functools import lru_cache
from typing import Iterable, Iterator

from vlm_sdk.outputs import LogprobsView, TokenLogprob

# what a body's writer sleeps after each block of tokens (`TokenSpeller._view_json`), giving up the GIL
BODY_PAUSE_S = 1e-4

# a request's logprobs: what its outputs hold, or `TokenLogprob`s
Logprobs = LogprobsView | list[TokenLogprob]


def logprobs_rows(logprobs: Logprobs, start: int = 0) -> Iterator[tuple[int, float, Iterable[tuple[int, float]]]]:
    """(token id, logprob, its alternatives as (token id, logprob) best first) of each token from `start`."""
    if isinstance(logprobs, LogprobsView):
        return ((t, v, zip(ids, values)) for t, v, ids, values in logprobs.rows(start))
    return ((lp.token_id, lp.logprob, lp.top_logprobs) for lp in logprobs[start:])


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what Qwen's tokenizers spell their tokens in), reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenSpeller:
    """Token id -> (text, bytes) with the output tokenizer; `lock` is the one its other users hold."""

    def __init__(self, tokenizer, lock: threading.Lock):
        self.tokenizer, self.lock = tokenizer, lock
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.prefixes: dict[int, str] = {}  # token id -> its entry's JSON up to the logprob (content_json)

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is not None:
            return hit
        with self.lock:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(piece, str) and piece and all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
            else:  # not byte-level (or a special token spelled outside the alphabet): its decoded text
                raw = self.tokenizer.decode([token_id]).encode("utf-8")
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self.cache) < 1 << 20:
            self.cache[token_id] = hit
        return hit

    def entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.spell(token_id)
        # JSON has no -inf: a token top-k/top-p cut gets OpenAI's floor value instead
        return {"token": text, "logprob": logprob if math.isfinite(logprob) else -9999.0, "bytes": raw}

    def content(self, logprobs: Logprobs, start: int = 0) -> dict:
        """The `logprobs` object of tokens `start`.. (a stream chunk's)."""
        entry = self.entry
        return {"content": [{**entry(token, value), "top_logprobs": [entry(t, v) for t, v in tops]}
                            for token, value, tops in logprobs_rows(logprobs, start)]}

    def content_json(self, logprobs: Logprobs) -> str:
        """`content(logprobs)` as JSON text, for a large body (server/response_body.py): each entry is its
        token's cached `{"token":..,"bytes":..,"logprob":` and the number."""
        if isinstance(logprobs, LogprobsView):
            return self._view_json(logprobs)
        prefix = self._prefix
        parts = []
        for token, value, tops in logprobs_rows(logprobs):
            alternatives = ",".join(prefix(t) + _number(v) + "}" for t, v in tops)
            parts.append(prefix(token) + _number(value) + ',"top_logprobs":[' + alternatives + "]}")
        return '{"content":[' + ",".join(parts) + "]}"

    def _view_json(self, view: LogprobsView) -> str:
        """`content_json` of what outputs hold: a block of tokens at a time in a few C-level passes (the
        prefixes, the numbers, the text between entries), then a pause. While a thread makes a body,
        the engine thread waits for the GIL at each torch call of its step (dozens) until that thread
        gives it up, after a switch interval (5 ms) if it never waits: issue 28's row-5 victim then
        got a token every 0.2-0.5 s. A block's work (~0.5 ms at 21 entries a token, most of it `repr`)
        bounds that wait; the pause gives the GIL up (BODY_PAUSE_S a block: 4,000 tokens, 25 ms)."""
        separators = _separators(view.columns.width)
        parts = []
        for ids, values in view.blocks():
            texts = list(map(repr, values))
            pieces = map(str.__add__, self._prefixes(ids), map(_NOT_FINITE.get, texts, texts))
            parts.append("".join(map(str.__add__, pieces, separators * (len(ids) // len(separators)))))
            time.sleep(BODY_PAUSE_S)
        return '{"content":[' + "".join(parts)[:-1] + "]}"

    def _prefixes(self, ids: list[int]) -> list[str]:
        found = list(map(self.prefixes.get, ids))
        if None in found:  # tokens not seen before
            found = [hit if hit is not None else self._prefix(t) for hit, t in zip(found, ids)]
        return found

    def _prefix(self, token_id: int) -> str:
        hit = self.prefixes.get(token_id)
        if hit is None:
            text, raw = self.spell(token_id)
            hit = '{"token":' + json.dumps(text) + ',"bytes":' + json.dumps(raw, separators=(",", ":")) + ',"logprob":'
            if len(self.prefixes) < 1 << 20:
                self.prefixes[token_id] = hit
        return hit


# JSON has no -inf (see `entry`); nor inf and nan, which a sampler never gives
_NOT_FINITE = {"-inf": "-9999.0", "inf": "-9999.0", "nan": "-9999.0"}


@lru_cache(maxsize=32)
def _separators(width: int) -> tuple[str, ...]:
    """What follows each of a token's `width` entries in `content_json`: its alternatives' list opens
    after the drawn token, and closes (with the token's entry) after the last; a comma before the next."""
    if width == 1:
        return (',"top_logprobs":[]},',)
    return (',"top_logprobs":[',) + ("},",) * (width - 2) + ("}]},",)


def _number(logprob: float) -> str:
    return repr(logprob) if math.isfinite(logprob) else "-9999.0"  # JSON has no -inf (see `entry`)
