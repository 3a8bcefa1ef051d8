"""`vlm-sdk plan` reproduces each seed's scenario (../shared/seeds/) with the seed's own figures: what
took its author a debugger or profiling is one command here."""
import json

from helpers import TESTS
from vlm_sdk.cli import main
from vlm_sdk.plan import plan

CONFIGS = TESTS / "configs"
INTERNVL2_8B = CONFIGS / "internvl2_8b.json"
MIB, GIB = 1 << 20, 1 << 30
# lmdeploy_kv_cache_input_length_error.md: "free gpu memory: 6784 mb", "estimated max runtime memory: 5061 mb",
# --cache-max-entry-count 0.1, block_size=64 -> "block num: 21", max_tokens 1344; len(input_ids) 3446
LMDEPLOY_CACHE_0_1 = int((6784 - 5061) * MIB * 0.1)  # 180,709,785 bytes
LMDEPLOY_BLOCK_BYTES = 8_388_608  # "p cache_block_size"


def test_lmdeploy_input_length_error_seed(capsys):
    """InternVL2-8B, block 64, 0.1 of free memory: 21 blocks = 1,344 tokens, and a 3,446-token prompt
    (13 tiles x 256 image tokens + 118 text) that LMDeploy answered with "internal error happened".
    plan names the cause and each fix, with the engine's setting names and units."""
    argv = ["plan", str(INTERNVL2_8B), "--device-memory", "24GiB", "--block-size", "64", "--kv-cache-memory",
            f"{LMDEPLOY_CACHE_0_1}B", "--prompt-tokens", "118", "--images", "1", "--output-tokens", "0"]
    assert main(argv + ["--json"]) == 1  # the seed's request does not fit: a non-zero status
    p = json.loads(capsys.readouterr().out)
    assert (p["kv_bytes_per_block"], p["num_blocks"], p["capacity_tokens"]) == (LMDEPLOY_BLOCK_BYTES, 21, 1344)
    assert (p["dtype"], p["request_tokens"], p["image_tokens_per_image"]) == ("bfloat16", 3446, 13 * 256)
    assert p["max_concurrent_requests"] == 0
    [too_long] = [pr for pr in p["problems"] if "request of 3446 tokens" in pr["message"]]
    # 54 x 64 = 3,456 >= 3,446; 3 tiles + thumbnail; LMDeploy's own answer, quant_policy 4: the same bytes hold
    # 74 int4 blocks (72 bytes a token and head against bf16's 256), where FP8's 42 would not do
    assert too_long["fixes"] == {"kv_cache_memory": 54 * LMDEPLOY_BLOCK_BYTES, "num_blocks": 54,
                                 "max_dynamic_patch": 3, "kv_cache_dtype": "int4"}
    assert main(argv) == 1
    table = capsys.readouterr().out
    for piece in ("21 = 168.00 MiB", "1,344 tokens", "3,446 tokens per request", "--kv-cache-memory 432MiB",
                  "--num-blocks 54", "--max-dynamic-patch 3",
                  # the image problem: the engine's start-up fixes (256 tokens left beside the image)
                  "set --max-dynamic-patch 3, or --kv-cache-memory 448MiB, or --num-blocks 56"):
        assert piece in table, piece
    # each fix, applied, makes the request fit
    for fix in ({"kv_cache_memory": "432MiB"}, {"num_blocks": 54}, {"max_dynamic_patch": 3}, {"kv_cache_dtype": "int4"},
                {"quant_policy": 4}):
        fixed = plan(INTERNVL2_8B, device_memory="24GiB", block_size=64, prompt_tokens=118, images=1,
                     output_tokens=0, **{"kv_cache_memory": LMDEPLOY_CACHE_0_1, **fix})
        assert fixed.max_concurrent_requests == 1 and not [pr for pr in fixed.problems if "request" in pr.message]
    # our default on the same 24 GiB GPU (memory_utilization 0.9 of TOTAL memory, weights included)
    ours = plan(INTERNVL2_8B, device_memory="24GiB", block_size=64, prompt_tokens=118, images=1, output_tokens=0)
    assert ours.capacity_tokens > 3446 and ours.max_concurrent_requests >= 10 and not ours.problems


def test_lmdeploy_cache_engine_notebook_seed():
    """The notebook's block arithmetic: LMDeploy's get_cache_block_size = num_layers * (K + V) of shape
    (block_size, kv_heads, head_dim) for Qwen2.5-VL-3B (36 layers, 2 KV heads, 2048 / 16 = 128, bf16);
    TP splits the KV heads; its pdb figures (InternVL2-8B, 0.5 of free memory): gpu_mem 903548928.0 /
    cache_block_size 8388608 -> 107 blocks = 6,848 tokens, where the 3,446-token prompt fits."""
    layers, kv_heads, head_dim, block_size = 36, 2, 2048 // 16, 64
    lmdeploy_block = layers * 2 * (block_size * kv_heads * head_dim * 2)
    p = plan(CONFIGS / "qwen2_5_vl_3b.json", device_memory="24GiB", block_size=64, num_blocks=16)
    assert p.kv_bytes_per_block == lmdeploy_block == 2_359_296
    assert not [pr for pr in p.problems if "does not fit in" in pr.message]  # 16 blocks fit on 24 GiB
    assert plan(CONFIGS / "qwen2_5_vl_3b.json", device_memory="24GiB", block_size=64, num_blocks=16,
                tp=2).kv_bytes_per_block == lmdeploy_block // 2  # num_heads // world_size
    half = plan(INTERNVL2_8B, device_memory="24GiB", block_size=64, kv_cache_memory=903_548_928,
                prompt_tokens=3446)
    assert (half.kv_bytes_per_block, half.num_blocks, half.capacity_tokens) == (LMDEPLOY_BLOCK_BYTES, 107, 6848)
    assert half.max_concurrent_requests == 1 and not half.problems  # 2 x 54 blocks > 107


def _llama2_70b_shaped(tmp_path):
    """The vLLM OOM seed's model is Llama-2-70B, not a VLM: its text stack (80 layers, hidden 8192, 64
    heads, 8 KV heads, MLP 28672, vocabulary 32000, fp16) under a Qwen2.5-VL vision tower."""
    config = json.loads((CONFIGS / "qwen2_5_vl_7b.json").read_text())
    config.update(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=28672, vocab_size=32000, max_position_embeddings=8192, torch_dtype="float16")
    config.update(bos_token_id=1, eos_token_id=2, vision_start_token_id=31995, vision_end_token_id=31996,
                  vision_token_id=31997, image_token_id=31998, video_token_id=31999)  # inside the vocabulary
    config["vision_config"]["out_hidden_size"] = 8192  # the projector feeds the 8192-wide text stack
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_vllm_oom_max_model_len_seed(tmp_path):
    """4 x A100 80G, tensor_parallel_size=4, fp16, max_model_len 8192, prompts 800-1200 tokens +
    max_tokens 512, 10-15 requests at once. The seed blamed max_model_len for preallocating KV memory
    ("32 GB per request"); plan shows the real figures: 81,920 B per token per rank (80 layers x 2 x
    8/4 KV heads x 128 x 2 B), a full 8,192-token sequence 640 MiB per rank, and a paged cache whose
    requests at once do not depend on max_model_len. Its rule max_model_len = P99 prompt + max_tokens
    is plan's fix when max_model_len is too short."""
    cfg = _llama2_70b_shaped(tmp_path)
    common = dict(device_memory="80GiB", tp=4, dtype="float16", max_num_seqs=15, prompt_tokens=1200,
                  output_tokens=512)
    p = plan(cfg, max_model_len=8192, **common)
    assert (p.num_layers, p.num_kv_heads, p.kv_bytes_per_token) == (80, 2, 81_920)
    assert 8192 * p.kv_bytes_per_token == 640 * MIB
    assert 32e9 < p.weights_bytes < 38e9  # ~69B parameters x 2 bytes / 4 ranks, plus the vision tower
    assert p.request_tokens == 1712 and p.max_concurrent_requests == 15 and not p.problems
    assert p.capacity_tokens // 8192 >= 15  # even 15 full-length sequences fit beside the weights
    short = plan(cfg, max_model_len=2048, **common)
    assert short.num_blocks == p.num_blocks and short.max_concurrent_requests == p.max_concurrent_requests
    too_short = plan(cfg, max_model_len=1024, **common)
    [problem] = [pr for pr in too_short.problems if "request of 1712 tokens" in pr.message]
    assert problem.fixes == {"max_model_len": 1200 + 512}
    # on one 80 GiB GPU the fp16 weights alone do not fit: the seed's "add GPUs" case, said up front
    [alone] = [pr for pr in plan(cfg, max_model_len=8192, num_blocks=64, **{**common, "tp": 1}).problems
               if "does not fit in" in pr.message]
    assert "even without a KV cache" in alone.message


def test_vllm_pipeline_parallel_low_utilization_seed():
    """48 GB GPUs: gpu_memory_utilization 0.3 failed, 0.4 ran; GPU blocks 3796 -> 7592 -> 15185 as the
    model was split over 1 -> 2 -> 4 stages. With a 7B VLM on 48 GiB, plan says up front that 0.3 leaves
    no room for the KV cache, naming the smallest utilization that does (0.35: the memory consumers as the
    engine's profile counts them: the step beside the held image, the graph pool, the encoder cache; the
    sampler's phase adds nothing over an 8,192-token step), that 0.4 does, and that blocks per rank at
    least double with each doubling of ranks."""
    cfg = CONFIGS / "qwen2_5_vl_7b.json"
    low = plan(cfg, device_memory="48GiB", memory_utilization=0.3)
    [problem] = low.problems
    assert low.num_blocks == 0 and "no room for one KV block" in problem.message
    need = problem.fixes["memory_utilization"]
    assert need == 0.35
    assert plan(cfg, device_memory="48GiB", memory_utilization=round(need - 0.01, 2)).num_blocks == 0
    assert plan(cfg, device_memory="48GiB", memory_utilization=need).num_blocks >= 1
    assert plan(cfg, device_memory="48GiB", memory_utilization=0.4).num_blocks > 0
    blocks = {tp: plan(cfg, device_memory="48GiB", memory_utilization=0.9, tp=tp).num_blocks for tp in (1, 2, 4)}
    assert blocks[2] >= 2 * blocks[1] and blocks[4] >= 2 * blocks[2]



def test_a_plan_that_does_not_fit_says_what_would_and_exits_non_zero(capsys):
    """Qwen3-VL-235B-A22B (471 GB in bf16) on one 80 GiB GPU: no room for one KV block. The plan names
    the weights as the cause (not the activation peak), lists what would fit, each planned again by
    plan() (the fewest ranks; an FP8 KV cache; a block-wise FP8 checkpoint of the same shape), and exits
    1; the same config at --tp 8 has no problem and exits 0."""
    from vlm_sdk.plan.alternatives import alternatives
    config = TESTS / "configs" / "qwen3_vl_235b_a22b.json"
    base = plan(config, device_memory="80GiB")
    [problem] = base.problems
    assert "the weights alone" in problem.message and "--tp" in problem.message
    assert "--max-num-batched-tokens" not in problem.message
    found = {a.flags or a.checkpoint: a for a in alternatives(config, {"device_memory": "80GiB"}, base)}
    assert set(found) == {"--tp 8", "--kv-cache-dtype fp8 --tp 8", "--tp 4"}, list(found)
    assert found["--tp 4"].checkpoint == "block-wise FP8"
    at8 = plan(config, device_memory="80GiB", tp=8)
    assert not at8.problems and found["--tp 8"].weights_bytes == at8.weights_bytes
    assert found["--tp 8"].capacity_tokens == at8.capacity_tokens
    assert abs(at8.weights_bytes / 2**30 - 55.05) < 0.01  # the README's figure
    assert found["--kv-cache-dtype fp8 --tp 8"].capacity_tokens in (2 * at8.capacity_tokens,
                                                                    2 * at8.capacity_tokens + 16)
    assert main(["plan", str(config), "--device-memory", "80GiB", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [a["flags"] for a in out["fits_with"]] == ["--tp 8", "--kv-cache-dtype fp8 --tp 8", "--tp 4"]
    assert main(["plan", str(config), "--device-memory", "80GiB", "--tp", "8"]) == 0
    assert "what would fit" not in capsys.readouterr().out
