"""One pipeline stage's share of a model's cache layout (`CacheLayout`, the whole model's: the engine's
groups and block tables are the same for every stage, so one block id means the same page on all of them).

A stage allocates only what its layers view: of the `group_size` KV tensors, those its attention layers
use (`layer_tensor`), and the state tensors of its state layers. A model of one attention kind puts
layer i on tensor i, so a stage of k layers holds k / num_layers of the pool's bytes per block. A stage
whose layers are all state layers (Qwen3.5's linear-attention runs) holds no KV tensor at all: its bytes
per block are 0 and its blocks cost it nothing (the other stages size the pool).
"""
from __future__ import annotations

from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.protocol.cache_spec import AttentionSpec, StateSpec


def stage_tensors(layout: CacheLayout, layers: tuple[int, int]) -> tuple[int, ...]:
    """The KV tensors (indices into the pool's `group_size`) the attention layers in [start, stop) view."""
    return tuple(sorted({layout.layer_tensor[i] for i in range(*layers) if isinstance(layout.specs[i], AttentionSpec)}))


def stage_block_bytes(layout: CacheLayout, layers: tuple[int, int], block_size: int) -> int:
    """One block of the shared pool on this stage: a page in each KV tensor its layers view."""
    return len(stage_tensors(layout, layers)) * layout.page_spec.page_bytes(block_size)


def stage_state_slot_bytes(layout: CacheLayout, layers: tuple[int, int]) -> int:
    """One request's state over this stage's state layers."""
    return sum(layout.specs[i].slot_bytes for i in range(*layers) if isinstance(layout.specs[i], StateSpec))
