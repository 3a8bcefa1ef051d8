"""The kernel set a model runs on: `TorchOps` (the reference path, every device) or `TritonOps` (the
Triton kernels of this package; CUDA, or the CPU under TRITON_INTERPRET=1).

Models call only these methods between their matmuls, so the two backends differ in nothing else and
the torch one is the oracle for the other. A backend is chosen once per engine (`make_ops`); the
Triton kernels are imported when `TritonOps` is built, so TRITON_INTERPRET is read then, not when
vlm_sdk is imported.

    decoder layer:   rms_norm / add_rms_norm -> qkv matmul -> rotary -> store_kv -> paged_attention
                     -> o_proj -> add_rms_norm -> gate_up matmul -> silu_and_mul -> down matmul
    vision block:    segments (once per image batch) ... segment_attention
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vlm_sdk.engine.attention_metadata import AttentionMetadata
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.kernels import paged_attention as torch_paged
from vlm_sdk.kernels import segment_attention as torch_segments

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class RotaryInputs:
    """One forward's rotary angles, shared by every layer. Backends read what they need: the torch
    one precomputed `cos`/`sin` `[N, 1, D/2]`, the Triton one recomputes them per layer in-kernel
    from `positions` (cheaper than reading them)."""
    positions: torch.Tensor  # [N] or [3, N] int64
    inv_freq: torch.Tensor  # [D/2] float32
    mrope_section: tuple[int, ...] | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class KernelOps(ABC):
    """The ops between a model's matmuls. Inputs may be strided views with a contiguous last dim.
    Nothing here synchronises with the host on a decode step (CUDA graphs capture it)."""

    name: str
    # whether a decode step may be captured into a CUDA graph (no host reads of device data)
    graph_safe: bool

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`[N, C] -> [N, C]`: HF RMSNorm (normalise in float32, cast, scale)."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rms_norm(x + residual), x + residual)`: the sum rounded to x's dtype is the new residual."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, 2I] -> [N, I]`: silu(gate) * up."""

    @abstractmethod
    def rotary_inputs(self, positions: torch.Tensor, rotary: Any, dtype: torch.dtype) -> RotaryInputs:
        """Per-forward rotary state from positions `[N]` or `[3, N]`; `rotary` has `inv_freq` `[D/2]`,
        `mrope_section` and, called as `rotary(positions, dtype)`, gives cos/sin `[N, 1, D/2]`."""

    @abstractmethod
    def rotary(self, qk: torch.Tensor, num_q_heads: int, rope: RotaryInputs) -> torch.Tensor:
        """RoPE / M-RoPE (rotate_half layout) on the q and k heads of a packed `[N, H + Hkv, D]` (the
        first `num_q_heads` are q); returns them rotated (the same tensor, rotated in place, where
        the backend can)."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write `[N, Hkv, D]` K/V into the flat cache slots; slot -1 is skipped (graph padding)."""

    @abstractmethod
    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this step's queries `[N, H, D]` over their sequences' cached keys (this
        step's already stored). `k`/`v` are this step's, for backends that read them directly."""

    @abstractmethod
    def segments(self, lengths: list[int], device: torch.device) -> Any:
        """A plan for `segment_attention` over back-to-back segments of these lengths (once per
        vision-tower call, shared by its blocks)."""

    @abstractmethod
    def segment_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                          scale: float) -> torch.Tensor:
        """Non-causal attention `[N, H, D]` within each segment of the plan."""


class TorchOps(KernelOps):
    name = "torch"
    graph_safe = False  # batched decode groups sequences by their host-side lengths

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        s = x + residual
        return self.rms_norm(s, weight, eps), s

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_inputs(self, positions, rotary, dtype):
        cos, sin = rotary(positions, dtype)  # [N, 1, D/2]
        return RotaryInputs(positions, rotary.inv_freq, rotary.mrope_section, cos, sin)

    def rotary(self, qk, num_q_heads, rope):
        return apply_rotary(qk, rope.cos, rope.sin)  # q and k heads in one pass

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        torch_paged.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(self, q, k_cache, v_cache, meta, scale, k, v):
        return torch_paged.paged_attention(q, k_cache, v_cache, meta, scale, k, v)

    def segments(self, lengths, device):
        return torch_segments.segment_plan(lengths, device)

    def segment_attention(self, q, k, v, plan, scale):
        return torch_segments.segment_attention(q, k, v, plan, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in float32, cast back, then scale by the weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op; identical maths in float32
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def apply_rotary(x: torch.Tensor,  # [..., D]
                 cos: torch.Tensor,  # broadcastable to [..., D // 2]
                 sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE with the cos/sin halves given once: x*cat(c,c) + rotate_half(x)*cat(s,s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TritonOps(KernelOps):
    name = "triton"
    graph_safe = True

    def __init__(self):
        # imported here so that TRITON_INTERPRET is read when the backend is chosen
        from vlm_sdk.kernels import (paged_attention_decode, paged_prefill_attention, rms_norm, rotary,
                                     silu_and_mul, store_kv, varlen_attention)
        self._decode = paged_attention_decode
        self._prefill = paged_prefill_attention.paged_prefill_attention
        self._rms_norm = rms_norm.rms_norm
        self._rotary = rotary.rotary_embedding
        self._silu_and_mul = silu_and_mul.silu_and_mul
        self._store_kv = store_kv.store_kv
        self._varlen = varlen_attention.varlen_attention

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._rms_norm(x, weight, eps, residual=residual)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)

    def rotary_inputs(self, positions, rotary, dtype):
        return RotaryInputs(positions, rotary.inv_freq, rotary.mrope_section)

    def rotary(self, qk, num_q_heads, rope):
        self._rotary(qk[:, :num_q_heads], qk[:, num_q_heads:], rope.positions, rope.inv_freq, rope.mrope_section)
        return qk

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self._store_kv(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(self, q, k_cache, v_cache, meta, scale, k, v):
        if meta.decode_only:
            if meta.num_splits is None:  # chosen once per step, by the first layer
                meta.num_splits = self._decode.choose_num_splits(meta.num_seqs, k_cache.shape[2], meta.max_seq_len,
                                                                 q.device)
            return self._decode.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                       num_splits=meta.num_splits, max_seq_len=meta.max_seq_len)
        return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             meta.max_query_len, scale)

    def segments(self, lengths, device):
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [S + 1]
        return cu.to(device), max(lengths)

    def segment_attention(self, q, k, v, plan, scale):
        cu_seqlens, max_seqlen = plan
        return self._varlen(q, k, v, cu_seqlens, max_seqlen, scale)


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def make_ops(backend: str | None, device: torch.device) -> KernelOps:
    """The kernel set for `attention_backend` on `device` (None: Triton on CUDA, torch elsewhere).
    Raises `InvalidRequestError` naming the setting when Triton cannot run there."""
    backend = backend or default_backend(device)
    if backend == "torch":
        return TorchOps()
    if backend != "triton":
        raise InvalidRequestError(f"attention_backend={backend!r} is not one of {list(ATTENTION_BACKENDS)}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError(
            "attention_backend='triton' on the CPU needs the Triton interpreter: set TRITON_INTERPRET=1 in the "
            "environment before starting (slow; for testing the kernels), or use attention_backend='torch'")
    try:
        return TritonOps()
    except ImportError as e:
        raise InvalidRequestError(f"attention_backend='triton' needs the triton package ({e}); install triton "
                                  f"or use attention_backend='torch'") from e
