"""qwen-vl-utils' `fetch_video` as the oracle for which frames a video gives and their size.

qwen_vl_utils/vision_process.py imports torchvision at its top, for `transforms.functional.resize` and
`io.read_video` (one of its three readers). torchvision's PyPI wheel is built against CUDA torch and
does not load beside the CPU-only torch the test environment pins, so where `import torchvision` fails
the module is imported with a stand-in `torchvision` holding only those names: `resize` is torchvision's
tensor resize as written in torchvision/transforms/_functional_tensor.py (float32 `interpolate`, clamp,
round, cast back; a frame already at the size returned as it is), `read_video` refuses. Frames are read
by decord (a test dependency: its own FFmpeg build, so frame counts and rates do not come from PyAV).
Everything that decides the indices and the size (smart_nframes, the linspace, the pixel budget,
smart_resize) is qwen-vl-utils' own code, run as published.
"""
from __future__ import annotations

import enum
import importlib
import sys
import types

import torch
import torch.nn.functional as F


def _resize(img: torch.Tensor, size, interpolation=None, antialias=True, **_) -> torch.Tensor:
    if list(img.shape[-2:]) == list(size):
        return img
    dtype = img.dtype
    out = F.interpolate(img.to(torch.float32), size=list(size), mode="bicubic", align_corners=False,
                        antialias=antialias)
    if dtype == torch.uint8:
        out = out.clamp(0, 255).round()
    return out.to(dtype)


def _stand_in() -> types.ModuleType:
    tv = types.ModuleType("torchvision")
    tv.__version__ = "0.28.0"
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.resize = _resize
    transforms.functional = functional
    transforms.InterpolationMode = enum.Enum("InterpolationMode", {"BICUBIC": "bicubic", "BILINEAR": "bilinear"})
    io = types.ModuleType("torchvision.io")

    def read_video(*a, **k):
        raise RuntimeError("the torchvision stand-in reads no video; qwen-vl-utils is set to decord")
    io.read_video = read_video
    tv.transforms, tv.io = transforms, io
    return tv


def vision_process():
    """qwen_vl_utils.vision_process, reading videos with decord."""
    if "qwen_vl_utils.vision_process" in sys.modules:
        vp = sys.modules["qwen_vl_utils.vision_process"]
    else:
        try:
            importlib.import_module("torchvision")  # absent from the test deps: the stand-in below
            vp = importlib.import_module("qwen_vl_utils.vision_process")
        except Exception:  # the CUDA wheel beside CPU torch: ImportError or a RuntimeError from its ops
            vp = _import_with_stand_in()
    vp.FORCE_QWENVL_VIDEO_READER = "decord"
    vp.get_video_reader_backend.cache_clear()
    return vp


def _import_with_stand_in():
    """qwen_vl_utils.vision_process imported while `torchvision` names the stand-in, which then leaves
    sys.modules again (the module keeps what it bound), so that nothing else sees it."""
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io")
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    tv = _stand_in()
    sys.modules.update(zip(names, (tv, tv.transforms, tv.transforms.functional, tv.io)))
    try:
        return importlib.import_module("qwen_vl_utils.vision_process")
    finally:
        for name in names:
            sys.modules.pop(name, None)




def fetch(path: str, patch_size: int = 14, **options) -> dict:
    """What `fetch_video` makes of the video file at `path` under the part's `options`: frame indices,
    sample fps, the source fps, frames x height x width, the frames (float, as it returns them)."""
    vp = vision_process()
    (video, meta), sample_fps = vp.fetch_video({"type": "video", "video": path, **options}, image_patch_size=patch_size,
                                               return_video_sample_fps=True, return_video_metadata=True)
    return {"indices": [int(i) for i in meta["frames_indices"]], "sample_fps": sample_fps, "fps": meta["fps"],
            "total_frames": meta["total_num_frames"], "shape": tuple(video.shape), "video": video}
