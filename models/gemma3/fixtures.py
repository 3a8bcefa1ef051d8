"""Gemma 3's test and benchmark fixtures (registered in vlm_sdk/testing/families.py; never imported by
runtime code)."""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from vlm_sdk.models.common.reference import best_of, pixel_report
from vlm_sdk.models.fixtures import FamilyFixtures
from vlm_sdk.models.gemma3.image_processor import Gemma3ImageProcessor


class Gemma3Fixtures(FamilyFixtures):
    family = "gemma3"
    bench_image_sizes = ((448, 448), (1280, 720))  # square; 16:9 (pan-and-scan would cut it in 2)
    reference_module = "vlm_sdk.models.gemma3.reference"
    preprocessing_module = "vlm_sdk.models.gemma3.fixtures"

    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.gemma3.tiny_checkpoint import make_tiny_gemma3_checkpoint
        return make_tiny_gemma3_checkpoint(path, seed, **overrides)

    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        from vlm_sdk.models.gemma3.tiny_checkpoint import make_bench_gemma3_checkpoint
        return make_bench_gemma3_checkpoint(path, seed, **overrides)


def benchmark_against_transformers(images: list[Image.Image], repeats: int = 3,
                                   ours: Gemma3ImageProcessor | None = None) -> dict:
    """Time this processor against transformers' `Gemma3ImageProcessorPil` on the same images, size,
    normalisation and pan-and-scan options. Ours one call per image (how the engine uses it); transformers
    on the whole list, its fastest path; each figure the best of `repeats` passes."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if not images:
        raise ValueError("benchmark_against_transformers needs at least one image.")
    ours = ours or Gemma3ImageProcessor()
    p = ours.pan_and_scan
    theirs = Gemma3ImageProcessorPil(size={"height": ours.size, "width": ours.size}, image_mean=list(ours.mean),
                                     image_std=list(ours.std), rescale_factor=ours.rescale_factor,
                                     resample=ours.resample, do_pan_and_scan=p.enabled,
                                     pan_and_scan_min_crop_size=p.min_crop_size,
                                     pan_and_scan_max_num_crops=p.max_num_crops,
                                     pan_and_scan_min_ratio_to_activate=p.min_ratio_to_activate)
    ours_s, ours_out = best_of(lambda: [ours(im) for im in images], repeats)
    theirs_s, theirs_out = best_of(lambda: theirs(images, return_tensors="pt"), repeats)
    frames_match = [o.shape[0] - 1 for o in ours_out] == [int(n) for n in theirs_out["num_crops"]]
    report = pixel_report(ours_s, theirs_s, torch.cat(ours_out), theirs_out["pixel_values"], frames_match, len(images))
    return {**report, "frames_match": frames_match}


FIXTURES = Gemma3Fixtures()
