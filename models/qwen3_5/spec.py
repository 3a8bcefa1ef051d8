"""The Qwen3.5 family (dense: Qwen3.5-0.8B ... 27B): `FAMILY`, named in `vlm_sdk.models.registry`.

Everything but the decoder is the Qwen3-VL tower's, held in models/common/qwen_vl/: images, video,
settings, the prompt processor, the planner's image sizing (`Qwen3VLTowerSpec`). The model is the Qwen3.5
architecture (models/common/qwen_vl/qwen3_5_model.py): Gated DeltaNet state layers and gated
full-attention layers. Importing this module imports no model code.
"""
from __future__ import annotations

from vlm_sdk.models.common.qwen_vl.spec import Qwen3VLTowerSpec


class Qwen3_5Spec(Qwen3VLTowerSpec):
    name = "qwen3_5"
    display_name = "Qwen3.5"

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_5.model import Qwen3_5ForCausalLM
        return Qwen3_5ForCausalLM


FAMILY = Qwen3_5Spec()
