"""Short test videos written with PyAV (tests, the video benchmark, the samples): each frame carries its
own index, so that whoever decodes it can tell which frame it got whatever the codec did to it.

    left half:   12 horizontal bands, band k white when bit k of the frame index is set, else black
                 (read back by `frame_index`, robust to lossy coding and chroma subsampling)
    right half:  a colour texture that changes every frame (something for pixel comparisons to compare)

`write_video` takes a codec and container (libx264/mp4, libvpx-vp9/webm, hevc/mkv, mpeg4/avi, ...), a
constant rate or explicit timestamps (a variable frame rate), and the keyframe interval.
"""
from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import numpy as np

BITS = 12  # frames up to 4095 can be told apart


def frame_pixels(index: int, width: int, height: int) -> np.ndarray:  # [height, width, 3] uint8
    out = np.empty((height, width, 3), dtype=np.uint8)
    half = width // 2
    band = np.arange(height) * BITS // height  # [height] band of each row
    bits = ((index >> band) & 1).astype(np.uint8) * 255  # [height]
    out[:, :half] = bits[:, None, None]
    y, x = np.mgrid[0:height, 0:width - half]
    out[:, half:, 0] = (x * 7 + index * 11) % 256
    out[:, half:, 1] = (y * 5 + index * 3) % 256
    out[:, half:, 2] = ((x + y) * 3 + index * 29) % 256
    return out


def frame_index(frame: np.ndarray) -> int:
    """The index `frame_pixels` wrote into a decoded RGB frame [H, W, 3]."""
    height, width = frame.shape[:2]
    gray = frame[:, : width // 2].astype(np.float32).mean(axis=(1, 2))  # [H]
    band = np.arange(height) * BITS // height
    index = 0
    for k in range(BITS):
        rows = gray[band == k]
        inner = rows[len(rows) // 4: len(rows) - len(rows) // 4] if len(rows) >= 4 else rows  # away from the edges
        if inner.mean() > 127:
            index |= 1 << k
    return index


def write_video(path: str | Path | None = None, *, frames: int = 24, width: int = 64, height: int = 48,
                fps: float = 24, codec: str = "libx264", container: str = "mp4",
                timestamps_ms: list[int] | None = None, gop: int | None = None, pix_fmt: str = "yuv420p") -> bytes:
    """Write a video; returns its bytes (and writes them to `path` when given). `timestamps_ms` gives
    each frame's presentation time in milliseconds (a variable frame rate), else frames are 1/fps apart.
    `gop`: frames between keyframes (None: the encoder's default)."""
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        rate = Fraction(fps).limit_denominator(1001)
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if gop is not None:
            stream.codec_context.gop_size = gop
        if timestamps_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        out.start_encoding()  # the header even without frames: a zero-length video
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            if timestamps_ms is not None:
                frame.pts, frame.time_base = timestamps_ms[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = buf.getvalue()
    if path is not None:
        Path(path).write_bytes(data)
    return data
