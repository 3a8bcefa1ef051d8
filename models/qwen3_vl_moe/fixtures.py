"""Qwen3-VL-MoE's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported
by runtime code): the Qwen-VL families' (models/common/qwen_vl/fixtures.py: the preprocessing comparison),
with Qwen3-VL's benchmark images, on its own checkpoints and reference."""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.fixtures import QwenVLFixtures


class Qwen3VLMoeFixtures(QwenVLFixtures):
    family = "qwen3_vl_moe"
    bench_image_sizes = ((448, 448),)  # Qwen3-VL's: whole 32-pixel cells
    reference_module = "vlm_sdk.models.qwen3_vl_moe.reference"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_vl_moe.tiny_checkpoint import make_tiny_qwen3_vl_moe_checkpoint
        return make_tiny_qwen3_vl_moe_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_vl_moe.tiny_checkpoint import make_bench_qwen3_vl_moe_checkpoint
        return make_bench_qwen3_vl_moe_checkpoint(path, seed, **overrides)


FIXTURES = Qwen3VLMoeFixtures()
