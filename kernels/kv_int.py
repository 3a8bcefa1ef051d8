"""The int8 / int4 KV cache's arithmetic in torch (`kv_cache_dtype="int8" | "int4"`, LMDeploy's
`quant_policy` 8 | 4): what the KV store writes and what attention reads back. The Triton kernels do the
same in registers (kernels/kv_int_bits.py); these functions are their reference and the torch backend's.

Per token and KV head, asymmetric over the head's D values (LMDeploy's `_quant_int8` / `_quant_int4` in
lmdeploy/pytorch/kernels/cuda/fill_kv_cache.py; Q = 255 for int8, 15 for int4):

    scale = max(max(x) - min(x), tiny) / Q      zero = -min(x) / scale      (zero in code units)
    code  = floor(x / scale + zero + 0.5)  clamped to 0..Q            read = (code - zero) * scale

so |x - read| <= scale / 2 per element (round to nearest; min(x) maps to code 0, max(x) to Q). Layout, as
LMDeploy's cache engine allocates it: the codes in uint8 pages beside the float pages' shape,
[num_blocks, block_size, num_kv_heads, D] for int8 and [.., D / 2] for int4, whose byte d holds element d in
its low nibble and element d + D / 2 in its high one; (scale, zero) per token and head in their own tensor
[num_blocks, block_size, num_kv_heads, 2] of the same block ids. One deviation: LMDeploy keeps scale and
zero in the model's dtype; here they are float32 (4 more bytes a token and head for K and for V), because
a bfloat16 zero of up to 255 code units rounds by up to half a unit, doubling int8's error bound.
"""
from __future__ import annotations

import torch

from vlm_sdk.config import INT_KV_BITS  # noqa: F401  (kv_cache_dtype -> bits a value)

SZ_DTYPE = torch.float32  # the (scale, zero) tensor's
# a head whose D values are all equal gets this scale instead of 0 (no division by zero; read back exactly)
TINY_RANGE = 1e-20


def code_max(bits: int) -> int:
    return (1 << bits) - 1


def code_dim(head_dim: int, bits: int) -> int:
    """Bytes of one token's head in the code pages: D for int8, D / 2 for int4."""
    return head_dim if bits == 8 else head_dim // 2


def bits_of(cache: torch.Tensor, sz: torch.Tensor | None, head_dim: int) -> int:
    """0 for a float or FP8 cache (no `sz`), else 8 or 4 from the code pages' width; ValueError when the
    pages and `sz` do not form an int8 / int4 cache of `head_dim`."""
    if sz is None:
        return 0
    if cache.dtype != torch.uint8 or sz.dtype != SZ_DTYPE or sz.shape != (*cache.shape[:3], 2):
        raise ValueError(f"an int8 / int4 KV cache is uint8 pages [num_blocks, block_size, Hkv, D or D/2] with "
                         f"float32 scales and zeros [num_blocks, block_size, Hkv, 2]; got {tuple(cache.shape)} "
                         f"{cache.dtype} and {tuple(sz.shape)} {sz.dtype}")
    if cache.shape[3] == head_dim:
        return 8
    if 2 * cache.shape[3] == head_dim:
        return 4
    raise ValueError(f"code pages of width {cache.shape[3]} fit neither int8 ({head_dim}) nor int4 "
                     f"({head_dim // 2}) of head_dim {head_dim}")


def quantize(x: torch.Tensor,  # [..., D] float
             bits: int) -> tuple[torch.Tensor, torch.Tensor]:  # codes [..., D or D/2] uint8, sz [..., 2] float32
    """Each row of D values quantized (module docstring): its codes (int4: two a byte) and (scale, zero)."""
    q = code_max(bits)
    xf = x.float()
    lo, hi = xf.amin(-1), xf.amax(-1)  # [...]
    scale = (hi - lo).clamp(min=TINY_RANGE) / q
    zero = -lo / scale
    codes = torch.floor(xf / scale[..., None] + zero[..., None] + 0.5).clamp(0, q).to(torch.uint8)  # [..., D]
    if bits == 4:
        half = x.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)  # [..., D/2]
    return codes, torch.stack([scale, zero], dim=-1)


def dequantize(codes: torch.Tensor,  # [..., D or D/2] uint8
               sz: torch.Tensor,  # [..., 2] float32
               bits: int, dtype: torch.dtype) -> torch.Tensor:  # [..., D]
    if bits == 4:
        codes = torch.cat([codes & 0xF, codes >> 4], dim=-1)  # [..., D]
    return ((codes.float() - sz[..., 1:2]) * sz[..., 0:1]).to(dtype)


def round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x as attention reads it back from an int cache (x itself for bits 0): what a path that attends over
    this step's K/V without reading the cache must use."""
    if not bits:
        return x
    return dequantize(*quantize(x, bits), bits, x.dtype)


def write_slots(cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D or D/2] uint8
                sz_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, 2] float32
                slots: torch.Tensor,  # [n] int64 flat slots
                x: torch.Tensor,  # [n, Hkv, D]
                bits: int) -> None:
    codes, sz = quantize(x, bits)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, codes)
    sz_cache.view(-1, *sz_cache.shape[2:]).index_copy_(0, slots, sz)


def error_bound(sz: torch.Tensor) -> torch.Tensor:  # [..., 2] -> [...]
    """The largest |x - read| of each row: half its scale (plus float32's rounding of the read)."""
    return sz[..., 0] / 2
