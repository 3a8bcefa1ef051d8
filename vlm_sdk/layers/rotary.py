"""Rotary angle state: `MRotaryEmbedding` (RoPE, or M-RoPE over three position axes, contiguous as
Qwen2-VL's or interleaved as Qwen3-VL's) and the per-forward `RotaryInputs` every decoder layer shares.
The rotation itself is the kernel set's (`layers.ops.KernelOps.rotary`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_sdk.kernels.rotary_torch import mrope_axes


@dataclass(frozen=True)
class RotaryInputs:
    """One forward's rotary angles, shared by every layer. Kernel sets read what they need: the torch
    one precomputed `cos`/`sin` `[N, 1, D/2]`, the Triton one recomputes them per layer in-kernel
    from `positions` (cheaper than reading them)."""
    positions: torch.Tensor  # [N] or [3, N] int64
    inv_freq: torch.Tensor  # [D/2] float32
    mrope_section: tuple[int, ...] | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    mrope_interleaved: bool = False  # the section's layout (kernels/rotary_torch.py)


class MRotaryEmbedding(nn.Module):
    """cos/sin `[num_tokens, 1, head_dim // 2]` for 1-axis or 3-axis positions (HF
    `Qwen2_5_VLRotaryEmbedding`, or `Qwen3VLTextRotaryEmbedding` when `interleaved`; plain RoPE when
    `mrope_section` is None).

    Frequency i of the half head dim takes its position from axis `axis_of_freq[i]`
    (`kernels.rotary_torch.mrope_axes`): contiguous, the first mrope_section[0] frequencies from t, the
    next mrope_section[1] from h, the rest from w; interleaved, t h w t h w ...
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] | None,
                 device: torch.device | str, interleaved: bool = False):
        super().__init__()
        # computed on the CPU whatever the device context: on the meta device these ops would run torch's
        # reference kernels, which import torch._dynamo and triton (seconds at start-up)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))  # [D/2]
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        if mrope_section is not None and sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {tuple(mrope_section)} must sum to head_dim // 2 = {head_dim // 2}")
        axes = [0] * (head_dim // 2) if mrope_section is None else mrope_axes(tuple(mrope_section), interleaved)
        self.register_buffer("axis_of_freq", torch.tensor(axes, dtype=torch.long, device=device), persistent=False)
        self.mrope = mrope_section is not None
        self.mrope_section = mrope_section
        self.interleaved = interleaved and self.mrope

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:  # [N] plain positions
            freqs = positions[:, None].float() * self.inv_freq  # [N, D/2]
        elif self.mrope:  # [3, N]
            pos = positions.gather(0, self.axis_of_freq[:, None].expand(-1, positions.shape[1]))  # [D/2, N]
            freqs = pos.t().float() * self.inv_freq  # [N, D/2]
        else:
            freqs = positions[0][:, None].float() * self.inv_freq
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]  # [N, 1, D/2]


class VisionRotaryEmbedding(MRotaryEmbedding):
    """The vision towers' 2-D RoPE (transformers' `Qwen2_5_VLVisionRotaryEmbedding`, also Qwen3-VL's) as
    M-RoPE with two contiguous sections: positions `[2, N]` = (patch row, patch column); frequency
    i < D/4 turns with the row and the rest with the column, both over the tower's own
    f = 1 / theta^(arange(0, D/2, 2) / (D/2)) `[D/4]`, so `inv_freq` is cat(f, f) `[D/2]`. Either kernel
    set rotates with it (`KernelOps.rotary`); angles in float32 (`rotary_inputs(..., torch.float32)`)
    give HF's float32 rotation."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str):
        if head_dim % 4:
            raise ValueError(f"vision head_dim {head_dim} must be divisible by 4 (row and column halves)")
        super().__init__(head_dim, theta, (head_dim // 4, head_dim // 4), device)
        spatial = head_dim // 2
        f = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device="cpu") / spatial))  # [D/4]
        self.inv_freq.copy_(torch.cat((f, f)).to(self.inv_freq.device))  # [D/2]
