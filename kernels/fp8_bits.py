"""Float8 e4m3 (the FP8 KV cache's dtype) inside the Triton kernels, whatever the GPU: the bit-level
conversions the KV store and the attention kernels share, beside their torch reference (kernels/kv_quant.py).

Why by hand. Triton types float8 e4m3 (`tl.float8e4nv`) only on sm_89 and newer: an A100 (sm_80) refuses
to compile a kernel that names it, and the interpreter (the CPU tests) rounds float32 -> e4m3 wrongly when
the rounding carries into the exponent (125.9 -> 64, not 128). So:

- the store always encodes in integer arithmetic and writes the cache's bytes through a uint8 view
  (`f32_to_e4m3_bits`: round to nearest even, saturate at +-448, as torch's `.to(float8_e4m3fn)` after
  `kv_quant.quantize`'s clamp). A store is a few thousand elements per layer and step: the ALU work is
  nothing beside the attention that follows.
- the attention kernels read e4m3 either with the hardware conversion (sm_89+: `cvt` of two values per
  instruction; the cache passed as float8) or, elsewhere, by moving its bits into a float16
  (`e4m3_bits_to_f16`: sign, then exponent and mantissa shifted into place, which is the value / 256
  exactly, subnormals included); the 256 joins the layer's scale (`SOFTWARE_FACTOR`).

`kernel_cache` picks the path for a launcher: `hardware` None means by the cache's device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels import kv_quant

# e4m3 bits read as a float16 hold the value / 2**8 (float16's exponent bias is 15, e4m3's 7)
SOFTWARE_FACTOR = 256.0


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 -> float8 e4m3 (fn) bits as uint8: nearest, ties to even, saturating at +-448."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a_bits = u & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # normal (|x| >= 2**-6): keep 3 of float32's 23 mantissa bits, rounding at bit 20 (the carry may raise
    # the exponent), then rebias the exponent from 127 to 7
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: m * 2**-9, m = |x| * 2**9 rounded to the nearest even integer by float32's own addition
    # of 2**23 (m = 8 is the smallest normal's code, 0x08: the same bits)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def e4m3_bits_to_f16(b):
    """uint8 e4m3 bits -> float16 holding the value / 256, exactly (NaN codes come out finite)."""
    h = b.to(tl.uint16)
    return (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def load_kv(ptrs, mask, dtype: tl.constexpr, SOFTWARE: tl.constexpr):
    """A K/V tile as `dtype`: a float cache's values, the hardware-converted e4m3 values, or (SOFTWARE:
    uint8 bits) the e4m3 values / SOFTWARE_FACTOR."""
    if SOFTWARE:
        return e4m3_bits_to_f16(tl.load(ptrs, mask=mask, other=0)).to(dtype)
    return tl.load(ptrs, mask=mask, other=0.0).to(dtype)


def hardware_fp8(device: torch.device) -> bool:
    """Whether Triton converts float8 e4m3 in hardware on `device` (CUDA sm_89 and newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def kernel_cache(cache: torch.Tensor, hardware: bool | None = None) -> tuple[torch.Tensor, bool]:
    """(the cache as the attention kernels take it, whether they convert it in software): a float cache
    as is; an FP8 one as float8 with the hardware conversion, else as uint8 bits (values / SOFTWARE_FACTOR,
    which the kernels fold into the scales)."""
    if not kv_quant.is_fp8(cache):
        return cache, False
    if hardware is None:
        hardware = hardware_fp8(cache.device)
    return (cache, False) if hardware else (cache.view(torch.uint8), True)


def f32_to_e4m3_bits_ref(x: torch.Tensor) -> torch.Tensor:  # [...] float32 -> [...] uint8
    """Torch reference of `f32_to_e4m3_bits`."""
    return x.clamp(-kv_quant.FP8_MAX, kv_quant.FP8_MAX).to(kv_quant.KV_FP8).view(torch.uint8)


def e4m3_bits_to_f16_ref(b: torch.Tensor) -> torch.Tensor:  # [...] uint8 -> [...] float16
    """Torch reference of `e4m3_bits_to_f16` (finite codes)."""
    return (b.view(kv_quant.KV_FP8).float() / SOFTWARE_FACTOR).half()

