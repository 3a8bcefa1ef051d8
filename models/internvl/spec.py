"""The InternVL 2 / 2.5 / 3 family: `FAMILY`, named in `vlm_sdk.models.registry`.

Images are cut into 448x448 tiles (at most max_num, plus a thumbnail); each tile is
tokens_per_tile image tokens. Engine setting: max_dynamic_patch (most tiles per image, default the
checkpoint's); an image part may set its own `max_num`. The planner sizes images by the engine setting
(`--max-dynamic-patch`), so a fix it prints pastes into `vlm-sdk serve` and `LLM(...)`. A video is
`max_frames` uniformly sampled frames (default 8), one tile each, written "Frame1: <image>" ... as the
model card writes them.
Importing this module imports no model code.
"""
from __future__ import annotations

from typing import Any, Mapping

from vlm_sdk.models.family import MAX_PART_FRAMES, FamilySpec, ImageLimits, ImageSize, Setting, VideoTokens

MAX_NUM_LIMIT = 256  # tiles one image may ask for; the published models use at most 40


class InternVLSpec(FamilySpec):
    name = "internvl"
    display_name = "InternVL"
    engine_settings = (Setting("max_dynamic_patch", "most 448x448 tiles per image, the thumbnail not counted "
                                                    "(default: the checkpoint's)", maximum=MAX_NUM_LIMIT),)
    image_settings = (Setting("max_num", "most tiles for this image (the thumbnail not counted)",
                              maximum=MAX_NUM_LIMIT),)
    # a video: frames sampled uniformly, one tile each (models/internvl/video.py)
    video_settings = (Setting("max_frames", "frames sampled uniformly from the video, one 448x448 tile each "
                                            "(default 8, the model card's)", maximum=MAX_PART_FRAMES),)
    plan_setting = ("max_dynamic_patch", "max_dynamic_patch")

    @property
    def model_cls(self) -> type:
        from vlm_sdk.models.internvl.model import InternVLForCausalLM
        return InternVLForCausalLM

    @property
    def image_processor_cls(self) -> type:
        from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor
        return InternVLImageProcessor

    @property
    def processor_cls(self) -> type:
        from vlm_sdk.models.internvl.processor import InternVLProcessor
        return InternVLProcessor

    def image_limits(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any,
                     options: Mapping[str, Any]) -> ImageLimits:
        ip = self.image_processor_cls.from_preprocessor_config(preprocessor, hf_config)
        per_tile = model.vision.cfg.tokens_per_tile(ip.image_size)
        grid = model.vision.cfg.grid_of(ip.image_size)
        max_num = options.get("max_dynamic_patch") or ip.max_num

        def at(n: int) -> ImageSize:
            tiles = ip.tiles_of_grid(n)
            return ImageSize(tiles * per_tile, tiles * (grid * grid + 1),
                             f"max_dynamic_patch {n}: {tiles} tiles of {ip.image_size}x{ip.image_size} pixels", n)

        def candidates(limit: int) -> int | None:  # tile counts need not shrink with max_num: scan them all
            ok = [n for n in range(ip.min_num, max_num) if at(n).tokens <= limit]
            return max(ok) if ok else None
        def tokens_for(width: int, height: int) -> int:
            return ip.num_tiles(width, height, max_num) * per_tile

        def video_for(width: int, height: int, frames: int, fps: float, part: Mapping[str, Any]) -> VideoTokens:
            from vlm_sdk.models.internvl.video import DEFAULT_FRAMES
            n = self.video_options(part, "video: ").get("max_frames", DEFAULT_FRAMES)  # whatever the video's length
            # each frame an image part of one tile (video.py): "Frame{i}: " before it, the template's "\n" after
            # it, and <img> </img> around its tokens
            return VideoTokens(n, n, n * per_tile, tuple(f"Frame{i + 1}: " for i in range(n)) + ("\n",) * n, 2 * n)
        return ImageLimits("max_dynamic_patch", at(max_num), at, candidates, tokens_for, video_for)

    def video_item_tokens(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any) -> int:
        ip = self.image_processor_cls.from_preprocessor_config(preprocessor, hf_config)
        return model.vision.cfg.tokens_per_tile(ip.image_size)  # a frame is one tile

    def vision_activation_widths(self, hf_config: Any, model: Any) -> tuple[int, int, int]:
        cfg = model.vision.cfg
        return cfg.hidden_size, cfg.intermediate_size, 3 * cfg.patch_size ** 2


FAMILY = InternVLSpec()
