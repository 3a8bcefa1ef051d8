"""The model's parameters on this rank."""
from __future__ import annotations

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs


class Weights(MemoryConsumer):
    name, title, kind = "weights", "weights", "weights"

    def estimate(self, m: MemoryInputs) -> int:
        return m.weights.total
