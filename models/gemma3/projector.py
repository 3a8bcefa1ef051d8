"""Gemma 3's multimodal projector (transformers' `Gemma3MultiModalProjector`): the tower's patch grid
average-pooled to `mm_tokens_per_image` tokens, a (1 + weight) RMSNorm, then one matrix to the decoder's
width (`mm_input_projection_weight` [vision hidden, text hidden], applied as x @ W, not transposed).

    [B, 64*64, 1152] -> grid [B, 1152, 64, 64] -> avg pool 4x4 -> [B, 256, 1152] -> norm -> [B, 256, text]

Whole on every tensor-parallel rank (1152 x 2560 in the 4B: small beside the tower).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.rms_norm_torch import rms_norm_zero_centered
from vlm_sdk.weight_loading import ParamSlot


class Gemma3Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, grid: int, tokens_per_image: int, eps: float,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        side = math.isqrt(tokens_per_image)
        if side * side != tokens_per_image or grid % side:
            raise CheckpointError(f"config.json mm_tokens_per_image {tokens_per_image} must be a square whose side "
                                  f"divides the vision grid of {grid}x{grid} patches (image_size / patch_size)")
        self.grid, self.side, self.kernel = grid, side, grid // side
        self.eps = eps
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden, dtype=dtype,
                                                                   device=device))
        self.norm_weight = nn.Parameter(torch.empty(vision_hidden, dtype=dtype, device=device))

    @property
    def tokens_per_image(self) -> int:
        return self.side * self.side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [B, grid^2, C] -> [B * tokens, text_hidden]
        b, n, c = patches.shape
        x = patches.transpose(1, 2).reshape(b, c, self.grid, self.grid)  # [B, C, g, g]: patches row by row
        x = F.avg_pool2d(x, kernel_size=self.kernel, stride=self.kernel)  # [B, C, side, side]
        x = x.flatten(2).transpose(1, 2)  # [B, tokens, C]
        x = rms_norm_zero_centered(x, self.norm_weight, self.eps)
        return torch.matmul(x, self.mm_input_projection_weight).reshape(b * self.tokens_per_image, -1)

    def slots(self, prefix: str) -> dict[str, ParamSlot]:
        """`{prefix}mm_input_projection_weight` and `{prefix}mm_soft_emb_norm.weight` -> this module."""
        w = self.mm_input_projection_weight
        return {f"{prefix}mm_input_projection_weight": ParamSlot("mm_input_projection_weight", tuple(w.shape)),
                f"{prefix}mm_soft_emb_norm.weight": ParamSlot("norm_weight", (w.shape[0],))}
