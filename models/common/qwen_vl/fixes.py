"""Qwen2.5-VL's image-setting search: the largest engine max_pixels that makes a prompt (the too-long
error's fix) or the largest image (the planner's) fit. Image tokens never grow as max_pixels shrinks,
so the search bisects over multiples of (patch * merge)^2."""
from __future__ import annotations

from typing import Callable

from vlm_sdk.multimodal.inputs import PromptInputs


def max_pixels_fix(prompt: PromptInputs, capacity: int,
                   image_tokens_with_max_pixels: Callable[[PromptInputs, int], list[int]], min_pixels: int,
                   factor: int, max_pixels: int | None) -> int | None:
    """The largest engine max_pixels that makes this prompt fit, or None. Images whose part sets its
    own max_pixels do not follow it; the others keep their effective min_pixels (their part's, else
    the engine's), which the value may not go below. A fix is only offered strictly below
    `max_pixels` (the value in effect) when it is given."""
    affected = [im for im in prompt.images if not im.meta.own_max_pixels and im.source_size is not None
                and im.meta.frames == 1]  # video patches are sized by their video's settings
    if not affected:
        return None
    floor = max([min_pixels] + [im.meta.own_min_pixels for im in affected if im.meta.own_min_pixels is not None])
    text_tokens = len(prompt.token_ids) - sum(prompt.image_tokens)
    best = largest_max_pixels(lambda v: text_tokens + sum(image_tokens_with_max_pixels(prompt, v)),
                               capacity, floor, factor, max_pixels)
    if best is None or (max_pixels is not None and best >= max_pixels):
        return None
    return best


_MAX_PIXELS_CAP_UNITS = 1 << 20  # ~822M pixels at factor 28: far above any decodable image


def largest_max_pixels(tokens_at: Callable[[int], int], capacity: int, min_pixels: int,
                        factor: int, below: int | None = None) -> int | None:
    """The largest max_pixels (a multiple of factor^2, >= min_pixels, < `below` when given) whose
    prompt fits, by bisection: image tokens never grow as max_pixels shrinks. None when none fits,
    or when (with no `below`) even the search's cap fits: then max_pixels is not what limits."""
    unit = factor * factor
    lo = max(1, -(-min_pixels // unit))  # smallest allowed multiple
    if below is not None:
        hi = -(-below // unit)  # (hi - 1) * unit < below: candidates are lo .. hi - 1
        if hi <= lo:
            return None
    else:
        hi = None
    if tokens_at(lo * unit) > capacity:
        return None
    if hi is None:
        hi = lo
        while tokens_at(hi * 2 * unit) <= capacity:
            hi *= 2
            if hi >= _MAX_PIXELS_CAP_UNITS:
                return None
        hi *= 2  # tokens_at(hi * unit) > capacity
    while hi - lo > 1:  # tokens_at(lo * unit) fits; hi is excluded
        mid = (lo + hi) // 2
        if tokens_at(mid * unit) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo * unit
