"""Qwen2-VL / Qwen2.5-VL image preprocessing: smart_resize, rescale, normalise, patchify.

Pixel-for-pixel the same as transformers' `Qwen2VLImageProcessorPil` (bicubic PIL resize on uint8,
x * rescale_factor in float64 cast to float32, then (x - mean) / std in float32, then patches with
the single frame repeated `temporal_patch_size` times), without importing transformers. It is faster
because it resizes the PIL image directly (no numpy/PIL round trips) and patchifies the 1-byte pixels.

The pixels leave the processor as those patchified bytes, one frame (`ImageInput.data` uint8
`[patches, 3 * p * p]`), and become float on the model's device (`pixels_to_device`): pinned upload
of the bytes, then a gather from a `[3, 256]` table of transformers' float32 value of every (channel,
byte) (`QwenImage.pixel_lut`, the rescale and normalisation above computed once per value), then the
frame repeated `temporal_patch_size` times. Equal to normalising on the host bit for bit, for 1/8 of
the bytes a float32 two-frame patch takes (patch 14: 588 B instead of 4,704 B).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError
from vlm_sdk.multimodal.image_io import to_rgb
from vlm_sdk.multimodal.image_key import image_key
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.multimodal.pixels import byte_table, images_to_device, normalisation

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenImage:
    """`ImageInput.meta` of a Qwen2.5-VL image."""
    grid_thw: tuple[int, int, int]  # patches along time, height, width (before merging)
    own_max_pixels: bool = False  # the image part set its own max_pixels (engine max_pixels does not apply)
    own_min_pixels: int | None = None  # the image part's own min_pixels, if it set one (it wins over the engine's)
    # frames in `data`: 1, a still image repeated in every temporal slot; temporal_patch_size, one temporal
    # patch of a video (its frames in order: uint8 [patches, 3, T, p*p])
    frames: int = 1
    t_offset: int = 0  # a video patch's temporal position relative to its video's start (rope_index.VisionSpan)
    ends_run: bool = True  # False for a video's patches but the last: text resumes after the whole video
    # a video's patches: what sized them (video_fixes.VideoSource), one object per video; None: an image
    video: Any = field(default=None, compare=False, repr=False)
    # [3, 256] float32: the normalised value of each (channel, byte) when `data` is uint8 (`pixels_to_device`);
    # the processor's one table, shared by its images
    pixel_lut: torch.Tensor | None = field(default=None, compare=False, repr=False)


def pixels_to_device(images: list[ImageInput], temporal_patch_size: int, device: torch.device | str,
                     dtype: torch.dtype) -> torch.Tensor:  # [patches, 3 * T * p * p] dtype on device
    """The images' patches as the tower takes them. uint8 `data` (the processor's) travels as bytes
    (pinned on CUDA, copied without blocking) and is normalised on the device through its `pixel_lut`:
    a still image's one frame repeated `temporal_patch_size` times, a video patch's frames as they are;
    float `data` (already normalised, all frames) is only copied and cast
    (`multimodal.pixels.images_to_device`). Consecutive items of one kind go up together."""
    if all(im.data.dtype != torch.uint8 for im in images):
        return images_to_device([im.data for im in images], [None] * len(images), device, dtype)
    if any(im.data.dtype != torch.uint8 for im in images):
        raise ValueError("images mix byte and float pixels")
    out, start = [], 0
    while start < len(images):
        frames = _frames(images[start])
        end = start + 1
        while end < len(images) and _frames(images[end]) == frames:
            end += 1
        run = images[start:end]
        data = [im.data.view(im.data.shape[0], 3, frames, -1) for im in run]  # bytes [n, 3, frames, p*p]
        pixels = images_to_device(data, [im.meta.pixel_lut for im in run], device, dtype)  # [n, 3, frames, p*p]
        # a still image: every temporal slot holds the same frame
        out.append(pixels.expand(-1, -1, temporal_patch_size, -1).reshape(pixels.shape[0], -1)
                   if frames == 1 else pixels.reshape(pixels.shape[0], -1))  # [n, 3 * T * p*p]
        start = end
    return out[0] if len(out) == 1 else torch.cat(out)


def _frames(image: ImageInput) -> int:
    return image.meta.frames


class Qwen2VLImageProcessor:
    """Turns one RGB PIL image into `ImageInput` for the Qwen2-VL vision tower.

    `data` is `[gh * gw, 3 * temporal_patch_size * patch_size**2]` float32 (meta: `QwenImage`), rows ordered
    merge-window by merge-window (the order the vision tower's patch merger expects); each row is
    laid out (channel, time, patch_row, patch_col). Defaults are those of the published checkpoints.
    """

    def __init__(self, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280, patch_size: int = 14,
                 temporal_patch_size: int = 2, merge_size: int = 2,
                 image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN, image_std: tuple[float, ...] = OPENAI_CLIP_STD,
                 rescale_factor: float = 1 / 255, resample: int = Image.Resampling.BICUBIC):
        for name, value in (("patch_size", patch_size), ("temporal_patch_size", temporal_patch_size),
                            ("merge_size", merge_size)):
            if not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive int, got {value!r}.")
        self.image_mean, self.image_std = normalisation(image_mean, image_std)
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.rescale_factor = float(rescale_factor)
        self.resample = int(resample)
        self.min_pixels, self.max_pixels = self._pixel_bounds(min_pixels, max_pixels, defaults=False)
        # transformers' arithmetic once per byte value; the device turns the uploaded bytes into these
        self.pixel_lut = torch.from_numpy(byte_table(self.image_mean, self.image_std, self.rescale_factor))  # [3, 256]

    @classmethod
    def from_preprocessor_config(cls, d: dict, hf_config=None) -> "Qwen2VLImageProcessor":
        """Build from `preprocessor_config.json`, either the published layout (top-level `min_pixels`
        / `max_pixels`) or transformers 5's (`size: {shortest_edge, longest_edge}`). Top-level values
        win when both are present, as in transformers. `hf_config` (config.json) is not needed here:
        the argument exists because other families read their image settings from it."""
        size = d.get("size") or {}
        min_pixels = d.get("min_pixels")
        max_pixels = d.get("max_pixels")
        if min_pixels is None:
            min_pixels = size.get("shortest_edge", size.get("min_pixels", 56 * 56))
        if max_pixels is None:
            max_pixels = size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280))
        if d.get("do_resize", True) is False:
            raise CheckpointError("preprocessor_config.json sets do_resize=false, which Qwen2-VL does not "
                                  "support: images must be resized to multiples of patch_size * merge_size.")
        kwargs = {k: d[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                    "image_std", "resample") if d.get(k) is not None}
        kwargs["rescale_factor"] = d.get("rescale_factor", 1 / 255) if d.get("do_rescale", True) else 1.0
        if d.get("do_normalize", True) is False:  # (x - 0) / 1 is exact, so this equals skipping it
            kwargs["image_mean"], kwargs["image_std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        try:
            return cls(min_pixels=min_pixels, max_pixels=max_pixels, **kwargs)
        except InvalidRequestError as exc:
            raise CheckpointError(f"preprocessor_config.json: {exc}") from exc

    def _pixel_bounds(self, min_pixels: int | None, max_pixels: int | None,
                      defaults: bool = True) -> tuple[int, int]:
        lo = self.min_pixels if (defaults and min_pixels is None) else min_pixels
        hi = self.max_pixels if (defaults and max_pixels is None) else max_pixels
        for name, value in (("min_pixels", lo), ("max_pixels", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive int, got {value!r}.")
        if lo > hi:
            def origin(given):  # per call vs this processor's default (the preprocessor config's)
                if not defaults:
                    return ""
                return ", the processor default" if given is None else ", passed to this call"
            raise InvalidRequestError(f"min_pixels ({lo}{origin(min_pixels)}) is larger than max_pixels "
                                      f"({hi}{origin(max_pixels)}); set min_pixels <= max_pixels.")
        return lo, hi

    def smart_resize(self, height: int, width: int, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[int, int]:
        """The size the image is resized to: both sides multiples of patch_size * merge_size, the
        area within [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
        lo, hi = self._pixel_bounds(min_pixels, max_pixels)
        if height <= 0 or width <= 0:
            raise InvalidImageError(f"image has zero size ({width}x{height}, width x height).")
        ratio = max(height, width) / min(height, width)
        if ratio > MAX_ASPECT_RATIO:
            raise InvalidImageError(
                f"image is {width}x{height} (width x height), aspect ratio {ratio:.1f}; Qwen2-VL accepts at "
                f"most {MAX_ASPECT_RATIO}. Crop or pad the image so that the long side is at most "
                f"{MAX_ASPECT_RATIO} times the short side.")
        # Same arithmetic as transformers' smart_resize, Python's round() (half to even) included.
        factor = self.patch_size * self.merge_size
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > hi:
            beta = math.sqrt((height * width) / hi)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < lo:
            beta = math.sqrt(lo / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid_thw(self, height: int, width: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int, int]:
        h, w = self.smart_resize(height, width, min_pixels, max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, height: int, width: int, min_pixels: int | None = None,
                         max_pixels: int | None = None) -> int:
        t, gh, gw = self.grid_thw(height, width, min_pixels, max_pixels)
        return t * gh * gw // (self.merge_size ** 2)

    def __call__(self, image: Image.Image, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> ImageInput:
        if not isinstance(image, Image.Image):
            raise InvalidImageError(f"the image processor takes a PIL.Image.Image, got {type(image).__name__}; "
                                    f"use vlm_sdk.multimodal.image_io.load_image to decode other sources.")
        if image.mode != "RGB":
            image = to_rgb(image)
        width, height = image.size
        h, w = self.smart_resize(height, width, min_pixels, max_pixels)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=self.resample)
        p, m = self.patch_size, self.merge_size
        gh, gw = h // p, w // p
        pixels = np.asarray(image)  # [h, w, 3] uint8
        # Patchify the 1-byte pixels first: the float work below then runs on contiguous memory.
        patches = pixels.reshape(gh // m, m, p, gw // m, m, p, 3)  # [gh/m, m, p, gw/m, m, p, 3]
        patches = np.ascontiguousarray(patches.transpose(0, 3, 1, 4, 6, 2, 5))  # [gh/m, gw/m, m, m, 3, p, p]
        pixel_bytes = torch.from_numpy(patches.reshape(gh * gw, 3 * p * p))  # [gh*gw, 3*p*p] uint8, one frame
        return ImageInput(pixel_bytes, gh * gw // (m * m), QwenImage((1, gh, gw), pixel_lut=self.pixel_lut))

    def normalized(self, image: ImageInput) -> torch.Tensor:  # [gh*gw, 3*T*p*p] float32
        """The patches as transformers' processor returns them (on the host; the model does this on its
        device)."""
        return pixels_to_device([image], self.temporal_patch_size, "cpu", torch.float32)


def qwen_image_pixels(image: Image.Image, ip: Qwen2VLImageProcessor, min_pixels: int, max_pixels: int):
    """One decoded image's work (run where `PromptProcessor.run_pixels` puts it, a worker process or the
    prompt's thread): (patch bytes uint8 [gh*gw, 3*p*p], grid (1, gh, gw), image tokens, (height, width)
    as decoded, its `image_key`)."""
    out = ip(image, min_pixels=min_pixels, max_pixels=max_pixels)
    return (out.data, out.meta.grid_thw, out.num_tokens, (image.height, image.width),
            image_key(image, min_pixels=min_pixels, max_pixels=max_pixels))  # the grid follows from these


def max_image_grid(image_processor, max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) patches of the image the profile runs through the vision tower: as many
    (patch * merge)^2 cells as fit in `max_pixels`, in a rectangle of aspect ratio at most 2 (a few
    cells fewer when the count does not factor so). A square image can fall well short: 1001x1001 at
    max_pixels 28*28*1280 resizes to 35x35 = 1225 cells, a 896x1120 one to all 1280."""
    m = image_processor.merge_size
    factor = image_processor.patch_size * m
    for cells in range(max(1, max_pixels // (factor * factor)), 0, -1):
        rows = next(d for d in range(math.isqrt(cells), 0, -1) if cells % d == 0)
        if cells // rows <= 2 * rows:
            return 1, rows * m, cells // rows * m
    return 1, m, m


def max_image_patches(image_processor, max_pixels: int) -> int:
    """Patches of the profiled max_pixels image: the most one vision-tower call may take
    (`ModelRunner(max_vision_patches=...)`) for the profiled peak to hold."""
    t, h, w = max_image_grid(image_processor, max_pixels)
    return t * h * w
