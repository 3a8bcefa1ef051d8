"""The contract between the model-agnostic engine and one model family."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True)
class StepImages:
    """The image-token rows of one step (chunked prefill may carry any part of an image): which rows
    of the packed step they are, and their rows of `encode_images`' output."""
    rows: torch.Tensor  # [n] int64 on the model's device: indices into the step's packed tokens
    embeds: torch.Tensor  # [n, width] the images' rows, width as `encode_images` returns it


class VisionLanguageModel(nn.Module, ABC):
    """A vision tower plus a decoder that runs on the paged KV cache.

    Attributes the engine sizes the cache with: `num_layers`, `num_kv_heads`, `head_dim`,
    `hidden_size`, `vocab_size`. `position_rows` (1, or 3 for M-RoPE) is the first dim of the
    positions `forward` takes; `positions()` makes them from the prompt.

    Under tensor parallelism (a model built with `tp=TPGroup(rank, size, group)`) every rank runs
    every method on the same inputs and gets the same outputs (`encode_images`, `embed_tokens`,
    `forward` and `compute_logits` are whole on every rank: the layers all-reduce and gather);
    `num_kv_heads` is this rank's count, the heads its KV cache holds.
    """
    position_rows: int = 1

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @abstractmethod
    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:
        """Image embeddings `[sum of num_tokens, width]` in the model's dtype and device, images in the
        order given, each image's rows in the order its image tokens appear. Reads each image's `data`
        (float32, moved here) and the family's `meta`. `width` is hidden_size, or more for a family
        that carries more per image token into its decoder (DeepStack's features of earlier vision
        layers): the engine only caches, slices and hands back rows (`forward`'s `images`)."""

    def positions(self, prompt_positions: Any, start: int, end: int) -> torch.Tensor:
        """Positions `[position_rows, end - start]` int64 (host) of tokens start..end of a sequence whose
        prompt's processor left `prompt_positions` (`PromptInputs.positions`, None for none); tokens past
        the prompt are generated ones. Default: 1-D, the index."""
        return torch.arange(start, end).expand(self.position_rows, -1)

    @abstractmethod
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens] -> [num_tokens, hidden_size]`."""

    @abstractmethod
    def forward(self, inputs_embeds: torch.Tensor,  # [num_tokens, hidden_size], from `embed_tokens`
                positions: torch.Tensor,  # [position_rows, num_tokens] int64 (from `positions()`)
                kv_caches: list[KVCache],  # one per decoder layer
                meta: AttentionMetadata,
                images: StepImages | None = None) -> torch.Tensor:
        """Final-norm hidden states `[num_tokens, hidden_size]`. The image rows of this step replace
        the embeddings of their image tokens (`inputs_embeds` may be written in place). Writes this
        step's K/V into the cache slots named by `meta.slot_mapping` before attending."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[num_sampled, hidden_size] -> [num_sampled, vocab_size]` float32 (the whole vocab on every
        rank under tensor parallelism); called only on the rows that are sampled."""

    @abstractmethod
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """{"language_model", "vision", "projector"}: every parameter once, for the memory reports
        (`vlm-sdk plan` and the engine's start-up breakdown). The projector (Qwen's patch merger,
        InternVL's mlp1) maps vision features to the LM width; "vision" is the tower without it."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        """Copy checkpoint tensors (published HF names) into the modules. Raises `CheckpointError`
        naming the tensor (and `source`, the checkpoint directory, when given) for a missing,
        unexpected or mis-shaped tensor; `vlm_sdk.weight_loading.load_checked` does this from a
        `ParamSlot` map."""


class PromptProcessor(ABC):
    """What the engine needs from a family's prompt builder (`FamilySpec.processor_cls`).

    Built once per engine by `FamilySpec.make_processor` (`from_engine_args(tokenizer, image_processor,
    hf_config, args, family)`), which
    checks `args.mm_processor_kwargs` with its family's `engine_options` (another family's setting is
    refused with `InvalidRequestError` naming it). The engine sets the plain attribute
    `max_image_tokens` (its max_model_len) once it is known.
    """

    max_image_tokens: int | None

    @abstractmethod
    def __call__(self, messages, template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        """Validate messages, decode and preprocess images, render the chat template (given
        `template_kwargs` as variables: the request's tools, its chat_template_kwargs) and expand each
        image placeholder to the image's tokens (typed errors for bad input)."""

    @abstractmethod
    def largest_image(self) -> ImageInput:
        """Zero pixels of the largest image the engine's image settings allow: the CUDA memory profile
        runs it through `encode_images`, and its `size` caps one vision-tower call."""

    @abstractmethod
    def image_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """Engine image settings (name -> value) that alone would make `prompt` fit `capacity` tokens,
        e.g. {"max_pixels": 200704} or {"max_dynamic_patch": 2}; {} when none does."""
