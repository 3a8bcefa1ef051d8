"""The Qwen2.5-VL family: `FAMILY`, named in `vlm_sdk.models.registry`.

Images are resized to a multiple of 28 pixels between min_pixels and max_pixels (`smart_resize`);
one image token per 28x28 pixels. Engine settings: min_pixels, max_pixels (defaults: the
preprocessor config's); an image part may set its own. The planner sizes images by max_pixels.
All of that is the Qwen-VL families' (models/common/qwen_vl/spec.py); the model is this family's.
Importing this module imports no model code.
"""
from __future__ import annotations

from vlm_sdk.models.common.qwen_vl.spec import QwenVLSpec


class Qwen2_5_VLSpec(QwenVLSpec):
    name = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen2_5_vl.model import Qwen2_5_VLForCausalLM
        return Qwen2_5_VLForCausalLM


FAMILY = Qwen2_5_VLSpec()
