"""Allocating one rank's paged KV cache (its size is decided on the engine side by vlm_sdk/memory/kv.py:
every rank allocates the block count the engine took, the smallest any rank can hold)."""
from __future__ import annotations

import torch

from vlm_sdk.errors import InvalidRequestError, format_size
from vlm_sdk.memory.kv import CacheConfig


def allocate_kv_caches(num_layers: int, cache: CacheConfig, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim], views of one
    allocation."""
    # zeros, not empty: batched decode reads padding slots (masked out), and masked garbage that
    # happens to be NaN would still poison the weighted sum
    shape = (num_layers, 2, cache.num_blocks, cache.block_size, num_kv_heads, head_dim)
    flat = torch.zeros(shape, dtype=dtype, device=device)
    return [(flat[i, 0], flat[i, 1]) for i in range(num_layers)]


def allocate_or_explain(num_layers: int, cache: CacheConfig, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`allocate_kv_caches`, with a device out-of-memory turned into an error that names the cache's
    size, what was free, and the largest cache that fits now."""
    try:
        return allocate_kv_caches(num_layers, cache, num_kv_heads, head_dim, dtype, device)
    except torch.OutOfMemoryError as e:
        if device.type != "cuda":
            raise
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        # the activation peak and the encoder cache still need their share of what is free
        peak = cache.budget.activation_peak_bytes if cache.budget else 0
        encoder = cache.budget.encoder_cache_bytes if cache.budget else 0
        fits = max(0, (free - peak - encoder) // cache.bytes_per_block)
        setting = ("lower memory_utilization (other processes may have taken memory since it was measured)"
                   if cache.rule == "memory_utilization" else
                   f"set num_blocks <= {fits} or kv_cache_memory <= {format_size(fits * cache.bytes_per_block)}")
        raise InvalidRequestError(
            f"allocating the KV cache of {cache.num_blocks} blocks x {cache.bytes_per_block:,} bytes = "
            f"{cache.num_blocks * cache.bytes_per_block:,} bytes ({cache.source}) ran out of device memory: "
            f"{free:,} bytes are free and the activation peak needs {peak:,} of them, the encoder cache "
            f"{encoder:,}; {setting}") from e
