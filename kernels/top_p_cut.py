"""Top-p for a row whose nucleus passes the sampler's candidates, without a host sync: in place,
one program per row.

    probs:  [rows, vocab] float32, last dim contiguous: tempered probabilities, not cut yet
    short:  [rows] bool         the rows to cut here (their candidates hold less mass than top_p)
    top_p:  [rows] float32      each row's mass cut

A short row keeps the tokens whose probability is at least tau, the LARGEST float32 with
mass(probs >= tau) >= top_p: the smallest prefix of the sorted row whose mass reaches top_p, the
token that crosses it included (as the full sort does), and every token tied with that one. tau is
found by bisection over float32 bit patterns in [0, 1.0] (non-negative floats order as their bits):
31 halvings of 0x3F800000, each a pass over the row, then one pass zeroes what falls below tau. Any
other row is zeroed outright: the sampler scatters its kept candidates back afterwards, as it does for
every row (a short row's candidates are all >= tau, so they are written back unchanged).

Why: `sample/top_k_top_p.py` first looks for each nucleus among the 1,024 most likely tokens; which
rows reach past them is only known on the device, and learning it on the host would stall the host
behind the forward at every step with such a row, which asynchronous scheduling exists to avoid.
Rows that are not short cost one zeroing pass (the `zero_()` this replaces); short rows (flat
distributions, rare with real models) cost ~32 passes over their row, from L2 for one row of 0.6 MB.

`top_p_cut_ref` is the same bisection in torch (the oracle; sums in another order, so a tau may differ
only where a row's mass lands within float32 rounding of top_p).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V = 4096
_ONE_BITS = 0x3F800000  # float32 1.0
_ITERS = 31  # ceil(log2(_ONE_BITS + 1)): lo == hi after these


@triton.jit(do_not_specialize=["stride", "vocab"])
def _top_p_cut_kernel(probs_ptr, short_ptr, top_p_ptr, stride, vocab,
                      ONE_BITS: tl.constexpr, ITERS: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * stride
    offs = tl.arange(0, BLOCK_V)
    if tl.load(short_ptr + row) == 0:
        for start in range(0, vocab, BLOCK_V):
            tl.store(base + start + offs, tl.zeros([BLOCK_V], tl.float32), mask=start + offs < vocab)
    else:
        p = tl.load(top_p_ptr + row)
        lo = 0  # mass(probs >= 0.0) = 1 >= p
        hi = ONE_BITS
        for _ in range(ITERS):
            mid = (lo + hi + 1) // 2
            tau = mid.to(tl.float32, bitcast=True)
            mass = 0.0
            for start in range(0, vocab, BLOCK_V):
                x = tl.load(base + start + offs, mask=start + offs < vocab, other=0.0)
                mass += tl.sum(tl.where(x >= tau, x, 0.0), axis=0)
            if mass >= p:
                lo = mid
            else:
                hi = mid - 1
        tau = lo.to(tl.float32, bitcast=True)
        for start in range(0, vocab, BLOCK_V):
            mask = start + offs < vocab
            x = tl.load(base + start + offs, mask=mask, other=0.0)
            tl.store(base + start + offs, tl.where(x >= tau, x, 0.0), mask=mask)


def _check(probs: torch.Tensor, short: torch.Tensor, top_p: torch.Tensor) -> None:
    if probs.dim() != 2 or probs.dtype != torch.float32 or (probs.shape[1] > 1 and probs.stride(1) != 1):
        raise ValueError(f"probs must be [rows, vocab] float32 with a contiguous last dim, got "
                         f"{list(probs.shape)} {probs.dtype}")
    rows = probs.shape[0]
    if short.shape != (rows,) or short.dtype != torch.bool or short.device != probs.device:
        raise ValueError(f"short must be [{rows}] bool on {probs.device}, got {list(short.shape)} {short.dtype}")
    if top_p.shape != (rows,) or top_p.dtype != torch.float32 or top_p.device != probs.device:
        raise ValueError(f"top_p must be [{rows}] float32 on {probs.device}, got {list(top_p.shape)} {top_p.dtype}")


def top_p_cut_(probs: torch.Tensor,  # [rows, vocab] float32, edited in place
               short: torch.Tensor,  # [rows] bool
               top_p: torch.Tensor,  # [rows] float32
               ) -> torch.Tensor:
    """Short rows cut to their top-p nucleus, the others zeroed (see the module docstring); `probs`."""
    _check(probs, short, top_p)
    rows, vocab = probs.shape
    if rows and vocab:
        block_v = min(triton.next_power_of_2(vocab), _BLOCK_V)
        _top_p_cut_kernel[(rows,)](probs, short.view(torch.uint8), top_p, probs.stride(0), vocab,
                                   ONE_BITS=_ONE_BITS, ITERS=_ITERS, BLOCK_V=block_v, num_warps=8)
    return probs


def top_p_cut_ref(probs: torch.Tensor,  # [rows, vocab] float32, edited in place
                  short: torch.Tensor,  # [rows] bool
                  top_p: torch.Tensor,  # [rows] float32
                  ) -> torch.Tensor:
    """Torch reference of `top_p_cut_`: the same bisection, every row at once."""
    _check(probs, short, top_p)
    rows = probs.shape[0]
    lo = torch.zeros(rows, dtype=torch.int32, device=probs.device)  # [rows]
    hi = torch.full((rows,), _ONE_BITS, dtype=torch.int32, device=probs.device)  # [rows]
    for _ in range(_ITERS):
        mid = (lo + hi + 1) // 2  # [rows]
        tau = mid.view(torch.float32)[:, None]  # [rows, 1]
        ok = torch.where(probs >= tau, probs, 0.0).sum(dim=1) >= top_p  # [rows]
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    keep = (probs >= lo.view(torch.float32)[:, None]) & short[:, None]  # [rows, vocab]
    return probs.mul_(keep)
