"""transformers as the oracle for Qwen3-VL (`FIXTURES.reference`). transformers builds Qwen3-VL prompts
as Qwen2.5-VL's: `Qwen2VLImageProcessorPil` (the auto class it picks for model_type "qwen3_vl" without
torchvision) configured by the checkpoint, and each `<|image_pad|>` expanded to grid_t*grid_h*grid_w /
merge^2 tokens (`Qwen3VLProcessor.replace_image_token`), so the prompt hooks are Qwen2.5-VL's; the
model is transformers' own Qwen3-VL class. Imports transformers lazily; test fixtures only.
"""
from __future__ import annotations

import torch

from vlm_sdk.models.common.qwen_vl.reference import hf_image_processor, hf_prompt

__all__ = ["hf_model", "hf_image_processor", "hf_prompt"]


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' own model class on the checkpoint, in eval mode."""
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
