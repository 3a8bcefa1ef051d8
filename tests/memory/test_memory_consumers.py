"""The memory package's consumers: `vlm-sdk plan` and engine start-up count the same list, through the same
pipeline (vlm_sdk/memory/breakdown.py), and a new consumer is one class plus its place in `CONSUMERS`."""
from __future__ import annotations

import torch

from helpers import TESTS
from vlm_sdk import LLM
from vlm_sdk.config import EngineArgs
from vlm_sdk.memory import consumers
from vlm_sdk.memory.consumers import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs, memory_inputs
from vlm_sdk.memory.startup import size_rank_caches
from vlm_sdk.model_loader import read_checkpoint
from vlm_sdk.models.registry import resolve
from vlm_sdk.plan import plan
from vlm_sdk.plan.report import format_plan
from vlm_sdk.protocol.rank import RankLoad, WeightBytes

QWEN_3B = TESTS / "configs" / "qwen2_5_vl_3b.json"
GIB = 1 << 30


class AdapterBuffers(MemoryConsumer):
    """A consumer the engine does not have: step-time buffers of 1,000 hidden-wide rows per sequence."""
    name, title = "adapter_buffers", "adapter buffers (test)"

    def estimate(self, m: MemoryInputs) -> int:
        return m.args.max_num_seqs * 1000 * m.hidden_size * m.dtype_bytes


def _with_adapter(monkeypatch) -> None:
    monkeypatch.setattr(consumers, "CONSUMERS", consumers.CONSUMERS + (AdapterBuffers(),))


def test_a_new_consumer_in_one_class_shows_in_the_plan_and_shrinks_the_cache(monkeypatch):
    before = plan(QWEN_3B, device_memory="24GiB")
    _with_adapter(monkeypatch)
    after = plan(QWEN_3B, device_memory="24GiB")
    extra = 64 * 1000 * 2048 * 2  # max_num_seqs x 1000 x hidden x bf16
    assert after.consumer_bytes("adapter_buffers") == extra
    assert after.activation_peak_bytes - before.activation_peak_bytes == extra
    assert (before.num_blocks - after.num_blocks) * after.kv_bytes_per_block >= extra - after.kv_bytes_per_block
    assert after.num_blocks < before.num_blocks
    assert "adapter buffers (test)" in format_plan(after) and "adapter buffers" not in format_plan(before)
    assert {"name": "adapter_buffers", "title": "adapter buffers (test)", "kind": "activation", "bytes": extra,
            "measured": False} in after.to_dict()["consumers"]


def test_the_same_consumer_shows_in_the_start_up_report(monkeypatch, tiny_ckpt):
    _with_adapter(monkeypatch)
    llm = LLM(str(tiny_ckpt), device="cpu", show_progress=False)
    report = llm.memory_report
    names = [c.name for c in report.consumers]
    assert names == ["weights", "activation", "sampler", "encoder_cache", "adapter_buffers"]
    assert "adapter buffers (test)" in report.format()
    assert report.to_dict()["consumers"][-1]["name"] == "adapter_buffers"


def _inputs(ckpt, **settings) -> MemoryInputs:
    info = read_checkpoint(ckpt)
    family = resolve([info.architecture])
    args = EngineArgs(**settings)
    model = family.meta_model(info.hf_config, torch.bfloat16)
    return memory_inputs(family, info, args, model, torch.bfloat16, 1, on_gpu=True, decode_graphs=True,
                         piecewise_graphs=False)


def test_start_up_sizes_each_rank_from_its_measured_parts_plus_unmeasured_estimates(monkeypatch, tiny_ckpt):
    """The engine's GPU path without a GPU: a rank reports its device (total, in use) and the parts its
    profile measured; a consumer the profile has no part for counts its estimate in the budget."""
    _with_adapter(monkeypatch)
    m = _inputs(tiny_ckpt, memory_utilization=0.5)
    load = RankLoad(0, "cuda:0", "bfloat16", WeightBytes(GIB, 0, 0), GIB, 1.0, m.num_layers, m.num_kv_heads,
                    m.head_dim, 8192)
    profile = {"activation": 100 << 20, "sampler": 20 << 20, "decode_graph_pool": 5 << 20, "piecewise_graphs": 0}
    [rank] = size_rank_caches(m, [load], [profile], [(8 * GIB, 2 * GIB)], "max_pixels")
    adapter = AdapterBuffers().estimate(m)
    parts = {c.name: (c.bytes, c.measured) for c in rank.parts.consumers}
    assert parts["activation"] == (100 << 20, True) and parts["sampler"] == (20 << 20, True)
    assert parts["decode_graph_pool"] == (5 << 20, True) and parts["adapter_buffers"] == (adapter, False)
    budget = rank.cache.budget
    assert budget.activation_peak_bytes == (125 << 20) + adapter
    assert budget.encoder_cache_bytes == m.args.encoder_cache_memory
    assert rank.cache.num_blocks == (4 * GIB - 2 * GIB - budget.activation_peak_bytes - budget.encoder_cache_bytes) // 8192


def test_held_vision_counts_a_steps_reach_of_video_items(tiny_checkpoints):
    """A prefilling request holds its chunk's video items and one straddling each end of it
    (vlm_sdk/worker/step_images.py): the activation estimate holds that many rows when more than the
    largest image, never more than max_position_embeddings."""
    qwen = _inputs(tiny_checkpoints("qwen2_5_vl"), max_num_batched_tokens=2048)
    assert qwen.video_item_tokens == 768  # qwen-vl-utils' largest frame: one temporal patch
    assert qwen.held_vision_tokens == 2048 + 2 * 768 > qwen.image.tokens
    whole = _inputs(tiny_checkpoints("qwen2_5_vl"), max_num_batched_tokens=qwen.max_position_embeddings)
    assert whole.held_vision_tokens == qwen.max_position_embeddings  # a step of a whole sequence: no more
    internvl = _inputs(tiny_checkpoints("internvl"), max_num_batched_tokens=2048)
    one_tile = internvl.image.at(1)  # max_dynamic_patch 1: a single tile, no thumbnail
    assert "1 tiles" in one_tile.text and internvl.video_item_tokens == one_tile.tokens  # a frame is one tile
    assert internvl.held_vision_tokens == max(internvl.image.tokens, 2048 + 2 * one_tile.tokens)
