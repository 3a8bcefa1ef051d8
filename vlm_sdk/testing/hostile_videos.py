"""Small files that would cost a video reader minutes or gigabytes (issue 41 rows 1, 2, 4 and 10), made
in well under a second each with PyAV, for the tests and `bench-serve --red-team`:

    png_mov        PNG frames in a MOV: 1-bit frames of zeros compress ~4000:1, so two 16000x16000 frames
                   are 63 KB; `header_side` writes another size into the container than the frames have
                   (a header that lies about its frames)
    many_frames    one tiny H.264 frame muxed n times at `fps`: a million frames in 14 MB (MP4, whose header
                   states the frame count) or 41 MB (Matroska, whose header does not); `keyframes=False`:
                   one keyframe, then copies of one predicted frame (12 bytes each), so that reaching the
                   last frame decodes every one
"""
from __future__ import annotations

import io
from fractions import Fraction


def png_mov(side: int, frames: int = 2, header_side: int | None = None, pix_fmt: str = "monob") -> bytes:
    """`frames` PNG frames of side x side (zeros) in a MOV whose header says `header_side` (default: side)."""
    import av
    enc = av.CodecContext.create("png", "w")
    enc.width = enc.height = side
    enc.pix_fmt = pix_fmt
    enc.time_base = Fraction(1, 1)
    frame = av.VideoFrame(side, side, pix_fmt)
    for plane in frame.planes:
        plane.update(bytes(plane.buffer_size))
    packets = []
    for i in range(frames):
        frame.pts = i
        packets += [bytes(p) for p in enc.encode(frame)]
    packets += [bytes(p) for p in enc.encode(None)]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mov") as out:
        stream = out.add_stream("png", rate=1)
        stream.width = stream.height = header_side or side
        stream.pix_fmt = pix_fmt
        for i, data in enumerate(packets):
            _mux(out, stream, data, i, Fraction(1, 1), True)
    return buf.getvalue()


def many_frames(n: int, *, fps: int = 30, container: str = "mp4", side: int = 16, keyframes: bool = True) -> bytes:
    """n frames of side x side at `fps` frames a second: each the same intra picture, or (`keyframes`
    False) one intra picture and then n - 1 copies of one "nothing changed" predicted picture."""
    import av
    import numpy as np
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        gop = "1" if keyframes else "infinite"
        stream.options = {"preset": "ultrafast", "tune": "zerolatency",
                          "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:ref=1"}
        picture = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")
        coded = [bytes(p) for _ in range(2) for p in stream.encode(picture)] + [bytes(p) for p in stream.encode()]
        # intra: the second IDR picture (the first carries the encoder's version text); else the
        # first (intra) and then the second (predicted from the one before, whichever that is)
        first, rest = (coded[1], coded[1]) if keyframes else (coded[0], coded[1])
        tb = Fraction(1, fps)
        for i in range(n):
            _mux(out, stream, rest if i else first, i, tb, keyframes or i == 0)
    return buf.getvalue()


def _mux(out, stream, data: bytes, i: int, time_base: Fraction, key: bool) -> None:
    import av
    packet = av.Packet(data)
    packet.stream = stream
    packet.pts = packet.dts = i
    packet.time_base = time_base
    packet.is_keyframe = key
    out.mux(packet)
