"""y = x W^T (+ b) with W in the model makers' block-wise FP8 (Qwen3-VL-*-FP8, DeepSeek-V3; `quant_method:
fp8`, `weight_block_size: [B0, B1]`), dequantized in registers: the GPU product of its quantized linear
layers (the CPU dequantizes the whole weight: kernels/dequant_torch.py, this op's reference).

    x:                [M, K]  float16 / bfloat16 / float32, last dim contiguous
    weight:           [N, K]  float8 e4m3 (row-major, as published)
    weight_scale_inv: [ceil(N / B0), ceil(K / B1)] float32       W[n, k] = weight[n, k] * s[n // B0, k // B1]
    out:              [M, N]  x.dtype

Activations stay in x's dtype (W8A16): each [BLOCK_K, BLOCK_N] tile of the weight is converted (e4m3 in
hardware on sm_89+, from its bits elsewhere: kernels/fp8_bits.py), multiplied by its blocks' scales in
float32, rounded to x's dtype (what the reference's F.linear multiplies) and fed to a tensor-core dot with
float32 accumulation. Decode reads half of bf16's weight bytes; prefill runs at bf16's tensor-core rate
(the W8A8 alternative, activations quantized per token group and an FP8 dot, would double it on sm_89+:
not built). BLOCK_K divides B1, so a tile's rows share one column of scales; its columns read theirs.
Paths and the split of K for decode-sized M as kernels/int4_gemm.py (`gpu_config`, `Config`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vlm_sdk.kernels import fp8_bits
from vlm_sdk.kernels.dequant_torch import dequantize_fp8_block
from vlm_sdk.kernels.int4_gemm import SMALL_M, Config, _split

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _fp8_block_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, k_per_split,
                           stride_xm, stride_wn, stride_s, stride_om, stride_os,
                           B0: tl.constexpr, B1: tl.constexpr, SOFTWARE: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]: weight rows are output columns
    s_cols = s_ptr + (offs_n // B0)[None, :] * stride_s  # [1, BLOCK_N]
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        mask_k = k < k_end
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        mask_w = mask_k[:, None] & mask_n[None, :]
        w = fp8_bits.load_kv(w_cols + k[:, None], mask_w, tl.float32, SOFTWARE)  # [BLOCK_K, BLOCK_N]
        s = tl.load(s_cols + k0 // B1, mask=mask_n[None, :], other=0.0)  # [1, BLOCK_N]: BLOCK_K divides B1
        if SOFTWARE:  # bits read as float16 hold the value / 256
            s = s * 256.0
        acc = tl.dot(x, (w * s).to(x.dtype), acc, input_precision=INPUT_PRECISION)
    mask_o = mask_m[:, None] & mask_n[None, :]
    if SPLIT:  # float32 partials [split, M, N]
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask_o)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_o)


def choose_config(m: int, n: int, k: int, block: tuple[int, int], device: torch.device) -> Config:
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_config(m, n, k, block, torch.cuda.get_device_properties(device).multi_processor_count)
    block_k = _block_k(32, block[1])
    if m <= SMALL_M:
        return Config(16, 32, block_k, _split(2, k, block_k), 4, 1)
    return Config(32, 32, block_k, 1, 4, 1)


def gpu_config(m: int, n: int, k: int, block: tuple[int, int], sms: int) -> Config:
    """As int4_gemm's: split-K 16 x 64 tiles for m <= SMALL_M, 64 x 128 tiles above; BLOCK_K divides B1."""
    if m <= SMALL_M:
        block_k = _block_k(64, block[1])
        want = triton.cdiv(4 * sms, triton.cdiv(n, 64))
        return Config(16, 64, block_k, _split(want, k, block_k), 4, 3)
    return Config(64, 128, _block_k(32, block[1]), 1, 8, 3)


def _block_k(largest: int, b1: int) -> int:
    block_k = largest
    while block_k > 16 and b1 % block_k:
        block_k //= 2
    if b1 % block_k:
        raise ValueError(f"the block-wise FP8 kernel needs weight_block_size[1] to be a multiple of 16, got {b1}")
    return block_k


def _check(x, weight, scale_inv, block, bias) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [M, K] of {_DTYPES} with a contiguous last dim, got {tuple(x.shape)} {x.dtype}")
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1 or k != x.shape[1]:
        raise ValueError(f"weight must be float8_e4m3fn [N, K={x.shape[1]}] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    want = (-(-n // block[0]), -(-k // block[1]))
    if scale_inv.shape != want or scale_inv.dtype != torch.float32 or scale_inv.stride(1) != 1:
        raise ValueError(f"weight_scale_inv must be float32 {list(want)} for blocks {list(block)}, got "
                         f"{scale_inv.dtype} {tuple(scale_inv.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("weight_scale_inv", scale_inv), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return n, k


def fp8_block_gemm(x: torch.Tensor,  # [M, K]
                   weight: torch.Tensor,  # [N, K] float8_e4m3fn
                   scale_inv: torch.Tensor,  # [ceil(N / B0), ceil(K / B1)] float32
                   block: tuple[int, int],  # (B0, B1)
                   bias: torch.Tensor | None = None,  # [N]
                   config: Config | None = None,
                   fp8_hardware: bool | None = None,  # e4m3 converted in hardware; None: by device
                   ) -> torch.Tensor:  # [M, N] x.dtype
    n, k = _check(x, weight, scale_inv, block, bias)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    c = config or choose_config(m, n, k, block, x.device)
    if block[1] % c.block_k:
        raise ValueError(f"BLOCK_K {c.block_k} must divide the scale block's {block[1]} inputs")
    w, software = fp8_bits.kernel_cache(weight, fp8_hardware)
    k_per_split = triton.cdiv(triton.cdiv(k, c.split), c.block_k) * c.block_k
    split = triton.cdiv(k, k_per_split)
    target = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _fp8_block_gemm_kernel[(triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split)](
        x, w, scale_inv, bias if bias is not None else scale_inv, target, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), scale_inv.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0,
        B0=block[0], B1=block[1], SOFTWARE=software, HAS_BIAS=bias is not None and split == 1, SPLIT=split > 1,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    if split > 1:
        y = target.sum(0)  # [M, N] float32
        if bias is not None:
            y += bias.float()
        out.copy_(y)
    return out


def fp8_block_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                       bias: torch.Tensor | None = None, config: Config | None = None,
                       fp8_hardware: bool | None = None) -> torch.Tensor:  # [M, N]
    """Torch reference: the whole weight dequantized and rounded to x's dtype, then F.linear."""
    _check(x, weight, scale_inv, block, bias)
    return F.linear(x, dequantize_fp8_block(weight, scale_inv, block).to(x.dtype), bias)
