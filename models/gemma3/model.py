"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP tower (models/common/siglip.py), the average-pool
projector (projector.py) and the Gemma decoder (models/common/gemma_decoder.py) on the paged KV cache, with
1-D positions. Five of every six decoder layers attend over a sliding window: `cache_specs` says so.

Three spellings of the same tensors, all accepted (`canonical_name` maps them to the first):

    transformers 5 (in memory)  model.language_model.*  model.vision_tower.*  model.multi_modal_projector.*
                                lm_head.weight (only when untied)
    transformers 5.24 (saved)   language_model.model.*  vision_tower.*  multi_modal_projector.*
    published (4.50)            language_model.model.*  vision_tower.vision_model.*  multi_modal_projector.*
                                language_model.lm_head.weight (only when untied)

Tensor parallelism: `tp` shards the decoder and, when `shard_vision`, the SigLIP tower (its 16 heads
split); the projector is whole on every rank.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.model_loader import config_field, text_config
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.multimodal.pixels import images_to_device
from vlm_sdk.protocol.cache_spec import LayerCacheSpec
from vlm_sdk.weight_loading import ParamSlot
from vlm_sdk.models.base import LayerCache, StepImages
from vlm_sdk.models.common.gemma_config import GemmaDecoderConfig
from vlm_sdk.models.common.gemma_decoder import GemmaDecoder
from vlm_sdk.models.common.image_spans import image_key_limits
from vlm_sdk.models.common.siglip import SiglipVisionConfig, SiglipVisionTower
from vlm_sdk.models.gemma3.projector import Gemma3Projector
from vlm_sdk.models.common.lm_loading import DecoderVLM, finish_cpu_layout, load_with_lm_head
from vlm_sdk.models.pipeline import IntermediateTensors

# the saved and published spellings -> transformers 5's in-memory names (longest prefix first)
_ALIASES = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."),
            ("model.vision_tower.vision_model.", "model.vision_tower."), ("vision_tower.vision_model.", "model.vision_tower."),
            ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))
_LLM, _TOWER, _PROJECTOR = "model.language_model.", "model.vision_tower.", "model.multi_modal_projector."

def canonical_name(name: str) -> str:
    for old, new in _ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Gemma3Vision(nn.Module):
    """The tower and its projector: pixels `[B, 3, S, S]` -> `[B * tokens_per_image, text hidden]`."""

    def __init__(self, cfg: SiglipVisionConfig, text_hidden: int, tokens_per_image: int, dtype: torch.dtype,
                 device: torch.device | str, tp: TPGroup):
        super().__init__()
        self.tower = SiglipVisionTower(cfg, dtype, device, tp)
        self.projector = Gemma3Projector(cfg.hidden_size, text_hidden, cfg.grid, tokens_per_image, cfg.layer_norm_eps,
                                         dtype, device)
        self.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixels))


class Gemma3ForConditionalGeneration(DecoderVLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups(),
                 shard_vision: bool = True):
        super().__init__()
        text = text_config(hf_config)
        tied = config_field(hf_config, "tie_word_embeddings")
        tied = config_field(text, "tie_word_embeddings") if tied is None else tied
        cfg = GemmaDecoderConfig.from_hf(text, tie_word_embeddings=True if tied is None else bool(tied),
                                         quantization=quant_scheme(hf_config), quant_prefix=_LLM)
        self._init_decoder(cfg, dtype, device, ops, parallel, shard_vision, decoder_cls=GemmaDecoder)
        vision_cfg = SiglipVisionConfig.from_hf(config_field(hf_config, "vision_config") or {})
        self.tokens_per_image = int(config_field(hf_config, "mm_tokens_per_image") or 256)
        self.vision = self._build_vision(lambda group, dev: Gemma3Vision(vision_cfg, cfg.hidden_size,
                                                                         self.tokens_per_image, dtype, dev, group),
                                         device)
        self.requires_grad_(False)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: StepMetadata, images: StepImages | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """A step with image tokens attends bidirectionally within each image's run of them: every
        attention group's metadata carries the step's `key_limits` (models/common/image_spans.py). A
        later pipeline stage gets the image rows alone (their embeddings are in `intermediate`) and
        limits its keys the same way."""
        embeds = inputs_embeds
        if images is not None:
            if intermediate is None:
                embeds[images.rows] = images.embeds.to(embeds.dtype)  # [n, hidden] rows
            first = next(g for g in meta.groups if isinstance(g, AttentionMetadata))
            limits = image_key_limits(positions[0], images.rows, first.query_start_loc)  # [N] int32
            meta = StepMetadata(tuple(dataclasses.replace(g, key_limits=limits) if isinstance(g, AttentionMetadata)
                                      else g for g in meta.groups),
                                meta.layer_group)
        return self.decoder(embeds, positions[0], caches, meta, intermediate=intermediate)

    def stack_inputs(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                     images: StepImages | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None for a step with image tokens: their attention needs `forward`'s key limits."""
        return None if images is not None else (inputs_embeds, positions[0])

    def cache_specs(self, kv_dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Sliding-window KV for the local layers (window `sliding_window`), full KV for the global ones."""
        return self.decoder.cache_specs(kv_dtype)

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:  # [images * tokens, hidden]
        """Each image's `data` is one frame `[1, 3, S, S]` (a whole image or one pan-and-scan crop: uint8
        with `meta.pixel_lut`, or float), frames back to back."""
        side = self.vision.tower.cfg.image_size
        bad = [list(im.data.shape) for im in images if tuple(im.data.shape[1:]) != (3, side, side)]
        if bad:
            raise ValueError(f"Gemma 3 encode_images takes [frames, 3, {side}, {side}] pixels, got shapes {bad}")
        tables = [getattr(im.meta, "pixel_lut", None) for im in images]
        pixels = images_to_device([im.data for im in images], tables, self.decoder.embed_tokens.weight.device,
                                  self.dtype)  # [frames, 3, S, S]
        return self.vision(pixels)

    def _vision_parts(self) -> tuple[nn.Module, nn.Module]:
        return self.vision, self.vision.projector

    def checkpoint_map(self) -> dict[str, ParamSlot]:
        """transformers 5's names (`canonical_name` turns the published ones into them) -> slots."""
        slots = {name: s.under("decoder.") for name, s in self.decoder.checkpoint_map(_LLM, "lm_head.weight").items()}
        slots.update({name: s.under("vision.tower.") for name, s in self.vision.tower.checkpoint_map(_TOWER).items()})
        slots.update({name: s.under("vision.projector.") for name, s in self.vision.projector.slots(_PROJECTOR).items()})
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        load_with_lm_head(self, self.decoder, weights, self.checkpoint_map(), lm_head="lm_head.weight",
                          canonical=canonical_name, source=source)
        finish_cpu_layout(self, self.decoder)

