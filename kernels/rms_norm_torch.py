"""HF RMSNorm in pure torch: the torch backend's norms (the Triton ops are `rms_norm.py`, `gated_rms_norm.py`).

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


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's (and Gemma's) RMSNorm: the weight stored as an offset from 1, applied in float32 with
    one rounding, `(x.float() * rsqrt(mean(x.float()**2) + eps) * (1 + weight.float())).to(x.dtype)`."""
    return (F.rms_norm(x.float(), weight.shape, None, eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm (transformers' `Qwen3_5RMSNormGated`, norm before gate): HF RMSNorm of
    each row, rounded as it does (normalised row, then times the weight, each in x's dtype), then times
    silu(gate) in float32, rounded once. x, gate: [N, D]; weight: [D] (x's dtype, as the layer holds it)."""
    normed = F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return ((weight * normed).float() * F.silu(gate.float())).to(x.dtype)
