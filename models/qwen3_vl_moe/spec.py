"""The Qwen3-VL-MoE family: `FAMILY`, named in `vlm_sdk.models.registry`.

Everything but the decoder's MLP is Qwen3-VL's (models/qwen3_vl/spec.py): images, settings, the
prompt processor, the planner's image sizing. The model routes the sparse layers through experts
(models/qwen3_vl_moe/model.py). Importing this module imports no model code.
"""
from __future__ import annotations

from vlm_sdk.models.qwen3_vl.spec import Qwen3VLSpec


class Qwen3VLMoeSpec(Qwen3VLSpec):
    name = "qwen3_vl_moe"
    display_name = "Qwen3-VL-MoE"

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_vl_moe.model import Qwen3VLMoeForCausalLM
        return Qwen3VLMoeForCausalLM


FAMILY = Qwen3VLMoeSpec()
