"""Structured outputs in batched sampling: the constrained rows' logits are set to -inf outside their
grammar (the engine's `GrammarBitmask`), before penalties, temperature and the draw, so logprobs are
those of the constrained distribution. Rows without a grammar are not touched."""
from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor,  # [rows, words] int32, bit t of word w = token 32w + t
                   vocab: int) -> torch.Tensor:  # [rows, vocab] bool
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    return ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor,  # [num_sampled, vocab], edited in place
                        rows: list[int],  # the constrained rows of `logits`, one per bitmask row
                        bitmask: torch.Tensor) -> None:  # [len(rows), words] int32, on the host
    """On CUDA one Triton launch writes -inf in place (kernels/token_bitmask.py: no [rows, vocab]
    temporaries); elsewhere torch, which is also its reference."""
    if logits.is_cuda:
        from vlm_sdk.kernels.token_bitmask import apply_token_bitmask_
        index = torch.tensor(rows, dtype=torch.int32).pin_memory().to(logits.device, non_blocking=True)  # [n]
        apply_token_bitmask_(logits, index, bitmask.pin_memory().to(logits.device, non_blocking=True))
        return
    vocab = logits.shape[1]
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), vocab)  # [len(rows), vocab]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)  # [len(rows)]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
