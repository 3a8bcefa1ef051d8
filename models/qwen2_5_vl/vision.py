"""The Qwen2.5-VL vision tower: patch embed -> blocks (window / full attention) -> patch merger.

Token order. The image processor emits patches block-major: each run of merge^2 = 4 patches is one 2x2
merge block, blocks in raster order. Window attention wants the blocks of one window to be adjacent,
so the tower reorders blocks once (window order), runs every block in that order, and restores the
raster order after the merger:

    merged grid 6x6, window 4x4 merged units (window_size 112 / patch 14 / merge 2):
      raster:  0  1  2  3 | 4  5        window order:  w0 = 0..3, 6..9, 12..15, 18..21   (16 units)
               6  7  8  9 |10 11                       w1 = 4, 5, 10, 11, 16, 17, 22, 23  (8)
              ...         |                            w2 = 24..27, 30..33                (8)
              ------------+-----                       w3 = 28, 29, 34, 35                (4)

Window blocks attend within their window; blocks in `fullatt_block_indexes` attend within the whole
image (per frame). Windows and images are never mixed.

Tensor parallelism (`tp`, one rank of size 1 by default): each block holds its rank's heads of q/k/v
(the fused `attn.qkv` checkpoint tensor is split per part, a `SplitSlot`), its columns of proj, its
rows of gate/up and its columns of down; the merger's fc1 / fc2 likewise. The residual stream, the
norms and patch_embed are whole on every rank; proj, down_proj and the merger's fc2 all-reduce their
outputs (`RowParallelLinear`), so `attention` / `mlp` / the merger return the whole sum on every rank.

Kernels (the model's kernel set, `layers.ops`; the torch set is the reference): the 2-D RoPE is
`ops.rotary` in place on the q and k heads of the qkv output (`VisionRotaryEmbedding`: M-RoPE with a row
and a column section, float32 math as HF's); the gated SiLU MLP is `ops.silu_and_mul` on the fused
gate|up output; every residual add is fused into the RMSNorm that follows it (`ops.add_rms_norm`):
norm2 after the attention, and the next block's norm1 (after the last block, the merger's ln_q) after the
MLP, so the stream travels between blocks as (normed h, residual):

    h = norm1_0(x), r = x
    block i:  h, r = add_rms_norm(attention(h), r, norm2_i);  h, r = add_rms_norm(mlp(h), r, next norm)
    merger:   fc2(gelu(fc1(h viewed [N/4, 4*dim])))
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.weight_loading import ParamSlot, SplitSlot
from vlm_sdk.kernels.rms_norm_torch import rms_norm
from vlm_sdk.layers.activation import ACTIVATIONS
from vlm_sdk.layers.attention import SegmentAttention
from vlm_sdk.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear)
from vlm_sdk.layers.norm import RMSNorm
from vlm_sdk.layers.ops import KernelOps, TorchOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.rotary import RotaryInputs, VisionRotaryEmbedding
from vlm_sdk.models.common.qwen_vl.vision_attention import attend, check_patch_grids


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int, act: str, dtype: torch.dtype, device, ops: KernelOps,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.ops = ops
        self.heads, self.head_dim = tp.split(heads, "vision attention heads"), dim // heads  # heads: this rank's
        self.attn = SegmentAttention(self.heads, self.head_dim, self.head_dim ** -0.5, ops.attention)
        self.act = ACTIVATIONS[act]
        self.fused_silu = act == "silu"  # silu(gate) * up in one kernel
        self.norm1 = RMSNorm(dim, 1e-6, dtype, device)
        self.qkv = QKVParallelLinear(dim, self.head_dim, heads, heads, True, dtype, device, tp)
        self.proj = RowParallelLinear(dim, dim, True, dtype, device, tp)
        self.norm2 = RMSNorm(dim, 1e-6, dtype, device)
        self.gate_up_proj = MergedColumnParallelLinear(dim, [inter, inter], True, dtype, device, tp)
        self.down_proj = RowParallelLinear(inter, dim, True, dtype, device, tp)

    def attention(self, h: torch.Tensor,  # [N, dim], norm1(x)
                  rope: RotaryInputs, plan: Any) -> torch.Tensor:  # [N, dim], summed over ranks
        return attend(self, h, rope, plan)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:  # [N, dim], norm2(x) -> [N, dim], summed over ranks
        gate_up = self.gate_up_proj(h)  # [N, 2 * inter/tp]: this rank's gate | up
        if self.fused_silu:
            return self.down_proj(self.ops.silu_and_mul(gate_up))  # [N, inter/tp] -> [N, dim]
        gate, up = gate_up.chunk(2, dim=-1)  # [N, inter/tp] each
        return self.down_proj(self.act(gate) * up)

    def forward(self, h: torch.Tensor,  # [N, dim] norm1(residual), window order
                residual: torch.Tensor,  # [N, dim] the stream x
                rope: RotaryInputs, plan: Any,  # plan: `attention.segments` of windows or of whole images
                next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(next_norm(x'), x') for x' = this block's output: x + attn, then + mlp, each add fused into
        the norm after it."""
        ops = self.ops
        h, residual = ops.add_rms_norm(self.attention(h, rope, plan), residual, self.norm2.weight, self.norm2.eps)
        return ops.add_rms_norm(self.mlp(h), residual, next_norm.weight, next_norm.eps)

    def slots(self, src: str, dst: str) -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint names under `src` (`visual.blocks.N.`) -> this rank's slices, params under `dst`."""
        e = self.norm1.weight.shape[0]
        return {
            f"{src}norm1.weight": ParamSlot(f"{dst}norm1.weight", (e,)),
            f"{src}norm2.weight": ParamSlot(f"{dst}norm2.weight", (e,)),
            **self.qkv.fused_slots(f"{dst}qkv.", f"{src}attn.qkv.weight", f"{src}attn.qkv.bias"),
            **self.proj.slots(f"{dst}proj.", f"{src}attn.proj.weight", f"{src}attn.proj.bias"),
            **self.gate_up_proj.slots(f"{dst}gate_up_proj.", [f"{src}mlp.gate_proj.weight", f"{src}mlp.up_proj.weight"],
                                      [f"{src}mlp.gate_proj.bias", f"{src}mlp.up_proj.bias"]),
            **self.down_proj.slots(f"{dst}down_proj.", f"{src}mlp.down_proj.weight", f"{src}mlp.down_proj.bias"),
        }


class PatchMerger(nn.Module):
    def __init__(self, dim: int, out_dim: int, merge_unit: int, dtype: torch.dtype, device,
                 tp: TPGroup = TPGroup()):
        super().__init__()
        self.in_dim = dim * merge_unit
        self.ln_q = RMSNorm(dim, 1e-6, dtype, device)
        self.fc1 = ColumnParallelLinear(self.in_dim, self.in_dim, True, dtype, device, tp)
        self.fc2 = RowParallelLinear(self.in_dim, out_dim, True, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N / merge_unit, out_dim]
        return self.project(rms_norm(x, self.ln_q.weight, self.ln_q.eps))

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [N, dim] ln_q(x) -> [N / merge_unit, out_dim]
        return self.fc2(F.gelu(self.fc1(h.view(-1, self.in_dim))))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, vision_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None, tp: TPGroup = TPGroup()):
        super().__init__()
        c = vision_config
        self.ops = ops or TorchOps()
        self.dim, self.heads = c.hidden_size, c.num_heads
        self.in_channels, self.patch_size, self.temporal_patch_size = c.in_channels, c.patch_size, c.temporal_patch_size
        self.merge = c.spatial_merge_size
        self.merge_unit = self.merge ** 2
        self.window_units = c.window_size // self.merge // self.patch_size  # merged units per window side
        self.fullatt_block_indexes = frozenset(c.fullatt_block_indexes)
        self.out_hidden_size = c.out_hidden_size
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        rope = getattr(c, "rope_parameters", None) or {}
        self.rotary = VisionRotaryEmbedding(c.hidden_size // c.num_heads, rope.get("rope_theta", 10000.0), device)
        # Conv3d with kernel == stride over one patch is a matmul with the flattened kernel; whole on every rank
        self.patch_embed = ColumnParallelLinear(self.patch_dim, c.hidden_size, False, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(c.hidden_size, c.num_heads, c.intermediate_size, c.hidden_act,
                                                dtype, device, self.ops, tp) for _ in range(c.depth))
        self.merger = PatchMerger(c.hidden_size, c.out_hidden_size, self.merge_unit, dtype, device, tp)
        self.requires_grad_(False)

    def _layout(self, grid_thw: list[tuple[int, int, int]]):
        """Window order of the merge blocks, (h, w) patch positions in that order, and the segment lengths."""
        m, ws = self.merge, self.window_units
        orders, positions, window_lens, image_lens = [], [], [], []
        offset = 0
        for t, h, w in grid_thw:
            gh, gw = h // m, w // m
            tt, rr, cc = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            nwh, nww = -(-gh // ws), -(-gw // ws)
            window = (tt * nwh + rr // ws) * nww + cc // ws  # [t, gh, gw] window id of each merged unit
            key = window * ws * ws + (rr % ws) * ws + cc % ws
            order = torch.argsort(key.flatten())  # merged units in window order
            orders.append(order + offset)
            window_lens += (torch.bincount(window.flatten(), minlength=t * nwh * nww) * self.merge_unit).tolist()
            image_lens += [h * w] * t
            # (h, w) of each patch, block-major within each frame: [gh, gw, m, m] -> flat
            hpos = (rr[0][:, :, None, None] * m + torch.arange(m)[:, None]).expand(gh, gw, m, m)
            wpos = (cc[0][:, :, None, None] * m + torch.arange(m)[None, :]).expand(gh, gw, m, m)
            hw = torch.stack([hpos.reshape(-1, self.merge_unit), wpos.reshape(-1, self.merge_unit)], dim=-1)
            positions.append(hw.repeat(t, 1, 1)[order])  # [t*gh*gw, merge_unit, 2] in window order
            offset += t * gh * gw
        window_index = torch.cat(orders)  # [num_merged]
        pos = torch.cat(positions).reshape(-1, 2)  # [num_patches, 2]
        return window_index, pos, window_lens, image_lens

    def forward(self, pixel_values: torch.Tensor,  # [num_patches, patch_dim]
                grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:  # [num_patches / merge^2, out_hidden]
        grid_thw = check_patch_grids(pixel_values, grid_thw, self.patch_dim, self.merge)
        device = self.patch_embed.weight.device
        window_index, pos, window_lens, image_lens = self._layout(grid_thw)
        window_index, pos = window_index.to(device), pos.to(device)
        patch_order = (window_index[:, None] * self.merge_unit + torch.arange(self.merge_unit, device=device)).flatten()
        x = self.patch_embed(pixel_values.to(device=device, dtype=self.patch_embed.weight.dtype)[patch_order])
        rope = self.ops.rotary_inputs(pos.t(), self.rotary, torch.float32)  # positions [2, N]: (h, w)
        window_plan = self.ops.attention.segments(window_lens, device)
        full_plan = self.ops.attention.segments(image_lens, device)
        norms = [block.norm1 for block in self.blocks] + [self.merger.ln_q]  # the norm after each residual add
        h, residual = self.ops.rms_norm(x, norms[0].weight, norms[0].eps), x  # [N, dim] each
        for i, block in enumerate(self.blocks):
            plan = full_plan if i in self.fullatt_block_indexes else window_plan
            h, residual = block(h, residual, rope, plan, norms[i + 1])
        merged = self.merger.project(h)  # [num_merged, out_hidden], window order
        out = torch.empty_like(merged)
        out[window_index] = merged  # back to raster order
        return out

    def checkpoint_map(self, prefix: str = "visual.") -> dict[str, ParamSlot | SplitSlot]:
        """Checkpoint name (published layout: `visual.blocks.N.attn.qkv.weight`) -> where this rank's
        slice goes."""
        e, m = self.dim, self.merger
        out = {
            f"{prefix}patch_embed.proj.weight": ParamSlot(
                "patch_embed.weight", (e, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)),
            f"{prefix}merger.ln_q.weight": ParamSlot("merger.ln_q.weight", (e,)),
            **m.fc1.slots("merger.fc1.", f"{prefix}merger.mlp.0.weight", f"{prefix}merger.mlp.0.bias"),
            **m.fc2.slots("merger.fc2.", f"{prefix}merger.mlp.2.weight", f"{prefix}merger.mlp.2.bias"),
        }
        for i, block in enumerate(self.blocks):
            out.update(block.slots(f"{prefix}blocks.{i}.", f"blocks.{i}."))
        return out
