"""What the Qwen-VL families' specs share (`QwenVLSpec`): images resized to a multiple of a cell of pixels
between min_pixels and max_pixels (`smart_resize`), one image token per cell; the engine settings
min_pixels, max_pixels (defaults: the preprocessor config's), which an image part may set for itself;
qwen-vl-utils' video settings; the planner sizing images by max_pixels. `Qwen3VLTowerSpec` is the
Qwen3-VL tower's (32-pixel cells, its image and prompt processors): Qwen3-VL's and its MoE variant's.
A family's spec (models/<family>/spec.py) subclasses one and names itself and its model.
Importing this module imports no model code.
"""
from __future__ import annotations

from typing import Any, Mapping

from vlm_sdk.models.family import (MAX_PART_FPS, MAX_PART_FRAMES, MAX_PART_PIXELS, FamilySpec, ImageLimits,
                                    ImageSize, Setting, VideoTokens)

_PIXELS = "pixels (width x height) an image is resized to {} (default: the preprocessor's)"


def pixel_settings(cell: int) -> tuple[Setting, Setting]:
    """min_pixels / max_pixels of a family whose images are resized to multiples of `cell` pixels (the cell
    is this family's alone: `Setting.detail`)."""
    detail = f"a multiple of {cell}x{cell} pixels"
    return (Setting("min_pixels", _PIXELS.format("at least"), detail=detail),
            Setting("max_pixels", _PIXELS.format("at most"), detail=detail))


def qwen_video_settings(cell: int) -> tuple[Setting, ...]:
    """A video part's settings: qwen-vl-utils' names and defaults (video_sampling.py)."""
    detail = f"a multiple of {cell}x{cell} pixels"
    frames, fps, pixels = {"maximum": MAX_PART_FRAMES}, {"type": float, "maximum": MAX_PART_FPS}, \
        {"maximum": MAX_PART_PIXELS, "detail": detail}
    return (Setting("fps", "frames sampled per second of video (default 2)", **fps),
            Setting("nframes", "frames to sample, instead of fps (rounded to a multiple of 2)", **frames),
            Setting("min_frames", "the fewest frames fps may sample (default 4)", **frames),
            Setting("max_frames", "the most frames fps may sample (default 768, at most the video's)", **frames),
            Setting("min_pixels", "pixels each frame is resized to at least (default 128 tokens' worth)", **pixels),
            Setting("max_pixels", "pixels each frame is resized to at most (default 768 tokens' worth, and "
                                  "total_pixels / frames * 2)", **pixels),
            Setting("total_pixels", "pixels of all frames together, an even share per frame (default 128000 "
                                    "tokens' worth * 0.9)", **pixels),
            Setting("sample_fps", "a video given as a list of frames: the frames per second they were taken at "
                                  "(default 2)", **fps))


class QwenVLSpec(FamilySpec):
    """Qwen2.5-VL's cell (28) and processors; a subclass sets name, display_name and model_cls."""
    engine_settings = pixel_settings(28)
    image_settings = engine_settings  # an image part's own bounds win over the engine's
    video_settings = qwen_video_settings(28)
    plan_setting = ("max_pixels", "max_pixels")

    @property
    def image_processor_cls(self) -> type:
        from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor
        return Qwen2VLImageProcessor

    @property
    def processor_cls(self) -> type:
        from vlm_sdk.models.common.qwen_vl.processor import QwenVLProcessor
        return QwenVLProcessor

    def image_limits(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any,
                     options: Mapping[str, Any]) -> ImageLimits:
        from vlm_sdk.models.common.qwen_vl.fixes import largest_max_pixels
        from vlm_sdk.models.common.qwen_vl.image_processor import max_image_grid
        from vlm_sdk.models.common.qwen_vl.video_sampling import VIDEO_MAX_TOKEN_NUM
        ip = self.image_processor_cls.from_preprocessor_config(preprocessor, hf_config)
        max_pixels = options.get("max_pixels") or ip.max_pixels
        factor, unit = ip.patch_size * ip.merge_size, ip.merge_size ** 2

        # a video's largest temporal patch (768 tokens a frame) is the tower's largest call when larger
        _, vh, vw = max_image_grid(ip, VIDEO_MAX_TOKEN_NUM * factor * factor)

        def at(v: int) -> ImageSize:
            t, h, w = max_image_grid(ip, v)
            return ImageSize(t * h * w // unit, max(t * h * w, vh * vw),
                             f"max_pixels {v}: {h * ip.patch_size}x{w * ip.patch_size} pixels", v)

        def candidates(limit: int) -> int | None:
            return largest_max_pixels(lambda v: at(v).tokens, limit, ip.min_pixels, factor, max_pixels)
        def tokens_for(width: int, height: int) -> int:  # the processor's resize of an image part without options
            return ip.num_image_tokens(height, width, options.get("min_pixels"), max_pixels)

        def video_for(width: int, height: int, frames: int, fps: float, part: Mapping[str, Any]) -> VideoTokens:
            from vlm_sdk.models.common.qwen_vl.video_sampling import plan_video
            sampling = plan_video(self.video_options(part, "video: "), frames, fps, height, width, factor)
            patches = len(sampling.indices) // ip.temporal_patch_size
            tokens = patches * (sampling.height // factor) * (sampling.width // factor)  # merged cells per patch
            return VideoTokens(len(sampling.indices), patches, tokens, *self.video_item_text(sampling))
        return ImageLimits("max_pixels", at(max_pixels), at, candidates, tokens_for, video_for)

    def video_item_text(self, sampling) -> tuple[tuple[str, ...], int]:
        """(text, special tokens) the processor writes around each temporal patch beyond the video's one
        wrapper: none for Qwen2.5-VL (one run of pads)."""
        return (), 0

    def video_item_tokens(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any) -> int:
        from vlm_sdk.models.common.qwen_vl.image_processor import max_image_grid
        from vlm_sdk.models.common.qwen_vl.video_sampling import VIDEO_MAX_TOKEN_NUM
        ip = self.image_processor_cls.from_preprocessor_config(preprocessor, hf_config)
        factor = ip.patch_size * ip.merge_size
        _, h, w = max_image_grid(ip, VIDEO_MAX_TOKEN_NUM * factor * factor)  # a frame of 768 tokens at most
        return h * w // ip.merge_size ** 2

    def vision_activation_widths(self, hf_config: Any, model: Any) -> tuple[int, int, int]:
        vc = hf_config.vision_config  # transformers' parsed vision config
        return vc.hidden_size, vc.intermediate_size, model.visual.patch_dim


class Qwen3VLTowerSpec(QwenVLSpec):
    """A family on the Qwen3-VL vision tower and prompt processor: Qwen2-VL's `smart_resize` at patch 16,
    merge 2 (32-pixel cells: qwen3_image_processor.py), the same special tokens, placeholder expansion and
    still-image positions, and videos with a timestamp before each temporal patch (qwen3_processor.py).
    The too-long fixes and the planner's image sizing are `QwenVLSpec`'s on this image processor."""
    engine_settings = image_settings = pixel_settings(32)  # an image part's own bounds win over the engine's
    video_settings = qwen_video_settings(32)

    @property
    def image_processor_cls(self) -> type:
        from vlm_sdk.models.common.qwen_vl.qwen3_image_processor import Qwen3VLImageProcessor
        return Qwen3VLImageProcessor

    @property
    def processor_cls(self) -> type:
        from vlm_sdk.models.common.qwen_vl.qwen3_processor import Qwen3VLProcessor
        return Qwen3VLProcessor

    def video_item_text(self, sampling) -> tuple[tuple[str, ...], int]:
        """Each temporal patch's timestamp text, and its own vision_start / vision_end (qwen3_processor.py)."""
        from vlm_sdk.models.common.qwen_vl.qwen3_processor import timestamps
        stamps = timestamps(sampling.times)
        return tuple(f"<{t:.1f} seconds>" for t in stamps), 2 * len(stamps)
