"""InternVL's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported by
runtime code)."""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from vlm_sdk.models.common.reference import best_of, pixel_report
from vlm_sdk.models.fixtures import FamilyFixtures
from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor


class InternVLFixtures(FamilyFixtures):
    family = "internvl"
    bench_image_sizes = ((448, 448), (1920, 1080))  # one tile; a 2x1 grid plus the thumbnail
    reference_module = "vlm_sdk.models.internvl.reference"
    preprocessing_module = "vlm_sdk.models.internvl.fixtures"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.internvl.tiny_checkpoint import make_tiny_internvl_checkpoint
        return make_tiny_internvl_checkpoint(path, seed=seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.internvl.tiny_checkpoint import make_bench_internvl_checkpoint
        return make_bench_internvl_checkpoint(path, seed=seed, **overrides)


def benchmark_against_transformers(images: list[Image.Image], max_num: int = 12, repeats: int = 3,
                                   ours: InternVLImageProcessor | None = None) -> dict:
    """Time this processor against transformers' `GotOcr2ImageProcessorPil(crop_to_patches=True)`.

    `ours`: a configured processor (e.g. a checkpoint's; its max_num wins over `max_num`), default the
    published tiling at `max_num`; transformers' gets the same tile size, tile bounds and normalisation.
    Ours is timed one call per image (how the engine uses it); transformers on the whole list in one
    call, its fastest path. Each figure is the best of `repeats` passes.
    """
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    if not images:
        raise ValueError("benchmark_against_transformers needs at least one image.")
    ours = ours or InternVLImageProcessor(max_num=max_num)
    theirs = GotOcr2ImageProcessorPil(
        crop_to_patches=True, min_patches=ours.min_num, max_patches=ours.max_num,
        size={"height": ours.image_size, "width": ours.image_size},
        image_mean=list(ours.mean), image_std=list(ours.std))

    ours_s, ours_out = best_of(lambda: [ours(im) for im in images], repeats)
    theirs_s, theirs_out = best_of(lambda: theirs(images, return_tensors="pt"), repeats)
    ours_pixels = torch.cat(ours_out)  # [sum(tiles), 3, s, s]
    tiles_match = [o.shape[0] for o in ours_out] == list(theirs_out["num_patches"])
    report = pixel_report(ours_s, theirs_s, ours_pixels, theirs_out["pixel_values"], tiles_match, len(images))
    return {**report, "tiles_match": tiles_match, "max_num": ours.max_num}


FIXTURES = InternVLFixtures()
