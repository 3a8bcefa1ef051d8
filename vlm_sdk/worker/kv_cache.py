"""Allocating the paged KV cache on the worker's device (its size is decided by `engine.kv_cache`)."""
from __future__ import annotations

import torch

from vlm_sdk.config import CacheConfig


def allocate_kv_caches(num_layers: int, cache: CacheConfig, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim], views of one
    allocation."""
    # zeros, not empty: batched decode reads padding slots (masked out), and masked garbage that
    # happens to be NaN would still poison the weighted sum
    shape = (num_layers, 2, cache.num_blocks, cache.block_size, num_kv_heads, head_dim)
    flat = torch.zeros(shape, dtype=dtype, device=device)
    return [(flat[i, 0], flat[i, 1]) for i in range(num_layers)]
