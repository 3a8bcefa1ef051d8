"""transformers as the oracle for Qwen2.5-VL (`FIXTURES.reference`): the Qwen-VL families' prompt hooks
(models/common/qwen_vl/reference.py) and transformers' own `Qwen2_5_VLForConditionalGeneration`. Imports
transformers lazily; test fixtures only.
"""
from __future__ import annotations

import torch

from vlm_sdk.models.common.qwen_vl.reference import hf_image_processor, hf_prompt

__all__ = ["hf_model", "hf_image_processor", "hf_prompt"]


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' own model class on the checkpoint, in eval mode."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
