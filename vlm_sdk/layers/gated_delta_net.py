"""The Gated DeltaNet token mixer (Qwen3.5's `linear_attention` layers; transformers'
`Qwen3_5GatedDeltaNet`), on the state cache kind: a fixed-size state per request, in slots.

    x [T, hidden] -> in_proj_qkvz -> q | k | v (the conv's channels) and z (the output gate)
                  -> in_proj_ba   -> b (beta = sigmoid(b)) and a (g = -exp(A_log) softplus(a + dt_bias))
    q | k | v -> causal conv1d (width K, SiLU) with its state -> q, k [T, Hk, Dk], v [T, Hv, Dv]
    o = gated delta rule(q, k, v, g, beta) with its state      [T, Hv, Dv]
    o = rms_norm(o) * silu(z) per v head (the gated norm)      -> out_proj -> [T, hidden]

Its state per request (`cache_spec`): "conv" [conv_dim, K - 1] in the model's dtype (the last K - 1 inputs
of the conv; transformers keeps K columns, whose oldest one never reaches an output) and "recurrent"
[Hv, Dk, Dv] in float32 (the published configs' `mamba_ssm_dtype`, and what transformers' fallback keeps:
decays compound over the whole sequence). `forward` reads and writes each request's slot in place
(`StateMetadata`); the arithmetic is the kernel set's (`KernelOps.causal_conv1d`, `gated_delta_rule`,
`gated_rms_norm`), a decode-only step through their single-token forms. A verification step of speculative
decoding also leaves the state after each draft in that draft's slot (`StateMetadata.drafts`:
layers/draft_states.py), so a rejected draft's state is left behind, not recomputed.

Checkpoint tensors (the published names, under the layer's prefix): in_proj_qkv [2 Hk Dk + Hv Dv, hidden]
(q | k | v rows, heads contiguous), in_proj_z [Hv Dv, hidden], in_proj_b and in_proj_a [Hv, hidden],
conv1d.weight [conv_dim, 1, K], dt_bias and A_log [Hv], norm.weight [Dv], out_proj.weight [hidden, Hv Dv].
The layer holds q | k | v | z in one product and b | a in another (vLLM's in_proj_qkvz and in_proj_ba).

Tensor parallelism splits heads as vLLM does: rank r holds key heads [r Hk/tp, ...) and value heads
[r Hv/tp, ...), which are the value heads those key heads serve (each key head serves Hv / Hk consecutive
value heads), so q, k, v, z, b, a, the conv's channels, dt_bias, A_log and the state split with them and
the rule needs nothing from another rank; out_proj is row-parallel (one all-reduce). Hk and Hv must both
divide by tp (`ValueError` naming them otherwise, which the engine's size check turns into the sizes that
work).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.attention.metadata import StateMetadata
from vlm_sdk.layers import draft_states
from vlm_sdk.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.protocol.cache_spec import StateSpec, StateTensor
from vlm_sdk.weight_loading import ParamSlot, Shard, SplitSlot


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    eps: float  # rms_norm_eps (the gated norm's)
    activation: str = "silu"  # hidden_act (the conv's)
    state_dtype: str = "float32"  # mamba_ssm_dtype: the recurrent state's

    @classmethod
    def from_hf(cls, text_config) -> "GatedDeltaNetConfig":
        """From a Qwen3.5 text config (transformers' `Qwen3_5TextConfig` or the published config.json's
        text part)."""
        c = text_config
        return cls(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                   c.linear_value_head_dim, c.linear_conv_kernel_dim, c.rms_norm_eps, c.hidden_act,
                   getattr(c, "mamba_ssm_dtype", None) or "float32")


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: GatedDeltaNetConfig, ops: KernelOps, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        super().__init__()
        if cfg.state_dtype != "float32":
            raise ValueError(f"mamba_ssm_dtype {cfg.state_dtype!r}: the Gated DeltaNet recurrent state is kept in "
                             f"float32 (its decays compound over the whole sequence)")
        if cfg.num_v_heads % cfg.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({cfg.num_v_heads}) must be a multiple of linear_num_key_heads "
                             f"({cfg.num_k_heads}): each key head serves whole value heads")
        self.cfg, self.ops, self.tp, self.dtype = cfg, ops, tp, dtype
        self.num_k_heads = tp.split(cfg.num_k_heads, "linear-attention key heads (linear_num_key_heads)")  # local
        self.num_v_heads = tp.split(cfg.num_v_heads, "linear-attention value heads (linear_num_value_heads)")
        key_dim, value_dim = cfg.num_k_heads * cfg.head_k_dim, cfg.num_v_heads * cfg.head_v_dim  # whole
        self.key_dim, self.value_dim = self.num_k_heads * cfg.head_k_dim, self.num_v_heads * cfg.head_v_dim  # local
        self.conv_dim = 2 * self.key_dim + self.value_dim  # local q | k | v channels
        self.in_proj_qkvz = MergedColumnParallelLinear(cfg.hidden_size, [key_dim, key_dim, value_dim, value_dim],
                                                       False, dtype, device, tp)
        self.in_proj_ba = MergedColumnParallelLinear(cfg.hidden_size, [cfg.num_v_heads, cfg.num_v_heads], False,
                                                     dtype, device, tp)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.conv_kernel, dtype=dtype, device=device))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device))
        self.norm_weight = nn.Parameter(torch.empty(cfg.head_v_dim, dtype=dtype, device=device))  # replicated
        self.out_proj = RowParallelLinear(value_dim, cfg.hidden_size, False, dtype, device, tp)

    def cache_spec(self) -> StateSpec:
        """This rank's state per request, in the order `forward` takes the tensors."""
        c = self.cfg
        return StateSpec((StateTensor("conv", (self.conv_dim, c.conv_kernel - 1), str(self.dtype).split(".")[1]),
                          StateTensor("recurrent", (self.num_v_heads, c.head_k_dim, c.head_v_dim), c.state_dtype)),
                         draft_states=True)

    def forward(self, x: torch.Tensor,  # [T, hidden]
                state: tuple[torch.Tensor, torch.Tensor],  # conv [slots, conv_dim, K-1], recurrent [slots, Hv, Dk, Dv]
                meta: StateMetadata) -> torch.Tensor:  # [T, hidden], summed over the ranks
        c = self.cfg
        conv_state, recurrent_state = state
        t = x.shape[0]
        qkvz = self.in_proj_qkvz(x)  # [T, conv_dim + value_dim]
        ba = self.in_proj_ba(x)  # [T, 2 Hv]
        drafts = meta.drafts  # a verification step: the states after its drafts kept too (layers/draft_states.py)
        if drafts is not None:
            conv_start = draft_states.conv_before(conv_state, drafts)  # [R, conv_dim, K - 1]
            draft_states.recurrent_before(recurrent_state, drafts)
        mixed = self.ops.causal_conv1d(qkvz[:, :self.conv_dim], self.conv_weight, None, conv_state, meta,
                                       c.activation)  # [T, conv_dim]
        if drafts is not None:
            draft_states.keep_conv_states(conv_state, conv_start, qkvz[:, :self.conv_dim], drafts)
        q = mixed[:, :self.key_dim].view(t, self.num_k_heads, c.head_k_dim)
        k = mixed[:, self.key_dim:2 * self.key_dim].view(t, self.num_k_heads, c.head_k_dim)
        v = mixed[:, 2 * self.key_dim:].view(t, self.num_v_heads, c.head_v_dim)
        b, a = ba[:, :self.num_v_heads], ba[:, self.num_v_heads:]
        beta = b.sigmoid()  # [T, Hv], the model's dtype, as transformers
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] float32
        o = self.ops.gated_delta_rule(q, k, v, g, beta, recurrent_state, meta)  # [T, Hv, Dv]
        if drafts is not None:
            draft_states.keep_recurrent_states(self.ops, q, k, v, g, beta, recurrent_state, drafts)
        z = qkvz[:, self.conv_dim:].reshape(-1, c.head_v_dim)  # [T * Hv, Dv]
        o = self.ops.gated_rms_norm(o.reshape(-1, c.head_v_dim), z, self.norm_weight, c.eps)
        return self.out_proj(o.view(t, self.value_dim))

    def slots(self, prefix: str = "") -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint names (the published ones, after `prefix`, e.g. "model.layers.0.linear_attn.") -> this
        rank's slice of each."""
        c, tp, h = self.cfg, self.tp, self.cfg.hidden_size
        key_dim, value_dim = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim  # whole
        out: dict[str, ParamSlot | SplitSlot] = {}
        # q | k | v rows: this rank's heads of each part, back to back (the same for the conv's channels)
        parts = ((0, key_dim, self.key_dim), (key_dim, key_dim, self.key_dim),
                 (2 * key_dim, value_dim, self.value_dim))
        conv_dim = 2 * key_dim + value_dim
        for name, param, shape in ((f"{prefix}in_proj_qkv.weight", "in_proj_qkvz.weight", (conv_dim, h)),
                                   (f"{prefix}conv1d.weight", "conv_weight", (conv_dim, 1, c.conv_kernel))):
            out[name] = _rows(param, shape, parts, tp)
        out[f"{prefix}in_proj_z.weight"] = _rows("in_proj_qkvz.weight", (value_dim, h), ((0, value_dim, self.value_dim),),
                                                 tp, at=self.conv_dim)
        out.update(self.in_proj_ba.slots("in_proj_ba.", [f"{prefix}in_proj_b.weight", f"{prefix}in_proj_a.weight"]))
        for name in ("dt_bias", "A_log"):
            out[f"{prefix}{name}"] = _rows(name, (c.num_v_heads,), ((0, c.num_v_heads, self.num_v_heads),), tp)
        out[f"{prefix}norm.weight"] = ParamSlot("norm_weight", (c.head_v_dim,))
        out.update(self.out_proj.slots("out_proj.", f"{prefix}out_proj.weight"))
        return out


def _rows(param: str, shape: tuple[int, ...], parts: tuple[tuple[int, int, int], ...], tp: TPGroup,
          at: int = 0) -> ParamSlot | SplitSlot:
    """One checkpoint tensor of `shape` whose rows are `parts` (first row, rows, this rank's rows): rank r's
    share of each part placed back to back from row `at` of `param`. One rank: the whole tensor."""
    if tp.size == 1:
        return ParamSlot(param, shape, at if len(parts) > 1 or at else None)
    slices, dst = [], at
    for first, _, local in parts:
        slices.append(ParamSlot(param, shape, dst, Shard(0, first + tp.rank * local, local)))
        dst += local
    return slices[0] if len(slices) == 1 else SplitSlot(tuple(slices))
