"""The Qwen3-VL family: `FAMILY`, named in `vlm_sdk.models.registry`.

Images are resized to a multiple of 32 pixels between min_pixels and max_pixels (Qwen2-VL's
`smart_resize` at patch 16, merge 2); one image token per 32x32 pixels. The prompt side is Qwen2.5-VL's
(the same special tokens, the same placeholder expansion, and `get_rope_index` gives still images the
same positions), so the processor, the too-long fixes and the planner's image sizing are the Qwen-VL
families' on the Qwen3-VL tower's image processor, but for videos (timestamp text before each temporal
patch): all of it `Qwen3VLTowerSpec` (models/common/qwen_vl/spec.py). The model (DeepStack, interleaved
M-RoPE, q/k norm) is models/qwen3_vl/model.py.
Engine settings: min_pixels, max_pixels (defaults: the preprocessor config's); an image part may set
its own. The planner sizes images by max_pixels.
Importing this module imports no model code.
"""
from __future__ import annotations

from vlm_sdk.models.common.qwen_vl.spec import Qwen3VLTowerSpec


class Qwen3VLSpec(Qwen3VLTowerSpec):
    name = "qwen3_vl"
    display_name = "Qwen3-VL"

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl.model import Qwen3VLForCausalLM
        return Qwen3VLForCausalLM


FAMILY = Qwen3VLSpec()
