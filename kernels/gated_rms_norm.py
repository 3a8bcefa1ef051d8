"""Gated DeltaNet's output norm (transformers' `Qwen3_5RMSNormGated`: norm before gate), as a Triton op.

    x, gate: [N, D]   rows may be strided, last dim contiguous (N = tokens x value heads, D = head_v_dim)
    weight:  [D]
    out = ((weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)).float() * silu(gate.float()))
          .to(x.dtype)

with transformers' roundings: the normalised row to x's dtype, its product with the weight in their
promoted dtype, then the gate in float32, rounded once more. Reference: kernels/rms_norm_torch.py
`gated_rms_norm` (the torch set's op).

Grid: BLOCK_R rows per program, each row whole in registers (D is a head dim, 128 in the published
models), so a step of T tokens and Hv heads is T * Hv / BLOCK_R programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.rms_norm_torch import gated_rms_norm as gated_rms_norm_ref

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_DIM = 1024  # a head dim: one row per register tile

__all__ = ["gated_rms_norm", "gated_rms_norm_ref"]


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, stride_x, stride_z, stride_out, num_rows, dim, eps,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BLOCK_R]
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0)
    scaled = (normed.to(tl.float32) * w.to(tl.float32)).to((normed * w).dtype).to(tl.float32)  # promoted, as torch
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = scaled * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor,  # [N, D]
                   gate: torch.Tensor,  # [N, D]
                   weight: torch.Tensor,  # [D]
                   eps: float) -> torch.Tensor:  # [N, D] x.dtype
    if x.dim() != 2 or gate.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"gated rms norm needs x, gate [N, D] and weight [D], got {list(x.shape)}, "
                         f"{list(gate.shape)}, {list(weight.shape)}")
    if x.dtype not in _DTYPES or x.shape[1] > MAX_DIM or (x.shape[1] > 1 and (
            x.stride(1) != 1 or gate.stride(1) != 1 or weight.stride(0) != 1)):
        raise ValueError(f"gated rms norm needs {_DTYPES} rows of at most {MAX_DIM} with a contiguous last dim, "
                         f"got {x.dtype} {list(x.shape)}")
    n, d = x.shape
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d = triton.next_power_of_2(d)
        block_r = max(1, 2048 // block_d)
        _gated_rms_norm_kernel[(triton.cdiv(n, block_r),)](x, gate, weight, out, x.stride(0), gate.stride(0),
                                                           out.stride(0), n, d, eps, BLOCK_R=block_r,
                                                           BLOCK_D=block_d, num_warps=4)
    return out
