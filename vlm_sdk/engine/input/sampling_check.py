"""A request's sampling settings against this engine: token ids inside the vocabulary, and the sizes
that reach every step within the engine's limits.

`SamplingParams` checks what it can alone (types, ranges); the vocabulary and the limits are the
engine's. Each entry of `logit_bias` is written into the request's logits at every step, and
`min_tokens` bans each of `stop_token_ids` at every step until it is reached, so their counts are
bounded (`EngineArgs.max_logit_bias`, `max_stop_token_ids`); an id outside the vocabulary is refused as
vLLM refuses it, naming the ids and the vocabulary size.
"""
from __future__ import annotations

from vlm_sdk.errors import InvalidRequestError, limit_text
from vlm_sdk.sampling_params import SamplingParams

SHOWN_IDS = 5  # bad ids a message lists before it counts the rest


def check_counts(name: str, count: int, limit: int) -> None:
    """A field's entries within the engine's limit `limit` (the setting named `max_<name>`)."""
    if count > limit:
        raise InvalidRequestError(f"'{name}' has {count} entries; this engine accepts at most {limit} per request "
                                  f"({limit_text('max_' + name, limit)}), because each is applied at every step",
                                  param=name)


def check_sampling(params: SamplingParams, vocab_size: int, eos_ids, max_logit_bias: int,
                   max_stop_token_ids: int) -> None:
    """`InvalidRequestError` naming the field when `params` asks for more than this engine serves."""
    check_counts("logit_bias", len(params.logit_bias), max_logit_bias)
    check_counts("stop_token_ids", len(params.stop_token_ids), max_stop_token_ids)
    _check_ids("logit_bias", [t for t, _ in params.logit_bias], vocab_size)
    _check_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if len(banned) >= vocab_size:
            raise InvalidRequestError(
                f"'min_tokens' is {params.min_tokens}, but stop_token_ids{'' if params.ignore_eos else ' and EOS'} "
                f"cover all {vocab_size} tokens of the vocabulary, so no token could come before the stop; leave some "
                f"tokens out of stop_token_ids, or min_tokens out", param="min_tokens")


def _check_ids(name: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(map(str, bad[:SHOWN_IDS]))
        more = f" and {len(bad) - SHOWN_IDS} more" if len(bad) > SHOWN_IDS else ""
        raise InvalidRequestError(f"token id(s) {shown}{more} in '{name}' are outside the vocabulary: vocabulary size "
                                  f"{vocab_size} (ids 0 to {vocab_size - 1})", param=name)
