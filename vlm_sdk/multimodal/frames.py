"""Video frames to the size a model takes them at, as qwen-vl-utils resizes them: torchvision's tensor
`resize` (bicubic, antialias) on uint8 frames, which is torch's `interpolate` in float32, clamped to
[0, 255], rounded and cast back (torchvision/transforms/_functional_tensor.py `resize`, with
`_cast_squeeze_in` / `_cast_squeeze_out`); a frame already at that size is returned as it is.

Without a float32 copy of the whole frame (12 bytes a pixel: 770 MB for a 64-megapixel frame). torch's
CPU antialiased interpolation is separable (aten/src/ATen/native/cpu/UpSampleKernel.cpp,
`separable_upsample_generic_Nd_kernel_impl`): it resamples along the width into a float32 buffer
[1, 3, H, width], then along the height from that buffer. Each row of the first pass depends on that
row alone, so it runs here on bands of source rows of at most BAND_BYTES as float32, into the same
buffer; the second pass then runs on the buffer as torch runs it. The result is the whole-frame call's,
bit for bit (tests/multimodal/test_frames.py), and the most float32 held is the buffer (the frame's
height x the target width) plus one band.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from vlm_sdk.multimodal.image_io import DecodeCancelled

BAND_BYTES = 4 << 20  # float32 bytes of source rows converted at a time: ~10 ms of work a band


def resize_frame(frame: np.ndarray,  # [H, W, 3] uint8 RGB
                 height: int, width: int, cancelled: threading.Event | None = None,
                 band_bytes: int = BAND_BYTES) -> np.ndarray:  # [height, width, 3] uint8
    """`frame` resized as qwen-vl-utils resizes it. Raises `DecodeCancelled` between bands once
    `cancelled` is set."""
    if frame.shape[:2] == (height, width):
        return frame
    src = torch.from_numpy(np.require(frame, requirements=("C", "W"))).permute(2, 0, 1)[None]  # [1, 3, H, W] uint8
    rows, cols = frame.shape[:2]
    if cols != width:  # the width pass, a band of rows at a time
        band = max(1, band_bytes // (cols * 3 * 4))
        mid = torch.empty((1, 3, rows, width), dtype=torch.float32)  # [1, 3, H, width]
        for r in range(0, rows, band):
            _check(cancelled)
            x = src[:, :, r:r + band].to(torch.float32)  # [1, 3, band, W]
            mid[:, :, r:r + band] = _bicubic(x, x.shape[2], width)
    else:
        mid = src.to(torch.float32)  # [1, 3, H, width]: the width is already the target's
    _check(cancelled)
    y = _bicubic(mid, height, width) if rows != height else mid  # the height pass, as torch runs it
    y = y.clamp_(0, 255).round_().to(torch.uint8)  # [1, 3, height, width]
    return y[0].permute(1, 2, 0).contiguous().numpy()


def _bicubic(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)


def _check(cancelled: threading.Event | None) -> None:
    if cancelled is not None and cancelled.is_set():
        raise DecodeCancelled("a video frame's resize")
