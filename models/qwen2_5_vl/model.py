"""Qwen2.5-VL: the vision tower plus the Qwen2 decoder with M-RoPE, on the paged KV cache.

Checkpoint names are the published ones (`model.layers.*`, `visual.blocks.*`, `lm_head.weight`);
checkpoints saved by transformers 4.5x as `model.language_model.*` / `model.visual.*` are accepted too.
q/k/v and gate/up are fused on load (see `Qwen2Decoder` and `Qwen2_5_VisionTransformer.checkpoint_map`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import torch

from vlm_sdk.engine.attention_metadata import AttentionMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.model_loader import ParamSlot, load_checked
from vlm_sdk.models.cpu_layout import PackedLMHead, column_major, use_cpu_weight_layout
from vlm_sdk.models.base import KVCache, VisionLanguageModel
from vlm_sdk.models.qwen2.decoder import Qwen2Decoder, Qwen2DecoderConfig
from vlm_sdk.models.qwen2_5_vl.vision import Qwen2_5_VisionTransformer

logger = logging.getLogger(__name__)

_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def _canonical(name: str) -> str:
    """The published name of a checkpoint tensor (transformers 4.5x spellings -> published ones)."""
    for old, new in _ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Qwen2_5_VLForCausalLM(VisionLanguageModel):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        text = hf_config.text_config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        self.decoder_config = Qwen2DecoderConfig.from_hf(text, tie_word_embeddings=tied, mrope=True)
        self.decoder = Qwen2Decoder(self.decoder_config, dtype, device)
        self.visual = Qwen2_5_VisionTransformer(hf_config.vision_config, dtype, device)
        if self.visual.out_hidden_size != self.decoder_config.hidden_size:
            raise CheckpointError(f"vision_config.out_hidden_size {self.visual.out_hidden_size} != text hidden_size "
                                  f"{self.decoder_config.hidden_size}")
        cfg = self.decoder_config
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.dtype = dtype
        self.requires_grad_(False)

    def encode_images(self, pixel_values: torch.Tensor,  # [num_patches, patch_dim]
                      grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:  # [image tokens, hidden]
        return self.visual(pixel_values, grid_thw)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.decoder(inputs_embeds, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.compute_logits(hidden)

    def checkpoint_map(self) -> dict[str, ParamSlot]:
        """Published checkpoint name -> slot, parameter names relative to this module."""
        slots = {name: ParamSlot(f"decoder.{s.param}", s.shape, s.row_start)
                 for name, s in self.decoder.checkpoint_map("model.", "lm_head.weight").items()}
        slots.update({name: ParamSlot(f"visual.{s.param}", s.shape, s.row_start)
                      for name, s in self.visual.checkpoint_map("visual.").items()})
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        self._load(weights, source)
        use_cpu_weight_layout(self)
        dec = self.decoder
        head = dec.embed_tokens.weight if dec.lm_head is None else dec.lm_head.weight
        dec.packed_head = PackedLMHead.create(head)
        if dec.packed_head is None and dec.lm_head is None and head.device.type == "cpu":
            # the tied matrix serves the LM head every step and the embedding lookup rarely: favour the head
            dec.embed_tokens.weight = column_major(head)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], source: str | Path | None) -> None:
        if self.decoder.lm_head is not None:
            load_checked(self, weights, self.checkpoint_map(), canonical=_canonical, source=source)
            return
        # Tied: the checkpoint may still carry lm_head.weight. A copy of the embedding is dropped; a
        # different matrix is used as the head, as transformers does (it then leaves the two untied).
        head: list[torch.Tensor] = []

        def without_head():
            for name, tensor in weights:
                if _canonical(name) == "lm_head.weight":
                    head.append(tensor)
                else:
                    yield name, tensor

        load_checked(self, without_head(), self.checkpoint_map(), canonical=_canonical, source=source)
        if head:
            expected = tuple(self.decoder.embed_tokens.weight.shape)
            if tuple(head[0].shape) != expected:
                where = f" in {source}" if source is not None else ""
                raise CheckpointError(f"tensor lm_head.weight{where} has shape {list(head[0].shape)} but "
                                      f"{type(self).__name__} expects {list(expected)} (tied to the token "
                                      f"embedding): config.json does not match the weights")
            emb = self.decoder.embed_tokens.weight
            if not torch.equal(head[0].to(emb.device, emb.dtype), emb):  # checkpoint tensors are on the CPU
                logger.warning("config.json ties lm_head to the token embedding but the checkpoint's lm_head.weight "
                               "differs from it; using the checkpoint's lm_head.weight (as transformers does)")
                self.decoder.untie_lm_head(head[0])
