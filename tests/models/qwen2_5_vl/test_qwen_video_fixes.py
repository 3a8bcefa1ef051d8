"""Too-long video requests name the video part settings that make them fit (total_pixels, max_frames,
fps), each checked by applying it: the request then fits, and the next larger value does not. A video
that alone cannot fit is refused before any frame is decoded."""
from __future__ import annotations

import pytest

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InputTooLongError, InvalidVideoError
from vlm_sdk.testing.videos import write_video

CELL = 28 * 28


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("fix_videos")
    a, b = root / "a.mp4", root / "b.mp4"
    write_video(a, frames=96, fps=24, width=320, height=240)  # 4 s
    write_video(b, frames=60, fps=10, width=160, height=96)  # 6 s
    return str(a), str(b)


def conv(clips, **options) -> list[dict]:
    base = {"fps": 3.0, "min_pixels": 4 * CELL, "max_pixels": 40 * CELL}
    return [{"role": "user", "content": [{"type": "video", "video": clips[0], **base, **options},
                                         {"type": "text", "text": "and"},
                                         {"type": "video", "video": clips[1], **base, **options},
                                         {"type": "text", "text": "What happens in both?"}]}]


def test_fixes_name_video_settings_that_fit_and_are_the_largest(tiny_ckpt, clips):
    free = LLM(str(tiny_ckpt), show_progress=False)
    n = len(free.engine.inputs.build_prompt(conv(clips)).token_ids)
    limit = n - 40  # the prompt and max_tokens=20 do not fit; less video does
    llm = LLM(str(tiny_ckpt), max_model_len=limit, show_progress=False)
    params = SamplingParams(max_tokens=20)
    with pytest.raises(InputTooLongError) as info:
        llm.engine.inputs.build_prompt(conv(clips), params)
    err = info.value
    assert set(err.video_fixes) == {"total_pixels", "max_frames", "fps"}
    assert "on its video parts (set on every video part) makes it fit with its max_tokens=20" in str(err)

    def fits(**setting) -> bool:  # the prompt and its max_tokens, as the fixes are sized
        try:
            prompt = llm.engine.inputs.build_prompt(conv(clips, **setting), params)
        except InputTooLongError:
            return False
        return len(prompt.token_ids) + 20 <= limit
    for name, value in err.video_fixes.items():
        assert fits(**{name: value}), (name, value)
    assert not fits(total_pixels=err.video_fixes["total_pixels"] + 1)
    assert not any(fits(max_frames=m) for m in range(err.video_fixes["max_frames"] + 2, 40, 2))


def test_a_video_too_long_alone_is_refused_before_decoding(tiny_ckpt, clips):
    """Decoding it would have been refused too (max_video_decode_pixels of one frame): the size check
    comes first, so nothing was decoded."""
    llm = LLM(str(tiny_ckpt), max_model_len=300, max_video_decode_pixels=320 * 240, show_progress=False)
    one = [{"role": "user", "content": [{"type": "video", "video": clips[0]}, {"type": "text", "text": "Hi"}]}]
    with pytest.raises(InvalidVideoError, match=r"video 0 \(96 frames of 320x240 at 24 fps\) would be 8 frames of "
                                                r"392x280 = 560 tokens, more than the 300 one sequence may hold "
                                                r"\(max_model_len\); refused before decoding\. Any one of these on "
                                                r"the video part makes it fit: max_frames=4, fps=1\.0\."):
        llm.engine.inputs.build_prompt(one)
    for fix in ({"max_frames": 4}, {"fps": 1.0}):  # the video alone then fits (the text is the request's)
        fixed = [{"role": "user", "content": [{"type": "video", "video": clips[0], **fix}]}]
        assert sum(LLM(str(tiny_ckpt), show_progress=False).engine.inputs.build_prompt(fixed).image_tokens) <= 300


def test_the_largest_video_patch_is_the_profiled_vision_item(tiny_ckpt, clips):
    """The tiny checkpoint's images reach 256 tokens; a video frame up to qwen-vl-utils' 768: the memory
    profile and the tower's per-call cap take the video's patch, and a part asking larger frames is refused."""
    llm = LLM(str(tiny_ckpt), show_progress=False)
    largest = llm.engine.inputs.processor.largest_image()
    assert largest.meta.frames == 2 and largest.num_tokens == 768 and largest.size == 768 * 4
    huge = [{"role": "user", "content": [{"type": "video", "video": clips[0], "min_pixels": 1000 * CELL}]}]
    with pytest.raises(InvalidVideoError, match=r"tokens each, more than the 768 a video frame may have \(qwen-vl-utils' "
                                                r"largest, which the engine's memory plan counts\); lower the video "
                                                r"part's min_pixels"):
        llm.engine.inputs.build_prompt(huge)
