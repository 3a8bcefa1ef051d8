"""What a video may cost, bounded before decoding (issue 41 point 1): every frame's size is read from the
container header and checked against max_image_pixels before a frame is decoded (FFmpeg's stream
probe decodes nothing: a header that lies about its frames keeps its own size), the decoder refuses
frames larger than the header said, the container's frame count and duration are refused from the
header where it states them and as the packets are indexed otherwise, and the decode budget counts a
tiny frame as a 256x256 one. The hostile files are made here (vlm_sdk/testing/hostile_videos.py)."""
from __future__ import annotations

import io

import pytest

from vlm_sdk.errors import InvalidVideoError
from vlm_sdk.multimodal.image_io import DecodeCancelled
from vlm_sdk.multimodal.video_io import MIN_FRAME_COST, VideoLimits, decode_plan, iter_frames, open_video
from vlm_sdk.testing.hostile_videos import many_frames, png_mov
from vlm_sdk.testing.videos import write_video


def test_frames_over_max_image_pixels_are_refused_from_the_header():
    data = png_mov(8000)  # two 8000x8000 frames, 16 KB
    assert len(data) < 100_000
    with pytest.raises(InvalidVideoError, match=r"its frames are 8000x8000 = 64,000,000 pixels \(from its header\), "
                                                r"over the limit of 16,777,216 pixels per frame \(setting "
                                                r"max_image_pixels, flag --max-image-pixels"):
        open_video(data, max_image_pixels=16_777_216)


def test_opening_decodes_no_frame():
    """The container says 64x64, its frames are 2000x2000. FFmpeg's own probe (a plain av.open)
    decodes a frame and reports the frame's size; ours reports the header's: nothing was decoded.
    Decoding then refuses the frame: the decoder was told the header's size."""
    import av
    data = png_mov(2000, header_side=64)
    with av.open(io.BytesIO(data)) as plain:
        assert plain.streams.video[0].codec_context.width == 2000  # what decoding a frame tells
    video = open_video(data, max_image_pixels=100 * 100)
    assert (video.info.width, video.info.height, video.info.num_frames) == (64, 64, 2)
    with pytest.raises(InvalidVideoError, match="frame 0 could not be decoded; .* or its frames are larger than its "
                                                "header's 64x64"):
        list(iter_frames(video, [0]))


def test_a_frame_a_little_larger_than_its_header_is_refused():
    """Within the decoder's room for alignment (the header's size + 128 a side): decoded, then refused."""
    video = open_video(png_mov(100, header_side=64))
    with pytest.raises(InvalidVideoError, match="a frame is 100x100, larger than the 64x64 its header says"):
        list(iter_frames(video, [0]))


def test_the_container_frame_count_is_refused_from_the_header():
    data = many_frames(3000, fps=1000)  # MP4: the header states 3,000 frames (3 s)
    limits = VideoLimits(max_container_frames=1000)
    with pytest.raises(InvalidVideoError, match=r"has 3,000 frames \(from its header\), over the limit of 1,000 frames "
                                                r"per video \(setting max_video_container_frames, flag "
                                                r"--max-video-container-frames: every frame is indexed"):
        open_video(data, limits)
    video = open_video(data, VideoLimits(max_container_frames=3000))
    assert video.info.num_frames == 3000


def test_without_a_header_count_indexing_stops_at_the_limit():
    data = many_frames(3000, fps=1000, container="matroska")  # Matroska states no frame count
    with pytest.raises(InvalidVideoError, match=r"has more than 1,000 frames, over the limit of 1,000 frames per video "
                                                r"\(setting max_video_container_frames"):
        open_video(data, VideoLimits(max_container_frames=1000))


def test_a_length_refusal_comes_from_the_header():
    """4,000 frames at 1 fps: 4,000 s. The header says so; no packet is indexed (with a limit of 10
    frames on the index, the refusal is still the duration's)."""
    data = many_frames(4000, fps=1)
    with pytest.raises(InvalidVideoError, match=r"lasts 4000\.0 s, over the limit of 3600 s \(setting max_video_seconds"):
        open_video(data, VideoLimits(max_container_frames=10 ** 6))
    with pytest.raises(InvalidVideoError, match=r"lasts 4000\.0 s"):
        open_video(data, VideoLimits(max_container_frames=10))


def test_tiny_frames_count_as_256x256_in_the_decode_budget():
    """2,000 16x16 frames, a keyframe only at the start: reaching the last decodes all of them, 512,000
    pixels at their size but 2,000 x 65,536 as the budget counts them."""
    video = open_video(many_frames(2000, keyframes=False), VideoLimits(max_decode_pixels=1000 * MIN_FRAME_COST))
    assert video.info.keyframes == (0,)
    with pytest.raises(InvalidVideoError, match=r"would need 2,000 frames decoded = 131,072,000 pixels \(each frame "
                                                r"counted as at least 65,536 pixels: decoding a frame has a fixed "
                                                r"cost\) .* over the limit of 65,536,000 \(setting "
                                                r"max_video_decode_pixels"):
        decode_plan(video, [0, 1999])
    assert decode_plan(video, [0, 999]) == 1000
    assert [i for i, _ in iter_frames(video, [0, 999])] == [0, 999]


class _Trips:
    """A cancellation event that reads as set from its `after`-th look on (None: never): a client that
    hangs up in the middle of a phase. `looks` counts how often it was asked."""

    def __init__(self, after: int | None = None):
        self.after, self.looks = after, 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.after is not None and self.looks > self.after


# looks after the hang-up before DecodeCancelled: the one that saw it, and FFmpeg's retries of a read
# that returned nothing
_AFTER = 5


def _phases(exc: BaseException) -> set[str]:
    tb, names = exc.__traceback__, set()
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


@pytest.mark.parametrize("source", ["bytes", "path"])
def test_a_cancelled_request_stops_in_the_container_open(tmp_path, source):
    """Cancelled before the open, or after its first or second read (an MP4 of 20,000 frames: its header,
    at the end, takes several reads): DecodeCancelled, never an InvalidVideoError about a container cut
    short."""
    data = many_frames(20_000)
    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    src = data if source == "bytes" else str(path)
    for after in (0, 1, 2):
        cancelled = _Trips(after)
        with pytest.raises(DecodeCancelled) as info:
            open_video(src, cancelled=cancelled)
        assert "open_container" in _phases(info.value)
        assert cancelled.looks <= after + _AFTER  # it stopped at once: FFmpeg asks a few times, reading nothing


def test_a_cancelled_request_stops_while_indexing():
    """20,000 packets (Matroska: indexed one by one, looked at every 256 packets and at every read),
    cancelled half-way through its looks: it stops in the index, at the next look."""
    data = many_frames(20_000, fps=1000, container="matroska")
    whole = _Trips()
    assert open_video(data, cancelled=whole).info.num_frames == 20_000
    assert whole.looks > 20_000 // 256
    cancelled = _Trips(whole.looks // 2)
    with pytest.raises(DecodeCancelled) as info:
        open_video(data, cancelled=cancelled)
    assert "index_packets" in _phases(info.value)
    assert cancelled.looks <= whole.looks // 2 + _AFTER


def test_a_cancelled_request_stops_while_decoding():
    """3,000 frames, a keyframe only at the start: reaching the last decodes all of them; cancelled 50
    looks into the decode (a look at every frame and every read), it stops at the next."""
    data = many_frames(3000, keyframes=False)
    opening = _Trips()
    open_video(data, cancelled=opening)
    cancelled = _Trips(opening.looks + 50)
    video = open_video(data, cancelled=cancelled)
    with pytest.raises(DecodeCancelled) as info:
        list(iter_frames(video, [2999]))
    assert "_decode" in _phases(info.value)
    assert cancelled.looks <= opening.looks + 50 + _AFTER
