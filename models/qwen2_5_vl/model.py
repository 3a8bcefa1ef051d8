"""Qwen2.5-VL: the vision tower plus the Llama-style decoder (Qwen2 config) with M-RoPE, on the paged KV cache.

Checkpoint names are the published ones (`model.layers.*`, `visual.blocks.*`, `lm_head.weight`);
checkpoints saved by transformers 4.5x as `model.language_model.*` / `model.visual.*` are accepted too.
q/k/v and gate/up are fused on load (see `LlamaDecoder` and `Qwen2_5_VisionTransformer.checkpoint_map`).

Tensor parallelism: `tp` shards the decoder; the vision tower (its merger included) is sharded with the
same group when `shard_vision`, else each rank holds and runs the whole tower (`DecoderVLM._build_vision`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.weight_loading import ParamSlot
from vlm_sdk.models.lm_loading import DecoderVLM, finish_cpu_layout, load_with_lm_head
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.qwen2_5_vl.image_processor import pixels_to_device
from vlm_sdk.models.qwen2_5_vl.vision import Qwen2_5_VisionTransformer
from vlm_sdk.models.qwen2_5_vl.rope_index import MRopePositions, prompt_positions_at
from vlm_sdk.multimodal.inputs import ImageInput

_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def _canonical(name: str) -> str:
    """The published name of a checkpoint tensor (transformers 4.5x spellings -> published ones)."""
    for old, new in _ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class QwenVLM(DecoderVLM):
    """What Qwen2.5-VL and Qwen3-VL share: M-RoPE positions computed once per prompt by the processor, an
    LLM and a `visual` tower loaded from the published layout (`lm_prefix`, `vision_prefix`, `lm_head`;
    `canonical_name` maps other spellings of the names to it)."""
    position_rows = 3  # M-RoPE: temporal, height, width
    lm_prefix, vision_prefix, lm_head = "model.", "visual.", "lm_head.weight"

    def canonical_name(self, name: str) -> str:
        return name

    def positions(self, prompt_positions: MRopePositions | None, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions `[3, end - start]`: the prompt's (`MRopePositions`, computed once by the
        processor), then index + rope_delta on all three axes for generated tokens."""
        return prompt_positions_at(prompt_positions, start, end)

    def checkpoint_map(self) -> dict[str, ParamSlot]:
        """Published checkpoint name -> slot, parameter names relative to this module."""
        slots = {name: s.under("decoder.") for name, s in self.decoder.checkpoint_map(self.lm_prefix, self.lm_head).items()}
        slots.update({name: s.under("visual.") for name, s in self.visual.checkpoint_map(self.vision_prefix).items()})
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        load_with_lm_head(self, self.decoder, weights, self.checkpoint_map(), lm_head=self.lm_head,
                          canonical=self.canonical_name, source=source)
        finish_cpu_layout(self, self.decoder)


class Qwen2_5_VLForCausalLM(QwenVLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, tp: TPGroup = TPGroup(), shard_vision: bool = True):
        super().__init__()
        text = hf_config.text_config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        cfg = LlamaDecoderConfig.from_hf(text, tie_word_embeddings=tied, mrope=True,
                                         quantization=quant_scheme(hf_config), quant_prefix=self.lm_prefix)
        self._init_decoder(cfg, dtype, device, ops, tp, shard_vision)
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
