"""transformers as the oracle for Qwen3.5-MoE (`FIXTURES.reference`): the Qwen-VL prompt hooks and
transformers' own `Qwen3_5MoeForConditionalGeneration`. Imports transformers lazily; test fixtures only."""
from __future__ import annotations

import torch

from vlm_sdk.models.common.qwen_vl.reference import hf_image_processor, hf_prompt

__all__ = ["hf_model", "hf_image_processor", "hf_prompt"]


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' own model class on the checkpoint, in eval mode."""
    from transformers import Qwen3_5MoeForConditionalGeneration
    return Qwen3_5MoeForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
