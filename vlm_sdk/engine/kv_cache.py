"""Sizing and allocating the paged KV cache.

    bytes_per_block = num_layers * 2 (K, V) * block_size * num_kv_heads * head_dim * dtype bytes

The block count comes from the first of: `num_blocks`; `kv_cache_memory` // bytes_per_block; on CUDA,
(memory_utilization * total device memory - memory in use after loading - profiled activation peak)
// bytes_per_block; on the CPU, enough for max_num_seqs sequences of
max_model_len tokens, at most 1 GiB.
"""
from __future__ import annotations

import torch

from vlm_sdk.config import CacheConfig, EngineArgs
from vlm_sdk.engine.block_manager import blocks_needed
from vlm_sdk.errors import InvalidRequestError

CPU_DEFAULT_CACHE_BYTES = 1 << 30


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def plan_cache(args: EngineArgs, per_block: int, device: torch.device, max_useful_tokens: int,
               profiled_peak_bytes: int | None = None) -> CacheConfig:
    """`max_useful_tokens` (max_num_seqs full-length sequences) caps the CPU default."""
    if args.num_blocks is not None:
        return CacheConfig(args.block_size, args.num_blocks, per_block, f"num_blocks={args.num_blocks} set by you")
    if args.kv_cache_memory is not None:
        blocks = args.kv_cache_memory // per_block
        if blocks < 1:
            raise InvalidRequestError(
                f"kv_cache_memory={args.kv_cache_memory:,} bytes holds no KV block: one block of "
                f"{args.block_size} tokens takes {per_block:,} bytes; set kv_cache_memory >= {per_block:,}")
        return CacheConfig(args.block_size, blocks, per_block,
                           f"kv_cache_memory={args.kv_cache_memory:,} bytes set by you")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = torch.cuda.memory_allocated(device)
        peak = profiled_peak_bytes or 0
        blocks = blocks_from_device_memory(total, total - free, peak, args.memory_utilization, per_block)
        if blocks < 1:
            need = min_memory_utilization(total, free, peak, per_block)
            raise_to = (f"Raise memory_utilization to at least {need:.2f} (room for one {per_block:,}-byte "
                        f"block)" if need <= 1 else
                        f"Even memory_utilization=1 leaves no room for one {per_block:,}-byte block ({need:.2f} "
                        f"would be needed): free device memory")
            raise InvalidRequestError(
                f"no room for the KV cache: memory_utilization={args.memory_utilization} of {total:,} bytes "
                f"leaves {int(args.memory_utilization * total):,}; {total - free:,} are in use "
                f"({in_use:,} by this engine's weights) and the profiled activation peak is {peak:,} (a step "
                f"of max_num_batched_tokens={args.max_num_batched_tokens} tokens, logits for "
                f"max_num_seqs={args.max_num_seqs} rows and one max_pixels image; lowering those lowers it). "
                f"{raise_to}, lower max_num_batched_tokens, max_num_seqs or max_pixels, or set kv_cache_memory")
        return CacheConfig(args.block_size, blocks, per_block,
                           f"memory_utilization={args.memory_utilization} of {total:,} bytes, after "
                           f"{total - free:,} in use and a {peak:,}-byte activation peak")
    blocks = cpu_default_blocks(per_block, max_useful_tokens, args.block_size)
    return CacheConfig(args.block_size, blocks, per_block,
                       "the CPU default: max_num_seqs full-length sequences, at most 1 GiB "
                       "(set num_blocks or kv_cache_memory to change it)")


def blocks_from_device_memory(total: int, in_use: int, peak: int, memory_utilization: float,
                              per_block: int) -> int:
    """KV blocks that fit in (memory_utilization * total - in_use - peak) bytes; may be < 1.
    total: device bytes; in_use: bytes already taken (weights, other processes); peak: activation bytes."""
    return (int(memory_utilization * total) - in_use - peak) // per_block


def cpu_default_blocks(per_block: int, max_useful_tokens: int, block_size: int) -> int:
    """The CPU default: enough blocks for `max_useful_tokens` tokens, at most CPU_DEFAULT_CACHE_BYTES."""
    return min(CPU_DEFAULT_CACHE_BYTES // per_block, blocks_needed(max_useful_tokens, block_size))


def min_memory_utilization(total: int, free: int, peak: int, per_block: int) -> float:
    """The smallest memory_utilization, rounded up to 2 decimals, that leaves room for one KV block
    after the memory in use (`total - free`) and the activation peak."""
    need = total - free + peak + per_block
    hundredths = -(-need * 100 // total)
    if int(hundredths / 100 * total) < need:  # float rounding at an exact boundary
        hundredths += 1
    return hundredths / 100


def allocate_kv_caches(num_layers: int, cache: CacheConfig, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # zeros, not empty: batched decode reads padding slots (masked out), and masked garbage that
    # happens to be NaN would still poison the weighted sum
    shape = (num_layers, 2, cache.num_blocks, cache.block_size, num_kv_heads, head_dim)
    flat = torch.zeros(shape, dtype=dtype, device=device)
    return [(flat[i, 0], flat[i, 1]) for i in range(num_layers)]
