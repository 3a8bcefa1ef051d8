"""The CPU's float32 dense product through oneDNN rather than MKL's sgemm.

On the CPU, `F.linear` in float32 runs MKL's sgemm. On this project's AMD EPYC (Zen 4) VM, oneDNN's
matmul (`torch.ops.mkldnn._linear_pointwise`, the op torch's inductor emits for a CPU linear) is
1.5-3x faster at the row counts of decode and chunked prefill. Measured 2026-12-02 on 2 threads,
interleaved runs, one weight per shape:

    Gemma 3 bench head 262,208 x 640:  16 rows  126 ms (F.linear)  53 ms (oneDNN); 1 row 65 / 48 ms

`vlm-sdk bench --cpu-gemm` times every path at a checkpoint's shapes. The engine routes the LM head
here (models/cpu_layout.py `OneDnnLMHead`); the decoder's smaller products keep `F.linear` on their
column-major layout, where the two measured within the noise of a loaded VM. bfloat16 and float16
`F.linear` already reach oneDNN on the CPU, so only float32 is routed here.

The result is the same product in another summation order: within float32's reduction bound of
`F.linear`'s (tests/models/test_cpu_layout.py), not bit-equal to it. Where the op is missing (a torch
build without oneDNN), or where autograd needs a graph (the op has no backward), `F.linear` runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor,  # [..., in]
                  weight: torch.Tensor,  # [out, in], any strides
                  bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., out]
    """x W^T + b through oneDNN on the CPU in float32; `F.linear` for anything else."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
