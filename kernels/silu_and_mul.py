"""SwiGLU activation of a fused gate/up projection: out = silu(gate) * up.

    x:   [num_rows, 2 * I]   gate = x[:, :I], up = x[:, I:]; rows may be strided, last dim contiguous
    out: [num_rows, I]       (silu(gate.float()) * up.float()).to(x.dtype)

Grid: 2-D, (rows, column blocks of BLOCK_I). The op is pure bandwidth and I is large (e.g. 18944 for a 7B
model), so splitting a row over column blocks keeps every program's tile small and gives decode steps with
few rows enough programs to fill the GPU; rows sit on the first axis, whose grid limit is the large one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_BLOCK_I = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter,
                         BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_rows, 2 * I], got {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {_DTYPES}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("x needs a contiguous last dim")
    shape = (x.shape[0], x.shape[1] // 2)
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != x.dtype:
            raise ValueError(f"out must be {list(shape)} {x.dtype}, got {list(out.shape)} {out.dtype}")
        if shape[1] > 1 and out.stride(1) != 1:
            raise ValueError("out needs a contiguous last dim")


def silu_and_mul(x: torch.Tensor,  # [num_rows, 2 * I]
                 out: torch.Tensor | None = None,  # [num_rows, I]
                 ) -> torch.Tensor:  # [num_rows, I]
    """silu(x[:, :I]) * x[:, I:], in float32, stored in x.dtype."""
    _check(x, out)
    n, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n > 0 and inter > 0:
        block_i = min(triton.next_power_of_2(inter), _MAX_BLOCK_I)
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block_i))](
            x, out, x.stride(0), out.stride(0), inter,
            BLOCK_I=block_i, num_warps=4,
        )
    return out


def silu_and_mul_ref(x: torch.Tensor,  # [num_rows, 2 * I]
                     out: torch.Tensor | None = None,  # [num_rows, I]
                     ) -> torch.Tensor:  # [num_rows, I]
    """Torch reference of `silu_and_mul`."""
    _check(x, out)
    gate, up = x.float().chunk(2, dim=-1)  # [num_rows, I] each
    y = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return y if out is None else out.copy_(y)
