"""Read a video a user sends, size it up from its container before decoding anything, then decode only
the frames a model family samples (PyAV, i.e. FFmpeg's demuxers and decoders).

    open_video:   the bytes / file -> the container opened with no decoder allowed in FFmpeg's stream
                  probe (video_container.py), its header (codec, frame size, fps, duration, frame count)
                  checked against `VideoLimits` and max_image_pixels, then every video packet's timestamp
                  and keyframe flag (demuxed, not decoded; bounded as it goes): the frame count and the
                  frame -> timestamp map, as decord and torchcodec count frames (one per packet, in
                  presentation order) -> `OpenedVideo`
    decode_plan:  for the frame indices a family samples, how many frames the decoder must decode (from
                  the keyframe before each sampled frame), refused over `max_decode_pixels` first (each
                  frame counted as at least MIN_FRAME_COST pixels: a frame's fixed cost)
    iter_frames:  seek to the keyframe before each sampled frame (unless decoding on is shorter), decode
                  forward to it, yield it as RGB [H, W, 3] uint8; one decoded frame held at a time; the
                  decoder refuses a frame much larger than the header said, and any larger one is refused

A list of frames (PIL images, or anything `load_image` reads) is a video too (`OpenedVideo.frames`).
Every failure is an `InvalidVideoError` naming what was received, the numbers and the setting. A request
that was cancelled stops within a read of the file, a few packets or a frame: in the open, the index
and the decode alike (`DecodeCancelled`).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from vlm_sdk.errors import InvalidImageError, InvalidVideoError
from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.video_container import (ACCEPTED_VIDEO_SOURCES, GilPacer, average_fps, check_cancelled,
                                                check_header, decoder_options, index_packets, open_container, read_source,
                                                reason, too_long, video_stream)

__all__ = ["ACCEPTED_VIDEO_SOURCES", "MIN_FRAME_COST", "OpenedVideo", "VideoInfo", "VideoLimits", "decode_plan",
           "iter_frames", "open_video"]

# what decoding a frame costs at least, in pixels of decoding time: a 16x16 H.264 frame takes ~30 us to
# decode, as long as ~6,000 pixels of a large one (~4.5 ns a pixel); counted as 256x256, a million tiny
# frames cannot pass for 256 million pixels of work
MIN_FRAME_COST = 65_536


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost (engine settings of the same names with `max_video_` in front)."""
    max_bytes: int = 1 << 30  # encoded size
    max_seconds: float = 3600.0  # duration
    max_frames: int = 768  # frames sampled (qwen-vl-utils' FPS_MAX_FRAMES)
    # pixels the decoder may decode for one video: every frame decoded on the way to the sampled ones
    # (from the keyframe before each), at the source size; ~3,900 1080p frames, tens of seconds of decoding
    max_decode_pixels: int = 8_000_000_000
    # frames in the container, every one of which is indexed (a packet each) whichever are sampled: an
    # hour at 60 fps; the sampled ones are max_frames
    max_container_frames: int = 216_000


@dataclass(frozen=True)
class VideoInfo:
    """What the container says, and its packet index: frame i (presentation order) has timestamp
    `frame_pts[i]` (stream time base); `keyframes` are the indices of keyframes."""
    width: int
    height: int
    num_frames: int
    fps: float  # the stream's average frame rate (decord's get_avg_fps)
    seconds: float
    codec: str
    frame_pts: tuple[int, ...] = ()
    keyframes: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpenedVideo:
    """A video read and checked, nothing decoded yet. Exactly one of `data` (encoded bytes), `path`
    (a file, opened again to decode) and `frames` (already images) is set."""
    info: VideoInfo
    what: str
    limits: VideoLimits
    data: bytes | None = None
    path: str | None = None
    frames: tuple | None = None  # a list of frames given as the video: PIL images, decoded
    cancelled: threading.Event | None = None

    @property
    def pixels(self) -> int:
        """Pixels of one frame at the source size."""
        return self.info.width * self.info.height


def open_video(source: object, limits: VideoLimits = VideoLimits(), *, max_image_pixels: int = 64_000_000,
               cancelled: threading.Event | None = None) -> OpenedVideo:
    """Read `source`, check its header and index its packets (`InvalidVideoError` when it is not a
    usable video or is over a limit; `max_image_pixels` bounds one frame); no frame of an encoded video
    is decoded. `DecodeCancelled` once `cancelled` is set."""
    if isinstance(source, OpenedVideo):
        return source
    if isinstance(source, (list, tuple)):
        return _open_frames(source, limits, max_image_pixels, cancelled)
    data, path, what = read_source(source, limits.max_bytes)
    with open_container(data, path, what, cancelled) as container:
        stream = video_stream(container, what)
        header = check_header(container, stream, what, limits, max_image_pixels)
        info = _index(container, stream, what, limits, header, cancelled)
    return OpenedVideo(info, what, limits, data, path, None, cancelled)


def decode_plan(video: OpenedVideo, indices: list[int]) -> int:
    """Frames the decoder decodes to reach `indices` (sorted or not), each from the keyframe before it
    unless the frames in between are fewer; `InvalidVideoError` when that, at the source size (at least
    MIN_FRAME_COST a frame), is over the video's `max_decode_pixels` or an index is out of range."""
    info = video.info
    if len(indices) > video.limits.max_frames:
        raise InvalidVideoError(f"video {video.what}: {len(indices)} frames sampled, over the limit of "
                                f"{video.limits.max_frames} (setting max_video_frames, flag --max-video-frames); lower "
                                f"the video part's fps, max_frames or nframes, or raise the setting")
    wanted = sorted(set(indices))
    if wanted and (wanted[0] < 0 or wanted[-1] >= info.num_frames):
        raise InvalidVideoError(f"video {video.what}: frame {wanted[-1] if wanted[-1] >= info.num_frames else wanted[0]} "
                                f"is out of range; it has {info.num_frames} frames")
    if video.frames is not None:
        return len(wanted)
    decoded, position = 0, -1  # position: the last frame decoded so far
    for index in wanted:
        key = _keyframe_before(info, index)
        start = position + 1 if key <= position else key
        decoded += index - start + 1
        position = index
    cost = decoded * _frame_cost(video)
    if cost > video.limits.max_decode_pixels:
        floor = (f" (each frame counted as at least {MIN_FRAME_COST:,} pixels: decoding a frame has a fixed cost)"
                 if video.pixels < MIN_FRAME_COST else "")
        raise InvalidVideoError(
            f"video {video.what} ({info.width}x{info.height}, {info.num_frames} frames, keyframes every "
            f"{_keyframe_gap(info)} frames on average) would need {decoded:,} frames decoded = {cost:,} pixels{floor} "
            f"to reach its {len(wanted)} sampled frames, over the limit of {video.limits.max_decode_pixels:,} (setting "
            f"max_video_decode_pixels, flag --max-video-decode-pixels); sample fewer frames (the video part's fps "
            f"or max_frames), send a shorter or smaller video, or raise the setting.")
    return decoded


def iter_frames(video: OpenedVideo, indices: list[int]):
    """Yield (index, RGB frame [H, W, 3] uint8) for each distinct index in ascending order, decoding
    only what `decode_plan` counted (checked first). Raises `DecodeCancelled` once the request's
    `cancelled` is set (within a read or a frame), `InvalidVideoError` when a frame cannot be decoded
    or is larger than the header said."""
    decode_plan(video, indices)
    wanted = sorted(set(indices))
    if video.frames is not None:
        for index in wanted:
            check_cancelled(video.cancelled, video.what)
            yield index, np.asarray(video.frames[index])
        return
    with open_container(video.data, video.path, video.what, video.cancelled) as container:
        yield from _decode(container, video, wanted)


def _frame_cost(video: OpenedVideo) -> int:
    return max(video.pixels, MIN_FRAME_COST)


def _decode(container, video: OpenedVideo, wanted: list[int]):
    import av
    info, what = video.info, video.what
    stream = video_stream(container, what)
    stream.thread_type = "AUTO"  # frame and slice threads of the decoder
    stream.codec_context.options = decoder_options(info.width, info.height)
    budget = video.limits.max_decode_pixels // _frame_cost(video)  # frames, whatever the path taken
    decoded, frames, position = 0, None, -1  # position: index of the last frame decoded
    pace = GilPacer()  # the engine thread gets the GIL back between frames (video_container.py)
    for index in wanted:
        key = _keyframe_before(info, index)
        target = info.frame_pts[index]
        try:
            if frames is None or key > position:
                container.seek(info.frame_pts[key], backward=True, any_frame=False, stream=stream)
                frames = container.decode(stream)
            for frame in frames:
                check_cancelled(video.cancelled, what)
                decoded += 1
                pace()
                if decoded > budget:
                    raise InvalidVideoError(f"video {what}: decoding went past the limit of "
                                            f"{video.limits.max_decode_pixels:,} pixels (setting max_video_decode_pixels) "
                                            f"before reaching frame {index}; the file's keyframe index is unreliable")
                if frame.width * frame.height > video.pixels:
                    raise InvalidVideoError(f"video {what}: a frame is {frame.width}x{frame.height}, larger than the "
                                            f"{info.width}x{info.height} its header says; re-encode it")
                if frame.pts is None or frame.pts < target:
                    continue
                if frame.pts > target:
                    break  # the decoder skipped it (a broken reference): refused below
                position = index
                yield index, frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
                break
        except av.FFmpegError as exc:
            check_cancelled(video.cancelled, what)
            raise InvalidVideoError(f"video {what}: frame {index} could not be decoded; the data is corrupt or "
                                    f"truncated, or its frames are larger than its header's {info.width}x{info.height} "
                                    f"({reason(exc)})") from exc
        check_cancelled(video.cancelled, what)  # the reads ended early: not the end of the file
        if position != index:
            raise InvalidVideoError(f"video {what}: frame {index} (of {info.num_frames}) could not be decoded; "
                                    f"the data is corrupt or truncated")


def _index(container, stream, what: str, limits: VideoLimits, header: float | None,
           cancelled: threading.Event | None) -> VideoInfo:
    """The packet index in presentation order, its duration checked when the header had none."""
    pts, keys = index_packets(container, stream, what, limits, cancelled)
    if not pts:
        raise InvalidVideoError(f"video {what} has no frames (a zero-length video)")
    # decode order -> presentation order, in numpy: its sort lets the GIL go (a 200,000-entry sort in
    # Python's held it for a tenth of a second on a busy machine)
    stamps = np.asarray(pts, dtype=np.int64)  # [frames]
    order = np.argsort(stamps, kind="stable")  # [frames]
    ordered = stamps[order]
    if len(ordered) > 1 and not (np.diff(ordered) > 0).all():
        raise InvalidVideoError(f"video {what}: two frames share one timestamp; re-mux it (e.g. ffmpeg -i in -c copy out.mp4)")
    frame_pts = tuple(ordered.tolist())
    keyframes = tuple(np.flatnonzero(np.asarray(keys, dtype=bool)[order]).tolist()) or (0,)
    seconds = _index_seconds(frame_pts, stream.time_base or Fraction(1, 1))
    if header is None and seconds > limits.max_seconds:
        too_long(what, seconds, limits)
    fps = average_fps(stream, len(frame_pts), header if header else seconds)
    return VideoInfo(stream.codec_context.width, stream.codec_context.height, len(frame_pts), fps,
                     header if header else seconds, stream.codec_context.name, frame_pts, keyframes)


def _index_seconds(frame_pts: tuple[int, ...], tb: Fraction) -> float:
    """From the first frame to one frame past the last (the mean frame gap), in seconds."""
    n = len(frame_pts)
    span = frame_pts[-1] - frame_pts[0]
    return float((span + (span / (n - 1) if n > 1 else 0)) * tb)


def _keyframe_before(info: VideoInfo, index: int) -> int:
    at = bisect.bisect_right(info.keyframes, index) - 1
    return info.keyframes[at] if at >= 0 else 0


def _keyframe_gap(info: VideoInfo) -> int:
    return max(1, round(info.num_frames / max(len(info.keyframes), 1)))


def _open_frames(source, limits: VideoLimits, max_image_pixels: int, cancelled) -> OpenedVideo:
    """A list of frames as a video: each decoded now (they are images), one size for all."""
    if not source:
        raise InvalidVideoError("a video given as a list of frames needs at least one frame")
    if len(source) > limits.max_frames:
        raise InvalidVideoError(f"a video of {len(source)} frames is over the limit of {limits.max_frames} frames (setting "
                                f"max_video_frames, flag --max-video-frames); send fewer frames")
    frames = []
    for i, item in enumerate(source):
        check_cancelled(cancelled, f"frame {i}")
        try:
            frames.append(load_image(item, max_image_pixels=max_image_pixels))
        except InvalidImageError as exc:
            raise InvalidVideoError(f"frame {i} of the video: {exc}") from None
        if frames[-1].size != frames[0].size:
            raise InvalidVideoError(f"frame {i} of the video is {frames[-1].size[0]}x{frames[-1].size[1]} but frame 0 is "
                                    f"{frames[0].size[0]}x{frames[0].size[1]}; every frame of a video has one size")
    w, h = frames[0].size
    what = f"list of {len(frames)} frames of {w}x{h}"
    if len(frames) * w * h > limits.max_decode_pixels:
        raise InvalidVideoError(f"video {what} holds {len(frames) * w * h:,} pixels, over the limit of "
                                f"{limits.max_decode_pixels:,} (setting max_video_decode_pixels); send fewer or smaller frames")
    info = VideoInfo(w, h, len(frames), 0.0, 0.0, "frames", tuple(range(len(frames))), tuple(range(len(frames))))
    return OpenedVideo(info, what, limits, frames=tuple(frames), cancelled=cancelled)
