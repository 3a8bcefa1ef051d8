"""Qwen3-VL's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported by
runtime code). The preprocessing comparison is the Qwen-VL families' (models/common/qwen_vl/fixtures.py)
on this family's image processor (transformers' Qwen2-VL processor at patch 16)."""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.fixtures import QwenVLFixtures


class Qwen3VLFixtures(QwenVLFixtures):
    family = "qwen3_vl"
    # Qwen2.5-VL's workload, so the two figures compare; 448 = 14 * 32 is whole 32-pixel cells: 196
    # image tokens per image (256 at Qwen2.5-VL's 28-pixel cells)
    bench_image_sizes = ((448, 448),)
    reference_module = "vlm_sdk.models.qwen3_vl.reference"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_vl.tiny_checkpoint import make_tiny_qwen3_vl_checkpoint
        return make_tiny_qwen3_vl_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_vl.tiny_checkpoint import make_bench_qwen3_vl_checkpoint
        return make_bench_qwen3_vl_checkpoint(path, seed, **overrides)


FIXTURES = Qwen3VLFixtures()
