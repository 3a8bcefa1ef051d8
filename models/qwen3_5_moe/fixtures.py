"""Qwen3.5-MoE's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported by
runtime code): the Qwen-VL families' preprocessing comparison, with Qwen3.5's benchmark images, on its
own checkpoints and reference."""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.fixtures import QwenVLFixtures


class Qwen3_5MoeFixtures(QwenVLFixtures):
    family = "qwen3_5_moe"
    bench_image_sizes = ((448, 448),)  # whole 32-pixel cells
    reference_module = "vlm_sdk.models.qwen3_5_moe.reference"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_5_moe.tiny_checkpoint import make_tiny_qwen3_5_moe_checkpoint
        return make_tiny_qwen3_5_moe_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_5_moe.tiny_checkpoint import make_bench_qwen3_5_moe_checkpoint
        return make_bench_qwen3_5_moe_checkpoint(path, seed, **overrides)


FIXTURES = Qwen3_5MoeFixtures()
