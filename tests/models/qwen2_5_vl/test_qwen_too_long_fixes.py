"""Qwen2.5-VL's part of the too-long error: the max_pixels fix (the family's setting search) is offered
only when the engine's max_pixels can shrink the prompt, respects each image's own bounds, is below the
current value, and works when applied."""
from __future__ import annotations

import pytest
import torch

from helpers import image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.config import SchedulerConfig
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.memory import capacity
from vlm_sdk.errors import InputTooLongError
from vlm_sdk.models.common.qwen_vl import fixes
from vlm_sdk.models.common.qwen_vl.image_processor import QwenImage
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def _one(img, **bounds):
    return [{"role": "user", "content": [{"type": "image", "image": img, **bounds},
                                         {"type": "text", "text": "Describe."}]}]


@pytest.fixture(scope="module")
def ten_blocks(tiny_ckpt):
    llm = LLM(tiny_ckpt, num_blocks=10, allow_unfit_images=True, show_progress=False)  # 160 tokens
    llm.engine.processor.max_image_tokens = llm.engine.scheduler_config.max_model_len
    return llm


def test_image_too_big_under_the_engines_bounds_is_input_too_long_with_a_max_pixels_fix(tiny_ckpt):
    """An image too big under the engine's own bounds is the prompt check's business (with fixes)."""
    llm = LLM(tiny_ckpt, num_blocks=6, allow_unfit_images=True, show_progress=False)
    llm.engine.processor.max_image_tokens = llm.engine.scheduler_config.max_model_len
    big = [{"role": "user", "content": [{"type": "image", "image": image(400, 300, 5)},
                                        {"type": "image", "image": image(250, 250, 6)},
                                        {"type": "text", "text": "What differs?"}]}]
    with pytest.raises(InputTooLongError) as info:
        llm.chat(big, PARAMS)
    assert {"num_blocks", "max_pixels"} <= set(info.value.fixes)
    # an image part's small own min_pixels does not make the engine's max_pixels its fault
    with pytest.raises(InputTooLongError):
        llm.chat(_one(image(400, 300, 5), min_pixels=28 * 28), PARAMS)


def test_max_pixels_fix_respects_each_images_own_min_pixels(ten_blocks):
    conv = _one(image(100, 100, 1), min_pixels=100_352)  # upsized to 144 tokens by its own min_pixels
    with pytest.raises(InputTooLongError) as info:
        ten_blocks.chat(conv, PARAMS)
    assert info.value.image_tokens == [144]
    assert "max_pixels" not in info.value.fixes  # the engine's max_pixels cannot shrink this image


def test_no_max_pixels_fix_for_images_with_their_own(ten_blocks):
    with pytest.raises(InputTooLongError) as info:
        ten_blocks.chat(_one(image(400, 300, 5), max_pixels=200_704), PARAMS)
    assert info.value.image_tokens == [154] and "max_pixels" not in info.value.fixes


def test_max_pixels_fix_works_with_a_mix_of_images(tiny_ckpt):
    mixed = [{"role": "user", "content": [
        {"type": "image", "image": image(120, 120, 3), "min_pixels": 28 * 28 * 16},  # 16 tokens, floor
        {"type": "image", "image": image(400, 300, 5)},
        {"type": "text", "text": "Compare."}]}]
    llm = LLM(tiny_ckpt, num_blocks=6, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(mixed, PARAMS)
    best = info.value.fixes["max_pixels"]
    assert 28 * 28 * 16 <= best < llm.engine.image_processor.max_pixels
    fixed = LLM(tiny_ckpt, num_blocks=6, max_pixels=best, allow_unfit_images=True, show_progress=False)
    assert fixed.chat(mixed, PARAMS)[0].token_ids


def test_largest_max_pixels_never_returns_its_cap_or_the_current_value():
    assert fixes.largest_max_pixels(lambda v: 10, 50, 3136, 28) is None  # fits everywhere: not the limit
    assert fixes.largest_max_pixels(lambda v: 100, 50, 3136, 28) is None  # fits nowhere
    tokens = lambda v: v // 784  # noqa: E731
    assert fixes.largest_max_pixels(tokens, 50, 3136, 28) == 50 * 784
    assert fixes.largest_max_pixels(tokens, 50, 3136, 28, below=40 * 784) == 39 * 784
    assert fixes.largest_max_pixels(tokens, 50, 3136, 28, below=4 * 784) is None


def test_check_prompt_fits_offers_max_pixels_only_below_the_current():
    img = ImageInput(torch.zeros(1, 1), 60, QwenImage((1, 2, 2)), source_size=(500, 500))
    prompt = PromptInputs(token_ids=[0] * 70, images=[img], image_positions=[0])
    cache = CacheConfig(16, 4, 1000, "test")
    sched = SchedulerConfig(8, 64, 64, "the KV cache capacity")
    def setting_fixes(max_pixels):
        def image_setting_fixes(p, capacity_tokens):
            best = fixes.max_pixels_fix(p, capacity_tokens, lambda p, v: [10], 3136, 28, max_pixels)
            return {} if best is None else {"max_pixels": best}
        return image_setting_fixes

    with pytest.raises(InputTooLongError) as info:  # the what-if count claims it fits at the cap
        capacity.check_prompt_fits(prompt, cache, sched, 4096, False, setting_fixes(200_704), max_tokens=4)
    assert info.value.fixes["max_pixels"] < 200_704
    with pytest.raises(InputTooLongError) as info:  # same without the current value: the cap is no fix
        capacity.check_prompt_fits(prompt, cache, sched, 4096, False, setting_fixes(None), max_tokens=4)
    assert "max_pixels" not in info.value.fixes
