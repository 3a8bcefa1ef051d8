"""y = x W^T (+ b) with W held as int4 (AWQ or GPTQ layout), dequantized in registers: the GPU product of
the quantized linear layers (vlm_sdk/layers/quantized_linear.py; the CPU dequantizes whole weights with
kernels/dequant_torch.py, this op's reference).

    x:       [M, K]  float16 / bfloat16 / float32, last dim contiguous
    AWQ      qweight [K, N/8] int32 (nibble i of word c: column 8c + AWQ_ORDER[i]), qzeros [K/G, N/8] (same
             order), scales [K/G, N]:           W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    GPTQ     qweight [K/8, N] int32 (nibble i of word r: row 8r + i), qzeros [groups, N/8] (sequential),
             scales [groups, N], g = g_idx[k] (desc_act) or k // G:
                                                W[n, k] = (q[k, n] - (z[g, n] + zero_offset)) * s[g, n]
             qzeros None: no zero points (W[n, k] = (q[k, n] - zero_offset) * s[g, n], compressed-tensors'
             symmetric W4A16: zero_offset 8)
    out:     [M, N]  x.dtype

The GPTQ tensors may be transposed views (any stride along N): compressed-tensors' pack-quantized W4A16
(weight_packed [N, K/8], weight_scale [N, groups], weight_zero_point [N/8, groups]) is GPTQ v2's layout with
every tensor transposed, so its layer passes `.t()` views and this kernel reads them in place. A qweight
whose words run along K (`K_MAJOR`: such a view) is read as [BLOCK_N, BLOCK_K / 8] words, contiguous along
K, unpacked to [BLOCK_N, BLOCK_K] and transposed in registers, rather than gathered word by word.

Each program owns a [BLOCK_M, BLOCK_N] output tile and walks its share of K in BLOCK_K steps: it gathers
the int32 words of a [BLOCK_K, BLOCK_N] weight tile (each word serves the 8 lanes of its nibbles: the
duplicate addresses coalesce), shifts each nibble out, subtracts the zero, multiplies by the scale in
float32, rounds to x's dtype (what the reference's F.linear on the dequantized weight multiplies) and
feeds a tensor-core dot with float32 accumulation. Groups: when BLOCK_K divides G, one scale and zero row
per tile (`GROUPS` "tile"); otherwise per row of the tile, from k // G ("row") or from g_idx ("index").

Two paths, chosen from M (`choose_config`):
- decode-sized M (<= SMALL_M): the product is weight traffic (K * N / 2 bytes), and N / BLOCK_N programs
  are too few to keep an H100's loads in flight, so K is split too (split-K: `split` programs per output
  tile, each over k_per_split keys, writing float32 partials [split, M, N] that one sum reduces; the bias
  is added after it). 16-row M tiles (the tensor cores' smallest), 64-wide N.
- prefill-sized M: 64 x 128 tiles, no split, the bias added in the kernel.
The launcher reads no device data on the host (CUDA-graph capture); M is not specialised (a new value
per step would compile a variant while serving), and `split` is a power of two from a few values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vlm_sdk.kernels.dequant_torch import dequantize_awq, dequantize_gptq

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL_M = 16  # rows up to which the split-K path runs
PROGRAMS_PER_SM = 4
_GROUPS = {"tile": 0, "row": 1, "index": 2}


@triton.jit
def _awq_shift(col):
    """The bit offset of column `col` % 8 in its AWQ word: nibble (j // 2) + 4 (j % 2) holds column j."""
    j = col % 8
    return ((j // 2) + (j % 2) * 4) * 4


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _int4_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, out_ptr,
                      M, N, K, k_per_split, zero_offset,
                      stride_xm, stride_qw, stride_qz, stride_s, stride_om, stride_os,
                      stride_qw_n, stride_qz_n, stride_s_n,  # along N: 1, or a transposed view's row stride
                      AWQ: tl.constexpr, K_MAJOR: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                      HAS_ZEROS: tl.constexpr,
                      HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # where each column's zero sits in its word: AWQ's interleave, or GPTQ's sequential nibbles
    if AWQ:
        z_shift = _awq_shift(offs_n)
    else:
        z_shift = (offs_n % 8) * 4
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        mask_k = k < k_end
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        mask_w = mask_k[:, None] & mask_n[None, :]  # [BLOCK_K, BLOCK_N]
        if AWQ:  # word [k, n // 8]
            words = tl.load(qw_ptr + k.to(tl.int64)[:, None] * stride_qw + (offs_n // 8)[None, :] * stride_qw_n,
                            mask=mask_w, other=0)
            q = (words >> _awq_shift(offs_n)[None, :]) & 0xF
        elif K_MAJOR:  # a transposed view: each column's words run along K (stride_qw 1)
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8] word indices
            mask_kw = kw * 8 < k_end
            words = tl.load(qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qw_n + kw[None, :] * stride_qw,
                            mask=mask_n[:, None] & mask_kw[None, :], other=0)  # [BLOCK_N, BLOCK_K / 8]
            q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K / 8, 8]
            q = tl.trans(tl.reshape(q, (BLOCK_N, BLOCK_K)))  # [BLOCK_K, BLOCK_N]
        else:  # word [k // 8, n]
            words = tl.load(qw_ptr + (k // 8).to(tl.int64)[:, None] * stride_qw
                            + offs_n.to(tl.int64)[None, :] * stride_qw_n, mask=mask_w, other=0)
            q = (words >> ((k % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        if GROUPS == 0:  # the tile lies in one group: one row of scales and zeros
            g = k0 // GROUP
            s = tl.load(s_ptr + g * stride_s + offs_n * stride_s_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                z = (tl.load(qz_ptr + g * stride_qz + (offs_n // 8) * stride_qz_n, mask=mask_n, other=0)
                     >> z_shift) & 0xF
                z = z[None, :]
            else:
                z = 0
        else:
            if GROUPS == 1:
                g = k // GROUP  # [BLOCK_K]
            else:
                g = tl.load(g_ptr + k, mask=mask_k, other=0)
            s = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :] * stride_s_n, mask=mask_w,
                        other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = (tl.load(qz_ptr + g[:, None] * stride_qz + (offs_n // 8)[None, :] * stride_qz_n, mask=mask_w,
                             other=0) >> z_shift[None, :]) & 0xF
            else:
                z = 0
        w = ((q - (z + zero_offset)).to(tl.float32) * s).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
    mask_o = mask_m[:, None] & mask_n[None, :]
    if SPLIT:  # float32 partials [split, M, N]
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask_o)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_o)


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs per output tile along K (1: the tiled path)
    num_warps: int
    num_stages: int


def choose_config(m: int, n: int, k: int, group: int, device: torch.device) -> Config:
    """The launch for an [m, k] x [k, n] product (host ints only): `gpu_config` on CUDA. On the CPU (the
    interpreter) small tiles and at most 2 splits, so tests cross tile, split and group edges cheaply."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_config(m, n, k, group, torch.cuda.get_device_properties(device).multi_processor_count)
    block_k = _block_k(32, group)
    if m <= SMALL_M:
        return Config(16, 32, block_k, _split(2, k, block_k), 4, 1)
    return Config(32, 32, block_k, 1, 4, 1)


def gpu_config(m: int, n: int, k: int, group: int, sms: int) -> Config:
    """On a GPU of `sms` multiprocessors: at m <= SMALL_M, 16 x 64 tiles and a power-of-two split of K
    that brings the programs to about PROGRAMS_PER_SM per SM (at most 16, each split at least one
    BLOCK_K step); above, 64 x 128 tiles and no split."""
    block_k = _block_k(64, group)
    if m <= SMALL_M:
        want = triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(n, 64))
        return Config(16, 64, block_k, _split(want, k, block_k), 4, 3)
    return Config(64, 128, block_k, 1, 8, 3)


def _block_k(largest: int, group: int) -> int:
    """The largest power of two <= `largest` (and >= 16, tl.dot's least) dividing the group, so that a
    tile's rows share one scale row; 16 when none does (the tile then reads a scale row per row)."""
    block_k = largest
    while block_k > 16 and group % block_k:
        block_k //= 2
    return block_k


def _split(want: int, k: int, block_k: int) -> int:
    split = 1
    while split * 2 <= min(want, triton.cdiv(k, block_k), 16):
        split *= 2
    return split


def _check(x, qweight, qzeros, scales, g_idx, bias, awq: bool, group: int) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [M, K] of {_DTYPES} with a contiguous last dim, got {tuple(x.shape)} {x.dtype}")
    k = x.shape[1]
    if qzeros is None and awq:
        raise ValueError("AWQ needs qzeros")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t is not None and (t.dtype != torch.int32 or t.dim() != 2):
            raise ValueError(f"{name} must be int32 [rows, cols], got {t.dtype} {tuple(t.shape)}")
    n = qweight.shape[1] * 8 if awq else qweight.shape[1]
    rows = k if awq else k // 8
    if k % 8 or qweight.shape[0] != rows:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not hold K={k} inputs ({'AWQ' if awq else 'GPTQ'})")
    zeros_ok = qzeros is None or qzeros.shape == (scales.shape[0], n // 8)
    if scales.dim() != 2 or scales.shape[1] != n or not zeros_ok:
        shown = None if qzeros is None else tuple(qzeros.shape)
        raise ValueError(f"scales {tuple(scales.shape)} / qzeros {shown} do not match N={n}")
    if g_idx is None and scales.shape[0] * group < k:
        raise ValueError(f"{scales.shape[0]} groups of {group} rows do not cover K={k}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx must be [{k}] int32, got {tuple(g_idx.shape)} {g_idx.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return n, k


def int4_gemm(x: torch.Tensor,  # [M, K]
              qweight: torch.Tensor,  # AWQ [K, N/8] | GPTQ [K/8, N] int32
              qzeros: torch.Tensor | None,  # [groups, N/8] int32; GPTQ None: no zeros (zero_offset only)
              scales: torch.Tensor,  # [groups, N]
              *, awq: bool, group: int,  # group: input rows per scale row (K for one group)
              g_idx: torch.Tensor | None = None,  # GPTQ [K] int32: each input row's group (desc_act)
              zero_offset: int = 0,  # GPTQ's "gptq" checkpoint format stores zero - 1: 1; no qzeros: the zero
              bias: torch.Tensor | None = None,  # [N]
              config: Config | None = None,
              ) -> torch.Tensor:  # [M, N] x.dtype
    n, k = _check(x, qweight, qzeros, scales, g_idx, bias, awq, group)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    c = config or choose_config(m, n, k, group, x.device)
    groups = "index" if g_idx is not None else ("tile" if group % c.block_k == 0 else "row")
    k_per_split = triton.cdiv(triton.cdiv(k, c.split), c.block_k) * c.block_k
    split = triton.cdiv(k, k_per_split)
    target = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split)
    zeros = qzeros if qzeros is not None else qweight  # not read without zeros
    _int4_gemm_kernel[grid](
        x, qweight, zeros, scales, g_idx if g_idx is not None else zeros, bias if bias is not None else scales,
        target, m, n, k, k_per_split, zero_offset,
        x.stride(0), qweight.stride(0), zeros.stride(0), scales.stride(0), target.stride(-2),
        target.stride(0) if split > 1 else 0, qweight.stride(1), zeros.stride(1), scales.stride(1),
        AWQ=awq, K_MAJOR=not awq and qweight.stride(0) == 1 and qweight.stride(1) >= qweight.shape[0], GROUP=group,
        GROUPS=_GROUPS[groups], HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None and split == 1,
        SPLIT=split > 1,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    if split > 1:
        y = target.sum(0)  # [M, N] float32
        if bias is not None:
            y += bias.float()
        out.copy_(y)
    return out


def int4_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, *,
                  awq: bool, group: int, g_idx: torch.Tensor | None = None, zero_offset: int = 0,
                  bias: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:  # [M, N]
    """Torch reference: the whole weight dequantized (kernels/dequant_torch.py) and rounded to x's dtype,
    then F.linear (what the CPU path of the quantized layers runs)."""
    n, k = _check(x, qweight, qzeros, scales, g_idx, bias, awq, group)
    if awq:
        w = dequantize_awq(qweight, qzeros, scales)
    else:
        rows = torch.arange(k, device=x.device) // group if g_idx is None else g_idx
        if qzeros is None:  # no zero points: every zero 0, then zero_offset
            qzeros = torch.zeros(scales.shape[0], n // 8, dtype=torch.int32, device=x.device)
        w = dequantize_gptq(qweight, qzeros, scales, rows, zero_offset)
    return F.linear(x, w.to(x.dtype), bias)
