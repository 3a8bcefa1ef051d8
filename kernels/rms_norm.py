"""RMSNorm (HF Qwen2RMSNorm semantics), optionally fused with the residual add of a pre-norm decoder.

    x:        [num_rows, C]   rows may be strided, last dim contiguous
    weight:   [C]
    residual: [num_rows, C]   optional

Without residual:  out = weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)
With residual:     s = (x.float() + residual.float()).to(x.dtype);  returns (rms_norm(s), s)
The normalised row is rounded to x.dtype before the weight multiply, as HF does; that product is taken in
float32 and rounded once to the output dtype (x.dtype), which is what torch's low-precision `*` does too.
`zero_centered` (Qwen3.5's and Gemma's RMSNorm, the weight an offset from 1): out = (x.float() * rstd *
(1 + weight.float())).to(x.dtype), one rounding (kernels/rms_norm_torch.py `rms_norm_zero_centered`).

Grid: one program per row with BLOCK_C = next_power_of_2(C) (hidden sizes up to 8192): the whole row sits in
registers, so the sum of squares and the scaling are one pass over memory, and the fused residual sum is
written out and normalised without reading it back. Rows are independent and a decoder step has at least
as many rows as tokens, so there is no need to split a row across programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One row per program in registers: fine to 8192 (the largest hidden size served) with headroom; wider rows
# would want a split-row kernel.
MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_res, stride_out, stride_res_out,
                     num_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_C: tl.constexpr, ZERO_CENTERED: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK_C] x.dtype
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the new residual stream
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = xf * rstd * (1.0 + w)
    else:
        y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w  # HF rounds to x.dtype before the weight
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
    if shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim")


def _check(x, weight, residual, out, residual_out) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [num_rows, C], got {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {_DTYPES}")
    shape = tuple(x.shape)
    _check_rows("x", x, shape, x.dtype)
    if weight.shape != (shape[1],) or weight.dtype not in _DTYPES:
        raise ValueError(f"weight must be [{shape[1]}] in {_DTYPES}, got {list(weight.shape)} {weight.dtype}")
    if shape[1] > 1 and weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if shape[1] > MAX_HIDDEN:
        raise ValueError(f"C = {shape[1]} exceeds the one-row-per-program limit {MAX_HIDDEN}")
    if out is not None:
        _check_rows("out", out, shape, x.dtype)
    if residual is not None:
        _check_rows("residual", residual, shape, residual.dtype)
        if residual.dtype not in _DTYPES:
            raise ValueError(f"residual dtype {residual.dtype} is not one of {_DTYPES}")
        if residual_out is not None:
            _check_rows("residual_out", residual_out, shape, x.dtype)
    elif residual_out is not None:
        raise ValueError("residual_out given without residual")


def rms_norm(x: torch.Tensor,  # [num_rows, C]
             weight: torch.Tensor,  # [C]
             eps: float,
             residual: torch.Tensor | None = None,  # [num_rows, C]
             out: torch.Tensor | None = None,  # [num_rows, C] x.dtype
             residual_out: torch.Tensor | None = None,  # [num_rows, C] x.dtype; may alias residual
             zero_centered: bool = False,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or of x + residual (then returns (normed, x + residual))."""
    _check(x, weight, residual, out, residual_out)
    n, c = x.shape
    if out is None:
        out = torch.empty((n, c), dtype=x.dtype, device=x.device)
    has_res = residual is not None
    if has_res and residual_out is None:
        residual_out = torch.empty((n, c), dtype=x.dtype, device=x.device)
    if n > 0:
        block_c = triton.next_power_of_2(c)
        _rms_norm_kernel[(n,)](
            x, residual if has_res else x, weight, out, residual_out if has_res else out,
            x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
            residual_out.stride(0) if has_res else 0,
            c, eps,
            HAS_RESIDUAL=has_res, BLOCK_C=block_c, ZERO_CENTERED=zero_centered,
            num_warps=min(max(block_c // 512, 1), 16),
        )
    return (out, residual_out) if has_res else out


def rms_norm_ref(x: torch.Tensor,  # [num_rows, C]
                 weight: torch.Tensor,  # [C]
                 eps: float,
                 residual: torch.Tensor | None = None,  # [num_rows, C]
                 out: torch.Tensor | None = None,  # [num_rows, C] x.dtype
                 residual_out: torch.Tensor | None = None,  # [num_rows, C] x.dtype
                 zero_centered: bool = False,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rms_norm` (same semantics and return values)."""
    _check(x, weight, residual, out, residual_out)
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        if residual_out is not None:
            x = residual_out.copy_(x)
    xf = x.float()
    if zero_centered:
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    else:
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        y = (normed.float() * weight.float()).to(x.dtype)
    if out is not None:
        y = out.copy_(y)
    return (y, x) if residual is not None else y
