"""A video's container opened and indexed without decoding a frame, and every read of it cancellable
(PyAV over FFmpeg's demuxers); `video_io.py` builds on it.

    read_source      the bytes, file or data: URL, its size checked (max_video_bytes)
    open_container   av.open over a `_Reader`, with the format context's `codec_whitelist` naming no
                     decoder, so that opening decodes nothing (below), to index and to decode alike
    check_header     the header's frame size (max_image_pixels: a frame is an image), duration
                     (max_video_seconds) and frame count (max_video_container_frames), before any packet
    index_packets    every video packet's timestamp and keyframe flag (demuxed, not decoded), bounded by
                     the frame count and duration limits as it goes, the request's cancellation checked

Why the whitelist: av.open always runs `avformat_find_stream_info`, which opens a decoder and decodes
packets until it knows the pixel format and, for H.264, the reorder delay (FFmpeg's libavformat/demux.c,
`try_decode_frame`): a 16000x16000 PNG frame in a MOV was decoded there, before anything could look at
its size. With `codec_whitelist` set on the format context, `avcodec_open2` refuses every decoder there,
the stream is marked as having none (`found_decoder < 0`), `has_codec_parameters` then asks only for the
size, and the stream info is what the header and the packets' timestamps say. PyAV's own codec context,
which decodes later, is not bound by it; it is opened with `max_pixels` (`decoder_options`), so that a
frame larger than its header says is refused by the decoder before its buffer is allocated.

Why the reader: FFmpeg reads through PyAV's Python file callbacks; a read after the request's
`cancelled` is set returns nothing, which FFmpeg takes as the end of the file, so whatever it was doing
(the header, the stream probe, the packet index, a decode) stops at its next read, and the caller raises
`DecodeCancelled`. An exception raised inside the callback would be stashed by PyAV and could surface in
an unrelated later call; an end of file cannot.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import threading
import time
from fractions import Fraction
from pathlib import Path

from vlm_sdk.errors import InvalidImageError, InvalidVideoError, without_reprs
from vlm_sdk.multimodal.image_io import DecodeCancelled, _clip, _decode_data_url, _file_url_path

ACCEPTED_VIDEO_SOURCES = ("a filesystem path (str or pathlib.Path), raw video bytes, a base64 data URL "
                          "('data:video/mp4;base64,...'), a 'file://' URL, or a list of frames (PIL images, "
                          "paths or bytes of images)")
# FFmpeg opens a lone image as a one-frame "video"; such a source belongs in an image part
_IMAGE_FORMATS = ("image2", "image2pipe")
# a decoder name that no decoder has: avformat_find_stream_info may open none (see the docstring)
_NO_DECODER = {"codec_whitelist": "none"}
_CHECK_EVERY = 256  # packets indexed between two looks at the limits and the cancellation
# A loop over packets or frames holds the GIL between its FFmpeg calls, which let it go for a moment
# and take it back before a waiting thread can be woken: the engine thread, which takes the GIL back
# after each of the dozens of torch calls of a step, then waits up to CPython's switch interval (5 ms)
# at each: a victim stream stalled 0.7-1.0 s beside an index of 216,000 packets (2 s in issue 41).
# `GilPacer` hands the GIL over with a real sleep once per PACE_S of such a loop (as server/logprobs.py's
# BODY_PAUSE_S does for a body's writer): the loop runs ~10% longer, the engine waits about PACE_S a call.
GIL_PAUSE_S = 1e-4
PACE_S = 1e-3
# FFmpeg checks a frame's buffer against max_pixels, its width rounded up to the stride alignment (up
# to 64) and codecs code in blocks (16 or 64 pixels): the header's size with this much room on each
# side, and never below _DECODER_FLOOR (MPEG-4 part 2 asks for 53,760 at any frame size below ~230x230)
_ALIGN_ROOM = 128
_DECODER_FLOOR = 1 << 20


class GilPacer:
    """Call it once per packet or frame: every PACE_S since the last pause, it sleeps GIL_PAUSE_S."""

    def __init__(self):
        self.last = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= PACE_S:
            time.sleep(GIL_PAUSE_S)
            self.last = time.monotonic()


def check_cancelled(cancelled: threading.Event | None, what: str) -> None:
    if cancelled is not None and cancelled.is_set():
        raise DecodeCancelled(what)


def reason(exc: Exception) -> str:
    text = without_reprs(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- reading the source ---------------------------------------------------------------------------

def read_source(source: object, max_bytes: int) -> tuple[bytes | None, str | None, str]:
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


class _Reader:
    """The file object FFmpeg reads the video through (PyAV calls read, seek and tell): nothing more is
    read once `cancelled` is set (see the module docstring)."""

    def __init__(self, raw, cancelled: threading.Event | None):
        self.raw, self.cancelled = raw, cancelled

    def read(self, size: int = -1) -> bytes:
        if self.cancelled is not None and self.cancelled.is_set():
            return b""
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


@contextlib.contextmanager
def open_container(data: bytes | None, path: str | None, what: str, cancelled: threading.Event | None):
    """The container of the bytes or the file, opened with no decoder allowed in its stream probe;
    `InvalidVideoError` when FFmpeg cannot read it, `DecodeCancelled` once `cancelled` is set."""
    import av
    try:
        raw = io.BytesIO(data) if data is not None else open(path, "rb")  # closed below
    except OSError as exc:
        raise InvalidVideoError(f"cannot read video file {what}: {exc}") from None
    try:
        try:
            container = av.open(_Reader(raw, cancelled), metadata_errors="ignore", container_options=_NO_DECODER)
        except av.FFmpegError as exc:
            check_cancelled(cancelled, what)
            raise InvalidVideoError(f"cannot read a video container in video {what} ({reason(exc)}); expected an MP4, "
                                    f"WebM, MKV, MOV, AVI or other file FFmpeg reads; accepted: "
                                    f"{ACCEPTED_VIDEO_SOURCES}.") from exc
        try:
            check_cancelled(cancelled, what)  # a read cut short by the cancellation reads as a short file
            yield container
        finally:
            container.close()
    finally:
        raw.close()


def video_stream(container, what: str):
    """The first video stream, with a decoder."""
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


def decoder_options(width: int, height: int) -> dict[str, str]:
    """The decoder's options: no frame much larger than the header's (FFmpeg's max_pixels, checked
    when the decoder learns a frame's size, before it allocates the frame)."""
    return {"max_pixels": str(max((width + _ALIGN_ROOM) * (height + _ALIGN_ROOM), _DECODER_FLOOR))}


# -- the header and the packet index -------------------------------------------------------------

def check_header(container, stream, what: str, limits, max_frame_pixels: int) -> float | None:
    """Refuse from the header alone what it shows is over a limit: the frame size, the duration, the
    frame count (when the container states them). Returns the header's duration in seconds, if any."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise InvalidVideoError(f"video {what} has zero size ({width}x{height}) in its header")
    if width * height > max_frame_pixels:
        raise InvalidVideoError(
            f"video {what}: its frames are {width}x{height} = {width * height:,} pixels (from its header), over the "
            f"limit of {max_frame_pixels:,} pixels per frame (setting max_image_pixels, flag --max-image-pixels: a "
            f"video frame is an image); send a smaller video, or raise the setting.")
    header = header_seconds(container, stream)
    if header is not None and header > limits.max_seconds:
        too_long(what, header, limits)
    if stream.frames and stream.frames > limits.max_container_frames:
        too_many_frames(what, f"{stream.frames:,} frames (from its header)", limits)
    return header


def index_packets(container, stream, what: str, limits,
                  cancelled: threading.Event | None) -> tuple[list[int], list[bool]]:
    """(timestamp, keyframe flag) of every video packet in decode order; refused once there are more
    than max_video_container_frames or they span more than max_video_seconds, and stopped once the
    request is cancelled (a look every `_CHECK_EVERY` packets)."""
    import av
    tb = stream.time_base or Fraction(1, 1)
    span_limit = limits.max_seconds / float(tb)  # in time-base ticks
    pts, keys = [], []
    low = high = None
    pace = GilPacer()
    try:
        for packet in container.demux(stream):
            pace()
            if packet.size == 0:
                continue  # the flush packet at the end
            stamp = packet.pts if packet.pts is not None else packet.dts
            if stamp is None:
                raise InvalidVideoError(f"video {what}: packet {len(pts)} has no timestamp; re-mux it into MP4 or MKV")
            pts.append(stamp)
            keys.append(bool(packet.is_keyframe))
            low, high = (stamp, stamp) if low is None else (min(low, stamp), max(high, stamp))
            if len(pts) % _CHECK_EVERY == 0:
                check_cancelled(cancelled, what)
                if len(pts) > limits.max_container_frames:
                    too_many_frames(what, f"more than {limits.max_container_frames:,} frames", limits)
                if high - low > span_limit:
                    too_long(what, float((high - low) * tb), limits, " at least")
    except av.FFmpegError as exc:
        check_cancelled(cancelled, what)
        if not pts:
            raise InvalidVideoError(f"video {what} is corrupt ({reason(exc)})") from exc
        # a truncated file: the frames before the damage are indexed; decoding refuses a damaged one
    check_cancelled(cancelled, what)  # the reads ended early: not the end of the file
    if len(pts) > limits.max_container_frames:
        too_many_frames(what, f"{len(pts):,} frames", limits)
    return pts, keys


def header_seconds(container, stream) -> float | None:
    if stream.duration:
        return float(stream.duration * (stream.time_base or Fraction(1, 1)))
    if container.duration:
        return container.duration / 1_000_000  # av.time_base
    return None


def average_fps(stream, num_frames: int, seconds: float) -> float:
    """The stream's average frame rate as FFmpeg reports it (what decord and torchcodec's header give),
    else the index's frames per second."""
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate and float(rate) > 0 and math.isfinite(float(rate)):
            return float(rate)
    return num_frames / seconds if seconds > 0 else 1.0


def too_long(what: str, seconds: float, limits, qualifier: str = "") -> None:
    raise InvalidVideoError(f"video {what} lasts{qualifier} {seconds:.1f} s, over the limit of {limits.max_seconds:g} s "
                            f"(setting max_video_seconds, flag --max-video-seconds); cut it, or raise the setting.")


def too_many_frames(what: str, count: str, limits) -> None:
    raise InvalidVideoError(
        f"video {what} has {count}, over the limit of {limits.max_container_frames:,} frames per video (setting "
        f"max_video_container_frames, flag --max-video-container-frames: every frame is indexed, whichever are "
        f"sampled); send a shorter video or one at a lower frame rate, or raise the setting.")
