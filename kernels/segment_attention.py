"""Attention within back-to-back segments (the vision tower's windows and whole images) in pure torch:
segments are grouped by length so that each length is one batched SDPA call. The torch backend runs
this; `varlen_attention` is its Triton counterpart.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# segments of one attention pattern: (length, flat token indices of every segment of that length, or
# None when all segments have this length and tile the sequence in order)
SegmentPlan = list[tuple[int, torch.Tensor | None]]


def segment_plan(lengths: list[int], device: torch.device | str) -> SegmentPlan:
    """Group back-to-back segments by length so that each length is one batched attention call."""
    if len(set(lengths)) == 1:
        return [(lengths[0], None)]
    groups: dict[int, list[int]] = {}
    start = 0
    for n in lengths:
        groups.setdefault(n, []).append(start)
        start += n
    plan: SegmentPlan = []
    for n, starts in groups.items():
        idx = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(n)  # [num_segments, n]
        plan.append((n, idx.flatten().to(device)))
    return plan


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # [N, H, D]
                      plan: SegmentPlan, scale: float) -> torch.Tensor:  # [N, H, D]
    n_tok, heads, dim = q.shape
    if plan[0][1] is None:
        n = plan[0][0]
        qs, ks, vs = (t.reshape(n_tok // n, n, heads, dim).transpose(1, 2) for t in (q, k, v))  # [S, H, n, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        return o.transpose(1, 2).reshape(n_tok, heads, dim)
    out = torch.empty_like(q)
    for n, idx in plan:
        qs, ks, vs = (t[idx].view(-1, n, heads, dim).transpose(1, 2) for t in (q, k, v))  # [S, H, n, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[idx] = o.transpose(1, 2).reshape(-1, heads, dim)
    return out
