"""The int8 / int4 KV cache in Triton registers: the store's quantization and the attention kernels'
dequantization, the same arithmetic as the torch reference (kernels/kv_int.py, whose docstring has the
layout: uint8 code pages, int4 two values a byte with element d low and d + D/2 high, and a float32
(scale, zero) pair per token and KV head in its own [num_blocks, block_size, Hkv, 2] tensor).

`QUANT` is the constexpr the kernels carry: 0 (a float or FP8 cache: these helpers unused), 8 or 4.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels import kv_int


@triton.jit
def quant_rows(x,  # [R, BLOCK] float32: one row per (token, head); columns past the row masked
               mask,  # [R, BLOCK]
               Q: tl.constexpr):
    """(codes [R, BLOCK] uint8, scale [R], zero [R]) of each row's valid values (kv_int.quantize)."""
    lo = tl.min(tl.where(mask, x, float("inf")), 1)
    hi = tl.max(tl.where(mask, x, float("-inf")), 1)
    scale = tl.maximum(hi - lo, 1e-20) / Q
    zero = -lo / scale
    codes = tl.floor(x / scale[:, None] + zero[:, None] + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), Q * 1.0)
    return codes.to(tl.uint8), scale, zero


@triton.jit
def quant_pair(x1, x2,  # [R, BLOCK] float32: the first and second halves of each row (int4)
               mask,  # [R, BLOCK]: valid columns of each half
               ):
    """int4: (packed bytes [R, BLOCK] uint8 (x1's code low, x2's high), scale [R], zero [R])."""
    lo = tl.min(tl.where(mask, tl.minimum(x1, x2), float("inf")), 1)
    hi = tl.max(tl.where(mask, tl.maximum(x1, x2), float("-inf")), 1)
    scale = tl.maximum(hi - lo, 1e-20) / 15
    zero = -lo / scale
    c1 = tl.minimum(tl.maximum(tl.floor(x1 / scale[:, None] + zero[:, None] + 0.5), 0.0), 15.0).to(tl.int32)
    c2 = tl.minimum(tl.maximum(tl.floor(x2 / scale[:, None] + zero[:, None] + 0.5), 0.0), 15.0).to(tl.int32)
    return (c1 | (c2 << 4)).to(tl.uint8), scale, zero


@triton.jit
def load_tile(rows,  # [BLOCK_N] pointers to byte 0 of each key's head in the code pages
              sz,  # [BLOCK_N] pointers to each key's (scale, zero)
              offs_d,  # [BLOCK_D] the head's columns
              mask,  # [BLOCK_N, BLOCK_D]
              mask_n,  # [BLOCK_N]
              dtype: tl.constexpr, QUANT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A K/V tile [BLOCK_N, BLOCK_D] dequantized into `dtype`: (code - zero) * scale in float32."""
    if QUANT == 8:
        codes = tl.load(rows[:, None] + offs_d[None, :], mask=mask, other=0).to(tl.float32)
    else:  # int4: column d is byte d % (D/2), its high nibble for d >= D/2
        half = HEAD_DIM // 2
        byte = tl.load(rows[:, None] + (offs_d % half)[None, :], mask=mask, other=0).to(tl.int32)
        shift = (offs_d >= half).to(tl.int32) * 4
        codes = ((byte >> shift[None, :]) & 15).to(tl.float32)
    scale = tl.load(sz, mask=mask_n, other=0.0)
    zero = tl.load(sz + 1, mask=mask_n, other=0.0)
    return ((codes - zero[:, None]) * scale[:, None]).to(dtype)


@triton.jit
def load_codes(rows, offs_d, mask, dtype: tl.constexpr, QUANT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A tile's codes [BLOCK_N, BLOCK_D] as `dtype` (0..255 are exact in bf16 / fp16): for kernels that fold
    each key's scale and zero into the scores and the weights instead of dequantizing every element."""
    if QUANT == 8:
        return tl.load(rows[:, None] + offs_d[None, :], mask=mask, other=0).to(dtype)
    half = HEAD_DIM // 2
    byte = tl.load(rows[:, None] + (offs_d % half)[None, :], mask=mask, other=0).to(tl.int32)
    shift = (offs_d >= half).to(tl.int32) * 4
    return ((byte >> shift[None, :]) & 15).to(dtype)


def check_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, k_sz: torch.Tensor | None, v_sz: torch.Tensor | None,
               head_dim: int) -> int:
    """The caches' QUANT (0, 8 or 4), ValueError when K and V disagree or the scales are malformed."""
    bits = kv_int.bits_of(k_cache, k_sz, head_dim)
    if kv_int.bits_of(v_cache, v_sz, head_dim) != bits:
        raise ValueError("k and v caches must both be int8 / int4 (with k_sz and v_sz) or neither")
    for name, t in (("k_sz", k_sz), ("v_sz", v_sz)):
        if t is not None and (t.stride(3) != 1 or t.device != k_cache.device):
            raise ValueError(f"{name} needs a contiguous last dim on {k_cache.device}")
    return bits
