"""The Qwen3-VL family: `FAMILY`, named in `vlm_sdk.models.registry`.

Images are resized to a multiple of 32 pixels between min_pixels and max_pixels (Qwen2-VL's
`smart_resize` at patch 16, merge 2); one image token per 32x32 pixels. The prompt side is Qwen2.5-VL's
(the same special tokens, the same placeholder expansion, and `get_rope_index` gives still images the
same positions), so the processor, the too-long fixes and the planner's image sizing are Qwen2.5-VL's
on this family's image processor, but for videos (timestamp text before each temporal patch:
processor.py); the model (DeepStack, interleaved M-RoPE, q/k norm) is its own.
Engine settings: min_pixels, max_pixels (defaults: the preprocessor config's); an image part may set
its own. The planner sizes images by max_pixels.
Importing this module imports no model code.
"""
from __future__ import annotations

from typing import Any

from vlm_sdk.models.qwen2_5_vl.spec import Qwen2_5_VLSpec, pixel_settings, qwen_video_settings


class Qwen3VLSpec(Qwen2_5_VLSpec):
    name = "qwen3_vl"
    display_name = "Qwen3-VL"
    engine_settings = image_settings = pixel_settings(32)  # an image part's own bounds win over the engine's
    video_settings = qwen_video_settings(32)

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl.model import Qwen3VLForCausalLM
        return Qwen3VLForCausalLM

    @property
    def image_processor_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl.image_processor import Qwen3VLImageProcessor
        return Qwen3VLImageProcessor

    @property
    def processor_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl.processor import Qwen3VLProcessor
        return Qwen3VLProcessor


FAMILY = Qwen3VLSpec()
