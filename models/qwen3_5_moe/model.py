"""Qwen3.5-MoE: the Qwen3.5 architecture (models/common/qwen_vl/qwen3_5_model.py) whose every layer's MLP
is routed experts (the fused MoE op) plus a sigmoid-gated shared expert (vlm_sdk/layers/shared_expert_moe.py).

Tensor parallelism: each expert split along its width (moe_intermediate_size must divide by the ranks), or
whole experts per rank with expert parallelism (`enable_expert_parallel`: num_experts must divide); the
shared expert split as a dense MLP. The executor's size check names the sizes that work.
"""
from __future__ import annotations

from typing import Any

from vlm_sdk.errors import CheckpointError
from vlm_sdk.models.common.qwen_vl.qwen3_5_model import Qwen3_5VLM


class Qwen3_5MoeForCausalLM(Qwen3_5VLM):
    def __init__(self, hf_config: Any, *args, **kwargs):
        super().__init__(hf_config, *args, **kwargs)
        if self.decoder_config.moe is None:
            raise CheckpointError("config.json text_config declares no experts (num_experts): a Qwen3.5-MoE "
                                  "checkpoint needs num_experts, num_experts_per_tok, moe_intermediate_size and "
                                  "shared_expert_intermediate_size")
