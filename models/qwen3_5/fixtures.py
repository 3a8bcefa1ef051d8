"""Qwen3.5's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported by
runtime code): the Qwen-VL families' preprocessing comparison on this family's image processor (the
Qwen3-VL tower's, patch 16), its own checkpoints and reference."""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.fixtures import QwenVLFixtures


class Qwen3_5Fixtures(QwenVLFixtures):
    family = "qwen3_5"
    bench_image_sizes = ((448, 448),)  # whole 32-pixel cells: 196 image tokens, as Qwen3-VL's
    reference_module = "vlm_sdk.models.qwen3_5.reference"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_5.tiny_checkpoint import make_tiny_qwen3_5_checkpoint
        return make_tiny_qwen3_5_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_5.tiny_checkpoint import make_bench_qwen3_5_checkpoint
        return make_bench_qwen3_5_checkpoint(path, seed, **overrides)


FIXTURES = Qwen3_5Fixtures()
