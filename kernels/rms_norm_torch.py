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


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight) (Gemma's norms, whose checkpoints store the weight less one): the
    normalised row and the scale multiplied in float32 and rounded once to x's dtype, as transformers'
    `Gemma3RMSNorm` does (a Llama-style norm rounds the normalised row first).

        out = (x.float() * rsqrt(mean(x.float()**2) + eps) * (1 + weight.float())).to(x.dtype)
    """
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
