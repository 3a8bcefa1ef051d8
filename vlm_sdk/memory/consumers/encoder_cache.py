"""The encoder cache (vision embeddings kept for reuse): counted at its bound, encoder_cache_memory. It
fills while the engine serves, after the KV cache is allocated, so its bound is set aside first."""
from __future__ import annotations

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs


class EncoderCache(MemoryConsumer):
    name, title, kind = "encoder_cache", "encoder cache (encoder_cache_memory)", "encoder_cache"

    def applies(self, m: MemoryInputs) -> bool:
        return m.args.encoder_cache_memory > 0

    def estimate(self, m: MemoryInputs) -> int:
        return m.args.encoder_cache_memory

    def measured(self, m: MemoryInputs, profile) -> int:
        return m.args.encoder_cache_memory  # a bound, not a measurement: the same on every device
