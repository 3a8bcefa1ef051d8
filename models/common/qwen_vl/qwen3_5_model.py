"""The Qwen3.5 architecture (transformers' `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration`): the Qwen3-VL vision tower without DeepStack levels
(qwen3_vision.py) and the hybrid decoder (hybrid_decoder.py: Gated DeltaNet state layers and gated
full-attention layers, a dense or a routed + shared-expert MLP). `Qwen3_5VLM` is the model of both
families (models/qwen3_5/model.py, models/qwen3_5_moe/model.py); neither imports the other.

Positions and prompts are the Qwen3-VL tower's (M-RoPE computed once per prompt by the processor; videos
with a timestamp before each temporal patch), so the engine, the encoder cache, chunked prefill and
preemption see what they see for Qwen3-VL. What differs is what the layers keep: `cache_specs` gives
each Gated DeltaNet layer its state (the engine's state slots and prefix checkpoints) and each attention
layer its K/V (a quarter of the layers in the published configs).

Checkpoints: the published names (`model.language_model.*`, `model.visual.*`, `lm_head.weight`, which
transformers 5 also writes), loaded strictly; the experts of the MoE layers in any layout of
models/common/fused_experts.py. The multi-token-prediction head the published checkpoints carry
(`mtp.*`: one extra decoder layer, its fc and norms) is a draft model for speculative decoding, which
this engine does not run yet: its tensors are skipped by that prefix and counted in the load log, never
read (`MTP_PREFIX`).

Tensor parallelism: the decoder's heads and widths split (hybrid_decoder.py); the vision tower is sharded
with the same group when `shard_vision` and it splits, else whole on every rank.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.models.common.fused_experts import only_experts, split_fused_experts
from vlm_sdk.models.common.qwen_vl.hybrid_decoder import HybridDecoder, HybridDecoderConfig
from vlm_sdk.models.common.qwen_vl.image_processor import pixels_to_device
from vlm_sdk.models.common.qwen_vl.model import QwenVLM
from vlm_sdk.models.common.qwen_vl.qwen3_vision import Qwen3VLVisionTransformer
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.protocol.cache_spec import LayerCacheSpec

logger = logging.getLogger(__name__)

MTP_PREFIX = "mtp."  # the published checkpoints' multi-token-prediction head (module docstring)


class Qwen3_5VLM(QwenVLM):
    lm_prefix, vision_prefix = "model.language_model.", "model.visual."  # transformers 5's layout, as published

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups(),
                 shard_vision: bool = True):
        super().__init__()
        # the top level of config.json ties the head, as transformers' PreTrainedModel.tie_weights reads it
        cfg = HybridDecoderConfig.from_hf(hf_config.text_config, bool(getattr(hf_config, "tie_word_embeddings", False)),
                                          quantized=quant_scheme(hf_config) is not None)
        self._init_decoder(cfg, dtype, device, ops, parallel, shard_vision, decoder_cls=HybridDecoder)
        self.visual = self._build_vision(
            lambda group, dev: Qwen3VLVisionTransformer(hf_config.vision_config, dtype, dev, ops, group), device)
        if self.visual.deepstack_visual_indexes:
            raise CheckpointError(f"config.json vision_config.deepstack_visual_indexes "
                                  f"{list(self.visual.deepstack_visual_indexes)}: this architecture's tower has no "
                                  f"DeepStack levels (the published configs say [])")
        if self.visual.out_hidden_size != cfg.hidden_size:
            raise CheckpointError(f"vision_config.out_hidden_size {self.visual.out_hidden_size} != text hidden_size "
                                  f"{cfg.hidden_size}")
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.requires_grad_(False)

    def cache_specs(self, kv_dtype: torch.dtype) -> list[LayerCacheSpec]:
        return self.decoder.cache_specs(self.num_kv_heads, kv_dtype)

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:  # [image tokens, hidden]
        """Each image's `data` `[patches, patch_dim]` and `meta.grid_thw` (a `QwenImage`)."""
        device = self.decoder.embed_tokens.weight.device
        pixels = pixels_to_device(images, self.visual.temporal_patch_size, device, self.dtype)  # [patches, patch_dim]
        merged, _ = self.visual(pixels, [im.meta.grid_thw for im in images])
        return merged

    def decoder_stack(self) -> None:
        return None  # state layers have no attention call to split a piecewise graph around

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        weights = _without_mtp(weights)
        moe = self.decoder_config.moe
        if moe is not None:
            weights = split_fused_experts(weights, moe, self.hidden_size)
            routed = self.decoder.layers[self.decoder.start_layer].moe.routed  # this stage's first layer
            if routed.expert_parallel:  # this rank's experts only (the same in every layer)
                weights = only_experts(weights, routed.expert_range())
        super().load_weights(weights, source=source)

    def _vision_parts(self) -> tuple[nn.Module, nn.Module]:
        return self.visual, self.visual.projector


def _without_mtp(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`weights` without the multi-token-prediction head's tensors (unread), logged with their count."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(MTP_PREFIX):
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info("skipped the checkpoint's %d multi-token-prediction tensors (%s*): speculative decoding is not "
                    "run, so its draft head is not loaded", skipped, MTP_PREFIX)
