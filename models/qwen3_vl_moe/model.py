"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B): the Qwen3-VL architecture (Qwen3-VL's model too:
models/common/qwen_vl/deepstack_model.py, the vision tower with DeepStack mergers, interleaved M-RoPE,
q/k norm) whose decoder routes each sparse layer's MLP through experts (`LlamaDecoderConfig.moe`, a
`SparseMoeBlock` per sparse layer: vlm_sdk/layers/moe.py).

Checkpoints: the published names (`model.language_model.*`, `model.visual.*`, `lm_head.weight`) with
the experts in any of the three layouts of models/common/fused_experts.py (transformers 5's fused
tensors, the published repos' transposed fused tensors, or one tensor per expert), loaded strictly.

Tensor parallelism: as Qwen3-VL's, and each expert split along its intermediate dim (one all-reduce
per layer, as the dense MLP): `moe_intermediate_size` must divide by the ranks, which the executor's
size check names with the sizes that work. With expert parallelism (`enable_expert_parallel`) each rank
holds num_experts / tp whole experts instead (vlm_sdk/layers/moe.py) and loads only their tensors;
num_experts must divide by the ranks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.models.common.qwen_vl.deepstack_model import DeepStackVLM
from vlm_sdk.models.common.fused_experts import only_experts, split_fused_experts


class Qwen3VLMoeForCausalLM(DeepStackVLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups(),
                 shard_vision: bool = True):
        super().__init__(hf_config, dtype, device, ops, parallel, shard_vision)
        if self.decoder_config.moe is None:
            raise CheckpointError("config.json text_config declares no experts (num_experts): a Qwen3-VL-MoE "
                                  "checkpoint needs num_experts, num_experts_per_tok and moe_intermediate_size")

    @staticmethod
    def ties_embeddings(hf_config: Any) -> bool:
        """The top level of config.json decides, as transformers' `Qwen3VLMoeForConditionalGeneration` does:
        its text config defaults `tie_word_embeddings` to true, and the published configs set only the
        top level (false)."""
        return bool(getattr(hf_config, "tie_word_embeddings", False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        weights = split_fused_experts(weights, self.decoder_config.moe, self.hidden_size)
        blocks = [layer.moe for layer in self.decoder.layers if getattr(layer, "moe", None) is not None]  # this stage's
        if blocks and blocks[0].expert_parallel:  # this rank's experts only (the same in every layer)
            weights = only_experts(weights, blocks[0].expert_range())
        super().load_weights(weights, source=source)
