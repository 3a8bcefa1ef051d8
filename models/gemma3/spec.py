"""The Gemma 3 family: `FAMILY`, named in `vlm_sdk.models.registry`.

Every image is resized to the SigLIP tower's square (896x896 in the published checkpoints) and becomes
`mm_tokens_per_image` soft tokens (256), wrapped in <start_of_image> ... <end_of_image>. Pan-and-scan
(off by default, as in transformers' Gemma3Processor) adds crops of a wide or tall image, each one more
such image. Engine settings: transformers' pan-and-scan options (defaults Gemma3Processor's: off, 256, 4,
1.2; it passes them over preprocessor_config.json's, and so does the engine); an image part may set its
own. The planner sizes images by pan_and_scan_max_num_crops (the most frames an image becomes is 1 + it,
when pan-and-scan is on).
Importing this module imports no model code.
"""
from __future__ import annotations

from typing import Any, Mapping

from vlm_sdk.models.family import FamilySpec, ImageLimits, ImageSize, Setting

MAX_CROPS_LIMIT = 64  # crops one image may ask for; transformers' default is 4

PAN_AND_SCAN_SETTINGS = (
    Setting("do_pan_and_scan", "pan-and-scan: also show the model crops of an image whose aspect ratio is at least "
                               "pan_and_scan_min_ratio_to_activate (default off)", type=bool),
    Setting("pan_and_scan_max_num_crops", "the most pan-and-scan crops of one image (default 4)",
            maximum=MAX_CROPS_LIMIT),
    Setting("pan_and_scan_min_crop_size", "the narrowest pan-and-scan crop in pixels; no crops when they would be "
                                          "narrower (default 256)"),
    Setting("pan_and_scan_min_ratio_to_activate", "the aspect ratio (long side / short side) from which an image is "
                                                  "cut into crops (default 1.2)", type=float),
)


class Gemma3Spec(FamilySpec):
    name = "gemma3"
    display_name = "Gemma 3"
    engine_settings = PAN_AND_SCAN_SETTINGS
    image_settings = PAN_AND_SCAN_SETTINGS  # an image part's own options win over the engine's
    whole_images = True  # image tokens attend to each other within their image: no chunk ends inside one
    plan_setting = ("pan_and_scan_max_num_crops", "pan_and_scan_max_num_crops")

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.gemma3.model import Gemma3ForConditionalGeneration
        return Gemma3ForConditionalGeneration

    @property
    def image_processor_cls(self) -> type:
        from vlm_sdk.models.gemma3.image_processor import Gemma3ImageProcessor
        return Gemma3ImageProcessor

    @property
    def processor_cls(self) -> type:
        from vlm_sdk.models.gemma3.processor import Gemma3Processor
        return Gemma3Processor

    def image_limits(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any,
                     options: Mapping[str, Any]) -> ImageLimits:
        """The largest image: the whole image plus its most crops (when pan-and-scan is on), each frame
        `tokens_per_image` soft tokens; one frame is one vision-tower call of (image_size / patch)^2 rows."""
        from vlm_sdk.models.gemma3.processor import engine_pan_and_scan
        ip = self.image_processor_cls.from_preprocessor_config(preprocessor, hf_config)
        pas = engine_pan_and_scan(ip, options)
        per_frame, rows = model.tokens_per_image, model.vision.tower.cfg.num_patches

        def at(v: int) -> ImageSize:
            frames = 1 + (v if pas.enabled else 0)
            crops = f" and up to {v} pan-and-scan crops" if pas.enabled else ""
            return ImageSize(frames * per_frame, rows, f"pan_and_scan_max_num_crops {v}: the image{crops} at "
                                                       f"{ip.size}x{ip.size} pixels, {per_frame} tokens each", v)

        def candidates(limit: int) -> int | None:
            ok = [v for v in range(1, pas.max_num_crops) if at(v).tokens <= limit] if pas.enabled else []
            return max(ok) if ok else None
        def tokens_for(width: int, height: int) -> int:  # the whole image and its crops
            return (1 + len(pas.boxes(width, height))) * per_frame
        return ImageLimits("pan_and_scan_max_num_crops", at(pas.max_num_crops), at, candidates, tokens_for)

    def vision_activation_widths(self, hf_config: Any, model: Any) -> tuple[int, int, int]:
        cfg = model.vision.tower.cfg
        return cfg.hidden_size, cfg.intermediate_size, cfg.num_channels * cfg.patch_size ** 2


FAMILY = Gemma3Spec()
