"""`plan()` from config.json alone: KV arithmetic on published configs, the LMDeploy seed, and agreement
with the engine on the tiny checkpoint (CPU)."""
import json

import pytest
import torch

from helpers import TESTS
from vlm_sdk.cli import main
from vlm_sdk.errors import InvalidRequestError, UnknownArgumentError
from vlm_sdk.plan import plan

CONFIGS = TESTS / "configs"
MIB = 1 << 20


@pytest.mark.parametrize("name, layers, kv_heads, per_token", [
    ("qwen2_5_vl_3b", 36, 2, 36_864), ("qwen2_5_vl_7b", 28, 4, 57_344),
    ("internvl2_8b", 32, 8, 131_072), ("internvl3_8b_hf", 28, 4, 57_344)])
def test_kv_bytes_of_published_configs(name, layers, kv_heads, per_token):
    p = plan(CONFIGS / f"{name}.json", dtype="bfloat16", device_memory="80GiB", num_blocks=10)
    assert (p.num_layers, p.num_kv_heads, p.head_dim) == (layers, kv_heads, 128)
    assert p.kv_bytes_per_token == per_token == layers * 2 * kv_heads * 128 * 2
    assert p.kv_bytes_per_block == per_token * 16
    half = plan(CONFIGS / f"{name}.json", dtype="bfloat16", device_memory="80GiB", num_blocks=10, tp=2)
    assert half.kv_bytes_per_token * 2 == per_token and half.num_kv_heads * 2 == kv_heads
    assert half.weights_language_model_bytes < p.weights_language_model_bytes


def test_internvl2_8b_block_and_weights():
    p = plan(CONFIGS / "internvl2_8b.json", dtype="bfloat16", device_memory="80GiB", block_size=64, num_blocks=1)
    assert p.kv_bytes_per_block == 8_388_608
    assert 7.9e9 < p.weights_bytes / 2 < 8.2e9  # ~8.1B parameters in bf16
    assert p.image_tokens_per_image == 13 * 256  # max_dynamic_patch 12 + thumbnail


def test_weights_of_qwen_3b_and_7b():
    assert 3.6e9 < plan(CONFIGS / "qwen2_5_vl_3b.json", dtype="bfloat16", device_memory="80GiB", num_blocks=1).weights_bytes / 2 < 3.9e9
    assert 8.1e9 < plan(CONFIGS / "qwen2_5_vl_7b.json", dtype="bfloat16", device_memory="80GiB", num_blocks=1).weights_bytes / 2 < 8.4e9


def test_tp_must_split_the_heads():
    """16 query heads, 2 KV heads: 3 ranks are refused with the sizes that work; 4 ranks each keep a
    copy of one KV head (as vLLM does), so the per-rank KV bytes halve from tp=2 to tp=4 no more."""
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=3 .*attention heads \(16\) .*"
                                                  r"Sizes that work: 1, 2, 4, 8, 16"):
        plan(CONFIGS / "qwen2_5_vl_3b.json", dtype="bfloat16", device_memory="80GiB", num_blocks=1, tp=3)
    per_rank = {tp: plan(CONFIGS / "qwen2_5_vl_3b.json", dtype="bfloat16", device_memory="80GiB", num_blocks=1, tp=tp) for tp in (1, 2, 4)}
    assert per_rank[2].kv_bytes_per_block * 2 == per_rank[1].kv_bytes_per_block
    assert per_rank[4].kv_bytes_per_block == per_rank[2].kv_bytes_per_block
    assert per_rank[4].weights_bytes < per_rank[2].weights_bytes < per_rank[1].weights_bytes
    with pytest.raises(UnknownArgumentError):
        plan(CONFIGS / "qwen2_5_vl_3b.json", num_blokcs=1)
    with pytest.raises(UnknownArgumentError, match="max_num: use max_dynamic_patch"):
        plan(CONFIGS / "internvl2_8b.json", device_memory="80GiB", max_num=4)


def test_lmdeploy_seed_scenario():
    budget = int((6784 - 5061) * MIB * 0.1)
    p = plan(CONFIGS / "internvl2_8b.json", dtype="bfloat16", device_memory="24GiB", block_size=64,
             kv_cache_memory=budget, prompt_tokens=118, images=1, output_tokens=0)
    assert (p.num_blocks, p.capacity_tokens) == (21, 1344)
    assert p.request_tokens == 3446 and p.max_concurrent_requests == 0
    # 13 tiles (3328 tokens) do not fit 1344 tokens alone; max_dynamic_patch 4 (4 tiles + thumbnail) does
    assert (p.image_tokens_per_image, p.largest_fitting_image_tokens) == (3328, 1280)
    assert "max_dynamic_patch 4" in p.largest_fitting_image
    [problem] = [pr for pr in p.problems if "3446" in pr.message]
    assert problem.fixes["num_blocks"] >= 54
    assert problem.fixes["kv_cache_memory"] == problem.fixes["num_blocks"] * 8_388_608
    fixed = plan(CONFIGS / "internvl2_8b.json", dtype="bfloat16", device_memory="24GiB", block_size=64,
                 kv_cache_memory=problem.fixes["kv_cache_memory"], prompt_tokens=3446)
    assert fixed.num_blocks >= 54 and fixed.max_concurrent_requests == 1 and not fixed.problems


def test_max_model_len_above_capacity_names_fixes():
    p = plan(CONFIGS / "qwen2_5_vl_7b.json", dtype="bfloat16", device_memory="20GiB", max_model_len=32768)
    [problem] = [pr for pr in p.problems if "capacity" in pr.message]
    assert problem.fixes["max_model_len"] == p.capacity_tokens < 32768
    u = problem.fixes["memory_utilization"]
    assert p.memory_utilization < u <= 1
    assert plan(CONFIGS / "qwen2_5_vl_7b.json", dtype="bfloat16", device_memory="20GiB", max_model_len=32768,
                memory_utilization=u).capacity_tokens >= 32768


def test_transformers_layout_directory(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "internvl3_8b_hf.json").read_text())
    p = plan(tmp_path, dtype="bfloat16", device_memory="80GiB", block_size=64)
    assert p.kv_bytes_per_token == 57_344 and p.num_blocks > 0 and p.family == "internvl"


@pytest.mark.parametrize("options", [{}, {"kv_cache_memory": 300_000}, {"max_model_len": 128, "max_num_seqs": 3}])
def test_plan_matches_engine_on_cpu(tiny_ckpt, options):
    from vlm_sdk import LLM
    # allow_unfit_images: max_model_len=128 is below the largest image (issue 20: the engine refuses it)
    engine = LLM(str(tiny_ckpt), device="cpu", show_progress=False, allow_unfit_images=True, **options)
    p = plan(tiny_ckpt, device="cpu", **options)
    assert p.num_blocks == engine.stats()["kv_blocks_total"]
    assert p.kv_bytes_per_block == engine.stats()["kv_bytes_per_block"]


def test_cli_json_and_table(capsys):
    assert main(["plan", str(CONFIGS / "qwen2_5_vl_3b.json"), "--dtype", "bf16", "--device-memory", "80GiB",
                 "--prompt-tokens", "200", "--images", "1", "--output-tokens", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("kv_bytes_per_token", "kv_bytes_per_block", "num_blocks", "capacity_tokens", "weights_bytes",
                "activation_peak_bytes", "max_concurrent_requests", "problems"):
        assert key in out
    assert out["kv_bytes_per_token"] == 36_864 and out["max_concurrent_requests"] == 64
    assert out["problems"] == [] and out["notes"] == [] and out["largest_fitting_image_tokens"] > 0
    assert main(["plan", str(CONFIGS / "internvl2_8b.json"), "--dtype", "bf16", "--block-size", "64",
                 "--device-memory", "24GiB", "--kv-cache-memory", f"{int(1723 * MIB * 0.1)}B",
                 "--prompt-tokens", "3446"]) == 1  # a problem: the status says so
    table = capsys.readouterr().out
    assert "KV capacity" in table and "1,344 tokens" in table and "num_blocks=54" in table
    assert "--kv-cache-memory 432MiB" in table  # 54 blocks x 8 MiB, with its unit: pastes into serve / LLM


def test_activation_estimate_counts_what_the_engine_profile_counts():
    """The plan lists the memory consumers the engine's profile measures, each estimated: logits and the
    sampler's temporaries at max_num_seqs rows, the largest image's held embeddings with the step, on a GPU
    the decode graphs' pool (not with enforce_eager, nor on the CPU) and, when on, the piecewise graphs'
    buffers and pool; the activation peak is their sum."""
    from vlm_sdk.memory.consumers.piecewise import held_bytes
    from vlm_sdk.memory.consumers.sampler import WORST_BYTES_PER_ENTRY
    cfg = CONFIGS / "qwen2_5_vl_3b.json"
    gpu = dict(device_memory="80GiB")
    base = plan(cfg, enforce_eager=True, **gpu)
    vocab, hidden, seqs = 151936, 2048, 64
    # held embeddings, bf16: a video's items within a step's reach (8,192 step tokens + 2 patches of 768
    # tokens), more than the checkpoint's largest image (1,280 tokens)
    assert base.held_vision_tokens == 8192 + 2 * 768 > base.image_tokens_per_image == 1280
    held = base.held_vision_tokens * hidden * 2
    # logits + sampler per row, beside the held image: what that phase adds over the activation peak (64
    # rows add nothing over an 8,192-token step; 512 rows do)
    rows = seqs * vocab * (4 + WORST_BYTES_PER_ENTRY)
    assert base.consumer_bytes("sampler") == max(0, held + rows - base.consumer_bytes("activation")) == 0
    many = plan(cfg, enforce_eager=True, max_num_seqs=8 * seqs, **gpu)
    assert many.consumer_bytes("sampler") == held + 8 * rows - many.consumer_bytes("activation") > 0
    assert many.activation_peak_bytes == held + 8 * rows  # the peak is the sampler's phase
    assert base.consumer_bytes("decode_graph_pool") == 0
    graphs = plan(cfg, **gpu)
    pool = graphs.consumer_bytes("decode_graph_pool")
    logits = seqs * vocab * (2 + 4)  # the graphs' logits: bf16 product in the pool, float32 buffer
    assert seqs * hidden * 2 < pool - logits < 8 * 2**20  # a decode forward of 64 rows: more than their hidden states
    assert graphs.activation_peak_bytes - base.activation_peak_bytes == pool
    piecewise = plan(cfg, piecewise_cuda_graphs=True, **gpu)
    assert piecewise.consumer_bytes("piecewise_graphs") > held_bytes(8192, hidden, 16, 2, 128, 3, torch.bfloat16) > 0
    small = plan(cfg, enforce_eager=True, max_pixels=200704, **gpu)  # the largest image: 256 tokens
    assert small.held_vision.startswith("9,728 tokens (a video's items within a step's reach")
    # smaller images change nothing: a video's chunk is what a request may hold
    assert base.consumer_bytes("activation") == small.consumer_bytes("activation")
    assert plan(cfg, enforce_eager=True, max_num_batched_tokens=4096, **gpu).held_vision_tokens == 4096 + 2 * 768
    for p in (base, graphs, piecewise, small):  # the peak is what the step-time consumers add up to
        assert p.activation_peak_bytes == sum(c.bytes for c in p.consumers if c.kind == "activation")
    cpu = plan(cfg, device="cpu", host_memory="512GiB")
    assert cpu.consumer_bytes("decode_graph_pool") == 0
    assert cpu.activation_peak_bytes == plan(cfg, device="cpu", host_memory="512GiB", enforce_eager=True).activation_peak_bytes


