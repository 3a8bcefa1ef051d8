"""A memory consumer: one thing that takes device memory, with the arithmetic that estimates it and the
name of the start-up profile's part that measures it on a GPU."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

from vlm_sdk.memory.inputs import MemoryInputs

# how a consumer's bytes enter the budget (vlm_sdk/memory/kv.py DeviceBudget)
KINDS = ("weights", "activation", "encoder_cache")


class MemoryConsumer(ABC):
    """Subclass, set `name` (the key in reports, JSON and the profile), `title` (words for the report) and
    `kind`, implement `estimate`, and add the class to `CONSUMERS` (consumers/__init__.py): `vlm-sdk plan`
    and engine start-up both count it, and both reports show it.

    kind "activation": memory that comes and goes with the steps, carved out of the device before the KV
    cache is sized (a consumer of a new step-time buffer is this kind); "weights": what loading took;
    "encoder_cache": a bound set aside before the KV cache. The KV cache itself is the rest
    (vlm_sdk/memory/kv.py)."""
    name: str
    title: str
    kind: str = "activation"

    def applies(self, m: MemoryInputs) -> bool:
        """Whether this engine has this consumer at all (e.g. graph pools only with CUDA graphs)."""
        return True

    @abstractmethod
    def estimate(self, m: MemoryInputs) -> int:
        """Bytes, from the model's shape and the settings alone."""

    def measured(self, m: MemoryInputs, profile: Mapping[str, int]) -> int | None:
        """Bytes the start-up profile measured on a GPU (`profile`: part name -> bytes, from the worker's
        profiler), or None when the profile has no part of this name: the estimate counts instead."""
        return profile.get(self.name)
