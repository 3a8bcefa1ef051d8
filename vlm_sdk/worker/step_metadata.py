"""One step's metadata for every cache group of a model (`StepMetadata`): each attention group's
`AttentionMetadata` (its slots, its block-table rows, its window; the lengths are the step's), prepared by
the attention backend once per group, and one `StateMetadata` shared by the state groups. The runner, the
decode graphs, the memory profile and the kernel warm-up all build theirs here."""
from __future__ import annotations

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata, StateMetadata, StepMetadata
from vlm_sdk.protocol.cache_layout import CacheLayout


def step_metadata(layout: CacheLayout, caches: list, attention: AttentionBackend, common: dict,
                  slot_mapping, block_tables, state: StateMetadata | None = None) -> StepMetadata:
    """`common`: the `AttentionMetadata` fields every group shares (lengths, query starts); `slot_mapping`
    [groups, tokens] and `block_tables` [groups, batch, blocks] indexed by attention group; `state`: the
    state groups' (a model with state layers)."""
    metas = tuple(_prepare(attention, AttentionMetadata(slot_mapping=slot_mapping[g], block_tables=block_tables[g],
                                                        window=group.spec.window, **common), caches, group.layers)
                  for g, group in enumerate(layout.attention_groups))
    if layout.has_state:
        metas += (state,) * len(layout.state_groups)
    return StepMetadata(metas, layout.layer_group)


def _prepare(attention: AttentionBackend, meta: AttentionMetadata, caches: list, layers: tuple[int, ...]):
    """The backend's metadata of one group, from the shape of one K cache of it; None where a pipeline
    stage holds none of the group's layers (no layer here reads it)."""
    held = next((caches[i] for i in layers if caches[i] is not None), None)
    return None if held is None else attention.prepare(meta, held[0])


def synthetic_step_metadata(layout: CacheLayout, caches: list, attention: AttentionBackend,
                            meta: AttentionMetadata) -> StepMetadata:
    """A synthetic step (the memory profile, the kernel warm-up): every attention group reads and writes the
    blocks and slots of `meta`, each sequence the state slot of its row (modulo the slots there are: the
    values are thrown away) from token 0. `caches` as `worker.kv_cache.allocate_caches` made them."""
    common = {k: v for k, v in meta.fields().items() if k not in ("slot_mapping", "block_tables", "window")}
    groups = layout.num_attention_groups
    state = None
    if layout.has_state:
        b, device = meta.num_seqs, meta.seq_lens.device
        slots = caches[layout.state_layers[0]][0].shape[0]
        state = StateMetadata(meta.query_start_loc, list(meta.query_lens_cpu), torch.arange(b, device=device) % slots,
                              torch.zeros(b, dtype=torch.bool, device=device), [False] * b, meta.max_query_len)
    return step_metadata(layout, caches, attention, common, [meta.slot_mapping] * groups,
                         [meta.block_tables] * groups, state)


