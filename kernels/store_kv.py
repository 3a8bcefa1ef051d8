"""Scatter this step's K/V rows into their slots of the paged KV cache.

    k, v:         [num_tokens, num_kv_heads, head_dim]   (strided views of a packed qkv are fine)
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]   contiguous, same for v_cache
    slot_mapping: [num_tokens] int64 (int32 accepted), flat slot = block * block_size + offset

Token i lands in `k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[i]]`, cast to the cache dtype.
A negative slot means "skip": the padding rows of a CUDA-graph batch carry -1 and must not write.

Grid: one program per token. A token's row is num_kv_heads * head_dim elements (at most a few
thousand), so a single [BLOCK_H, BLOCK_D] tile moves it in one load/store pair; the flat slot
addresses the cache directly because the cache is contiguous (block * block_size + offset rows of
num_kv_heads * head_dim). The skip test is in the kernel, so the launcher never reads the slots on
the host and is safe inside CUDA-graph capture.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.paged_attention import write_kv_cache

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# the slots may be a view into a packed step buffer at any 8-byte offset: not specialised on their
# alignment, or an odd token count before them would compile another variant while serving
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     num_kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # CUDA-graph padding row
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    # cache row `slot` is contiguous [num_kv_heads, head_dim]
    cache_offs = slot * num_kv_heads * head_dim + offs_h[:, None] * head_dim + offs_d[None, :]

    k = tl.load(k_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    n, hkv, d = k.shape
    if k_cache.dim() != 4 or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, {hkv}, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be [{n}] int64 or int32, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {_DTYPES}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def store_kv(k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
             v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
             k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
             v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
             slot_mapping: torch.Tensor) -> None:  # [num_tokens]
    """Write k/v into their cache slots (cast to the cache dtype); rows with slot < 0 are skipped."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    n, hkv, d = k.shape
    if n == 0:
        return
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        hkv, d,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4 if hkv * d >= 2048 else 2,
    )


def store_kv_ref(k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                 v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                 k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                 v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                 slot_mapping: torch.Tensor) -> None:  # [num_tokens]
    """Torch reference of `store_kv`. Boolean masking syncs with the host on CUDA: not for graph capture."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0  # [num_tokens]
    write_kv_cache(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep].long())
