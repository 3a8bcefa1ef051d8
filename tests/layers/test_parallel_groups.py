"""The parallel layout as one value: `ParallelConfig` (the sizes, decided once from EngineArgs and carried
in RankConfig) and `ParallelGroups` (one rank's tp / pp / ep groups, handed by the executor to the worker
and by the worker to the model's constructor)."""
from __future__ import annotations

import dataclasses

import pytest

from vlm_sdk.config import EngineArgs, ParallelConfig, resolve_rank_config
from vlm_sdk.layers.moe import MoeConfig, SparseMoeBlock
from vlm_sdk.layers.ops import TorchOps
from vlm_sdk.layers.parallel_state import ParallelGroups, PPGroup, TPGroup


def test_the_engine_args_layout_reaches_the_rank_config():
    args = EngineArgs(tensor_parallel_size=2, enable_expert_parallel=True, device="cpu")
    assert args.parallel_config() == ParallelConfig(2, 1, True)
    assert resolve_rank_config(args).parallel == ParallelConfig(2, 1, True)
    assert resolve_rank_config(EngineArgs(device="cpu")).parallel.world_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelConfig().tensor_parallel_size = 2


def test_pipeline_stages_in_the_layout():
    assert ParallelConfig(4).world_size == 4
    assert ParallelConfig(2, pipeline_parallel_size=2).world_size == 4
    with pytest.raises(ValueError, match="tensor_parallel_size 0 and pipeline_parallel_size 1 must be >= 1"):
        ParallelConfig(0)
    assert PPGroup(1, 2, partition=(3, 5)).layer_range(8) == (3, 8) and PPGroup().layer_range(8) == (0, 8)
    assert ParallelGroups.of_stage(ParallelConfig(2, 2), 1).pp == PPGroup(1, 2)
    assert PPGroup().is_first and PPGroup().is_last
    assert not PPGroup(0, 2).is_last and PPGroup(1, 2).is_last
    with pytest.raises(ValueError, match="pipeline stage 2 of 2"):
        PPGroup(2, 2)


def test_expert_parallel_spreads_experts_over_the_tensor_parallel_ranks():
    tp = TPGroup(1, 4)
    assert ParallelGroups(tp, expert_parallel=True).ep == tp
    assert ParallelGroups(tp).ep == TPGroup()  # every expert split by width over tp instead
    assert ParallelGroups(TPGroup(), expert_parallel=True).ep == TPGroup()  # one rank: nothing to spread
    assert ParallelGroups(tp).rank == 1 and ParallelGroups(tp).world_size == 4


def test_first_rank_is_what_the_planner_and_the_split_check_build():
    groups = ParallelGroups.first_rank(ParallelConfig(8, enable_expert_parallel=True))
    assert groups == ParallelGroups(TPGroup(0, 8), PPGroup(0, 1), expert_parallel=True)
    assert groups.tp.group is None and not groups.tp.communicates  # meta builds talk to no one


def test_moe_experts_follow_ep():
    moe = MoeConfig(8, 2, 16)
    split = SparseMoeBlock(12, moe, TorchOps(), device="meta", tp=TPGroup(1, 2))
    assert (split.expert_parallel, split.local_experts, split.local_intermediate) == (False, 8, 8)
    whole = SparseMoeBlock(12, moe, TorchOps(), device="meta", tp=TPGroup(1, 2), ep=TPGroup(1, 2))
    assert (whole.expert_parallel, whole.local_experts, whole.local_intermediate) == (True, 4, 16)
    assert list(whole.expert_range()) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="expert-parallel rank 0 of 2 must be the tensor-parallel rank 1 of 2"):
        SparseMoeBlock(12, moe, TorchOps(), device="meta", tp=TPGroup(1, 2), ep=TPGroup(0, 2))


def test_the_model_is_built_with_the_layouts_groups():
    """What the planner builds (rank 0 of the layout, on the meta device) holds the groups it was given:
    Qwen3-VL-30B-A3B's 128 experts whole, 64 a rank, at tp 2 with expert parallelism."""
    from pathlib import Path

    import torch

    from vlm_sdk.model_loader import read_config
    from vlm_sdk.models import registry
    info = read_config(Path(__file__).parents[1] / "configs" / "qwen3_vl_30b_a3b.json")
    family = registry.resolve([info.architecture])
    layout = ParallelConfig(2, enable_expert_parallel=True)
    model = family.meta_model(info.hf_config, torch.bfloat16, layout)
    assert model.parallel == ParallelGroups.first_rank(layout) and model.tp == TPGroup(0, 2)
    blocks = [layer.moe for layer in model.decoder.layers if layer.moe is not None]
    assert blocks and all(b.expert_parallel and b.local_experts == 64 for b in blocks)
