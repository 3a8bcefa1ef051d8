"""Structured outputs in batched sampling: the constrained rows' logits are set to -inf outside their
grammar (the engine's `GrammarBitmask`), before penalties, temperature and the draw, so logprobs are
those of the constrained distribution. Rows without a grammar are not touched."""
from __future__ import annotations

import torch

from vlm_sdk.sample.device_lists import to_device


def _forbidden_bits(device: torch.device) -> torch.Tensor:  # [256, 8] bool
    """Row b: which of a byte's 8 bits are clear (bit k of byte b of word w is token 32w + 8b + k on a
    little-endian host, llguidance's layout read as bytes)."""
    return ((torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1) == 0


def forbidden_tokens(bitmask: torch.Tensor,  # [rows, words] int32, bit t of word w = token 32w + t
                     vocab: int) -> torch.Tensor:  # [rows, vocab] bool: True where the grammar forbids
    table = _forbidden_bits(bitmask.device)
    return table[bitmask.contiguous().view(torch.uint8).long()].flatten(1)[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor,  # [num_sampled, vocab], edited in place
                        rows: list[int],  # the constrained rows of `logits`, one per bitmask row
                        bitmask: torch.Tensor) -> None:  # [len(rows), words] int32, on the host
    """On CUDA one Triton launch writes -inf in place (kernels/token_bitmask.py: no [rows, vocab]
    temporaries); elsewhere torch, a byte lookup and an in-place fill per constrained row (no copy of
    the rows), which is also the kernel's reference here."""
    if logits.is_cuda:
        from vlm_sdk.kernels.token_bitmask import apply_token_bitmask_
        apply_token_bitmask_(logits, to_device(rows, torch.int32, logits.device),  # [n]
                             bitmask.to(logits.device, non_blocking=True))
        return
    vocab = logits.shape[1]
    forbidden = forbidden_tokens(bitmask.to(logits.device), vocab)  # [len(rows), <= vocab]
    if forbidden.shape[1] < vocab:  # logits wider than the grammar's vocabulary: the rest is forbidden
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab - forbidden.shape[1]), value=True)
    for j, r in enumerate(rows):
        logits[r].masked_fill_(forbidden[j], float("-inf"))
