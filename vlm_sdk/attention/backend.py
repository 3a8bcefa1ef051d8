"""The attention backend contract (`AttentionBackend`); `selector.make_backend` picks one per engine.

A backend owns the attention ops of one engine: writing this step's K/V into the paged cache and
attending over it (decoder layers), and attention within segments (vision towers). It follows
mini-sglang's `prepare_metadata` pattern:

    runner, once per step:      meta = backend.prepare(AttentionMetadata(...), k_cache)
                                (the CUDA-graph capture calls the same hook for each captured size)
    every attention layer:      out = backend.forward(q, k, v, layer, (k_cache, v_cache), meta)

`prepare` returns the backend's own subclass of `AttentionMetadata` holding what it derives once per
step (Triton: the decode grid's `num_splits`; torch: the decode groups); `forward` reads it and writes
nothing into it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from vlm_sdk.attention.metadata import AttentionMetadata

class AttentionLayerSpec(Protocol):
    """What a backend reads of the calling layer (`vlm_sdk.layers.attention`)."""
    scale: float
    # the layer's FP8 KV-cache scales ([] float32 on the cache's device; kernels/kv_quant.py), read only
    # when the cache is FP8: it stores K / k_scale and V / v_scale
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    # a sliding-window layer's window (keys p - window < q <= p); None: full attention. The step's
    # metadata of the layer's cache group carries the same (`AttentionMetadata.window`)
    window: int | None


class AttentionBackend(ABC):
    """The attention ops of one engine. Inputs may be strided views with a contiguous last dim.
    Nothing here synchronises with the host on a decode step when `graph_safe` (CUDA graphs capture it)."""

    name: str
    # whether a decode step may be captured into a CUDA graph (no host reads of device data)
    graph_safe: bool

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> AttentionMetadata:
        """This backend's per-step metadata, built once before the forward from the runner's `meta`
        and one layer's K cache `[num_blocks, block_size, num_kv_heads, head_dim]` (every layer's has
        this shape), once per attention cache group (`meta.window`: the group's). `forward` needs the
        returned object."""

    @abstractmethod
    def forward(self, q: torch.Tensor,  # [N, H, D]
                k: torch.Tensor,  # [N, Hkv, D]
                v: torch.Tensor,  # [N, Hkv, D]
                layer: AttentionLayerSpec, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, stored: bool = False) -> torch.Tensor:  # [N, H, D]
        """Store this step's K/V in the layer's cache (slot -1 skipped: graph padding; quantized with the
        layer's k_scale / v_scale into an FP8 cache; per token and head into an int8 / int4 cache, whose
        `kv_cache` is (K codes, V codes, K scales+zeros, V scales+zeros); not when `stored`: the caller wrote them, fused with
        the rotary), then causal attention of the queries over their
        sequences' cached keys (within `layer.window` for a sliding-window layer). `meta` is what
        `prepare` returned for the layer's cache group."""

    @abstractmethod
    def segments(self, lengths: list[int], device: torch.device) -> Any:
        """A plan for `segment_forward` over back-to-back segments of these lengths (once per
        vision-tower call, shared by its blocks)."""

    @abstractmethod
    def segment_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # [N, H, D]
                        layer: AttentionLayerSpec, plan: Any) -> torch.Tensor:  # [N, H, D]
        """Non-causal attention within each segment of the plan."""
