"""Does the model split into `tensor_parallel_size` ranks? The check the executor runs before any rank
starts and the planner runs on config.json alone (`vlm-sdk plan`), so both refuse a size with the same
words: the model is built on the meta device at that size and every layer checks its own split."""
from __future__ import annotations

import logging

import torch

from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.layers.parallel_state import TPGroup

_CANDIDATES = range(1, 17)  # the sizes offered when one is refused


def _split_error(family, hf_config, size: int, shard_vision: bool, expert_parallel: bool = False) -> str | None:
    """Why the model cannot be split into `size` ranks (the layer's own words), or None when it can:
    the model is built on the meta device at that size, so every layer checks its own split (under
    `expert_parallel`, the MoE layers their whole experts)."""
    if size == 1:
        return None
    quiet = logging.getLogger("vlm_sdk.models")  # the ranks say it when they build the model for real
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        family.model_cls(hf_config, dtype=torch.float32, device="meta",
                         tp=TPGroup(0, size, expert_parallel=expert_parallel), shard_vision=shard_vision)
    except ValueError as e:
        return str(e)
    finally:
        quiet.setLevel(level)
    return None


def tensor_parallel_sizes(family, hf_config, shard_vision: bool, limit: int | None = None,
                          expert_parallel: bool = False) -> list[int]:
    """The sizes from 1 to 16 (and at most `limit`) that split this model."""
    return [n for n in _CANDIDATES if (limit is None or n <= limit)
            and _split_error(family, hf_config, n, shard_vision, expert_parallel) is None]


def check_tensor_parallel_size(family, hf_config, size: int, shard_vision: bool = True,
                               expert_parallel: bool = False) -> None:
    """`InvalidRequestError` naming why `size` does not split the model and the sizes that do."""
    why = _split_error(family, hf_config, size, shard_vision, expert_parallel)
    if why is None:
        return
    works = ", ".join(map(str, tensor_parallel_sizes(family, hf_config, shard_vision, expert_parallel=expert_parallel)))
    raise InvalidRequestError(f"tensor_parallel_size={size} does not split this model: {why}. Sizes that work: "
                              f"{works}", param="tensor_parallel_size")
