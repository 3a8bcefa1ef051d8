"""Checks before any rank starts: is there a device for every rank, and no process group yet? (Whether
the model splits into `tensor_parallel_size` parts is vlm_sdk/models/parallel_split.py's, which the
planner runs too.)"""
from __future__ import annotations

import torch

from vlm_sdk.errors import InvalidRequestError


def check_no_group_yet() -> None:
    """torch.distributed holds one default process group per process: one tensor-parallel engine at a time."""
    import torch.distributed as dist
    if dist.is_initialized():
        raise InvalidRequestError(
            "a tensor-parallel engine is already running in this process (torch.distributed holds one process "
            "group per process): shut it down first (LLM.shutdown(), or `with LLM(...)`), or run one engine "
            "per process", param="tensor_parallel_size")


def rank_devices(device: torch.device, size: int, sizes_that_split=None) -> list[torch.device]:
    """Rank r's device: on CUDA the GPU `index + r` of the one asked for (cuda = cuda:0), each rank its
    own; on the CPU every rank shares it. `sizes_that_split(limit)`: the sizes up to `limit` that split
    the model, named when there are too few GPUs."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + size > visible:
        fits = visible - first
        works = sizes_that_split(fits) if sizes_that_split is not None else list(range(1, fits + 1))
        raise InvalidRequestError(
            f"tensor_parallel_size={size} needs {size} GPUs (one per rank, from cuda:{first}) but only {visible} "
            f"are visible (CUDA_VISIBLE_DEVICES selects them): sizes that work here: "
            f"{', '.join(map(str, works)) or 'none'} (at most {fits}), or make more GPUs visible",
            param="tensor_parallel_size")
    return [torch.device("cuda", first + r) for r in range(size)]
