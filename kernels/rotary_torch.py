"""rotate_half RoPE in pure torch: the torch backend's rotation and the reference of `rotary.py`, plus
the M-RoPE frequency layouts both kernel sets share.

    x:        [..., D]
    cos, sin: broadcastable to [..., D // 2] (the angles of the first half; the second half repeats them)
    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)   with x1 = x[..., :D/2], x2 = x[..., D/2:]

M-RoPE gives each of the D/2 frequencies a position row (0 = t, 1 = h, 2 = w):
    contiguous (Qwen2-VL, Qwen2.5-VL): section s covers the next mrope_section[s] frequencies, row s % 3
        (16, 24, 24) -> t for [0, 16), h for [16, 40), w for [40, 64)
    interleaved (Qwen3-VL, `mrope_interleaved`): h takes frequencies 1, 4, 7, ... below 3 * section[1],
        w takes 2, 5, 8, ... below 3 * section[2], t the rest (transformers' Qwen3VLTextRotaryEmbedding)
        (24, 20, 20) -> t h w t h w ... t h w (20 times), then t t t t
so every axis sees low and high frequencies, rather than t only the highest ones.
"""
from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor,  # [..., D]
                 cos: torch.Tensor,  # broadcastable to [..., D // 2]
                 sin: torch.Tensor) -> torch.Tensor:  # [..., D]
    """x*cat(c,c) + rotate_half(x)*cat(s,s), with the cos/sin halves given once."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def check_mrope_section(section: tuple[int, ...], interleaved: bool, half_dim: int) -> None:
    """Raise ValueError unless `section` is a valid M-RoPE split of `half_dim` frequencies (O(1): the
    Triton launcher calls it every layer)."""
    if sum(section) != half_dim or any(s < 0 for s in section):
        raise ValueError(f"mrope_section {tuple(section)} must be non-negative and sum to "
                         f"head_dim // 2 = {half_dim}")
    # interleaved: h's last frequency 3*s1 - 2 and w's 3*s2 - 1 must exist, else an axis gets fewer
    # frequencies than its section says (transformers' slices would silently come up short)
    if interleaved and (len(section) != 3 or 3 * section[1] > half_dim + 1 or 3 * section[2] > half_dim):
        raise ValueError(f"interleaved mrope_section {tuple(section)} must have 3 parts with 3 * section[1] <= "
                         f"{half_dim + 1} and 3 * section[2] <= {half_dim} (head_dim // 2 = {half_dim})")


def mrope_axes(section: tuple[int, ...], interleaved: bool) -> list[int]:
    """The position row (0 t, 1 h, 2 w) of each of the `sum(section)` frequencies."""
    half = sum(section)
    check_mrope_section(section, interleaved, half)
    if not interleaved:
        return [s % 3 for s, size in enumerate(section) for _ in range(size)]
    axes = [0] * half
    for row in (1, 2):
        for i in range(row, 3 * section[row], 3):
            axes[i] = row
    return axes
