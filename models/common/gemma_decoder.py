"""The Gemma decoder on the paged KV cache (Gemma 3's `Gemma3TextModel`): what sets it apart from the
Llama-style decoder (models/common/llama_decoder.py) is

    embedding         the lookup times sqrt(hidden), the factor rounded to the model's dtype first
                      (transformers' `Gemma3TextScaledWordEmbedding`: 55.4256 becomes 55.5 in bfloat16)
    norms             RMSNorm scaled by (1 + weight), in float32 and rounded once (`KernelOps.rms_norm(...,
                      zero_centered=True)`)
    sandwich norms    x + post_attention_norm(attn(input_norm(x))), then
                      x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
    q / k norms       a (1 + weight) RMSNorm over each head's head_dim before RoPE
    attention scale   query_pre_attn_scalar ** -0.5 (168 in the 27B: not head_dim's 128)
    MLP               GeGLU: gelu_tanh(gate) * up
    layer types       sliding-window layers (a query at p reads keys p - W < k <= p) and global ones,
                      each type with its own RoPE (local base 1e4; global 1e6 with the linear factor 8
                      of the published 4B / 12B / 27B configs); `cache_specs` declares the window
    logits            tied to the embedding; cap * tanh(logits / cap) where the config sets
                      final_logit_softcapping (no published Gemma 3 does)

Fused projections as the Llama decoder's: qkv_proj = q | k | v rows, gate_up_proj = gate | up rows (this
rank's). The residual stream is carried as (layer output, stream before it), the next norm adding them,
so each layer splits around its attention call (`pre_attention` / `post_attention`: the `DecoderStack`
contract of models/base.py). Tensor parallelism as the Llama decoder's: heads split, o_proj and down_proj
row-parallel (two all-reduces a layer), the vocab-parallel embedding and the gathered logits.
"""
from __future__ import annotations

import torch
from torch import nn

from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.models.pipeline import IntermediateTensors, PPMissingLayer
from vlm_sdk.layers.attention import PagedAttention
from vlm_sdk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlm_sdk.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vlm_sdk.layers.norm import RMSNorm
from vlm_sdk.layers.ops import KernelOps, TorchOps
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.layers.quantized_linear import linear_layer
from vlm_sdk.layers.rotary import MRotaryEmbedding, RotaryInputs
from vlm_sdk.protocol.cache_spec import AttentionSpec
from vlm_sdk.weight_loading import ParamSlot
from vlm_sdk.models.common.gemma_config import GemmaDecoderConfig
from vlm_sdk.models.common.llama_decoder import kv_scale_slots
from vlm_sdk.models.common.lm_head import DecoderHead, attention_slots

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaDecoderConfig, dtype: torch.dtype, device: torch.device | str, ops: KernelOps,
                 tp: TPGroup, index: int):
        super().__init__()
        self.ops = ops
        self.layer_type = cfg.layer_types[index]
        hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, name = cfg.quantization, f"{cfg.quant_prefix}layers.{index}."
        qkv_cls = linear_layer(QKVParallelLinear, q, f"{name}self_attn.q_proj")
        o_cls = linear_layer(RowParallelLinear, q, f"{name}self_attn.o_proj")
        gate_up_cls = linear_layer(MergedColumnParallelLinear, q, f"{name}mlp.gate_proj")
        down_cls = linear_layer(RowParallelLinear, q, f"{name}mlp.down_proj")
        for norm in _NORMS:
            setattr(self, norm, RMSNorm(hidden, cfg.rms_norm_eps, dtype, device))
        self.qkv_proj = qkv_cls(hidden, d, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, dtype, device, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)  # per head: replicated under TP
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.window = cfg.sliding_window if cfg.is_sliding(index) else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, cfg.query_pre_attn_scalar ** -0.5,
                                   ops.attention, device, window=self.window)
        self.o_proj = o_cls(cfg.num_heads * d, hidden, cfg.attention_bias, dtype, device, tp)
        self.gate_up_proj = gate_up_cls(hidden, [inter, inter], False, dtype, device, tp)
        self.down_proj = down_cls(inter, hidden, False, dtype, device, tp)
        for proj in (self.qkv_proj, self.o_proj):
            if isinstance(proj, nn.Linear):  # the float layers: the kernel set's few-row product
                proj.matmul = ops.small_m_linear

    def cache_spec(self, kv_dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, str(kv_dtype).removeprefix("torch."), self.window)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict[str, RotaryInputs],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        store = (kv_cache, meta.slot_mapping) if self.ops.fuses_rotary_store else None
        q, k, v, residual = self.pre_attention(x, residual, rope, store)
        return self.post_attention(self.attn(q, k, v, kv_cache, meta, stored=store is not None), residual)

    def pre_attention(self, x: torch.Tensor,  # [N, hidden]: the previous layer's output
                      residual: torch.Tensor | None,  # [N, hidden]: the stream before it; None for layer 0
                      rope: dict[str, RotaryInputs],  # the step's rotary inputs per layer type
                      store: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, H, D], k [N, Hkv, D], v [N, Hkv, D], the residual stream [N, hidden]): input norm, qkv,
        q / k norms, this layer type's RoPE (stored into the cache too when `store`: the fused launch)."""
        ops, n, eps = self.ops, x.shape[0], self.input_layernorm.eps
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if residual is None:
            residual, normed = x, ops.rms_norm(x, self.input_layernorm.weight, eps, zero_centered=True)
        else:
            normed, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, eps, zero_centered=True)
        qkv = self.qkv_proj(normed).view(n, h + 2 * hkv, d)  # [N, H+2Hkv, D]
        qkv[:, :h] = ops.rms_norm(qkv[:, :h].reshape(-1, d), self.q_norm.weight, eps, zero_centered=True).view(n, h, d)
        qkv[:, h:h + hkv] = ops.rms_norm(qkv[:, h:h + hkv].reshape(-1, d), self.k_norm.weight, eps,
                                         zero_centered=True).view(n, hkv, d)
        layer_rope = rope[self.layer_type]
        if store is not None:
            ops.rotary_store_kv(qkv, h, hkv, layer_rope, None, *store, kv_scales=(self.attn.k_scale, self.attn.v_scale))
            return qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:], residual
        qk = ops.rotary(qkv[:, :h + hkv], h, layer_rope)  # [N, H+Hkv, D]
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv:], residual

    def post_attention(self, attn: torch.Tensor,  # [N, H, D]
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, hidden] x 2
        """o_proj, its post norm, the add + pre-feedforward norm, GeGLU, its post norm: (the MLP branch's
        output, the residual stream before it)."""
        ops, n, eps = self.ops, attn.shape[0], self.input_layernorm.eps
        o = self.o_proj(attn.reshape(n, self.num_heads * self.head_dim))  # [N, hidden]
        o = ops.rms_norm(o, self.post_attention_layernorm.weight, eps, zero_centered=True)
        normed, residual = ops.add_rms_norm(o, residual, self.pre_feedforward_layernorm.weight, eps, zero_centered=True)
        mlp = self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(normed)))
        return ops.rms_norm(mlp, self.post_feedforward_layernorm.weight, eps, zero_centered=True), residual


class GemmaDecoder(DecoderHead, nn.Module):
    """A `DecoderStack` (models/base.py) with the interface `lm_loading.load_with_lm_head` and
    `finish_cpu_layout` use (`embed_tokens`, `lm_head`, `packed_head`, `untie_lm_head`, `tp`). Under
    pipeline parallelism it holds one stage's layers (another stage's is a `PPMissingLayer` keeping its
    cache spec), the embedding on the first stage (and the last when tied), the head on the last."""
    pipeline_stages = True

    def __init__(self, cfg: GemmaDecoderConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, parallel: ParallelGroups = ParallelGroups()):
        super().__init__()
        tp, pp = parallel.tp, parallel.pp
        self.cfg, self.tp, self.pp = cfg, tp, pp
        self.ops = ops or TorchOps()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device, tp) \
            if pp.is_first or (pp.is_last and cfg.tie_word_embeddings) else None
        # transformers rounds sqrt(hidden) to the weight's dtype before the product
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device),
                             persistent=False)
        self.start_layer, self.end_layer = pp.layer_range(cfg.num_layers)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, dtype, device, self.ops, tp, i)
                                    if self.start_layer <= i < self.end_layer else
                                    _missing(GemmaDecoderLayer(cfg, dtype, "meta", self.ops, tp, i), i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = nn.ModuleDict({t: _rotary(cfg, t, device) for t in sorted(set(cfg.layer_types))})
        self.lm_head = None if cfg.tie_word_embeddings or not pp.is_last else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype,
                                                                           device, tp)
        self.packed_head = None
        self.logit_softcap = cfg.final_logit_softcapping
        self.hidden_size, self.position_rows = cfg.hidden_size, 1  # the DecoderStack contract
        self.requires_grad_(False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.embed_tokens(input_ids) * self.normalizer

    def cache_specs(self, kv_dtype: torch.dtype) -> list[AttentionSpec]:
        return [layer.cache_spec(kv_dtype) for layer in self.layers]

    def forward(self, inputs_embeds: torch.Tensor,  # [N, hidden], the image rows in place
                positions: torch.Tensor,  # [N]
                caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: StepMetadata,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """`meta`: the step's metadata per cache group; layer i reads `meta.layer(i)` (a sliding-window
        layer its window's group's). Pipeline parallelism: a later stage starts from `intermediate`; a
        stage before the last returns its own (models/pipeline.py)."""
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(self.layers)} decoder layers")
        x, residual = (inputs_embeds, None) if intermediate is None else (intermediate.hidden, intermediate.residual)
        rope = self.rotary_inputs(positions, x.dtype)
        for i in range(self.start_layer, self.end_layer):
            x, residual = self.layers[i](x, residual, rope, caches[i], meta.layer(i))
        if not self.pp.is_last:
            return IntermediateTensors(x, residual)
        return self.final_norm(x, residual)

    def rotary_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, RotaryInputs]:
        """The step's rotary inputs of each layer type, shared by the layers of that type."""
        return {t: self.ops.rotary_inputs(positions, r, dtype) for t, r in self.rotary.items()}

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [N, hidden] x 2 -> [N, hidden]
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps, zero_centered=True)[0]

    def checkpoint_map(self, prefix: str, lm_head: str = "lm_head.weight") -> dict[str, ParamSlot]:
        """Checkpoint name -> this rank's slot (relative to this module), transformers' Gemma 3 names under
        `prefix` (e.g. "model.language_model.": `{prefix}layers.N.self_attn.q_proj.weight`)."""
        cfg = self.cfg
        hid, d = cfg.hidden_size, cfg.head_dim
        out = self.head_slots(prefix, lm_head)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PPMissingLayer):  # another stage's: skipped on load
                continue
            src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
            out.update(attention_slots(layer, src, dst, cfg.attention_bias, cfg.attention_bias))
            out.update(layer.gate_up_proj.slots(f"{dst}gate_up_proj.", [f"{src}mlp.gate_proj.weight",
                                                                        f"{src}mlp.up_proj.weight"]))
            out.update(layer.down_proj.slots(f"{dst}down_proj.", f"{src}mlp.down_proj.weight"))
            for norm in _NORMS:
                out[f"{src}{norm}.weight"] = ParamSlot(f"{dst}{norm}.weight", (hid,))
            out[f"{src}self_attn.q_norm.weight"] = ParamSlot(f"{dst}q_norm.weight", (d,))
            out[f"{src}self_attn.k_norm.weight"] = ParamSlot(f"{dst}k_norm.weight", (d,))
            out.update(kv_scale_slots(src, f"{dst}attn."))
        return out


def _missing(meta_layer: GemmaDecoderLayer, index: int) -> PPMissingLayer:
    """Another stage's layer: no weights; its cache spec (sliding window or full) kept for the layout."""
    missing = PPMissingLayer(index)
    missing.cache_spec = meta_layer.cache_spec
    return missing


def _rotary(cfg: GemmaDecoderConfig, layer_type: str, device: torch.device | str) -> MRotaryEmbedding:
    """The plain RoPE of one layer type; "linear" scaling divides its frequencies by the factor, as
    transformers' `_compute_linear_scaling_rope_parameters` does."""
    rope = cfg.rope[layer_type]
    rotary = MRotaryEmbedding(cfg.head_dim, rope.theta, None, device)
    if rope.linear_factor != 1.0:
        rotary.inv_freq.div_(rope.linear_factor)
    return rotary
