"""Copying checkpoint tensors into a model, strictly: `load_checked` and the `ParamSlot` map.

Every failure is a `CheckpointError` (or, for a slot map that is itself wrong, a `ValueError`) naming
the tensor. Weights are copied with `load_checked`. Model code describes where each checkpoint tensor goes with
a `ParamSlot` per checkpoint name: a parameter (or persistent buffer) of the module, the shape the
checkpoint tensor must have, and optionally the first row of the range it fills in a fused parameter
(q/k/v -> qkv_proj, gate/up -> gate_up_proj); the tensor is reshaped to the parameter's trailing dims
(a Conv3d patch-embed weight -> a Linear). A slot may take only a `Shard` of the checkpoint tensor (one
tensor-parallel rank's slice along one dim): the tensor is checked at its full shape, then only the
slice is copied, so a rank never keeps the whole tensor. A FUSED checkpoint tensor whose parts are
split separately (Qwen's / InternViT's `attn.qkv` [3C, C]: rank r takes its heads of q, of k and of v)
maps to a `SplitSlot`: several `ParamSlot`s of the one tensor, each with its own shard and row_start.
A slot may place its range along another dim of the parameter (`dim`): a packed quantized tensor whose
output features are its dim 1 (AWQ's `qweight` [in, out / 8]) takes q | k | v side by side along dim 1.
`load_checked` refuses unexpected, mis-shaped, duplicated
and missing tensors instead of leaving random weights behind, and checks up front that the slots
cover every row of every parameter exactly once. A slot marked `optional` may be absent from the
checkpoint (a buffer with a default: the FP8 KV cache's per-layer k_scale / v_scale, which only some
checkpoints ship); a one-element slot takes a one-element tensor of any rank (such scales are saved as
[] or [1]). It knows no model: name aliases (e.g. the
`model.language_model.*` spelling of transformers 4.5x) come in as a `canonical` function.

The checkpoint tensors may be lazy (a `LazyTensor`, e.g. `model_loader.iter_safetensors(lazy=True)`):
a slot with a shard reads only the shard from the file, a slot without one the whole tensor; so under
tensor parallelism a rank reads (not just keeps) only its slices.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Iterable, Protocol, Union

import torch

from vlm_sdk.errors import CheckpointError

__all__ = ["ParamSlot", "Shard", "SplitSlot", "LazyTensor", "materialize", "load_checked"]


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet (`model_loader.SafetensorsTensor`)."""
    shape: torch.Size
    dtype: torch.dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read only the slice [start, start + length) along `dim`."""

    def materialize(self) -> torch.Tensor:
        """Read the whole tensor."""


CheckpointTensor = Union[torch.Tensor, LazyTensor]


def materialize(tensor: CheckpointTensor) -> torch.Tensor:
    """The whole tensor: `tensor` itself, or a lazy one read."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()


@dataclass(frozen=True)
class Shard:
    """The slice [start, start + length) along `dim` of a checkpoint tensor: what one tensor-parallel
    rank loads (column-parallel: dim 0 of a weight; row-parallel: dim 1)."""
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class ParamSlot:
    """Where one checkpoint tensor goes: rows [row_start, row_start + loaded rows) of parameter `param`
    (the whole parameter when `row_start` is None), after reshaping to the parameter's trailing dims.
    `param` is a name in the module's `state_dict()` (a parameter or a persistent buffer). With a
    `shard`, only that slice of the tensor is loaded (`shape` is still the whole tensor's). `dim`: the
    parameter's dim that `row_start` counts along (0: rows; 1: columns, for packed tensors whose output
    features run along dim 1); the loaded tensor then has the parameter's shape but along `dim`."""
    param: str
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    row_start: int | None = None
    shard: Shard | None = None
    dim: int = 0
    optional: bool = False  # the checkpoint may lack it: the target keeps its value

    def under(self, prefix: str) -> "ParamSlot":
        """The same slot for the parameter seen from a parent module (`prefix` + param)."""
        return ParamSlot(prefix + self.param, self.shape, self.row_start, self.shard, self.dim, self.optional)

    @property
    def loaded_shape(self) -> tuple[int, ...]:
        """The shape of what is copied: `shape`, narrowed to the shard."""
        if self.shard is None:
            return tuple(self.shape)
        shape = list(self.shape)
        shape[self.shard.dim] = self.shard.length
        return tuple(shape)


@dataclass(frozen=True)
class SplitSlot:
    """One checkpoint tensor loaded as several slices: each part a `ParamSlot` with the whole tensor's
    `shape` and its own `shard` (the slice it takes) and `row_start` (where the slice lands). E.g. a
    fused q | k | v tensor [3C, C] on rank r of 2: q rows [r*C/2, ...) -> qkv rows [0, C/2), k rows
    [C + r*C/2, ...) -> [C/2, C), v likewise -> [C, 3C/2)."""
    parts: tuple[ParamSlot, ...]

    def __post_init__(self):
        if not self.parts or len({tuple(p.shape) for p in self.parts}) != 1:
            raise ValueError(f"a SplitSlot needs one or more parts of one checkpoint shape, got "
                             f"{[list(p.shape) for p in self.parts]}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have (the same for every part)."""
        return tuple(self.parts[0].shape)

    @property
    def optional(self) -> bool:
        return all(p.optional for p in self.parts)

    def under(self, prefix: str) -> "SplitSlot":
        return SplitSlot(tuple(p.under(prefix) for p in self.parts))


def _parts(slot: ParamSlot | SplitSlot) -> tuple[ParamSlot, ...]:
    return slot.parts if isinstance(slot, SplitSlot) else (slot,)


def _identity(name: str) -> str:
    return name


def load_checked(module: torch.nn.Module, weights: Iterable[tuple[str, CheckpointTensor]],
                 slots: dict[str, ParamSlot | SplitSlot], *, ignore: frozenset[str] = frozenset(),
                 canonical: Callable[[str], str] = _identity,
                 source: str | Path | None = None) -> None:
    """Copy checkpoint tensors into `module`, strictly: each into the slot `slots[canonical(name)]`.

    `slots` is keyed by canonical checkpoint name (a `SplitSlot` loads one tensor as several slices);
    checkpoint tensors whose canonical name is in `ignore` are skipped (e.g. lm_head when tied).
    `CheckpointError`, naming the tensor, its shape and `source` (the checkpoint directory) when given, for: a tensor with no slot; a tensor whose shape is
    not the slot's (both shapes named); a tensor given twice, also under two aliases, or two tensors
    for one weight (slots naming the same rows are aliases, as tied weights are); and slots the
    checkpoint never fills, unless an alias was loaded (the first 10 named, then a count).
    Values are cast to the target's dtype and device.

    Slots that name no parameter or persistent buffer, run past its rows, cannot be reshaped into it,
    overlap, or leave rows of a parameter uncovered are a bug in the caller's map: `ValueError`, before
    anything is copied. Persistent buffers are loaded when a slot names them, else left alone.
    """
    where = f" in {source}" if source is not None else ""
    owner = type(module).__name__
    regions = _slot_regions(module, slots)
    loaded: dict[str, str] = {}                          # slot name -> checkpoint name
    filled: dict[tuple[int, int, int, int], str] = {}    # (id(target), dim, start, stop) -> checkpoint name
    with torch.no_grad():
        for raw_name, tensor in weights:
            name = canonical(raw_name)
            if name in ignore:
                continue
            read_as = "" if name == raw_name else f" (read as {name!r})"
            slot = slots.get(name)
            if slot is None:
                raise CheckpointError(
                    f"unexpected tensor {raw_name} (shape {_shape(tensor)}){where}{read_as} matches no weight "
                    f"of {owner}: wrong architecture or config.json for these weights?")
            if tuple(tensor.shape) != tuple(slot.shape) and not _one_element(tensor.shape, slot.shape):
                raise CheckpointError(
                    f"tensor {raw_name}{where} has shape {_shape(tensor)} but {owner} expects "
                    f"{list(slot.shape)}{read_as} for {_slot_text(slot)}: config.json does not match the weights")
            previous = loaded.get(name)
            if previous == raw_name:
                raise CheckpointError(f"tensor {raw_name}{where} appears twice in the checkpoint")
            keys = [(id(target), dim, start, stop) for target, dim, start, stop in regions[name]]
            previous = previous or next((filled[k] for k in keys if k in filled), None)
            if previous is not None:   # two aliases of one name, or two names tied to one weight
                raise CheckpointError(f"tensors {previous} and {raw_name}{where} both load into {_slot_text(slot)}")
            for part, (target, dim, start, stop) in zip(_parts(slot), regions[name]):
                view = target.data if part.row_start is None else target.data.narrow(dim, start, stop - start)
                piece = materialize(tensor) if part.shard is None else \
                    tensor.narrow(part.shard.dim, part.shard.start, part.shard.length)  # this rank's slice only
                view.copy_(piece.reshape(view.shape))
            loaded[name] = raw_name
            filled.update((k, raw_name) for k in keys)
    missing = [n for n in slots if n not in loaded and not slots[n].optional
               and not all((id(t), d, a, b) in filled for t, d, a, b in regions[n])]
    if missing:
        shown = [f"{n} {list(slots[n].shape)}" for n in missing]
        raise CheckpointError(f"{len(missing)} tensor(s) of {owner} missing from the checkpoint{where}: "
                              f"{_name_list(shown)}")


def _slot_regions(module: torch.nn.Module, slots: dict[str, ParamSlot | SplitSlot]
                  ) -> dict[str, list[tuple[torch.Tensor, int, int, int]]]:
    """slot name -> (target tensor, dim, first index, end index along dim) of each of its parts; checks
    the map against the module."""
    owner = type(module).__name__
    targets: dict[str, torch.Tensor] = module.state_dict(keep_vars=True)  # params + persistent buffers
    regions: dict[str, list[tuple[torch.Tensor, int, int, int]]] = {}
    entries = [(name, slot) for name, split in slots.items() for slot in _parts(split)]
    for name, slot in entries:
        target = targets.get(slot.param)
        if target is None:
            raise ValueError(f"slot for {name} names {slot.param!r}, which {owner} does not have")
        dim = slot.dim
        if slot.row_start is not None and not 0 <= dim < max(target.dim(), 1):
            raise ValueError(f"slot for {name}: dim {dim} is not a dim of {slot.param} {_shape(target)}")
        rows = target.shape[dim] if target.dim() else 1
        loaded = slot.loaded_shape
        if slot.shard is not None and not (0 <= slot.shard.dim < len(slot.shape) and slot.shard.start >= 0
                                           and slot.shard.start + slot.shard.length <= slot.shape[slot.shard.dim]):
            raise ValueError(f"slot for {name}: {slot.shard} is outside the tensor's shape {list(slot.shape)}")
        if slot.row_start is None:
            dim, start, stop, expect = 0, 0, (target.shape[0] if target.dim() else 1), target.numel()
        else:
            width = loaded[dim] if len(loaded) > dim else 1  # the loaded tensor has the parameter's rank
            start, stop = slot.row_start, slot.row_start + width
            expect = (stop - start) * (target.numel() // rows if rows else 0)
            if target.dim() == 0 or start < 0 or stop > rows:
                raise ValueError(f"slot for {name}: {_along(dim)} [{start}, {stop}) are outside {slot.param} "
                                 f"{_shape(target)}")
        if prod(loaded) != expect:
            raise ValueError(f"slot for {name}: shape {list(loaded)} does not reshape into "
                             f"{_slot_text(slot)} of {owner} ({_shape(target)})")
        regions.setdefault(name, []).append((target, dim, start, stop))
    # every parameter index along its dim is filled by exactly one region (slots naming the same region
    # are aliases)
    covered: dict[int, set[tuple[int, int, int]]] = {}
    for parts in regions.values():
        for target, dim, start, stop in parts:
            covered.setdefault(id(target), set()).add((dim, start, stop))
    located = [((id(t), d, a, b), (n, slot)) for (n, slot), (t, d, a, b)
               in zip(entries, (r for parts in regions.values() for r in parts))]
    by_region = dict(reversed(located))  # first slot per region
    for key, spans in covered.items():
        dims = {d for d, _, _ in spans}
        if len(dims) > 1:  # a whole-tensor slot (dim 0) beside column slots also overlaps
            (first, s0), (second, s1) = (by_region[(key, *span)] for span in sorted(spans)[:2])
            raise ValueError(f"slots for {first} and {second} overlap: {_slot_text(s0)} and {_slot_text(s1)}")
        ordered = sorted(spans)
        for (d0, a0, b0), (d1, a1, b1) in zip(ordered, ordered[1:]):
            if a1 < b0:
                (first, s0), (second, s1) = by_region[(key, d0, a0, b0)], by_region[(key, d1, a1, b1)]
                raise ValueError(f"slots for {first} and {second} overlap: {_slot_text(s0)} "
                                 f"and {_slot_text(s1)}")
    gaps: list[str] = []
    # a part built on the meta device in a module that is not (another pipeline stage's vision tower,
    # models/pipeline.py) is loaded nowhere here
    elsewhere = any(p.device.type != "meta" for p in module.parameters())
    for pname, param in module.named_parameters():   # tied parameters appear once
        if elsewhere and param.device.type == "meta":
            continue
        spans = sorted(covered.get(id(param), ()))
        dim = spans[0][0] if spans else 0
        rows = param.shape[dim] if param.dim() else 1
        nxt = 0
        for _, start, stop in spans:
            if start > nxt:
                break
            nxt = max(nxt, stop)
        if nxt < rows:
            gaps.append(pname if nxt == 0 else f"{pname} {_along(dim)} [{nxt}, {rows})")
    if gaps:
        raise ValueError(f"the slots leave {len(gaps)} parameter(s) of {owner} unloaded: {_name_list(gaps)}")
    return regions


def _one_element(shape, expected) -> bool:
    """A one-element tensor for a one-element slot, whatever their ranks ([] or [1])."""
    return prod(shape) == 1 and prod(expected) == 1


def _along(dim: int) -> str:
    return "rows" if dim == 0 else f"dim-{dim} indices"


def _slot_text(slot: ParamSlot | SplitSlot) -> str:
    if isinstance(slot, SplitSlot):
        return " and ".join(_slot_text(p) for p in slot.parts)
    loaded = slot.loaded_shape
    width = loaded[slot.dim] if len(loaded) > slot.dim else 1
    text = slot.param if slot.row_start is None else \
        f"{slot.param} {_along(slot.dim)} [{slot.row_start}, {slot.row_start + width})"
    if slot.shard is not None:
        sh = slot.shard
        text += f" (its dim-{sh.dim} slice [{sh.start}, {sh.start + sh.length}))"
    return text


# ----------------------------------------------------------------------------------------------
# helpers


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _name_list(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (and {len(names) - limit} more)"
