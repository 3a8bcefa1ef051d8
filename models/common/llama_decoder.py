"""The Llama-style decoder on the paged KV cache: embedding, pre-norm attention + SwiGLU layers, final
norm, LM head. Qwen2, Qwen3, Llama and InternLM2 configure it (`LlamaDecoderConfig`,
models/common/llama_config.py); Qwen2.5-VL adds M-RoPE over three position axes, Qwen3-VL interleaved
M-RoPE, the others use plain RoPE (`mrope_section=None`). Qwen3 (`qk_norm`) RMS-normalises each q and k
head before RoPE: the kernel set does it with the rotation (`KernelOps.rotary`).

DeepStack (Qwen3-VL): `forward(..., deepstack=(rows, features))` adds `features[i]` to the residual
stream at `rows` after layer i, as transformers' `Qwen3VLTextModel._deepstack_process` does.

Qwen3-MoE (`cfg.moe`): a sparse layer's MLP is a `SparseMoeBlock` (vlm_sdk/layers/moe.py: router and
experts, one all-reduce under tensor parallelism) in place of gate_up / down; it is row-wise, so the
layer still splits around attention (`post_attention`) as the dense one does.

Every projection is a tensor-parallel-ready layer (vlm_sdk.layers; one rank by default). Fused
projections (the checkpoint keeps them apart; `checkpoint_map` says where each lands, per rank):

    qkv_proj   rows [0, H*D) = q_proj | [H*D, (H+Hkv)*D) = k_proj | [(H+Hkv)*D, (H+2Hkv)*D) = v_proj
    gate_up    rows [0, I) = gate_proj | [I, 2I) = up_proj
(H, Hkv, I: this rank's heads and intermediate size.) `checkpoint_map` is the published Qwen2 / Llama
layout; InternLM2 checkpoints are renamed to it first (models/common/internlm2_weights.py).

Tensor parallelism (`parallel.tp`; `parallel.ep` spreads MoE experts whole: vlm_sdk/layers/moe.py): q
heads split, KV heads split or replicated (`layers.linear.kv_head_split`), gate/up column- and
o_proj/down row-parallel: two all-reduces per layer (after o_proj, after down), one in the
vocab-parallel embedding, and one all-gather of the logits, so `compute_logits` returns the whole vocab
on every rank. The residual stream and the norms are whole on every rank.
"""
from __future__ import annotations

import torch
from torch import nn

from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.layers.attention import PagedAttention
from vlm_sdk.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vlm_sdk.layers.moe import SparseMoeBlock
from vlm_sdk.layers.norm import RMSNorm
from vlm_sdk.layers.ops import KernelOps, TorchOps
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.layers.quantized_linear import linear_layer
from vlm_sdk.layers.rotary import MRotaryEmbedding, RotaryInputs
from vlm_sdk.weight_loading import ParamSlot, SplitSlot
from vlm_sdk.models.common.decoder_ends import DecoderEnds
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.common.lm_head import attention_slots
from vlm_sdk.models.pipeline import IntermediateTensors, PPMissingLayer

# Where checkpoints keep a layer's FP8 KV-cache scales (each a one-element float32 tensor; vLLM's
# `maybe_remap_kv_scale_name` reads the same spellings): llm-compressor / compressed-tensors'
# self_attn.{k,v}_scale, ModelOpt's self_attn.{k,v}_proj.{k,v}_scale, the older compressed-tensors
# self_attn.{k,v}_proj.output_scale, and the deprecated single self_attn.kv_scale (both K and V). All are
# optional: a checkpoint without them runs with 1.0.
KV_SCALE_NAMES = {"k_scale": ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale"),
                  "v_scale": ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale")}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaDecoderConfig, dtype: torch.dtype, device: torch.device | str, ops: KernelOps,
                 parallel: ParallelGroups, index: int = 0):
        super().__init__()
        self.ops, tp = ops, parallel.tp
        hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        # a quantized checkpoint's layer kinds (the float ones where it keeps a module unquantized)
        q, name = cfg.quantization, f"{cfg.quant_prefix}layers.{index}."
        qkv_cls = linear_layer(QKVParallelLinear, q, f"{name}self_attn.q_proj")
        o_cls = linear_layer(RowParallelLinear, q, f"{name}self_attn.o_proj")
        gate_up_cls = linear_layer(MergedColumnParallelLinear, q, f"{name}mlp.gate_proj")
        down_cls = linear_layer(RowParallelLinear, q, f"{name}mlp.down_proj")
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = qkv_cls(hidden, d, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, dtype, device, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5, ops.attention, device)
        self.o_proj = o_cls(cfg.num_heads * d, hidden, cfg.o_proj_bias, dtype, device, tp)
        # per head, so replicated under tensor parallelism and applied with no collective
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device)
        # Qwen3-MoE's sparse layers route the MLP through experts; the others keep the dense SwiGLU
        experts_quant = None if q is None or q.skips(f"{name}mlp.experts") else q
        self.moe = SparseMoeBlock(hidden, cfg.moe, ops, dtype, device, tp, experts_quant, ep=parallel.ep) \
            if cfg.moe is not None and cfg.moe.is_sparse(index) else None
        if self.moe is None:
            self.gate_up_proj = gate_up_cls(hidden, [inter, inter], False, dtype, device, tp)
            self.down_proj = down_cls(inter, hidden, False, dtype, device, tp)
        # the kernel set's product for few rows (`small_m_gemm`), where cuBLAS reads the weights slowest;
        # a quantized layer keeps its own dequantizing product
        for proj in (self.qkv_proj, self.o_proj):
            if isinstance(proj, nn.Linear):  # the float layers (a quantized one is not one)
                proj.matmul = ops.small_m_linear

    def forward(self, x: torch.Tensor,  # [N, hidden]: the previous layer's output
                residual: torch.Tensor | None,  # [N, hidden]: the residual stream before it; None for layer 0
                rope: RotaryInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it): the next norm adds them
        (fused with the add), as HF's `x = x + mlp(norm(x))` does in two steps."""
        # the kernel set may rotate and store K/V in one launch: then attention only reads the cache
        store = (kv_cache, meta.slot_mapping) if self.ops.fuses_rotary_store else None
        q, k, v, residual = self.pre_attention(x, residual, rope, store)
        attn = self.attn(q, k, v, kv_cache, meta, stored=store is not None)  # [N, H, D]
        return self.post_attention(attn, residual)

    # the two halves around the attention call (`DecoderLayerHalves`, models/base.py): piecewise CUDA graphs
    # (vlm_sdk/worker/piecewise_graphs.py) capture them and run the attention between them eagerly
    def pre_attention(self, x: torch.Tensor,  # [N, hidden]
                      residual: torch.Tensor | None,  # [N, hidden] or None for layer 0
                      rope: RotaryInputs,
                      store: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, H, D], k [N, Hkv, D], v [N, Hkv, D], the residual stream [N, hidden]): norm, qkv, rotary.
        `store` = (this layer's KV cache, the step's slot mapping): k and v also go into the cache, in
        the rotary's launch (`KernelOps.rotary_store_kv`, where the kernel set fuses them)."""
        ops, n = self.ops, x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        norm = self.input_layernorm
        if residual is None:
            residual, normed = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            normed, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        qkv = self.qkv_proj(normed).view(n, h + 2 * hkv, self.head_dim)  # [N, H+2Hkv, D]
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if store is not None:
            # in place; an FP8 cache quantized with this layer's scales
            ops.rotary_store_kv(qkv, h, hkv, rope, qk_norm, *store, kv_scales=(self.attn.k_scale, self.attn.v_scale))
            return qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:], residual
        qk = ops.rotary(qkv[:, :h + hkv], h, rope, qk_norm)  # [N, H+Hkv, D]
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv:], residual  # [N, H, D], [N, Hkv, D], [N, Hkv, D], [N, hidden]

    def post_attention(self, attn: torch.Tensor,  # [N, H, D]
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, hidden] x 2
        """o_proj, the add + norm, the MLP: (the MLP output, the residual stream before it)."""
        ops, n = self.ops, attn.shape[0]
        norm = self.post_attention_layernorm
        normed, residual = ops.add_rms_norm(self.o_proj(attn.reshape(n, self.num_heads * self.head_dim)), residual,
                                            norm.weight, norm.eps)
        if self.moe is not None:
            return self.moe(normed), residual
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(normed))), residual

    def mlp_slots(self, src: str, dst: str) -> dict[str, ParamSlot]:
        """The MLP's checkpoint names under `src` (`model.layers.N.mlp.`) -> this rank's slices under `dst`."""
        if self.moe is not None:
            return self.moe.slots(src, f"{dst}moe.")
        return {**self.gate_up_proj.slots(f"{dst}gate_up_proj.", [f"{src}gate_proj.weight", f"{src}up_proj.weight"]),
                **self.down_proj.slots(f"{dst}down_proj.", f"{src}down_proj.weight")}


class LlamaDecoder(DecoderEnds):
    pipeline_stages = True  # builds and runs one stage's layers under pipeline parallelism (models/pipeline.py)

    def __init__(self, cfg: LlamaDecoderConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", ops: KernelOps | None = None,
                 parallel: ParallelGroups = ParallelGroups()):
        super().__init__()
        self.cfg = cfg
        self.ops = ops or TorchOps()
        self._init_ends(cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings, dtype, device, parallel.tp,
                        parallel.pp)
        # pipeline parallelism: this stage's layers; the others' are placeholders (models/pipeline.py)
        self.start_layer, self.end_layer = parallel.pp.layer_range(cfg.num_layers)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, device, self.ops, parallel, i)
                                    if self.start_layer <= i < self.end_layer else PPMissingLayer(i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, device,
                                       interleaved=cfg.mrope_interleaved)
        # the `DecoderStack` contract (models/base.py): positions [3, N] for M-RoPE, else [N]
        self.hidden_size = cfg.hidden_size
        self.position_rows = 3 if cfg.mrope_section is not None else 1
        # EAGLE-3 (models/common/eagle3_draft.py): the residual stream entering these layers is kept per
        # forward, concatenated in this order, for the draft (`aux_hidden`); () keeps nothing
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        self.requires_grad_(False)

    def forward(self, inputs_embeds: torch.Tensor,  # [N, hidden]
                positions: torch.Tensor,  # [3, N] (M-RoPE) or [N]
                caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: StepMetadata,
                deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
                intermediate: IntermediateTensors | None = None,
                ) -> torch.Tensor | IntermediateTensors:  # [N, hidden], after the final norm
        """`meta`: the step's metadata per cache group (layer i reads `meta.layer(i)`: the attention
        backend's `prepare`d metadata of its group). `deepstack`: (rows `[n]` int64, features per level
        `[n, hidden]`): after layer i < len(features), the residual stream at `rows` gets features[i]
        added (Qwen3-VL: rows are this step's image tokens). Pipeline parallelism: a later stage starts
        from the previous stage's `intermediate` (`inputs_embeds` is then unused), and a stage before
        the last returns its `IntermediateTensors` instead of the normed hidden states."""
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(self.layers)} decoder layers")
        rows, features = deepstack if deepstack is not None else (None, [])
        if len(features) > len(self.layers):
            raise ValueError(f"got {len(features)} DeepStack levels for {len(self.layers)} decoder layers")
        x, residual = (inputs_embeds, None) if intermediate is None else (intermediate.hidden, intermediate.residual)
        rope = self.rotary_inputs(positions, x.dtype)  # shared by every layer
        aux = {} if self.aux_layers else None
        for i in range(self.start_layer, self.end_layer):
            if aux is not None and i in self.aux_layers:  # vLLM's: the stream before layer i (x + residual)
                aux[i] = x if residual is None else x + residual  # [N, hidden]
            x, residual = self.layers[i](x, residual, rope, caches[i], meta.layer(i))
            if i < len(features):
                # the stream is x + residual; x is this layer's fresh MLP output, so adding in place is safe
                x.index_add_(0, rows, features[i].to(x.dtype))  # [N, hidden] += at rows [n, hidden]
        if aux is not None:
            self.aux_hidden = torch.cat([aux[j] for j in self.aux_layers], dim=-1)  # [N, len(aux_layers) * hidden]
        if not self.pp.is_last:
            return IntermediateTensors(x, residual)
        return self.final_norm(x, residual)

    def rotary_inputs(self, positions: torch.Tensor, dtype: torch.dtype):
        """The step's rotary inputs (the kernel set's: cos/sin, or the positions), shared by every layer."""
        return self.ops.rotary_inputs(positions, self.rotary, dtype)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [N, hidden] x 2 -> [N, hidden]
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def checkpoint_map(self, prefix: str = "model.", lm_head: str = "lm_head.weight") -> dict[str, ParamSlot]:
        """Checkpoint name -> where it goes (this rank's slice), for the published Qwen2 / Llama layout
        (`model.layers.N.self_attn.q_proj...`). Our parameter names are relative to this module."""
        cfg = self.cfg
        hid = cfg.hidden_size
        out = self.head_slots(prefix, lm_head)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PPMissingLayer):  # another stage's (models/pipeline.py: skipped on load)
                continue
            src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
            out.update(attention_slots(layer, src, dst, cfg.attention_bias, cfg.o_proj_bias))
            out.update(layer.mlp_slots(f"{src}mlp.", dst))
            out[f"{src}input_layernorm.weight"] = ParamSlot(f"{dst}input_layernorm.weight", (hid,))
            if cfg.qk_norm:
                out[f"{src}self_attn.q_norm.weight"] = ParamSlot(f"{dst}q_norm.weight", (cfg.head_dim,))
                out[f"{src}self_attn.k_norm.weight"] = ParamSlot(f"{dst}k_norm.weight", (cfg.head_dim,))
            out[f"{src}post_attention_layernorm.weight"] = ParamSlot(f"{dst}post_attention_layernorm.weight", (hid,))
            out.update(kv_scale_slots(src, f"{dst}attn."))
        return out


def kv_scale_slots(src: str, dst: str) -> dict[str, ParamSlot | SplitSlot]:
    """The optional slots of one layer's FP8 KV-cache scales (`KV_SCALE_NAMES`), into `PagedAttention`'s
    k_scale / v_scale buffers."""
    out: dict[str, ParamSlot | SplitSlot] = {f"{src}{name}": ParamSlot(f"{dst}{buffer}", (), optional=True)
                                             for buffer, names in KV_SCALE_NAMES.items() for name in names}
    out[f"{src}self_attn.kv_scale"] = SplitSlot(tuple(ParamSlot(f"{dst}{b}", (), optional=True)
                                                      for b in KV_SCALE_NAMES))
    return out
