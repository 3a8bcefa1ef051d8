"""open_video / iter_frames on videos written here with PyAV: several codecs, containers, frame rates,
sizes and a variable frame rate. Frame counts and rates equal decord's (another FFmpeg build, the reader
qwen-vl-utils uses); every decoded frame is the one asked for (each frame carries its index); only the
frames the sampled ones need are decoded; limits and bad input are `InvalidVideoError`s naming them."""
from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
from PIL import Image

from vlm_sdk.errors import InvalidVideoError
from vlm_sdk.multimodal.image_io import DecodeCancelled
from vlm_sdk.multimodal.video_io import MIN_FRAME_COST, VideoLimits, decode_plan, iter_frames, open_video
from vlm_sdk.testing.videos import frame_index, frame_pixels, write_video

# (name, write_video keywords): codecs x containers x rates x sizes, one variable frame rate
VFR_MS = [0, 40, 80, 200, 210, 220, 500, 600, 700, 705, 710, 900, 1000, 1100, 1300, 1301, 1400, 1500, 1600,
          1700, 1800, 1900, 2000, 2100, 2400, 2420, 2440, 2460, 2480, 2500]
VIDEOS = [
    ("h264-mp4-24fps", dict(codec="libx264", container="mp4", frames=48, fps=24, width=96, height=64)),
    ("h264-mp4-29.97fps-gop12", dict(codec="libx264", container="mp4", frames=90, fps=30000 / 1001, width=64,
                                     height=48, gop=12)),
    ("vp9-webm-15fps", dict(codec="libvpx-vp9", container="webm", frames=30, fps=15, width=80, height=48)),
    ("hevc-mkv-25fps", dict(codec="hevc", container="matroska", frames=40, fps=25, width=64, height=64)),
    ("mpeg4-avi-10fps", dict(codec="mpeg4", container="avi", frames=25, fps=10, width=112, height=48)),
    ("mjpeg-mov-12fps", dict(codec="mjpeg", container="mov", frames=20, fps=12, width=80, height=48,
                             pix_fmt="yuvj420p")),
    ("h264-mp4-vfr", dict(codec="libx264", container="mp4", frames=len(VFR_MS), timestamps_ms=VFR_MS,
                          width=64, height=48)),
]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for name, kw in VIDEOS:
        ext = {"matroska": "mkv"}.get(kw["container"], kw["container"])
        path = root / f"{name}.{ext}"
        write_video(path, **kw)
        out[name] = path
    return out


@pytest.mark.parametrize("name", [n for n, _ in VIDEOS])
def test_frames_and_rate_equal_decords_and_each_frame_is_the_one_asked_for(videos, name):
    import decord
    path = videos[name]
    video = open_video(str(path))
    reader = decord.VideoReader(str(path))
    assert video.info.num_frames == len(reader)
    assert video.info.fps == pytest.approx(reader.get_avg_fps(), rel=1e-9)
    n = video.info.num_frames
    indices = sorted({0, 1, n // 3, n // 2, n - 2, n - 1})
    got = list(iter_frames(video, indices))
    assert [i for i, _ in got] == indices
    assert [frame_index(f) for _, f in got] == indices  # the frames asked for, not their neighbours
    theirs = reader.get_batch(indices).asnumpy()  # [k, H, W, 3]
    for (i, frame), ref in zip(got, theirs):
        assert frame.shape == ref.shape == (video.info.height, video.info.width, 3)
        assert frame.dtype == np.uint8
        assert frame_index(ref) == i  # decord agrees on which frame index i is


def test_every_source_type_gives_the_same_video(videos, tmp_path):
    path = videos["h264-mp4-24fps"]
    data = path.read_bytes()
    sources = {"str": str(path), "Path": path, "bytes": data, "bytearray": bytearray(data),
               "file URL": path.as_uri(),
               "data URL": "data:video/mp4;base64," + base64.b64encode(data).decode()}
    ref = [f for _, f in iter_frames(open_video(str(path)), [0, 10, 47])]
    for name, source in sources.items():
        frames = [f for _, f in iter_frames(open_video(source), [0, 10, 47])]
        assert all(np.array_equal(a, b) for a, b in zip(frames, ref)), name


def test_only_the_frames_before_each_sampled_one_are_decoded(videos):
    """90 frames, a keyframe every 12: reaching 4 spread frames decodes from the keyframe before each."""
    video = open_video(str(videos["h264-mp4-29.97fps-gop12"]))
    keys = video.info.keyframes
    assert len(keys) >= 6 and keys[0] == 0
    wanted = [5, 40, 41, 80]
    expected = 0
    position = -1
    for i in wanted:
        key = max(k for k in keys if k <= i)
        start = position + 1 if key <= position else key
        expected += i - start + 1
        position = i
    assert decode_plan(video, wanted) == expected < video.info.num_frames
    assert [frame_index(f) for _, f in iter_frames(video, wanted)] == wanted


def test_a_list_of_frames_is_a_video():
    frames = [Image.fromarray(frame_pixels(i, 40, 30)) for i in range(5)]
    video = open_video(frames)
    assert (video.info.num_frames, video.info.width, video.info.height) == (5, 40, 30)
    assert [i for i, _ in iter_frames(video, [0, 4, 4])] == [0, 4]
    with pytest.raises(InvalidVideoError, match="frame 1 of the video is 41x30 but frame 0 is 40x30"):
        open_video([frames[0], Image.new("RGB", (41, 30))])
    with pytest.raises(InvalidVideoError, match="frame 1 of the video"):
        open_video([frames[0], b"not an image"])


def test_limits_are_named_before_decoding(videos):
    path = str(videos["h264-mp4-24fps"])  # 48 frames, 2 s, 96x64
    size = videos["h264-mp4-24fps"].stat().st_size
    with pytest.raises(InvalidVideoError, match=rf"{size:,} bytes, over the limit of 1,000 bytes \(setting "
                                                r"max_video_bytes, flag --max-video-bytes\)"):
        open_video(path, VideoLimits(max_bytes=1000))
    with pytest.raises(InvalidVideoError, match=r"lasts 2\.0 s, over the limit of 1\.5 s \(setting max_video_seconds"):
        open_video(path, VideoLimits(max_seconds=1.5))
    video = open_video(path, VideoLimits(max_decode_pixels=MIN_FRAME_COST * 10))
    with pytest.raises(InvalidVideoError, match=r"would need 48 frames decoded = 3,145,728 pixels \(each frame counted "
                                                r"as at least 65,536 pixels: decoding a frame has a fixed cost\) .* over "
                                                r"the limit of 655,360 \(setting max_video_decode_pixels"):
        decode_plan(video, [0, 47])  # 96x64 frames: each counted as 256x256
    with pytest.raises(InvalidVideoError, match=r"12 frames sampled, over the limit of 8 \(setting max_video_frames"):
        decode_plan(open_video(path, VideoLimits(max_frames=8)), list(range(0, 48, 4)))


def _audio_only() -> bytes:
    import io

    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _unknown_codec() -> bytes:
    """An MKV whose video track names a codec FFmpeg does not know (its CodecID rewritten)."""
    data = write_video(frames=4, codec="ffv1", container="matroska")
    assert data.count(b"V_FFV1") == 1
    return data.replace(b"V_FFV1", b"V_QQQQ")


def _zero_frames() -> bytes:
    return write_video(frames=0)


@pytest.mark.parametrize("name, make, message", [
    ("random bytes", lambda v: bytes(range(256)) * 64, "cannot read a video container"),
    ("truncated mp4", lambda v: v["h264-mp4-24fps"].read_bytes()[:3000], "cannot read a video container|corrupt"),
    ("png image", lambda v: _png(), "is an image .*, not a video; send it as an image part"),
    ("audio only", lambda v: _audio_only(), r"has no video stream \(streams: audio\)"),
    ("zero frames", lambda v: _zero_frames(), "has no video stream|has no frames"),  # FFmpeg: no stream
    ("unknown codec", lambda v: _unknown_codec(), "no decoder for its video codec"),
    ("empty", lambda v: b"", "empty video data"),
    ("missing file", lambda v: "/nonexistent/video.mp4", "video file not found"),
    ("http URL", lambda v: "https://example.com/v.mp4", "does not fetch remote URLs"),
    ("number", lambda v: 42, "cannot read a video from a int"),
])
def test_bad_input_is_a_typed_error(videos, name, make, message):
    with pytest.raises(InvalidVideoError, match=message):
        video = open_video(make(videos))
        list(iter_frames(video, [0, video.info.num_frames - 1]))


def test_a_truncated_tail_refuses_the_frames_it_lost(videos):
    """An MKV cut short keeps its header: the frames before the cut decode, a lost one is refused."""
    data = videos["hevc-mkv-25fps"].read_bytes()
    video = open_video(data[: len(data) * 2 // 3])
    assert 0 < video.info.num_frames < 40
    assert [frame_index(f) for _, f in iter_frames(video, [0])] == [0]
    with pytest.raises(InvalidVideoError, match="out of range"):
        decode_plan(video, [39])


def test_cancelled_request_stops_between_frames(videos):
    cancelled = threading.Event()
    video = open_video(str(videos["h264-mp4-24fps"]), cancelled=cancelled)
    frames = iter_frames(video, [0, 20, 40])
    next(frames)
    cancelled.set()
    with pytest.raises(DecodeCancelled):
        next(frames)


def _png() -> bytes:
    import io
    buf = io.BytesIO()
    Image.fromarray(frame_pixels(0, 32, 32)).save(buf, format="PNG")
    return buf.getvalue()
