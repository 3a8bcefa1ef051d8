"""The contract between the model-agnostic engine and one model family."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from vlm_sdk.attention.metadata import StepMetadata
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.protocol.cache_spec import AttentionSpec, LayerCacheSpec

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_dim]
# one layer's cache: its (K, V) pair (an attention layer), or its state tensors in spec order, each
# [num_state_slots, *shape] (a state layer)
LayerCache = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class MediaPart:
    """One image or video part of a prompt as the user sent it, over the prompt's items (`PromptInputs.images`):
    an image may be several items (Gemma 3's pan-and-scan crops), a video is one item per temporal patch
    or frame. `frames`: the video's sampled frames (1 for an image); `grid`: the family's patch grid
    (Qwen: (t, h, w) before merging, as transformers' image/video_grid_thw), None where it has none."""
    kind: str  # "image" or "video"
    items: tuple[int, ...]  # indices into PromptInputs.images, ascending
    frames: int = 1
    grid: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepImages:
    """The image-token rows of one step (chunked prefill may carry any part of an image): which rows
    of the packed step they are, and their rows of `encode_images`' output."""
    rows: torch.Tensor  # [n] int64 on the model's device: indices into the step's packed tokens
    embeds: torch.Tensor  # [n, width] the images' rows, width as `encode_images` returns it


@runtime_checkable
class DecoderLayerHalves(Protocol):
    """One decoder layer split around its attention call. `pre_attention(x, residual, rope)` -> (q [N, H, D],
    k [N, Hkv, D], v [N, Hkv, D], residual [N, hidden]); `attn(q, k, v, kv_cache, meta)` stores the
    step's K/V and attends ([N, H, D]; `meta` is the layer's group's, `StepMetadata.layer(i)`); `post_attention(attn_out, residual)` -> (x, residual), the layer's
    output and the residual stream before it (the next layer's norm adds them). Row-wise apart from
    `attn`: the halves depend on the token count only, so they can be captured per token count."""
    num_heads: int  # this rank's
    num_kv_heads: int  # this rank's
    head_dim: int
    attn: Any

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Any) -> tuple[torch.Tensor, ...]:
        ...

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


@runtime_checkable
class DecoderStack(Protocol):
    """The model contract's decoder, as the worker may run it from outside (piecewise CUDA graphs) and
    size it (the memory profile): every layer split around attention (`DecoderLayerHalves`), the rotary
    inputs computed once per step from the positions (`[3, N]` when `position_rows` is 3, else `[N]`),
    and the final norm of (last layer's output, residual). Running

        rope = stack.rotary_inputs(positions, dtype); x, residual = embeds, None
        for i, (layer, cache) in enumerate(zip(stack.layers, caches)):
            q, k, v, residual = layer.pre_attention(x, residual, rope)
            x, residual = layer.post_attention(layer.attn(q, k, v, cache, meta.layer(i)), residual)
        hidden = stack.final_norm(x, residual)

    must equal the model's `forward` on the `stack_inputs` of a step."""
    layers: Sequence[DecoderLayerHalves]
    hidden_size: int
    position_rows: int

    def rotary_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        ...

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        ...


class VisionLanguageModel(nn.Module, ABC):
    """A vision tower plus a decoder that runs on the paged KV cache.

    What each decoder layer keeps between steps is its cache spec (`cache_specs`: full attention by
    default; sliding-window KV or a fixed-size state where a family says so), from which the engine,
    the memory package and every rank size and allocate the caches. Attributes: `num_layers`,
    `num_kv_heads`, `head_dim` (the attention layers'), `hidden_size`, `vocab_size`. `position_rows`
    (1, or 3 for M-RoPE) is the first dim of the positions `forward` takes; `positions()` makes them
    from the prompt.

    Under tensor parallelism (a model built with `parallel=ParallelGroups(TPGroup(rank, size, group))`)
    every rank runs every method on the same inputs and gets the same outputs (`encode_images`,
    `embed_tokens`, `forward` and `compute_logits` are whole on every rank: the layers all-reduce and gather);
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

    def cache_specs(self, kv_dtype: torch.dtype) -> list[LayerCacheSpec]:
        """One spec per decoder layer, this rank's shapes (vlm_sdk/protocol/cache_spec.py): what the layer
        keeps between steps. `kv_dtype` is the KV cache's (the model's, float8 e4m3 with
        kv_cache_dtype="fp8", or torch.int8 / torch.int4 naming an int8 / int4 cache's pages: the spec's
        dtype string carries it); a state layer names its own tensors' dtypes. Default: every layer full
        attention over `num_kv_heads` x `head_dim`."""
        spec = AttentionSpec(self.num_kv_heads, self.head_dim, str(kv_dtype).removeprefix("torch."))
        return [spec] * self.num_layers

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
                caches: list[LayerCache],  # caches[i]: decoder layer i's, as its cache spec says
                meta: StepMetadata,
                images: StepImages | None = None) -> torch.Tensor:
        """Final-norm hidden states `[num_tokens, hidden_size]`. The image rows of this step replace
        the embeddings of their image tokens (`inputs_embeds` may be written in place). Layer i reads
        `meta.layer(i)`, its cache group's metadata: an attention layer writes this step's K/V into the
        slots its `slot_mapping` names before attending; a state layer reads and writes its requests'
        state slots in place."""

    def decoder_stack(self) -> DecoderStack | None:
        """The decoder as a `DecoderStack`, for the worker's piecewise CUDA graphs; None (the default):
        a family whose decoder is its own runs every step through `forward` (eager, and whole-graph
        decode steps), and the engine says so at start-up when piecewise graphs were asked for."""
        return None

    def stack_inputs(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                     images: StepImages | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's (embeddings with its image rows in place, positions as `decoder_stack()` takes
        them), so that running the stack equals `forward`; None when the step needs `forward` itself
        (e.g. features added between layers). Only called when `decoder_stack()` is not None."""
        return None

    def set_aux_hidden_layers(self, layers: tuple[int, ...]) -> None:
        """EAGLE-3 drafts (models/common/eagle3_draft.py): from now on every `forward` keeps the residual stream
        entering each of these decoder layers (vLLM's `aux_hidden_state_layers`), for `aux_hidden_states`.
        Default: refused, naming the family (its decoder keeps no such states)."""
        raise InvalidRequestError(f"speculative_config method='eagle3' reads the target's hidden states at layers "
                                  f"{list(layers)}, and {type(self).__name__}'s decoder does not hand them out: use "
                                  f"method='ngram', or leave speculative_config out", param="speculative_config")

    def aux_hidden_states(self) -> torch.Tensor | None:
        """`[num_tokens, len(layers) * hidden_size]`: the last forward's states at the layers set above, in
        their order (None when none are set)."""
        return None

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[num_sampled, hidden_size] -> [num_sampled, vocab_size]` float32 (the whole vocab on every
        rank under tensor parallelism); called only on the rows that are sampled. `out`: a float32
        `[num_sampled, vocab_size]` to write them into (the decode graphs' static buffer), returned."""

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
    `max_image_tokens` (its max_model_len) once it is known, and `pixel_workers` (a
    `multimodal.pixel_workers.PixelWorkers`) when its images are preprocessed in worker processes.
    """

    max_image_tokens: int | None
    pixel_workers = None  # None: images are decoded and resized on the thread that builds the prompt

    def run_pixels(self, image, max_image_pixels: int, fn, *args):
        """`fn(load_image(image), *args)` for an `OpenedImage`: in a worker process when the engine gave
        this processor `pixel_workers`, else here. `fn` is a module-level function (it may be pickled by
        reference) returning tensors and plain values; it decodes, resizes and patchifies, so that the
        prompt-building thread keeps only the cheap work (options, checks, the `ImageInput`)."""
        if self.pixel_workers is not None:
            return self.pixel_workers.run(image, max_image_pixels, fn, *args)
        return fn(load_image(image, max_image_pixels=max_image_pixels), *args)

    def preprocess_image(self, ref) -> list[ImageInput]:
        """One image part (a `multimodal.messages.ImageRef`) alone, as a prompt's image 0: its options and
        checks, decode, resize and patchify, without a template or tokenizer (the preprocessing benchmark's
        unit, bench/preprocess_scaling.py). A family's `_image(index, ref)` does the work."""
        out = self._image(0, ref)
        return out if isinstance(out, list) else [out]

    @classmethod
    def from_engine_args(cls, tokenizer, image_processor, hf_config, args, family):
        """The processor for an engine's `EngineArgs`: `mm_processor_kwargs` is checked against
        `family.engine_settings` (another family's setting is refused here) and handed to the class as
        `settings_kwargs` says; `family` is the folder's `FamilySpec`, passed in so that the spec may
        import the processor's module and not the reverse."""
        options = family.engine_options(args.mm_processor_kwargs)
        return cls(tokenizer, image_processor, hf_config, max_image_pixels=args.max_image_pixels, family=family,
                   **cls.settings_kwargs(options))

    @classmethod
    def settings_kwargs(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The family's checked engine settings -> this class's keyword arguments (default: none)."""
        return {}

    @abstractmethod
    def __call__(self, messages, template_kwargs: Mapping[str, Any] | None = None) -> PromptInputs:
        """Validate messages, decode and preprocess images, render the chat template (given
        `template_kwargs` as variables: the request's tools, its chat_template_kwargs) and expand each
        image placeholder to the image's tokens (typed errors for bad input)."""

    @abstractmethod
    def text_prompt(self, token_ids: list[int]) -> PromptInputs:
        """The prompt of these token ids as they are (a raw text's or a token-id prompt's, already
        checked against the vocabulary): no chat template, no images, the family's positions for
        plain text. The image placeholder token is refused (`multimodal.inputs.refuse_placeholders`)."""

    @abstractmethod
    def largest_image(self) -> ImageInput:
        """Zero pixels of the largest image the engine's image settings allow: the CUDA memory profile
        runs it through `encode_images`, and its `size` caps one vision-tower call."""

    def video_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int | float]:
        """Video part settings (name -> value) that alone, set on every video part of the request, would
        make `prompt` fit `capacity` tokens, e.g. {"total_pixels": 90000, "max_frames": 16}; {} (the
        default) when none does or the family has none."""
        return {}

    def media_parts(self, prompt: PromptInputs) -> list[MediaPart]:
        """The prompt's image and video parts in order, each over its items (the dry run's tokens per
        part, vLLM's per-item hashes and placeholder ranges). Default: every item is one image."""
        return [MediaPart("image", (i,)) for i in range(len(prompt.images))]

    @abstractmethod
    def image_setting_fixes(self, prompt: PromptInputs, capacity: int) -> dict[str, int]:
        """Engine image settings (name -> value) that alone would make `prompt` fit `capacity` tokens,
        e.g. {"max_pixels": 200704} or {"max_dynamic_patch": 2}; {} when none does."""
