"""Dequantization of the published quantized weight layouts, in pure torch: the CPU path of every quantized
linear (dequantize, then `F.linear`) and the reference the Triton GEMMs are checked against.

Every function returns the weight as `[out, in]` float32 (PyTorch's Linear layout), whatever the packing:

    AWQ (GEMM)   qweight [in, out/8] int32, nibble i of word c = column 8c + AWQ_ORDER[i]
                 qzeros  [in/G, out/8] int32, same order; scales [in/G, out]
                 W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    GPTQ         qweight [in/8, out] int32, nibble i of word r = row 8r + i
                 qzeros  [groups, out/8] int32, nibble i of word c = column 8c + i; scales [groups, out]
                 g_idx   [in]: the group of each input row (desc_act permutes them)
                 W[n, k] = (q[k, n] - (z[g, n] + zero_offset)) * s[g, n], g = g_idx[k]; zero_offset is 1 in
                 the original format (checkpoint_format "gptq": it stores zero - 1), 0 in "gptq_v2"
    FP8 block    weight [out, in] float8_e4m3fn, weight_scale_inv [ceil(out/B0), ceil(in/B1)]
                 W[n, k] = w[n, k] * scale_inv[n // B0, k // B1]
    FP8 channel  weight [out, in] float8_e4m3fn, weight_scale [out, 1] (compressed-tensors, channel strategy)
    W4A16        compressed-tensors' pack-quantized: weight_packed [out, in/8] int32, nibble i of word c = input
                 8c + i, stored as q + 8 (signed int4 -8..7 made unsigned); weight_scale [out, groups];
                 weight_zero_point [out/8, groups] int32 packed along the output, also + 8 (asymmetric only;
                 symmetric checkpoints have none: the zero is 8); weight_g_idx [in] (actorder "group")
                 W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = g_idx[k] or k // G
                 (GPTQ v2's layout with every tensor transposed)

(sources: AutoAWQ / vLLM awq_triton.py for AWQ's order; AutoGPTQ / gptqmodel and vLLM gptq.py for GPTQ and
its "+1"; vLLM fp8.py and the Qwen FP8 checkpoints for `weight_scale_inv`; compressed-tensors'
float-quantized format for the channel scales, and its pack_quantized compressor (pack_to_int32, and
`dequantize`: x = (x_q - zero_point) * scale) with vLLM's compressed_tensors_wNa16.py for W4A16.)
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (0..15) in sequential order along `dim` (8x as long), int32."""
    x = packed.to(torch.int32).movedim(dim, -1)  # [..., words]
    nibbles = (x.unsqueeze(-1) >> _SHIFTS.to(x.device)) & 0xF  # [..., words, 8]
    return nibbles.flatten(-2).movedim(-1, dim)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `unpack_int4`: values 0..15 along `dim` (a multiple of 8) -> int32 words."""
    x = values.to(torch.int64).movedim(dim, -1)
    if x.shape[-1] % 8:
        raise ValueError(f"{x.shape[-1]} values do not pack 8 per int32 word")
    if x.numel() and (x.min() < 0 or x.max() > 15):
        raise ValueError("int4 values must be in 0..15")
    words = (x.unflatten(-1, (-1, 8)) << _SHIFTS.to(torch.int64).to(x.device)).sum(-1)  # [..., words]
    return _to_int32(words).movedim(-1, dim)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words [rows, cols/8] -> values [rows, cols] in column order (undoing AWQ's interleave)."""
    seq = unpack_int4(packed, 1).unflatten(1, (-1, 8))  # [rows, words, 8] nibble order
    return seq[:, :, list(AWQ_REVERSE_ORDER)].flatten(1)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """Values [rows, cols] (0..15) -> AWQ words [rows, cols/8]: nibble i = column AWQ_ORDER[i]."""
    return pack_int4(values.unflatten(1, (-1, 8))[:, :, list(AWQ_ORDER)].flatten(1), 1)


def dequantize_awq(qweight: torch.Tensor,  # [in, out/8] int32
                   qzeros: torch.Tensor,   # [in/G, out/8] int32
                   scales: torch.Tensor,   # [in/G, out]
                   ) -> torch.Tensor:      # [out, in] float32
    q = awq_unpack(qweight)  # [in, out]
    groups = scales.shape[0]
    group = q.shape[0] // groups
    z = awq_unpack(qzeros).repeat_interleave(group, 0)  # [in, out]
    s = scales.float().repeat_interleave(group, 0)  # [in, out]
    return ((q - z).float() * s).t()


def dequantize_gptq(qweight: torch.Tensor,  # [in/8, out] int32
                    qzeros: torch.Tensor,   # [groups, out/8] int32
                    scales: torch.Tensor,   # [groups, out]
                    g_idx: torch.Tensor,    # [in] group of each input row
                    zero_offset: int) -> torch.Tensor:  # [out, in] float32
    q = unpack_int4(qweight, 0)  # [in, out]
    z = unpack_int4(qzeros, 1) + zero_offset  # [groups, out]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t()


def dequantize_fp8_block(weight: torch.Tensor,     # [out, in] float8_e4m3fn
                         scale_inv: torch.Tensor,  # [ceil(out/B0), ceil(in/B1)]
                         block: tuple[int, int]) -> torch.Tensor:  # [out, in] float32
    out_f, in_f = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return weight.float() * s


def dequantize_fp8_channel(weight: torch.Tensor,  # [out, in] float8_e4m3fn
                           scale: torch.Tensor,   # [out, 1] or [1] / []: per channel or per tensor
                           ) -> torch.Tensor:     # [out, in] float32
    s = scale.float()
    return weight.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))


def dequantize_w4a16(weight_packed: torch.Tensor,  # [out, in/8] int32
                     scale: torch.Tensor,          # [out, groups]
                     zero_point: torch.Tensor | None,  # [out/8, groups] int32, None: symmetric (zero 8)
                     g_idx: torch.Tensor | None,   # [in]: each input column's group; None: k // (in / groups)
                     ) -> torch.Tensor:            # [out, in] float32
    q = unpack_int4(weight_packed, 1)  # [out, in] unsigned (q + 8)
    in_f, groups = q.shape[1], scale.shape[1]
    g = torch.arange(in_f, device=q.device) // (in_f // groups) if g_idx is None else g_idx.long()  # [in]
    z = 8 if zero_point is None else unpack_int4(zero_point, 0)[:, g]  # [out, in] unsigned (zero + 8)
    return (q - z).float() * scale.float()[:, g]
