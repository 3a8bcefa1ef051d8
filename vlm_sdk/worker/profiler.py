"""Measure the activation peak of the largest step before sizing the KV cache on CUDA.

The cache gets what is left of `memory_utilization * total` after the weights and this peak, so the
profile must run the worst case the scheduler can produce: `max_num_batched_tokens` new tokens in
one forward, logits for `max_num_seqs` rows, and the largest image the engine's settings allow
through the vision tower (the model family's processor builds it: `largest_image()`).
"""
from __future__ import annotations

import torch

from vlm_sdk.config import CacheConfig
from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.worker.block_table import blocks_needed
from vlm_sdk.worker.kv_cache import allocate_kv_caches
from vlm_sdk.multimodal.inputs import ImageInput


def profile_num_tokens(max_num_batched_tokens: int, max_position_embeddings: int) -> int:
    """Tokens of the profiled step: a full token budget, but no longer than one sequence may be."""
    return min(max_num_batched_tokens, max_position_embeddings)


@torch.inference_mode()
def profile_peak_bytes(model, largest_image: ImageInput, *, num_tokens: int, num_seqs: int,
                       block_size: int, per_block: int, dtype: torch.dtype, device: torch.device,
                       attention: AttentionBackend) -> int:
    """Bytes allocated at the peak of a worst-case step, beyond what was allocated before it (the
    temporary cache of the profile itself excluded)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)

    blocks = blocks_needed(num_tokens, block_size)
    cache = CacheConfig(block_size, blocks, per_block, "profile")
    caches = allocate_kv_caches(model.num_layers, cache, model.num_kv_heads, model.head_dim, dtype, device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens], max_query_len=num_tokens, max_seq_len=num_tokens)
    meta = attention.prepare(meta, caches[0][0])
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device).expand(model.position_rows, -1)  # [rows, num_tokens]
    hidden = model(model.embed_tokens(ids), positions, caches, meta)  # [num_tokens, hidden]
    model.compute_logits(hidden[-min(num_seqs, num_tokens):])

    model.encode_images([largest_image])  # [image tokens, hidden]
    torch.cuda.synchronize(device)

    peak = torch.cuda.max_memory_allocated(device) - base - blocks * per_block
    del caches, hidden
    torch.cuda.empty_cache()
    return max(0, peak)
