"""The kernel set a model runs on between its matmuls: `TorchOps` (the reference path, every
device) or `TritonOps` (the Triton kernels; CUDA, or the CPU under TRITON_INTERPRET=1), with the
attention backend of the same name as `ops.attention`.

Chosen once per engine (`make_ops`, from `EngineArgs.attention_backend`). The two sets differ in
nothing else, so the torch one is the oracle for the other. The Triton kernels are imported when
`TritonOps` is built, so TRITON_INTERPRET is read then, not when vlm_sdk is imported.

    decoder layer:   rms_norm / add_rms_norm -> qkv matmul -> rotary (Qwen3: q/k norm fused in) ->
                     attention.forward (store_kv + paged attention) -> o_proj -> add_rms_norm ->
                     gate_up matmul -> silu_and_mul -> down (a sparse MoE layer: router -> fused_moe, the
                     torch set's kernels/fused_moe_torch.py or the Triton set's kernels/fused_moe.py); with the
                     Triton set, rotary and store_kv are one launch (`rotary_store_kv`) and attention reads the
                     cache only
    vision block:    attention.segments (once per image batch); qkv matmul -> rotary (2-D RoPE, float32
                     angles) -> attention.segment_forward -> proj -> add_rms_norm -> gate_up matmul ->
                     silu_and_mul -> down -> add_rms_norm (next block's norm1) where the tower has them
    Gated DeltaNet:  in_proj matmuls -> causal_conv1d (its conv state) -> gated_delta_rule (its recurrent
                     state; chunked over a prompt, one step per decode row) -> gated_rms_norm -> out_proj
                     (layers/gated_delta_net.py); a decode-only step (`StateMetadata.decode_only`) takes
                     the single-token kernels
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import StateMetadata
from vlm_sdk.attention.selector import make_backend
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.kernels import causal_conv1d_torch, gated_delta_rule_torch
from vlm_sdk.kernels.fused_moe_torch import ExpertScales, fused_moe_ref
from vlm_sdk.kernels.rms_norm_torch import gated_rms_norm, rms_norm, rms_norm_zero_centered
from vlm_sdk.kernels.rotary_torch import apply_rotary
from vlm_sdk.layers.rotary import MRotaryEmbedding, RotaryInputs


class KernelOps(ABC):
    """The non-attention ops. Inputs may be strided views with a contiguous last dim. Nothing here
    synchronises with the host (CUDA graphs capture a decode step)."""

    def __init__(self, attention: AttentionBackend):
        self.attention = attention

    @property
    def name(self) -> str:
        return self.attention.name

    # whether `rotary_store_kv` rotates and stores K/V in one launch (then attention must not store them)
    fuses_rotary_store = False
    # the product a decoder's qkv and o projections run, (x, weight, bias) -> x W^T + b; None: F.linear
    small_m_linear = None

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step may be captured into a CUDA graph."""
        return self.attention.graph_safe

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
        """`[N, C] -> [N, C]`: HF RMSNorm (normalise in float32, cast, scale); `zero_centered`: Qwen3.5's and
        Gemma's, the weight an offset from 1 applied in float32, one rounding
        (kernels/rms_norm_torch.py `rms_norm_zero_centered`)."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rms_norm(x + residual), x + residual)`: the sum rounded to x's dtype is the new residual."""

    @abstractmethod
    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`[N, D]`: HF RMSNorm of x times silu(gate) (transformers' `Qwen3_5RMSNormGated`; weight `[D]`)."""

    @abstractmethod
    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, meta: StateMetadata, activation: str | None) -> torch.Tensor:
        """`[T, C]`: the depthwise causal conv of each request's new tokens (x `[T, C]`, weight `[C, K]`),
        continuing from its slot of `conv_state` `[slots, C, K - 1]`, which then holds its last K - 1 inputs
        (kernels/causal_conv1d_torch.py)."""

    @abstractmethod
    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """`[T, Hv, Dv]`: the gated delta rule over each request's new tokens (q, k `[T, Hk, Dk]`, v `[T, Hv,
        Dv]`, g and beta `[T, Hv]`), continuing from its slot of the float32 `state` `[slots, Hv, Dk, Dv]`,
        which then holds its final state (kernels/gated_delta_rule_torch.py)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, 2I] -> [N, I]`: silu(gate) * up."""

    @abstractmethod
    def rotary_inputs(self, positions: torch.Tensor, rotary: MRotaryEmbedding, dtype: torch.dtype) -> RotaryInputs:
        """Per-forward rotary state from positions `[N]` or `[3, N]`."""

    @abstractmethod
    def rotary(self, qk: torch.Tensor, num_q_heads: int, rope: RotaryInputs,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """RoPE / M-RoPE (rotate_half layout) on the q and k heads of a packed `[N, H + Hkv, D]` (the
        first `num_q_heads` are q); returns them rotated (the same tensor, rotated in place, where
        the set can; the torch set returns a new tensor, float32 when the angles are, as the vision
        towers ask for their float32 rotation). `qk_norm` = (q weight `[D]`, k weight `[D]`, eps): each head RMS-normalised over
        D first (Qwen3's q_norm / k_norm), so a rank's heads need nothing from another rank."""

    @abstractmethod
    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
        """`[N, H]`: each token's routed experts, weighted and summed (x `[N, H]`, w13 `[E, 2I, H]` gate | up,
        w2 `[E, H, I]`, topk_weights `[N, K]` float32, topk_ids `[N, K]`; `scales`: the block scales of FP8
        experts; kernels/fused_moe_torch.py)."""

    # GeGLU (Gemma's MLP): the torch maths in both kernel sets until one fuses it
    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, 2I] -> [N, I]`: gelu_tanh(gate) * up (GeGLU, transformers' "gelu_pytorch_tanh")."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary_store_kv(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, rope: RotaryInputs,
                        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`rotary` on the q and k heads of a packed `[N, H + 2Hkv, D]` qkv, in place, and the rotated k
        and v written into their cache slots (slot -1: none; an int8 / int4 cache, four tensors, quantized per
        token and head after the rotary; an FP8 cache quantized with `kv_scales`, the
        layer's (k_scale, v_scale)), where `fuses_rotary_store`."""
        raise NotImplementedError(f"the {self.name} kernel set does not fuse rotary and the KV store")


class TorchOps(KernelOps):
    def __init__(self, attention: AttentionBackend | None = None):
        super().__init__(attention or make_backend("torch", torch.device("cpu")))

    def rms_norm(self, x, weight, eps, zero_centered=False):
        return (rms_norm_zero_centered if zero_centered else rms_norm)(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps, zero_centered=False):
        s = x + residual
        return self.rms_norm(s, weight, eps, zero_centered), s

    def gated_rms_norm(self, x, gate, weight, eps):
        return gated_rms_norm(x, gate, weight, eps)

    def causal_conv1d(self, x, weight, bias, conv_state, meta, activation):
        if meta.decode_only:
            return causal_conv1d_torch.causal_conv1d_update(x, weight, bias, conv_state, meta.state_slots,
                                                            meta.has_initial_state, activation)
        return causal_conv1d_torch.causal_conv1d_varlen(x, weight, bias, conv_state, meta.query_start_loc,
                                                        meta.state_slots, meta.has_initial_state, activation)

    def gated_delta_rule(self, q, k, v, g, beta, state, meta):
        if meta.decode_only:
            return gated_delta_rule_torch.recurrent_gated_delta_rule(q, k, v, g, beta, state, meta.state_slots,
                                                                     meta.has_initial_state)
        return gated_delta_rule_torch.chunk_gated_delta_rule(q, k, v, g, beta, state, meta.query_lens_cpu,
                                                             meta.state_slots, meta.has_initial_state)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_inputs(self, positions, rotary, dtype):
        cos, sin = rotary(positions, dtype)  # [N, 1, D/2]
        return RotaryInputs(positions, rotary.inv_freq, rotary.mrope_section, cos, sin, rotary.interleaved)

    def rotary(self, qk, num_q_heads, rope, qk_norm=None):
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            n, _, d = qk.shape
            q = rms_norm(qk[:, :num_q_heads].reshape(-1, d), q_weight, eps)  # [N*H, D]
            k = rms_norm(qk[:, num_q_heads:].reshape(-1, d), k_weight, eps)  # [N*Hkv, D]
            qk = torch.cat((q.view(n, -1, d), k.view(n, -1, d)), dim=1)  # [N, H+Hkv, D]
        return apply_rotary(qk, rope.cos, rope.sin)  # q and k heads in one pass

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, scales=None):
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, scales)


class TritonOps(KernelOps):
    def __init__(self, attention: AttentionBackend, small_m_gemm: str = "torch"):
        super().__init__(attention)
        # imported here so that TRITON_INTERPRET is read when the set is chosen
        from vlm_sdk.kernels import (causal_conv1d, fused_moe, gated_delta_rule_chunk, gated_delta_rule_recurrent,
                                     gated_rms_norm, rms_norm, rotary, rotary_store_kv, silu_and_mul, store_kv)
        self._conv, self._gated_rms_norm = causal_conv1d, gated_rms_norm.gated_rms_norm
        self._rule_chunk = gated_delta_rule_chunk.chunk_gated_delta_rule
        self._rule_recurrent = gated_delta_rule_recurrent.recurrent_gated_delta_rule
        self._fused_moe = fused_moe.fused_moe
        self._rms_norm = rms_norm.rms_norm
        self._rotary = rotary.rotary_embedding
        self._rotary_store_kv = rotary_store_kv.rotary_store_kv
        self._store_kv = store_kv.store_kv  # an int8 / int4 cache's store: after the rotary, not fused with it
        self._silu_and_mul = silu_and_mul.silu_and_mul
        if small_m_gemm == "triton":
            from vlm_sdk.kernels import skinny_gemm
            self._skinny = skinny_gemm
            self.small_m_linear = self._small_m_linear

    fuses_rotary_store = True

    def _small_m_linear(self, x: torch.Tensor,  # [M, in]
                        weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [M, out]
        if x.dim() == 2 and x.shape[0] <= self._skinny.MAX_M and x.stride(-1) == 1:
            return self._skinny.skinny_gemm(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, zero_centered=False):
        return self._rms_norm(x, weight, eps, zero_centered=zero_centered)

    def add_rms_norm(self, x, residual, weight, eps, zero_centered=False):
        return self._rms_norm(x, weight, eps, residual=residual, zero_centered=zero_centered)

    def gated_rms_norm(self, x, gate, weight, eps):
        return self._gated_rms_norm(x, gate, weight, eps)

    def causal_conv1d(self, x, weight, bias, conv_state, meta, activation):
        if meta.decode_only:
            return self._conv.causal_conv1d_update(x, weight, bias, conv_state, meta.state_slots,
                                                   meta.has_initial_state, activation)
        return self._conv.causal_conv1d_varlen(x, weight, bias, conv_state, meta.query_start_loc, meta.state_slots,
                                               meta.has_initial_state, activation, meta.max_query_len)

    def gated_delta_rule(self, q, k, v, g, beta, state, meta):
        if meta.decode_only:
            return self._rule_recurrent(q, k, v, g, beta, state, meta.state_slots, meta.has_initial_state)
        return self._rule_chunk(q, k, v, g, beta, state, meta.query_start_loc, meta.max_query_len, meta.state_slots,
                                meta.has_initial_state)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)

    def rotary_inputs(self, positions, rotary, dtype):
        return RotaryInputs(positions, rotary.inv_freq, rotary.mrope_section, mrope_interleaved=rotary.interleaved)

    def rotary(self, qk, num_q_heads, rope, qk_norm=None):
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        self._rotary(qk[:, :num_q_heads], qk[:, num_q_heads:], rope.positions, rope.inv_freq, rope.mrope_section,
                     rope.mrope_interleaved, q_weight, k_weight, eps)
        return qk

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, scales=None):
        return self._fused_moe(x, w13, w2, topk_weights, topk_ids, scales)

    def rotary_store_kv(self, qkv, num_q_heads, num_kv_heads, rope, qk_norm, kv_cache, slot_mapping,
                        kv_scales=None):
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
        h, hkv = num_q_heads, num_kv_heads
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        if len(kv_cache) == 4:  # an int8 / int4 cache: rotate in place, then the quantizing store
            self.rotary(qkv[:, :h + hkv], h, rope, qk_norm)
            k_cache, v_cache, k_sz, v_sz = kv_cache
            self._store_kv(qkv[:, h:h + hkv], qkv[:, h + hkv:], k_cache, v_cache, slot_mapping, k_sz=k_sz, v_sz=v_sz)
            return
        self._rotary_store_kv(qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:], *kv_cache, slot_mapping,
                              rope.positions, rope.inv_freq, rope.mrope_section, rope.mrope_interleaved, q_weight,
                              k_weight, eps, k_scale, v_scale)


def make_ops(backend: str | None, device: torch.device, small_m_gemm: str = "torch") -> KernelOps:
    """The kernel set for `attention_backend` on `device` (None: Triton on CUDA, torch elsewhere), its
    small-M projections by `small_m_gemm`. Raises `InvalidRequestError` naming the setting when Triton
    cannot run there (`make_backend`), or small_m_gemm='triton' without the Triton set."""
    attention = make_backend(backend, device)
    if attention.name == "triton":
        return TritonOps(attention, small_m_gemm)
    if small_m_gemm == "triton":
        raise InvalidRequestError("small_m_gemm='triton' needs the Triton kernel set: attention_backend='triton' "
                                  "(the default on CUDA), or small_m_gemm='torch'", param="small_m_gemm")
    return TorchOps(attention)
