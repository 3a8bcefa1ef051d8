"""Scatter this step's K/V rows into their slots of the paged KV cache.

    k, v:         [num_tokens, num_kv_heads, head_dim]   (strided views of a packed qkv are fine)
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]   contiguous, same for v_cache
    slot_mapping: [num_tokens] int64 (int32 accepted), flat slot = block * block_size + offset

Token i lands in `k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[i]]`, cast to the cache dtype;
an FP8 cache (`kv_quant.KV_FP8`) gets fp8(clamp(k / k_scale, +-448)) (and v by v_scale), the scales
read from their device scalars in the kernel (no host read: graph-safe), the e4m3 bits made in integer
arithmetic and written through a uint8 view (kernels/fp8_bits.py: any GPU, and the interpreter).
An int8 / int4 cache (`k_sz` / `v_sz` given: kernels/kv_int.py) gets each token's heads quantized per head
(asymmetric, LMDeploy's quant_policy 8 / 4), the codes into the uint8 pages (int4: two a byte) and the
(scale, zero) pairs into their tensor at the same slot (kernels/kv_int_bits.py).
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

from vlm_sdk.kernels import kv_int, kv_int_bits, kv_quant
from vlm_sdk.kernels.fp8_bits import f32_to_e4m3_bits
from vlm_sdk.kernels.paged_attention import write_kv_cache

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = _DTYPES + (kv_quant.KV_FP8,)


@triton.jit
def _to_cache(x, scale_ptr, cache_ptr, FP8: tl.constexpr):
    """x as the cache stores it: cast, or (FP8: the cache is its uint8 view) the e4m3 bits of x / scale."""
    if FP8:
        return f32_to_e4m3_bits(x.to(tl.float32) / tl.load(scale_ptr))
    return x.to(cache_ptr.dtype.element_ty)


# the slots may be a view into a packed step buffer at any 8-byte offset: not specialised on their
# alignment, or an odd token count before them would compile another variant while serving
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     num_kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
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
    tl.store(k_cache_ptr + cache_offs, _to_cache(k, k_scale_ptr, k_cache_ptr, FP8), mask=mask)
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_offs, _to_cache(v, v_scale_ptr, v_cache_ptr, FP8), mask=mask)


@triton.jit
def _store_int_one(x_ptr, stride_xn, stride_xh, cache_ptr, sz_ptr, token, slot, num_kv_heads,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """One token's K (or V) heads quantized into code row `slot` and its (scale, zero) pairs."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    x_row = x_ptr + token * stride_xn + offs_h[:, None] * stride_xh
    sz_offs = (slot * num_kv_heads + offs_h) * 2  # [BLOCK_H] into [num_slots, Hkv, 2]
    mask_h = offs_h < num_kv_heads
    if QUANT == 8:
        mask = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
        x = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        codes, scale, zero = kv_int_bits.quant_rows(x, mask, 255)
        tl.store(cache_ptr + slot * num_kv_heads * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :], codes,
                 mask=mask)
    else:  # int4: BLOCK_D covers half a head; byte d = element d (low) | element d + D/2 (high)
        half = HEAD_DIM // 2
        mask = mask_h[:, None] & (offs_d[None, :] < half)
        x1 = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + half + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        codes, scale, zero = kv_int_bits.quant_pair(x1, x2, mask)
        tl.store(cache_ptr + slot * num_kv_heads * half + offs_h[:, None] * half + offs_d[None, :], codes, mask=mask)
    tl.store(sz_ptr + sz_offs, scale, mask=mask_h)
    tl.store(sz_ptr + sz_offs + 1, zero, mask=mask_h)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_int_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_sz_ptr, v_sz_ptr, slot_ptr,
                         stride_kn, stride_kh, stride_vn, stride_vh, num_kv_heads,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # CUDA-graph padding row
        return
    _store_int_one(k_ptr, stride_kn, stride_kh, k_cache_ptr, k_sz_ptr, token, slot, num_kv_heads,
                   HEAD_DIM, BLOCK_H, BLOCK_D, QUANT)
    _store_int_one(v_ptr, stride_vn, stride_vh, v_cache_ptr, v_sz_ptr, token, slot, num_kv_heads,
                   HEAD_DIM, BLOCK_H, BLOCK_D, QUANT)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor, k_sz: torch.Tensor | None = None, v_sz: torch.Tensor | None = None) -> int:
    """The cache's int bits (0: float or FP8), ValueError on any malformed input."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    n, hkv, d = k.shape
    bits = kv_int_bits.check_pair(k_cache, v_cache, k_sz, v_sz, d) if k_cache.dim() == 4 else 0
    width = kv_int.code_dim(d, bits) if bits else d
    if k_cache.dim() != 4 or k_cache.shape[2:] != (hkv, width) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, {hkv}, {width}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be [{n}] int64 or int32, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {_DTYPES}")
    if bits:
        if not (k_sz.is_contiguous() and v_sz.is_contiguous()):
            raise ValueError("k_sz and v_sz must be contiguous")
    elif k_cache.dtype not in _CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share one dtype of {_CACHE_DTYPES}, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    return bits


def store_kv(k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
             v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
             k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
             v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
             slot_mapping: torch.Tensor,  # [num_tokens]
             k_scale: torch.Tensor | None = None,  # [] float32: an FP8 cache's scales (else unused)
             v_scale: torch.Tensor | None = None,
             k_sz: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, 2] float32: an int cache's
             v_sz: torch.Tensor | None = None) -> None:
    """Write k/v into their cache slots (cast to the cache dtype, or quantized into an FP8 one, or into an
    int8 / int4 one with its scales and zeros); rows with slot < 0 are skipped."""
    bits = _check(k, v, k_cache, v_cache, slot_mapping, k_sz, v_sz)
    n, hkv, d = k.shape
    if n == 0:
        return
    if bits:
        _store_kv_int_kernel[(n,)](
            k, v, k_cache, v_cache, k_sz, v_sz, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
            BLOCK_D=triton.next_power_of_2(kv_int.code_dim(d, bits)), QUANT=bits, num_warps=4 if hkv * d >= 2048 else 2)
        return
    fp8 = kv_quant.check_scales(k_cache, k_scale, v_scale)
    if fp8:  # written as bytes (kernels/fp8_bits.py)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:  # the scales are read only with FP8
        k_scale = v_scale = k_cache
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        hkv, d,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d), FP8=fp8,
        num_warps=4 if hkv * d >= 2048 else 2,
    )


def store_kv_ref(k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                 v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                 k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                 v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                 slot_mapping: torch.Tensor,  # [num_tokens]
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None,
                 k_sz: torch.Tensor | None = None,
                 v_sz: torch.Tensor | None = None) -> None:
    """Torch reference of `store_kv`. Boolean masking syncs with the host on CUDA: not for graph capture."""
    if not _check(k, v, k_cache, v_cache, slot_mapping, k_sz, v_sz):
        kv_quant.check_scales(k_cache, k_scale, v_scale)
    keep = slot_mapping >= 0  # [num_tokens]
    write_kv_cache(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep].long(), k_scale, v_scale, k_sz, v_sz)
