"""Which frames a video gives and at what size, against qwen-vl-utils' `fetch_video` itself (the
preprocessing Qwen2.5-VL and Qwen3-VL were published with; tests/qwen_vl_utils_oracle.py
says how it is run here): a sweep of fps / nframes / min and max frames / min, max and total pixels over
videos of several rates, lengths and sizes (a variable frame rate among them), at Qwen2.5-VL's patch 14
and Qwen3-VL's 16. Then the same for a video given as a list of frames, pixels included."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import qwen_vl_utils_oracle as oracle
from vlm_sdk.errors import InvalidVideoError
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor
from vlm_sdk.models.common.qwen_vl.video_processor import QwenVideoProcessor
from vlm_sdk.multimodal.video_io import open_video
from vlm_sdk.testing.videos import frame_index, frame_pixels, write_video

VFR_MS = [0, 30, 90, 100, 400, 420, 440, 800, 1000, 1500, 1510, 1520, 1530, 2000, 2100, 2900, 3000, 3100, 3300,
          3500, 3510, 3700, 3900, 4000]
VIDEOS = {
    "24fps-2s-96x64": dict(frames=48, fps=24, width=96, height=64),
    "29.97fps-6s-160x90": dict(frames=180, fps=30000 / 1001, width=160, height=90, gop=30),
    "10fps-12s-64x112": dict(frames=120, fps=10, width=64, height=112, codec="libvpx-vp9", container="webm"),
    "vfr-4s-80x48": dict(frames=len(VFR_MS), timestamps_ms=VFR_MS, width=80, height=48),
    "60fps-1s-320x180": dict(frames=60, fps=60, width=320, height=180),
}
CELL = 28 * 28
SETTINGS = [
    {},
    {"fps": 1.0},
    {"fps": 0.5},
    {"fps": 4.0, "max_frames": 10},
    {"fps": 3.0, "min_frames": 8},
    {"fps": 0.25, "min_frames": 6, "max_frames": 20},
    {"nframes": 7},
    {"nframes": 12},
    {"total_pixels": 40 * CELL},
    {"total_pixels": 400 * CELL, "fps": 6.0},
    {"max_pixels": 8 * CELL},
    {"min_pixels": 16 * CELL, "max_pixels": 24 * CELL},
    {"min_pixels": 2 * CELL},
]


@pytest.fixture(scope="module")
def video_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_videos")
    out = {}
    for name, kw in VIDEOS.items():
        path = root / f"{name}.{kw.get('container', 'mp4')}"
        write_video(path, **kw)
        out[name] = path
    return out


def _ours(path, patch: int, options: dict):
    processor = QwenVideoProcessor(Qwen2VLImageProcessor(patch_size=patch))
    return processor.sample(open_video(str(path)), options)


@pytest.mark.parametrize("patch", [14, 16])
@pytest.mark.parametrize("name", list(VIDEOS))
def test_frames_rate_and_size_equal_qwen_vl_utils(video_files, name, patch):
    compared = 0
    for options in SETTINGS:
        options = {k: (v // 784 * (2 * patch) ** 2 if k.endswith("pixels") else v) for k, v in options.items()}
        try:
            theirs = oracle.fetch(str(video_files[name]), patch, **options)
        except (ValueError, AssertionError) as exc:  # qwen-vl-utils refuses: so must we
            with pytest.raises(InvalidVideoError):
                _ours(video_files[name], patch, options)
            print(f"{name} {options}: both refuse ({exc})")
            continue
        ours = _ours(video_files[name], patch, options)
        assert list(ours.indices) == theirs["indices"], options
        assert ours.sample_fps == theirs["sample_fps"], options
        assert (len(ours.indices), 3, ours.height, ours.width) == theirs["shape"], options
        assert ours.times == tuple(i / theirs["fps"] for i in theirs["indices"]), options
        compared += 1
    assert compared >= len(SETTINGS) - 3  # qwen-vl-utils samples most of the sweep


def test_the_sampled_frames_are_the_ones_qwen_vl_utils_takes(video_files):
    """Decoded by PyAV here and by decord there: the same frames (each carries its index) at one size."""
    path = video_files["29.97fps-6s-160x90"]
    options = {"fps": 1.5, "total_pixels": 100 * CELL}
    theirs = oracle.fetch(str(path), 14, **options)
    processor = QwenVideoProcessor(Qwen2VLImageProcessor())
    video = open_video(str(path))
    sampling = processor.sample(video, options)
    frames = processor.frames(video, sampling)  # [n, h, w, 3] uint8
    assert frames.shape == (theirs["shape"][0], theirs["shape"][2], theirs["shape"][3], 3)
    assert [frame_index(f) for f in frames] == theirs["indices"]


def test_setting_errors_are_named(video_files):
    path = video_files["24fps-2s-96x64"]
    with pytest.raises(InvalidVideoError, match="fps or nframes, not both"):
        _ours(path, 14, {"fps": 1.0, "nframes": 4})
    with pytest.raises(InvalidVideoError, match=r"has 48 frames at 24 fps; with nframes=60 it would sample 60: ask "
                                                r"for 2 to 48 frames"):
        _ours(path, 14, {"nframes": 60})
    with pytest.raises(InvalidVideoError, match=r"max_pixels \(784\) is below min_pixels \(3136, set on the video "
                                                r"part\)"):
        _ours(path, 14, {"min_pixels": 3136, "max_pixels": 784})
    with pytest.raises(InvalidVideoError, match=r"max_pixels \(784\) is below min_pixels \(100352, the default, "
                                                r"128 tokens' pixels\); set min_pixels <= max_pixels"):
        _ours(path, 14, {"max_pixels": 784})


def test_a_list_of_frames_equals_qwen_vl_utils(tmp_path):
    """qwen-vl-utils resizes each frame as an image first (PIL bicubic, to multiples of twice the cell),
    pads to an even count with the last frame, then resizes as a video: sizes, rate and pixels equal."""
    vp = oracle.vision_process()
    frames = [Image.fromarray(frame_pixels(i, 150, 100)) for i in range(5)]
    processor = QwenVideoProcessor(Qwen2VLImageProcessor())
    compared = 0
    for options in ({}, {"sample_fps": 3.0}, {"max_pixels": 30 * CELL}, {"min_pixels": 40 * CELL},
                    {"min_pixels": 10 * CELL, "max_pixels": 30 * CELL}):
        try:
            (video, meta), sample_fps = vp.fetch_video({"type": "video", "video": frames, **options},
                                                       image_patch_size=14, return_video_sample_fps=True,
                                                       return_video_metadata=True)
        except (ValueError, AssertionError):  # qwen-vl-utils refuses: so must we
            with pytest.raises(InvalidVideoError):
                processor.sample(open_video(frames), options)
            continue
        opened = open_video(frames)
        sampling = processor.sample(opened, options)
        ours = processor.frames(opened, sampling)  # [6, h, w, 3]
        assert sampling.sample_fps == sample_fps
        assert ours.shape == (video.shape[0], video.shape[2], video.shape[3], 3)
        assert list(sampling.indices) == [0, 1, 2, 3, 4, 4]
        assert sampling.times == tuple(i / meta["fps"] for i in meta["frames_indices"])
        theirs = video.permute(0, 2, 3, 1).numpy()  # [6, h, w, 3] float of uint8 values
        assert np.array_equal(ours.astype(np.float32), theirs), options
        compared += 1
    assert compared == 4  # {"max_pixels": 30 * CELL} alone is refused by both (below the video min_pixels)
