"""mrope_positions against transformers' Qwen2_5_VLModel.get_rope_index."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

from vlm_sdk.models.common.qwen_vl.rope_index import mrope_positions

IMG, VSTART, VEND = 500, 501, 502
MERGE = 2


@pytest.fixture(scope="module")
def hf_model() -> Qwen2_5_VLModel:
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
                         bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=16,
                           fullatt_block_indexes=[0], spatial_merge_size=MERGE),
        image_token_id=IMG, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    return Qwen2_5_VLModel(cfg).eval()


def image_block(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [VSTART] + [IMG] * (t * h * w // MERGE ** 2) + [VEND]


def reference(model, ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    mm = (input_ids == IMG).int()
    if not grids:  # get_rope_index wants a vision sequence; text-only positions are consecutive
        return torch.arange(len(ids)).expand(3, -1), 0
    pos, delta = model.get_rope_index(input_ids, mm_token_type_ids=mm, image_grid_thw=torch.tensor(grids))
    return pos[:, 0], int(delta.item())


CASES = {
    "text_only": ([1, 2, 3, 4, 5, 6, 7], []),
    "one_image": ([1, 2, 3] + image_block((1, 8, 12)) + [4, 5], [(1, 8, 12)]),
    "three_images": ([9] + image_block((1, 8, 12)) + [4, 5] + image_block((1, 16, 8)) + [6]
                     + image_block((1, 2, 14)) + [7, 8, 9], [(1, 8, 12), (1, 16, 8), (1, 2, 14)]),
    "image_at_start": ([IMG] * 24 + [4, 5, 6], [(1, 8, 12)]),
    "image_at_end": ([1, 2, 3] + [IMG] * 32, [(1, 16, 8)]),
    "only_image": ([IMG] * 6, [(1, 4, 6)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_get_rope_index(hf_model, case):
    ids, grids = CASES[case]
    ours, delta = mrope_positions(ids, grids, IMG, MERGE)
    ref, ref_delta = reference(hf_model, ids, grids)
    assert ours.dtype == torch.int64 and ours.shape == (3, len(ids))
    assert torch.equal(ours, ref)
    assert delta == ref_delta
    # decode token p continues at p + delta on all three axes: one past the largest prompt position
    assert len(ids) + delta == int(ours.max()) + 1


def test_delta_is_negative_for_large_images():
    ids = [1] + [IMG] * 64 + [2]  # grid 1x16x16 -> 8x8 merged: 64 tokens spanning 8 positions
    pos, delta = mrope_positions(ids, [(1, 16, 16)], IMG, MERGE)
    assert delta == 1 + 8 + 1 - len(ids)
    assert pos[:, -1].tolist() == [9, 9, 9]


def test_wrong_token_count_raises():
    with pytest.raises(ValueError, match="image 0"):
        mrope_positions([1] + [IMG] * 23 + [2], [(1, 8, 12)], IMG, MERGE)


def test_run_count_must_match_grids():
    with pytest.raises(ValueError, match="2 image grid"):
        mrope_positions([1] + [IMG] * 24 + [2], [(1, 8, 12), (1, 8, 12)], IMG, MERGE)
    with pytest.raises(ValueError, match="0 image grid"):
        mrope_positions([1] + [IMG] * 24 + [2], [], IMG, MERGE)


def test_empty_prompt():
    pos, delta = mrope_positions([], [], IMG, MERGE)
    assert pos.shape == (3, 0) and delta == 0


def test_text_positions_give_plain_rope():
    """With t == h == w (text tokens) M-RoPE reduces to 1-D RoPE; the 1-D path of the rotary agrees."""
    from vlm_sdk.layers.rotary import MRotaryEmbedding

    mrope = MRotaryEmbedding(16, 1e6, (2, 3, 3), "cpu")
    plain = MRotaryEmbedding(16, 1e6, None, "cpu")
    pos = torch.arange(40, dtype=torch.int64)
    for a, b in zip(mrope(pos.expand(3, -1), torch.float32), plain(pos, torch.float32)):
        assert a.shape == (40, 1, 8)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # an image position takes t, h, w for frequencies [0, 2), [2, 5), [5, 8)
    cos, _ = mrope(torch.tensor([[1], [2], [3]]), torch.float32)
    axis = torch.tensor([1, 1, 2, 2, 2, 3, 3, 3]).float()
    torch.testing.assert_close(cos[0, 0], torch.cos(axis * mrope.inv_freq))


def test_text_after_a_long_video_resumes_past_its_time_axis():
    """Issue 50 point 10's video: 30 s at 10 fps, qwen-vl-utils' default sampling (2 fps: 60 frames, 30
    temporal patches 1 s apart, time index 2 apart at tokens_per_second 2) at 392x280 (a 10x14 merged grid).
    Qwen's rule (transformers PR #35569, vLLM): the text after it starts at the video's last time index + 1,
    and decoding continues after it; transformers 5.3+ would restart the text at start + 14."""
    from video_reference import qwen_original_positions
    from vlm_sdk.models.common.qwen_vl.rope_index import VisionSpan, video_time_offsets, vision_positions

    offsets = video_time_offsets(30, 2.0, 2, 2)
    assert offsets[-1] == 58
    start, per = 3, 10 * 14
    spans = [VisionSpan(start + k * per, (1, 10, 14), off, ends_run=k == 29) for k, off in enumerate(offsets)]
    n = start + 30 * per + 5
    pos, delta = vision_positions(n, spans)
    types_ = [0] * start + [2] * (30 * per) + [0] * 5
    ref, ref_delta = qwen_original_positions(list(range(n)), types_, [(30, 20, 28)], [2.0], MERGE)
    assert torch.equal(pos, ref) and delta == ref_delta
    assert pos[:, start + 30 * per].tolist() == [start + 59] * 3  # past the time axis, not start + 14
    assert n + delta == int(pos[0, -1]) + 1  # the first decode token follows the last prompt token
