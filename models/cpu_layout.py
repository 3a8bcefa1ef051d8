"""CPU weight layout: store Linear weights (and an untied `ParallelLMHead`) transposed.

oneDNN/MKL on the CPU multiply a few rows by a `[out, in]` row-major weight several times slower
than by the same weight stored `[in, out]` (measured on 2 cores: 16 x 512 by 151936 x 512 takes
63 ms row-major, 31 ms transposed; a 16-row decoder projection 1.06 ms vs 0.24 ms). `F.linear` takes
the fast path when the weight is a transposed view of `[in, out]` storage, so we keep the logical
shape and change only the strides. Decoding is exactly those few-row products.

The LM head is the exception where oneDNN is available: its float32 product goes through oneDNN on the
row-major weight (`OneDnnLMHead`), faster than MKL in either layout (`vlm-sdk bench --cpu-gemm`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.cpu_gemm import onednn_available, onednn_linear
from vlm_sdk.layers.embedding import ParallelLMHead
from vlm_sdk.layers.moe import SparseMoeBlock


def column_major(weight: torch.Tensor) -> nn.Parameter:
    """Same values and logical shape `[out, in]`, storage laid out `[in, out]`."""
    return nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)


@torch.no_grad()
def use_cpu_weight_layout(module: nn.Module) -> None:
    """Re-lay every Linear weight (the parallel linear layers are `nn.Linear`s), LM head and sparse
    MoE layer's experts under `module`; a no-op off the CPU. A float32 LM head that oneDNN will run
    (`OneDnnLMHead.applies`) stays row-major: oneDNN reads that layout fastest."""
    for sub in module.modules():
        if isinstance(sub, ParallelLMHead) and OneDnnLMHead.applies(sub.weight):
            continue
        if isinstance(sub, (nn.Linear, ParallelLMHead)) and sub.weight.device.type == "cpu":
            sub.weight = column_major(sub.weight)
        elif isinstance(sub, SparseMoeBlock):
            sub.use_cpu_layout()


class OneDnnLMHead:
    """The LM head as oneDNN's float32 product (layers/cpu_gemm.py) on the row-major weight.

    The head is the largest product of every decode step. `vlm-sdk bench --cpu-gemm` on the Gemma 3
    bench head (262,208 x 640, 2 threads, loaded VM, 2026-12-02): 16 rows 117 ms against MKL packed's
    218 ms and F.linear's 308 ms; 1 row 92 ms against 125 ms (MKL packed) and 147 ms. Not bit-equal to
    `F.linear` (another summation order, within float32's reduction bound: tests/models/test_cpu_layout.py)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [vocab, hidden], row-major

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        return onednn_linear(hidden, self.weight)


class PackedLMHead:
    """The LM head as MKL's pre-packed float32 GEMM, for a CPU torch without oneDNN.

    The head is the largest product of every decode step (vocab x hidden). MKL's packed format is
    ~30% faster than either plain layout at the row count it was packed for (16 x 512 by 151936 x 512:
    23 ms vs 31 ms) and several times slower at any other, so rows up to 16 are padded to 16. One or two
    rows, and more than 16, go through `F.linear` on `fallback` instead: past 16 rows packed passes read
    the whole weight once per 16 rows, `F.linear` once (a flood's step beside ~20 text streams had 19-25
    rows; on the loaded 2-core machine, thread CPU time, 151936 x 512: 19 rows 185 ms packed in two passes
    against 114 ms in one `F.linear`, 24 rows 216 against 86, 32 rows 164 against 103). At 16 rows the result
    equals `F.linear`'s exactly (checked at construction); where the private MKL ops are missing or disagree,
    `create` returns None and the caller keeps `F.linear`.
    """

    ROWS = 16

    def __init__(self, packed: torch.Tensor, fallback: torch.Tensor):
        self.packed = packed
        self.fallback = fallback  # [vocab, hidden], any layout
        self._stub = torch.empty(1, dtype=fallback.dtype).expand(fallback.shape)  # shape only

    @classmethod
    @torch.no_grad()
    def create(cls, weight: torch.Tensor) -> "PackedLMHead | None":
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        try:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), cls.ROWS)
            head = cls(packed, weight)
            probe = torch.randn(cls.ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
            # at its row count (fewer rows are padded to it); F.linear at 3 rows runs another kernel, whose
            # sums differ in the last bits
            if not torch.equal(head(probe), F.linear(probe, weight)):
                return None
            return head
        except (AttributeError, RuntimeError):
            return None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        rows = hidden.shape[0]
        if rows <= 2 or rows > self.ROWS:  # one pass over the weight, whatever the rows
            return F.linear(hidden, self.fallback)
        if rows != self.ROWS:
            hidden = torch.cat([hidden, hidden.new_zeros(self.ROWS - rows, hidden.shape[1])])
        return torch.ops.mkl._mkl_linear(hidden, self.packed, self._stub, None, self.ROWS)[:rows]
