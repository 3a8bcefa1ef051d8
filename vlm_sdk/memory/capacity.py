"""How many tokens one sequence may hold, and which settings would make a too-long prompt fit.

    capacity_tokens = max_model_len <= the longest sequence the blocks hold (num_blocks * block_size for
                                       one full-attention group; `CacheConfig.capacity_tokens`)

A prompt fits when prompt_tokens <= capacity_tokens (the step that computes its last token samples
the first output token; generation then stops with "length" at max_model_len). A prompt that does
not fit is refused; the fixes offered fit the whole request (prompt + its max_tokens), so that the
request, once the fix is applied, generates all its max_tokens. The engine's start-up refusals, the
too-long error and `vlm-sdk plan` all take their cache fixes from `CacheConfig.fixes_for`, so they
name the same settings and values.
"""
from __future__ import annotations

from typing import Callable

from vlm_sdk.config import SchedulerConfig
from vlm_sdk.errors import CacheTooSmallError, InputTooLongError, fixes_text
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.sampling_params import DEFAULT_MAX_TOKENS


def resolve_max_model_len(max_model_len: int | None, max_position_embeddings: int,
                          capacity_tokens: int) -> tuple[int, str]:
    """(max_model_len, where it came from): the user's value, else the cache's capacity or the model's
    max_position_embeddings, whichever is smaller. The engine and `vlm-sdk plan` both take it from here."""
    if max_model_len is not None:
        return max_model_len, "set by you"
    if capacity_tokens < max_position_embeddings:
        return capacity_tokens, "the KV cache capacity"
    return max_position_embeddings, "the model's max_position_embeddings"


def requests_at_once(cache: CacheConfig, tokens: int, max_num_seqs: int) -> int:
    """Requests of `tokens` tokens each (prompt + output, images counted in) the cache holds at once, each
    running to its end: the blocks over every group, at most max_num_seqs and the state slots (a running
    request holds one); 0 when one alone does not fit. The start-up line and `vlm-sdk plan --workload`."""
    if tokens > cache.capacity_tokens:
        return 0
    slots = cache.num_state_slots or max_num_seqs
    return min(max_num_seqs, max(cache.num_blocks, 0) // cache.blocks_for(max(tokens, 1)), slots)


def max_model_len_fixes(cache: CacheConfig, max_model_len: int) -> dict[str, int | float]:
    """Each setting that alone lets `max_model_len` fit once: the largest max_model_len the cache
    holds, or a cache of enough blocks (by the rule that sized it)."""
    return {"max_model_len": cache.capacity_tokens,
            **cache.fixes_for(cache.blocks_for(max_model_len))}


def check_max_model_len_fits(cache: CacheConfig, max_model_len: int) -> None:
    """Raise `CacheTooSmallError` when one sequence of `max_model_len` tokens cannot fit the cache."""
    if max_model_len <= cache.capacity_tokens:
        return
    need = cache.blocks_for(max_model_len)
    fixes = max_model_len_fixes(cache, max_model_len)
    note = ""
    if len(fixes) == 1 and cache.budget is not None:
        u = cache.budget.utilization_for(need * cache.bytes_per_block + cache.state_bytes)
        note = f" (no cache setting can: that cache would take {u:.2f} of the device)"
    names = fixes_text(fixes)
    groups = cache.layout.num_attention_groups if cache.layout is not None else 1
    over = f" over its {groups} attention groups ({cache.layout.describe()})" if groups > 1 else ""
    raise CacheTooSmallError(
        f"max_model_len={max_model_len} does not fit once in the KV cache: one sequence of {max_model_len} "
        f"tokens needs {need} blocks of {cache.block_size} tokens{over} ({need * cache.bytes_per_block:,} bytes at "
        f"{cache.bytes_per_block:,} per block) but the cache has {cache.num_blocks} blocks = "
        f"{cache.capacity_tokens} tokens ({cache.source}). The largest max_model_len that fits is "
        f"{cache.capacity_tokens}. Any one of these settings lets the engine start{note}: {names}",
        max_model_len, need, cache.num_blocks, fixes)


def output_room(prompt_tokens: int, max_tokens: int | None, max_position_embeddings: int) -> int:
    """The output tokens a fix makes room for: the request's max_tokens (when None, not set:
    `DEFAULT_MAX_TOKENS`), fewer only where max_position_embeddings ends the sequence sooner."""
    want = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    return max(0, min(want, max_position_embeddings - prompt_tokens))


def check_prompt_fits(prompt: PromptInputs, cache: CacheConfig, sched: SchedulerConfig,
                      max_position_embeddings: int, max_model_len_is_user_set: bool,
                      image_setting_fixes: Callable[[PromptInputs, int], dict[str, int]] | None = None,
                      max_tokens: int | None = None,
                      video_setting_fixes: Callable[[PromptInputs, int], dict] | None = None) -> None:
    """Raise `InputTooLongError` when the prompt cannot fit. Its fixes fit the whole request, the prompt
    and `output_room(...)` tokens after it (the request's `max_tokens`; None: not set), so that with
    any of them the request generates all its max_tokens. `image_setting_fixes(prompt, capacity)`
    (the model family's processor) names the engine image settings that alone would make it fit, and
    `video_setting_fixes(prompt, capacity)` the settings of its video parts.

    A sequence of n prompt tokens generates k tokens when n + k <= max_model_len (it stops with
    "length" once it holds max_model_len tokens), so the request needs max_model_len >= n + k."""
    n = len(prompt.token_ids)
    capacity = sched.max_model_len
    if n <= capacity:
        return
    fixes: dict[str, int] = {}
    together: dict[str, int] = {}
    room = output_room(n, max_tokens, max_position_embeddings)
    need = n + room  # the whole request, at most max_position_embeddings
    blocks = cache.blocks_for(need)
    if max_model_len_is_user_set:
        if n <= max_position_embeddings:
            if need <= cache.capacity_tokens:
                fixes["max_model_len"] = need
            else:  # both limits are below the request: raising either alone is not enough
                together = {"max_model_len": need, "num_blocks": blocks}
    elif n <= max_position_embeddings:
        # max_model_len follows the cache when not set, so growing the cache alone is enough
        fixes.update(cache.fixes_for(blocks))
    video_fixes = {}
    if prompt.images and image_setting_fixes is not None and capacity - room >= 1:
        fixes.update(image_setting_fixes(prompt, capacity - room))  # smaller images leave the room
    if prompt.images and video_setting_fixes is not None and capacity - room >= 1:
        video_fixes = video_setting_fixes(prompt, capacity - room)
    raise InputTooLongError(prompt_tokens=n, image_tokens=prompt.image_tokens, capacity_tokens=capacity,
                            fixes=fixes, limit_reason=describe_limit(cache, sched, max_model_len_is_user_set),
                            together=together, max_tokens=max_tokens, output_tokens=room, video_fixes=video_fixes)


def text_too_long(min_tokens: int, cache: CacheConfig, sched: SchedulerConfig,
                  max_model_len_is_user_set: bool) -> InputTooLongError:
    """The error for a text refused before it was tokenized whole: at least `min_tokens` tokens."""
    return InputTooLongError(prompt_tokens=min_tokens, image_tokens=[], capacity_tokens=sched.max_model_len,
                             fixes={}, limit_reason=describe_limit(cache, sched, max_model_len_is_user_set),
                             at_least=True)


def describe_limit(cache: CacheConfig, sched: SchedulerConfig, max_model_len_is_user_set: bool | None = None) -> str:
    """The limit in words; max_model_len is named when it is below the cache or the user set it."""
    if max_model_len_is_user_set is None:
        max_model_len_is_user_set = sched.max_model_len_source == "set by you"
    groups = cache.layout.num_attention_groups if cache.layout is not None else 1
    if groups == 1:
        cache_text = (f"KV cache of {cache.num_blocks} blocks x {cache.block_size} tokens = "
                      f"{cache.capacity_tokens} tokens, {cache.bytes_per_block:,} bytes per block, {cache.source}")
    else:  # one sequence holds blocks in every attention group: the capacity is what that leaves
        cache_text = (f"KV cache of {cache.num_blocks} blocks of {cache.block_size} tokens shared by "
                      f"{groups} attention groups ({cache.layout.describe()}): at most {cache.capacity_tokens} "
                      f"tokens in one sequence, {cache.bytes_per_block:,} bytes per block, {cache.source}")
    if sched.max_model_len < cache.capacity_tokens or max_model_len_is_user_set:
        return f"max_model_len={sched.max_model_len} ({sched.max_model_len_source}); {cache_text}"
    return cache_text
