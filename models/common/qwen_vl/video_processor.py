"""Qwen2.5-VL / Qwen3-VL video preprocessing: one video -> one `ImageInput` per temporal patch (2 frames).

    sample    qwen-vl-utils' frames and size (video_sampling.py) from the container's frame count and rate
    decode    only the sampled frames (multimodal/video_io.py), each resized at once as qwen-vl-utils
              resizes (multimodal/frames.py: from the uint8 frame, a band of rows at a time in float32),
              so one source frame is held at a time; a cancelled request stops between bands
    patchify  frames 2k and 2k+1 -> uint8 [gh * gw, 3 * 2 * p * p], rows in merge-window order, each row
              laid out (channel, frame, patch_row, patch_col): transformers' `Qwen2VLVideoProcessor.patchify`
    values    normalised on the model's device through a [3, 256] table of transformers' video processor
              arithmetic (`fused_byte_table`: its rescale folded into mean and std, float32)

A temporal patch is an item of its own (grid (1, h, w)): the vision tower attends within a frame and
its windows never cross frames, so a patch's embeddings are those of the whole video's rows, and the
engine caps, caches and chunks a video patch by patch as it does images. Each patch's key hashes its
resized frames, its grid and its place in the positions (its temporal offset), so equal keys promise
equal embeddings and positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from PIL import Image

from vlm_sdk.errors import InvalidVideoError
from vlm_sdk.multimodal.frames import resize_frame
from vlm_sdk.multimodal.image_key import pixels_key
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.multimodal.pixels import fused_byte_table
from vlm_sdk.multimodal.video_io import OpenedVideo, iter_frames
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor, QwenImage, max_image_grid
from vlm_sdk.models.common.qwen_vl.video_fixes import VideoSource
from vlm_sdk.models.common.qwen_vl.video_sampling import VIDEO_MAX_TOKEN_NUM, VideoSampling, plan_frame_list, plan_video


@dataclass(frozen=True)
class QwenVideo:
    """One video as the prompt builder places it: its patches (items), how it was sampled, its grid."""
    patches: list[ImageInput]
    sampling: VideoSampling
    grid: tuple[int, int]  # (h, w) merged units of every patch

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.patches)


class QwenVideoProcessor:
    """Videos for a Qwen2-VL-style vision tower whose image processor is `image_processor` (its patch
    geometry, mean, std and rescale factor)."""

    def __init__(self, image_processor: Qwen2VLImageProcessor):
        ip = image_processor
        self.patch_size, self.merge_size, self.temporal_patch_size = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        if self.temporal_patch_size != 2:
            raise InvalidVideoError(f"videos need temporal_patch_size 2 (qwen-vl-utils' frame factor); the "
                                    f"checkpoint's is {self.temporal_patch_size}")
        self.factor = self.patch_size * self.merge_size
        self.pixel_lut = torch.from_numpy(fused_byte_table(ip.image_mean, ip.image_std, ip.rescale_factor))  # [3, 256]

    def largest_patch(self) -> ImageInput:
        """Zero pixels of the largest temporal patch the defaults allow (qwen-vl-utils' 768 tokens per
        frame; a part's larger min_pixels is refused), for the memory profile beside the largest image."""
        t, h, w = max_image_grid(self, VIDEO_MAX_TOKEN_NUM * self.factor ** 2)
        p, tp = self.patch_size, self.temporal_patch_size
        return ImageInput(torch.zeros(h * w, 3 * tp * p * p, dtype=torch.uint8), h * w // self.merge_size ** 2,
                          QwenImage((1, h, w), frames=tp, pixel_lut=self.pixel_lut))  # data [patches, 3*T*p*p]

    def sample(self, video: OpenedVideo, options: Mapping[str, Any]) -> VideoSampling:
        info = video.info
        if video.frames is not None:
            return plan_frame_list(options, info.num_frames, info.height, info.width, self.factor)
        return plan_video(options, info.num_frames, info.fps, info.height, info.width, self.factor)

    def frames(self, video: OpenedVideo, sampling: VideoSampling) -> np.ndarray:  # [nframes, h, w, 3] uint8
        """The sampled frames at their resized size, decoded one at a time."""
        out = np.empty((len(sampling.indices), sampling.height, sampling.width, 3), dtype=np.uint8)
        slots: dict[int, list[int]] = {}
        for slot, index in enumerate(sampling.indices):
            slots.setdefault(index, []).append(slot)
        for index, frame in iter_frames(video, list(sampling.indices)):
            if sampling.pre_size is not None:  # a frame list: qwen-vl-utils' image resize first
                frame = np.asarray(Image.fromarray(frame).resize(sampling.pre_size[::-1], Image.Resampling.BICUBIC))
            out[slots[index]] = resize_frame(frame, sampling.height, sampling.width, video.cancelled)
        return out

    def source(self, video: OpenedVideo, options: Mapping[str, Any]) -> VideoSource:
        info = video.info
        return VideoSource(info.num_frames, info.fps, info.height, info.width, video.frames is not None, dict(options))

    def tokens(self, sampling: VideoSampling) -> int:
        """Tokens of a video sampled so (before decoding it)."""
        return len(sampling.indices) // self.temporal_patch_size * (sampling.height // self.factor) * \
            (sampling.width // self.factor)

    def __call__(self, video: OpenedVideo, options: Mapping[str, Any],
                 placement: Callable[[int, VideoSampling], list[tuple[int, bool]]],
                 sampling: VideoSampling | None = None) -> QwenVideo:
        """The video's patches. `placement(num_patches, sampling)` -> each patch's (temporal offset, ends
        its run) in the positions (rope_index.VisionSpan): the family's. `sampling`: `sample`'s, if done."""
        sampling = sampling or self.sample(video, options)
        return self.patches(self.frames(video, sampling), sampling, placement, self.source(video, options))

    def patches(self, frames: np.ndarray,  # [nframes, h, w, 3] uint8, sampled and resized
                sampling: VideoSampling, placement, source: VideoSource | None = None) -> QwenVideo:
        """The temporal patches of resized frames (`__call__` after decoding)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = sampling.height, sampling.width
        gh, gw = h // p, w // p
        groups = frames.reshape(-1, t, gh // m, m, p, gw // m, m, p, 3)  # [G, T, gh/m, m, p, gw/m, m, p, 3]
        # per patch: rows (gh/m, gw/m, m, m), each (channel, frame, p, p), as transformers' patchify
        groups = groups.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [G, gh/m, gw/m, m, m, 3, T, p, p]
        num = groups.shape[0]
        patches = []
        for k, (offset, ends_run) in enumerate(placement(num, sampling)):
            data = torch.from_numpy(np.ascontiguousarray(groups[k]).reshape(gh * gw, 3 * t * p * p))  # uint8
            meta = QwenImage((1, gh, gw), frames=t, pixel_lut=self.pixel_lut, t_offset=offset, ends_run=ends_run,
                             video=source)
            key = pixels_key(data, grid=(1, gh, gw), t_offset=offset, ends_run=ends_run)
            size = (source.height, source.width) if source is not None else None
            patches.append(ImageInput(data, gh * gw // (m * m), meta, source_size=size, key=key))
        return QwenVideo(patches, sampling, (gh // m, gw // m))
