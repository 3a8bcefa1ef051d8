"""Qwen3-VL-MoE under tensor parallelism: each expert split along its width (moe_intermediate_size / 2 per
rank of two). Two gloo ranks' prefill logits of an image prompt equal one rank's within the rounding of
another summation order, for the published layout (transposed fused experts) and one tensor per expert;
each rank's lazily read expert slices are the one-rank weights' slices; a size that does not split the
experts' width is refused before any rank starts, naming the sizes that work. The same with expert
parallelism: whole experts per rank, the same logits; a number of experts that does not split is refused. (Tokens through the
engine at tensor_parallel_size=2: tests/e2e/test_tensor_parallel.py, every family.)"""
from __future__ import annotations

import copy

import pytest
import torch

from qwen3_vl_steps import tp_prefill
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.config import ParallelConfig
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.models.parallel_split import check_tensor_parallel_size
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.registry import load
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.distributed import run_on_ranks

# the tiny model's prefill chain (tests/tolerance.py), as Qwen3-VL's: its longest MLP is the dense layer's
TERMS = forward_terms(layers=3, hidden=48, intermediate=128, tokens=128, head_dim=16, patch=1536, vision_layers=3,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=64, merger=256)
LAYOUTS = {"transposed": {"config_layout": "flat"}, "per_expert": {}}
E, I, H = 12, 32, 48


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {name: make_tiny_checkpoint(tmp_path_factory.mktemp(f"moe_tp_{name}"), family="qwen3_vl_moe",
                                       experts=name, **kw) for name, kw in LAYOUTS.items()}


def rank_main(tp: TPGroup, paths: dict) -> dict:
    """Each layout's logits with every expert split (`name`) and with whole experts per rank (`name-ep`)."""
    out = {name: tp_prefill(path, tp, True)["logits"] for name, path in paths.items()}
    return out | {f"{name}-ep": tp_prefill(path, tp, True, expert_parallel=True)["logits"]
                  for name, path in paths.items()}


def test_two_ranks_equal_one_rank(checkpoints):
    """Both ways of placing the experts: each expert split along its width, and expert parallel (rank r
    holds experts [6r, 6r + 6) whole, computes only their pairs; one all-reduce sums the ranks)."""
    one = {name: tp_prefill(path, TPGroup(), True)["logits"] for name, path in checkpoints.items()}
    torch.testing.assert_close(one["per_expert"], one["transposed"], atol=0, rtol=0)  # same weights
    for ranks in run_on_ranks(rank_main, 2, checkpoints, timeout_s=600):
        for name in LAYOUTS:
            assert_reduction_close(ranks[name], one[name], TERMS, msg=name)
            assert_reduction_close(ranks[f"{name}-ep"], one[name], TERMS, msg=f"{name}, expert parallel")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_its_slice_of_every_expert(checkpoints, layout):
    """Loaded lazily as a rank does (no process group is needed to load): rank r's gate and up rows and
    down columns of expert e are [r*I/2, (r+1)*I/2) of the one-rank model's."""
    ckpt = checkpoints[layout]
    cfg = read_checkpoint(ckpt).hf_config
    model_cls = load("qwen3_vl_moe").model_cls
    whole = model_cls(cfg)
    whole.load_weights(iter_safetensors(ckpt, show_progress=False), source=ckpt)
    half = I // 2
    for r in range(2):
        rank = model_cls(cfg, parallel=ParallelGroups(TPGroup(r, 2)))
        rank.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=True), source=ckpt)
        for i in (0, 2):  # the sparse layers
            ours, full = rank.decoder.layers[i].moe, whole.decoder.layers[i].moe
            w13, w13_full = ours.w13.view(E, 2, half, H), full.w13.view(E, 2, 2, half, H)  # [e, gate|up, (rank,) I/2, H]
            assert torch.equal(w13, w13_full[:, :, r])
            assert torch.equal(ours.w2.view(E, H, half), full.w2.view(E, H, 2, half)[:, :, r])
            assert torch.equal(ours.gate.weight, full.gate.weight)  # the router is whole on every rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_ranks_read_whole_experts(checkpoints, layout):
    """Expert parallel, loaded lazily: rank r holds experts [6r, 6r + 6) whole, the one-rank model's rows
    of them (none of the other rank's tensors is placed), and the whole router."""
    ckpt = checkpoints[layout]
    cfg = read_checkpoint(ckpt).hf_config
    model_cls = load("qwen3_vl_moe").model_cls
    whole = model_cls(cfg)
    whole.load_weights(iter_safetensors(ckpt, show_progress=False), source=ckpt)
    for r in range(2):
        rank = model_cls(cfg, parallel=ParallelGroups(TPGroup(r, 2), expert_parallel=True))
        rank.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=True), source=ckpt)
        for i in (0, 2):  # the sparse layers
            ours, full = rank.decoder.layers[i].moe, whole.decoder.layers[i].moe
            held = slice(6 * r, 6 * r + 6)
            assert list(ours.expert_range()) == list(range(12))[held]
            for mine, theirs in zip(ours.experts(), full.experts()):  # [6, ...] of [12, ...]
                assert torch.equal(mine, theirs[held])
            assert torch.equal(ours.gate.weight, full.gate.weight)


def test_sizes_that_do_not_split_the_experts_are_refused(checkpoints):
    cfg = copy.deepcopy(read_checkpoint(checkpoints["per_expert"]).hf_config)
    cfg.text_config.moe_intermediate_size = 30  # splits in 2, not in 4 (which splits the heads)
    family = load("qwen3_vl_moe")
    check_tensor_parallel_size(family, cfg, ParallelConfig(2))
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=4 does not split this model: "
                                                  r"moe_intermediate_size .*\(30\).*Sizes that work: 1, 2$"):
        check_tensor_parallel_size(family, cfg, ParallelConfig(4))
    cfg.text_config.moe_intermediate_size = I
    cfg.text_config.num_experts = 10  # whole experts: 2 ranks of 5, not 4
    check_tensor_parallel_size(family, cfg, ParallelConfig(4))
    check_tensor_parallel_size(family, cfg, ParallelConfig(2, enable_expert_parallel=True))
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=4 does not split this model: num_experts "
                                                  r"\(whole experts per rank under expert parallelism\) \(10\) is not "
                                                  r"divisible by the tensor-parallel size 4\. Sizes that work: 1, 2$"):
        check_tensor_parallel_size(family, cfg, ParallelConfig(4, enable_expert_parallel=True))
