"""Gemma 3 image preprocessing: every image resized to the SigLIP tower's square (896x896 in the published
checkpoints), optionally with pan-and-scan crops, each crop resized the same way.

Pixel for pixel transformers' `Gemma3ImageProcessorPil` (the oracle, used without torchvision): PIL
resize (bilinear, `resample` 2) of the uint8 image to size x size whatever its aspect ratio, then
x * rescale_factor in float64 cast to float32 and (x - mean) / std in float32 (mean = std = 0.5: SigLIP's
[-1, 1] range). The rescale and normalise depend only on a pixel's byte and channel, so the engine keeps
the resized bytes and normalises them on the model's device through a [3, 256] table
(`multimodal.pixels`); `__call__` gives the float frames on the host, for comparisons.

Pan-and-scan (`PanAndScan`; transformers' `pan_and_scan`, off by default as Gemma3Processor has it): an
image whose long side is at least `min_ratio_to_activate` times its short side is cut along its long side
into n equal crops, n = round-half-up(long / short) but at most long // min_crop_size, then clamped to
[2, max_num_crops]; crops are ceil(long / n) wide, the last one clipped at the edge; none when a crop
would be narrower than min_crop_size. The frames of one image are the whole image, then its crops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError
from vlm_sdk.model_loader import config_field
from vlm_sdk.multimodal.image_io import to_rgb
from vlm_sdk.multimodal.image_key import image_key
from vlm_sdk.multimodal.pixels import byte_table, normalisation

SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class PanAndScan:
    """transformers' pan-and-scan options, at Gemma3Processor's defaults (off, 256, 4, 1.2): the values its
    `images_kwargs` hands the image processor on every call, over preprocessor_config.json's."""
    enabled: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(crops along the height, crops along the width); (0, 0) when the image is not cut."""
        if not self.enabled:
            return 0, 0
        landscape = width >= height
        long, short = (width, height) if landscape else (height, width)
        if long / short < self.min_ratio_to_activate:
            return 0, 0
        n = int(math.floor(long / short + 0.5))  # half rounds up
        n = min(int(math.floor(long / self.min_crop_size)), n)
        n = min(self.max_num_crops, max(2, n))
        rows, cols = (1, n) if landscape else (n, 1)
        if min(math.ceil(width / cols), math.ceil(height / rows)) < self.min_crop_size:
            return 0, 0
        return rows, cols

    def boxes(self, width: int, height: int) -> list[tuple[int, int, int, int]]:
        """The crops as PIL boxes (left, top, right, bottom), row by row, clipped at the image's edge."""
        rows, cols = self.grid(width, height)
        if not rows:
            return []
        w, h = math.ceil(width / cols), math.ceil(height / rows)
        return [(c * w, r * h, min(c * w + w, width), min(r * h + h, height)) for r in range(rows) for c in range(cols)]


class Gemma3ImageProcessor:
    """Frames of `size` x `size` pixels: `frame_bytes` (uint8, the engine's) or `__call__` (normalised float32)."""

    def __init__(self, size: int = 896, mean: tuple[float, ...] = SIGLIP_MEAN, std: tuple[float, ...] = SIGLIP_STD,
                 rescale_factor: float = 1 / 255, resample: int = Image.Resampling.BILINEAR,
                 pan_and_scan: PanAndScan = PanAndScan()):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidRequestError(f"image size must be a positive int, got {size!r}")
        self.size = size
        self.mean, self.std = normalisation(mean, std, names=("image_mean", "image_std"))
        self.rescale_factor = float(rescale_factor)
        self.resample = int(resample)
        self.pan_and_scan = pan_and_scan
        self._lut = byte_table(self.mean, self.std, self.rescale_factor)  # [3, 256]
        self.pixel_lut = torch.from_numpy(self._lut)  # [3, 256] float32, shared by every frame's meta

    @classmethod
    def from_preprocessor_config(cls, config: dict, hf_config=None) -> "Gemma3ImageProcessor":
        """From `preprocessor_config.json` (Gemma3ImageProcessor's fields: `size` {height, width}, image_mean /
        image_std, rescale_factor, resample, do_rescale / do_normalize) and, when its size is absent, the
        vision tower's image_size. Its do_pan_and_scan / pan_and_scan_* fields (null in the published files)
        are not read: transformers' Gemma3Processor passes its own defaults (off, 256, 4, 1.2) to the image
        processor on every call, over them, so they never take effect there either; the engine settings
        and an image part's options are what change them."""
        config = dict(config or {})
        size = config.get("size")
        if isinstance(size, dict):
            h, w = size.get("height"), size.get("width")
            if h is not None and w is not None and h != w:
                raise CheckpointError(f"preprocessor_config.json size {w}x{h} (width x height) is not square: the "
                                      f"Gemma 3 vision tower takes square images")
            size = h if h is not None else size.get("shortest_edge")
        if size is None:
            size = config_field(config_field(hf_config, "vision_config"), "image_size") or 896
        kwargs = {}
        for ours, theirs in (("mean", "image_mean"), ("std", "image_std"), ("resample", "resample")):
            if config.get(theirs) is not None:
                kwargs[ours] = config[theirs]
        kwargs["rescale_factor"] = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else 1.0
        if config.get("do_normalize", True) is False:
            kwargs["mean"], kwargs["std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        try:  # pan-and-scan: Gemma3Processor's defaults, whatever the file says (see `PanAndScan`)
            return cls(size=int(size), **kwargs)
        except InvalidRequestError as exc:
            raise CheckpointError(f"Gemma 3 preprocessing config: {exc}") from exc

    def boxes(self, image: Image.Image, pan_and_scan: PanAndScan | None = None) -> list[tuple[int, int, int, int]]:
        """The pan-and-scan crops of `image` (none without pan-and-scan)."""
        return (pan_and_scan or self.pan_and_scan).boxes(*image.size)

    def frame_bytes(self, image: Image.Image, pan_and_scan: PanAndScan | None = None) -> torch.Tensor:
        """`[1 + crops, 3, size, size]` uint8: the whole image, then its crops, each resized."""
        image = self._rgb(image)
        boxes = self.boxes(image, pan_and_scan)
        s = self.size
        out = np.empty((1 + len(boxes), 3, s, s), dtype=np.uint8)  # [frames, 3, s, s]
        for i, frame in enumerate([image] + [image.crop(b) for b in boxes]):
            out[i] = np.asarray(frame.resize((s, s), resample=self.resample)).transpose(2, 0, 1)
        return torch.from_numpy(out)

    def __call__(self, image: Image.Image, pan_and_scan: PanAndScan | None = None) -> torch.Tensor:
        """`[1 + crops, 3, size, size]` float32: `frame_bytes` through the normalisation table."""
        raw = self.frame_bytes(image, pan_and_scan).numpy()
        out = np.empty(raw.shape, dtype=np.float32)
        for c in range(3):
            np.take(self._lut[c], raw[:, c], out=out[:, c])
        return torch.from_numpy(out)

    @staticmethod
    def _rgb(image: Image.Image) -> Image.Image:
        if not isinstance(image, Image.Image):
            raise InvalidImageError(f"the image processor takes a PIL.Image.Image, got {type(image).__name__}; use "
                                    f"vlm_sdk.multimodal.image_io.load_image to decode other sources")
        if image.width <= 0 or image.height <= 0:
            raise InvalidImageError(f"image has zero size ({image.width}x{image.height}, width x height)")
        return image if image.mode == "RGB" else to_rgb(image)


def gemma3_image_pixels(image: Image.Image, ip: Gemma3ImageProcessor, pan_and_scan: PanAndScan):
    """One decoded image's work (where `PromptProcessor.run_pixels` puts it): (frame bytes uint8
    [1 + crops, 3, S, S], (height, width) as decoded, each frame's `image_key`: the whole image, then the crops
    of its (rows, cols) grid)."""
    rows, cols = pan_and_scan.grid(image.width, image.height)
    data = ip.frame_bytes(image, pan_and_scan)
    return data, (image.height, image.width), [image_key(image, frame=f, grid=(rows, cols) if f else None)
                                               for f in range(data.shape[0])]
