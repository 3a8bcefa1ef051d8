"""The FP8 KV cache's arithmetic, in torch: what the KV store writes and what attention reads back.

A cache of dtype `KV_FP8` (float8 e4m3, `kv_cache_dtype="fp8"`) holds each layer's K and V divided by a
per-layer scale (`k_scale`, `v_scale`: float32 scalars, from the checkpoint's `k_scale` / `v_scale`
tensors when it has them, else 1.0, as vLLM does):

    stored = fp8(clamp(x / scale, -448, 448))     448: e4m3's largest finite value (no inf: saturate)
    read   = float(stored) * scale

A float cache (bf16, fp16, fp32: `kv_cache_dtype="auto"`) stores x cast to its dtype and ignores the
scales. The Triton kernels do the same in registers (kernels/store_kv.py writes; the attention kernels
fold k_scale into the softmax scale and v_scale into the output, which is the same product); these
functions are the torch attention backend's and the kernels' references.

On the CPU `index_copy_` has no float8 kernel: `write_slots` scatters through uint8 views of the same
bytes (also what it does on CUDA, where the view costs nothing).
"""
from __future__ import annotations

import torch

KV_FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is FP8 (then both scales must be one-element float32 tensors on its device)."""
    if not is_fp8(k_cache):
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.numel() != 1 or s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(f"an FP8 KV cache needs {name} as a one-element float32 tensor on {k_cache.device}, "
                             f"got {None if s is None else (tuple(s.shape), s.dtype, str(s.device))}")
    return True


def quantize(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: cast to a float cache's dtype, or scaled and saturated into FP8."""
    if cache_dtype != KV_FP8:
        return x.to(cache_dtype)
    if scale is None:
        raise ValueError("an FP8 KV cache needs its layer's scale (k_scale / v_scale)")
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents back as `dtype` values: a float cache's cast, an FP8 cache's scaled."""
    if stored.dtype != KV_FP8:
        return stored.to(dtype)
    if scale is None:
        raise ValueError("an FP8 KV cache needs its layer's scale (k_scale / v_scale)")
    return (stored.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as attention reads it back from a cache of `cache_dtype` (x itself for a float cache of its
    dtype): what a path that attends over this step's K/V without reading the cache must use."""
    if cache_dtype != KV_FP8:
        return x
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)


def write_slots(cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                slots: torch.Tensor,  # [n] int64 flat slots
                values: torch.Tensor,  # [n, num_kv_heads, head_dim], already in the cache's dtype
                ) -> None:
    """cache rows `slots` = values (index_copy_ on the flat slot axis; FP8 through uint8 views)."""
    rows = cache.view(-1, *cache.shape[2:])  # [num_slots, Hkv, D]
    if cache.dtype == KV_FP8:
        rows, values = rows.view(torch.uint8), values.view(torch.uint8)
    rows.index_copy_(0, slots, values)
