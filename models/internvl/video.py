"""InternVL videos, as its model card's `load_video` and chat prompts take them: `max_frames` frames
(default 8, the card's num_segments) sampled uniformly, each one 448x448 tile (its `dynamic_preprocess`
with max_num=1: the frame resized to the tile, no thumbnail), written into the prompt as

    Frame1: <image>\\nFrame2: <image>\\n ... FrameN: <image>\\n

which is also what transformers' InternVLProcessor makes of a video (`replace_video_token`, the -hf
template's `<video>\\n`). So the video part becomes those text and image parts before the chat template
renders, and each frame is an image item of one tile (its key: the tile's bytes).

    frame i = int(seg / 2 + round(seg * i)),  seg = (frames - 1) / max_frames   (the card's get_index)
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from PIL import Image

from vlm_sdk.multimodal.image_key import pixels_key
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.multimodal.video_io import OpenedVideo, iter_frames

DEFAULT_FRAMES = 8


def segment_indices(num_frames: int, num_segments: int) -> list[int]:
    """The model card's get_index without a time bound: the middle of each of `num_segments` equal
    segments of frames 0 .. num_frames - 1 (round half to even, as numpy rounds)."""
    seg = float(num_frames - 1) / num_segments
    return [int(seg / 2 + float(np.round(seg * i))) for i in range(num_segments)]


def video_frames(video: OpenedVideo, options: Mapping[str, Any], image_processor, tokens_per_tile: int,
                 meta_of) -> list[ImageInput]:
    """One item per sampled frame: uint8 [1, 3, s, s] (one tile), `meta_of(tiles)` its family record."""
    indices = segment_indices(video.info.num_frames, options.get("max_frames", DEFAULT_FRAMES))
    s = image_processor.image_size
    tiles: dict[int, torch.Tensor] = {}
    for index, frame in iter_frames(video, indices):
        tile = np.asarray(Image.fromarray(frame).resize((s, s), resample=image_processor.resample))  # [s, s, 3]
        tiles[index] = torch.from_numpy(np.ascontiguousarray(tile.transpose(2, 0, 1))[None])  # [1, 3, s, s]
    return [ImageInput(tiles[i], tokens_per_tile, meta_of(1), source_size=(video.info.height, video.info.width),
                       key=pixels_key(tiles[i], tile=s)) for i in indices]


def frame_parts(count: int) -> list[dict]:
    """The template parts a video of `count` frames becomes."""
    parts = []
    for i in range(count):
        parts += [{"type": "text", "text": f"Frame{i + 1}: "}, {"type": "image"}]
    return parts
