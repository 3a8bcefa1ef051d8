"""The contract between the model-agnostic engine and one model family."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_dim]


class VisionLanguageModel(nn.Module, ABC):
    """A vision tower plus a decoder that runs on the paged KV cache.

    Attributes the engine sizes the cache with: `num_layers`, `num_kv_heads`, `head_dim`,
    `hidden_size`, `vocab_size`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @abstractmethod
    def encode_images(self, pixel_values: torch.Tensor,  # [num_patches, patch_dim], images back to back
                      grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Image embeddings `[sum of image tokens, hidden_size]`, images in the order given; each image
        contributes grid_t*grid_h*grid_w/merge^2 rows, in the order its image tokens appear."""

    @abstractmethod
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens] -> [num_tokens, hidden_size]`."""

    @abstractmethod
    def forward(self, inputs_embeds: torch.Tensor,  # [num_tokens, hidden_size]
                positions: torch.Tensor,  # [3, num_tokens] int64 (M-RoPE t/h/w; text tokens repeat one value)
                kv_caches: list[KVCache],  # one per decoder layer
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden states `[num_tokens, hidden_size]`. Writes this step's K/V into the cache
        slots named by `meta.slot_mapping` before attending."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[num_sampled, hidden_size] -> [num_sampled, vocab_size]` float32; called only on the rows
        that are sampled."""

    @abstractmethod
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """{"language_model", "vision", "projector"}: every parameter once, for the memory reports
        (`vlm-sdk plan` and the engine's start-up breakdown). The projector (Qwen's patch merger,
        InternVL's mlp1) maps vision features to the LM width; "vision" is the tower without it."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        """Copy checkpoint tensors (published HF names) into the modules. Raises `CheckpointError`
        naming the tensor (and `source`, the checkpoint directory, when given) for a missing,
        unexpected or mis-shaped tensor; `vlm_sdk.model_loader.load_checked` does this from a
        `ParamSlot` map."""


class PromptProcessor(ABC):
    """What the engine needs from a family's prompt builder (`ModelFamily.processor_cls`).

    Built once per engine with `from_engine_args(tokenizer, image_processor, hf_config, args)`, which
    refuses image settings of another family with `InvalidRequestError` naming the setting. The
    engine sets the plain attribute `max_image_tokens` (its max_model_len) once it is known.
    """

    max_image_tokens: int | None

    @abstractmethod
    def __call__(self, messages) -> PromptInputs:
        """Validate messages, decode and preprocess images, render the chat template and expand each
        image placeholder to the image's tokens (typed errors for bad input)."""

    @abstractmethod
    def largest_image(self) -> ImageInput:
        """Zero pixels of the largest image the engine's image settings allow: the CUDA memory profile
        runs it through `encode_images`, and its first dim caps one vision-tower call."""

    @abstractmethod
    def image_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """Engine image settings (name -> value) that alone would make `prompt` fit `capacity` tokens,
        e.g. {"max_pixels": 200704} or {"max_dynamic_patch": 2}; {} when none does."""
