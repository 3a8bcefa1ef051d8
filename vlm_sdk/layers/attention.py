"""Attention layers: they own the attention's parameters (heads, scale, causal or within segments)
and call the engine's attention backend (`vlm_sdk.attention.backend.AttentionBackend`).

    PagedAttention    decoder: causal, over the paged KV cache (or, with `window`, over the last
                      `window` keys only: a sliding-window layer); stores this step's K/V first (unless
                      the kernel set stored them with the rotary)
    SegmentAttention  vision towers: non-causal within back-to-back segments (windows, images)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """`k_scale` / `v_scale`: the FP8 KV cache's per-layer scales (the cache holds K / k_scale, V / v_scale:
    kernels/kv_quant.py), persistent buffers so that a checkpoint's `k_scale` / `v_scale` tensors load into
    them; 1.0 when it has none (vLLM's default). A float cache ignores them. `window` (HF's
    `sliding_window`): a query at position p attends keys p - window < q <= p; None: every earlier key.
    The layer's cache spec (`AttentionSpec.window`) must say the same: the engine frees the blocks
    before the window."""
    causal = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend,
                 device: torch.device | str | None = None, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim  # this rank's
        self.scale = scale
        self.window = window
        self.backend = backend
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device))

    def forward(self, q: torch.Tensor,  # [N, H, D]
                k: torch.Tensor,  # [N, Hkv, D]
                v: torch.Tensor,  # [N, Hkv, D]
                kv_cache: tuple[torch.Tensor, torch.Tensor],  # this layer's K and V cache
                meta: AttentionMetadata, stored: bool = False) -> torch.Tensor:  # [N, H, D]
        """`meta` is the backend's `prepare`d metadata of this step; `stored`: k and v are in the cache
        already (a fused rotary + store), so the backend does not write them again."""
        return self.backend.forward(q, k, v, self, kv_cache, meta, stored=stored)


class SegmentAttention(nn.Module):
    causal = False

    def __init__(self, num_heads: int, head_dim: int, scale: float, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # [N, H, D]
                plan: Any) -> torch.Tensor:  # [N, H, D]
        """`plan` is `backend.segments(lengths, device)`, built once per tower call."""
        return self.backend.segment_forward(q, k, v, self, plan)
