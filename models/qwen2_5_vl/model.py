"""Qwen2.5-VL: the vision tower plus the Llama-style decoder (Qwen2 config) with M-RoPE, on the paged KV cache.

Checkpoint names are the published ones (`model.layers.*`, `visual.blocks.*`, `lm_head.weight`);
checkpoints saved by transformers 4.5x as `model.language_model.*` / `model.visual.*` are accepted too.
q/k/v and gate/up are fused on load (see `LlamaDecoder` and `Qwen2_5_VisionTransformer.checkpoint_map`).

Tensor parallelism: `parallel.tp` shards the decoder; the vision tower (its merger included) is sharded with the
same group when `shard_vision`, else each rank holds and runs the whole tower (`DecoderVLM._build_vision`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.common.qwen_vl.image_processor import pixels_to_device
from vlm_sdk.models.common.qwen_vl.model import QwenVLM
from vlm_sdk.models.qwen2_5_vl.vision import Qwen2_5_VisionTransformer
from vlm_sdk.multimodal.inputs import ImageInput

_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def _canonical(name: str) -> str:
    """The published name of a checkpoint tensor (transformers 4.5x spellings -> published ones)."""
    for old, new in _ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Qwen2_5_VLForCausalLM(QwenVLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups(),
                 shard_vision: bool = True):
        super().__init__()
        text = hf_config.text_config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        cfg = LlamaDecoderConfig.from_hf(text, tie_word_embeddings=tied, mrope=True,
                                         quantization=quant_scheme(hf_config), quant_prefix=self.lm_prefix)
        self._init_decoder(cfg, dtype, device, ops, parallel, shard_vision)
        self.visual = self._build_vision(
            lambda group, dev: Qwen2_5_VisionTransformer(hf_config.vision_config, dtype, dev, ops, group), device)
        if self.visual.out_hidden_size != self.decoder_config.hidden_size:
            raise CheckpointError(f"vision_config.out_hidden_size {self.visual.out_hidden_size} != text hidden_size "
                                  f"{self.decoder_config.hidden_size}")
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.requires_grad_(False)

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:  # [image tokens, hidden]
        """Each image's `data` `[patches, patch_dim]` and `meta.grid_thw` (a `QwenImage`)."""
        device = self.decoder.embed_tokens.weight.device
        pixels = pixels_to_device(images, self.visual.temporal_patch_size, device, self.dtype)  # [patches, patch_dim]
        return self.visual(pixels, [im.meta.grid_thw for im in images])

    def canonical_name(self, name: str) -> str:
        return _canonical(name)

    def _vision_parts(self) -> tuple[nn.Module, nn.Module]:
        return self.visual, self.visual.merger
