"""Qwen3.5 (dense): the Qwen3.5 architecture (models/common/qwen_vl/qwen3_5_model.py) with a SwiGLU MLP in
every layer; a config with experts is the MoE family's (models/qwen3_5_moe/)."""
from __future__ import annotations

from typing import Any

from vlm_sdk.errors import CheckpointError
from vlm_sdk.models.common.qwen_vl.qwen3_5_model import Qwen3_5VLM


class Qwen3_5ForCausalLM(Qwen3_5VLM):
    def __init__(self, hf_config: Any, *args, **kwargs):
        super().__init__(hf_config, *args, **kwargs)
        if self.decoder_config.moe is not None:
            raise CheckpointError("config.json text_config declares experts (num_experts): that is a Qwen3.5-MoE "
                                  "checkpoint, architectures Qwen3_5MoeForConditionalGeneration")
