"""Qwen2.5-VL per-image pixel bounds: an image part's own min_pixels/max_pixels are checked before any
resizing, each refusal says where every bound came from and suggests a value that fits, and
max_image_patches bounds every image the engine may meet."""
from __future__ import annotations

import time

import pytest

from helpers import image
from vlm_sdk import LLM
from vlm_sdk.errors import InvalidImageError, InvalidRequestError
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor, max_image_grid, max_image_patches

BLOCKS = 20  # 320 tokens


@pytest.fixture(scope="module")
def limited(tiny_ckpt):
    """An engine whose processor refuses images over max_model_len tokens (what the engine wires)."""
    llm = LLM(tiny_ckpt, num_blocks=BLOCKS, show_progress=False)
    llm.engine.processor.max_image_tokens = llm.engine.scheduler_config.max_model_len
    return llm


def _one(img, **bounds):
    return [{"role": "user", "content": [{"type": "image", "image": img, **bounds},
                                         {"type": "text", "text": "Describe."}]}]


@pytest.mark.timing  # a wall-clock bound: run alone
def test_huge_own_min_pixels_is_refused_before_resizing(limited, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the image must not be resized")
    monkeypatch.setattr(Qwen2VLImageProcessor, "__call__", boom)
    start = time.perf_counter()
    with pytest.raises(InvalidImageError) as info:
        limited.engine.build_prompt(_one(image(64, 48, 1), min_pixels=10**9, max_pixels=2 * 10**9))
    assert time.perf_counter() - start < 1.0
    msg = str(info.value)
    for part in ("image 0", "64x48", "min_pixels=1000000000 (set on the image part)",
                 "max_pixels=2000000000 (set on the image part)", "320 one image may take",
                 "Lower the image part's min_pixels to at most"):
        assert part in msg, (part, msg)


def test_own_max_pixels_refusal_suggests_a_value_that_fits(limited):
    with pytest.raises(InvalidImageError) as info:
        limited.engine.build_prompt(_one(image(600, 600, 2), max_pixels=10**7))
    msg = str(info.value)
    assert "max_pixels=10000000 (set on the image part)" in msg
    assert "min_pixels=3136 (the preprocessor default)" in msg
    best = int(msg.split("max_pixels to at most ")[1].rstrip("."))
    ip = limited.engine.image_processor
    assert ip.num_image_tokens(600, 600, max_pixels=best) <= 320 < ip.num_image_tokens(600, 600, max_pixels=best + 1)
    prompt = limited.engine.processor(_one(image(600, 600, 2), max_pixels=best))  # accepted
    assert prompt.image_tokens[0] <= 320


def test_image_part_min_pixels_above_max_pixels_names_where_each_came_from(limited):
    with pytest.raises(InvalidRequestError) as info:
        limited.engine.build_prompt(_one(image(64, 64), min_pixels=300_000))
    assert "image 0: min_pixels (300000, set on the image part) is larger than max_pixels (200704, the " \
           "preprocessor default)" in str(info.value)


def test_own_min_pixels_is_recorded_and_used_by_the_what_if_count(limited):
    prompt = limited.engine.build_prompt(_one(image(100, 100, 1), min_pixels=28 * 28 * 16))
    assert prompt.images[0].meta.own_min_pixels == 28 * 28 * 16 and not prompt.images[0].meta.own_max_pixels
    plain = limited.engine.build_prompt(_one(image(100, 100, 1)))
    assert plain.images[0].meta.own_min_pixels is None
    # the what-if count uses each image's own min_pixels: at the current max_pixels it is the real count
    at = limited.engine.processor.image_tokens_with_max_pixels
    assert at(prompt, limited.engine.image_processor.max_pixels) == prompt.image_tokens


def test_max_image_patches_bounds_every_image():
    ip = Qwen2VLImageProcessor()
    max_pixels = 28 * 28 * 1280
    limit = max_image_patches(ip, max_pixels)
    assert limit == 1280 * 4 and max_image_grid(ip, max_pixels) == (1, 64, 80)
    t, h, w = ip.grid_thw(896, 1120, max_pixels=max_pixels)
    assert t * h * w == limit  # reached by a real image (a square one falls short)
    for height, width in ((1001, 1001), (3000, 2000), (500, 4000), (123, 4567), (2000, 2000)):
        t, h, w = ip.grid_thw(height, width, max_pixels=max_pixels)
        assert t * h * w <= limit
    assert max_image_patches(ip, 1000) == 4  # below one cell: the smallest image
