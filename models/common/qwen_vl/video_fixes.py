"""Qwen videos that make a prompt too long: the video part settings (`total_pixels`, `max_frames`, `fps`)
that alone, set on every video part of the request, would make it fit. Counted from each video's
container figures and qwen-vl-utils' arithmetic (video_sampling.py), nothing decoded.

    tokens(video) = sampled frames / 2 * (h / cell) * (w / cell)

    total_pixels  the largest value that fits, by bisection: every frame's size is non-decreasing in it
    max_frames    the largest even value that fits, scanned down: fewer frames may each be larger
    fps           the largest frame rate that fits among those that change some video's frame count
                  (decoded videos sampled by fps only), verified by recomputing the sampling
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from vlm_sdk.errors import InvalidVideoError
from vlm_sdk.models.common.qwen_vl.video_sampling import (FPS, FPS_MAX_FRAMES, FRAME_FACTOR, MODEL_SEQ_LEN,
                                                       ceil_by_factor, frame_size, smart_nframes)

_MAX_BISECTION = 1 << 40


@dataclass(frozen=True)
class VideoSource:
    """What sized a video's patches: its container figures and its part's options (shared by its patches'
    `QwenImage.video`)."""
    num_frames: int
    fps: float
    height: int
    width: int
    frame_list: bool
    options: Mapping[str, Any] = field(default_factory=dict)

    def tokens(self, factor: int, **changes) -> int | None:
        """Tokens under the part's options with `changes`; None when those settings are refused."""
        options = {**self.options, **changes}
        try:
            n = self.frames(options)
            h, w = frame_size(n, self.height, self.width, options, factor)
        except InvalidVideoError:
            return None
        return n // FRAME_FACTOR * (h // factor) * (w // factor)

    def frames(self, options: Mapping[str, Any]) -> int:
        """Frames sampled under `options` (a frame list: all, padded to a temporal patch)."""
        if self.frame_list:
            return ceil_by_factor(self.num_frames, FRAME_FACTOR)
        return smart_nframes(options, self.num_frames, self.fps)


def video_fixes(videos: list[VideoSource], other_tokens: int, capacity: int, factor: int) -> dict[str, int | float]:
    """{setting: value} for each video setting that alone (on every video part) makes `other_tokens`
    plus the videos' tokens fit `capacity`; values strictly below what the videos use now."""
    if not videos:
        return {}

    def fits(**changes) -> bool:
        counts = [v.tokens(factor, **changes) for v in videos]
        return None not in counts and other_tokens + sum(counts) <= capacity

    fixes: dict[str, int | float] = {}
    total = _largest_total_pixels(videos, fits, factor)
    if total is not None:
        fixes["total_pixels"] = total
    sampled = [v for v in videos if not v.frame_list and "nframes" not in v.options]  # fps decides their frames
    frames = max((v.frames(v.options) for v in sampled), default=0)
    best = next((m for m in range(frames - FRAME_FACTOR, 0, -FRAME_FACTOR) if fits(max_frames=m)), None)
    if best is not None:
        fixes["max_frames"] = best
    rate = _largest_fps(sampled, fits)
    if rate is not None:
        fixes["fps"] = rate
    return fixes


def _largest_total_pixels(videos: list[VideoSource], fits, factor: int) -> int | None:
    current = max(int(v.options.get("total_pixels", MODEL_SEQ_LEN * factor * factor * 0.9)) for v in videos)
    if not fits(total_pixels=1):
        return None
    lo, hi = 1, min(current, _MAX_BISECTION)  # fits(lo); hi: the value in use, which does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(total_pixels=mid) else (lo, mid)
    return lo


def _largest_fps(videos: list[VideoSource], fits) -> float | None:
    """Among the rates at which a video's frame count changes (n frames at n * video_fps / frames per
    second; n up to 768), below the rates in use: the largest that fits, rounded down to 3 decimals
    when that still fits."""
    if not videos:
        return None
    current = min(v.options.get("fps", FPS) for v in videos)
    top = min(FPS_MAX_FRAMES, max(v.num_frames for v in videos))
    candidates = sorted({n * v.fps / v.num_frames for v in videos for n in range(FRAME_FACTOR, top + 1, FRAME_FACTOR)},
                        reverse=True)
    for rate in candidates:
        if rate >= current:
            continue
        for shown in (float(f"{rate:.3f}"), rate):
            if 0 < shown < current and fits(fps=shown):
                return shown
    return None
