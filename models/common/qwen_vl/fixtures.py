"""What the Qwen-VL families' test and benchmark fixtures share (never imported by runtime code): the
benchmark workload's images and the image preprocessing compared with transformers' Qwen2-VL processor
(`benchmark_against_transformers`), which serves every Qwen-VL image processor at its own patch size.
A family's fixtures (models/<family>/fixtures.py, registered in vlm_sdk/testing/families.py) subclass
`QwenVLFixtures` with its name, reference and checkpoints."""
from __future__ import annotations

import torch
from PIL import Image

from vlm_sdk.models.common.reference import best_of, pixel_report
from vlm_sdk.models.fixtures import FamilyFixtures
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor


class QwenVLFixtures(FamilyFixtures):
    bench_image_sizes = ((448, 448),)
    preprocessing_module = "vlm_sdk.models.common.qwen_vl.fixtures"


def benchmark_against_transformers(images: list[Image.Image], repeats: int = 3,
                                   ours: Qwen2VLImageProcessor | None = None) -> dict:
    """Time this processor against transformers' `Qwen2VLImageProcessorPil` on the same images.

    `ours` (default: the published Qwen2.5-VL settings) is a configured processor, e.g. a checkpoint's;
    transformers' gets the same pixel bounds, patch geometry and normalisation, so a subclass with
    another patch size (the Qwen3-VL tower's 16) is compared with transformers at that size. Ours is timed
    one call per image (how the engine uses it); transformers is timed on the whole list in one call, its
    fastest path. Each figure is the best of `repeats` passes.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if not images:
        raise ValueError("benchmark_against_transformers needs at least one image.")
    ours = ours or Qwen2VLImageProcessor()
    theirs = Qwen2VLImageProcessorPil(
        min_pixels=ours.min_pixels, max_pixels=ours.max_pixels, patch_size=ours.patch_size,
        temporal_patch_size=ours.temporal_patch_size, merge_size=ours.merge_size,
        image_mean=list(ours.image_mean), image_std=list(ours.image_std))

    ours_s, ours_out = best_of(lambda: [ours(im) for im in images], repeats)
    theirs_s, theirs_out = best_of(lambda: theirs(images, return_tensors="pt"), repeats)
    ours_pixels = torch.cat([ours.normalized(o) for o in ours_out])  # [sum(gh*gw), 3*T*p*p]
    ours_grids = [list(o.meta.grid_thw) for o in ours_out]
    grids_match = ours_grids == theirs_out["image_grid_thw"].tolist()
    theirs_pixels = theirs_out["pixel_values"]  # [sum(gh*gw), 3*T*p*p]
    report = pixel_report(ours_s, theirs_s, ours_pixels, theirs_pixels, grids_match, len(images))
    return {**report, "grids_match": grids_match, "patch_size": ours.patch_size}

