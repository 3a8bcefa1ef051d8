"""Memory of quantized checkpoints: `vlm-sdk plan` counts the packed weights, scales and zeros exactly as the
engine holds them (plan == engine on quantized tiny checkpoints, and both against the arithmetic of the
format: AWQ's and W4A16's by hand), names the format, and plans Qwen2.5-VL-72B-Instruct-AWQ on one 80 GiB
GPU from its config alone."""
from __future__ import annotations

import json

import pytest

from helpers import TESTS
from vlm_sdk import LLM
from vlm_sdk.plan import plan
from vlm_sdk.plan.report import format_plan
from vlm_sdk.testing.quantizer import quantize_checkpoint

AWQ_72B = TESTS / "configs" / "qwen2_5_vl_72b_awq.json"


def _awq_linear_bytes(out_f: int, in_f: int, group: int) -> int:
    """qweight int32 [in, out/8] + qzeros int32 [in/G, out/8] + scales fp16 [in/G, out]."""
    return in_f * out_f // 8 * 4 + in_f // group * out_f // 8 * 4 + in_f // group * out_f * 2


def test_plan_of_the_72b_awq_config_fits_one_80gib_gpu_and_counts_every_packed_byte():
    c = json.loads(AWQ_72B.read_text())
    p = plan(AWQ_72B, device_memory="80GiB")
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    per_layer = (_awq_linear_bytes(h, h, 128) + 2 * _awq_linear_bytes(kv * d, h, 128)  # q, k, v
                 + (h + 2 * kv * d) * 2                                                # their biases (bf16)
                 + _awq_linear_bytes(h, h, 128)                                        # o_proj
                 + 2 * _awq_linear_bytes(inter, h, 128) + _awq_linear_bytes(h, inter, 128)  # gate, up, down
                 + 2 * h * 2)                                                          # the two norms
    embed_and_head = 2 * c["vocab_size"] * h * 2 + h * 2  # untied, bf16; the final norm
    assert p.weights_language_model_bytes == c["num_hidden_layers"] * per_layer + embed_and_head
    # the published config (intermediate_size 29696): 40.05 GiB of weights, the cache in the rest of one 80 GiB GPU
    assert p.weights_bytes < 41 * 2 ** 30 and not p.problems
    assert p.capacity_tokens > 90_000  # what the bf16 KV cache holds beside them
    assert p.weight_format.startswith("AWQ int4, group 128")
    assert "weights: format" in format_plan(p) and "AWQ int4, group 128" in format_plan(p)


@pytest.mark.parametrize("method, options", [("awq", dict(group_size=16)),
                                             ("gptq", dict(group_size=16, sym=False, desc_act=True)),
                                             ("fp8", dict(block=(16, 16))),
                                             ("w4a16", dict(group_size=16, sym=False, desc_act=True))])
def test_plan_equals_the_engine_on_a_quantized_checkpoint(tiny_checkpoints, tmp_path, method, options):
    path = quantize_checkpoint(tiny_checkpoints("qwen2_5_vl"), tmp_path / "q", method, **options)
    float_plan = plan(tiny_checkpoints("qwen2_5_vl"), device="cpu")
    p = plan(path, device="cpu")
    r = LLM(str(path), device="cpu", show_progress=False).memory_report
    for key in ("weights_language_model_bytes", "weights_vision_bytes", "weights_projector_bytes", "num_blocks",
                "kv_bytes_per_block", "weight_format"):
        assert getattr(p, key) == getattr(r, key), key
    assert p.weights_language_model_bytes < float_plan.weights_language_model_bytes  # packed: fewer bytes
    assert p.weights_vision_bytes == float_plan.weights_vision_bytes  # the vision tower stays float
    assert p.weight_format != "float" and float_plan.weight_format == "float"


def test_plan_of_the_72b_awq_config_with_an_fp8_kv_cache_holds_twice_the_tokens():
    """The issue's plan: Qwen2.5-VL-72B-Instruct-AWQ on one 80 GiB GPU, how many tokens the cache holds in bf16
    and FP8 KV. The same memory_utilization budget: the FP8 cache's blocks are half the bytes, so twice the
    blocks (the budget's remainder may give one more)."""
    bf16 = plan(AWQ_72B, device_memory="80GiB")
    fp8 = plan(AWQ_72B, device_memory="80GiB", kv_cache_dtype="fp8")
    assert (bf16.kv_cache_dtype, fp8.kv_cache_dtype) == ("bfloat16", "float8_e4m3fn")
    assert fp8.kv_bytes_per_block * 2 == bf16.kv_bytes_per_block
    assert fp8.kv_bytes_per_token == 80 * 2 * 8 * 128  # 80 layers x K, V x 8 KV heads x 128 x 1 byte
    assert fp8.weights_bytes == bf16.weights_bytes and not fp8.problems
    assert fp8.num_blocks in (2 * bf16.num_blocks, 2 * bf16.num_blocks + 1)
    assert bf16.fp8_capacity_tokens == fp8.capacity_tokens > 180_000  # the bf16 plan names the FP8 figure
    assert fp8.fp8_capacity_tokens is None
    text = format_plan(bf16)
    assert f"{bf16.capacity_tokens:,} tokens; {fp8.capacity_tokens:,} with --kv-cache-dtype fp8" in text
    assert "x float8_e4m3fn) (kv_cache_dtype='fp8'" in format_plan(fp8)
    assert fp8.to_dict()["kv_cache_dtype"] == "float8_e4m3fn"


def test_plan_equals_the_engine_with_an_fp8_kv_cache(tiny_checkpoints):
    path = tiny_checkpoints("qwen2_5_vl")
    p = plan(path, device="cpu", kv_cache_dtype="fp8", kv_cache_memory="1MiB")
    r = LLM(str(path), device="cpu", show_progress=False, kv_cache_dtype="fp8", kv_cache_memory="1MiB").memory_report
    for key in ("kv_bytes_per_block", "kv_bytes_per_token", "num_blocks", "kv_cache_dtype"):
        assert getattr(p, key) == getattr(r, key), key
    assert p.kv_cache_dtype == "float8_e4m3fn"


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_plan_counts_w4a16_packed_weights_scales_and_zeros_exactly(tiny_checkpoints, tmp_path, sym):
    """compressed-tensors W4A16 per Linear: weight_packed int32 [out, in/8], weight_scale [out, in/G] in the
    model's dtype (float32 on the CPU), weight_zero_point int32 [out/8, in/G] when asymmetric, weight_shape
    int64 [2]; everything else as in the float checkpoint."""
    src = tiny_checkpoints("qwen2_5_vl")
    path = quantize_checkpoint(src, tmp_path / "q", "w4a16", group_size=16, sym=sym)
    c = json.loads((src / "config.json").read_text())
    c = c.get("text_config", c)
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    linears = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (inter, h), (inter, h), (h, inter)]

    def packed(out_f, in_f):
        return out_f * in_f // 8 * 4 + out_f * in_f // 16 * 4 + (0 if sym else out_f // 8 * in_f // 16 * 4) + 2 * 8
    saved = c["num_hidden_layers"] * sum(out_f * in_f * 4 - packed(out_f, in_f) for out_f, in_f in linears)
    float_plan, p = plan(src, device="cpu"), plan(path, device="cpu")
    assert float_plan.weights_language_model_bytes - p.weights_language_model_bytes == saved
    assert p.weights_vision_bytes == float_plan.weights_vision_bytes
    kind = "sym" if sym else "asym"
    assert p.weight_format.startswith(f"W4A16 int4 (compressed-tensors pack-quantized), group 16, {kind} ")
    assert p.weight_format in format_plan(p)
