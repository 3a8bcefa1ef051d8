"""Rotary position embedding (RoPE and Qwen2-VL's M-RoPE), in place on q and k.

    q:         [num_tokens, num_heads, head_dim]      strided views of one packed qkv
    k:         [num_tokens, num_kv_heads, head_dim]   [N, H + 2Hkv, D] tensor; last dim contiguous
    positions: [num_tokens] (plain RoPE) or [3, num_tokens] (M-RoPE rows t, h, w) int64 / int32
    inv_freq:  [head_dim // 2] float32

Neox / rotate_half layout: with x1 = x[..., :D/2], x2 = x[..., D/2:] and angle_i = pos_i * inv_freq[i],
    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
cos/sin and the rotation are computed in float32 and stored in the tensor dtype. M-RoPE splits the D/2
frequencies into `mrope_section` (e.g. (16, 24, 24)): frequency i takes its position from row `s % 3`, s being
the index of the section holding i. Without a section, [3, N] positions use row 0 (text-only M-RoPE).

Grid: one program per token. The angles depend only on the token, so each program computes cos/sin once
([BLOCK_HALF], the section -> row choice folded in at compile time) and reuses them for all q heads and
then all k heads, in [BLOCK_H, BLOCK_HALF] tiles; v, which sits between and after them in the packed
tensor, is never touched. No cos/sin cache is built on the host, so nothing is allocated or copied per
call and the launcher is capture-safe.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.rotary_torch import apply_rotary

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Heads x half-dim elements rotated per tile: bounds registers while covering a whole GQA group of a
# 128-dim head (e.g. 28 q heads x 64) in one step.
_TILE_ELEMS = 2048


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, half_dim, cos, sin,  # cos, sin: [BLOCK_HALF] float32
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half_dim)  # [BLOCK_H, BLOCK_HALF]
        ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
        ptr2 = ptr1 + half_dim
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr2, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr,
                   stride_qn, stride_qh, stride_kn, stride_kh, stride_pos_row, stride_pos_n,
                   num_heads, num_kv_heads, half_dim,
                   SECTION_ENDS: tl.constexpr,  # cumulative ends of the M-RoPE sections, () = plain RoPE
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=offs_d < half_dim, other=0.0)  # [BLOCK_HALF]
    pos_t = tl.load(pos_ptr + token * stride_pos_n).to(tl.float32)
    if len(SECTION_ENDS) == 0:
        pos = tl.zeros([BLOCK_HALF], tl.float32) + pos_t
    else:
        pos_h = tl.load(pos_ptr + stride_pos_row + token * stride_pos_n).to(tl.float32)
        pos_w = tl.load(pos_ptr + 2 * stride_pos_row + token * stride_pos_n).to(tl.float32)
        row = tl.zeros([BLOCK_HALF], tl.int32)  # which position row each frequency reads
        for s in tl.static_range(1, len(SECTION_ENDS)):
            row = tl.where(offs_d >= SECTION_ENDS[s - 1], s % 3, row)
        pos = tl.where(row == 0, pos_t, tl.where(row == 1, pos_h, pos_w))  # [BLOCK_HALF]
    angle = pos * inv_freq
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    _rotate_heads(q_ptr + token * stride_qn, stride_qh, num_heads, half_dim, cos, sin, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kn, stride_kh, num_kv_heads, half_dim, cos, sin, BLOCK_HK, BLOCK_HALF)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           mrope_section: tuple[int, ...] | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    n, _, d = q.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype in {_DTYPES}, got {q.dtype} and {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dim")
    if positions.dtype not in (torch.int64, torch.int32) or positions.shape not in ((n,), (3, n)):
        raise ValueError(f"positions must be [{n}] or [3, {n}] int64, got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be [{d // 2}] float32, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if mrope_section is not None and (sum(mrope_section) != d // 2 or any(s < 0 for s in mrope_section)):
        raise ValueError(f"mrope_section {tuple(mrope_section)} must be non-negative and sum to "
                         f"head_dim // 2 = {d // 2}")


def rotary_embedding(q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
                     k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
                     positions: torch.Tensor,  # [num_tokens] or [3, num_tokens]
                     inv_freq: torch.Tensor,  # [head_dim // 2] float32
                     mrope_section: tuple[int, ...] | None = None) -> None:
    """Apply (M-)RoPE to q and k in place (rotate_half layout, float32 math)."""
    _check(q, k, positions, inv_freq, mrope_section)
    n, h, d = q.shape
    hkv = k.shape[1]
    if n == 0:
        return
    mrope = positions.dim() == 2 and mrope_section is not None
    section_ends = tuple(accumulate(int(s) for s in mrope_section)) if mrope else ()
    if positions.dim() == 2:
        stride_pos_row, stride_pos_n = positions.stride(0), positions.stride(1)
    else:
        stride_pos_row, stride_pos_n = 0, positions.stride(0)
    block_half = triton.next_power_of_2(d // 2)
    max_heads = max(1, _TILE_ELEMS // block_half)
    _rotary_kernel[(n,)](
        q, k, positions, inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), stride_pos_row, stride_pos_n,
        h, hkv, d // 2,
        SECTION_ENDS=section_ends,
        BLOCK_HQ=min(triton.next_power_of_2(h), max_heads), BLOCK_HK=min(triton.next_power_of_2(hkv), max_heads),
        BLOCK_HALF=block_half,
        num_warps=4,
    )


def _angles(positions: torch.Tensor,  # [N] or [3, N]
            inv_freq: torch.Tensor,  # [D/2] float32
            mrope_section: tuple[int, ...] | None) -> torch.Tensor:  # [N, D/2] float32
    if positions.dim() == 1:
        return positions[:, None].float() * inv_freq
    if mrope_section is None:
        return positions[0][:, None].float() * inv_freq
    parts, start = [], 0
    for s, size in enumerate(mrope_section):  # slices, not a gather index: nothing copied to the device
        parts.append(positions[s % 3][:, None].float() * inv_freq[start:start + size])
        start += size
    return torch.cat(parts, dim=-1)


def rotary_embedding_ref(q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
                         k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
                         positions: torch.Tensor,  # [num_tokens] or [3, num_tokens]
                         inv_freq: torch.Tensor,  # [head_dim // 2] float32
                         mrope_section: tuple[int, ...] | None = None) -> None:
    """Torch reference of `rotary_embedding` (same semantics, in place)."""
    _check(q, k, positions, inv_freq, mrope_section)
    angles = _angles(positions, inv_freq, mrope_section)  # [N, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [N, 1, D/2]
    for x in (q, k):
        x.copy_(apply_rotary(x.float(), cos, sin))
