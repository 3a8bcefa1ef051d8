"""Tiny Qwen3.5-MoE checkpoints with random weights, for tests and benchmarks without a model hub: the
Qwen3.5 architecture's writer (models/common/qwen_vl/qwen3_5_tiny_checkpoint.py) on transformers' own
`Qwen3_5MoeForConditionalGeneration`, with experts in the text config. Reached as
`vlm_sdk.testing.make_tiny_checkpoint(path, family="qwen3_5_moe", ...)`.

The tiny shape: 12 experts of width 32, 3 per token (8 experts, 2 per token, gave Qwen3-VL-MoE's tiny
checkpoint one token over and over), a shared expert of 64; every layer sparse, as in the published
models. 2I = 64 and I = 32 both differ from hidden 48, so the fused tensors' two orientations cannot be
mistaken for each other. transformers 5 saves the experts fused ([E, 2I, H] and [E, H, I]), the
orientation the published repositories keep.
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from vlm_sdk.models.common.qwen_vl.qwen3_5_tiny_checkpoint import BENCH_SHAPE, DEFAULTS, write_qwen3_5_checkpoint

_EXPERTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    **DEFAULTS, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=64))


def make_tiny_qwen3_5_moe_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format Qwen3.5-MoE checkpoint with random weights to `path` and return it.
    Accepted overrides: Qwen3.5's (`DEFAULTS` of the writer) and the expert fields above."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    opts = {**_DEFAULTS, **overrides}
    experts = {k: opts[k] for k in _EXPERTS}
    return write_qwen3_5_checkpoint(path, seed, _DEFAULTS, {k: v for k, v in overrides.items() if k not in _EXPERTS},
                                    Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig, experts)


def make_bench_qwen3_5_moe_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape: Qwen3.5's (hidden 512, 8 layers, vocab 151936, bfloat16) with every layer's MLP
    16 experts of width 256, 4 per token, and a shared expert of 256."""
    experts = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    return make_tiny_qwen3_5_moe_checkpoint(path, seed, **{**BENCH_SHAPE, "mtp": False, **experts, **overrides})
