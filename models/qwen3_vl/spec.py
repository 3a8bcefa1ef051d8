"""The Qwen3-VL family: `FAMILY`, named in `vlm_sdk.models.registry`.

Images are resized to a multiple of 32 pixels between min_pixels and max_pixels (Qwen2-VL's
`smart_resize` at patch 16, merge 2); one image token per 32x32 pixels. The prompt side is Qwen2.5-VL's
(the same special tokens, the same placeholder expansion, and `get_rope_index` gives still images the
same positions), so the processor, the too-long fixes and the planner's image sizing are Qwen2.5-VL's
on this family's image processor; the model (DeepStack, interleaved M-RoPE, q/k norm) is its own.
Engine settings: min_pixels, max_pixels (defaults: the preprocessor config's); an image part may set
its own. The planner sizes images by max_pixels. The bench's preprocessing comparison is
Qwen2.5-VL's hook on this family's image processor (transformers' Qwen2-VL processor at patch 16).
Importing this module imports no model code.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from vlm_sdk.models.family import Setting
from vlm_sdk.models.qwen2_5_vl.spec import Qwen2_5_VLSpec

_PIXELS = "pixels (width x height) an image is resized to {} (default: the preprocessor's)"
_CELL = "a multiple of 32x32 pixels"  # this family's alone: Setting.detail


class Qwen3VLSpec(Qwen2_5_VLSpec):
    name = "qwen3_vl"
    display_name = "Qwen3-VL"
    engine_settings = (Setting("min_pixels", _PIXELS.format("at least"), detail=_CELL),
                       Setting("max_pixels", _PIXELS.format("at most"), detail=_CELL))
    image_settings = engine_settings  # an image part's own bounds win over the engine's
    plan_setting = ("max_pixels", "max_pixels")
    # Qwen2.5-VL's workload, so the two figures compare; 448 = 14 * 32 is whole 32-pixel cells: 196
    # image tokens per image (256 at Qwen2.5-VL's 28-pixel cells)
    bench_image_sizes = ((448, 448),)

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl.model import Qwen3VLForCausalLM
        return Qwen3VLForCausalLM

    @property
    def image_processor_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl.image_processor import Qwen3VLImageProcessor
        return Qwen3VLImageProcessor

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_vl.tiny_checkpoint import make_tiny_qwen3_vl_checkpoint
        return make_tiny_qwen3_vl_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.qwen3_vl.tiny_checkpoint import make_bench_qwen3_vl_checkpoint
        return make_bench_qwen3_vl_checkpoint(path, seed, **overrides)

    @property
    def reference(self) -> Any:
        return importlib.import_module("vlm_sdk.models.qwen3_vl.reference")


FAMILY = Qwen3VLSpec()
