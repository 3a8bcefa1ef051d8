"""Our Qwen2-VL image processor against transformers' Qwen2VLImageProcessorPil: same grid, same pixels."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from helpers import image as make_image
from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError
from vlm_sdk.models.common.qwen_vl.image_processor import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, Qwen2VLImageProcessor,
                                                       pixels_to_device)
from vlm_sdk.models.common.qwen_vl.fixtures import benchmark_against_transformers
from vlm_sdk.multimodal.image_io import load_image

hf = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280
TOL = 1e-6


def _content(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """Noise over gradients: resizing then mixes distinct values, so an off-by-one pixel shows up."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None]  # [h, 1]
    x = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :]  # [1, w]
    ramps = (x + 0 * y, y + 0 * x, (x + y) / 2, 1 - x + 0 * y)
    out = np.empty((h, w, channels), dtype=np.uint8)  # [h, w, channels]
    for c in range(channels):
        noise = rng.integers(0, 96, (h, w), dtype=np.uint8)  # [h, w]
        out[..., c] = (ramps[c] * 160).astype(np.uint8) + noise  # at most 160 + 95: no overflow
    return out


@pytest.fixture(scope="module")
def ours():
    return Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="module")
def theirs():
    return hf.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _assert_parity(mine, reference) -> None:
    # bytes leave the processor (one frame); the float patches are made where the model runs
    assert mine.data.dtype == torch.uint8 and mine.data.shape[1] * 2 == reference["pixel_values"].shape[1]
    assert list(mine.meta.grid_thw) == reference["image_grid_thw"][0].tolist()
    pixels = pixels_to_device([mine], 2, "cpu", torch.float32)  # [patches, 3*T*p*p]
    assert pixels.shape == reference["pixel_values"].shape
    diff = (pixels - reference["pixel_values"]).abs().max().item()
    assert diff <= TOL
    t, gh, gw = mine.meta.grid_thw
    assert mine.num_tokens == t * gh * gw // 4


# (height, width); 1x1 included: transformers upsamples it to 56x56 (grid 1x4x4), so we do the same.
@pytest.mark.parametrize("height,width", [(1, 1), (28, 28), (17, 999), (999, 17), (480, 640), (3000, 4000)])
def test_rgb_sizes_match_transformers(ours, theirs, height, width):
    image = Image.fromarray(_content(height, width, seed=height + width))
    mine = ours(image)
    _assert_parity(mine, theirs(image, return_tensors="pt"))
    assert mine.num_tokens == ours.num_image_tokens(height, width)


def test_rgba_with_varied_alpha(ours, theirs):
    image = Image.fromarray(_content(120, 90, channels=4, seed=5), mode="RGBA")
    _assert_parity(ours(load_image(image)), theirs(image, return_tensors="pt"))
    _assert_parity(ours(image), theirs(image, return_tensors="pt"))  # converts non-RGB input itself


def test_palette_with_and_without_transparency(ours, theirs):
    palette = Image.fromarray(_content(70, 130, seed=6)).quantize(colors=64)
    _assert_parity(ours(load_image(palette)), theirs(palette, return_tensors="pt"))
    palette.info["transparency"] = int(np.asarray(palette)[3, 3])
    buf = io.BytesIO()
    palette.save(buf, format="PNG")
    reference = theirs(Image.open(io.BytesIO(buf.getvalue())), return_tensors="pt")
    _assert_parity(ours(load_image(buf.getvalue())), reference)


def test_grayscale(ours, theirs):
    image = Image.fromarray(_content(100, 200, channels=1, seed=7)[..., 0], mode="L")
    _assert_parity(ours(load_image(image)), theirs(image, return_tensors="pt"))


def test_exif_rotated_jpeg(ours, theirs, tmp_path):
    upright = Image.fromarray(_content(300, 500, seed=8))  # 500 wide, 300 tall
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # sideways pixels, as a rotated camera writes them
    exif = Image.Exif()
    exif[0x0112] = 6  # exif_transpose applies ROTATE_270, restoring `upright`
    path = tmp_path / "rotated.jpg"
    stored.save(path, format="JPEG", quality=92, exif=exif.tobytes())

    loaded = load_image(path)
    raw = Image.open(path)
    assert loaded.size == (500, 300) and raw.size == (300, 500)
    # JPEG is lossy, so the reference is the same file decoded and transposed, not `upright` itself.
    reference = theirs(ImageOps.exif_transpose(Image.open(path)), return_tensors="pt")
    mine = ours(loaded)
    _assert_parity(mine, reference)
    assert mine.meta.grid_thw == (1, 22, 36) and ours(raw).meta.grid_thw == (1, 36, 22)


def test_both_config_layouts_give_the_same_processor(theirs, tmp_path):
    published = {  # the layout of Qwen/Qwen2.5-VL-*/preprocessor_config.json
        "min_pixels": 1000, "max_pixels": 200_000, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    }
    reference = hf.Qwen2VLImageProcessorPil(min_pixels=1000, max_pixels=200_000)
    reference.save_pretrained(tmp_path)
    v5 = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert v5["size"] == {"shortest_edge": 1000, "longest_edge": 200_000} and "max_pixels" not in v5

    a = Qwen2VLImageProcessor.from_preprocessor_config(published)
    b = Qwen2VLImageProcessor.from_preprocessor_config(v5)
    for attr in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                 "image_mean", "image_std", "rescale_factor"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert (a.min_pixels, a.max_pixels) == (1000, 200_000)
    image = Image.fromarray(_content(600, 800, seed=9))
    _assert_parity(b(image), reference(image, return_tensors="pt"))
    assert torch.equal(a.normalized(a(image)), b.normalized(b(image)))
    assert Qwen2VLImageProcessor.from_preprocessor_config({}).max_pixels == MAX_PIXELS


def test_bad_config_names_the_file():
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        Qwen2VLImageProcessor.from_preprocessor_config({"min_pixels": 10, "max_pixels": 5})


def test_per_call_pixel_bounds_match_transformers_size(ours, theirs):
    image = Image.fromarray(_content(900, 1200, seed=10))
    default = ours(image)
    for lo, hi in ((MIN_PIXELS, 100_000), (300_000, 400_000), (28 * 28, 2 * 28 * 28)):
        mine = ours(image, min_pixels=lo, max_pixels=hi)
        _assert_parity(mine, theirs(image, size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="pt"))
        assert mine.meta.grid_thw != default.meta.grid_thw
        assert mine.num_tokens == ours.num_image_tokens(900, 1200, min_pixels=lo, max_pixels=hi)
    small = Image.fromarray(_content(40, 50, seed=11))
    mine = ours(small, min_pixels=200_000)  # min_pixels alone upsizes; max_pixels keeps its default
    _assert_parity(mine, theirs(small, size={"shortest_edge": 200_000, "longest_edge": MAX_PIXELS},
                                return_tensors="pt"))


@pytest.mark.parametrize("height,width", [(1, 1), (17, 999), (480, 640), (3000, 4000), (1080, 1920), (30, 6000)])
def test_num_image_tokens_from_size_alone(ours, theirs, height, width):
    patches = theirs.get_number_of_image_patches(height, width, {})
    assert ours.num_image_tokens(height, width) == patches // 4
    assert ours.grid_thw(height, width)[1] * ours.grid_thw(height, width)[2] == patches


def test_aspect_ratio_over_200_refused(ours):
    assert ours.grid_thw(1, 200) == (1, 2, 58)  # exactly 200 is allowed, as in transformers
    with pytest.raises(InvalidImageError) as info:
        ours.num_image_tokens(1, 201)
    assert "201x1" in str(info.value) and "200" in str(info.value)
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        ours(Image.new("RGB", (3, 603)))


def test_invalid_pixel_bounds(ours):
    image = Image.new("RGB", (64, 64))
    with pytest.raises(InvalidRequestError, match="min_pixels"):
        ours(image, min_pixels=500_000, max_pixels=400_000)
    with pytest.raises(InvalidRequestError, match="max_pixels must be a positive int"):
        ours.grid_thw(64, 64, max_pixels=0)
    with pytest.raises(InvalidRequestError, match="min_pixels must be a positive int"):
        Qwen2VLImageProcessor(min_pixels=-1)
    with pytest.raises(InvalidImageError, match="PIL.Image.Image"):
        ours(np.zeros((4, 4, 3), np.uint8))


def test_min_pixels_above_max_pixels_says_where_each_came_from():
    ip = Qwen2VLImageProcessor()
    with pytest.raises(InvalidRequestError) as info:
        ip(make_image(64, 64), min_pixels=2_000_000)
    assert "min_pixels (2000000, passed to this call) is larger than max_pixels (1003520, the processor " \
           "default)" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        ip.smart_resize(64, 64, max_pixels=1000)
    assert "min_pixels (3136, the processor default) is larger than max_pixels (1000, passed to this call)" \
           in str(info.value)


def test_benchmark_helper_reports_parity():
    images = [Image.fromarray(_content(64, 96, seed=s)) for s in range(2)]
    result = benchmark_against_transformers(images, repeats=1)
    assert result["max_abs_diff"] <= TOL and result["grids_match"]
    assert result["ours_ms_per_image"] > 0 and result["transformers_ms_per_image"] > 0
