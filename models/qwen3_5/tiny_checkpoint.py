"""Tiny Qwen3.5 checkpoints with random weights, for tests and benchmarks without a model hub: the Qwen3.5
architecture's writer (models/common/qwen_vl/qwen3_5_tiny_checkpoint.py: tokenizer, chat template, shapes,
config layouts, the mtp.* head) on transformers' own `Qwen3_5ForConditionalGeneration`. Reached as
`vlm_sdk.testing.make_tiny_checkpoint(path, family="qwen3_5", ...)`.
"""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.qwen3_5_tiny_checkpoint import BENCH_SHAPE, DEFAULTS, write_qwen3_5_checkpoint


def make_tiny_qwen3_5_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format Qwen3.5 checkpoint with random weights to `path` and return it. Same
    arguments give byte-identical files; accepted overrides: `DEFAULTS`' names."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    return write_qwen3_5_checkpoint(path, seed, DEFAULTS, overrides, Qwen3_5ForConditionalGeneration, Qwen3_5Config)


def make_bench_qwen3_5_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape (`BENCH_SHAPE`: hidden 512, 8 layers of which 2 attention, vocab 151936 tied,
    bfloat16; ~100M parameters, 78M of them the embedding): speed does not depend on the weight values."""
    return make_tiny_qwen3_5_checkpoint(path, seed, **{**BENCH_SHAPE, "mtp": False, **overrides})
