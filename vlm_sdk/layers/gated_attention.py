"""Qwen3.5's gated full attention (transformers' `Qwen3_5Attention`): what it adds to a Qwen3 attention
layer, as pieces a decoder composes around its attention call (`project`, the backend's attention,
`output`).

    qkv_proj x -> per head [q (D) | gate (D)], k, v       q_proj's rows are per head q then gate
    q, k: RMSNorm per head, zero-centred (weight an offset from 1: `Qwen3_5RMSNorm`)
    rotary on the first `rotary_dim` of each head only     partial_rotary_factor 0.25: 64 of D = 256,
                                                           interleaved M-RoPE over those (mrope_section
                                                           [11, 11, 10] sums to 32 = 64 / 2)
    attention(q, k, v)                                     causal, GQA, scale D^-0.5
    o_proj(attn * sigmoid(gate))                           the output gate, per head and channel

Tensor parallelism splits heads as vLLM does (`GatedQKVParallelLinear`: each rank's q heads with their
gates, its KV heads, or one replicated when there are fewer KV heads than ranks); the norms are per head,
so replicated and collective-free; o_proj is row-parallel (one all-reduce).

Checkpoint tensors (published names after the layer's prefix, e.g. "model.layers.3.self_attn."): q_proj
[H 2D, hidden], k_proj and v_proj [Hkv D, hidden] (biases with attention_bias), q_norm and k_norm [D],
o_proj [hidden, H D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.layers.attention import PagedAttention
from vlm_sdk.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, kv_head_split
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.rotary import MRotaryEmbedding, RotaryInputs
from vlm_sdk.weight_loading import ParamSlot


@dataclass(frozen=True)
class GatedAttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # over rotary_dim / 2 frequencies
    mrope_interleaved: bool
    eps: float
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, text_config) -> "GatedAttentionConfig":
        """From a Qwen3.5 text config (transformers 5's `rope_parameters`)."""
        c = text_config
        rope = dict(getattr(c, "rope_parameters", None) or {})
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        section = rope.get("mrope_section")
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim,
                   int(head_dim * rope.get("partial_rotary_factor", 1.0)), float(rope.get("rope_theta", 10000.0)),
                   tuple(section) if section else None, bool(rope.get("mrope_interleaved", False)), c.rms_norm_eps,
                   bool(getattr(c, "attention_bias", False)))

    def rotary(self, device: torch.device | str) -> MRotaryEmbedding:
        """The angles of the rotated part (one per decoder, shared by its attention layers)."""
        return MRotaryEmbedding(self.rotary_dim, self.rope_theta, self.mrope_section, device,
                                interleaved=self.mrope_interleaved)


class GatedQKVParallelLinear(QKVParallelLinear):
    """`QKVParallelLinear` whose q part holds 2 D rows per head (the head's q, then its gate), as Qwen3.5's
    q_proj: rows `[q | gate of head 0, ..., of head H-1 (this rank's) | k | v]`."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        self.num_heads = tp.split(num_heads, "attention heads")  # local
        self.kv_head_start, self.num_kv_heads = kv_head_split(num_kv_heads, tp)  # local
        self.head_dim = head_dim
        MergedColumnParallelLinear.__init__(self, hidden_size, [num_heads * 2 * head_dim, num_kv_heads * head_dim,
                                                                num_kv_heads * head_dim], bias, dtype, device, tp)


class GatedAttention(nn.Module):
    def __init__(self, cfg: GatedAttentionConfig, ops: KernelOps, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        super().__init__()
        if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
            raise ValueError(f"rotary dim {cfg.rotary_dim} (head_dim {cfg.head_dim} x partial_rotary_factor) must be "
                             f"even and within the head")
        self.cfg, self.ops = cfg, ops
        d = cfg.head_dim
        self.qkv_proj = GatedQKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
                                               dtype, device, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_norm_weight = nn.Parameter(torch.zeros(d, dtype=dtype, device=device))  # replicated, per head
        self.k_norm_weight = nn.Parameter(torch.zeros(d, dtype=dtype, device=device))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5, ops.attention, device)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.attention_bias, dtype, device, tp)

    def project(self, x: torch.Tensor,  # [N, hidden]: the normed input
                rope: RotaryInputs,  # `ops.rotary_inputs(positions, cfg.rotary(...), dtype)`, once per forward
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, H, D], k [N, Hkv, D], v [N, Hkv, D], gate [N, H, D]): the projection, the zero-centred q/k
        norms and the rotary of each head's first rotary_dim."""
        ops, cfg, n = self.ops, self.cfg, x.shape[0]
        h, hkv, d, rot = self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.rotary_dim
        qkv = self.qkv_proj(x)  # [N, H 2D + 2 Hkv D]
        q_gate = qkv[:, :h * 2 * d].view(n, h, 2 * d)
        k = qkv[:, h * 2 * d:(h * 2 + hkv) * d].reshape(n * hkv, d)
        v = qkv[:, (h * 2 + hkv) * d:].view(n, hkv, d)
        q = ops.rms_norm(q_gate[..., :d].reshape(n * h, d), self.q_norm_weight, cfg.eps, zero_centered=True)
        k = ops.rms_norm(k, self.k_norm_weight, cfg.eps, zero_centered=True)
        qk = torch.cat((q.view(n, h, d), k.view(n, hkv, d)), dim=1)  # [N, H + Hkv, D]
        part = qk[..., :rot]  # the rotated dims of every q and k head; the rest pass through
        rotated = ops.rotary(part, h, rope)  # the same tensor where the set rotates in place
        if rotated is not part:
            part.copy_(rotated)
        return qk[:, :h], qk[:, h:], v, q_gate[..., d:]

    def output(self, attn: torch.Tensor,  # [N, H, D]
               gate: torch.Tensor,  # [N, H, D]
               ) -> torch.Tensor:  # [N, hidden], summed over the ranks
        n = attn.shape[0]
        return self.o_proj((attn * torch.sigmoid(gate)).reshape(n, self.num_heads * self.cfg.head_dim))

    def forward(self, x: torch.Tensor,  # [N, hidden]
                rope: RotaryInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:  # [N, hidden]
        """The layer over the paged KV cache (`meta`: the backend's prepared metadata of the step)."""
        q, k, v, gate = self.project(x, rope)
        return self.output(self.attn(q, k, v, kv_cache, meta), gate)

    def slots(self, prefix: str = "") -> dict[str, ParamSlot]:
        """Checkpoint names (published, after `prefix`) -> this rank's slice of each."""
        b = self.cfg.attention_bias
        names = [f"{prefix}{p}_proj.weight" for p in "qkv"]
        out = self.qkv_proj.slots("qkv_proj.", names, [f"{prefix}{p}_proj.bias" for p in "qkv"] if b else None)
        out[f"{prefix}q_norm.weight"] = ParamSlot("q_norm_weight", (self.cfg.head_dim,))
        out[f"{prefix}k_norm.weight"] = ParamSlot("k_norm_weight", (self.cfg.head_dim,))
        out.update(self.o_proj.slots("o_proj.", f"{prefix}o_proj.weight", f"{prefix}o_proj.bias" if b else None))
        return out
