"""The Qwen3-VL vision tower: patch embed + learned positions -> blocks (whole-image attention) ->
patch merger, plus one DeepStack merger per `deepstack_visual_indexes` block.

Equal to transformers' `Qwen3VLVisionModel` (the oracle). Patches arrive block-major (each run of
merge^2 = 4 patches is one 2x2 merge block, blocks in raster order), which is the merger's order, so
unlike Qwen2.5-VL's windowed tower nothing is reordered: every block attends within one frame.

Positions, twice. (1) The learned `pos_embed` is a square grid of `num_position_embeddings` (48x48
published) that each image's h x w patch grid samples bilinearly with aligned corners (patch row i
sits at i * (side - 1) / (h - 1) on the grid), in float32, then cast. (2) 2-D RoPE over each head:
the first half of the rotated frequencies follow the patch row, the second the column (as Qwen2.5-VL's).

DeepStack. After block i in `deepstack_visual_indexes` the stream goes through that level's merger:
    merger            LayerNorm(dim) per patch   -> view [N/4, 4*dim] -> fc1 -> GELU -> fc2 -> [N/4, out]
    DeepStack merger  view [N/4, 4*dim] -> LayerNorm(4*dim)          -> fc1 -> GELU -> fc2 -> [N/4, out]
The decoder adds level k to the hidden states of image tokens after its layer k.

Tensor parallelism (`tp`, one rank by default), as Qwen2.5-VL's tower: a block holds its rank's heads
of the fused `attn.qkv` (a `SplitSlot`), its columns of proj and linear_fc2, its rows of linear_fc1; every
merger likewise (fc1 rows, fc2 columns). proj, linear_fc2 and the mergers' fc2 all-reduce their outputs
(`RowParallelLinear`). The residual stream, the LayerNorms, patch_embed and pos_embed are whole on every
rank.

Kernels: the 2-D RoPE is the kernel set's `ops.rotary` in place on q and k (Qwen2.5-VL's `attend`).
The rest has no kernel of the set: the norms are LayerNorms (with bias; the set's fused add+norm is an
RMSNorm) and the MLP is an ungated tanh-GELU (nothing for `silu_and_mul`), so they stay torch ops.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.activation import ACTIVATIONS
from vlm_sdk.layers.attention import SegmentAttention
from vlm_sdk.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vlm_sdk.layers.ops import KernelOps, TorchOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.rotary import RotaryInputs, VisionRotaryEmbedding
from vlm_sdk.models.common.qwen_vl.vision_attention import attend, check_patch_grids
from vlm_sdk.weight_loading import ParamSlot, SplitSlot

LN_EPS = 1e-6  # transformers builds every LayerNorm of this tower with eps 1e-6


def _layer_norm(dim: int, dtype: torch.dtype, device) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=LN_EPS, dtype=dtype, device=device)


def _norm_slots(norm: nn.LayerNorm, src: str, dst: str) -> dict[str, ParamSlot]:
    shape = tuple(norm.weight.shape)
    return {f"{src}weight": ParamSlot(f"{dst}weight", shape), f"{src}bias": ParamSlot(f"{dst}bias", shape)}


def _bilinear(n: int, side: int, device) -> torch.Tensor:  # [n, side] float32
    """Weights that resample `side` grid points to `n`, bilinear with aligned corners: point i sits at
    i * (side - 1) / (n - 1) (transformers' closed form of linspace(0, side - 1, n)) between grid
    points floor and floor + 1 (clamped)."""
    at = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)  # [n]
    lo = at.floor().long()
    frac = at - lo
    weights = torch.zeros(n, side, dtype=torch.float32, device=device)
    i = torch.arange(n, device=device)
    weights.index_put_((i, lo), 1 - frac, accumulate=True)
    weights.index_put_((i, (lo + 1).clamp(max=side - 1)), frac, accumulate=True)
    return weights


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int, act: str, dtype: torch.dtype, device, ops: KernelOps,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.ops = ops
        self.heads, self.head_dim = tp.split(heads, "vision attention heads"), dim // heads  # heads: this rank's
        self.attn = SegmentAttention(self.heads, self.head_dim, self.head_dim ** -0.5, ops.attention)
        self.act = ACTIVATIONS[act]
        self.norm1 = _layer_norm(dim, dtype, device)
        self.qkv = QKVParallelLinear(dim, self.head_dim, heads, heads, True, dtype, device, tp)
        self.proj = RowParallelLinear(dim, dim, True, dtype, device, tp)
        self.norm2 = _layer_norm(dim, dtype, device)
        self.fc1 = ColumnParallelLinear(dim, inter, True, dtype, device, tp)
        self.fc2 = RowParallelLinear(inter, dim, True, dtype, device, tp)

    def forward(self, x: torch.Tensor,  # [N, dim]
                rope: RotaryInputs,  # the 2-D RoPE of the patches (row, column)
                plan: Any) -> torch.Tensor:  # `attention.segments` of the frames
        x = x + attend(self, self.norm1(x), rope, plan)  # [N, dim], summed over ranks
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    def slots(self, src: str, dst: str) -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint names under `src` (`model.visual.blocks.N.`) -> this rank's slices, params under `dst`."""
        return {
            **_norm_slots(self.norm1, f"{src}norm1.", f"{dst}norm1."),
            **_norm_slots(self.norm2, f"{src}norm2.", f"{dst}norm2."),
            **self.qkv.fused_slots(f"{dst}qkv.", f"{src}attn.qkv.weight", f"{src}attn.qkv.bias"),
            **self.proj.slots(f"{dst}proj.", f"{src}attn.proj.weight", f"{src}attn.proj.bias"),
            **self.fc1.slots(f"{dst}fc1.", f"{src}mlp.linear_fc1.weight", f"{src}mlp.linear_fc1.bias"),
            **self.fc2.slots(f"{dst}fc2.", f"{src}mlp.linear_fc2.weight", f"{src}mlp.linear_fc2.bias"),
        }


class PatchMerger(nn.Module):
    """merge^2 patches -> one LM-width token. `postshuffle` (the DeepStack mergers): the LayerNorm runs
    over the merged 4*dim vector instead of over each patch."""

    def __init__(self, dim: int, out_dim: int, merge_unit: int, postshuffle: bool, dtype: torch.dtype, device,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.in_dim, self.postshuffle = dim * merge_unit, postshuffle
        self.norm = _layer_norm(self.in_dim if postshuffle else dim, dtype, device)
        self.fc1 = ColumnParallelLinear(self.in_dim, self.in_dim, True, dtype, device, tp)
        self.fc2 = RowParallelLinear(self.in_dim, out_dim, True, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N / merge_unit, out_dim]
        x = self.norm(x.view(-1, self.in_dim)) if self.postshuffle else self.norm(x).view(-1, self.in_dim)
        return self.fc2(F.gelu(self.fc1(x)))  # exact GELU (nn.GELU()), unlike the blocks' tanh one

    def slots(self, src: str, dst: str) -> dict[str, ParamSlot]:
        return {**_norm_slots(self.norm, f"{src}norm.", f"{dst}norm."),
                **self.fc1.slots(f"{dst}fc1.", f"{src}linear_fc1.weight", f"{src}linear_fc1.bias"),
                **self.fc2.slots(f"{dst}fc2.", f"{src}linear_fc2.weight", f"{src}linear_fc2.bias")}


class Projector(nn.Module):
    """Every map from vision features to the LM width: the merger and the DeepStack mergers (the
    "projector" of the memory reports)."""

    def __init__(self, dim: int, out_dim: int, merge_unit: int, levels: int, dtype: torch.dtype, device,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.merger = PatchMerger(dim, out_dim, merge_unit, False, dtype, device, tp)
        self.deepstack = nn.ModuleList(PatchMerger(dim, out_dim, merge_unit, True, dtype, device, tp)
                                       for _ in range(levels))


class Qwen3VLVisionTransformer(nn.Module):
    def __init__(self, vision_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, tp: TPGroup = TPGroup()):
        super().__init__()
        c = vision_config
        self.ops = ops or TorchOps()
        self.dim = c.hidden_size
        self.in_channels, self.patch_size, self.temporal_patch_size = c.in_channels, c.patch_size, c.temporal_patch_size
        self.merge = c.spatial_merge_size
        self.merge_unit = self.merge ** 2
        self.out_hidden_size = c.out_hidden_size
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        self.grid_side = math.isqrt(c.num_position_embeddings)
        if self.grid_side ** 2 != c.num_position_embeddings:
            raise CheckpointError(f"config.json vision_config.num_position_embeddings {c.num_position_embeddings} is "
                                  f"not a square: the learned positions are a square grid")
        # a tower configured without DeepStack (Qwen3.5's: no such field) has no levels
        self.deepstack_visual_indexes = tuple(int(i) for i in getattr(c, "deepstack_visual_indexes", None) or ())
        if any(not 0 <= i < c.depth for i in self.deepstack_visual_indexes) or \
                len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise CheckpointError(f"config.json vision_config.deepstack_visual_indexes "
                                  f"{list(self.deepstack_visual_indexes)} must name distinct vision blocks "
                                  f"0..{c.depth - 1}")
        if c.hidden_act not in ACTIVATIONS:
            raise CheckpointError(f"config.json vision_config.hidden_act {c.hidden_act!r} is not supported "
                                  f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        if c.hidden_size % c.num_heads or (c.hidden_size // c.num_heads) % 4:
            raise CheckpointError(f"config.json vision_config.hidden_size {c.hidden_size} over num_heads {c.num_heads} "
                                  f"must give a head_dim divisible by 4 (its halves rotate by patch row and column)")
        rope = getattr(c, "rope_parameters", None) or {}
        self.rotary = VisionRotaryEmbedding(c.hidden_size // c.num_heads, rope.get("rope_theta", 10000.0), device)
        # Conv3d with kernel == stride over one patch is a matmul with the flattened kernel; whole on every rank
        self.patch_embed = ColumnParallelLinear(self.patch_dim, c.hidden_size, True, dtype, device)
        self.pos_embed = nn.Parameter(torch.empty(c.num_position_embeddings, c.hidden_size, dtype=dtype,
                                                  device=device))  # [side * side, dim], whole on every rank
        self.blocks = nn.ModuleList(VisionBlock(c.hidden_size, c.num_heads, c.intermediate_size, c.hidden_act,
                                                dtype, device, self.ops, tp) for _ in range(c.depth))
        self.projector = Projector(c.hidden_size, c.out_hidden_size, self.merge_unit,
                                   len(self.deepstack_visual_indexes), dtype, device, tp)
        self.requires_grad_(False)

    def _grid_positions(self, grid_thw: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned position embedding of every patch `[N, dim]` (float32) and its (row, column)
        `[N, 2]`, block-major within each frame as the patches arrive."""
        m, side = self.merge, self.grid_side
        embeds, rows_cols = [], []
        table = self.pos_embed.float().view(side, side, -1)  # [side, side, dim]
        for t, h, w in grid_thw:
            # bilinear is separable: rows, then columns. transformers gathers the 4 taps of every patch
            # instead ([N, 4, dim] at once); the sums differ only in rounding
            rows = torch.einsum("is,std->itd", _bilinear(h, side, device), table)  # [h, side, dim]
            emb = torch.einsum("jt,itd->ijd", _bilinear(w, side, device), rows)  # [h, w, dim]
            blocks = (h // m, m, w // m, m)
            emb = emb.view(*blocks, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)  # [h*w, dim] block-major
            embeds.append(emb.repeat(t, 1))
            r, c = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            rc = torch.stack([r, c], dim=-1).view(*blocks, 2).permute(0, 2, 1, 3, 4).reshape(h * w, 2)  # [h*w, 2]
            rows_cols.append(rc.repeat(t, 1))
        return torch.cat(embeds), torch.cat(rows_cols)

    def forward(self, pixel_values: torch.Tensor,  # [num_patches, patch_dim]
                grid_thw: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(merged tokens `[num_patches / merge^2, out_hidden]`, one `[num_patches / merge^2, out_hidden]`
        per DeepStack level), tokens in the images' order, each image's in its merge blocks' raster order."""
        grid_thw = check_patch_grids(pixel_values, grid_thw, self.patch_dim, self.merge)
        device = self.patch_embed.weight.device
        x = self.patch_embed(pixel_values.to(device=device, dtype=self.patch_embed.weight.dtype))  # [N, dim]
        pos, rows_cols = self._grid_positions(grid_thw, device)  # [N, dim] float32, [N, 2]
        x = x + pos.to(x.dtype)
        rope = self.ops.rotary_inputs(rows_cols.t(), self.rotary, torch.float32)  # positions [2, N]: (row, column)
        plan = self.ops.attention.segments([h * w for t, h, w in grid_thw for _ in range(t)], device)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, plan)
            if i in self.deepstack_visual_indexes:
                levels.append(self.projector.deepstack[self.deepstack_visual_indexes.index(i)](x))
        return self.projector.merger(x), levels

    def checkpoint_map(self, prefix: str = "model.visual.") -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint name (published layout: `model.visual.blocks.N.attn.qkv.weight`) -> where this rank's
        slice goes."""
        e, p = self.dim, self.patch_size
        out = {
            f"{prefix}patch_embed.proj.weight": ParamSlot(
                "patch_embed.weight", (e, self.in_channels, self.temporal_patch_size, p, p)),
            f"{prefix}patch_embed.proj.bias": ParamSlot("patch_embed.bias", (e,)),
            f"{prefix}pos_embed.weight": ParamSlot("pos_embed", tuple(self.pos_embed.shape)),
            **self.projector.merger.slots(f"{prefix}merger.", "projector.merger."),
        }
        for k, merger in enumerate(self.projector.deepstack):
            out.update(merger.slots(f"{prefix}deepstack_merger_list.{k}.", f"projector.deepstack.{k}."))
        for i, block in enumerate(self.blocks):
            out.update(block.slots(f"{prefix}blocks.{i}.", f"blocks.{i}."))
        return out
