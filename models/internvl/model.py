"""InternVL 2 / 2.5 / 3: InternViT + pixel shuffle + MLP projector, and a Qwen2, Llama or InternLM2 LLM
on the paged KV cache with plain 1-D RoPE.

Two checkpoint layouts, told apart by config.json `model_type`:

    "internvl"       transformers' InternVLForConditionalGeneration (the `-hf` checkpoints)
                     model.vision_tower.*  model.multi_modal_projector.*  model.language_model.*  lm_head.weight
                     (4.5x spellings vision_tower.*, multi_modal_projector.*, language_model.model.*,
                     language_model.lm_head.weight are accepted too)
    "internvl_chat"  the original InternVLChatModel (published InternVL2 / 2.5 / 3, remote code never imported)
                     vision_model.*  mlp1.*  language_model.model.*  language_model.lm_head.weight
                     (an InternLM2 LLM: language_model.model.tok_embeddings / attention.wqkv / ...,
                     language_model.output.weight; its grouped wqkv is unpacked while streaming)

Tensor parallelism: `parallel.tp` shards the decoder; InternViT and the mlp1 projector are sharded with the same
group when `shard_vision`, else each rank holds and runs them whole (`DecoderVLM._build_vision`; also
when the tower does not split: InternViT-6B, of InternVL2.5-78B, has 25 heads).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.model_loader import config_from_dict
from vlm_sdk.weight_loading import ParamSlot
from vlm_sdk.models.common.internlm2_weights import internlm2_decoder_config, internlm2_to_llama_names
from vlm_sdk.models.internvl.vision import InternVisionConfig, InternVLVisionTower
from vlm_sdk.models.common.lm_loading import DecoderVLM, finish_cpu_layout, load_with_lm_head
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.multimodal.pixels import images_to_device

# legacy spellings of the -hf layout -> transformers 5's in-memory names
_HF_ALIASES = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))
_LLM_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "InternLM2ForCausalLM")


def hf_canonical_name(name: str) -> str:
    """An -hf layout tensor name in transformers 5's in-memory spelling (the legacy spelling of 4.5x and of
    transformers 5's save_pretrained is accepted too)."""
    for old, new in _HF_ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _same(name: str) -> str:
    return name


def _llm_config(hf_config: Any, original: bool) -> tuple[Any, str]:
    """The LLM's config and its architecture name. In the original layout `llm_config` is a plain
    dict; transformers' own config class parses it where it knows the model_type (defaults included)."""
    if not original:
        return hf_config.text_config, getattr(hf_config.text_config, "model_type", "")
    raw = getattr(hf_config, "llm_config", None)
    if raw is None:
        raise CheckpointError("config.json (model_type internvl_chat) has no llm_config")
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    arch = (raw.get("architectures") or [""])[0]
    if arch not in _LLM_ARCHITECTURES:
        raise CheckpointError(f"config.json llm_config.architectures is {raw.get('architectures')}; supported "
                              f"InternVL LLMs: {', '.join(_LLM_ARCHITECTURES)}")
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
    if model_type in CONFIG_MAPPING and arch != "InternLM2ForCausalLM":
        return config_from_dict(fields, CONFIG_MAPPING[model_type]), arch
    return config_from_dict(fields), arch


class InternVLForCausalLM(DecoderVLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups(),
                 shard_vision: bool = True):
        """`ops` runs the decoder (the InternViT tiles are equal-length: batched SDPA serves them)."""
        super().__init__()
        self.original_layout = getattr(hf_config, "model_type", None) == "internvl_chat"
        llm, arch = _llm_config(hf_config, self.original_layout)
        self.internlm2 = arch == "InternLM2ForCausalLM"
        quantization = quant_scheme(hf_config)
        if self.internlm2:
            if quantization is not None:
                raise CheckpointError(f"a quantized InternLM2 LLM ({quantization.description}) is not supported: its "
                                      f"fused wqkv is packed per KV group; quantized InternVL checkpoints with a "
                                      f"Qwen2 or Llama LLM (e.g. InternVL3) are")
            self.decoder_config = internlm2_decoder_config(llm)
        else:
            # transformers ties by the top-level flag of InternVLConfig; the original model by llm_config's
            tie_source = llm if self.original_layout else hf_config
            tied = bool(getattr(tie_source, "tie_word_embeddings", False))
            prefix = "language_model.model." if self.original_layout else "model.language_model."
            self.decoder_config = LlamaDecoderConfig.from_hf(llm, tie_word_embeddings=tied, mrope=False,
                                                             quantization=quantization, quant_prefix=prefix)
        self._init_decoder(self.decoder_config, dtype, device, ops, parallel, shard_vision)  # 1-D RoPE (position_rows 1)
        vision_cfg = InternVisionConfig.from_hf(hf_config, self.hidden_size)
        self.vision = self._build_vision(lambda group, dev: InternVLVisionTower(vision_cfg, dtype, dev, group, ops),
                                         device)
        self.requires_grad_(False)

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:  # [tiles * tokens per tile, hidden]
        """Each image's `data` `[tiles, 3, S, S]` (the thumbnail included; uint8 with `meta.pixel_lut`, or
        float), images back to back."""
        if any(im.data.dim() != 4 for im in images):
            raise ValueError(f"InternVL encode_images takes [tiles, 3, S, S] pixels, got shapes "
                             f"{[list(im.data.shape) for im in images]}")
        tables = [getattr(im.meta, "pixel_lut", None) for im in images]  # [3, 256] each, for byte tiles
        return self.vision(images_to_device([im.data for im in images], tables,
                                            self.decoder.embed_tokens.weight.device, self.dtype))

    def _vision_parts(self) -> tuple[nn.Module, nn.Module]:
        return self.vision, self.vision.projector

    @property
    def _lm_head_name(self) -> str:
        return "language_model.lm_head.weight" if self.original_layout else "lm_head.weight"

    def checkpoint_map(self) -> dict[str, ParamSlot]:
        """Checkpoint name (InternLM2 names after `internlm2_to_llama_names`) -> slot, relative to this module."""
        prefix = "language_model.model." if self.original_layout else "model.language_model."
        slots = {name: s.under("decoder.")
                 for name, s in self.decoder.checkpoint_map(prefix, self._lm_head_name).items()}
        layout = "original" if self.original_layout else "hf"
        slots.update({name: s.under("vision.")
                      for name, s in self.vision.checkpoint_map(layout).items()})
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        if self.internlm2:
            weights = internlm2_to_llama_names(weights, self.decoder_config, prefix="language_model.",
                                               out_prefix="language_model.")
        canonical = _same if self.original_layout else hf_canonical_name
        load_with_lm_head(self, self.decoder, weights, self.checkpoint_map(), lm_head=self._lm_head_name,
                          canonical=canonical, source=source)
        finish_cpu_layout(self, self.decoder)
