"""Does the model split over the ranks of a `ParallelConfig`? The check the executor runs before any rank
starts and the planner runs on config.json alone (`vlm-sdk plan`), so both refuse a layout with the same
words: the model is built on the meta device as rank 0 of that layout and every layer checks its own
split (under expert parallelism, the MoE layers their whole experts)."""
from __future__ import annotations

import dataclasses
import logging

import torch

from vlm_sdk.config import ParallelConfig
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.layers.parallel_state import ParallelGroups

_CANDIDATES = range(1, 17)  # the tensor-parallel sizes offered when one is refused


def _split_error(family, hf_config, parallel: ParallelConfig, shard_vision: bool) -> str | None:
    """Why the model cannot be split as `parallel` says (the layer's own words), or None when it can."""
    if parallel.world_size == 1:
        return None
    quiet = logging.getLogger("vlm_sdk.models")  # the ranks say it when they build the model for real
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        family.model_cls(hf_config, dtype=torch.float32, device="meta", parallel=ParallelGroups.first_rank(parallel),
                         shard_vision=shard_vision)
    except ValueError as e:
        return str(e)
    finally:
        quiet.setLevel(level)
    return None


def tensor_parallel_sizes(family, hf_config, parallel: ParallelConfig, shard_vision: bool,
                          limit: int | None = None) -> list[int]:
    """The tensor-parallel sizes from 1 to 16 (and at most `limit`) that split this model, the rest of
    `parallel` as it is."""
    return [n for n in _CANDIDATES if (limit is None or n <= limit) and _split_error(
        family, hf_config, dataclasses.replace(parallel, tensor_parallel_size=n), shard_vision) is None]


def check_pipeline(family, hf_config, parallel: ParallelConfig, shard_vision: bool = True) -> None:
    """Under pipeline parallelism: every stage's model builds (on the meta device, one tensor-parallel
    rank), else `InvalidRequestError` naming the stage and why (a family whose decoder runs no stages, a
    partition that does not fit the layers: vlm_sdk/pp_partition.py names the numbers)."""
    if parallel.pipeline_parallel_size == 1:
        return
    one_rank = dataclasses.replace(parallel, tensor_parallel_size=1)
    for stage in range(parallel.pipeline_parallel_size):
        try:
            family.model_cls(hf_config, dtype=torch.float32, device="meta",
                             parallel=ParallelGroups.of_stage(one_rank, stage), shard_vision=shard_vision)
        except ValueError as e:
            if isinstance(e, InvalidRequestError):
                raise
            raise InvalidRequestError(f"pipeline_parallel_size={parallel.pipeline_parallel_size} does not split "
                                      f"this model (stage {stage}): {e}", param="pipeline_parallel_size") from e


def check_tensor_parallel_size(family, hf_config, parallel: ParallelConfig, shard_vision: bool = True) -> None:
    """`InvalidRequestError` naming why `parallel.tensor_parallel_size` does not split the model and the
    sizes that do (the pipeline stages are checked apart: `check_pipeline`)."""
    check_pipeline(family, hf_config, parallel, shard_vision)
    parallel = dataclasses.replace(parallel, pipeline_parallel_size=1, pp_layer_partition=None)
    why = _split_error(family, hf_config, parallel, shard_vision)
    if why is None:
        return
    works = ", ".join(map(str, tensor_parallel_sizes(family, hf_config, parallel, shard_vision)))
    raise InvalidRequestError(f"tensor_parallel_size={parallel.tensor_parallel_size} does not split this model: "
                              f"{why}. Sizes that work: {works}", param="tensor_parallel_size")
