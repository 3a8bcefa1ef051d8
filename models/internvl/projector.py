"""InternVL's vision-to-text bridge: pixel shuffle (space-to-depth) and the MLP projector.

Pixel shuffle folds each inv x inv block of ViT patch features (inv = 1 / downsample_ratio) into one
token with inv^2 times the channels. The order of the folded channels is fixed by the checkpoints
(transformers' `InternVLModel.pixel_shuffle`, InternVL's `ps_version="v2"`), so it is reproduced
with the same view/permute sequence rather than with `F.pixel_unshuffle`, whose channel order differs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.linear import ColumnParallelLinear, RowParallelLinear
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import ParamSlot

PROJECTOR_LN_EPS = 1e-5  # both layouts build the projector's LayerNorm with nn.LayerNorm's default eps


def pixel_shuffle(x: torch.Tensor, inv: int) -> torch.Tensor:
    """[B, W, H, C] -> [B, W / inv, H / inv, C * inv^2], as `InternVLModel.pixel_shuffle(x, 1 / inv)`."""
    b, w, h, c = x.shape
    x = x.reshape(b, w, h // inv, c * inv)  # [B, W, H/inv, C*inv]
    x = x.permute(0, 2, 1, 3).reshape(b, h // inv, w // inv, c * inv * inv)  # [B, H/inv, W/inv, C*inv^2]
    return x.permute(0, 2, 1, 3)  # [B, W/inv, H/inv, C*inv^2]


class InternVLProjector(nn.Module):
    """LayerNorm -> Linear -> act -> Linear (transformers' `multi_modal_projector`, InternVL's `mlp1`).
    With tensor parallelism linear_1 is column-parallel, linear_2 row-parallel (its output all-reduced)."""

    def __init__(self, in_dim: int, out_dim: int, act: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str, tp: TPGroup = TPGroup()):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(in_dim, dtype=dtype, device=device))
        self.norm_bias = nn.Parameter(torch.empty(in_dim, dtype=dtype, device=device))
        self.linear_1 = ColumnParallelLinear(in_dim, out_dim, True, dtype, device, tp)
        self.linear_2 = RowParallelLinear(out_dim, out_dim, True, dtype, device, tp)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in_dim] -> [N, out_dim]
        x = F.layer_norm(x, self.norm_weight.shape, self.norm_weight, self.norm_bias, PROJECTOR_LN_EPS)
        return self.linear_2(self.act(self.linear_1(x)))

    def slots(self, ln: str, fc1: str, fc2: str, dst: str = "projector.") -> dict[str, ParamSlot]:
        """Checkpoint prefixes of the LayerNorm and the two Linears -> this rank's slices, params under `dst`."""
        n = self.norm_weight.shape[0]
        return {
            f"{ln}.weight": ParamSlot(f"{dst}norm_weight", (n,)),
            f"{ln}.bias": ParamSlot(f"{dst}norm_bias", (n,)),
            **self.linear_1.slots(f"{dst}linear_1.", f"{fc1}.weight", f"{fc1}.bias"),
            **self.linear_2.slots(f"{dst}linear_2.", f"{fc2}.weight", f"{fc2}.bias"),
        }
