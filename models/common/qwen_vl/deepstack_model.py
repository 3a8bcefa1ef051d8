"""The Qwen3-VL architecture: the vision tower with DeepStack mergers (qwen3_vision.py) plus the Llama-style
decoder as Qwen3 configures it (q/k RMSNorm per head, no qkv bias) with interleaved M-RoPE, on the paged KV
cache. `DeepStackVLM` is Qwen3-VL's model (models/qwen3_vl/model.py) and the base of its MoE variant
(models/qwen3_vl_moe/model.py): both families build on it here, neither imports the other.

DeepStack through the engine. `encode_images` returns each image token's row as
`[merger output | DeepStack level 0 | level 1 | ...]`, `hidden * (1 + levels)` wide; the engine caches,
slices (chunked prefill, a prefix cached part-way into an image) and hands back rows of that width
(`StepImages`), so the features of every level travel with their image token through the encoder cache
and preemption. `forward` splits each row: the first `hidden` columns replace the image token's
embedding, level k is added to its hidden state after decoder layer k (`LlamaDecoder`'s `deepstack=`).

Checkpoint names are the published ones, which transformers 5 also writes: `model.language_model.*`,
`model.visual.*`, `lm_head.weight` (q/k/v and gate/up fused on load: `LlamaDecoder.checkpoint_map`).

Tensor parallelism: `parallel.tp` shards the decoder; the vision tower and its mergers are sharded with the same
group when `shard_vision`, else each rank holds and runs the whole tower (`DecoderVLM._build_vision`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_sdk.attention.metadata import StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.models.base import LayerCache, StepImages
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.common.qwen_vl.image_processor import pixels_to_device
from vlm_sdk.models.common.qwen_vl.model import QwenVLM
from vlm_sdk.models.common.qwen_vl.qwen3_vision import Qwen3VLVisionTransformer
from vlm_sdk.models.pipeline import IntermediateTensors
from vlm_sdk.multimodal.inputs import ImageInput


class DeepStackVLM(QwenVLM):
    """Qwen3-VL's model: `Qwen3VLVisionTransformer` and a Qwen3 decoder (`LlamaDecoder`, q/k norm), the
    DeepStack levels added after the first decoder layers. A subclass may change how config.json ties
    the embeddings (`ties_embeddings`) and add to loading (`load_weights`)."""
    lm_prefix, vision_prefix = "model.language_model.", "model.visual."  # transformers 5's layout, as published

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups(),
                 shard_vision: bool = True):
        super().__init__()
        text = hf_config.text_config
        cfg = LlamaDecoderConfig.from_hf(text, tie_word_embeddings=self.ties_embeddings(hf_config), mrope=True,
                                         quantization=quant_scheme(hf_config), quant_prefix=self.lm_prefix)
        if not cfg.qk_norm:
            raise CheckpointError(f"config.json text_config model_type {getattr(text, 'model_type', None)!r} is not a "
                                  f"Qwen3 LLM (q/k norm): Qwen3-VL needs one")
        self._init_decoder(cfg, dtype, device, ops, parallel, shard_vision)
        self.visual = self._build_vision(
            lambda group, dev: Qwen3VLVisionTransformer(hf_config.vision_config, dtype, dev, ops, group), device)
        if self.visual.out_hidden_size != cfg.hidden_size:
            raise CheckpointError(f"vision_config.out_hidden_size {self.visual.out_hidden_size} != text hidden_size "
                                  f"{cfg.hidden_size}")
        self.deepstack_levels = len(self.visual.deepstack_visual_indexes)
        if self.deepstack_levels > cfg.num_layers:
            raise CheckpointError(f"vision_config.deepstack_visual_indexes has {self.deepstack_levels} levels but the "
                                  f"LLM has {cfg.num_layers} layers to add them to")
        first_stage_layers = self.decoder.end_layer if parallel.pp.is_first else None
        if parallel.pp.size > 1 and parallel.pp.is_first and first_stage_layers < self.deepstack_levels:
            raise ValueError(f"the first pipeline stage holds {first_stage_layers} decoder layers but DeepStack adds "
                             f"vision features after the first {self.deepstack_levels}: give the first stage at "
                             f"least {self.deepstack_levels} layers (pp_layer_partition / --pp-layer-partition)")
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.requires_grad_(False)

    @staticmethod
    def ties_embeddings(hf_config: Any) -> bool:
        """Whether lm_head is the token embedding: either config.json level says so."""
        text = hf_config.text_config
        return bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:  # [image tokens, hidden * (1 + levels)]
        """Each image's `data` `[patches, patch_dim]` and `meta.grid_thw` (a `QwenImage`)."""
        device = self.decoder.embed_tokens.weight.device
        pixels = pixels_to_device(images, self.visual.temporal_patch_size, device, self.dtype)  # [patches, patch_dim]
        merged, levels = self.visual(pixels, [im.meta.grid_thw for im in images])
        return torch.cat([merged, *levels], dim=1)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: StepMetadata, images: StepImages | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        deepstack = None
        if images is not None and intermediate is None:  # a later pipeline stage: nothing to place
            hidden = self.hidden_size
            rows = images.embeds.to(inputs_embeds.dtype)  # [n, hidden * (1 + levels)]
            if rows.shape[1] != hidden * (1 + self.deepstack_levels):
                raise ValueError(f"image rows are {rows.shape[1]} wide; this model's encode_images gives "
                                 f"{hidden} * (1 + {self.deepstack_levels} DeepStack levels)")
            inputs_embeds[images.rows] = rows[:, :hidden]
            if self.deepstack_levels:
                deepstack = (images.rows, list(rows[:, hidden:].split(hidden, dim=1)))  # levels [n, hidden] each
        return self.decoder(inputs_embeds, positions, caches, meta, deepstack=deepstack, intermediate=intermediate)

    def stack_inputs(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                     images: StepImages | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Steps with image rows add DeepStack features between layers: those need `forward`."""
        if images is not None and self.deepstack_levels:
            return None
        return super().stack_inputs(inputs_embeds, positions, images)

    def _vision_parts(self) -> tuple[nn.Module, nn.Module]:
        return self.visual, self.visual.projector
