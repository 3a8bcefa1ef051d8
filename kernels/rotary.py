"""Rotary position embedding (RoPE, Qwen2-VL's M-RoPE and Qwen3-VL's interleaved M-RoPE), in place on q
and k, optionally after Qwen3's per-head RMSNorm of q and k (fused: one read and one write of each head).

    q:         [num_tokens, num_heads, head_dim]      strided views of one packed qkv
    k:         [num_tokens, num_kv_heads, head_dim]   [N, H + 2Hkv, D] tensor; last dim contiguous
    positions: [num_tokens] (plain RoPE) or [3, num_tokens] (M-RoPE rows t, h, w) int64 / int32, or
               [2, num_tokens] with a two-part contiguous section (rows 0 and 1 only)
    inv_freq:  [head_dim // 2] float32
    q_norm_weight, k_norm_weight: [head_dim] (optional, together)

Neox / rotate_half layout: with x1 = x[..., :D/2], x2 = x[..., D/2:] and angle_i = pos_i * inv_freq[i],
    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
cos/sin and the rotation are computed in float32 and stored in the tensor dtype. M-RoPE gives each of the
D/2 frequencies a position row from `mrope_section`, contiguous or interleaved (`mrope_interleaved`):
the layouts are spelled out in rotary_torch.py (`mrope_axes`). Without a section, [3, N] positions use
row 0 (text-only M-RoPE).

The vision towers' 2-D RoPE (Qwen2.5-VL, Qwen3-VL) is this kernel with positions [2, N] = (patch row,
patch column), mrope_section (D/4, D/4) and inv_freq = cat(f, f) for the tower's f [D/4]: frequency i
< D/4 turns with the row, the rest with the column (`layers.rotary.VisionRotaryEmbedding`).

With the norm weights, each head is first normalised as HF's RMSNorm over head_dim does (float32 sum of
squares, the normalised head rounded to the dtype, times the weight, rounded again), then rotated: what
Qwen3's `q_norm` / `k_norm` followed by `apply_rotary_pos_emb` compute, with the rotation in float32.

Grid: one program per token. The angles depend only on the token, so each program computes cos/sin once
([BLOCK_HALF], the frequency -> row choice folded in at compile time) and reuses them for all q heads and
then all k heads, in [BLOCK_H, BLOCK_HALF] tiles; v, which sits between and after them in the packed
tensor, is never touched. A tile holds whole heads, so the norm's sum of squares needs no second pass.
No cos/sin cache is built on the host, so nothing is allocated or copied per call and the launcher is
capture-safe; cos/sin come from `_cos_sin` (a float64 quadrant reduction and short polynomials), not
libdevice's cosf/sinf, whose reduction of huge arguments spilled registers on sm_90.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.fp8_bits import f32_to_e4m3_bits
from vlm_sdk.kernels.rms_norm_torch import rms_norm
from vlm_sdk.kernels.rotary_torch import apply_rotary, check_mrope_section

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Heads x half-dim elements rotated per tile: bounds registers while covering a whole GQA group of a
# 128-dim head (e.g. 28 q heads x 64) in one step.
_TILE_ELEMS = 2048


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, half_dim, cos, sin,  # cos, sin: [BLOCK_HALF] float32
                  w_ptr, eps,  # the per-head RMSNorm weight [2 * half_dim] and eps, read when HAS_NORM
                  dst_ptr, dst_stride_h, dst_heads,  # HAS_DST: the first dst_heads rotated heads also go there
                  dst_scale_ptr,  # DST_FP8: dst is an FP8 KV cache's uint8 view, written as e4m3 of value / scale
                  HAS_NORM: tl.constexpr, HAS_DST: tl.constexpr, DST_FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half_dim)  # [BLOCK_H, BLOCK_HALF]
        ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
        ptr2 = ptr1 + half_dim
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:  # masked lanes are 0, so they add nothing to the sum of squares
            rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * half_dim) + eps)  # [BLOCK_H]
            w1 = tl.load(w_ptr + offs_d, mask=offs_d < half_dim, other=0.0).to(tl.float32)  # [BLOCK_HALF]
            w2 = tl.load(w_ptr + half_dim + offs_d, mask=offs_d < half_dim, other=0.0).to(tl.float32)
            # HF rounds the normalised head to the dtype before the weight, and the product after it
            x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
        out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
        out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
        tl.store(ptr1, out1, mask=mask)
        tl.store(ptr2, out2, mask=mask)
        if HAS_DST:  # the values just stored, cast (or quantized: store_kv's `_to_cache`) as a copy would be
            dst1 = dst_ptr + offs_h[:, None] * dst_stride_h + offs_d[None, :]
            dst_mask = (offs_h[:, None] < dst_heads) & (offs_d[None, :] < half_dim)
            if DST_FP8:
                scale = tl.load(dst_scale_ptr)
                tl.store(dst1, f32_to_e4m3_bits(out1.to(tl.float32) / scale), mask=dst_mask)
                tl.store(dst1 + half_dim, f32_to_e4m3_bits(out2.to(tl.float32) / scale), mask=dst_mask)
            else:
                tl.store(dst1, out1.to(dst_ptr.dtype.element_ty), mask=dst_mask)
                tl.store(dst1 + half_dim, out2.to(dst_ptr.dtype.element_ty), mask=dst_mask)


_HALF_PI = tl.constexpr(1.5707963267948966)  # float64: the quadrant reduction runs in float64


@triton.jit
def _cos_sin(angle):  # angle: float32, any size -> (cos, sin) float32
    """cos and sin of float32 angles without libdevice's cosf/sinf: their reduction of huge arguments
    (Payne-Hanek) keeps an array in local memory, which spilled 8 bytes on sm_90. Here the angle is
    reduced to r in [-pi/4, pi/4] and a quadrant in float64 (exact for the angles positions reach:
    |angle| 1e7 loses ~1e-9 rad), and cos r / sin r are Taylor polynomials to r^10 / r^11 (error below
    2e-9 there, under float32's rounding): within ~1 ulp of torch's cos / sin of the same float32 angle."""
    a = angle.to(tl.float64)
    k = tl.floor(a * (1.0 / _HALF_PI) + 0.5)
    r = (a - k * _HALF_PI).to(tl.float32)
    quadrant = k.to(tl.int32) & 3
    r2 = r * r
    c = 1.0 + r2 * (-1.0 / 2 + r2 * (1.0 / 24 + r2 * (-1.0 / 720 + r2 * (1.0 / 40320 + r2 * (-1.0 / 3628800)))))
    s = r * (1.0 + r2 * (-1.0 / 6 + r2 * (1.0 / 120 + r2 * (-1.0 / 5040 + r2 * (1.0 / 362880
                                                                               + r2 * (-1.0 / 39916800))))))
    # angle = r + quadrant * pi/2: cos, sin turn by a quarter per quadrant
    cos = tl.where(quadrant == 0, c, tl.where(quadrant == 1, -s, tl.where(quadrant == 2, -c, s)))
    sin = tl.where(quadrant == 0, s, tl.where(quadrant == 1, c, tl.where(quadrant == 2, -s, -c)))
    return cos, sin


@triton.jit
def _token_cos_sin(pos_ptr, inv_freq_ptr, token, stride_pos_row, stride_pos_n, half_dim,
                   SECTION_ENDS: tl.constexpr,  # cumulative ends of contiguous M-RoPE sections, or ()
                   INTERLEAVED_ENDS: tl.constexpr,  # (3 * section[1], 3 * section[2]) when interleaved, or ()
                   BLOCK_HALF: tl.constexpr):
    """cos, sin [BLOCK_HALF] float32 of one token: each frequency's angle from its position row."""
    offs_d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=offs_d < half_dim, other=0.0)  # [BLOCK_HALF]
    pos_t = tl.load(pos_ptr + token * stride_pos_n).to(tl.float32)
    if len(SECTION_ENDS) + len(INTERLEAVED_ENDS) == 0:
        pos = tl.zeros([BLOCK_HALF], tl.float32) + pos_t
    else:
        pos_h = tl.load(pos_ptr + stride_pos_row + token * stride_pos_n).to(tl.float32)
        if 3 * len(INTERLEAVED_ENDS) + len(SECTION_ENDS) > 2:  # interleaved, or 3+ contiguous sections
            pos_w = tl.load(pos_ptr + 2 * stride_pos_row + token * stride_pos_n).to(tl.float32)
        else:  # two contiguous sections read rows 0 and 1 only: [2, N] positions (the vision towers' h, w)
            pos_w = pos_h
        row = tl.zeros([BLOCK_HALF], tl.int32)  # which position row each frequency reads
        if len(INTERLEAVED_ENDS) == 0:
            for s in tl.static_range(1, len(SECTION_ENDS)):
                row = tl.where(offs_d >= SECTION_ENDS[s - 1], s % 3, row)
        else:  # h on 1, 4, 7, ... below 3 * section[1]; w on 2, 5, 8, ... below 3 * section[2]
            lane = offs_d % 3
            row = tl.where((lane == 1) & (offs_d < INTERLEAVED_ENDS[0]), 1, row)
            row = tl.where((lane == 2) & (offs_d < INTERLEAVED_ENDS[1]), 2, row)
        pos = tl.where(row == 0, pos_t, tl.where(row == 1, pos_h, pos_w))  # [BLOCK_HALF]
    return _cos_sin(pos * inv_freq)  # the float32 angle, as HF's inv_freq x position


# [3, N] positions: the row stride is the step's token count, not specialised (no compile while serving)
# positions may be a view into a packed step buffer at any offset: not specialised on alignment either
@triton.jit(do_not_specialize=["stride_pos_row"], do_not_specialize_on_alignment=["pos_ptr"])
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr, eps,
                   stride_qn, stride_qh, stride_kn, stride_kh, stride_pos_row, stride_pos_n,
                   num_heads, num_kv_heads, half_dim,
                   SECTION_ENDS: tl.constexpr, INTERLEAVED_ENDS: tl.constexpr, HAS_NORM: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(pos_ptr, inv_freq_ptr, token, stride_pos_row, stride_pos_n, half_dim,
                              SECTION_ENDS, INTERLEAVED_ENDS, BLOCK_HALF)
    _rotate_heads(q_ptr + token * stride_qn, stride_qh, num_heads, half_dim, cos, sin, q_norm_ptr, eps,
                  q_ptr, 0, 0, inv_freq_ptr, HAS_NORM, False, False, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kn, stride_kh, num_kv_heads, half_dim, cos, sin, k_norm_ptr, eps,
                  k_ptr, 0, 0, inv_freq_ptr, HAS_NORM, False, False, BLOCK_HK, BLOCK_HALF)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           mrope_section: tuple[int, ...] | None, mrope_interleaved: bool,
           q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None) -> None:
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
    two_rows = mrope_section is not None and not mrope_interleaved and len(mrope_section) <= 2
    shapes = ((n,), (3, n), (2, n)) if two_rows else ((n,), (3, n))
    if positions.dtype not in (torch.int64, torch.int32) or positions.shape not in shapes:
        raise ValueError(f"positions must be [{n}] or [3, {n}] int64 ([2, {n}] too with a two-part contiguous "
                         f"mrope_section), got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be [{d // 2}] float32, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if mrope_section is not None:
        check_mrope_section(tuple(mrope_section), mrope_interleaved, d // 2)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (d,) or w.dtype != q.dtype or w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{d}] {q.dtype} tensor (q's dtype), "
                             f"got {tuple(w.shape)} {w.dtype}")


def rotary_embedding(q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
                     k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
                     positions: torch.Tensor,  # [num_tokens] or [3, num_tokens]
                     inv_freq: torch.Tensor,  # [head_dim // 2] float32
                     mrope_section: tuple[int, ...] | None = None,
                     mrope_interleaved: bool = False,
                     q_norm_weight: torch.Tensor | None = None,  # [head_dim]
                     k_norm_weight: torch.Tensor | None = None,  # [head_dim]
                     norm_eps: float = 1e-6) -> None:
    """Apply (M-)RoPE to q and k in place (rotate_half layout, float32 math), after a per-head RMSNorm
    of each when the norm weights are given."""
    _check(q, k, positions, inv_freq, mrope_section, mrope_interleaved, q_norm_weight, k_norm_weight)
    n, h, d = q.shape
    hkv = k.shape[1]
    if n == 0:
        return
    p = launch_params(q, k, positions, mrope_section, mrope_interleaved, q_norm_weight is not None)
    has_norm = q_norm_weight is not None
    _rotary_kernel[(n,)](
        q, k, positions, inv_freq,
        q_norm_weight if has_norm else inv_freq, k_norm_weight if has_norm else inv_freq, norm_eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), p.stride_pos_row, p.stride_pos_n,
        h, hkv, d // 2, **p.constexprs, num_warps=4)


@dataclass(frozen=True)
class LaunchParams:
    """What a rotary launch derives from its inputs: the positions' strides and the constexprs
    (`SECTION_ENDS`, `INTERLEAVED_ENDS`, `HAS_NORM`, the head tiles, `BLOCK_HALF`)."""
    stride_pos_row: int
    stride_pos_n: int
    constexprs: dict


def launch_params(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, mrope_section: tuple[int, ...] | None,
                  mrope_interleaved: bool, has_norm: bool) -> LaunchParams:
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    mrope = positions.dim() == 2 and mrope_section is not None
    interleaved = mrope and mrope_interleaved
    section_ends = tuple(accumulate(int(s) for s in mrope_section)) if mrope and not interleaved else ()
    interleaved_ends = (3 * int(mrope_section[1]), 3 * int(mrope_section[2])) if interleaved else ()
    if positions.dim() == 2:
        stride_pos_row, stride_pos_n = positions.stride(0), positions.stride(1)
    else:
        stride_pos_row, stride_pos_n = 0, positions.stride(0)
    block_half = triton.next_power_of_2(d // 2)
    max_heads = max(1, _TILE_ELEMS // block_half)
    return LaunchParams(stride_pos_row, stride_pos_n, dict(
        SECTION_ENDS=section_ends, INTERLEAVED_ENDS=interleaved_ends, HAS_NORM=has_norm,
        BLOCK_HQ=min(triton.next_power_of_2(h), max_heads), BLOCK_HK=min(triton.next_power_of_2(hkv), max_heads),
        BLOCK_HALF=block_half))


def _angles(positions: torch.Tensor,  # [N] or [3, N]
            inv_freq: torch.Tensor,  # [D/2] float32
            mrope_section: tuple[int, ...] | None,
            mrope_interleaved: bool) -> torch.Tensor:  # [N, D/2] float32
    if positions.dim() == 1:
        return positions[:, None].float() * inv_freq
    if mrope_section is None:
        return positions[0][:, None].float() * inv_freq
    if mrope_interleaved:  # transformers' recomposition: t everywhere, then h and w over strided slices
        angles = positions[0][:, None].float() * inv_freq
        for row in (1, 2):
            idx = slice(row, 3 * mrope_section[row], 3)
            angles[:, idx] = positions[row][:, None].float() * inv_freq[idx]
        return angles
    parts, start = [], 0
    for s, size in enumerate(mrope_section):  # slices, not a gather index: nothing copied to the device
        parts.append(positions[s % 3][:, None].float() * inv_freq[start:start + size])
        start += size
    return torch.cat(parts, dim=-1)


def rotary_embedding_ref(q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
                         k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
                         positions: torch.Tensor,  # [num_tokens] or [3, num_tokens]
                         inv_freq: torch.Tensor,  # [head_dim // 2] float32
                         mrope_section: tuple[int, ...] | None = None,
                         mrope_interleaved: bool = False,
                         q_norm_weight: torch.Tensor | None = None,  # [head_dim]
                         k_norm_weight: torch.Tensor | None = None,  # [head_dim]
                         norm_eps: float = 1e-6) -> None:
    """Torch reference of `rotary_embedding` (same semantics, in place)."""
    _check(q, k, positions, inv_freq, mrope_section, mrope_interleaved, q_norm_weight, k_norm_weight)
    angles = _angles(positions, inv_freq, mrope_section, mrope_interleaved)  # [N, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [N, 1, D/2]
    for x, w in ((q, q_norm_weight), (k, k_norm_weight)):
        src = x if w is None else rms_norm(x.reshape(-1, x.shape[-1]), w, norm_eps).view(x.shape)
        x.copy_(apply_rotary(src.float(), cos, sin))
