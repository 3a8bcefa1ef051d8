"""The Qwen3.5-MoE family (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): `FAMILY`, named in
`vlm_sdk.models.registry`.

Everything but the decoder's MLP is Qwen3.5's, held in models/common/qwen_vl/ for both families: the
Qwen3-VL tower's images, video, settings and prompt processor (`Qwen3VLTowerSpec`), the hybrid decoder
(models/common/qwen_vl/qwen3_5_model.py); each layer's MLP is routed experts plus a sigmoid-gated shared
expert. Importing this module imports no model code.
"""
from __future__ import annotations

from vlm_sdk.models.common.qwen_vl.spec import Qwen3VLTowerSpec


class Qwen3_5MoeSpec(Qwen3VLTowerSpec):
    name = "qwen3_5_moe"
    display_name = "Qwen3.5-MoE"

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.qwen3_5_moe.model import Qwen3_5MoeForCausalLM
        return Qwen3_5MoeForCausalLM


FAMILY = Qwen3_5MoeSpec()
