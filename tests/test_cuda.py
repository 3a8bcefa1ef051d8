"""The CUDA path: run with `pytest -m cuda` on a machine with a GPU (skipped elsewhere)."""
import pytest
import torch

from helpers import conversations
from vlm_sdk import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def test_float32_cuda_greedy_equals_cpu(tiny_ckpt):
    convs = list(conversations().values())
    cpu = LLM(tiny_ckpt, device="cpu", show_progress=False).chat(convs, GREEDY)
    gpu = LLM(tiny_ckpt, device="cuda", dtype="float32", num_blocks=256, show_progress=False).chat(convs, GREEDY)
    same = sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu))
    assert same >= len(convs) - 1  # float32 kernels differ in summation order; near-ties may flip one


def test_memory_utilization_sizes_cache_and_runs_bf16(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cuda", memory_utilization=0.3, show_progress=False)
    stats = llm.stats()
    free, total = torch.cuda.mem_get_info()
    assert stats["kv_blocks_total"] > 0
    assert stats["kv_blocks_total"] * stats["kv_bytes_per_block"] <= 0.3 * total
    outs = llm.chat(list(conversations().values()), GREEDY)
    assert all(len(o.token_ids) >= 1 for o in outs)
    assert llm.stats()["kv_blocks_used"] == 0


def test_internvl_cuda_greedy_equals_cpu_and_profiles(internvl_ckpt):
    from test_internvl_model import conversations as internvl_conversations
    convs = list(internvl_conversations().values())
    cpu = LLM(internvl_ckpt, device="cpu", show_progress=False).chat(convs, GREEDY)
    gpu = LLM(internvl_ckpt, device="cuda", dtype="float32", num_blocks=512, show_progress=False).chat(convs, GREEDY)
    assert sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu)) >= len(convs) - 1
    # the memory profile runs the largest image (max_num tiles + thumbnail) through the vision tower
    sized = LLM(internvl_ckpt, device="cuda", memory_utilization=0.3, show_progress=False)
    assert sized.engine.runner.max_vision_patches == 7
    assert all(len(o.token_ids) >= 1 for o in sized.chat(convs, GREEDY))
    assert sized.stats()["kv_blocks_used"] == 0
