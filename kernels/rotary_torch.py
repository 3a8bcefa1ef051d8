"""rotate_half RoPE in pure torch: the torch backend's rotation and the reference of `rotary.py`.

    x:        [..., D]
    cos, sin: broadcastable to [..., D // 2] (the angles of the first half; the second half repeats them)
    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)   with x1 = x[..., :D/2], x2 = x[..., D/2:]
"""
from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor,  # [..., D]
                 cos: torch.Tensor,  # broadcastable to [..., D // 2]
                 sin: torch.Tensor) -> torch.Tensor:  # [..., D]
    """x*cat(c,c) + rotate_half(x)*cat(s,s), with the cos/sin halves given once."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
