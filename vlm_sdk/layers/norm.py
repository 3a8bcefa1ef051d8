"""RMSNorm's weight and eps; the math is the kernel set's (`layers.ops.KernelOps.rms_norm` /
`add_rms_norm`), so that the torch and Triton paths differ only there. Replicated under tensor
parallelism (every rank holds the whole `[C]` weight)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))  # [C]
        self.eps = eps
