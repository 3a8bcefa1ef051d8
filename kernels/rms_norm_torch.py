"""HF RMSNorm in pure torch: the torch backend's norm (the Triton op is `rms_norm.py`).

    x: [num_rows, C], weight: [C] -> [num_rows, C] x.dtype
    out = weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back, then scale by the weight (HF `Qwen2RMSNorm`)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op; identical maths in float32
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
