"""Read a video a user sends, size it up from its container before decoding anything, then decode only
the frames a model family samples (PyAV, i.e. FFmpeg's demuxers and decoders).

    open_video:   the bytes / file -> the container header (codec, size, fps, duration) checked against
                  `VideoLimits`, then every video packet's timestamp and keyframe flag (demuxed, not
                  decoded): the frame count and the frame -> timestamp map, as decord and torchcodec
                  count frames (one per packet, in presentation order) -> `OpenedVideo`
    decode_plan:  for the frame indices a family samples, how many frames the decoder must decode (from
                  the keyframe before each sampled frame), refused over `max_decode_pixels` first
    iter_frames:  seek to the keyframe before each sampled frame (unless decoding on is shorter), decode
                  forward to it, yield it as RGB [H, W, 3] uint8; one decoded frame held at a time

A list of frames (PIL images, or anything `load_image` reads) is a video too (`OpenedVideo.frames`).
Every failure is an `InvalidVideoError` naming what was received, the numbers and the setting; a
request that was cancelled stops between frames (`DecodeCancelled`).
"""
from __future__ import annotations

import bisect
import io
import math
import os
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from vlm_sdk.errors import InvalidImageError, InvalidVideoError, without_reprs
from vlm_sdk.multimodal.image_io import DecodeCancelled, _clip, _decode_data_url, _file_url_path, load_image

ACCEPTED_VIDEO_SOURCES = ("a filesystem path (str or pathlib.Path), raw video bytes, a base64 data URL "
                          "('data:video/mp4;base64,...'), a 'file://' URL, or a list of frames (PIL images, "
                          "paths or bytes of images)")
# FFmpeg opens a lone image as a one-frame "video"; such a source belongs in an image part
_IMAGE_FORMATS = ("image2", "image2pipe")
MAX_INDEXED_FRAMES = 1_000_000  # packets indexed per video: ~4.6 h at 60 fps; more is not a video to sample


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost (engine settings of the same names with `max_video_` in front)."""
    max_bytes: int = 1 << 30  # encoded size
    max_seconds: float = 3600.0  # duration
    max_frames: int = 768  # frames sampled (qwen-vl-utils' FPS_MAX_FRAMES)
    # pixels the decoder may decode for one video: every frame decoded on the way to the sampled ones
    # (from the keyframe before each), at the source size; ~3,900 1080p frames, tens of seconds of decoding
    max_decode_pixels: int = 8_000_000_000


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
    usable video or is over a limit); no frame of an encoded video is decoded."""
    if isinstance(source, OpenedVideo):
        return source
    if isinstance(source, (list, tuple)):
        return _open_frames(source, limits, max_image_pixels, cancelled)
    data, path, what = _read_source(source, limits.max_bytes)
    with _container(data, path, what) as container:
        stream = _video_stream(container, what)
        info = _index(container, stream, what, limits)
    return OpenedVideo(info, what, limits, data, path, None, cancelled)


def decode_plan(video: OpenedVideo, indices: list[int]) -> int:
    """Frames the decoder decodes to reach `indices` (sorted or not), each from the keyframe before it
    unless the frames in between are fewer; `InvalidVideoError` when that is over the video's
    `max_decode_pixels` or an index is out of range."""
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
    cost = decoded * video.pixels
    if cost > video.limits.max_decode_pixels:
        raise InvalidVideoError(
            f"video {video.what} ({info.width}x{info.height}, {info.num_frames} frames, keyframes every "
            f"{_keyframe_gap(info)} frames on average) would need {decoded:,} frames decoded = {cost:,} pixels to reach "
            f"its {len(wanted)} sampled frames, over the limit of {video.limits.max_decode_pixels:,} (setting "
            f"max_video_decode_pixels, flag --max-video-decode-pixels); sample fewer frames (the video part's fps "
            f"or max_frames), send a shorter or smaller video, or raise the setting.")
    return decoded


def iter_frames(video: OpenedVideo, indices: list[int]):
    """Yield (index, RGB frame [H, W, 3] uint8) for each distinct index in ascending order, decoding
    only what `decode_plan` counted (checked first). Raises `DecodeCancelled` between frames once the
    request's `cancelled` is set, `InvalidVideoError` when a frame cannot be decoded."""
    decode_plan(video, indices)
    wanted = sorted(set(indices))
    if video.frames is not None:
        for index in wanted:
            _check_cancelled(video)
            yield index, np.asarray(video.frames[index])
        return
    with _container(video.data, video.path, video.what) as container:
        yield from _decode(container, video, wanted)


def _decode(container, video: OpenedVideo, wanted: list[int]):
    import av
    info = video.info
    stream = _video_stream(container, video.what)
    stream.thread_type = "AUTO"  # frame and slice threads of the decoder
    budget = video.limits.max_decode_pixels // max(video.pixels, 1)  # frames, whatever the path taken
    decoded, frames, position = 0, None, -1  # position: index of the last frame decoded
    for index in wanted:
        key = _keyframe_before(info, index)
        target = info.frame_pts[index]
        try:
            if frames is None or key > position:
                container.seek(info.frame_pts[key], backward=True, any_frame=False, stream=stream)
                frames = container.decode(stream)
            for frame in frames:
                _check_cancelled(video)
                decoded += 1
                if decoded > budget:
                    raise InvalidVideoError(f"video {video.what}: decoding went past the limit of "
                                            f"{video.limits.max_decode_pixels:,} pixels (setting max_video_decode_pixels) "
                                            f"before reaching frame {index}; the file's keyframe index is unreliable")
                if frame.pts is None or frame.pts < target:
                    continue
                if frame.pts > target:
                    break  # the decoder skipped it (a broken reference): refused below
                position = index
                yield index, frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
                break
        except av.FFmpegError as exc:
            raise InvalidVideoError(f"video {video.what}: frame {index} could not be decoded; the data is corrupt or "
                                    f"truncated ({_reason(exc)})") from exc
        if position != index:
            raise InvalidVideoError(f"video {video.what}: frame {index} (of {info.num_frames}) could not be decoded; "
                                    f"the data is corrupt or truncated")


def _check_cancelled(video: OpenedVideo) -> None:
    if video.cancelled is not None and video.cancelled.is_set():
        raise DecodeCancelled(video.what)


def _keyframe_before(info: VideoInfo, index: int) -> int:
    at = bisect.bisect_right(info.keyframes, index) - 1
    return info.keyframes[at] if at >= 0 else 0


def _keyframe_gap(info: VideoInfo) -> int:
    return max(1, round(info.num_frames / max(len(info.keyframes), 1)))


# -- reading -------------------------------------------------------------------------------------

def _read_source(source: object, max_bytes: int) -> tuple[bytes | None, str | None, str]:
    """(bytes or None, a file path or None, a description of the source)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_bytes(len(data), max_bytes, f"{len(data)} bytes")
        return data, None, f"data of {len(data)} bytes starting {data[:16]!r}"
    if isinstance(source, os.PathLike):
        return _file(Path(os.fspath(source)), f"path {os.fspath(source)!r}", max_bytes)
    if isinstance(source, str):
        head = source[:16].lower()
        if head.startswith("data:"):
            try:
                data = _decode_data_url(source)
            except InvalidImageError as exc:
                raise InvalidVideoError(str(exc).replace("data:image/<type>", "data:video/<type>")) from None
            _check_bytes(len(data), max_bytes, f"data URL {_clip(source)!r}")
            return data, None, f"data URL {_clip(source)!r}"
        if head.startswith("file://"):
            try:
                path = _file_url_path(source)
            except InvalidImageError as exc:
                raise InvalidVideoError(str(exc)) from None
            return _file(path, f"file URL {_clip(source, 1024)!r}", max_bytes)
        if head.startswith(("http://", "https://")):
            raise InvalidVideoError(f"remote video URL {_clip(source)!r}: the engine does not fetch remote URLs. "
                                    f"Download the video yourself and pass it as {ACCEPTED_VIDEO_SOURCES}.")
        if "://" in head:
            raise InvalidVideoError(f"unsupported URL scheme in {_clip(source)!r}; accepted: {ACCEPTED_VIDEO_SOURCES}.")
        return _file(Path(source), f"path {_clip(source, 1024)!r}", max_bytes)
    raise InvalidVideoError(f"cannot read a video from a {type(source).__name__} ({_clip(repr(source))}); accepted: "
                            f"{ACCEPTED_VIDEO_SOURCES}.")


def _file(path: Path, what: str, max_bytes: int) -> tuple[None, str, str]:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise InvalidVideoError(f"video file not found: {what}; accepted: {ACCEPTED_VIDEO_SOURCES}.") from None
    except (OSError, ValueError) as exc:
        raise InvalidVideoError(f"cannot read video file {what}: {exc}") from None
    if path.is_dir():
        raise InvalidVideoError(f"{what} is a directory, not a video file.")
    _check_bytes(st.st_size, max_bytes, what)
    return None, str(path), what


def _check_bytes(size: int, max_bytes: int, what: str) -> None:
    if size == 0:
        raise InvalidVideoError(f"empty video data from {what}; accepted: {ACCEPTED_VIDEO_SOURCES}.")
    if size > max_bytes:
        raise InvalidVideoError(f"video from {what} is {size:,} bytes, over the limit of {max_bytes:,} bytes (setting "
                                f"max_video_bytes, flag --max-video-bytes); send a shorter or smaller video, or raise "
                                f"the setting.")


class _container:
    """`av.open` on the bytes or the path as a context manager, its failures as `InvalidVideoError`."""

    def __init__(self, data: bytes | None, path: str | None, what: str):
        self.data, self.path, self.what = data, path, what

    def __enter__(self):
        import av
        try:
            self.container = av.open(io.BytesIO(self.data) if self.data is not None else self.path,
                                     metadata_errors="ignore")
        except av.FFmpegError as exc:
            raise InvalidVideoError(f"cannot read a video container in video {self.what} ({_reason(exc)}); expected an MP4, "
                                    f"WebM, MKV, MOV, AVI or other file FFmpeg reads; accepted: "
                                    f"{ACCEPTED_VIDEO_SOURCES}.") from exc
        return self.container

    def __exit__(self, *exc):
        self.container.close()
        return False


def _video_stream(container, what: str):
    if container.format.name in _IMAGE_FORMATS or container.format.name.endswith("_pipe"):
        raise InvalidVideoError(f"{what} is an image ({container.format.name}), not a video; send it as an image part")
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise InvalidVideoError(f"{what} has no video stream (streams: {', '.join(kinds)}); send a file with video")
    stream = container.streams.video[0]
    context = stream.codec_context  # None when FFmpeg has no decoder for the track's codec
    if context is None or not context.is_decoder:
        raise InvalidVideoError(f"{what}: no decoder for its video codec "
                                f"({getattr(context, 'name', None) or 'unknown to FFmpeg'}); re-encode it as H.264, "
                                f"HEVC, VP9 or AV1")
    return stream


def _index(container, stream, what: str, limits: VideoLimits) -> VideoInfo:
    """The header checked against `limits`, then the packet index."""
    import av
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise InvalidVideoError(f"video {what} has zero size ({width}x{height}) in its header")
    tb = stream.time_base or Fraction(1, 1)
    header = _header_seconds(container, stream, tb)
    if header is not None and header > limits.max_seconds:
        _too_long(what, header, limits)
    pts, keys = [], []
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # the flush packet at the end
            stamp = packet.pts if packet.pts is not None else packet.dts
            if stamp is None:
                raise InvalidVideoError(f"video {what}: packet {len(pts)} has no timestamp; re-mux it into MP4 or MKV")
            pts.append(stamp)
            keys.append(bool(packet.is_keyframe))
            if len(pts) > MAX_INDEXED_FRAMES:
                raise InvalidVideoError(f"video {what} has more than {MAX_INDEXED_FRAMES:,} frames; send a shorter one")
    except av.FFmpegError as exc:
        if not pts:
            raise InvalidVideoError(f"video {what} is corrupt ({_reason(exc)})") from exc
        # a truncated file: the frames before the damage are indexed; decoding refuses a damaged one
    if not pts:
        raise InvalidVideoError(f"video {what} has no frames (a zero-length video)")
    order = sorted(range(len(pts)), key=lambda i: pts[i])  # decode order -> presentation order
    frame_pts = tuple(pts[i] for i in order)
    if len(set(frame_pts)) != len(frame_pts):
        raise InvalidVideoError(f"video {what}: two frames share one timestamp; re-mux it (e.g. ffmpeg -i in -c copy out.mp4)")
    keyframes = tuple(i for i, j in enumerate(order) if keys[j]) or (0,)
    seconds = _index_seconds(frame_pts, tb)
    if header is None and seconds > limits.max_seconds:
        _too_long(what, seconds, limits)
    fps = _average_fps(stream, len(frame_pts), header if header else seconds)
    return VideoInfo(width, height, len(frame_pts), fps, header if header else seconds,
                     stream.codec_context.name, frame_pts, keyframes)


def _header_seconds(container, stream, tb: Fraction) -> float | None:
    if stream.duration:
        return float(stream.duration * tb)
    if container.duration:
        return container.duration / 1_000_000  # av.time_base
    return None


def _index_seconds(frame_pts: tuple[int, ...], tb: Fraction) -> float:
    """From the first frame to one frame past the last (the mean frame gap), in seconds."""
    n = len(frame_pts)
    span = frame_pts[-1] - frame_pts[0]
    return float((span + (span / (n - 1) if n > 1 else 0)) * tb)


def _average_fps(stream, num_frames: int, seconds: float) -> float:
    """The stream's average frame rate as FFmpeg reports it (what decord and torchcodec's header give),
    else the index's frames per second."""
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate and float(rate) > 0 and math.isfinite(float(rate)):
            return float(rate)
    return num_frames / seconds if seconds > 0 else 1.0


def _too_long(what: str, seconds: float, limits: VideoLimits) -> None:
    raise InvalidVideoError(f"video {what} lasts {seconds:.1f} s, over the limit of {limits.max_seconds:g} s (setting "
                            f"max_video_seconds, flag --max-video-seconds); cut it, or raise the setting.")


def _open_frames(source, limits: VideoLimits, max_image_pixels: int, cancelled) -> OpenedVideo:
    """A list of frames as a video: each decoded now (they are images), one size for all."""
    if not source:
        raise InvalidVideoError("a video given as a list of frames needs at least one frame")
    if len(source) > limits.max_frames:
        raise InvalidVideoError(f"a video of {len(source)} frames is over the limit of {limits.max_frames} frames (setting "
                                f"max_video_frames, flag --max-video-frames); send fewer frames")
    frames = []
    for i, item in enumerate(source):
        if cancelled is not None and cancelled.is_set():
            raise DecodeCancelled(f"frame {i}")
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


def _reason(exc: Exception) -> str:
    text = without_reprs(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
