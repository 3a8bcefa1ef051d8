"""The video frame resize (multimodal/frames.py): bit for bit torch's whole-frame bicubic antialiased
`interpolate` in float32 (qwen-vl-utils' resize), done from the uint8 frame a band of rows at a time,
so a large frame never has a float32 copy; a cancelled request stops between bands."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlm_sdk.multimodal.frames import resize_frame
from vlm_sdk.multimodal.image_io import DecodeCancelled


def _whole(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """qwen-vl-utils' resize (its torchvision tensor resize) of one frame: [1, 3, H, W] float32 at once."""
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].contiguous().to(torch.float32)
    y = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return y.clamp(0, 255).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()


# (source H, W) -> (target h, w): down and up, width or height alone, odd sizes, tall and wide
SIZES = [((90, 160), (84, 140)), ((540, 960), (252, 448)), ((37, 1001), (28, 812)), ((500, 3), (280, 28)),
         ((48, 64), (112, 140)), ((777, 333), (392, 168)), ((64, 64), (64, 32)), ((64, 64), (32, 64))]


@pytest.mark.parametrize("threads", [1, 2])
def test_banded_resize_is_the_whole_frame_resize_bit_for_bit(threads):
    rng = np.random.default_rng(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for (H, W), (h, w) in SIZES:
            frame = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
            expected = _whole(frame, h, w)
            for band_bytes in (1 << 12, 1 << 30):  # a row or a few a band, the whole frame in one
                ours = resize_frame(frame, h, w, band_bytes=band_bytes)
                assert ours.shape == (h, w, 3) and ours.dtype == np.uint8
                assert np.array_equal(ours, expected), ((H, W), (h, w), band_bytes)
    finally:
        torch.set_num_threads(before)


def _peak_growth(fn) -> int:
    """Bytes the process's resident memory rose to above where it was, while `fn()` ran (Linux: the
    high-water mark reset through /proc/self/clear_refs)."""
    import re

    def status(field):
        return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


def test_a_large_frame_has_no_float32_copy():
    """A 2000x2000 frame to 224x224: converted whole (as before), the float32 copy alone is 48 MB;
    banded (1 MiB bands here), the peak is the 2000x224 float32 buffer between the passes (5.4 MB)
    and a band."""
    frame = np.full((2000, 2000, 3), 7, dtype=np.uint8)
    resize_frame(frame, 224, 224, band_bytes=1 << 20)  # torch's first-call allocations
    banded = _peak_growth(lambda: resize_frame(frame, 224, 224, band_bytes=1 << 20))
    whole = _peak_growth(lambda: _whole(frame, 224, 224))
    assert banded < 16 << 20 and whole > 40 << 20, (banded, whole)


def test_resize_stops_between_bands_once_cancelled():
    cancelled = threading.Event()
    frame = np.zeros((400, 400, 3), dtype=np.uint8)
    assert resize_frame(frame, 56, 56, cancelled).shape == (56, 56, 3)
    cancelled.set()
    with pytest.raises(DecodeCancelled):
        resize_frame(frame, 56, 56, cancelled)
    assert resize_frame(frame, 400, 400, cancelled) is frame  # nothing to do: nothing refused
