"""Start-up check: the largest image the image settings allow must fit in one sequence.

    largest image tokens <= max_model_len        (the same test as `vlm-sdk plan`'s problem)

Otherwise every request carrying such an image would be refused with a 400 / `InputTooLongError`,
so the engine refuses to start (`UnfitImagesError`), naming the numbers and each setting that alone
makes it fit with room (`DEFAULT_MAX_TOKENS`, 256 tokens) for a request's text and output beside the
image: the family's image setting (the largest value whose image fits) and max_model_len, or the
cache settings when max_model_len follows the cache. `allow_unfit_images=True`
(`--allow-unfit-images`) logs the same text as a warning and starts: such images are then refused per
request, and smaller ones run.
"""
from __future__ import annotations

import logging

from vlm_sdk.config import EngineArgs, SchedulerConfig
from vlm_sdk.errors import UnfitImagesError, fixes_text, setting_text
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.models.family import ImageLimits
from vlm_sdk.sampling_params import DEFAULT_MAX_TOKENS

logger = logging.getLogger("vlm_sdk")


def unfit_image_fixes(limits: ImageLimits, setting: str, cache: CacheConfig, max_model_len: int,
                      max_position_embeddings: int, max_model_len_is_user_set: bool,
                      room: int = DEFAULT_MAX_TOKENS) -> tuple[dict[str, int | float], dict[str, int | float], int]:
    """(fixes, together, room) for a largest image that does not fit `max_model_len`. Each fix leaves
    `room` tokens beside the largest image for the request's text and output (fewer only where
    max_position_embeddings allows no more; the third value says how many): `setting` (the engine
    name of the family's image setting) at the largest value whose image fits max_model_len - room;
    a max_model_len (or a cache, when max_model_len follows it) of image + room tokens. `vlm-sdk plan`
    can call this with its own figures to print the same fixes."""
    need = min(limits.tokens + room, max_position_embeddings)
    room = max(need - limits.tokens, 0)
    fixes: dict[str, int | float] = {}
    together: dict[str, int | float] = {}
    fit = limits.fitting(max_model_len - room) if max_model_len - room >= 1 else None
    if fit is not None and fit.value is not None:
        fixes[setting] = fit.value
    if limits.tokens <= max_position_embeddings:
        if not max_model_len_is_user_set:  # max_model_len follows the cache: a bigger cache is enough
            fixes.update(cache.fixes_for(cache.blocks_for(need)))
        elif need <= cache.capacity_tokens:
            fixes["max_model_len"] = need
        else:
            grow = cache.fixes_for(cache.blocks_for(need))
            if "num_blocks" in grow:
                together = {"max_model_len": need, "num_blocks": grow["num_blocks"]}
    return fixes, together, room


def check_largest_image_fits(limits: ImageLimits, setting: str, cache: CacheConfig, sched: SchedulerConfig,
                             max_position_embeddings: int, args: EngineArgs) -> None:
    """Raise `UnfitImagesError` (or, with `args.allow_unfit_images`, log it as a warning) when the
    largest allowed image cannot fit in max_model_len."""
    if limits.tokens <= sched.max_model_len:
        return
    user_set = args.max_model_len is not None
    fixes, together, room = unfit_image_fixes(limits, setting, cache, sched.max_model_len, max_position_embeddings,
                                              user_set)
    where = (f"max_model_len={sched.max_model_len} ({sched.max_model_len_source})" if user_set else
             f"max_model_len={sched.max_model_len}, the KV cache's capacity ({cache.num_blocks} blocks x "
             f"{cache.block_size} tokens, {cache.source})")
    msg = (f"the largest image the image settings allow ({limits.text}: {limits.tokens} tokens) cannot fit in "
           f"{where}: every request with an image that large would be refused.")
    also = f" with {room} tokens left for a request's text and output"
    if fixes:
        msg += f" Any one of these settings makes it fit{also}: {fixes_text(fixes)}."
    if together:
        both = ", ".join(setting_text(k, v) for k, v in together.items())
        msg += f" {'So do these' if fixes else 'These do'} together: {both}."
    if not fixes and not together:
        msg += (f" No setting makes it fit: the model's max_position_embeddings is {max_position_embeddings} and no "
                f"smaller {setting} gives a smaller image.")
    if args.allow_unfit_images:
        logger.warning("%s Starting anyway (allow_unfit_images): images above %d tokens are refused per request.",
                       msg, sched.max_model_len)
        return
    msg += " Or set allow_unfit_images=True (--allow-unfit-images) to start anyway and refuse such images per request."
    raise UnfitImagesError(msg, limits.tokens, sched.max_model_len, fixes, together, param=setting)
