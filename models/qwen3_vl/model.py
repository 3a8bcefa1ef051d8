"""Qwen3-VL's model: the Qwen3-VL architecture (models/common/qwen_vl/deepstack_model.py: the vision tower
with DeepStack mergers, a Qwen3 decoder with interleaved M-RoPE and q/k norm) as it stands. Its MoE
variant builds on the same base (models/qwen3_vl_moe/model.py)."""
from __future__ import annotations

from vlm_sdk.models.common.qwen_vl.deepstack_model import DeepStackVLM


class Qwen3VLForCausalLM(DeepStackVLM):
    """Qwen3-VL (dense): `DeepStackVLM`; lm_head is tied when either level of config.json says so."""
