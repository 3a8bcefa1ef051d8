"""Video frames to the size a model takes them at, as qwen-vl-utils resizes them: torchvision's tensor
`resize` (bicubic, antialias) on uint8 frames, which is torch's `interpolate` in float32, clamped to
[0, 255], rounded and cast back (torchvision/transforms/_functional_tensor.py `resize`, with
`_cast_squeeze_in` / `_cast_squeeze_out`); a frame already at that size is returned as it is."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def resize_frame(frame: np.ndarray,  # [H, W, 3] uint8 RGB
                 height: int, width: int) -> np.ndarray:  # [height, width, 3] uint8
    if frame.shape[:2] == (height, width):
        return frame
    x = torch.from_numpy(np.require(frame, requirements=("C", "W"))).permute(2, 0, 1)[None].to(torch.float32)  # [1, 3, H, W]
    y = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    y = y.clamp_(0, 255).round_().to(torch.uint8)  # [1, 3, height, width]
    return y[0].permute(1, 2, 0).contiguous().numpy()
