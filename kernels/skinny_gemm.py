"""y = x W^T + b for a few rows of x (decode at batch 1-8): a GEMV-shaped product read at the weight's
bandwidth.

    x:   [M, K]   M <= MAX_M, last dim contiguous
    w:   [N, K]   nn.Linear's weight, any strides (the CPU layout stores it [K, N])
    b:   [N]      optional
    out: [M, N]   x.dtype

Why a kernel of its own: at M = 1..8 the product is pure weight traffic (2M FLOPs per 2-byte weight
element, far from compute-bound), and cuBLAS picks tiles made for large M: on
the first H100 run the 3B model's qkv (N 2560, K 2048) and o_proj (2048 x 2048) at batch 1 ran at 1.4-1.6
TB/s, where gate_up and down reached ~2.5. Here every program owns BLOCK_N whole output columns
(weight rows), so the grid is N / BLOCK_N programs with no split-K reduction to launch, and BLOCK_N is
chosen from the SM count so that there are about PROGRAMS_PER_SM programs per SM to keep loads in
flight. Each program streams its rows in [BLOCK_N, BLOCK_K] tiles (coalesced along K) and, for each of
the M rows of x (unrolled), multiplies and reduces along K in float32: the FLOPs are negligible, the
tensor cores are not needed.

Whether it beats cuBLAS is measured, not assumed: `vlm-sdk bench --gpu` times both at the model's
projection shapes and records the faster; the engine uses it only with `small_m_gemm="triton"`
(default "cublas").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_M = 8  # rows this path takes; more go to cuBLAS
PROGRAMS_PER_SM = 4
TILE_ELEMS = 4096  # weight elements per [BLOCK_N, BLOCK_K] tile: 32 float32 registers a thread at 4 warps


def block_k(bn: int) -> int:
    """Keys per tile: 512 for the narrow tiles of small N, fewer as BLOCK_N grows (registers bound)."""
    return max(64, min(512, TILE_ELEMS // bn))


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_wk, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        w = tl.load(w_rows + k[None, :] * stride_wk, mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        for m in tl.static_range(BLOCK_M):
            # rows past M read nothing (a bound of 0 keys; the interpreter cannot AND a scalar into a mask)
            x = tl.load(x_ptr + m * stride_xm + k, mask=k < tl.where(m < M, K, 0), other=0.0).to(tl.float32)  # [BLOCK_K]
            part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & mask_n[None, :])


def block_n(n: int, device: torch.device) -> int:
    """Weight rows per program: about PROGRAMS_PER_SM programs per SM (a power of two in 2..64); a
    small fixed tile on the CPU (the interpreter pays per program)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 16
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, n // (PROGRAMS_PER_SM * sms))
    return max(2, min(64, 1 << (want.bit_length() - 1)))  # the power of two at or below `want`


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, n = x.shape[0], w.shape[0]
    if m > MAX_M:
        raise ValueError(f"skinny_gemm takes at most {MAX_M} rows, got {m}: use F.linear")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share a dtype in {_DTYPES}, got {x.dtype} and {w.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("x needs a contiguous last dim")
    if b is not None and (b.shape != (n,) or b.dtype != x.dtype):
        raise ValueError(f"b must be [{n}] {x.dtype}, got {tuple(b.shape)} {b.dtype}")
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or (n > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with a contiguous last dim, got {tuple(out.shape)}")
    for name, t in (("w", w), ("b", b), ("out", out)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def skinny_gemm(x: torch.Tensor,  # [M, K], M <= MAX_M
                w: torch.Tensor,  # [N, K]
                b: torch.Tensor | None = None,  # [N]
                out: torch.Tensor | None = None,  # [M, N]
                ) -> torch.Tensor:  # [M, N]
    _check(x, w, b, out)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    launch(x, w, b, out, block_n(n, x.device))
    return out


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor, bn: int) -> None:
    """The kernel on checked inputs with `bn` weight rows per program (the ahead-of-time test compiles
    the values `block_n` gives on a GPU)."""
    m, k = x.shape
    n = w.shape[0]
    _skinny_gemm_kernel[(triton.cdiv(n, bn),)](
        x, w, b if b is not None else w, out, m, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        HAS_BIAS=b is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=block_k(bn),
        num_warps=4, num_stages=3)


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:  # [M, N]
    """Torch reference of `skinny_gemm`: float32 product and bias, rounded once to x.dtype."""
    _check(x, w, b, out)
    y = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return y if out is None else out.copy_(y)
