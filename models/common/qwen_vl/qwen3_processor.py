"""Qwen3-VL prompt builder: Qwen2.5-VL's (images, M-RoPE positions) with Qwen3-VL's videos.

A video's `<|video_pad|>` becomes, for each temporal patch (2 frames), its timestamp as text, then the
patch between vision_start and vision_end, as transformers' `Qwen3VLProcessor.replace_video_token`
writes it:

    <|vision_start|> <0.3 seconds><|vision_start|> pads <|vision_end|> <1.3 seconds><|vision_start|> ... <|vision_end|>

a timestamp being the mean of its two frames' times (frame index / the video's fps;
`_calculate_timestamps`), with one decimal. Each patch is a run of its own in the positions
(`get_rope_index` splits a video's grid into one (1, h, w) grid per patch): temporal offset 0, and the
text after it resumes at its start + max(h, w), so time reaches the model through the timestamps only.
"""
from __future__ import annotations

from vlm_sdk.errors import CheckpointError
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.models.common.qwen_vl.processor import QwenVLProcessor
from vlm_sdk.models.common.qwen_vl.video_processor import QwenVideo

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def timestamps(times: tuple[float, ...], merge: int = 2) -> list[float]:
    """Each temporal patch's time: the mean of its frames' times (the last frame repeated to fill it)."""
    times = list(times)
    if len(times) % merge:
        times.extend(times[-1] for _ in range(merge - len(times) % merge))
    return [(times[i] + times[i + merge - 1]) / 2 for i in range(0, len(times), merge)]


class Qwen3VLProcessor(QwenVLProcessor):
    def __init__(self, tokenizer, image_processor, hf_config, **kwargs):
        super().__init__(tokenizer, image_processor, hf_config, **kwargs)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END)]
        if any(i is None for i in ids):
            raise CheckpointError(f"the tokenizer has no {VISION_START} / {VISION_END} tokens, which Qwen3-VL's "
                                  f"video prompts need")
        self.vision_start_id, self.vision_end_id = ids

    def place_patches(self, num_patches: int, sampling) -> list[tuple[int, bool]]:
        return [(0, True)] * num_patches  # a run per patch; time is in the timestamps

    def expand_video(self, video: QwenVideo) -> list[tuple[list[int], ImageInput, list[int]]]:
        stamps = timestamps(video.sampling.times, self.video_processor.temporal_patch_size)
        return [(self.tokenizer.encode(f"<{stamp:.1f} seconds>", add_special_tokens=False) + [self.vision_start_id],
                 patch, [self.vision_end_id]) for stamp, patch in zip(stamps, video.patches)]
