"""Measure the activation peak of the largest step before sizing the KV cache on CUDA.

The cache gets what is left of `memory_utilization * total` after the weights and this peak, so the
profile must run the worst case the scheduler can produce: `max_num_batched_tokens` new tokens in
one forward, logits for `max_num_seqs` rows, and one image of `max_pixels` through the vision tower.
"""
from __future__ import annotations

import math

import torch

from vlm_sdk.config import CacheConfig
from vlm_sdk.engine.attention_metadata import AttentionMetadata
from vlm_sdk.engine.block_manager import blocks_needed
from vlm_sdk.engine.kv_cache import allocate_kv_caches


def max_image_grid(image_processor, max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) patches of the image the profile runs through the vision tower: as many
    (patch * merge)^2 cells as fit in `max_pixels`, in a rectangle of aspect ratio at most 2 (a few
    cells fewer when the count does not factor so). A square image can fall well short: 1001x1001 at
    max_pixels 28*28*1280 resizes to 35x35 = 1225 cells, a 896x1120 one to all 1280."""
    m = image_processor.merge_size
    factor = image_processor.patch_size * m
    for cells in range(max(1, max_pixels // (factor * factor)), 0, -1):
        rows = next(d for d in range(math.isqrt(cells), 0, -1) if cells % d == 0)
        if cells // rows <= 2 * rows:
            return 1, rows * m, cells // rows * m
    return 1, m, m


def max_image_patches(image_processor, max_pixels: int) -> int:
    """Patches of the profiled max_pixels image: the most one vision-tower call may take
    (`ModelRunner(max_vision_patches=...)`) for the profiled peak to hold."""
    t, h, w = max_image_grid(image_processor, max_pixels)
    return t * h * w


@torch.inference_mode()
def profile_peak_bytes(model, image_processor, *, num_tokens: int, num_seqs: int, max_pixels: int,
                       block_size: int, per_block: int, dtype: torch.dtype, device: torch.device) -> int:
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
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device).expand(3, -1)
    hidden = model(model.embed_tokens(ids), positions, caches, meta)  # [num_tokens, hidden]
    model.compute_logits(hidden[-min(num_seqs, num_tokens):])

    t, h, w = max_image_grid(image_processor, max_pixels)
    patch_dim = 3 * image_processor.temporal_patch_size * image_processor.patch_size ** 2
    pixels = torch.zeros(t * h * w, patch_dim, dtype=dtype, device=device)
    model.encode_images(pixels, [(t, h, w)])
    torch.cuda.synchronize(device)

    peak = torch.cuda.max_memory_allocated(device) - base - blocks * per_block
    del caches, hidden, pixels
    torch.cuda.empty_cache()
    return max(0, peak)
