"""Qwen2.5-VL's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported by
runtime code): the Qwen-VL families' (models/common/qwen_vl/fixtures.py) on this family's checkpoints and
reference."""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models.common.qwen_vl.fixtures import QwenVLFixtures


class Qwen2_5_VLFixtures(QwenVLFixtures):
    family = "qwen2_5_vl"
    reference_module = "vlm_sdk.models.qwen2_5_vl.reference"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen2_5_vl.tiny_checkpoint import make_tiny_qwen_checkpoint
        return make_tiny_qwen_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen2_5_vl.tiny_checkpoint import make_bench_qwen_checkpoint
        return make_bench_qwen_checkpoint(path, seed, **overrides)


FIXTURES = Qwen2_5_VLFixtures()
