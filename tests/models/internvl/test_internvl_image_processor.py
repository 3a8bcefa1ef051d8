"""Our InternVL dynamic-tiling processor against transformers' GotOcr2ImageProcessorPil(crop_to_patches=True)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import image
from vlm_sdk.models.internvl.fixtures import benchmark_against_transformers
from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError
from vlm_sdk.models.internvl.image_processor import (IMAGENET_MEAN, IMAGENET_STD, InternVLImageProcessor,
                                                     published_grid)

hf = pytest.importorskip("transformers.models.got_ocr2.image_processing_pil_got_ocr2")

TOL = 1e-6
_THEIRS: dict[int, object] = {}


def theirs(max_num: int = 12, min_num: int = 1):
    key = (min_num, max_num)
    if key not in _THEIRS:
        _THEIRS[key] = hf.GotOcr2ImageProcessorPil(
            crop_to_patches=True, min_patches=min_num, max_patches=max_num, size={"height": 448, "width": 448},
            image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))
    return _THEIRS[key]


@pytest.fixture(scope="module")
def ours():
    return InternVLImageProcessor()


def _assert_parity(proc, img, max_num=None, expect_grid=None):
    n = proc.max_num if max_num is None else max_num
    width, height = img.size
    rows, cols = proc.grid(width, height, max_num)
    if expect_grid is not None:
        assert (rows, cols) == expect_grid
    hf_cols, hf_rows = hf.get_optimal_tiled_canvas((height, width), (448, 448), proc.min_num, n)
    assert (rows, cols) == (hf_rows, hf_cols)
    if proc.min_num == 1:  # the published dynamic_preprocess rule agrees whenever min_num == 1
        assert published_grid(width, height, proc.min_num, n) == (rows, cols)
    mine = proc(img, max_num)
    ref = theirs(n, proc.min_num)(img, return_tensors="pt")
    assert mine.dtype == torch.float32
    assert mine.shape[0] == proc.num_tiles(width, height, max_num) == int(ref["num_patches"][0])
    assert mine.shape[0] == (rows * cols + 1 if rows * cols > 1 else 1)
    assert mine.shape == ref["pixel_values"].shape
    assert (mine - ref["pixel_values"]).abs().max().item() <= TOL
    return mine


@pytest.mark.parametrize("width,height,grid", [
    (1, 1, (1, 1)), (448, 448, (1, 1)), (449, 448, (1, 1)), (2000, 300, (1, 7)), (300, 2000, (7, 1)),
    (1920, 1080, (2, 4)), (640, 480, None), (1024, 768, None), (500, 375, None), (1000, 1000, (3, 3)),
])
def test_sizes_match_transformers(ours, width, height, grid):
    _assert_parity(ours, image(width, height, seed=width + height), expect_grid=grid)


def test_tie_cases(ours):
    # 9:2 sits exactly halfway between 4:1 and 5:1 (max 12; 9:2 itself needs 18 tiles), in floats too: the
    # tie goes to the larger grid only while the image area exceeds half the grid's pixel area.
    assert abs(4.5 - 4) == abs(4.5 - 5)
    _assert_parity(ours, image(2250, 500, seed=1), expect_grid=(1, 5))  # 1125000 > 0.5*448^2*5
    _assert_parity(ours, image(900, 200, seed=2), expect_grid=(1, 4))
    _assert_parity(ours, image(500, 2250, seed=11), expect_grid=(5, 1))
    # 5:2 halfway between 2:1 and 3:1 when 5:2 itself (10 tiles) is out of reach (max 6).
    assert abs(2.5 - 2) == abs(2.5 - 3)
    _assert_parity(ours, image(1000, 400, seed=3), max_num=6, expect_grid=(1, 3))  # 400000 > 301056
    _assert_parity(ours, image(500, 200, seed=4), max_num=6, expect_grid=(1, 2))


def test_per_image_max_num(ours):
    img = image(3200, 400, seed=5)
    a = _assert_parity(ours, img, max_num=12, expect_grid=(1, 8))
    b = _assert_parity(ours, img, max_num=6, expect_grid=(1, 6))
    assert a.shape[0] == 9 and b.shape[0] == 7
    assert ours.max_num == 12  # the per-call value does not stick
    # the thumbnail is last and is the whole image at 448x448, whatever the grid
    assert torch.equal(a[-1], b[-1])


def test_non_rgb_and_small_max(ours):
    rgba = Image.fromarray(np.dstack([np.asarray(image(900, 500, seed=6)),
                                      np.linspace(0, 255, 900 * 500).reshape(500, 900).astype(np.uint8)]), "RGBA")
    _assert_parity(ours, rgba)
    one = InternVLImageProcessor(max_num=1)
    out = one(image(1920, 1080, seed=7))
    assert out.shape == (1, 3, 448, 448)


def test_published_rule_differs_only_with_min_num_above_one():
    # Exhaustive over every exact halfway point between neighbouring grid ratios: with min_num == 1 the
    # two visiting orders never disagree. With min_num > 1 grids with the same count can be neighbours.
    from fractions import Fraction
    for max_num in range(1, 25):
        ratios = sorted({Fraction(c, r) for c in range(1, max_num + 1) for r in range(1, max_num + 1)
                         if c * r <= max_num})
        proc = InternVLImageProcessor(max_num=max_num)
        for a, b in zip(ratios, ratios[1:]):
            mid = (a + b) / 2
            for k in (1, 448):
                w, h = mid.numerator * k, mid.denominator * k
                assert published_grid(w, h, 1, max_num) == proc.grid(w, h)
    four = InternVLImageProcessor(min_num=4, max_num=4)
    assert published_grid(5, 2, 4, 4) == (1, 4)
    assert four.grid(5, 2) == (2, 2) == tuple(reversed(hf.get_optimal_tiled_canvas((2, 5), (448, 448), 4, 4)))


def test_from_preprocessor_config():
    hf_layout = {"crop_to_patches": True, "min_patches": 1, "max_patches": 6, "size": {"height": 448, "width": 448},
                 "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD), "resample": 3,
                 "rescale_factor": 1 / 255, "image_processor_type": "GotOcr2ImageProcessorFast"}
    p = InternVLImageProcessor.from_preprocessor_config(hf_layout)
    assert (p.image_size, p.min_num, p.max_num, p.use_thumbnail) == (448, 1, 6, True)
    p = InternVLImageProcessor.from_preprocessor_config({**hf_layout, "crop_to_patches": False})
    assert p.max_num == 1 and p.num_tiles(1920, 1080) == 1
    original = {"crop_size": 448, "size": 448, "do_center_crop": True, "image_mean": list(IMAGENET_MEAN),
                "image_std": list(IMAGENET_STD), "resample": 3}
    cfg = {"force_image_size": 448, "max_dynamic_patch": 12, "min_dynamic_patch": 1, "use_thumbnail": True,
           "dynamic_image_size": True}
    p = InternVLImageProcessor.from_preprocessor_config(original, cfg)
    assert (p.image_size, p.min_num, p.max_num, p.use_thumbnail) == (448, 1, 12, True)

    class Cfg:
        force_image_size = 448
        max_dynamic_patch = 4
        use_thumbnail = False

    p = InternVLImageProcessor.from_preprocessor_config(original, Cfg())
    assert p.max_num == 4 and not p.use_thumbnail and p.num_tiles(1920, 1080) == 2  # (1, 2), no thumbnail
    with pytest.raises(CheckpointError):
        InternVLImageProcessor.from_preprocessor_config({**hf_layout, "min_patches": 8})
    # a -hf checkpoint saves crop_to_patches false, yet transformers' InternVLProcessor tiles; its tiles
    # take the image processor's size even when the vision tower's position grid is another
    hf_config = {"model_type": "internvl", "vision_config": {"image_size": [224, 224]}}
    p = InternVLImageProcessor.from_preprocessor_config({**hf_layout, "crop_to_patches": False}, hf_config)
    assert (p.image_size, p.max_num) == (448, 6) and p.num_tiles(1920, 1080) == 3


def test_bad_inputs(ours):
    with pytest.raises(InvalidImageError):
        ours(np.zeros((4, 4, 3), dtype=np.uint8))
    with pytest.raises(InvalidRequestError):
        ours(image(10, 10), max_num=0)
    with pytest.raises(InvalidRequestError):
        InternVLImageProcessor(min_num=3, max_num=2)


def test_benchmark_helper_runs():
    stats = benchmark_against_transformers([image(1920, 1080, seed=8), image(640, 480, seed=9)], repeats=1)
    assert stats["tiles_match"] and stats["max_abs_diff"] <= TOL
    print(stats)
