"""Sizing and allocating the paged KV cache of one rank (under tensor parallelism the engine takes
the smallest block count any rank can hold: every rank then allocates that many).

    bytes_per_block = num_layers * 2 (K, V) * block_size * num_kv_heads * head_dim * dtype bytes

The block count comes from the first of: `num_blocks`; `kv_cache_memory` // bytes_per_block; on CUDA,
(memory_utilization * total device memory - memory in use after loading - profiled activation peak
- encoder_cache_memory) // bytes_per_block (`DeviceBudget`: the encoder cache fills while serving, after
the KV cache is allocated, so its bound is set aside first); on the CPU, enough for max_num_seqs
sequences of max_model_len tokens, at most 1 GiB. `vlm_sdk.plan.planner` applies the same rules
before anything is loaded.
"""
from __future__ import annotations

import torch

from vlm_sdk.config import CacheConfig, DeviceBudget, EngineArgs
from vlm_sdk.errors import InvalidRequestError, format_size
from vlm_sdk.protocol.blocks import blocks_needed

CPU_DEFAULT_CACHE_BYTES = 1 << 30


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def size_cache(args: EngineArgs, per_block: int, max_position_embeddings: int,
               budget: DeviceBudget | None) -> CacheConfig:
    """The cache the settings ask for, by the rules above (`budget` None: not on CUDA). The block
    count may be < 1 under memory_utilization: the caller decides how to refuse. The CPU default
    holds max_num_seqs sequences of max_model_len (else max_position_embeddings) tokens."""
    if args.num_blocks is not None:
        return CacheConfig(args.block_size, args.num_blocks, per_block, f"num_blocks={args.num_blocks} set by you",
                           "num_blocks", budget)
    if args.kv_cache_memory is not None:
        return CacheConfig(args.block_size, args.kv_cache_memory // per_block, per_block,
                           f"kv_cache_memory={args.kv_cache_memory:,} bytes set by you", "kv_cache_memory", budget)
    if budget is not None:
        u = args.memory_utilization
        return CacheConfig(args.block_size, budget.blocks(u, per_block), per_block,
                           f"memory_utilization={u} of {budget.total_bytes:,} bytes, after {budget.in_use_bytes:,} "
                           f"in use, a {budget.activation_peak_bytes:,}-byte activation peak and a "
                           f"{budget.encoder_cache_bytes:,}-byte encoder cache",
                           "memory_utilization", budget)
    useful_tokens = args.max_num_seqs * (args.max_model_len or max_position_embeddings)
    blocks = min(CPU_DEFAULT_CACHE_BYTES // per_block, blocks_needed(useful_tokens, args.block_size))
    return CacheConfig(args.block_size, blocks, per_block,
                       "the CPU default: max_num_seqs full-length sequences, at most 1 GiB "
                       "(set num_blocks or kv_cache_memory to change it)", "cpu_default")


def plan_cache(args: EngineArgs, per_block: int, device: torch.device, max_position_embeddings: int,
               profiled_peak_bytes: int | None = None, image_setting: str | None = None,
               weights_bytes: int | None = None) -> CacheConfig:
    """The engine's cache: on CUDA the budget is measured now (after the weights are loaded). Raises
    `InvalidRequestError`, naming the numbers and the fix, when not one block fits; `image_setting`
    (the model family's `plan_setting`) is the setting that sizes the profiled image; `weights_bytes`
    what loading this engine's weights allocated (the rest of what is in use is someone else's)."""
    budget = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = DeviceBudget(total, total - free, profiled_peak_bytes or 0, args.encoder_cache_memory)
    cache = size_cache(args, per_block, max_position_embeddings, budget)
    if cache.num_blocks >= 1:
        return cache
    if cache.rule == "kv_cache_memory":
        raise InvalidRequestError(
            f"kv_cache_memory={args.kv_cache_memory:,} bytes holds no KV block: one block of "
            f"{args.block_size} tokens takes {per_block:,} bytes; set kv_cache_memory >= {format_size(per_block)} "
            f"(--kv-cache-memory {format_size(per_block)})")
    if budget is None:  # the CPU default, with one block above its 1 GiB cap
        raise InvalidRequestError(
            f"one KV block of {args.block_size} tokens takes {per_block:,} bytes, more than the CPU default "
            f"cache of {CPU_DEFAULT_CACHE_BYTES:,} bytes: set num_blocks, kv_cache_memory >= {format_size(per_block)}, or a "
            f"smaller block_size")
    raise no_room_error(args, budget, per_block, image_setting, weights_bytes)


def no_room_error(args: EngineArgs, budget: DeviceBudget, per_block: int, image_setting: str | None,
                  weights_bytes: int | None) -> InvalidRequestError:
    """Not one block fits the memory_utilization budget: the numbers, whose memory is in use, the fixes."""
    need = budget.utilization_for(per_block)
    raise_to = (f"Raise memory_utilization to at least {need:.2f} (room for one {per_block:,}-byte block)"
                if need <= 1 else
                f"Even memory_utilization=1 leaves no room for one {per_block:,}-byte block ({need:.2f} would "
                f"be needed): free device memory")
    if weights_bytes is None:
        whose, others = "", 0
    else:  # in use is device-wide: the CUDA context, other engines of this process, other processes
        others = max(0, budget.in_use_bytes - weights_bytes)
        whose = (f" ({weights_bytes:,} by this engine's weights, {others:,} by the CUDA context, other engines or "
                 f"tensors of this process and other processes)")
    # memory_utilization bounds the whole device's use, so the k-th of n engines started one after
    # another in a process takes its share with k/n of the total utilization
    shared = (". Most of that memory is not this engine's: engines sharing a device each need a share, "
              "kv_cache_memory for each, or memory_utilization u*k/n for the k-th of n engines started one after "
              "another (it bounds the whole device's use, theirs included)"
              if others > max(weights_bytes or 0, 1 << 30) else "")
    return InvalidRequestError(
        f"no room for the KV cache: memory_utilization={args.memory_utilization} of {budget.total_bytes:,} bytes "
        f"leaves {int(args.memory_utilization * budget.total_bytes):,}; {budget.in_use_bytes:,} are in use"
        f"{whose} and the profiled activation peak is "
        f"{budget.activation_peak_bytes:,} (a step of max_num_batched_tokens={args.max_num_batched_tokens} tokens, "
        f"logits for max_num_seqs={args.max_num_seqs} rows and one {image_setting or 'largest allowed'} image; "
        f"lowering those lowers it)"
        + (f"; encoder_cache_memory sets aside {budget.encoder_cache_bytes:,}" if budget.encoder_cache_bytes else "")
        + shared
        + f". {raise_to}, lower max_num_batched_tokens, max_num_seqs, {image_setting or 'the image size setting'}"
        + (" or encoder_cache_memory" if budget.encoder_cache_bytes else "") + ", or set kv_cache_memory")

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
