"""Parameter bytes of a loaded (or meta-device) model, by part: what one rank holds."""
from __future__ import annotations

from vlm_sdk.protocol.rank import WeightBytes


def weight_bytes(model) -> WeightBytes:
    """`model` is a `VisionLanguageModel`, real or on the meta device (only shapes and dtypes are
    read), built for one rank: its parameters are that rank's."""
    groups = model.parameter_groups()
    return WeightBytes(_nbytes(groups["language_model"]), _nbytes(groups["vision"]), _nbytes(groups["projector"]))


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)
