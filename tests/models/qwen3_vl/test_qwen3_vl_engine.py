"""Qwen3-VL through the engine on the Triton kernel set (q/k norm fused into the in-kernel rotary,
interleaved M-RoPE, paged prefill and decode attention, varlen vision attention) against the torch
reference set: the same greedy tokens for a batch of a text and a two-image conversation. On the CPU
the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1): few tokens."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import conversations
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_triton_greedy_equals_torch(tiny_checkpoints):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    ckpt = tiny_checkpoints("qwen3_vl")
    convs = [conversations()["text"], conversations()["two_images"]]
    reference = LLM(ckpt, device="cpu", attention_backend="torch", show_progress=False)
    want = [o.token_ids for o in reference.chat(convs, GREEDY)]
    triton = LLM(ckpt, device="cpu", attention_backend="triton", num_blocks=64, show_progress=False)
    assert local_worker(triton.engine).ops.name == "triton"
    assert [o.token_ids for o in triton.chat(convs, GREEDY)] == want
    assert triton.stats()["kv_blocks_used"] == 0
