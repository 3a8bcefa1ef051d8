"""Linear layers ready for tensor parallelism (vLLM's split), each loading only its own slice.

    ColumnParallelLinear       y = x W^T + b, W [out, in]: rank r holds rows [r*out/tp, (r+1)*out/tp) of W
                               and b; its output is that slice of y (gathered, or fed to a row layer)
    MergedColumnParallelLinear several column layers fused on the output dim (gate | up): each part is
                               split, rank r holding [gate_r | up_r]
    QKVParallelLinear          the merged q | k | v projection, split by heads: H/tp q heads; Hkv/tp kv heads
                               when tp divides Hkv, else (Hkv < tp, Hkv divides tp) ONE kv head per rank,
                               replicated: rank r holds kv head r // (tp / Hkv), as vLLM does
    RowParallelLinear          W [out, in]: rank r holds columns [r*in/tp, (r+1)*in/tp) and takes that slice
                               of x; its partial product (the bias added by rank 0 only) is all-reduced, so
                               every rank returns the whole output

    column -> row composition, as in an MLP:   all_reduce_r(row_r(act(column_r(x)))) == row(act(column(x)))

Each layer is an `nn.Linear` over its LOCAL shape, so the matmul is exactly `F.linear` (the CPU weight
layout of models/cpu_layout.py applies unchanged). `slots(...)` gives the `ParamSlot`s that load each
checkpoint tensor's slice for this rank (`weight_loading.Shard`); with one rank they are plain slots
(no shard). The one collective is RowParallelLinear's all-reduce (`TPGroup.all_reduce`: an identity
with one rank, or with no process group when tests compose ranks by hand and sum the partials).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import ParamSlot, Shard, SplitSlot


def _shard(tp: TPGroup, dim: int, local: int) -> Shard | None:
    return None if tp.size == 1 else Shard(dim, tp.rank * local, local)


class _Linear(nn.Linear):
    """`nn.Linear` over the local shape with uninitialised storage (weights come from a checkpoint).
    `matmul`: the product (x, weight, bias) -> x W^T + b it runs; None: F.linear (a kernel set may give
    another, e.g. for few rows: `KernelOps.small_m_linear`)."""

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, tp: TPGroup):
        super().__init__(in_local, out_local, bias=bias, device="meta", dtype=dtype)
        # allocated where they belong, not `to_empty`: under a torch.device context its empty_like runs
        # torch's reference kernels, whose first use imports sympy (~1 s of start-up)
        self.weight = nn.Parameter(torch.empty(out_local, in_local, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, device=device, dtype=dtype))
        self.tp = tp
        self.matmul = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        return self._product(x, self.bias)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias) if self.matmul is None else self.matmul(x, self.weight, bias)


class ColumnParallelLinear(_Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        super().__init__(input_size, tp.split(output_size, "output features"), bias, dtype, device, tp)
        self.input_size, self.output_size = input_size, output_size

    def slots(self, param_prefix: str, weight: str, bias: str | None = None) -> dict[str, ParamSlot]:
        """Checkpoint names `weight` `[out, in]` (and `bias` `[out]`) -> this rank's rows."""
        local = self.out_features
        out = {weight: ParamSlot(f"{param_prefix}weight", (self.output_size, self.input_size),
                                 shard=_shard(self.tp, 0, local))}
        if bias is not None:
            out[bias] = ParamSlot(f"{param_prefix}bias", (self.output_size,), shard=_shard(self.tp, 0, local))
        return out


class MergedColumnParallelLinear(_Linear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        self.output_sizes = tuple(output_sizes)
        rows = [self._part_rows(i, n, tp) for i, n in enumerate(output_sizes)]  # (start, length) per part
        super().__init__(input_size, sum(n for _, n in rows), bias, dtype, device, tp)
        self.input_size = input_size
        self.part_starts, self.local_sizes = tuple(a for a, _ in rows), tuple(n for _, n in rows)

    def _part_rows(self, index: int, size: int, tp: TPGroup) -> tuple[int, int]:
        """(first row, rows) of part `index` (`size` rows) that this rank holds: its 1/tp share."""
        local = tp.split(size, "output features of each merged part")
        return tp.rank * local, local

    def _part_shard(self, index: int) -> Shard | None:
        if self.tp.size == 1:
            return None
        return Shard(0, self.part_starts[index], self.local_sizes[index])

    def slots(self, param_prefix: str, weights: list[str], biases: list[str] | None = None) -> dict[str, ParamSlot]:
        """Checkpoint names of the parts, in order (`[size_i, in]` weights, `[size_i]` biases) -> this
        rank's rows of each part, placed back to back."""
        out: dict[str, ParamSlot] = {}
        start = 0
        for i, (full, local) in enumerate(zip(self.output_sizes, self.local_sizes)):
            shard = self._part_shard(i)
            out[weights[i]] = ParamSlot(f"{param_prefix}weight", (full, self.input_size), start, shard)
            if biases is not None:
                out[biases[i]] = ParamSlot(f"{param_prefix}bias", (full,), start, shard)
            start += local
        return out

    def fused_slots(self, param_prefix: str, weight: str, bias: str | None = None
                    ) -> dict[str, ParamSlot | SplitSlot]:
        """One checkpoint tensor holding the parts back to back (`weight` `[sum sizes, in]`, `bias`
        `[sum sizes]`: Qwen's / InternViT's fused `attn.qkv`) -> this rank's slice of each part, back to
        back (a `SplitSlot`); with one rank, the whole tensor (a plain slot)."""
        total = sum(self.output_sizes)
        names = {weight: ("weight", (total, self.input_size))}
        if bias is not None:
            names[bias] = ("bias", (total,))
        if self.tp.size == 1:
            return {name: ParamSlot(f"{param_prefix}{param}", shape) for name, (param, shape) in names.items()}
        out: dict[str, ParamSlot | SplitSlot] = {}
        for name, (param, shape) in names.items():
            parts, src, dst = [], 0, 0
            for full, first, local in zip(self.output_sizes, self.part_starts, self.local_sizes):
                shard = Shard(0, src + first, local)  # this rank's rows of the part
                parts.append(ParamSlot(f"{param_prefix}{param}", shape, dst, shard))
                src, dst = src + full, dst + local
            out[name] = SplitSlot(tuple(parts))
        return out


def kv_head_split(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, KV heads) this rank holds: `num_kv_heads / tp` of them when tp divides them; when
    there are fewer KV heads than ranks and they divide tp, one, replicated on tp / num_kv_heads ranks
    (rank r: head r // (tp / num_kv_heads), which is the KV head of all its query heads). Else
    `ValueError` naming the numbers."""
    if num_kv_heads % tp.size == 0:
        local = num_kv_heads // tp.size
        return tp.rank * local, local
    if tp.size % num_kv_heads == 0:
        return tp.rank // (tp.size // num_kv_heads), 1
    raise ValueError(f"KV heads ({num_kv_heads}) and the tensor-parallel size ({tp.size}): one must divide the "
                     f"other (KV heads are split over the ranks, or each replicated on tp / KV heads ranks)")



class QKVParallelLinear(MergedColumnParallelLinear):
    """Output rows `[q (H*D) | k (Hkv*D) | v (Hkv*D)]` of this rank's heads (H, Hkv local: `num_heads`,
    `num_kv_heads`; `kv_head_start` is the first KV head held, see `kv_head_split`)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        self.num_heads = tp.split(num_heads, "attention heads")  # local
        self.kv_head_start, self.num_kv_heads = kv_head_split(num_kv_heads, tp)  # local
        self.head_dim = head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, dtype, device, tp)

    def _part_rows(self, index: int, size: int, tp: TPGroup) -> tuple[int, int]:
        if index == 0:
            return super()._part_rows(index, size, tp)
        return self.kv_head_start * self.head_dim, self.num_kv_heads * self.head_dim  # k, v: this rank's KV heads


class RowParallelLinear(_Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        super().__init__(tp.split(input_size, "input features"), output_size, bias, dtype, device, tp)
        self.input_size, self.output_size = input_size, output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in/tp] -> [N, out], summed over the ranks
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [N, in/tp] -> [N, out], this rank's part of the sum
        """The product before the all-reduce, for a layer that adds more partial sums before reducing once."""
        # the bias joins rank 0's partial only, so that the sum holds it once
        return self._product(x, self.bias if self.tp.rank == 0 else None)

    def slots(self, param_prefix: str, weight: str, bias: str | None = None) -> dict[str, ParamSlot]:
        """Checkpoint names `weight` `[out, in]` -> this rank's columns; `bias` `[out]` whole."""
        out = {weight: ParamSlot(f"{param_prefix}weight", (self.output_size, self.input_size),
                                 shard=_shard(self.tp, 1, self.in_features))}
        if bias is not None:
            out[bias] = ParamSlot(f"{param_prefix}bias", (self.output_size,))
        return out
