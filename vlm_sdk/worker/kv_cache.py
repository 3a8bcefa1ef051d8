"""Allocating one rank's caches from its cache layout (its size is decided on the engine side by
vlm_sdk/memory/kv.py: every rank allocates the block count and state slots the engine took, the smallest
any rank can hold).

    attention   `group_size` KV tensors of [num_blocks, block_size, num_kv_heads, head_dim] (K and V), views
                of one allocation [group_size, 2, num_blocks, ...]; layer i views tensor layer_tensor[i]
                (for a model of one attention kind: tensor i, today's [layers, 2, blocks, ...] cache)
    state       per state layer, its tensors [num_state_slots, *shape] in the spec's dtypes

`caches[i]` is layer i's: a (K, V) pair, or the tuple of its state tensors in spec order. An int8 / int4
page (kv_cache_dtype int8 / int4): K and V are uint8 code pages [num_blocks, block_size, num_kv_heads, D or
D/2] and layer i's cache is (K, V, K scales+zeros, V scales+zeros), the last two [num_blocks, block_size,
num_kv_heads, 2] float32 views of one allocation of the same shape as the pages' (kernels/kv_int.py).
"""
from __future__ import annotations

import torch

from vlm_sdk.errors import InvalidRequestError, format_size
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.protocol.cache_spec import AttentionSpec, StateSpec
from vlm_sdk.protocol.stage_layout import stage_tensors

LayerCache = tuple[torch.Tensor, ...]


def allocate_caches(layout: CacheLayout, num_blocks: int, block_size: int, num_state_slots: int,
                    device: torch.device, layers: tuple[int, int] | None = None) -> list[LayerCache | None]:
    """Every layer's cache (module docstring). `layers`: a pipeline stage's [start, stop): only those
    layers get a cache (the KV tensors they view: protocol/stage_layout.py), the others None."""
    page = layout.page_spec
    held = range(*layers) if layers is not None else range(layout.num_layers)
    tensors = stage_tensors(layout, (held.start, held.stop))
    where = {j: k for k, j in enumerate(tensors)}  # pool tensor -> its place in this rank's allocation
    # zeros, not empty: batched decode reads padding slots (masked out), and masked garbage that
    # happens to be NaN would still poison the weighted sum; a state slot of a fresh request is zero
    shape = (len(tensors), 2, num_blocks, block_size, page.num_kv_heads, page.code_dim)
    quant = page.quant_bits
    flat = torch.zeros(shape, dtype=torch.uint8 if quant else getattr(torch, page.dtype), device=device)
    sz = torch.zeros((*shape[:-1], 2), dtype=torch.float32, device=device) if quant else None
    caches: list[LayerCache | None] = []
    for i, spec in enumerate(layout.specs):
        if i not in held:
            caches.append(None)  # another pipeline stage's layer
        elif isinstance(spec, AttentionSpec):
            j = where[layout.layer_tensor[i]]
            caches.append((flat[j, 0], flat[j, 1]) + ((sz[j, 0], sz[j, 1]) if quant else ()))
        else:
            assert isinstance(spec, StateSpec)
            caches.append(tuple(torch.zeros((num_state_slots, *t.shape), dtype=getattr(torch, t.dtype), device=device)
                                for t in spec.tensors))
    return caches


def copy_state_slots(tensors: list[torch.Tensor], pairs: tuple[tuple[int, int], ...], device: torch.device) -> None:
    """Copy state slot src into slot dst of every state tensor (`[num_state_slots, *shape]`), for each
    (src, dst) of `pairs`: a step's restores (checkpoint -> live slot) or checkpoints (live -> checkpoint).
    The destinations are distinct (live slots, or checkpoint slots taken once per step)."""
    src = torch.tensor([a for a, _ in pairs], dtype=torch.int64).to(device, non_blocking=True)  # [n]
    dst = torch.tensor([b for _, b in pairs], dtype=torch.int64).to(device, non_blocking=True)  # [n]
    for t in tensors:  # [num_state_slots, *shape]
        t.index_copy_(0, dst, t.index_select(0, src))


def allocate_kv_caches(num_layers: int, cache: CacheConfig, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A model of one full-attention kind: one (K, V) pair per layer, each [num_blocks, block_size,
    num_kv_heads, head_dim], views of one allocation."""
    spec = AttentionSpec(num_kv_heads, head_dim, str(dtype).removeprefix("torch."))
    return allocate_caches(CacheLayout.uniform(num_layers, spec), cache.num_blocks, cache.block_size, 0, device)


def allocate_or_explain(layout: CacheLayout, cache: CacheConfig, device: torch.device,
                        layers: tuple[int, int] | None = None) -> list[LayerCache | None]:
    """`allocate_caches` of `cache`, with a device out-of-memory turned into an error that names the cache's
    size (each part: the KV blocks, the state slots), what was free, and the largest cache that fits now."""
    try:
        return allocate_caches(layout, cache.num_blocks, cache.block_size, cache.num_state_slots, device, layers)
    except torch.OutOfMemoryError as e:
        if device.type != "cuda":
            raise
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        # the activation peak and the encoder cache still need their share of what is free
        peak = cache.budget.activation_peak_bytes if cache.budget else 0
        encoder = cache.budget.encoder_cache_bytes if cache.budget else 0
        state = cache.state_bytes
        fits = max(0, (free - peak - encoder - state) // cache.bytes_per_block)
        setting = ("lower memory_utilization (other processes may have taken memory since it was measured)"
                   if cache.rule == "memory_utilization" else
                   f"set num_blocks <= {fits} or kv_cache_memory <= {format_size(fits * cache.bytes_per_block + state)}")
        states = (f" and {cache.num_state_slots} state slots x {cache.state_slot_bytes:,} bytes = {state:,} bytes"
                  if cache.num_state_slots else "")
        raise InvalidRequestError(
            f"allocating the KV cache of {cache.num_blocks} blocks x {cache.bytes_per_block:,} bytes = "
            f"{cache.num_blocks * cache.bytes_per_block:,} bytes{states} ({cache.source}) ran out of device memory: "
            f"{free:,} bytes are free and the activation peak needs {peak:,} of them, the encoder cache "
            f"{encoder:,}; {setting}") from e
