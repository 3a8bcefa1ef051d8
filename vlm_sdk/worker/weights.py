"""Parameter bytes of a loaded (or meta-device) model, by part: what one rank holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightBytes:
    """Parameter bytes of one rank by part (under tensor parallelism, its slices)."""
    language_model: int
    vision: int
    projector: int

    @property
    def total(self) -> int:
        return self.language_model + self.vision + self.projector


def weight_bytes(model) -> WeightBytes:
    """`model` is a `VisionLanguageModel`, real or on the meta device (only shapes and dtypes are
    read), built for one rank: its parameters are that rank's."""
    groups = model.parameter_groups()
    return WeightBytes(_nbytes(groups["language_model"]), _nbytes(groups["vision"]), _nbytes(groups["projector"]))


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)
