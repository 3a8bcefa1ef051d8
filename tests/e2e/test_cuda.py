"""The CUDA path: run with `pytest -m cuda` on a machine with a GPU (skipped elsewhere)."""
import pytest
import torch

from helpers import conversations, internvl_conversations
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.config import DEFAULT_ENCODER_CACHE_MEMORY

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
    convs = list(internvl_conversations().values())
    cpu = LLM(internvl_ckpt, device="cpu", show_progress=False).chat(convs, GREEDY)
    gpu = LLM(internvl_ckpt, device="cuda", dtype="float32", num_blocks=512, show_progress=False).chat(convs, GREEDY)
    assert sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu)) >= len(convs) - 1
    # the memory profile runs the largest image (max_num tiles + thumbnail) through the vision tower
    sized = LLM(internvl_ckpt, device="cuda", memory_utilization=0.3, show_progress=False)
    assert local_worker(sized.engine).runner.max_vision_patches == 7
    assert all(len(o.token_ids) >= 1 for o in sized.chat(convs, GREEDY))
    assert sized.stats()["kv_blocks_used"] == 0


def test_plan_agrees_with_engine_within_3_percent_and_report_is_measured(tiny_ckpt):
    import gc

    from vlm_sdk.plan import plan
    gc.collect()
    torch.cuda.empty_cache()
    options = dict(memory_utilization=0.3, max_num_batched_tokens=2048, max_num_seqs=16)
    planned = plan(tiny_ckpt, device="cuda", **options)
    llm = LLM(tiny_ckpt, device="cuda", show_progress=False, **options)
    r = llm.memory_report
    assert abs(planned.num_blocks - r.num_blocks) <= 0.03 * r.num_blocks, (planned.num_blocks, r.num_blocks)
    assert r.activation_peak_bytes is not None and r.activation_peak_bytes > 0
    assert r.weights_allocated_bytes >= r.weights_bytes  # allocator rounding only adds
    assert r.device_memory_bytes == torch.cuda.mem_get_info()[1]
    assert planned.weights_bytes == r.weights_bytes and planned.kv_bytes_per_block == r.kv_bytes_per_block
    # both set the encoder cache aside before sizing the KV cache
    assert planned.encoder_cache_bytes == r.encoder_cache_bytes == DEFAULT_ENCODER_CACHE_MEMORY
    assert "set aside from the memory_utilization budget" in r.format()



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_two_gpus_with_cuda_graphs_give_the_tokens_of_one(tiny_ckpt):
    """NCCL between two GPUs; decode steps replay CUDA graphs that captured the all-reduces."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    convs = list(conversations().values())
    want = [o.token_ids for o in LLM(tiny_ckpt, device="cuda", dtype="float32", show_progress=False).chat(convs, params)]
    with LLM(tiny_ckpt, device="cuda", dtype="float32", show_progress=False, tensor_parallel_size=2) as two:
        assert local_worker(two.engine).runner.graphs is not None
        assert [o.token_ids for o in two.chat(convs, params)] == want
        assert [r.device for r in two.memory_report.ranks] == ["cuda:0", "cuda:1"]


def test_async_scheduling_on_cuda_graphs_gives_the_synchronous_tokens(tiny_ckpt):
    """On by default on CUDA: decode steps replay graphs that take their ids from the device while the
    host schedules the next step; tokens (greedy, seeded, logprobs) equal the synchronous engine's."""
    convs = list(conversations().values()) * 3
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=9, logprobs=2)] * 6
    sync = LLM(tiny_ckpt, device="cuda", dtype="float32", num_blocks=512, async_scheduling=False,
               show_progress=False).chat(convs, params)
    llm = LLM(tiny_ckpt, device="cuda", dtype="float32", num_blocks=512, show_progress=False)
    assert llm.engine.async_scheduling and local_worker(llm.engine).runner.graphs is not None
    outs = llm.chat(convs, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert llm.stats()["kv_blocks_used"] == 0 and llm.engine.executor.collective_rpc("held_state")[0] == (0, 0)
