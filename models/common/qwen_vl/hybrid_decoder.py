"""Qwen3.5's language model (transformers' `Qwen3_5TextModel` / `Qwen3_5MoeTextModel`): pre-norm layers
whose token mixer is, per `layer_types`, a Gated DeltaNet (`linear_attention`: a state layer, on the state
cache kind) or a gated full attention (`full_attention`: partial interleaved M-RoPE, output gate, on the
paged KV cache), published as `[3 x linear + 1 x full]` blocks; then an MLP: SwiGLU (Qwen3.5) or routed
experts with a sigmoid-gated shared expert (Qwen3.5-MoE: every layer sparse). Every RMSNorm, the final
one too, is zero-centred (`x * (1 + w)`, Qwen3_5RMSNorm).

    x -> norm -> linear_attn (vlm_sdk/layers/gated_delta_net.py)  | self_attn (vlm_sdk/layers/gated_attention.py)
      -> + residual -> norm -> mlp (SwiGLU | vlm_sdk/layers/shared_expert_moe.py) -> + residual

`cache_specs` says what each layer keeps: a `StateSpec` (its conv and recurrent state per request) or an
`AttentionSpec` (its K/V per token); the engine groups them (protocol/cache_layout.py). Layer i reads
`caches[i]` and `meta.layer(i)`. The decoder is not a `DecoderStack`: piecewise graphs split around
attention calls, and three layers in four have none (the worker runs every step through `forward`).

Tensor parallelism: each mixer splits its heads (see the layers), the MLP its width (the routed experts
theirs, or whole experts under expert parallelism); one all-reduce after each mixer and each MLP.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlm_sdk.attention.metadata import StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.rotary_torch import check_mrope_section
from vlm_sdk.layers.gated_attention import GatedAttention, GatedAttentionConfig
from vlm_sdk.layers.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig
from vlm_sdk.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vlm_sdk.layers.moe import MoeConfig
from vlm_sdk.layers.norm import RMSNorm
from vlm_sdk.layers.ops import KernelOps, TorchOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.layers.shared_expert_moe import SharedExpertMoeBlock
from vlm_sdk.models.pipeline import IntermediateTensors, PPMissingLayer
from vlm_sdk.models.common.decoder_ends import DecoderEnds
from vlm_sdk.protocol.cache_spec import AttentionSpec, LayerCacheSpec
from vlm_sdk.weight_loading import ParamSlot, SplitSlot

LINEAR, FULL = "linear_attention", "full_attention"
_DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding when the config names none


@dataclass(frozen=True)
class HybridDecoderConfig:
    """The decoder's shape. The size fields the engine's memory inputs read (num_layers, hidden_size,
    num_heads, num_kv_heads, head_dim of the attention layers, vocab_size, intermediate_size of a dense
    MLP: 0 when every layer is sparse, moe, quantization) are named as `LlamaDecoderConfig`'s."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's; 0 with experts
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    attention: GatedAttentionConfig
    linear: GatedDeltaNetConfig
    moe: MoeConfig | None = None  # every layer's routed experts (Qwen3.5-MoE)
    shared_expert_intermediate_size: int = 0
    quantization: None = None  # float checkpoints only (from_hf refuses a quantization_config)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @classmethod
    def from_hf(cls, text: Any, tie_word_embeddings: bool, quantized: bool = False) -> "HybridDecoderConfig":
        """From a Qwen3.5 / Qwen3.5-MoE text config as transformers parses config.json (either layout: its
        `rope_parameters` hold what the published file spells beside them). `CheckpointError` naming the
        field for a variant this decoder does not implement."""
        if quantized:
            raise CheckpointError("config.json has a quantization_config: this model family loads float "
                                  "checkpoints only (BF16 / FP16 / FP32); use the unquantized checkpoint")
        act = getattr(text, "hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"config.json text_config.hidden_act {act!r}: the MLP is SwiGLU ('silu')")
        if not getattr(text, "attn_output_gate", True):
            raise CheckpointError("config.json text_config.attn_output_gate is false: the full-attention layers "
                                  "are implemented with their output gate only (as transformers' Qwen3_5Attention)")
        kinds = tuple(getattr(text, "layer_types", None) or ())
        if len(kinds) != text.num_hidden_layers or set(kinds) - {LINEAR, FULL}:
            raise CheckpointError(f"config.json text_config.layer_types {list(kinds)} must name one of "
                                  f"{LINEAR!r} / {FULL!r} for each of its num_hidden_layers={text.num_hidden_layers}")
        attention = GatedAttentionConfig.from_hf(text)
        section = attention.mrope_section or _DEFAULT_MROPE_SECTION
        try:  # transformers interleaves whatever the config says
            check_mrope_section(section, True, attention.rotary_dim // 2)
        except ValueError as e:
            raise CheckpointError(f"{e}; fix text_config.rope_parameters.mrope_section in config.json") from None
        attention = dataclasses.replace(attention, mrope_section=tuple(section), mrope_interleaved=True)
        moe, shared = _experts(text)
        return cls(vocab_size=text.vocab_size, hidden_size=text.hidden_size,
                   intermediate_size=0 if moe else int(text.intermediate_size), rms_norm_eps=text.rms_norm_eps,
                   tie_word_embeddings=tie_word_embeddings, layer_types=kinds, attention=attention,
                   linear=GatedDeltaNetConfig.from_hf(text), moe=moe, shared_expert_intermediate_size=shared)


def _experts(text: Any) -> tuple[MoeConfig | None, int]:
    """(the routed experts, the shared expert's width) of a Qwen3.5-MoE text config; (None, 0) for a dense
    one. Its router always renormalises the top k (Qwen3_5MoeTopKRouter) and every layer is sparse."""
    experts = getattr(text, "num_experts", None) or 0
    if not experts:
        return None, 0
    fields = {k: getattr(text, k, None) for k in ("num_experts_per_tok", "moe_intermediate_size",
                                                  "shared_expert_intermediate_size")}
    missing = [k for k, v in fields.items() if not v]
    if missing:
        raise CheckpointError(f"config.json text_config has num_experts={experts} but no {', '.join(missing)}")
    try:
        moe = MoeConfig(int(experts), int(fields["num_experts_per_tok"]), int(fields["moe_intermediate_size"]))
    except ValueError as e:
        raise CheckpointError(f"config.json text_config: {e}") from None
    return moe, int(fields["shared_expert_intermediate_size"])


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridDecoderConfig, index: int, dtype: torch.dtype, device: torch.device | str,
                 ops: KernelOps, parallel: ParallelGroups):
        super().__init__()
        self.ops, tp, h = ops, parallel.tp, cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        linear = cfg.layer_types[index] == LINEAR
        self.linear_attn = GatedDeltaNet(cfg.linear, ops, dtype, device, tp) if linear else None
        self.self_attn = None if linear else GatedAttention(cfg.attention, ops, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        if cfg.moe is not None:
            self.moe = SharedExpertMoeBlock(h, cfg.moe, cfg.shared_expert_intermediate_size, ops, dtype, device, tp,
                                            ep=parallel.ep)
        else:
            self.moe = None
            self.gate_up_proj = MergedColumnParallelLinear(h, [cfg.intermediate_size] * 2, False, dtype, device, tp)
            self.down_proj = RowParallelLinear(cfg.intermediate_size, h, False, dtype, device, tp)

    def forward(self, x: torch.Tensor,  # [N, hidden]: the previous layer's MLP output
                residual: torch.Tensor | None,  # [N, hidden]: the residual stream before it; None for layer 0
                rope: Any, cache: tuple[torch.Tensor, ...], meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); `cache` and `meta` are this layer's
        (state tensors and `StateMetadata`, or its (K, V) and its group's `AttentionMetadata`)."""
        ops, norm, post = self.ops, self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, normed = x, ops.rms_norm(x, norm.weight, norm.eps, zero_centered=True)
        else:
            normed, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps, zero_centered=True)
        if self.linear_attn is not None:
            mixed = self.linear_attn(normed, cache, meta)  # [N, hidden]
        else:
            mixed = self.self_attn(normed, rope, cache, meta)  # [N, hidden]
        normed, residual = ops.add_rms_norm(mixed, residual, post.weight, post.eps, zero_centered=True)
        if self.moe is not None:
            return self.moe(normed), residual
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(normed))), residual

    def slots(self, src: str, dst: str) -> dict[str, ParamSlot | SplitSlot]:
        """The published names under `src` (`...layers.N.`) -> this rank's slices under `dst`."""
        h = self.input_layernorm.weight.shape[0]
        out: dict[str, ParamSlot | SplitSlot] = {
            f"{src}input_layernorm.weight": ParamSlot(f"{dst}input_layernorm.weight", (h,)),
            f"{src}post_attention_layernorm.weight": ParamSlot(f"{dst}post_attention_layernorm.weight", (h,))}
        mixer, name = (self.linear_attn, "linear_attn") if self.linear_attn is not None else (self.self_attn, "self_attn")
        out.update({k: s.under(f"{dst}{name}.") for k, s in mixer.slots(f"{src}{name}.").items()})
        if self.moe is not None:
            out.update(self.moe.slots(f"{src}mlp.", f"{dst}moe."))
        else:
            out.update(self.gate_up_proj.slots(f"{dst}gate_up_proj.", [f"{src}mlp.gate_proj.weight",
                                                                        f"{src}mlp.up_proj.weight"]))
            out.update(self.down_proj.slots(f"{dst}down_proj.", f"{src}mlp.down_proj.weight"))
        return out


class HybridDecoder(DecoderEnds):
    position_rows = 3  # M-RoPE: temporal, height, width
    pipeline_stages = True  # builds and runs one stage's layers under pipeline parallelism (models/pipeline.py)

    def __init__(self, cfg: HybridDecoderConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", ops: KernelOps | None = None,
                 parallel: ParallelGroups = ParallelGroups()):
        super().__init__()
        self.cfg, self.ops = cfg, ops or TorchOps()
        self._init_ends(cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings, dtype, device, parallel.tp,
                        parallel.pp)
        # pipeline parallelism: this stage's layers; another stage's is a placeholder keeping only its cache
        # kind (its state spec, read from the layer built on the meta device), so every stage's layout is
        # the whole model's
        self.start_layer, self.end_layer = parallel.pp.layer_range(cfg.num_layers)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, dtype, device, self.ops, parallel)
                                    if self.start_layer <= i < self.end_layer else
                                    _missing(HybridDecoderLayer(cfg, i, dtype, "meta", self.ops, parallel), i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = cfg.attention.rotary(device)  # the rotated dims' angles, shared by the attention layers
        self.hidden_size = cfg.hidden_size
        self.requires_grad_(False)

    def cache_specs(self, num_kv_heads: int, kv_dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Each layer's cache (this rank's shapes): its Gated DeltaNet state, or its K/V over `num_kv_heads`."""
        full = AttentionSpec(num_kv_heads, self.cfg.head_dim, str(kv_dtype).removeprefix("torch."))
        return [(layer.state_spec or full) if isinstance(layer, PPMissingLayer) else
                full if layer.linear_attn is None else layer.linear_attn.cache_spec() for layer in self.layers]

    def forward(self, inputs_embeds: torch.Tensor,  # [N, hidden]
                positions: torch.Tensor,  # [3, N]
                caches: list[tuple[torch.Tensor, ...]], meta: StepMetadata,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:  # [N, hidden]
        """Pipeline parallelism: a later stage starts from `intermediate`; one before the last returns its own."""
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(self.layers)} decoder layers")
        x, residual = (inputs_embeds, None) if intermediate is None else (intermediate.hidden, intermediate.residual)
        rope = self.ops.rotary_inputs(positions, self.rotary, x.dtype)  # shared by every attention layer
        for i in range(self.start_layer, self.end_layer):
            x, residual = self.layers[i](x, residual, rope, caches[i], meta.layer(i))
        if not self.pp.is_last:
            return IntermediateTensors(x, residual)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps, zero_centered=True)[0]

    def checkpoint_map(self, prefix: str, lm_head: str) -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint name (published, under `prefix`, e.g. "model.language_model.") -> this rank's slice;
        our parameter names are relative to this module."""
        out: dict[str, ParamSlot | SplitSlot] = {} if self.embed_tokens is None else dict(
            self.embed_tokens.slots("embed_tokens.weight", f"{prefix}embed_tokens.weight"))
        out[f"{prefix}norm.weight"] = ParamSlot("norm.weight", (self.cfg.hidden_size,))
        if self.lm_head is not None:
            out.update(self.lm_head.slots("lm_head.weight", lm_head))
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, PPMissingLayer):  # another stage's: skipped on load (models/pipeline.py)
                out.update(layer.slots(f"{prefix}layers.{i}.", f"layers.{i}."))
        return out


def _missing(meta_layer: "HybridDecoderLayer", index: int) -> PPMissingLayer:
    """Another stage's layer: no weights, its state spec kept (None: an attention layer)."""
    missing = PPMissingLayer(index)
    missing.state_spec = None if meta_layer.linear_attn is None else meta_layer.linear_attn.cache_spec()
    return missing
