"""Structured-output token mask applied to the logits in place: tokens a row's grammar forbids get -inf.

    logits:  [num_seqs, vocab]   float32 / bfloat16 / float16, last dim contiguous; edited in place
    rows:    [n] int32 / int64   the logits row of each bitmask row (on the logits' device)
    bitmask: [n, words] int32    bit t of word w allows token 32 w + t (xgrammar's layout); tokens past
                                 the last word (a logits vocabulary padded beyond the grammar's) are forbidden

Grid: 2-D, (n, vocabulary blocks of BLOCK_V). A program reads its BLOCK_V / 32 words and writes -inf
only where a bit is clear: no [n, vocab] temporaries (the torch reference makes a [n, words, 32]
int32 expansion, a bool mask and, for a subset of rows, a gathered copy of those rows: ~10 bytes
per vocabulary entry and row), and the other rows are never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_V = 1024


@triton.jit
def _token_bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, stride_logits, stride_mask, vocab, words,
                          BLOCK_V: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = offs < vocab
    word = offs // 32
    bits = tl.load(mask_ptr + i * stride_mask + word, mask=in_vocab & (word < words), other=0)
    allowed = ((bits >> (offs % 32)) & 1) != 0
    ninf = tl.full([BLOCK_V], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + offs, ninf, mask=in_vocab & ~allowed)


def _check(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be [num_seqs, vocab] in {_DTYPES}, got {list(logits.shape)} {logits.dtype}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError("logits need a contiguous last dim")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or (bitmask.shape[1] > 1 and bitmask.stride(1) != 1):
        raise ValueError(f"bitmask must be [n, words] int32 with a contiguous last dim, got "
                         f"{list(bitmask.shape)} {bitmask.dtype}")
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0] or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [{bitmask.shape[0]}] int32/int64, got {list(rows.shape)} {rows.dtype}")
    if not (rows.device == bitmask.device == logits.device):
        raise ValueError("logits, rows and bitmask must be on one device")


def apply_token_bitmask_(logits: torch.Tensor,  # [num_seqs, vocab], edited in place
                         rows: torch.Tensor,  # [n] the logits row of each bitmask row
                         bitmask: torch.Tensor,  # [n, words] int32
                         ) -> torch.Tensor:  # logits
    """-inf in `logits[rows[i]]` wherever `bitmask[i]` forbids the token."""
    _check(logits, rows, bitmask)
    n, vocab = bitmask.shape[0], logits.shape[1]
    if n > 0 and vocab > 0:
        block_v = min(triton.next_power_of_2(vocab), _BLOCK_V)
        _token_bitmask_kernel[(n, triton.cdiv(vocab, block_v))](
            logits, rows, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1],
            BLOCK_V=block_v, num_warps=4,
        )
    return logits


def apply_token_bitmask_ref(logits: torch.Tensor,  # [num_seqs, vocab], edited in place
                            rows: torch.Tensor,  # [n]
                            bitmask: torch.Tensor,  # [n, words] int32
                            ) -> torch.Tensor:  # logits
    """Torch reference of `apply_token_bitmask_`."""
    _check(logits, rows, bitmask)
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [n, min(vocab, 32 words)]
    if allowed.shape[1] < vocab:  # past the grammar's vocabulary: forbidden
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)  # [n, vocab]
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
