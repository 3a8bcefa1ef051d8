"""Rotary positions of a step's tokens, from what the prompt carried (the model contract's part).

Today every model takes M-RoPE positions `[3, N]`: the prompt's precomputed ones for prompt tokens,
then `index + rope_delta` on all three axes for generated tokens. A model that computes its own
positions (1 or 3 rows) changes only this module.
"""
from __future__ import annotations

import torch


def positions(mrope_positions: torch.Tensor | None,  # [3, num_prompt_tokens] int64, or None: arange
              rope_delta: int, num_prompt_tokens: int, start: int, end: int) -> torch.Tensor:
    """Positions `[3, end - start]` int64 of token indices start..end of one request."""
    parts = []
    if start < num_prompt_tokens:
        if mrope_positions is not None:
            parts.append(mrope_positions[:, start:min(end, num_prompt_tokens)])
        else:
            parts.append(torch.arange(start, min(end, num_prompt_tokens)).expand(3, -1))
    if end > num_prompt_tokens:
        tail = torch.arange(max(start, num_prompt_tokens), end) + rope_delta  # [n_generated]
        parts.append(tail.expand(3, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
