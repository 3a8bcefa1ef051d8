"""Bidirectional attention within each image's tokens (Gemma 3: transformers' `token_type_ids` mask, whose
blocks are the runs of image tokens): the last key each query of a step may see.

    key_limits[i] = position of token i                                    a text token (causal)
                  = position of the last token of i's run of image tokens  an image token
                                                   in this step's chunk of i's sequence

A run is a maximal stretch of consecutive image rows of the packed step within one sequence: the
families that use this wrap every image in begin / end tokens, so two images never touch. Built on the
device from the step's image rows, its positions and its query_start_loc (no host read: prefill steps
are launched without waiting on the device). The attention kernels read keys up to key_limits[i] (and,
in a sliding-window layer, after p - window: kernels/paged_prefill_attention.py).

A chunk must hold the rest of every image it starts (the scheduler does not end a prefill chunk inside
an image of such a model): tokens of an image computed in an earlier chunk could not see the later ones.
"""
from __future__ import annotations

import torch


def image_key_limits(positions: torch.Tensor,  # [N] int64: each packed token's position in its sequence
                     image_rows: torch.Tensor,  # [n] int64: the packed rows of the step's image tokens
                     query_start_loc: torch.Tensor,  # [batch + 1] int32: where each sequence's chunk starts
                     ) -> torch.Tensor:  # [N] int32
    limits = positions.to(torch.int32)  # a copy: text tokens see up to themselves
    n = image_rows.numel()
    if n == 0:
        return limits
    rows = image_rows.sort().values  # [n]
    starts = torch.zeros(positions.numel() + 1, dtype=torch.bool, device=positions.device)
    starts[query_start_loc[:-1].long()] = True  # a sequence's first row: a run never continues into it
    ends = torch.ones(n, dtype=torch.bool, device=positions.device)  # [n]: the last row of its run
    ends[:-1] = (rows[1:] != rows[:-1] + 1) | starts[rows[1:]]
    index = torch.where(ends, torch.arange(n, device=rows.device), n)  # [n]
    run_end = index.flip(0).cummin(0).values.flip(0)  # [n]: the index of each row's run end
    limits[rows] = positions[rows[run_end]].to(torch.int32)
    return limits
