"""config.json `architectures` -> the model family that serves it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vlm_sdk.errors import CheckpointError
from vlm_sdk.models.base import VisionLanguageModel


@dataclass(frozen=True)
class ModelFamily:
    name: str  # e.g. "qwen2_5_vl"
    model_cls: type[VisionLanguageModel]  # model_cls(hf_config, dtype=..., device=...)
    architectures: tuple[str, ...]  # config.json names served by this family
    image_processor_cls: type  # .from_preprocessor_config(preprocessor_config.json as a dict, hf_config)
    processor_cls: type  # .from_engine_args(tokenizer, image_processor, hf_config, EngineArgs); messages -> PromptInputs
    text_config: Callable[[Any], Any]  # hf_config -> the language model's config


def _families() -> tuple[ModelFamily, ...]:
    from vlm_sdk.model_loader import text_config
    from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor
    from vlm_sdk.models.internvl.model import InternVLForCausalLM
    from vlm_sdk.models.internvl.processor import InternVLProcessor
    from vlm_sdk.models.qwen2_5_vl.image_processor import Qwen2VLImageProcessor
    from vlm_sdk.models.qwen2_5_vl.model import Qwen2_5_VLForCausalLM
    from vlm_sdk.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor
    return (
        ModelFamily("qwen2_5_vl", Qwen2_5_VLForCausalLM, ("Qwen2_5_VLForConditionalGeneration",),
                    Qwen2VLImageProcessor, Qwen2_5_VLProcessor, text_config),
        ModelFamily("internvl", InternVLForCausalLM, ("InternVLForConditionalGeneration", "InternVLChatModel"),
                    InternVLImageProcessor, InternVLProcessor, text_config),
    )


def supported_architectures() -> list[str]:
    return [arch for fam in _families() for arch in fam.architectures]


def resolve(architectures: list[str]) -> ModelFamily:
    """The family of the first known architecture; `CheckpointError` when none is known."""
    families = _families()
    for arch in architectures or []:
        for fam in families:
            if arch in fam.architectures:
                return fam
    raise CheckpointError(f"config.json architectures {list(architectures or [])} are not supported; "
                          f"supported: {', '.join(supported_architectures())}")
