"""Qwen3-VL image preprocessing: Qwen2-VL's (smart_resize, rescale, normalise, patchify) with patch 16.

transformers serves Qwen3-VL with `Qwen2VLImageProcessor` itself, configured by the checkpoint's
preprocessor_config.json (published: patch_size 16, merge_size 2, temporal_patch_size 2, mean and std
0.5, `size` {shortest_edge 65536, longest_edge 16777216}). So this is that processor, pixel for
pixel; what differs is what a preprocessor config that leaves something out means. transformers would
fall back to Qwen2-VL's patch 14 and feed the tower patches of the wrong size: this takes the vision
config's, and refuses a preprocessor config that contradicts it. Without pixel bounds (`vlm-sdk plan`
on a bare config.json) it takes the published Qwen3-VL bounds, not Qwen2-VL's 56*56 .. 28*28*1280.
"""
from __future__ import annotations

from typing import Any

from vlm_sdk.errors import CheckpointError
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor

PUBLISHED_SIZE = {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}  # every published Qwen3-VL's
_GEOMETRY = (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
             ("temporal_patch_size", "temporal_patch_size"))  # (preprocessor key, vision_config field)


class Qwen3VLImageProcessor(Qwen2VLImageProcessor):
    """`Qwen2VLImageProcessor` whose patch geometry matches the checkpoint's vision tower."""

    @classmethod
    def from_preprocessor_config(cls, d: dict, hf_config: Any = None) -> "Qwen3VLImageProcessor":
        """From preprocessor_config.json (`size` or top-level min/max_pixels, as Qwen2-VL's; neither:
        `PUBLISHED_SIZE`); patch_size, merge_size and temporal_patch_size default to
        `hf_config.vision_config`'s, and a value that differs from it raises `CheckpointError` naming both."""
        d = dict(d)
        if not d.get("size") and d.get("min_pixels") is None and d.get("max_pixels") is None:
            d["size"] = dict(PUBLISHED_SIZE)
        vision = getattr(hf_config, "vision_config", None)
        for key, field in _GEOMETRY:
            model_value = getattr(vision, field, None)
            if model_value is None:
                continue
            if d.get(key) is None:
                d[key] = int(model_value)
            elif d[key] != model_value:
                raise CheckpointError(f"preprocessor_config.json {key} {d[key]!r} differs from config.json "
                                      f"vision_config.{field} {model_value!r}: the vision tower takes patches "
                                      f"of the config's size")
        return super().from_preprocessor_config(d, hf_config)
