"""The sampler's draw in one launch: token = argmax_v probs[v] / q[v], q[v] = -log(u[v]) ~ Exp(1),
with u drawn in the kernel from Philox keyed by the row's seed (`tl.rand(seed, v)`).

    probs:  [rows, vocab] float32, last dim contiguous (zero outside what a row keeps)
    seeds:  [rows] int64        the Philox key of each row's draw
    out:    [rows] int64        the drawn tokens

The exponential race draws exactly from each row's probs. Doing it in the kernel writes no [rows,
vocab] buffer of draws (the torch path writes q, then probs / q: 12 bytes per entry of traffic more)
and needs no launch per seeded row: each row carries its own key. Grid: 2-D, (rows, vocabulary
blocks of BLOCK_V); each program leaves its block's best score and token in a [rows, blocks]
partial, and a small torch argmax picks the block.

`exponential_race_ref` recomputes Triton's Philox (10 rounds, 32-bit counters: counter (v, 0, 0, 0),
key (seed low, seed high)) and its uniform conversion in torch integer arithmetic: the same tokens,
bit for bit, on any device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V = 2048
_M32 = 0xFFFFFFFF


@triton.jit
def _exponential_race_kernel(probs_ptr, seeds_ptr, best_ptr, token_ptr, stride_probs, vocab, num_blocks,
                             BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < vocab
    p = tl.load(probs_ptr + row * stride_probs + offs, mask=mask, other=0.0)
    u = tl.rand(tl.load(seeds_ptr + row), offs)  # [BLOCK_V] in [0, 1)
    score = tl.where(mask, p / -tl.log(u), -1.0)  # u = 0: an infinite wait, score 0
    best, at = tl.max(score, axis=0, return_indices=True)
    tl.store(best_ptr + row * num_blocks + blk, best)
    tl.store(token_ptr + row * num_blocks + blk, (blk * BLOCK_V + at).to(tl.int64))


def _check(probs: torch.Tensor, seeds: torch.Tensor) -> None:
    if probs.dim() != 2 or probs.dtype != torch.float32 or (probs.shape[1] > 1 and probs.stride(1) != 1):
        raise ValueError(f"probs must be [rows, vocab] float32 with a contiguous last dim, got "
                         f"{list(probs.shape)} {probs.dtype}")
    if seeds.shape != (probs.shape[0],) or seeds.dtype != torch.int64 or seeds.device != probs.device:
        raise ValueError(f"seeds must be [{probs.shape[0]}] int64 on {probs.device}, got {list(seeds.shape)} "
                         f"{seeds.dtype} on {seeds.device}")


def exponential_race(probs: torch.Tensor,  # [rows, vocab] float32
                     seeds: torch.Tensor,  # [rows] int64
                     ) -> torch.Tensor:  # [rows] int64
    """One token per row, drawn from `probs` with the row's seed."""
    _check(probs, seeds)
    rows, vocab = probs.shape
    block_v = min(triton.next_power_of_2(max(vocab, 1)), _BLOCK_V)
    num_blocks = triton.cdiv(vocab, block_v)
    best = torch.empty(rows, num_blocks, dtype=torch.float32, device=probs.device)  # [rows, blocks]
    token = torch.empty(rows, num_blocks, dtype=torch.int64, device=probs.device)  # [rows, blocks]
    if rows and vocab:
        _exponential_race_kernel[(rows, num_blocks)](probs, seeds, best, token, probs.stride(0), vocab, num_blocks,
                                                     BLOCK_V=block_v, num_warps=8)
    return token.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]


def _umul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a x b for a 32-bit constant and a tensor of 32-bit values in int64."""
    bh, bl = b >> 16, b & 0xFFFF
    x, y = a * bh, a * bl  # < 2^48 each
    return (x + (y >> 16)) >> 16, (((x & 0xFFFF) << 16) + y) & _M32


def uniforms_ref(seeds: torch.Tensor,  # [rows] int64
                 vocab: int) -> torch.Tensor:  # [rows, vocab] float32
    """Triton's `tl.rand(seed, v)` for v < vocab, in torch."""
    dev = seeds.device
    k0 = (seeds & _M32)[:, None]  # [rows, 1]
    k1 = ((seeds >> 32) & _M32)[:, None]
    c0 = torch.arange(vocab, dtype=torch.int64, device=dev)[None, :].expand(len(seeds), vocab)  # [rows, vocab]
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _umul32(0xCD9E8D57, c2)
        hi_a, lo_a = _umul32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    x = torch.where(c0 >= 2 ** 31, c0 - 2 ** 32, c0)  # the int32 bit pattern
    x = torch.where(x < 0, ~x, x).to(torch.int32)
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32, device=dev)


def exponential_race_ref(probs: torch.Tensor,  # [rows, vocab] float32
                         seeds: torch.Tensor,  # [rows] int64
                         ) -> torch.Tensor:  # [rows] int64
    """Torch reference of `exponential_race`: the same draws, the same tokens."""
    _check(probs, seeds)
    return (probs / -uniforms_ref(seeds, probs.shape[1]).log()).argmax(dim=1)
