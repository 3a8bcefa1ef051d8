"""`vlm-sdk plan` on the published Qwen3-VL-MoE configs alone: every expert's weight counted (resident), the
MoE step buffers as their own consumer, the dense MLP term gone where no layer is dense, 30B-A3B on one
80 GiB GPU and 235B-A22B on eight.

Where the configs come from (no machine here reaches the Hub):
- tests/configs/qwen3_vl_30b_a3b.json: the fields of Qwen/Qwen3-VL-30B-A3B-Instruct's config.json (the
  published layout: `rope_scaling` + `rope_theta`, `num_experts`) as a public repository transcribes them
  from the file at its commit 1fc78ad (a Rust parser's test fixture, found with the search tool);
  fields it leaves out take transformers' defaults. transformers builds 31,070,754,032 parameters from
  it: the model card's 31.07B.
- tests/configs/qwen3_vl_235b_a22b.json: Qwen/Qwen3-VL-235B-A22B-Instruct's config as transformers 5.7
  printed it after loading the real checkpoint directory (transformers 5's spelling: `rope_parameters`,
  `num_local_experts`), from a public model report found with the search tool, which also lists the
  checkpoint's tensors (experts as `gate_up_proj` [128, 4096, 3072] and `down_proj` [128, 1536, 4096]:
  the transposed fused layout) and its 235,670,022,896 parameters.
"""
from __future__ import annotations

import json

import torch
from transformers import Qwen3VLMoeForConditionalGeneration

from helpers import TESTS
from vlm_sdk.cli import main
from vlm_sdk.model_loader import read_config
from vlm_sdk.plan import plan

A3B = TESTS / "configs" / "qwen3_vl_30b_a3b.json"
A22B = TESTS / "configs" / "qwen3_vl_235b_a22b.json"
A22B_PARAMETERS = 235_670_022_896  # the real checkpoint's tensors, summed
GIB = 1 << 30


def hf_parameters(path) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3VLMoeForConditionalGeneration(read_config(path).hf_config).parameters())


def moe_bytes(tokens: int, experts: int, top_k: int, inter: int, hidden: int, held: int | None = None) -> int:
    """consumers/moe.py's Triton-set formula, written out: routing (over all `experts`), both products'
    rows, the padded sort (of the `held` experts a rank computes: all but under expert parallelism), the
    float32 sum and its cast (bf16)."""
    pairs, held = tokens * top_k, experts if held is None else held
    return (tokens * experts * (2 + 4) + pairs * 56 + pairs * (inter + hidden) * 2 + 4 * (pairs + held * 63)
            + tokens * hidden * 6)


def test_30b_a3b_fits_one_80gib_gpu():
    p = plan(A3B, dtype="bfloat16", device_memory="80GiB")
    assert p.family == "qwen3_vl_moe" and (p.num_layers, p.num_kv_heads, p.head_dim) == (48, 4, 128)
    assert p.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2 == 98_304
    assert hf_parameters(A3B) == 31_070_754_032
    assert p.weights_bytes == 2 * 31_070_754_032  # all 128 experts of all 48 layers, resident
    assert p.problems == () and p.num_blocks * 16 >= 100_000  # room for 100k tokens of KV beside 62 GB of weights
    # 8192-token steps, 8 of 128 experts of width 768, plus the decode graphs' 64-token step
    assert p.consumer_bytes("moe_activation") == moe_bytes(8192, 128, 8, 768, 2048) + moe_bytes(64, 128, 8, 768, 2048)


def test_no_dense_mlp_term_when_every_layer_is_sparse():
    """With a small image the decoder's step is the activation peak: residual, norms and q/k/v only (no
    2 x intermediate_size = 12,288 dense columns: 30B-A3B has no dense layer), beside the vision
    embeddings a request holds (the largest image, or a chunk's reach of a video's items)."""
    p = plan(A3B, dtype="bfloat16", device_memory="80GiB", max_pixels=32 * 32 * 64)
    qkv = (32 + 2 * 4) * 128
    assert p.consumer_bytes("activation") == 8192 * (4 * 2048 + qkv) * 2 + p.held_vision_tokens * 2048 * 2


def test_235b_a22b_fits_eight_80gib_gpus_not_one():
    assert hf_parameters(A22B) == A22B_PARAMETERS
    one = plan(A22B, dtype="bfloat16", device_memory="80GiB")
    assert one.weights_bytes == 2 * A22B_PARAMETERS and one.num_blocks == 0
    assert any("471,340,045,792 in use" in problem.message for problem in one.problems)
    eight = plan(A22B, dtype="bfloat16", device_memory="80GiB", tp=8)
    assert eight.problems == () and eight.weights_bytes < 56 * GIB  # one rank's eighth, plus what is whole
    # 4 KV heads over 8 ranks: each rank keeps one (KV per token halves, not eighths)
    assert eight.num_kv_heads == 1 and eight.kv_bytes_per_token == 94 * 2 * 128 * 2
    assert eight.consumer_bytes("moe_activation") == moe_bytes(8192, 128, 8, 1536 // 8, 4096) + \
        moe_bytes(64, 128, 8, 1536 // 8, 4096)


def test_cli_shows_the_experts_buffers(capsys):
    assert main(["plan", str(A22B), "--tp", "8", "--dtype", "bf16", "--device-memory", "80GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == [] and out["family"] == "qwen3_vl_moe"
    assert "moe_activation" in [c["name"] for c in out["consumers"]]
    assert main(["plan", str(A3B), "--dtype", "bf16", "--device-memory", "80GiB"]) == 0
    assert "MoE experts' step buffers" in capsys.readouterr().out


def test_235b_a22b_fp8_fits_four_80gib_gpus(tmp_path):
    """The block-wise FP8 checkpoint's layout from config.json alone: the BF16 config above with the
    quantization_config the Qwen FP8 repos carry (quant_method fp8, e4m3, dynamic activations, 128 x 128
    blocks; written here, not copied from the FP8 repo's file). Per rank at tp=4 each quantized weight
    (every expert, q | k | v, o) takes 1 byte instead of 2 and adds a float32 per 128 x 128 block: the
    plan's weights are the BF16 plan's less exactly that. The bf16 checkpoint does not fit four 80 GiB
    GPUs, the FP8 one does; tp=8 would cut 1536 / 8 = 192 into a partial 128-block: refused naming 1, 2, 4."""
    import pytest

    from vlm_sdk.errors import InvalidRequestError
    cfg = json.loads(A22B.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    bf16 = plan(A22B, dtype="bfloat16", device_memory="80GiB", tp=4)
    fp8 = plan(tmp_path / "config.json", dtype="bfloat16", device_memory="80GiB", tp=4)
    layers, experts, inter, hidden = 94, 128, 1536 // 4, 4096
    q, kv = 64 * 128 // 4, 128  # q rows per rank; 4 KV heads over 4 ranks: one each
    elements = layers * (experts * 3 * inter * hidden + (q + 2 * kv) * hidden + hidden * q)
    blocks = layers * (experts * (2 * inter // 128 * hidden // 128 + hidden // 128 * inter // 128)
                       + (q + 2 * kv) // 128 * hidden // 128 + hidden // 128 * q // 128)
    assert bf16.weights_bytes - fp8.weights_bytes == elements - 4 * blocks
    assert bf16.num_blocks == 0 and fp8.problems == () and fp8.weights_bytes < 56 * GIB
    with pytest.raises(InvalidRequestError, match=r"moe_intermediate_size per rank \(192 at tensor_parallel_size "
                                                  r"8\).*Sizes that work: 1, 2, 4$"):
        plan(tmp_path / "config.json", dtype="bfloat16", device_memory="80GiB", tp=8)


def test_the_torch_sets_fp8_experts_dequantized_per_step_are_counted(tmp_path):
    """On the CPU (the torch set) a step dequantizes a layer's FP8 experts: E I H x 24 bytes at the peak
    (gate|up's float32 weights, scales and product) over the BF16 checkpoint's step buffers."""
    cfg = json.loads(A3B.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    options = dict(dtype="bfloat16", device="cpu", host_memory="512GiB")
    bf16, fp8 = plan(A3B, **options), plan(tmp_path / "config.json", **options)
    assert fp8.consumer_bytes("moe_activation") - bf16.consumer_bytes("moe_activation") == 128 * 768 * 2048 * 24


def fp8_config(tmp_path):
    cfg = json.loads(A22B.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "config.json"


def test_expert_parallel_counts_each_ranks_whole_experts(tmp_path):
    """--enable-expert-parallel at tp=8: each rank holds 16 of the 128 experts whole. BF16: the same bytes
    per rank as splitting every expert 8 ways (16 x 1536 = 128 x 192 columns), its step buffers at the
    whole width over 16 experts. FP8: every expert's 1536 columns are whole 128-blocks, so tp=8 (refused
    without expert parallelism: 192 columns cut a block) is planned, and one rank's weights are the BF16
    rank's less 1 byte per expert and attention element plus a float32 per 128 x 128 block."""
    options = dict(dtype="bfloat16", device_memory="80GiB", tp=8)
    split, whole = plan(A22B, **options), plan(A22B, **options, enable_expert_parallel=True)
    assert whole.weights_bytes == split.weights_bytes and whole.problems == ()
    assert whole.consumer_bytes("moe_activation") == moe_bytes(8192, 128, 8, 1536, 4096, held=16) + \
        moe_bytes(64, 128, 8, 1536, 4096, held=16)
    fp8 = plan(fp8_config(tmp_path), **options, enable_expert_parallel=True)
    layers, experts, inter, hidden = 94, 16, 1536, 4096
    q, kv = 64 * 128 // 8, 128  # q rows per rank; 4 KV heads over 8 ranks: one each
    elements = layers * (experts * 3 * inter * hidden + (q + 2 * kv) * hidden + hidden * q)
    blocks = layers * (experts * (2 * inter // 128 * hidden // 128 + hidden // 128 * inter // 128)
                       + (q + 2 * kv) // 128 * hidden // 128 + hidden // 128 * q // 128)
    assert whole.weights_bytes - fp8.weights_bytes == elements - 4 * blocks and fp8.problems == ()


def test_cli_plans_expert_parallel(capsys):
    args = ["plan", str(A22B), "--tp", "8", "--dtype", "bf16", "--device-memory", "80GiB", "--json"]
    assert main(args) == 0 and main([*args, "--enable-expert-parallel"]) == 0
    split, whole = (json.loads(part) for part in capsys.readouterr().out.replace("}\n{", "}\n\x00{").split("\x00"))
    moe = [{c["name"]: c["bytes"] for c in out["consumers"]}["moe_activation"] for out in (split, whole)]
    assert moe[1] - moe[0] == (moe_bytes(8192, 128, 8, 1536, 4096, held=16) - moe_bytes(8192, 128, 8, 192, 4096)
                               + moe_bytes(64, 128, 8, 1536, 4096, held=16) - moe_bytes(64, 128, 8, 192, 4096))
