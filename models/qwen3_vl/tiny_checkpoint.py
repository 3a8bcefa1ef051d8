"""Tiny Qwen3-VL checkpoints with random weights, for tests and benchmarks without a model hub: the Qwen3-VL
architecture's writer (models/common/qwen_vl/qwen3_tiny_checkpoint.py: the tokenizer, templates, vision
tower, config layouts, options and shapes) on transformers' own `Qwen3VLForConditionalGeneration`.
Reached as `vlm_sdk.testing.make_tiny_checkpoint(path, family="qwen3_vl", ...)`.
"""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.qwen3_tiny_checkpoint import BENCH_SHAPE, DEFAULTS, write_qwen3_vl_checkpoint


def make_tiny_qwen3_vl_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format Qwen3-VL checkpoint with random weights to `path` and return it.

    Same arguments give byte-identical files. Accepted overrides: see `DEFAULTS` (an unknown name
    raises TypeError). Layouts: config_layout "nested" is what transformers 5 writes
    (`text_config.rope_parameters`), "flat" the published one (`text_config.rope_scaling` + `rope_theta`,
    written by transformers 4.57); preprocessor_layout "nested" writes size.shortest_edge/longest_edge
    (as the published Qwen3-VL checkpoints do), "flat" writes min_pixels/max_pixels.
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    return write_qwen3_vl_checkpoint(path, seed, DEFAULTS, overrides, Qwen3VLForConditionalGeneration, Qwen3VLConfig)


def make_bench_qwen3_vl_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape: Qwen3-VL architecture, ~100M parameters (the tied 151936 x 512 embedding is
    77.8M of them), bfloat16 weights. Speed does not depend on the weight values; vocab 151936 keeps
    the embedding and LM head as costly as the real ones."""
    return make_tiny_qwen3_vl_checkpoint(path, seed, **{**BENCH_SHAPE, **overrides})
