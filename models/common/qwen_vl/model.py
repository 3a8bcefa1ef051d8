"""What the Qwen-VL models share (Qwen2.5-VL's, models/qwen2_5_vl/model.py; the Qwen3-VL tower's,
qwen3_model.py): M-RoPE positions from the processor and the published checkpoint layout."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from vlm_sdk.models.common.qwen_vl.rope_index import MRopePositions, prompt_positions_at
from vlm_sdk.models.common.lm_loading import DecoderVLM, finish_cpu_layout, load_with_lm_head
from vlm_sdk.weight_loading import ParamSlot


class QwenVLM(DecoderVLM):
    """What Qwen2.5-VL and Qwen3-VL share: M-RoPE positions computed once per prompt by the processor, an
    LLM and a `visual` tower loaded from the published layout (`lm_prefix`, `vision_prefix`, `lm_head`;
    `canonical_name` maps other spellings of the names to it)."""
    position_rows = 3  # M-RoPE: temporal, height, width
    lm_prefix, vision_prefix, lm_head = "model.", "visual.", "lm_head.weight"

    def canonical_name(self, name: str) -> str:
        return name

    def positions(self, prompt_positions: MRopePositions | None, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions `[3, end - start]`: the prompt's (`MRopePositions`, computed once by the
        processor), then index + rope_delta on all three axes for generated tokens."""
        return prompt_positions_at(prompt_positions, start, end)

    def checkpoint_map(self) -> dict[str, ParamSlot]:
        """Published checkpoint name -> slot, parameter names relative to this module."""
        slots = {name: s.under("decoder.") for name, s in self.decoder.checkpoint_map(self.lm_prefix, self.lm_head).items()}
        slots.update({name: s.under("visual.") for name, s in self.visual.checkpoint_map(self.vision_prefix).items()})
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str | Path | None = None) -> None:
        load_with_lm_head(self, self.decoder, weights, self.checkpoint_map(), lm_head=self.lm_head,
                          canonical=self.canonical_name, source=source)
        finish_cpu_layout(self, self.decoder)
