"""The metadata of a synthetic step (the memory profile, the kernel warm-up), for every cache group of
a model: each attention group reads and writes the blocks and slots of one `AttentionMetadata` (with its
own window), each sequence the state slot of its row, from token 0. The runner builds real steps'
metadata itself (worker/model_runner.py)."""
from __future__ import annotations

import dataclasses

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata, StateMetadata, StepMetadata
from vlm_sdk.protocol.cache_layout import CacheLayout


def synthetic_step_metadata(layout: CacheLayout, caches: list, attention: AttentionBackend,
                            meta: AttentionMetadata) -> StepMetadata:
    """`caches` as `worker.kv_cache.allocate_caches` made them, with at least `meta.num_seqs` state slots."""
    metas = tuple(attention.prepare(dataclasses.replace(meta, window=g.spec.window), caches[g.layers[0]][0])
                  for g in layout.attention_groups)
    if layout.has_state:
        b, device = meta.num_seqs, meta.seq_lens.device
        state = StateMetadata(meta.query_start_loc, list(meta.query_lens_cpu), torch.arange(b, device=device),
                              torch.zeros(b, dtype=torch.bool, device=device), [False] * b, meta.max_query_len)
        metas += (state,) * len(layout.state_groups)
    return StepMetadata(metas, layout.layer_group)
