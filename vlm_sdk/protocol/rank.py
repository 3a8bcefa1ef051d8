"""What a rank reports to the engine at start-up: plain data, the same on every executor."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightBytes:
    """Parameter bytes of one rank by part (under tensor parallelism, its slices)."""
    language_model: int
    vision: int
    projector: int
    draft: int = 0  # a speculative draft's (EAGLE-3's head; its embedding only when it has its own)

    @property
    def total(self) -> int:
        return self.language_model + self.vision + self.projector + self.draft


@dataclass(frozen=True)
class RankLoad:
    """What one rank holds after loading."""
    rank: int
    device: str
    dtype: str  # the model's dtype on this rank, e.g. "bfloat16"
    weights: WeightBytes  # this rank's parameter bytes by part
    weights_allocated_bytes: int | None  # CUDA: memory_allocated growth while building and loading
    load_seconds: float
    num_layers: int
    num_kv_heads: int  # this rank's KV heads (what its cache holds per layer)
    head_dim: int
    bytes_per_block: int  # this rank's KV bytes per block of the shared pool (its KV heads, group_size layers, K and V)
    kv_cache_dtype: str = ""  # the cache's dtype, e.g. "bfloat16" or "float8_e4m3fn"; "": the model's
    state_slot_bytes: int = 0  # one request's state over this rank's state layers (0: none)
    stage_layers: tuple[int, int] | None = None  # pipeline parallelism: the decoder layers [start, stop) it holds
