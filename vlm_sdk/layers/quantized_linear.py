"""Quantized linear layers: the tensor-parallel split of vlm_sdk/layers/linear.py over a checkpoint's packed
tensors (a `QuantScheme`: AWQ, GPTQ, FP8, W4A16), with the same constructor contract as their float siblings plus
`scheme` (a keyword).

    QuantColumnParallelLinear / QuantMergedColumnParallelLinear / QuantQKVParallelLinear   output split
    QuantRowParallelLinear                                                                   input split

Each packed tensor of the format (`PackedTensor`) is held as one parameter of this rank's shape, named by
its checkpoint suffix (`qweight`, `scales`, `weight_scale_inv`, ...); fused parts (q | k | v, gate | up) sit
side by side along the tensor's output dim, as the float layers stack rows (a `ParamSlot` with `dim`). A
tensor with no output dim (GPTQ's `g_idx`) is held per part (`g_idx_0`, `g_idx_1`, ...). `slots()` names
the checkpoint tensors beside each float weight name it is given (`<module>.weight` -> `<module>.qweight`,
...), each with this rank's `Shard`, so `load_checked` stays strict and a rank reads only its slice.

A split that would cut a packed index (a group of the input, 8 outputs of an int32 word, an FP8 block) is
a `ValueError` at construction naming the divisor: built on the meta device at the asked size, that is how
`check_tensor_parallel_size` refuses the size and names the ones that work.

forward: on CUDA the format's kernel (`QuantScheme.kernel_matmul`: kernels/int4_gemm.py for AWQ, GPTQ, W4A16,
kernels/fp8_block_gemm.py for block-wise FP8, kernels/fp8_scaled_mm.py for compressed-tensors FP8 on sm_90),
which dequantizes in registers; elsewhere, or where no kernel takes the inputs, dequantize this rank's
weight (kernels/dequant_torch.py) and `F.linear` in the activations' dtype: the CPU path of every format.
`use_kernels` (None: CUDA) forces either path: the tests run the kernels under the Triton interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.linear import kv_head_split
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.quantization.base import PackedTensor, QuantScheme
from vlm_sdk.weight_loading import ParamSlot, Shard


@dataclass(frozen=True)
class _Part:
    full: int   # output features of the checkpoint tensor
    start: int  # this rank's first output feature of it
    local: int  # output features this rank holds


class _QuantLinear(nn.Module):
    def __init__(self, scheme: QuantScheme, input_size: int, in_start: int, in_local: int, parts: list[_Part],
                 bias: bool, dtype: torch.dtype, device: torch.device | str, tp: TPGroup, row_parallel: bool):
        super().__init__()
        self.scheme, self.tp, self.row_parallel = scheme, tp, row_parallel
        self.input_size, self.parts = input_size, tuple(parts)
        self.in_start, self.in_features = in_start, in_local
        self.out_features = sum(p.local for p in parts)
        # group_size -1: one group over the whole input, kept whole by every rank of a split input
        self.specs = tuple(replace(s, in_div=input_size, whole_on_row_split=True) if s.in_div == -1 else s
                           for s in scheme.tensors())
        self.checkpoint_names: tuple[str, ...] = ()  # set by slots(): named in load-time errors
        self.use_kernels: bool | None = None  # the format's GPU kernel: None = on CUDA (see the module docstring)
        # per spec: (first index, indices) along the input; per part along the output, of the checkpoint
        # tensor (`out_slices`) and where the part sits in this rank's tensor (`out_ranges`)
        self.in_ranges: dict[str, tuple[int, int]] = {}
        self.out_slices: dict[str, tuple[tuple[int, int], ...]] = {}
        self.out_ranges: dict[str, tuple[tuple[int, int], ...]] = {}
        for spec in self.specs:
            self._register(spec, spec.dtype or dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def _register(self, spec: PackedTensor, dtype: torch.dtype, device) -> None:
        what = f"{self.scheme.description}: {type(self).__name__}"
        if spec.in_dim is not None:
            spec.check_features(self.input_size, spec.in_div, f"{what} input features", self.scheme.method)
            if self.row_parallel and not spec.whole_on_row_split:
                self.in_ranges[spec.suffix] = spec.index_range(self.in_start, self.in_features, self.input_size,
                                                               spec.in_div, f"{what} input features",
                                                               self.scheme.method)
            else:
                self.in_ranges[spec.suffix] = (0, spec.indices(self.input_size, spec.in_div))
        shape = [spec.extent] * spec.ndim
        if spec.in_dim is not None:
            shape[spec.in_dim] = self.in_ranges[spec.suffix][1]
        if spec.out_dim is None:
            for i, _ in enumerate(self.parts):
                self.register_parameter(self._per_part(spec, i), _empty(shape, dtype, device))
            return
        ranges = []
        for p in self.parts:
            spec.check_features(p.full, spec.out_div, f"{what} output features", self.scheme.method)
            ranges.append(spec.index_range(p.start, p.local, p.full, spec.out_div, f"{what} output features",
                                           self.scheme.method))
        self.out_slices[spec.suffix] = tuple(ranges)
        offsets = [sum(n for _, n in ranges[:i]) for i in range(len(ranges))]
        self.out_ranges[spec.suffix] = tuple((o, n) for o, (_, n) in zip(offsets, ranges))
        shape[spec.out_dim] = sum(n for _, n in ranges)
        self.register_parameter(spec.suffix, _empty(shape, dtype, device))

    def _per_part(self, spec: PackedTensor, index: int) -> str:
        return spec.suffix if len(self.parts) == 1 else f"{spec.suffix}_{index}"

    # -- loading --------------------------------------------------------------------------------------
    def _slots(self, param_prefix: str, weights: list[str], biases: list[str] | None) -> dict[str, ParamSlot]:
        bases = [w.removesuffix(".weight") for w in weights]
        self.checkpoint_names = tuple(bases)
        out: dict[str, ParamSlot] = {}
        for spec in self.specs:
            offset = 0
            for i, (base, part) in enumerate(zip(bases, self.parts)):
                full = spec.shape(part.full, self.input_size)
                name = f"{base}.{spec.suffix}"
                if spec.out_dim is None:
                    out[name] = ParamSlot(f"{param_prefix}{self._per_part(spec, i)}", full, shard=self._in_shard(spec))
                    continue
                first, count = self.out_slices[spec.suffix][i]
                if self.row_parallel:
                    shard = self._in_shard(spec)
                else:
                    shard = None if self.tp.size == 1 else Shard(spec.out_dim, first, count)
                row_start = None if len(self.parts) == 1 else offset
                out[name] = ParamSlot(f"{param_prefix}{spec.suffix}", full, row_start, shard, spec.out_dim)
                offset += count
        if biases is not None:
            start = 0
            for name, part in zip(biases, self.parts):
                shard = None if self.tp.size == 1 or self.row_parallel else Shard(0, part.start, part.local)
                out[name] = ParamSlot(f"{param_prefix}bias", (part.full,), None if len(self.parts) == 1 else start,
                                      shard)
                start += part.local
        return out

    def _in_shard(self, spec: PackedTensor) -> Shard | None:
        if not self.row_parallel or self.tp.size == 1 or spec.in_dim is None or spec.whole_on_row_split:
            return None
        first, count = self.in_ranges[spec.suffix]
        return Shard(spec.in_dim, first, count)

    def part_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Part `index`'s tensors, by suffix (views into this rank's parameters)."""
        t = {}
        for spec in self.specs:
            if spec.out_dim is None:
                t[spec.suffix] = getattr(self, self._per_part(spec, index))
            else:
                first, count = self.out_ranges[spec.suffix][index]
                t[spec.suffix] = getattr(self, spec.suffix).narrow(spec.out_dim, first, count)
        return t

    def check_loaded(self) -> None:
        """Values the format constrains, checked once loaded (`CheckpointError` naming the tensor)."""
        for i, (name, part) in enumerate(zip(self.checkpoint_names, self.parts)):
            self.scheme.check(name, self.part_tensors(i), self.in_starts(), (part.full, self.input_size))

    # -- compute --------------------------------------------------------------------------------------
    def dequantized_weight(self) -> torch.Tensor:  # [out_local, in_local] float32
        parts = [self.scheme.dequantize(self.part_tensors(i), p.local, self.in_features, self.in_starts())
                 for i, p in enumerate(self.parts)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def in_starts(self) -> dict[str, int]:
        return {suffix: first for suffix, (first, _) in self.in_ranges.items()}

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [N, in] -> [N, out]
        use = self.use_kernels if self.use_kernels is not None else x.is_cuda
        if use and x.dim() == 2:
            y = self.scheme.kernel_matmul(x if x.stride(-1) == 1 else x.contiguous(), self, bias)
            if y is not None:
                return y
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


def _empty(shape, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantColumnParallelLinear(_QuantLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup(), *, scheme: QuantScheme):
        local = tp.split(output_size, "output features")
        super().__init__(scheme, input_size, 0, input_size, [_Part(output_size, tp.rank * local, local)], bias,
                         dtype, device, tp, row_parallel=False)
        self.output_size = output_size

    def slots(self, param_prefix: str, weight: str, bias: str | None = None) -> dict[str, ParamSlot]:
        return self._slots(param_prefix, [weight], None if bias is None else [bias])


class QuantMergedColumnParallelLinear(_QuantLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup(), *, scheme: QuantScheme):
        parts = []
        for n in output_sizes:
            local = tp.split(n, "output features of each merged part")
            parts.append(_Part(n, tp.rank * local, local))
        super().__init__(scheme, input_size, 0, input_size, parts, bias, dtype, device, tp, row_parallel=False)
        self.output_sizes = tuple(output_sizes)

    def slots(self, param_prefix: str, weights: list[str], biases: list[str] | None = None) -> dict[str, ParamSlot]:
        return self._slots(param_prefix, weights, biases)


class QuantQKVParallelLinear(_QuantLinear):
    """q | k | v of this rank's heads, as `QKVParallelLinear` (`num_heads`, `num_kv_heads` local)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TPGroup = TPGroup(),
                 *, scheme: QuantScheme):
        local_heads = tp.split(num_heads, "attention heads")
        kv_start, kv_local = kv_head_split(num_kv_heads, tp)
        q = _Part(num_heads * head_dim, tp.rank * local_heads * head_dim, local_heads * head_dim)
        kv = _Part(num_kv_heads * head_dim, kv_start * head_dim, kv_local * head_dim)
        super().__init__(scheme, hidden_size, 0, hidden_size, [q, kv, kv], bias, dtype, device, tp,
                         row_parallel=False)
        self.num_heads, self.kv_head_start, self.num_kv_heads, self.head_dim = local_heads, kv_start, kv_local, head_dim

    def slots(self, param_prefix: str, weights: list[str], biases: list[str] | None = None) -> dict[str, ParamSlot]:
        return self._slots(param_prefix, weights, biases)


class QuantRowParallelLinear(_QuantLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup(), *, scheme: QuantScheme):
        local = tp.split(input_size, "input features")
        super().__init__(scheme, input_size, tp.rank * local, local, [_Part(output_size, 0, output_size)], bias,
                         dtype, device, tp, row_parallel=True)
        self.output_size = output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in/tp] -> [N, out], summed over the ranks
        return self.tp.all_reduce(self._matmul(x, self.bias if self.tp.rank == 0 else None))

    def slots(self, param_prefix: str, weight: str, bias: str | None = None) -> dict[str, ParamSlot]:
        return self._slots(param_prefix, [weight], None if bias is None else [bias])


QUANTIZED = {"ColumnParallelLinear": QuantColumnParallelLinear,
             "MergedColumnParallelLinear": QuantMergedColumnParallelLinear,
             "QKVParallelLinear": QuantQKVParallelLinear, "RowParallelLinear": QuantRowParallelLinear}


def linear_layer(float_cls: type, scheme: QuantScheme | None, module: str):
    """The layer class to build for the checkpoint's `module` (its published name): `float_cls` when the
    checkpoint is not quantized or keeps `module` unquantized, else its quantized sibling with `scheme`
    bound (the same positional constructor)."""
    if scheme is None or scheme.skips(module):
        return float_cls
    cls = QUANTIZED[float_cls.__name__]
    return lambda *args, **kw: cls(*args, scheme=scheme, **kw)
