"""Tile sizes shared by the flash-attention-style kernels (`paged_prefill_attention`, `varlen_attention`)."""
from __future__ import annotations

import torch


def flash_launch_config(q: torch.Tensor, max_len: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for queries of at most `max_len` rows per program
    column. Chosen from offline sm_80/sm_90 compiles (cubin register use), not from timings: the largest
    tiles that keep the fp32 score tile and accumulator in registers without spills."""
    if q.device.type == "cpu":
        # interpreter: tiles small enough that test-sized sequences span several of them (any other
        # device gets the GPU tiles, "meta" included: the ahead-of-time compile check launches on meta)
        return 32, 32, 4, 1
    if q.element_size() == 4:
        # exact ("ieee") fp32 dots run on the FMA units, not tensor cores: small tiles, a parity path
        return 32, 16, 4 if block_d <= 64 else 8, 2
    block_n = 64 if block_d <= 64 else 32  # head_dim 80/128 spill with 64-key tiles
    if max_len <= 64:
        return 64, block_n, 4, 2  # short chunks and small windows: don't waste half a 128-row tile
    return 128, block_n, 8, 2
