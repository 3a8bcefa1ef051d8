"""Tensor parallelism through the engine on the CPU (gloo): tensor_parallel_size=2 gives the tokens of
one rank, for every family, under batching and preemption; the size is checked before any rank
starts; `plan --tp 2` equals the engine's per-rank figures; ranks hold no state after requests end."""
from __future__ import annotations

import re
import time

import pytest
import torch

from helpers import image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.executor.launch import rank_devices
from vlm_sdk.plan import plan
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.hooks import held_experts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# a cache small enough that a batch of eight prompts preempts even though prefix caching shares the
# prompts of its pairs (InternVL: one 256-token tile per image)
CACHE = {"qwen2_5_vl": {"num_blocks": 18}, "internvl": {"num_blocks": 60, "max_dynamic_patch": 1},
         "qwen3_vl": {"num_blocks": 18}, "qwen3_vl_moe": {"num_blocks": 18},
         "gemma3": {"num_blocks": 24},  # Gemma 3: a block is a page in each of its 3 groups' one tensor
         "qwen3_5": {"num_blocks": 18}, "qwen3_5_moe": {"num_blocks": 18}}


def _conversations() -> list:
    one = [{"role": "user", "content": [{"type": "image", "image": image(64, 48, 1)},
                                        {"type": "text", "text": "What is this?"}]}]
    two = [{"role": "user", "content": [{"type": "image", "image": image(56, 56, 2)},
                                        {"type": "text", "text": "and"},
                                        {"type": "image", "image": image(90, 40, 3)},
                                        {"type": "text", "text": "Compare them."}]}]
    text = [{"role": "user", "content": "Tell me about lakes."}]
    turns = [*one, {"role": "assistant", "content": "A red square."}, {"role": "user", "content": "Why red?"}]
    return [one, two, text, turns]


def test_two_ranks_give_the_tokens_of_one(family_ckpt):
    """Text, one image, two images and a multi-turn conversation, alone, batched with preemption, and
    seeded sampling; per-rank memory figures, which `plan --tp 2` predicts exactly."""
    family, ckpt = family_ckpt
    one = LLM(ckpt, show_progress=False, **CACHE[family])
    with LLM(ckpt, show_progress=False, tensor_parallel_size=2, **CACHE[family]) as two:
        convs = _conversations()
        for conv in convs:
            assert two.chat(conv, GREEDY)[0].token_ids == one.chat(conv, GREEDY)[0].token_ids
        batch = convs * 2
        params = [SamplingParams(max_tokens=24 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(batch))]
        assert [o.token_ids for o in two.chat(batch, params)] == [o.token_ids for o in one.chat(batch, params)]
        assert two.stats()["num_preemptions"] > 0, "the batch was meant to preempt"
        # every rank let go of every request and image
        assert two.engine.executor.collective_rpc("held_state") == [(0, 0), (0, 0)]
        assert two.stats()["kv_blocks_used"] == 0
        seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
        assert two.chat(convs[0], seeded)[0].token_ids == one.chat(convs[0], seeded)[0].token_ids

        report = two.memory_report
        num_blocks = CACHE[family]["num_blocks"]
        assert report.tensor_parallel_size == 2 and [r.rank for r in report.ranks] == [0, 1]
        assert all(r.num_blocks_possible == num_blocks for r in report.ranks)
        assert "rank 1" in report.format()
        # each rank holds half of the KV heads (2 -> 1) and about half of the weights
        assert report.kv_bytes_per_block * 2 == one.memory_report.kv_bytes_per_block
        assert report.weights_bytes < 0.7 * one.memory_report.weights_bytes
        planned = plan(ckpt, device=str(one.engine.device), tp=2, num_blocks=num_blocks)
        assert (planned.num_blocks, planned.kv_bytes_per_block, planned.weights_bytes) == \
            (report.num_blocks, report.kv_bytes_per_block, report.weights_bytes)


def test_expert_parallel_gives_the_tokens_of_one(tiny_checkpoints):
    """Qwen3-VL-MoE with enable_expert_parallel: two ranks of 6 whole experts (of 12) each, greedy tokens
    of one rank for an image, two images and text, batched; each rank's weights as `plan` counts them."""
    ckpt = tiny_checkpoints("qwen3_vl_moe")
    convs = _conversations()[:3]
    one = LLM(ckpt, show_progress=False, **CACHE["qwen3_vl_moe"])
    want = [o.token_ids for o in one.chat(convs, GREEDY)]
    with LLM(ckpt, show_progress=False, tensor_parallel_size=2, enable_expert_parallel=True,
             **CACHE["qwen3_vl_moe"]) as two:
        assert [o.token_ids for o in two.chat(convs, GREEDY)] == want
        # the sparse layers 0 and 2 of each rank hold its half of the experts
        assert two.engine.executor.collective_rpc(held_experts) == [[(0, 6)] * 2, [(6, 12)] * 2]
        planned = plan(ckpt, device="cpu", tp=2, num_blocks=18, enable_expert_parallel=True)
        assert planned.weights_bytes == two.memory_report.weights_bytes


def test_plan_matches_the_cpu_default_cache_per_rank(tiny_ckpt):
    """The CPU default cache is sized from the per-rank block bytes: plan --tp 2 gives the same count."""
    with LLM(tiny_ckpt, show_progress=False, tensor_parallel_size=2, max_model_len=512, max_num_seqs=4) as llm:
        engine_blocks = llm.engine.cache_config.num_blocks
        per_block = llm.memory_report.kv_bytes_per_block
    planned = plan(tiny_ckpt, tp=2, max_model_len=512, max_num_seqs=4, device="cpu")
    assert (planned.num_blocks, planned.kv_bytes_per_block) == (engine_blocks, per_block)


def test_structured_output_masks_reach_the_sampling_rank(tiny_ckpt):
    """The grammar bitmask travels in the step's plain data to every rank; rank 0 applies it."""
    regex = r"[a-z]{3}-[0-9]{2}"
    with LLM(tiny_ckpt, show_progress=False, tensor_parallel_size=2, max_model_len=256, max_num_seqs=4) as llm:
        outs = llm.chat([[{"role": "user", "content": "code?"}]] * 2,
                        [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_outputs={"regex": regex})
                         for s in range(2)])
    assert all(re.fullmatch(regex, o.text) and o.finish_reason == "stop" for o in outs)


def test_fewer_kv_heads_than_ranks(tmp_path):
    """One KV head on two ranks: each rank keeps a copy of it (vLLM's rule), tokens unchanged."""
    ckpt = make_tiny_checkpoint(tmp_path / "kv1", "qwen2_5_vl", num_kv_heads=1)
    conv = _conversations()[1]
    want = LLM(ckpt, show_progress=False).chat(conv, GREEDY)[0].token_ids
    with LLM(ckpt, show_progress=False, tensor_parallel_size=2) as two:
        assert two.memory_report.num_kv_heads == 1
        assert two.chat(conv, GREEDY)[0].token_ids == want


@pytest.mark.parametrize("llm_kind", ["internlm2", "llama"])
def test_internvl_llms_under_tensor_parallelism(llm_kind, internvl_internlm2_ckpt, internvl_llama_ckpt):
    """InternVL's other language models on two ranks: InternLM2 (its packed wqkv split per rank) and Llama."""
    ckpt = internvl_internlm2_ckpt if llm_kind == "internlm2" else internvl_llama_ckpt
    conv = _conversations()[3]
    want = LLM(ckpt, show_progress=False, max_dynamic_patch=1).chat(conv, GREEDY)[0].token_ids
    with LLM(ckpt, show_progress=False, max_dynamic_patch=1, tensor_parallel_size=2) as two:
        assert two.chat(conv, GREEDY)[0].token_ids == want


def test_replicated_vision_tower_gives_the_same_tokens(internvl_ckpt):
    conv = _conversations()[1]
    want = LLM(internvl_ckpt, show_progress=False).chat(conv, GREEDY)[0].token_ids
    with LLM(internvl_ckpt, show_progress=False, tensor_parallel_size=2, shard_vision=False) as two:
        assert two.memory_report.weights_vision_bytes > 0
        assert two.chat(conv, GREEDY)[0].token_ids == want


def test_a_start_up_refusal_on_every_rank_ends_every_rank_process(tiny_ckpt):
    """kv_cache_memory below one block: every rank refuses while sizing its cache; the user gets the
    refusal with its numbers (not a hang, not a rank's traceback) and no rank process is left."""
    import multiprocessing
    before = set(multiprocessing.active_children())
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"kv_cache_memory=100 bytes holds no KV block"):
        LLM(tiny_ckpt, show_progress=False, tensor_parallel_size=2, kv_cache_memory=100)
    assert time.monotonic() - t0 < 60
    assert [p for p in multiprocessing.active_children() if p not in before] == []


def test_a_size_that_does_not_split_the_heads_is_refused_before_any_rank_starts(tiny_ckpt):
    with pytest.raises(InvalidRequestError) as e:
        LLM(tiny_ckpt, show_progress=False, tensor_parallel_size=3)
    msg = str(e.value)
    assert "tensor_parallel_size=3" in msg and "(4) is not divisible" in msg and "Sizes that work: 1, 2" in msg
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=3"):
        plan(tiny_ckpt, device="cpu", tp=3)


def test_more_ranks_than_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(InvalidRequestError, match=r"needs 4 GPUs .* only 3 are visible.*sizes that work here: "
                                                  r"1, 2 \(at most 3\)"):
        rank_devices(torch.device("cuda"), 4, lambda limit: [n for n in (1, 2, 4) if n <= limit])
    assert rank_devices(torch.device("cuda:0"), 2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_devices(torch.device("cpu"), 2) == [torch.device("cpu")] * 2
