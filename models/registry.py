"""config.json `architectures` -> the model family that serves it."""
from __future__ import annotations

from dataclasses import dataclass

from vlm_sdk.errors import CheckpointError
from vlm_sdk.models.base import VisionLanguageModel


@dataclass(frozen=True)
class ModelFamily:
    name: str  # e.g. "qwen2_5_vl"
    model_cls: type[VisionLanguageModel]
    architectures: tuple[str, ...]  # config.json names served by this family


def _families() -> tuple[ModelFamily, ...]:
    from vlm_sdk.models.qwen2_5_vl.model import Qwen2_5_VLForCausalLM
    return (
        ModelFamily("qwen2_5_vl", Qwen2_5_VLForCausalLM, ("Qwen2_5_VLForConditionalGeneration",)),
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
