"""A request's logprobs in OpenAI's shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`, read
from the compact `RequestOutput.token_logprobs` (or a list of `TokenLogprob`s).

A token's `bytes` are its own bytes, which may be part of a UTF-8 character (byte-level BPE splits
them); `token` is those bytes decoded with replacement. Token ids are looked up once and cached.
"""
from __future__ import annotations

import json
import math
import threading
from functools import lru_cache
from typing import Iterable, Iterator

from vlm_sdk.outputs import LogprobsView, TokenLogprob

# a request's logprobs: what its outputs hold, or `TokenLogprob`s
Logprobs = LogprobsView | list[TokenLogprob]


def rows(logprobs: Logprobs, start: int = 0) -> Iterator[tuple[int, float, Iterable[tuple[int, float]]]]:
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
                            for token, value, tops in rows(logprobs, start)]}

    def content_json(self, logprobs: Logprobs) -> str:
        """`content(logprobs)` as JSON text, for a large body (server/response_body.py): each entry is its
        token's cached `{"token":..,"bytes":..,"logprob":` and the number, so that 2,000 tokens of 21
        entries take milliseconds, and the thread making them gives the GIL back between tokens."""
        prefix = self._prefix
        parts = []
        for token, value, tops in rows(logprobs):
            alternatives = ",".join(prefix(t) + _number(v) + "}" for t, v in tops)
            parts.append(prefix(token) + _number(value) + ',"top_logprobs":[' + alternatives + "]}")
        return '{"content":[' + ",".join(parts) + "]}"

    def _prefix(self, token_id: int) -> str:
        hit = self.prefixes.get(token_id)
        if hit is None:
            text, raw = self.spell(token_id)
            hit = '{"token":' + json.dumps(text) + ',"bytes":' + json.dumps(raw, separators=(",", ":")) + ',"logprob":'
            if len(self.prefixes) < 1 << 20:
                self.prefixes[token_id] = hit
        return hit


def _number(logprob: float) -> str:
    return repr(logprob) if math.isfinite(logprob) else "-9999.0"  # JSON has no -inf (see `entry`)
