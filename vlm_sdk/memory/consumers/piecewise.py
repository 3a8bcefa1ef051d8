"""Piecewise CUDA graphs (vlm_sdk/worker/piecewise_graphs.py): their hand-over buffers and per-bucket
outputs (`held_bytes`, arithmetic) and their pool, bounded by a plain forward of the token budget (a
piece is a part of one layer's work)."""
from __future__ import annotations

import torch

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token-count buckets: powers of two from 16, then the budget itself (padding at most 2x)."""
    sizes, n = [], 16
    while n < max_num_batched_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_num_batched_tokens]


def held_bytes(max_num_batched_tokens: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
               position_rows: int, dtype: torch.dtype) -> int:
    """What the graphs hold for good besides their pool's temporaries, an upper bound: the hand-over
    buffers at the largest bucket (embeddings, residual, q, k, v, attention output, positions), and
    per bucket its final hidden states and rotary inputs (cos and sin, float32, with the torch set):

        N = max_num_batched_tokens, S = sum of the buckets (< 2 N), e = dtype bytes
        N * (2 hidden + 2 H D + 2 Hkv D) * e + N * 8 * position_rows + S * (hidden * e + 4 D)
    """
    e = torch.finfo(dtype).bits // 8
    n, total = max_num_batched_tokens, sum(piecewise_sizes(max_num_batched_tokens))
    return (n * (2 * hidden + 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim) * e + n * 8 * position_rows
            + total * (hidden * e + 4 * head_dim))


class PiecewiseGraphs(MemoryConsumer):
    name, title = "piecewise_graphs", "piecewise CUDA graphs"

    def applies(self, m: MemoryInputs) -> bool:
        return m.on_gpu and m.piecewise_graphs

    def estimate(self, m: MemoryInputs) -> int:
        n = m.args.max_num_batched_tokens
        return m.forward_bytes(n) + held_bytes(n, m.hidden_size, m.num_heads, m.num_kv_heads_total, m.head_dim,
                                               m.position_rows, m.dtype)
