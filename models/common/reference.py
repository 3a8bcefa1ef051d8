"""Timing helpers for the image-processor comparisons against transformers (`benchmark_against_transformers`
in each family's image_processor.py, reported by `vlm-sdk bench`)."""
from __future__ import annotations

import torch


def best_of(fn, repeats: int):
    """(fastest wall time in seconds over `repeats` calls, the last result): the figure the
    preprocessing comparisons against transformers report."""
    import math
    import time
    best, result = math.inf, None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def pixel_report(ours_s: float, theirs_s: float, ours: torch.Tensor, theirs: torch.Tensor, layout_match: bool,
                 num_images: int) -> dict:
    """Per-image times and the max abs pixel difference (inf when the layouts differ)."""
    same = layout_match and ours.shape == theirs.shape
    return {"ours_ms_per_image": ours_s * 1e3 / num_images, "transformers_ms_per_image": theirs_s * 1e3 / num_images,
            "max_abs_diff": (ours - theirs.to(torch.float32)).abs().max().item() if same else float("inf"),
            "num_images": num_images}
