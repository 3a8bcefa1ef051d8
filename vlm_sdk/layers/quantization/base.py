"""What every quantized weight format tells the quantized linear layers: the tensors a checkpoint module
holds in its place of `weight` (`PackedTensor`: name, dtype, and how its dims relate to the output and input
features) and how to turn them back into a float `[out, in]` weight (`QuantScheme.dequantize`).

The layer (vlm_sdk/layers/quantized_linear.py) does the rest the same way for every format: it sizes each
tensor for this rank, names the checkpoint slices it loads (`Shard`s along `out_dim` or `in_dim`), and
places fused parts (q | k | v) side by side along `out_dim`. A tensor dim that packs several features per
index (AWQ's 8 int4 values per int32, a group's scale, an FP8 block's scale) carries its divisor: a rank's
slice must start and end on a whole index, else the tensor-parallel size is refused naming the divisor.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from vlm_sdk.errors import CheckpointError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PackedTensor:
    """One checkpoint tensor of a quantized Linear, named `<module>.<suffix>`.

    `out_dim` / `in_dim`: which of its dims runs along the output / input features (None: neither), with
    `out_div` / `in_div` features per index (8 for packed int4, the group size for group scales; -1 for
    one group over the whole input, whose tensor every rank of a split input keeps whole). With
    `ceil`, a partial last index counts (FP8 block scales: ceil(features / block)); else the features
    must divide. `whole_on_row_split`: under a split of the input features the tensor is kept whole on
    every rank (GPTQ's scales and zeros with desc_act, which g_idx indexes anywhere). A tensor with no
    output dim (GPTQ's g_idx) is held once per fused part. `dtype` None: the model's dtype (compressed-tensors
    writes its scales in the checkpoint's dtype; vLLM holds them in the model's). `extent`: the size of a dim
    that is neither (compressed-tensors' `weight_shape` [2])."""
    suffix: str
    dtype: torch.dtype | None
    ndim: int
    out_dim: int | None
    out_div: int
    in_dim: int | None
    in_div: int
    ceil: bool = False
    whole_on_row_split: bool = False
    extent: int = 1

    def size(self, dim: int, out_features: int, in_features: int) -> int:
        """The tensor's size along `dim` for a `[out_features, in_features]` weight."""
        if dim == self.out_dim:
            return self.indices(out_features, self.out_div)
        if dim == self.in_dim:
            return self.indices(in_features, self.in_div)
        return self.extent

    def shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        return tuple(self.size(d, out_features, in_features) for d in range(self.ndim))

    def indices(self, features: int, div: int) -> int:
        return cdiv(features, div) if self.ceil else features // div

    def check_features(self, features: int, div: int, what: str, method: str) -> None:
        """`ValueError` when `features` (a whole tensor's) do not fill whole indices of `div`."""
        if not self.ceil and features % div:
            raise ValueError(f"{what} ({features}) is not a multiple of {div}, as {method}'s {self.suffix} needs")

    def index_range(self, start: int, length: int, full: int, div: int, what: str, method: str) -> tuple[int, int]:
        """(first index, indices) of features [start, start + length) of `full`, refused (`ValueError`) when
        the slice would cut an index: a group, an int32 word or a block shared with another rank."""
        end_ok = length % div == 0 or (self.ceil and start + length == full)
        if start % div or not end_ok:
            raise ValueError(f"{what}: this rank's slice [{start}, {start + length}) of {full} cuts an index of "
                             f"{method}'s {self.suffix}, which holds {div} features per index")
        return start // div, self.indices(start + length, div) - start // div


class QuantScheme(ABC):
    """A weight format: its checkpoint tensors and their dequantization. Frozen dataclasses (the config
    fields the format reads from config.json's `quantization_config`)."""
    method: str  # the quant_method (or "compressed-tensors"), for messages and the memory report

    @property
    @abstractmethod
    def description(self) -> str:
        """e.g. "AWQ int4, group 128": what the start-up report and `vlm-sdk plan` name."""

    @abstractmethod
    def tensors(self) -> tuple[PackedTensor, ...]:
        """The checkpoint tensors of one quantized Linear."""

    @abstractmethod
    def dequantize(self, t: dict[str, torch.Tensor], out_features: int, in_features: int,
                   in_starts: dict[str, int]) -> torch.Tensor:
        """This rank's `[out_features, in_features]` float32 weight of one part from its tensors (`t`, by
        suffix, sliced to the part). `in_starts`: each tensor's first index along the input that this rank
        holds (non-zero under a split of the input); indices read from the checkpoint (g_idx) are global."""

    def check(self, name: str, t: dict[str, torch.Tensor], in_starts: dict[str, int],
              shape: tuple[int, int]) -> None:
        """After loading: values the format constrains (e.g. g_idx within the groups, a recorded weight shape),
        `CheckpointError` naming the tensor `name`.<suffix>. `shape`: the checkpoint's whole `[out, in]` weight
        of this part. Nothing by default."""

    def kernel_matmul(self, x: torch.Tensor, layer: "QuantizedTensors",
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        """x `[M, in_local]` times this rank's weight, transposed (+ bias), through the format's GPU kernel
        (vlm_sdk/kernels/: the weight dequantized in registers, never whole); None when no kernel takes
        these inputs (the layer then dequantizes and multiplies). None by default."""
        return None

    def skips(self, module: str) -> bool:
        """Whether the checkpoint keeps `module` (its published name) unquantized."""
        return any(_matches(pattern, module) for pattern in getattr(self, "skip", ()))


class QuantizedTensors(Protocol):
    """What `kernel_matmul` reads of a quantized layer (vlm_sdk/layers/quantized_linear.py): this rank's
    tensors by suffix as attributes (fused parts side by side along their output dim), and per part."""
    input_size: int  # the whole layer's input features (every rank's)
    in_features: int  # this rank's
    parts: tuple  # per fused part: `.local` output features on this rank

    def part_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Part `index`'s tensors, by suffix."""

    def in_starts(self) -> dict[str, int]:
        """Each input-split tensor's first index along the input on this rank."""


def check_group_index(tensor: str, g_idx: torch.Tensor, scales: str, groups: int, offset: int, field: str) -> None:
    """`CheckpointError` when the group index `tensor` (global groups) points outside the `groups` groups of
    `scales` this rank holds from group `offset`: config.json's `field` (desc_act, actorder) does not match."""
    low, high = int(g_idx.min()), int(g_idx.max())
    if low - offset < 0 or high - offset >= groups:
        raise CheckpointError(f"tensor {tensor} holds groups {low}..{high}, outside the {groups} groups of {scales}"
                              f"{f' held by this rank (from group {offset})' if offset else ''}: {field} in "
                              f"config.json does not match the weights")


def _matches(pattern: str, module: str) -> bool:
    """vLLM's rule for modules_to_not_convert (a substring of the name, e.g. "visual"); compressed-tensors'
    "re:" patterns as regular expressions."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern in module
