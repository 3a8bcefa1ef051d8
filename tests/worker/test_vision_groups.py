"""The model runner encodes images through the vision tower in groups of at most max_vision_patches
patches; any grouping gives the embeddings of one call."""
from __future__ import annotations

import torch

from helpers import conversations
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.worker.encoder_cache import EncoderCache
from vlm_sdk.protocol.scheduler_output import NewRequestData
from vlm_sdk.worker.step_images import patch_groups
from vlm_sdk.worker.request_state import RequestState

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
# the tiny Qwen2.5-VL tower's chain (tests/tolerance.py): 1,176-input patches, 2 blocks of width 32 over
# at most 400 patches an image, a merger of inputs 128 + 128
TOWER_TERMS = forward_terms(layers=0, hidden=0, intermediate=0, tokens=0, patch=1176, vision_layers=2,
                            vision_hidden=32, vision_intermediate=64, vision_tokens=400, merger=256)


def test_patch_groups_hold_at_most_the_limit_and_a_big_image_alone():
    assert patch_groups([4, 4, 4], None) == [range(0, 3)]
    assert patch_groups([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert patch_groups([10, 2, 2, 10], 4) == [range(0, 1), range(1, 3), range(3, 4)]  # a big one alone
    assert patch_groups([], 4) == [range(0, 0)]


def test_grouped_encoding_equals_one_call_and_the_engine_still_generates(tiny_ckpt):
    llm = LLM(tiny_ckpt, show_progress=False)
    convs = [conversations()["two_images"], conversations()["one_image"], conversations()["multi_turn"]]
    prompts = [llm.engine.inputs.build_prompt(c) for c in convs]
    runner = local_worker(llm.engine).runner
    calls = []
    encode = runner.model.encode_images

    def counting(images):
        calls.append(len(images))
        return encode(images)

    def embeds(limit):
        states = [RequestState.from_new(NewRequestData(
            f"r{i}", p.token_ids, [], p.images, p.image_positions, p.positions, PARAMS, [], 0))
            for i, p in enumerate(prompts)]
        runner.max_vision_patches = limit
        runner.encoder_cache = EncoderCache(0)  # every call goes through the tower
        calls.clear()
        runner._encode_images([(s, len(s.token_ids)) for s in states])  # the whole prompt in one chunk
        per_seq = [torch.cat([s.image_embeds[i] for i in range(len(s.images))]) for s in states]
        return per_seq, list(calls)

    runner.model.encode_images = counting
    try:
        whole, whole_calls = embeds(None)
        alone, alone_calls = embeds(1)  # every image in its own call
        first_two = sum(im.size for im in prompts[0].images)
        pairs, pair_calls = embeds(first_two)
    finally:
        runner.max_vision_patches = None
        del runner.model.encode_images
    assert whole_calls == [4] and alone_calls == [1, 1, 1, 1] and pair_calls[0] == 2 and sum(pair_calls) == 4
    for a, b, c, p in zip(whole, alone, pairs, prompts):
        assert a.shape[0] == sum(p.image_tokens)
        assert_reduction_close(b, a, TOWER_TERMS)
        assert_reduction_close(c, a, TOWER_TERMS)
    # and a whole engine step with grouping still generates
    runner.max_vision_patches = 1
    try:
        assert all(o.token_ids for o in llm.chat(convs, PARAMS))
    finally:
        runner.max_vision_patches = None
