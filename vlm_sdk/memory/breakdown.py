"""One pipeline for `vlm-sdk plan` and engine start-up: every consumer's bytes (measured where the GPU
profile measured it, estimated otherwise), then the KV cache from what is left.

    plan:      breakdown(inputs)                      every consumer estimated
    start-up:  breakdown(inputs, profile)             on a GPU, the profile's parts measured per rank
    both:      budget(breakdown, total, in_use)       -> DeviceBudget -> kv.size_cache -> the KV cache
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from vlm_sdk.memory import consumers as registry
from vlm_sdk.memory.consumers import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs
from vlm_sdk.memory.kv import DeviceBudget


@dataclass(frozen=True)
class ConsumerBytes:
    name: str
    title: str
    kind: str  # "weights", "activation" or "encoder_cache" (consumers/base.py)
    bytes: int
    measured: bool  # the GPU profile measured it (else: estimated from the shape and settings)

    def to_dict(self) -> dict:
        return {"name": self.name, "title": self.title, "kind": self.kind, "bytes": self.bytes,
                "measured": self.measured}


@dataclass(frozen=True)
class Breakdown:
    consumers: tuple[ConsumerBytes, ...]

    def bytes_of(self, kind: str) -> int:
        return sum(c.bytes for c in self.consumers if c.kind == kind)

    def get(self, name: str) -> ConsumerBytes | None:
        return next((c for c in self.consumers if c.name == name), None)

    @property
    def activation_bytes(self) -> int:
        """What the step-time consumers take: carved out of the device before the KV cache is sized."""
        return self.bytes_of("activation")

    def budget(self, total_bytes: int, in_use_bytes: int) -> DeviceBudget:
        """The device budget the KV cache comes out of; `in_use_bytes`: taken before the cache (measured
        on a GPU: the weights, the CUDA context, other processes; planned: the weights and what is in use)."""
        return DeviceBudget(total_bytes, in_use_bytes, self.activation_bytes, self.bytes_of("encoder_cache"))

    def to_list(self) -> list[dict]:
        return [c.to_dict() for c in self.consumers]


def breakdown(inputs: MemoryInputs, profile: Mapping[str, int] | None = None,
              consumers: tuple[MemoryConsumer, ...] | None = None) -> Breakdown:
    """Every consumer that applies, in order; with `profile` (a GPU rank's measured parts, by consumer
    name) a consumer the profile measured counts its measurement."""
    rows = []
    for c in registry.CONSUMERS if consumers is None else consumers:  # looked up now: tests may add one
        if not c.applies(inputs):
            continue
        measured = None if profile is None else c.measured(inputs, profile)
        rows.append(ConsumerBytes(c.name, c.title, c.kind, c.estimate(inputs) if measured is None else measured,
                                  measured is not None))
    return Breakdown(tuple(rows))
