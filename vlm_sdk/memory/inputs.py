"""What every memory consumer estimates from: `MemoryInputs`, one rank's view of the model and the
settings, read from the engine's own model built on the meta device (so `vlm-sdk plan`, from
config.json alone, and engine start-up read the same numbers)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.layers.moe import MoeConfig
from vlm_sdk.memory.weights import weight_bytes
from vlm_sdk.models.family import FamilySpec, ImageLimits
from vlm_sdk.protocol.cache_layout import CacheLayout, LayoutError
from vlm_sdk.protocol.cache_spec import AttentionSpec
from vlm_sdk.protocol.rank import WeightBytes


def profile_num_tokens(max_num_batched_tokens: int, max_position_embeddings: int) -> int:
    """Tokens of the profiled step: a full token budget, but no longer than one sequence may be."""
    return min(max_num_batched_tokens, max_position_embeddings)


@dataclass(frozen=True)
class MemoryInputs:
    """One rank's model and the settings that shape its steps. Widths are the whole model's (a rank's
    share is `// tp`), counts of KV heads and layers the rank's own."""
    args: EngineArgs
    dtype: torch.dtype
    tp: int
    on_gpu: bool  # memory is carved from a device budget (a GPU, or a planned device memory)
    decode_graphs: bool  # decode steps replay CUDA graphs: their pool stays allocated
    piecewise_graphs: bool  # steps with prefill rows replay piecewise graphs: their buffers and pool stay
    # the language model
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's; 0 when every layer is sparse (`moe`)
    num_heads: int  # the whole model's
    num_kv_heads_total: int  # the whole model's
    vocab_size: int
    position_rows: int
    max_position_embeddings: int
    weights: WeightBytes  # this rank's parameter bytes by part (packed tensors, scales and zeros of a
    # quantized checkpoint as they are held: they are the model's parameters)
    weight_format: str  # the LLM's Linear weights: "float", or the checkpoint's quantized format
    # the vision tower and the largest image the settings allow
    vision_hidden: int
    vision_intermediate: int
    vision_patch_inputs: int  # pixel values per vision row (a patch: channels x frames x patch x patch)
    image: ImageLimits
    video_item_tokens: int  # the largest item a video becomes (a temporal patch, a frame); 0: no video
    moe: MoeConfig | None = None  # the sparse layers' experts (vlm_sdk/memory/consumers/moe.py)
    moe_fp8: bool = False  # the experts are block-wise FP8 (the torch set dequantizes them per step)
    layout: CacheLayout | None = None  # the model's cache groups (`cache_specs`); None: one full-attention group

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's, or float8 e4m3 with kv_cache_dtype="fp8"."""
        return self.args.resolve_kv_cache_dtype(self.dtype)

    @property
    def profile_tokens(self) -> int:
        return profile_num_tokens(self.args.max_num_batched_tokens, self.max_position_embeddings)

    @property
    def held_vision_tokens(self) -> int:
        """Vision embeddings a prefilling request may hold during a step: the largest image, or a video's
        items that the step's chunk reaches plus one straddling each end of it (each item is encoded when
        a chunk reaches it and let go once prefill passes it: vlm_sdk/worker/step_images.py), no more
        than max_position_embeddings (not max_model_len: the cache is sized before it, and a shorter
        max_model_len changes no block count)."""
        if not self.video_item_tokens:
            return self.image.tokens
        reach = self.profile_tokens + 2 * self.video_item_tokens
        return max(self.image.tokens, min(reach, self.max_position_embeddings))

    @property
    def held_vision_text(self) -> str:
        held, reach = self.held_vision_tokens, self.profile_tokens + 2 * self.video_item_tokens
        if held == self.image.tokens:
            return f"{held:,} tokens (the largest image)"
        capped = ", at most max_position_embeddings" if held < reach else ""
        return (f"{held:,} tokens (a video's items within a step's reach: {self.profile_tokens:,} step tokens + "
                f"2 x {self.video_item_tokens}-token items{capped})")

    def forward_bytes(self, n: int) -> int:
        """The estimated activation peak of a decoder forward of n tokens on this rank: the residual stream
        and norms (4 x hidden), the dense MLP's gate and up (2 x intermediate) and q/k/v, in the model's
        dtype. The experts of sparse layers are their own consumer (consumers/moe.py)."""
        qkv = (self.num_heads + 2 * self.num_kv_heads_total) * self.head_dim
        return n * (4 * self.hidden_size + (2 * self.intermediate_size + qkv) // self.tp) * self.dtype_bytes


def memory_inputs(family: FamilySpec, info, args: EngineArgs, model, dtype: torch.dtype, tp: int, *, on_gpu: bool,
                  decode_graphs: bool, piecewise_graphs: bool) -> MemoryInputs:
    """`model`: the family's model as rank 0 of `tp` builds it, on the meta device (`FamilySpec.meta_model`);
    `info`: the checkpoint's config (`model_loader.read_config` / `read_checkpoint`)."""
    c = model.decoder_config
    dense = c.moe is None or not all(c.moe.is_sparse(i) for i in range(c.num_layers))
    vision_hidden, vision_inter, patch_inputs = family.vision_activation_widths(info.hf_config, model)
    image = family.image_limits(info.preprocessor, info.hf_config, model, dict(args.mm_processor_kwargs))
    layout = cache_layout(model, args.resolve_kv_cache_dtype(dtype))
    return MemoryInputs(
        args=args, dtype=dtype, tp=tp, on_gpu=on_gpu, decode_graphs=decode_graphs,
        # the worker runs no piecewise graphs over state layers (worker/piecewise_graphs.py)
        piecewise_graphs=piecewise_graphs and tp == 1 and model.decoder_stack() is not None and not layout.has_state,
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size if dense else 0, num_heads=c.num_heads,
        num_kv_heads_total=c.num_kv_heads, vocab_size=c.vocab_size, position_rows=model.position_rows,
        max_position_embeddings=int(family.text_config(info.hf_config).max_position_embeddings),
        weights=weight_bytes(model), weight_format=_weight_format(c), vision_hidden=vision_hidden,
        vision_intermediate=vision_inter, vision_patch_inputs=patch_inputs, image=image,
        video_item_tokens=family.video_item_tokens(info.preprocessor, info.hf_config, model), moe=c.moe,
        moe_fp8=c.moe is not None and c.quantization is not None, layout=layout)


def cache_layout(model, kv_dtype: torch.dtype) -> CacheLayout:
    """The model's cache groups (`cache_specs`, this rank's shapes); `InvalidRequestError` naming the model
    for specs that cannot share one block pool, or a head_dim the int4 KV cache cannot pack."""
    try:
        layout = CacheLayout.from_specs(model.cache_specs(kv_dtype))
    except LayoutError as e:
        raise InvalidRequestError(f"{type(model).__name__}: {e}") from None
    check_int_kv_head_dim(layout.page_spec)
    return layout


def check_int_kv_head_dim(page: AttentionSpec) -> None:
    """kv_cache_dtype='int4' packs element d and d + head_dim / 2 into one byte: an even head_dim only (every
    head_dim runs int8, and the Triton kernels take any head_dim: their tiles pad it to a power of 2)."""
    if page.quant_bits == 4 and page.head_dim % 2:
        raise InvalidRequestError(f"kv_cache_dtype='int4' packs two values a byte along the head: head_dim "
                                  f"{page.head_dim} is odd (supported: even head_dims, e.g. 64, 80, 128, 256); use "
                                  f"kv_cache_dtype='int8' (--kv-cache-dtype int8)", param="kv_cache_dtype")


def _weight_format(decoder_config) -> str:
    scheme = getattr(decoder_config, "quantization", None)
    return "float" if scheme is None else f"{scheme.description} (the vision tower, embeddings and LM head float)"
