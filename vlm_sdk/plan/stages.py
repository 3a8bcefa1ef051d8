"""`vlm-sdk plan --pp N`: each pipeline stage's memory, the stage that binds the shared block count, and
a layer partition that balances the stages.

Each stage's model is built on the meta device as its tensor-parallel rank 0 builds it
(`ParallelGroups.of_stage`): its weights are what its worker reports at start-up. Its KV share of a block
is the pages of the KV tensors its layers view (protocol/stage_layout.py); its blocks are sized by the
engine's own rules (`size_cache`) on its own budget, and every stage holds the smallest count (one block
table serves them all): the stage with the fewest binds. The balancing partition is the contiguous
split that minimises the largest stage's bytes (its fixed parts, its layers' weights and their KV at the
binding block count), by dynamic programming over the layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.memory.breakdown import breakdown
from vlm_sdk.memory.kv import size_cache
from vlm_sdk.memory.weights import weight_bytes
from vlm_sdk.models.pipeline import PPMissingLayer
from vlm_sdk.protocol.cache_spec import AttentionSpec
from vlm_sdk.protocol.stage_layout import stage_block_bytes


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, int]  # [start, stop)
    weights_bytes: int  # per tensor-parallel rank of the stage
    activation_peak_bytes: int  # the step-time consumers' estimate (rank 0's inputs: the same step)
    kv_bytes_per_block: int
    num_blocks_possible: int  # the blocks this stage alone could hold

    def to_dict(self) -> dict:
        return {"stage": self.stage, "layers": list(self.layers), "weights_bytes": self.weights_bytes,
                "activation_peak_bytes": self.activation_peak_bytes, "kv_bytes_per_block": self.kv_bytes_per_block,
                "num_blocks_possible": self.num_blocks_possible}


def plan_stages(family, info, args, parallel, dtype: torch.dtype, m, device_memory: int | None,
                other_use: int) -> tuple[tuple[StagePlan, ...], tuple[int, ...]]:
    """(each stage's plan, a balancing partition). `m`: rank 0's `MemoryInputs` (the engine sizes every
    rank from them, with each rank's own bytes per block and budget)."""
    parts = breakdown(m)
    stages, models = [], []
    for s in range(parallel.pipeline_parallel_size):
        with torch.device("meta"):
            model = family.model_cls(info.hf_config, dtype=dtype, device="meta",
                                     parallel=ParallelGroups.of_stage(parallel, s), shard_vision=args.shard_vision)
        models.append(model)
        layers = model.stage_layers
        weights = weight_bytes(model).total
        per_block = stage_block_bytes(m.layout, layers, args.block_size)
        budget = None if device_memory is None else parts.budget(device_memory, other_use + weights)
        cache = size_cache(args, per_block or 1, m.max_position_embeddings, budget, None, m.layout)
        stages.append(StagePlan(s, layers, weights, parts.activation_bytes, per_block, max(cache.num_blocks, 0)))
    blocks = min(st.num_blocks_possible for st in stages)
    return tuple(stages), balanced_partition(models, stages, m.layout, args.block_size, blocks)


def balanced_partition(models, stages, layout, block_size: int, blocks: int) -> tuple[int, ...]:
    """The contiguous layer counts minimising the largest stage's weights + KV at `blocks` blocks."""
    n, k = layout.num_layers, len(stages)
    layer_w = [0] * n
    for model in models:
        for i, layer in enumerate(model.decoder.layers):
            if not isinstance(layer, PPMissingLayer):
                layer_w[i] = sum(p.numel() * p.element_size() for p in layer.parameters())
    page = layout.page_spec.page_bytes(block_size)
    cost = [layer_w[i] + (page * blocks if isinstance(layout.specs[i], AttentionSpec) else 0) for i in range(n)]
    # fixed parts: the first stage's embedding and tower, the last's head (what a stage holds besides layers)
    fixed = [st.weights_bytes - sum(layer_w[st.layers[0]:st.layers[1]]) for st in stages]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the smallest largest-stage bytes placing layers [0, j) on stages [0, s]
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for j in range(1, n + 1):
        best[0][j] = fixed[0] + prefix[j]
    for s in range(1, k):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], fixed[s] + prefix[j] - prefix[i])
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    counts, j = [], n
    for s in range(k - 1, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return tuple(reversed(counts))
