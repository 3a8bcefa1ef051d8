"""How many tokens one sequence may hold, and which single setting would make a too-long prompt fit.

    capacity_tokens = max_model_len <= num_blocks * block_size

A prompt fits when prompt_tokens <= capacity_tokens (the step that computes its last token samples
the first output token; generation then stops with "length" at max_model_len).
"""
from __future__ import annotations

from typing import Callable

from vlm_sdk.config import CacheConfig, SchedulerConfig
from vlm_sdk.errors import InputTooLongError
from vlm_sdk.multimodal.inputs import PromptInputs


def check_prompt_fits(prompt: PromptInputs, cache: CacheConfig, sched: SchedulerConfig,
                      max_position_embeddings: int, max_model_len_is_user_set: bool,
                      image_tokens_with_max_pixels: Callable[[PromptInputs, int], list[int]] | None,
                      min_pixels: int, factor: int) -> None:
    n = len(prompt.token_ids)
    capacity = sched.max_model_len
    if n <= capacity:
        return
    fixes: dict[str, int] = {}
    cache_tokens = cache.capacity_tokens
    if max_model_len_is_user_set:
        if n <= cache_tokens and n <= max_position_embeddings:
            fixes["max_model_len"] = n
    elif n <= max_position_embeddings:
        # max_model_len follows the cache when not set, so growing the cache alone is enough
        blocks = -(-n // cache.block_size)
        fixes["num_blocks"] = blocks
        fixes["kv_cache_memory"] = blocks * cache.bytes_per_block
    if prompt.images and image_tokens_with_max_pixels is not None:
        text_tokens = n - sum(prompt.image_tokens)
        best = _largest_max_pixels(lambda v: text_tokens + sum(image_tokens_with_max_pixels(prompt, v)),
                                   capacity, min_pixels, factor)
        if best is not None:
            fixes["max_pixels"] = best
    raise InputTooLongError(prompt_tokens=n, image_tokens=prompt.image_tokens, capacity_tokens=capacity,
                            fixes=fixes, limit_reason=describe_limit(cache, sched))


def describe_limit(cache: CacheConfig, sched: SchedulerConfig) -> str:
    cache_text = (f"KV cache of {cache.num_blocks} blocks x {cache.block_size} tokens = "
                  f"{cache.capacity_tokens} tokens, {cache.bytes_per_block:,} bytes per block, {cache.source}")
    if sched.max_model_len < cache.capacity_tokens:
        return f"max_model_len={sched.max_model_len} ({sched.max_model_len_source}); {cache_text}"
    return cache_text


def _largest_max_pixels(tokens_at: Callable[[int], int], capacity: int, min_pixels: int,
                        factor: int) -> int | None:
    """The largest max_pixels (a multiple of factor^2, >= min_pixels) whose prompt fits, by bisection:
    image tokens never grow as max_pixels shrinks."""
    unit = factor * factor
    lo = max(1, -(-min_pixels // unit))  # smallest allowed multiple
    if tokens_at(lo * unit) > capacity:
        return None
    hi = lo
    while tokens_at(hi * 2 * unit) <= capacity and hi < 1 << 20:
        hi *= 2
    hi *= 2  # tokens_at(hi * unit) > capacity, or hi is huge
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens_at(mid * unit) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo * unit
