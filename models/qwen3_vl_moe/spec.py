"""The Qwen3-VL-MoE family: `FAMILY`, named in `vlm_sdk.models.registry`.

Everything but the decoder's MLP is Qwen3-VL's, held in models/common/qwen_vl/ for both families:
images, settings, the prompt processor, the planner's image sizing (`Qwen3VLTowerSpec`). The model
routes the sparse layers through experts (models/qwen3_vl_moe/model.py). Importing this module imports
no model code.
"""
from __future__ import annotations

from vlm_sdk.models.common.qwen_vl.spec import Qwen3VLTowerSpec


class Qwen3VLMoeSpec(Qwen3VLTowerSpec):
    name = "qwen3_vl_moe"
    display_name = "Qwen3-VL-MoE"

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl_moe.model import Qwen3VLMoeForCausalLM
        return Qwen3VLMoeForCausalLM


FAMILY = Qwen3VLMoeSpec()
