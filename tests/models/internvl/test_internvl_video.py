"""InternVL video on the tiny checkpoints (both layouts), transformers as the oracle: the frames are the
model card's `get_index` (its load_video, written out below from the card) of the video's frames as decord
counts them; the prompt ids and greedy tokens equal transformers' InternVL on the same frames given as
"Frame{i}: " + one-tile images (what its processor makes of a video); chunked prefill through the
frames changes no token."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.models.internvl.video import segment_indices
from vlm_sdk.multimodal.video_io import iter_frames, open_video
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.reference import hf_greedy
from vlm_sdk.testing.videos import frame_index, write_video

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def card_get_index(bound, fps, max_frame, first_idx=0, num_segments=32):
    """InternVL's model card (e.g. OpenGVLab/InternVL3-1B README, "video multi-round conversation")."""
    if bound:
        start, end = bound[0], bound[1]
    else:
        start, end = -100000, 100000
    start_idx = max(first_idx, round(start * fps))
    end_idx = min(round(end * fps), max_frame)
    seg_size = float(end_idx - start_idx) / num_segments
    return np.array([int(start_idx + (seg_size / 2) + np.round(seg_size * idx)) for idx in range(num_segments)])


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = tmp_path_factory.mktemp("internvl_video") / "v.mp4"
    write_video(path, frames=45, fps=15, width=96, height=64)
    return str(path)


def test_frames_are_the_model_cards(tmp_path):
    import decord
    for frames, fps, segments in ((45, 15, 8), (30, 24, 4), (5, 10, 8), (100, 29.97, 16), (9, 30, 8)):
        path = str(tmp_path / f"{frames}.mp4")
        write_video(path, frames=frames, fps=fps, width=64, height=48)
        reader = decord.VideoReader(path)
        expected = card_get_index(None, float(reader.get_avg_fps()), len(reader) - 1, num_segments=segments)
        ours = segment_indices(open_video(path).info.num_frames, segments)
        assert ours == expected.tolist()
        got = [frame_index(f) for _, f in iter_frames(open_video(path), ours)]
        assert got == sorted(set(ours))  # decoded: the frames those indices name


def _as_frames(video: str, max_frames: int, question: str) -> list[dict]:
    """The same conversation transformers' way: the frames as one-tile images after "Frame{i}: "."""
    opened = open_video(video)
    indices = segment_indices(opened.info.num_frames, max_frames)
    decoded = dict(iter_frames(opened, indices))
    parts = []
    for i, index in enumerate(indices):
        parts += [{"type": "text", "text": f"Frame{i + 1}: "},
                  {"type": "image", "image": Image.fromarray(decoded[index]), "max_num": 1}]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


@pytest.mark.parametrize("layout", ["hf", "original"])
def test_greedy_tokens_equal_transformers_generate(video, layout, internvl_ckpt, internvl_original_ckpt):
    from transformers import AutoConfig, AutoTokenizer
    ref = fixtures("internvl").reference
    ckpt = str(internvl_ckpt if layout == "hf" else internvl_original_ckpt)
    llm = LLM(ckpt, show_progress=False)
    conv = [{"role": "user", "content": [{"type": "video", "video": video, "max_frames": 4},
                                         {"type": "text", "text": "What happens?"}]}]
    ours = llm.chat(conv, GREEDY)[0]
    hf_ckpt = str(internvl_ckpt)  # the same weights; transformers reads the -hf layout
    inputs = ref.hf_prompt(AutoTokenizer.from_pretrained(hf_ckpt), ref.hf_image_processor(hf_ckpt),
                           AutoConfig.from_pretrained(hf_ckpt), _as_frames(video, 4, "What happens?"))
    if layout == "hf":
        assert ours.prompt_token_ids == inputs["input_ids"][0].tolist()
    theirs = hf_greedy(ref.hf_model(hf_ckpt), {**inputs, "attention_mask": inputs["input_ids"] * 0 + 1}, 10)[0]
    assert len(set(theirs)) > 3
    assert ours.token_ids == theirs
    chunked = LLM(ckpt, max_num_batched_tokens=100, show_progress=False)
    assert chunked.chat(conv, GREEDY)[0].token_ids == theirs


def test_default_is_eight_frames_and_settings_are_checked(video, internvl_ckpt):
    llm = LLM(str(internvl_ckpt), show_progress=False)
    prompt = llm.engine.inputs.build_prompt([{"role": "user", "content": [{"type": "video", "video": video}]}])
    assert len(prompt.images) == 8 and all(im.data.shape[0] == 1 for im in prompt.images)
    with pytest.raises(InvalidRequestError, match="fps is not a video setting of InternVL"):
        llm.engine.inputs.build_prompt([{"role": "user", "content": [{"type": "video", "video": video, "fps": 2.0}]}])


def test_too_long_videos_name_max_frames(video, internvl_ckpt):
    from vlm_sdk.errors import InputTooLongError, InvalidVideoError
    per_frame = LLM(str(internvl_ckpt), show_progress=False).engine.inputs.processor.tokens_per_tile
    llm = LLM(str(internvl_ckpt), max_model_len=5 * per_frame, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InvalidVideoError, match=rf"video 0: 8 frames of {per_frame} tokens are {8 * per_frame} "
                                                rf"tokens, more than the {5 * per_frame} .*max_frames to at most 5"):
        llm.engine.inputs.build_prompt([{"role": "user", "content": [{"type": "video", "video": video}]}])
    two = [{"role": "user", "content": [{"type": "video", "video": video, "max_frames": 4},
                                        {"type": "video", "video": video, "max_frames": 4}]}]
    with pytest.raises(InputTooLongError) as info:
        llm.engine.inputs.build_prompt(two, SamplingParams(max_tokens=8))
    m = info.value.video_fixes["max_frames"]
    fixed = [{"role": "user", "content": [{"type": "video", "video": video, "max_frames": m}] * 2}]
    assert len(llm.engine.inputs.build_prompt(fixed).token_ids) + 8 <= 5 * per_frame
    more = [{"role": "user", "content": [{"type": "video", "video": video, "max_frames": m + 1}] * 2}]
    with pytest.raises(InputTooLongError):
        llm.engine.inputs.build_prompt(more, SamplingParams(max_tokens=8))
