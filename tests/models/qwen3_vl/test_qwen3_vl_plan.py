"""`vlm-sdk plan` on the published Qwen3-VL-8B config.json alone (tests/configs/qwen3_vl_8b.json, its
published fields: the nested text config with `rope_scaling` + `rope_theta`): exact KV bytes, the weights
of every parameter transformers' own model has, the published image bounds, tensor parallelism."""
from __future__ import annotations

import json

import torch
from transformers import Qwen3VLForConditionalGeneration

from helpers import TESTS
from vlm_sdk.cli import main
from vlm_sdk.model_loader import read_config
from vlm_sdk.plan import plan

CONFIG = TESTS / "configs" / "qwen3_vl_8b.json"
PER_TOKEN = 36 * 2 * 8 * 128 * 2  # layers * (K, V) * KV heads * head_dim * bf16 bytes


def _hf_numel() -> dict[str, int]:
    """Parameters of transformers' Qwen3-VL on this config (meta device): all, vision tower, its mergers."""
    with torch.device("meta"):
        hf = Qwen3VLForConditionalGeneration(read_config(CONFIG).hf_config)
    named = list(hf.named_parameters())
    return {"all": sum(p.numel() for _, p in named),
            "visual": sum(p.numel() for n, p in named if ".visual." in n),
            "mergers": sum(p.numel() for n, p in named if "merger" in n)}


def test_kv_bytes_and_weights_of_the_published_8b_config():
    p = plan(CONFIG, dtype="bfloat16", device_memory="80GiB", num_blocks=10)
    assert p.family == "qwen3_vl" and (p.num_layers, p.num_kv_heads, p.head_dim) == (36, 8, 128)
    assert p.kv_bytes_per_token == PER_TOKEN == 147_456 and p.kv_bytes_per_block == PER_TOKEN * 16
    n = _hf_numel()
    assert n["all"] == 8_767_123_696  # Qwen3-VL-8B's published parameter count
    assert p.weights_bytes == 2 * n["all"]
    assert p.weights_projector_bytes == 2 * n["mergers"]  # the merger and the 3 DeepStack mergers
    assert p.weights_vision_bytes + p.weights_projector_bytes == 2 * n["visual"]
    assert p.max_position_embeddings == 262_144
    half = plan(CONFIG, dtype="bfloat16", device_memory="80GiB", num_blocks=10, tp=2)
    assert half.kv_bytes_per_token * 2 == PER_TOKEN and half.num_kv_heads == 4
    assert half.weights_language_model_bytes < p.weights_language_model_bytes


def test_images_are_sized_by_the_published_bounds_and_max_pixels():
    """No preprocessor_config.json beside the file: Qwen3-VL's published 4096*4096-pixel bound (16,384
    image tokens of 32x32 pixels), and a smaller max_pixels shrinks it."""
    p = plan(CONFIG, dtype="bfloat16", device_memory="80GiB")
    assert p.image_tokens_per_image == 16_384 and "4096x4096" in p.largest_image
    smaller = plan(CONFIG, dtype="bfloat16", device_memory="80GiB", max_pixels=32 * 32 * 1024)
    assert smaller.image_tokens_per_image == 1024


def test_cli(capsys):
    assert main(["plan", str(CONFIG), "--dtype", "bf16", "--device-memory", "80GiB", "--max-pixels",
                 str(32 * 32 * 1024), "--prompt-tokens", "200", "--images", "2", "--output-tokens", "100",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == PER_TOKEN and out["image_tokens_per_image"] == 1024
    assert out["problems"] == [] and out["max_concurrent_requests"] > 0
