"""Parameter bytes of a loaded (or meta-device) model, by part: what one rank holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightBytes:
    """Parameter bytes per rank by part; with `tp` the language model's matrices (2-D parameters,
    embeddings and lm_head included) are split across ranks, its norms and biases and the whole
    vision side are counted on every rank."""
    language_model: int
    vision: int
    projector: int

    @property
    def total(self) -> int:
        return self.language_model + self.vision + self.projector


def weight_bytes(model, tp: int = 1) -> WeightBytes:
    """`model` is a `VisionLanguageModel` (real or on the meta device: only shapes and dtypes are read)."""
    groups = model.parameter_groups()
    lm = groups["language_model"]
    return WeightBytes(_nbytes(p for p in lm if p.dim() >= 2) // tp + _nbytes(p for p in lm if p.dim() < 2),
                       _nbytes(groups["vision"]), _nbytes(groups["projector"]))


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)
