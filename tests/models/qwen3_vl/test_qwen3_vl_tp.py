"""Qwen3-VL under tensor parallelism on two CPU ranks over gloo: prefill logits of an image prompt (the
vision tower and its DeepStack mergers sharded or replicated, q/k norm per head on each rank's heads, the
DeepStack features added on every rank) equal the one-rank model's within the rounding of another summation order; each rank reads only its
slices (`lazy=True`). The one-rank model equals transformers (test_qwen3_vl_model.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import image
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.config import EngineArgs
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.model_loader import iter_safetensors, load_tokenizer, read_checkpoint
from vlm_sdk.models.base import StepImages
from vlm_sdk.models.registry import load
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.distributed import run_on_ranks

BLOCK = 16
# The tiny Qwen3-VL's prefill chain (tests/tolerance.py): 1,536-input patches, 3 blocks of width 32 over at
# most 64 patches, mergers of inputs 128 + 128, 3 layers of width 48, MLP 128, head_dim 16, <= 128 tokens.
TERMS = forward_terms(layers=3, hidden=48, intermediate=128, tokens=128, head_dim=16, patch=1536, vision_layers=3,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=64, merger=256)
CASES = {"sharded_vision": True, "replicated_vision": False}  # name -> shard_vision


def prompt_of(ckpt):
    info = read_checkpoint(ckpt)
    fam = load("qwen3_vl")
    ip = fam.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    conv = [{"role": "user", "content": [{"type": "image", "image": image(160, 96, 4)},
                                         {"type": "text", "text": "What is in this image?"}]}]
    return fam.make_processor(load_tokenizer(ckpt), ip, info.hf_config, EngineArgs())(conv)


@torch.no_grad()
def prefill(ckpt, tp: TPGroup, shard_vision: bool) -> dict:
    info = read_checkpoint(ckpt)
    model = load("qwen3_vl").model_cls(info.hf_config, tp=tp, shard_vision=shard_vision)
    model.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=tp.size > 1), source=ckpt)
    prompt = prompt_of(ckpt)
    n = len(prompt.token_ids)
    rows = torch.cat([torch.arange(p, p + im.num_tokens) for p, im in zip(prompt.image_positions, prompt.images)])
    images = StepImages(rows, model.encode_images(prompt.images))  # [n, hidden * 3]
    blocks = -(-n // BLOCK)
    shape = (blocks, BLOCK, model.num_kv_heads, model.head_dim)  # this rank's KV heads
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n)
    meta = model.decoder.ops.attention.prepare(meta, caches[0][0])
    hidden = model(model.embed_tokens(torch.tensor(prompt.token_ids)), model.positions(prompt.positions, 0, n),
                   caches, meta, images)
    return {"logits": model.compute_logits(hidden), "num_kv_heads": model.num_kv_heads,
            "vision_heads": model.visual.blocks[0].heads, "images": images.embeds}


def rank_main(tp: TPGroup, ckpt) -> dict:
    return {name: prefill(ckpt, tp, shard) for name, shard in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_tp"), family="qwen3_vl")
    one = prefill(ckpt, TPGroup(), True)
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
