"""Qwen3-VL under tensor parallelism on two CPU ranks over gloo: prefill logits of an image prompt (the
vision tower and its DeepStack mergers sharded or replicated, q/k norm per head on each rank's heads, the
DeepStack features added on every rank) equal the one-rank model's within the rounding of another summation order; each rank reads only its
slices (`lazy=True`). The one-rank model equals transformers (test_qwen3_vl_model.py)."""
from __future__ import annotations

import pytest
import torch

from qwen3_vl_steps import tp_prefill
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.distributed import run_on_ranks

# The tiny Qwen3-VL's prefill chain (tests/tolerance.py): 1,536-input patches, 3 blocks of width 32 over at
# most 64 patches, mergers of inputs 128 + 128, 3 layers of width 48, MLP 128, head_dim 16, <= 128 tokens.
TERMS = forward_terms(layers=3, hidden=48, intermediate=128, tokens=128, head_dim=16, patch=1536, vision_layers=3,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=64, merger=256)
CASES = {"sharded_vision": True, "replicated_vision": False}  # name -> shard_vision


def rank_main(tp: TPGroup, ckpt) -> dict:
    return {name: tp_prefill(ckpt, tp, shard) for name, shard in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_tp"), family="qwen3_vl")
    one = tp_prefill(ckpt, TPGroup(), True)
    return one, run_on_ranks(rank_main, 2, ckpt, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank(results, name):
    one, ranks = results
    assert one["num_kv_heads"] == 2 and one["images"].shape[1] == 48 * 3  # hidden * (1 + 2 DeepStack levels)
    for r in ranks:
        got = r[name]
        assert got["num_kv_heads"] == 1 and got["vision_heads"] == (1 if CASES[name] else 2)
        assert_reduction_close(got["images"], one["images"], TERMS)
        assert_reduction_close(got["logits"], one["logits"], TERMS)
