"""Which frames of a video Qwen2.5-VL and Qwen3-VL see, and at what size: qwen-vl-utils' `fetch_video`
(qwen_vl_utils/vision_process.py, 0.0.14), the preprocessing the Qwen checkpoints were published with,
re-derived here so that nothing of it runs at serving time.

    frames   nframes = duration * fps (default 2), clamped to [min_frames (4), max_frames (768, at most
             the video's frames)] and to the video's frames, floored to a multiple of 2 (a temporal
             patch); `nframes` instead of fps asks for a count (rounded to a multiple of 2)
    indices  round(linspace(0, frames - 1, nframes)) in float32, as torch computes it
    fps      sample_fps = nframes / frames * video_fps: the time one temporal patch spans is 2 / sample_fps
    size     per frame: min_pixels (128 tokens' pixels) .. max_pixels = max(min(768 tokens' pixels,
             total_pixels / nframes * 2), 1.05 * min_pixels), a part's max_pixels only lowering it;
             total_pixels defaults to 128000 tokens' pixels * 0.9 (qwen-vl-utils' MODEL_SEQ_LEN);
             qwen-vl-utils' own smart_resize (which differs from transformers' at the edges)

A list of frames: padded to a multiple of 2 with its last frame; each frame first resized as
qwen-vl-utils' `fetch_image` resizes it there (to a multiple of twice the patch cell, its image pixel
bounds: the factor it passes is the cell, taken as a patch size), then the video size above;
sample_fps is the part's `sample_fps` (default 2), frame i's time i / sample_fps. Bad settings are `InvalidVideoError`s naming them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from vlm_sdk.errors import InvalidVideoError

FPS = 2.0
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_TOKEN_NUM = 128
VIDEO_MAX_TOKEN_NUM = 768
IMAGE_MIN_TOKEN_NUM = 4
IMAGE_MAX_TOKEN_NUM = 16384
MODEL_SEQ_LEN = 128000
MAX_RATIO = 200


@dataclass(frozen=True)
class VideoSampling:
    """What one video becomes: the frames taken (indices into the video, padded for frame lists), the
    rate they stand for, and their size."""
    indices: tuple[int, ...]
    sample_fps: float  # sampled frames per second of video: 2 / sample_fps seconds per temporal patch
    times: tuple[float, ...]  # each sampled frame's time in seconds (Qwen3-VL's timestamps)
    height: int
    width: int
    pre_size: tuple[int, int] | None = None  # frame lists: (h, w) each frame is resized to first


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """qwen-vl-utils' smart_resize: both sides multiples of `factor`, the area within the bounds."""
    if max_pixels < min_pixels:
        raise InvalidVideoError(f"max_pixels ({max_pixels:g}) is below min_pixels ({min_pixels:g}); set "
                                f"min_pixels <= max_pixels", param="max_pixels")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_RATIO:
        raise InvalidVideoError(f"video frames are {width}x{height} (width x height), aspect ratio {ratio:.1f}; at "
                                f"most {MAX_RATIO} is accepted. Crop or pad the video.")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = floor_by_factor(height / beta, factor)
        w_bar = floor_by_factor(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    if h_bar <= 0 or w_bar <= 0:
        raise InvalidVideoError(f"video frames of {width}x{height} shrink to nothing under max_pixels {max_pixels:g}; "
                                f"raise max_pixels or total_pixels", param="max_pixels")
    return h_bar, w_bar


def smart_nframes(options: Mapping[str, Any], total_frames: int, video_fps: float) -> int:
    """qwen-vl-utils' frame count for a video of `total_frames` frames at `video_fps`."""
    if "fps" in options and "nframes" in options:
        raise InvalidVideoError("a video part takes fps or nframes, not both", param="nframes")
    if "nframes" in options:
        nframes = round_by_factor(options["nframes"], FRAME_FACTOR)
    else:
        fps = options.get("fps", FPS)
        min_frames = ceil_by_factor(options.get("min_frames", FPS_MIN_FRAMES), FRAME_FACTOR)
        max_frames = floor_by_factor(options.get("max_frames", min(FPS_MAX_FRAMES, total_frames)), FRAME_FACTOR)
        nframes = total_frames / video_fps * fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = floor_by_factor(nframes, FRAME_FACTOR)
    if not FRAME_FACTOR <= nframes <= total_frames:
        asked = (f"nframes={options['nframes']}" if "nframes" in options else
                 f"fps={options.get('fps', FPS)}, min_frames={options.get('min_frames', FPS_MIN_FRAMES)}, "
                 f"max_frames={options.get('max_frames', 'its frame count')}")
        fix = ("a video needs at least 2 frames" if total_frames < FRAME_FACTOR else
               f"ask for {FRAME_FACTOR} to {floor_by_factor(total_frames, FRAME_FACTOR)} frames")
        raise InvalidVideoError(f"the video has {total_frames} frames at {video_fps:g} fps; with {asked} it would sample "
                                f"{nframes}: {fix}", param="nframes" if "nframes" in options else "max_frames")
    return int(nframes)


def sample_indices(total_frames: int, nframes: int) -> tuple[int, ...]:
    """round(linspace(0, total_frames - 1, nframes)): float32 and half-to-even, as torch computes it."""
    return tuple(torch.linspace(0, total_frames - 1, nframes).round().long().tolist())


def frame_size(nframes: int, height: int, width: int, options: Mapping[str, Any], factor: int) -> tuple[int, int]:
    """(height, width) of every frame of a video of `nframes` sampled frames of height x width."""
    min_pixels = options.get("min_pixels", VIDEO_MIN_TOKEN_NUM * factor * factor)
    total_pixels = options.get("total_pixels", MODEL_SEQ_LEN * factor * factor * 0.9)
    max_pixels = max(min(VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * FRAME_FACTOR),
                     int(min_pixels * 1.05))
    if options.get("max_pixels", max_pixels) < min_pixels:
        origin = "set on the video part" if "min_pixels" in options else \
            f"the default, {VIDEO_MIN_TOKEN_NUM} tokens' pixels"
        raise InvalidVideoError(f"the video part's max_pixels ({options['max_pixels']}) is below min_pixels "
                                f"({min_pixels}, {origin}); set min_pixels <= max_pixels", param="max_pixels")
    max_pixels = min(options.get("max_pixels", max_pixels), max_pixels)
    return smart_resize(height, width, factor, min_pixels, max_pixels)


def plan_video(options: Mapping[str, Any], total_frames: int, video_fps: float, height: int, width: int,
               factor: int) -> VideoSampling:
    """The frames and size of a decoded video (`factor`: patch size * merge size)."""
    nframes = smart_nframes(options, total_frames, video_fps)
    h, w = frame_size(nframes, height, width, options, factor)
    indices = sample_indices(total_frames, nframes)
    return VideoSampling(indices, nframes / max(total_frames, 1e-6) * video_fps,
                         tuple(i / video_fps for i in indices), h, w)


def plan_frame_list(options: Mapping[str, Any], num_frames: int, height: int, width: int,
                    factor: int) -> VideoSampling:
    """A list of frames given as the video: every frame, the last repeated to a multiple of 2."""
    nframes = ceil_by_factor(num_frames, FRAME_FACTOR)
    indices = tuple(range(num_frames)) + (num_frames - 1,) * (nframes - num_frames)
    image_factor = factor * 2  # fetch_image(..., image_factor) takes the cell as its patch size
    pre = smart_resize(height, width, image_factor,
                       options.get("min_pixels", IMAGE_MIN_TOKEN_NUM * image_factor ** 2),
                       options.get("max_pixels", IMAGE_MAX_TOKEN_NUM * image_factor ** 2))
    h, w = frame_size(nframes, pre[0], pre[1], options, factor)
    sample_fps = options.get("sample_fps", FPS)
    # qwen-vl-utils' metadata for a list: frame i (padding included) at i / sample_fps
    return VideoSampling(indices, sample_fps, tuple(i / sample_fps for i in range(nframes)), h, w, pre)
