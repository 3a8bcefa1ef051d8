"""The Qwen3-VL vision tower against transformers' Qwen3VLVisionModel on the tiny checkpoint's weights:
the merged tokens and every DeepStack level within 1e-4 (float32), for grids smaller and larger than the
learned 8x8 position grid, several images in one call, and a two-frame grid; and on two CPU ranks
(sharded heads and widths) equal to one rank."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.common.qwen_vl.qwen3_vision import Qwen3VLVisionTransformer
from vlm_sdk.testing.distributed import run_on_ranks

# the tiny Qwen3-VL tower's chain (tests/tolerance.py): 1,536-input patches, 3 blocks of width 32 over at
# most 256 patches, a merger of inputs 128 + 128
TERMS = forward_terms(layers=0, hidden=0, intermediate=0, tokens=0, patch=1536, vision_layers=3, vision_hidden=32,
                      vision_intermediate=64, vision_tokens=256, merger=256)


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)
GRIDS = [(1, 8, 12), (1, 16, 8), (1, 2, 2), (2, 4, 6)]  # 8 > 2 and 16 > 8 patches per side: down- and upsampling
PREFIX = "model.visual."


def build_tower(ckpt, tp: TPGroup = TPGroup()) -> Qwen3VLVisionTransformer:
    from vlm_sdk.weight_loading import load_checked
    tower = Qwen3VLVisionTransformer(read_checkpoint(ckpt).hf_config.vision_config, tp=tp)
    weights = ((k, v) for k, v in iter_safetensors(ckpt, show_progress=False, lazy=tp.size > 1) if k.startswith(PREFIX))
    load_checked(tower, weights, tower.checkpoint_map(PREFIX))
    return tower.eval()


def pixels(grids, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16, generator=g)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_vl")


@pytest.fixture(scope="module")
def towers(ckpt):
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return hf.model.visual, build_tower(ckpt)


@pytest.mark.parametrize("grids", [GRIDS[:1], GRIDS[1:2], GRIDS[2:3], GRIDS], ids=["8x12", "16x8", "2x2", "all"])
def test_merged_tokens_and_deepstack_levels_equal_transformers(towers, grids):
    hf, ours = towers
    x = pixels(grids)
    with torch.no_grad():
        ref = hf(x, grid_thw=torch.tensor(grids))
        merged, levels = ours(x, grids)
    tokens = sum(t * h * w for t, h, w in grids) // 4
    assert merged.shape == (tokens, ours.out_hidden_size) and len(levels) == len(ref.deepstack_features) == 2
    close(merged, ref.pooler_output)
    for mine, theirs in zip(levels, ref.deepstack_features):
        close(mine, theirs)
    assert not torch.allclose(levels[0], levels[1], atol=1e-2)  # distinct levels: a real comparison


def test_bad_pixels_and_configs_are_refused(ckpt, towers):
    _, ours = towers
    with pytest.raises(ValueError, match=r"need \[96, 1536\]"):
        ours(pixels([(1, 8, 12)])[:-1], [(1, 8, 12)])
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(pixels([(1, 3, 4)]), [(1, 3, 4)])
    vc = read_checkpoint(ckpt).hf_config.vision_config
    for field, value, words in (("num_position_embeddings", 60, "not a square"),
                                ("deepstack_visual_indexes", [0, 3], "distinct vision blocks 0..2"),
                                ("deepstack_visual_indexes", [1, 1], "distinct vision blocks 0..2"),
                                ("hidden_act", "swish", "hidden_act 'swish'")):
        bad = type(vc)(**{**vc.to_dict(), field: value})
        with pytest.raises(CheckpointError, match=words):
            Qwen3VLVisionTransformer(bad, device="meta")


def rank_outputs(tp: TPGroup, ckpt) -> dict:
    tower = build_tower(ckpt, tp)
    with torch.no_grad():
        merged, levels = tower(pixels(GRIDS), GRIDS)
    return {"merged": merged, "levels": levels, "heads": tower.blocks[0].heads,
            "fc1_rows": tower.projector.deepstack[0].fc1.weight.shape[0]}


def test_two_ranks_equal_one_rank(ckpt, towers):
    _, ours = towers
    with torch.no_grad():
        merged, levels = ours(pixels(GRIDS), GRIDS)
    for r in run_on_ranks(rank_outputs, 2, ckpt, timeout_s=300):
        assert r["heads"] == 1 and r["fc1_rows"] == ours.projector.deepstack[0].fc1.weight.shape[0] // 2
        close(r["merged"], merged)
        for mine, one in zip(r["levels"], levels):
            close(mine, one)
