"""The paged KV cache's size: bytes per block, and the block count the settings give.

    bytes_per_block = num_layers * 2 (K, V) * block_size * num_kv_heads * head_dim * KV dtype bytes

(the KV dtype: the model's, or 1 byte with kv_cache_dtype="fp8"; its per-layer scales are two float32
buffers of each attention layer, counted nowhere: 8 bytes a layer)

The block count comes from the first of: `num_blocks`; `kv_cache_memory` // bytes_per_block; on a GPU,
(memory_utilization * total device memory - memory in use after loading - the other consumers' bytes
(activation peak, sampler, graph pools: vlm_sdk/memory/consumers/) - encoder_cache_memory)
// bytes_per_block (`DeviceBudget`: the encoder cache fills while serving, after the KV cache is
allocated, so its bound is set aside first); on the CPU, enough for max_num_seqs sequences of
max_model_len tokens, at most 1 GiB. `vlm-sdk plan` and engine start-up both size the cache here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidRequestError, format_size
from vlm_sdk.protocol.blocks import blocks_needed

CPU_DEFAULT_CACHE_BYTES = 1 << 30
# which setting decided a cache's block count; the fixes offered for a too-small cache follow it
CACHE_RULES = ("num_blocks", "kv_cache_memory", "memory_utilization", "cpu_default")


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """`dtype`: the cache's (the model's, or float8 e4m3 with kv_cache_dtype="fp8")."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def fp8_bytes_per_block(per_block: int, kv_dtype: torch.dtype) -> int | None:
    """The bytes per block of an FP8 cache of the same model, beside a `kv_dtype` cache of `per_block`
    bytes; None when that cache is FP8 already."""
    bits = torch.finfo(kv_dtype).bits
    return None if bits <= 8 else per_block * 8 // bits


@dataclass(frozen=True)
class DeviceBudget:
    """The device memory a `memory_utilization` cache is carved from (bytes):

        kv_cache_bytes = memory_utilization * total - in_use - activation_peak - encoder_cache

    `in_use` is what is taken before the cache: weights, the CUDA context, other processes (the engine
    measures it; `plan` counts the weights, plus the device's current use with `--device cuda:N`).
    `activation_peak` is the sum of the memory consumers that come and go with each step (the activation
    peak, the sampler, the graph pools; vlm_sdk/memory/consumers/). `encoder_cache` is
    `encoder_cache_memory`: the vision embeddings kept for reuse grow into it while the engine runs,
    after the KV cache is allocated, so it is set aside before the KV cache is sized."""
    total_bytes: int
    in_use_bytes: int
    activation_peak_bytes: int
    encoder_cache_bytes: int = 0

    @property
    def reserved_bytes(self) -> int:
        """Taken before the KV cache: in use, the activation peak and the encoder cache."""
        return self.in_use_bytes + self.activation_peak_bytes + self.encoder_cache_bytes

    def blocks(self, memory_utilization: float, bytes_per_block: int) -> int:
        """KV blocks that fit; may be < 1."""
        return (int(memory_utilization * self.total_bytes) - self.reserved_bytes) // bytes_per_block

    def utilization_for(self, cache_bytes: int) -> float:
        """The smallest memory_utilization (2 decimals, rounded up) leaving `cache_bytes` for the cache;
        above 1 when the device cannot hold it at all."""
        need = self.reserved_bytes + cache_bytes
        hundredths = -(-need * 100 // self.total_bytes)
        if int(hundredths / 100 * self.total_bytes) < need:  # float rounding at an exact boundary
            hundredths += 1
        return hundredths / 100


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    bytes_per_block: int  # all layers, K and V
    source: str  # how num_blocks was decided, in words, for error messages and the start-up report
    rule: str = "num_blocks"  # one of CACHE_RULES
    budget: DeviceBudget | None = None  # CUDA (or a planned device): the memory the cache comes out of
    # the blocks the same rule gives an FP8 cache (kv_cache_dtype="fp8"), when this one is not FP8 and FP8
    # runs on this engine's device and backend; None otherwise
    fp8_blocks: int | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def fixes_for(self, num_blocks: int) -> dict[str, int | float | str]:
        """Settings, each of which alone gives this cache at least `num_blocks` blocks. Only settings
        that would take effect are named: num_blocks overrides kv_cache_memory, which overrides
        memory_utilization, so a cache the user sized by num_blocks is only fixed by num_blocks.
        kv_cache_dtype="fp8" when the same memory holds that many FP8 blocks (`fp8_blocks`). With a
        device budget, only that when the device cannot hold that many blocks of this dtype at all."""
        fixes: dict[str, int | float | str] = {}
        fits = True
        if self.budget is not None:
            u = self.budget.utilization_for(num_blocks * self.bytes_per_block)
            fits = u <= 1  # else the device cannot hold it beside the weights and activations, however set
            if fits and self.rule == "memory_utilization":
                fixes["memory_utilization"] = u
        if fits:
            if self.rule != "num_blocks":
                fixes["kv_cache_memory"] = num_blocks * self.bytes_per_block
            fixes["num_blocks"] = num_blocks
        if self.fp8_blocks is not None and self.fp8_blocks >= num_blocks:
            fixes["kv_cache_dtype"] = "fp8"
        return fixes


def size_cache(args: EngineArgs, per_block: int, max_position_embeddings: int,
               budget: DeviceBudget | None, fp8_per_block: int | None = None) -> CacheConfig:
    """The cache the settings ask for, by the rules above (`budget` None: not on a GPU). The block
    count may be < 1 under memory_utilization: `check_cache` refuses it. The CPU default holds
    max_num_seqs sequences of max_model_len (else max_position_embeddings) tokens. `fp8_per_block`: the
    bytes per block of an FP8 cache where kv_cache_dtype="fp8" would run and is not set (`fp8_blocks`)."""
    cache = _size_cache(args, per_block, max_position_embeddings, budget)
    if fp8_per_block is None or cache.rule == "num_blocks" or fp8_per_block >= per_block:
        return cache
    fp8 = _size_cache(args, fp8_per_block, max_position_embeddings, budget)
    return dataclasses.replace(cache, fp8_blocks=fp8.num_blocks) if fp8.num_blocks > cache.num_blocks else cache


def _size_cache(args: EngineArgs, per_block: int, max_position_embeddings: int,
                budget: DeviceBudget | None) -> CacheConfig:
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


def check_cache(cache: CacheConfig, args: EngineArgs, weights_bytes: int, image_setting: str | None = None) -> None:
    """Raise `InvalidRequestError`, naming the numbers and the fix, when not one block fits.
    `weights_bytes`: this engine's own weights on the rank (the rest of what is in use belongs to the
    CUDA context and other processes, other engines of this process included); `image_setting` (the
    model family's `plan_setting`) is the setting that sizes the profiled image."""
    if cache.num_blocks >= 1:
        return
    per_block, budget = cache.bytes_per_block, cache.budget
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
    need = budget.utilization_for(per_block)
    raise_to = (f"Raise memory_utilization to at least {need:.2f} (room for one {per_block:,}-byte block)"
                if need <= 1 else
                f"Even memory_utilization=1 leaves no room for one {per_block:,}-byte block ({need:.2f} would "
                f"be needed): free device memory")
    others = budget.in_use_bytes - weights_bytes
    raise InvalidRequestError(
        f"no room for the KV cache: memory_utilization={args.memory_utilization} of {budget.total_bytes:,} bytes "
        f"leaves {int(args.memory_utilization * budget.total_bytes):,}; {budget.in_use_bytes:,} are in use "
        f"({weights_bytes:,} by this engine's weights"
        + (f", {others:,} by the CUDA context, other engines and other processes" if others > 0 else "")
        + f") and the activation peak is {budget.activation_peak_bytes:,} (a step of max_num_batched_tokens="
        f"{args.max_num_batched_tokens} tokens, logits for max_num_seqs={args.max_num_seqs} rows and one "
        f"{image_setting or 'largest allowed'} image; lowering those lowers it)"
        + (f"; encoder_cache_memory sets aside {budget.encoder_cache_bytes:,}" if budget.encoder_cache_bytes else "")
        + f". {raise_to}, lower max_num_batched_tokens, max_num_seqs, {image_setting or 'the image size setting'}"
        + (" or encoder_cache_memory" if budget.encoder_cache_bytes else "") + ", or set kv_cache_memory")
