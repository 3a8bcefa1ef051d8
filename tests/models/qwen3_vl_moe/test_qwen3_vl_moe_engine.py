"""Qwen3-VL-MoE through the engine against transformers' `generate`, for each expert layout (transformers
5's fused tensors; the published transposed ones with the published config.json; one tensor per expert):
the same greedy tokens for text, one image, two images and a multi-turn conversation, with chunked
prefill (13-token steps), preemption (a cache too small for the batch) and the prefix cache on (the
batch twice: the second run starts on cached blocks). The batch of the Triton kernel set (the fused MoE
kernel under the interpreter on the CPU) gives the torch set's tokens."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoTokenizer

from helpers import conversations
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.testing.reference import hf_batch, hf_greedy

STEPS = 10
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
LAYOUTS = {"fused": {}, "transposed": {"config_layout": "flat", "preprocessor_layout": "flat"},
           "per_expert": {"max_shard_size": "200KB"}}


@pytest.fixture(scope="module")
def expected(tiny_checkpoints):
    """transformers' greedy tokens on the fused checkpoint, per conversation (the same seed's weights are
    in every layout)."""
    ckpt = tiny_checkpoints("qwen3_vl_moe")
    ref = fixtures("qwen3_vl_moe").reference
    model, tokenizer = ref.hf_model(str(ckpt)), AutoTokenizer.from_pretrained(str(ckpt))
    image_processor = ref.hf_image_processor(str(ckpt))
    out = {}
    for name, conv in conversations().items():
        inputs = ref.hf_prompt(tokenizer, image_processor, model.config, conv)
        out[name] = (inputs["input_ids"][0].tolist(), hf_greedy(model, hf_batch([inputs], 0), STEPS)[0])
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_transformers_with_chunks_preemption_and_prefix_cache(expected, tmp_path, layout):
    ckpt = make_tiny_checkpoint(tmp_path, family="qwen3_vl_moe", experts=layout, **LAYOUTS[layout])
    names = list(conversations())
    longest = max(len(expected[n][0]) for n in names) + STEPS
    llm = LLM(ckpt, max_num_batched_tokens=13, num_blocks=-(-longest // 16) + 2, allow_unfit_images=True,
              enable_prefix_caching=True, show_progress=False)
    for run in range(2):
        outs = llm.chat([conversations()[n] for n in names], GREEDY)
        for name, out in zip(names, outs):
            assert (out.prompt_token_ids, out.token_ids) == expected[name], (run, name)
            assert len(set(out.token_ids)) > 3  # varied tokens: a real comparison
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def test_triton_kernel_set_gives_the_torch_sets_tokens(tiny_checkpoints, expected):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    llm = LLM(tiny_checkpoints("qwen3_vl_moe"), device="cpu", attention_backend="triton", num_blocks=64,
              show_progress=False)
    assert local_worker(llm.engine).ops.name == "triton"
    names = ["text", "two_images"]
    outs = llm.chat([conversations()[n] for n in names], SamplingParams(max_tokens=4, temperature=0.0,
                                                                        ignore_eos=True))
    assert [o.token_ids for o in outs] == [expected[n][1][:4] for n in names]
