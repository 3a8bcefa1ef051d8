"""`vlm-sdk bench --gpu --quantization awq|w4a16|fp8 [--kv-cache-dtype fp8]` (vlm_sdk/bench/quantized.py): the same
code path on the CPU with `--tiny`, one decode batch and one step to stay short: the float baseline and the
quantized variants run our engine on checkpoints the reference quantizer wrote, the report holds a decode
figure per variant against the baseline, and with an FP8 KV cache the attention and capacity figures. Its
figures here check the plumbing (the CPU dequantizes before each product); the targets are the H100's."""
import json
import math

import pytest

from vlm_sdk.bench.quantized import DECODE_TARGETS, KV_ATTENTION_TARGET, KV_TOKENS_TARGET
from vlm_sdk.cli import main

SHORT = ["--decode-batches", "1", "--decode-steps", "1", "--context", "16"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(capsys, *flags: str) -> dict:
    argv = ["bench", "--gpu", "--tiny", "--json", *flags, *SHORT]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["command"] == "vlm-sdk " + " ".join(argv) and report["preset"] == "tiny"
    return report


def test_tiny_awq_with_an_fp8_cache_reports_every_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path / "cache"))
    report = _run(capsys, "--quantization", "awq", "--kv-cache-dtype", "fp8")
    base, awq, awq_fp8 = report["variants"]
    assert report["quantization"] == {"method": "awq", "group_size": 16}
    assert base["weight_format"] == "float" and base["kv_cache_dtype"] == "float32"
    assert awq["weight_format"].startswith("AWQ int4, group 16") and awq["kv_cache_dtype"] == "float32"
    assert awq_fp8["weight_format"] == awq["weight_format"] and awq_fp8["kv_cache_dtype"] == "float8_e4m3fn"
    # the packed language model holds fewer bytes than the float one; both quantized runs load the same
    assert awq["weights_bytes"] == awq_fp8["weights_bytes"] < base["weights_bytes"]
    # the same kv_cache_memory: e4m3 is a quarter of float32's bytes per token, so four times the tokens
    assert awq_fp8["kv_bytes_per_block"] * 4 == awq["kv_bytes_per_block"]
    assert awq_fp8["kv_capacity_tokens"] == 4 * awq["kv_capacity_tokens"]

    figures = report["figures"]
    assert len(figures) == 2 + 2  # a decode step per quantized variant (one batch), attention, capacity
    for f in figures:
        assert _positive(f["value"]) and _positive(f["baseline"]) and _positive(f["ratio"]), f
        assert f["pass"] is None if f["target_ratio"] is None else isinstance(f["pass"], bool)
    decode_awq, decode_fp8, attention, tokens = figures
    assert decode_awq["unit"] == "ms/step" and decode_awq["baseline_kind"] == "float32 weights ms/step"
    assert decode_awq["target_ratio"] == DECODE_TARGETS["awq"] and decode_fp8["target_ratio"] is None
    assert decode_awq["ratio"] == pytest.approx(base["decode_ms"]["1"] / awq["decode_ms"]["1"])
    assert attention["target_ratio"] == KV_ATTENTION_TARGET
    assert attention["details"]["fp8"]["max_abs_diff_vs_reference"] < 1e-3  # the kernel against its reference
    assert tokens["target_ratio"] == KV_TOKENS_TARGET and tokens["ratio"] == 4.0
    assert tokens["details"]["capacity_ratio"] == 4.0


def test_tiny_block_fp8_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path / "cache"))
    report = _run(capsys, "--quantization", "fp8")
    base, fp8 = report["variants"]
    assert report["quantization"] == {"method": "fp8", "block": [16, 16]}
    assert fp8["weight_format"].startswith("FP8 e4m3, 16x16 blocks") and fp8["kv_cache_dtype"] == "float32"
    assert fp8["weights_bytes"] < base["weights_bytes"]
    (decode,) = report["figures"]
    assert decode["target_ratio"] == DECODE_TARGETS["fp8"] and _positive(decode["ratio"])


def test_tiny_w4a16_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path / "cache"))
    report = _run(capsys, "--quantization", "w4a16")
    base, w4a16 = report["variants"]
    assert report["quantization"] == {"method": "w4a16", "group_size": 16}
    assert w4a16["weight_format"].startswith("W4A16 int4 (compressed-tensors pack-quantized), group 16, sym")
    assert w4a16["weights_bytes"] < base["weights_bytes"]
    (decode,) = report["figures"]
    assert decode["target_ratio"] == DECODE_TARGETS["w4a16"] and _positive(decode["ratio"])


@pytest.mark.parametrize("argv, message", [
    (["bench", "--quantization", "awq"], "--quantization only apply with --gpu"),
    (["bench", "--gpu", "--tiny", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype applies with --gpu --quantization"),
    (["bench", "--gpu", "--tiny", "--quantization", "awq", "--requests", "4"], "--requests do not apply with"),
    (["bench", "--gpu", "--tiny", "--quantization", "fp8", "--model", "/nowhere"], "drop --model"),
])
def test_misplaced_flags_are_refused(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
