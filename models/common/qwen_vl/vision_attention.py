"""What the Qwen-VL vision towers share (Qwen2.5-VL's windowed tower, models/qwen2_5_vl/vision.py, and the
Qwen3-VL tower with learned positions, qwen3_vision.py): the patch-grid check and a block's attention
(fused qkv -> 2-D RoPE on q and k -> segment attention -> proj)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_sdk.layers.rotary import RotaryInputs


def check_patch_grids(pixel_values: torch.Tensor, grid_thw, patch_dim: int, merge: int) -> list[tuple[int, int, int]]:
    """The grids as int tuples; `ValueError` when the pixels are not `[sum of t*h*w, patch_dim]` or a grid's
    h or w is not a multiple of the merge size."""
    grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
    expected = sum(t * h * w for t, h, w in grid_thw)
    if pixel_values.shape != (expected, patch_dim):
        raise ValueError(f"pixel_values has shape {list(pixel_values.shape)} but grids {grid_thw} need "
                         f"[{expected}, {patch_dim}]")
    for t, h, w in grid_thw:
        if h % merge or w % merge:
            raise ValueError(f"image grid {(t, h, w)}: h and w must be multiples of {merge}")
    return grid_thw


def attend(block: nn.Module, h: torch.Tensor,  # [N, dim] norm1(x)
           rope: RotaryInputs, plan: Any) -> torch.Tensor:  # [N, dim], summed over ranks
    """qkv -> 2-D RoPE on q and k (the kernel set's, in place where it can) -> segment attention -> proj:
    the attention of a Qwen2.5-VL or Qwen3-VL vision block (`block`: heads, head_dim, qkv, ops, attn, proj)."""
    n, heads, d = h.shape[0], block.heads, block.head_dim
    qkv = block.qkv(h).view(n, 3 * heads, d)  # [N, 3H/tp, D]: q heads, k heads, v heads
    # float32 angles: the torch set rotates in float32 (HF's vision RoPE) and returns float32
    qk = block.ops.rotary(qkv[:, :2 * heads], heads, rope).to(h.dtype)  # [N, 2H/tp, D]
    attn = block.attn(qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads:], plan)  # [N, H/tp, D]
    return block.proj(attn.reshape(n, -1))
