"""Checkpoints of Qwen-MoE style decoders (Qwen3-VL-MoE's, Qwen3.5-MoE's): the experts of a sparse layer come
in one of three layouts, all read into the same per-expert slots (`SparseMoeBlock.slots`, the names below on
the right):

    layout                                   tensor (under model.language_model.layers.N.mlp.)
    transformers 5 (save_pretrained)         experts.gate_up_proj [E, 2I, H] (gate rows, then up rows)
                                             experts.down_proj    [E, H, I]
    published BF16 repos (transformers 4.57) experts.gate_up_proj [E, H, 2I] (transposed: gate columns
                                             experts.down_proj    [E, I, H]   first, then up)
    per expert (Qwen3-MoE's; the FP8 repos)  experts.e.{gate,up}_proj.weight [I, H], experts.e.down_proj.weight [H, I]

`split_fused_experts` streams a checkpoint through, turning each fused tensor into its E per-expert
parts (lazy: `_ExpertPart`), so `load_checked` places, counts and checks them as it does any tensor: a
missing expert, a layer given both layouts or a tensor of another shape is a `CheckpointError`.

Which fused orientation: the shape says, unless 2I == H (gate_up) or I == H (down), where the two
coincide; then, as transformers (its `Transpose(check_dims=True)` keeps a tensor of its own shape),
the tensor is read as transformers 5's. No published size is ambiguous (Qwen3-VL-30B-A3B: H 2048, I 768;
Qwen3.5-35B-A3B: H 2048, I 512; Qwen3.5-397B-A17B: H 4096, I 1024). The published Qwen3.5-MoE repos keep
transformers 5's orientation (vLLM's qwen3_5.py loads their fused tensors untransposed).

Reading: a part narrowed to a rank's rows reads its expert's whole slice of the fused tensor (one
expert, all its rows: safetensors slices one dim at a time), once for gate and up together
(`_FusedExperts` keeps the last expert read). So under tensor parallelism a rank reads every expert's
rows, not only its own I / tp of them: the whole fused tensor once, where per-expert tensors are read
at the rank's slice.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.moe import MoeConfig
from vlm_sdk.weight_loading import CheckpointTensor

__all__ = ["split_fused_experts", "only_experts"]

_FUSED = re.compile(r"(.*\blayers\.(\d+)\.mlp\.)experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r".*\bmlp\.experts\.(\d+)\.")


class _FusedExperts:
    """One fused expert tensor (lazy or read) and the last expert taken from it, in transformers 5's
    orientation ([2I, H] or [H, I])."""

    def __init__(self, tensor: CheckpointTensor, transposed: bool):
        self.tensor, self.transposed = tensor, transposed
        self._last: tuple[int, torch.Tensor] | None = None

    def expert(self, e: int) -> torch.Tensor:
        if self._last is None or self._last[0] != e:
            block = self.tensor.narrow(0, e, 1)[0]  # [2I, H] / [H, I], or transposed
            self._last = (e, block.transpose(0, 1) if self.transposed else block)
        return self._last[1]


class _ExpertPart:
    """Rows [start, start + length) of expert `e` of a fused tensor, as one per-expert checkpoint tensor
    (the `LazyTensor` protocol of vlm_sdk/weight_loading.py)."""

    def __init__(self, source: _FusedExperts, e: int, start: int, length: int, cols: int, dtype: torch.dtype):
        self.source, self.e, self.start = source, e, start
        self.shape, self.dtype = torch.Size((length, cols)), dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        return self.source.expert(self.e).narrow(0, self.start, self.shape[0])


def split_fused_experts(weights: Iterable[tuple[str, CheckpointTensor]], moe: MoeConfig | None,
                        hidden_size: int) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` with each fused `experts.gate_up_proj` / `experts.down_proj` of a sparse layer replaced by
    its per-expert tensors (module docstring); everything else passes through untouched, including a
    fused tensor of a dense layer, which `load_checked` then refuses by its own name."""
    for name, tensor in weights:
        match = _FUSED.match(name)
        if moe is None or match is None or not moe.is_sparse(int(match.group(2))):
            yield name, tensor
            continue
        prefix, kind = match.group(1), match.group(3)
        yield from _split(name, tensor, prefix, kind, moe, hidden_size)


def only_experts(weights: Iterable[tuple[str, CheckpointTensor]], held: range
                 ) -> Iterator[tuple[str, CheckpointTensor]]:
    """`weights` (per-expert names: after `split_fused_experts`) without the tensors of experts outside
    `held`: under expert parallelism another rank loads and checks those (a lazy part is never read)."""
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match is None or int(match.group(1)) in held:
            yield name, tensor


def _split(name: str, tensor: CheckpointTensor, prefix: str, kind: str, moe: MoeConfig, hidden: int
           ) -> Iterator[tuple[str, CheckpointTensor]]:
    e_all, inter = moe.num_experts, moe.intermediate_size
    ours = (e_all, 2 * inter, hidden) if kind == "gate_up_proj" else (e_all, hidden, inter)  # transformers 5's
    published = (ours[0], ours[2], ours[1])
    shape = tuple(tensor.shape)
    if shape not in (ours, published):
        raise CheckpointError(f"tensor {name} has shape {list(shape)} but config.json's experts (num_experts "
                              f"{e_all}, hidden_size {hidden}, moe_intermediate_size {inter}) need {list(ours)} "
                              f"(transformers 5) or {list(published)} (the published layout)")
    source = _FusedExperts(tensor, transposed=shape != ours)
    rows, cols = ours[1], ours[2]
    for e in range(e_all):
        expert = f"{prefix}experts.{e}."
        if kind == "gate_up_proj":
            yield f"{expert}gate_proj.weight", _ExpertPart(source, e, 0, inter, cols, tensor.dtype)
            yield f"{expert}up_proj.weight", _ExpertPart(source, e, inter, inter, cols, tensor.dtype)
        else:
            yield f"{expert}down_proj.weight", _ExpertPart(source, e, 0, rows, cols, tensor.dtype)
