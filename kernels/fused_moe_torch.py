"""The experts of a sparse MoE layer in torch: the reference of kernels/fused_moe.py and the torch kernel
set's op (the CPU path).

    x            [N, H]       the tokens
    w13          [E, 2I, H]   per expert: gate_proj rows [0, I), up_proj rows [I, 2I)
    w2           [E, H, I]    per expert: down_proj
    topk_weights [N, K]       float32 routing weights
    topk_ids     [N, K]       int, each in [0, E), or -1: a pair this rank skips (its expert is on another
                              rank under expert parallelism); it adds nothing to its token's sum
    out          [N, H]       sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]

Block-wise FP8 experts (the Qwen3-VL-*-FP8 checkpoints' `weight_scale_inv`, `block` = (B0, B1) =
weight_block_size): w13 and w2 are float8_e4m3fn and each has a float32 scale per B0 x B1 block of
each expert, W[e, n, k] = w[e, n, k] * scale[e, n // B0, k // B1]:

    w13_scale    [E, 2I / B0, ceil(H / B1)]   gate's I / B0 block rows, then up's (I a multiple of B0)
    w2_scale     [E, ceil(H / B0), ceil(I / B1)]

The weights are dequantized to x's dtype (rounded once, as the Triton kernel does per tile) and the
products run as for float weights (W8A16: the activations are not quantized).

The (token, choice) pairs are sorted by expert (stable), so each expert multiplies all its rows at once
(the weights in either storage order: the CPU layout stores each expert transposed, vlm_sdk/layers/moe.py):
on the CPU one grouped product per weight (`F.grouped_mm`) for all experts, elsewhere (or with strides
it refuses) a loop over the experts that have rows, never over tokens, its bounds read on the host (the
torch set is not captured into CUDA graphs; the Triton op needs no host read). Arithmetic, as the
Triton kernel's: both products in the inputs' dtype with float32 accumulation, SiLU-and-mul in float32
rounded to the dtype (the kernel's stored intermediate), the routing weight and the sum over the K
choices in float32, rounded once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, scales: "ExpertScales | None" = None) -> None:
    """`ValueError` naming the operand whose shape, dtype or device disagrees with the others."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [N, H], w13 [E, 2I, H], w2 [E, H, I]; got {list(x.shape)}, "
                         f"{list(w13.shape)}, {list(w2.shape)}")
    n, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 {list(w13.shape)} and w2 {list(w2.shape)} do not fit x {list(x.shape)}: need "
                         f"w13 [E, 2I, {h}] and w2 [E, {h}, I]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must "
                         f"both be [{n}, K]")
    weight_dtype = x.dtype if scales is None else torch.float8_e4m3fn
    if x.dtype not in _DTYPES or w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(f"x, w13, w2 dtypes {x.dtype}, {w13.dtype}, {w2.dtype}: x one of {_DTYPES}, the weights "
                         f"{'alike' if scales is None else 'float8_e4m3fn (they have block scales)'}")
    if scales is not None:
        scales.check(e, two_i // 2, h)
    if topk_weights.dtype != torch.float32 or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be float32 and topk_ids integers, got {topk_weights.dtype}, "
                         f"{topk_ids.dtype}")
    extra = () if scales is None else (scales.w13, scales.w2)
    if len({t.device for t in (x, w13, w2, topk_weights, topk_ids, *extra)}) != 1:
        raise ValueError("x, w13, w2, topk_weights, topk_ids (and the scales) must be on one device")


@dataclass(frozen=True)
class ExpertScales:
    """The block scales of FP8 experts (module docstring): `w13` [E, 2I / B0, ceil(H / B1)], `w2`
    [E, ceil(H / B0), ceil(I / B1)] float32, `block` = (B0 output rows, B1 input columns) per scale."""
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int]

    def check(self, experts: int, inter: int, hidden: int) -> None:
        b0, b1 = self.block
        if inter % b0:
            raise ValueError(f"the experts' intermediate size {inter} is not a multiple of the FP8 block's "
                             f"{b0} rows: gate's and up's scale rows would share a block")
        want13 = (experts, 2 * inter // b0, -(-hidden // b1))
        want2 = (experts, -(-hidden // b0), -(-inter // b1))
        if tuple(self.w13.shape) != want13 or tuple(self.w2.shape) != want2:
            raise ValueError(f"FP8 scales {list(self.w13.shape)} and {list(self.w2.shape)} do not fit the block "
                             f"{list(self.block)}: need {list(want13)} and {list(want2)}")
        if self.w13.dtype != torch.float32 or self.w2.dtype != torch.float32:
            raise ValueError(f"FP8 scales must be float32, got {self.w13.dtype}, {self.w2.dtype}")


def dequantize_experts(w: torch.Tensor,  # [E, R, C] float8_e4m3fn
                       scale: torch.Tensor,  # [E, ceil(R / B0), ceil(C / B1)] float32
                       block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:  # [E, R, C] in dtype
    """W[e, n, k] = w[e, n, k] * scale[e, n // B0, k // B1], computed in float32, rounded once to dtype."""
    rows, cols = w.shape[1], w.shape[2]
    full = scale.repeat_interleave(block[0], 1)[:, :rows].repeat_interleave(block[1], 2)[:, :, :cols]  # [E, R, C]
    return (w.float() * full).to(dtype)


def fused_moe_ref(x: torch.Tensor,  # [N, H]
                  w13: torch.Tensor,  # [E, 2I, H]
                  w2: torch.Tensor,  # [E, H, I]
                  topk_weights: torch.Tensor,  # [N, K] float32
                  topk_ids: torch.Tensor,  # [N, K]
                  scales: ExpertScales | None = None,
                  ) -> torch.Tensor:  # [N, H] in x.dtype
    """The routed experts' weighted sum per token (module docstring); FP8 experts with their `scales`."""
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, scales)
    if scales is not None:  # W8A16: the float experts, then the same products
        w13 = dequantize_experts(w13, scales.w13, scales.block, x.dtype)  # [E, 2I, H]
        w2 = dequantize_experts(w2, scales.w2, scales.block, x.dtype)  # [E, H, I]
    n, k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    flat = topk_ids.reshape(-1).long()  # [P] pair p = token p // K, choice p % K
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert, the skipped (-1) first
    counts = torch.bincount(flat + 1, minlength=num_experts + 1)  # [1 + E] the skipped, then each expert's rows
    order, counts = order[int(counts[0]):], counts[1:]  # [P'], [E]: the pairs computed here
    tokens = order // k  # [P']
    gate, up = _by_expert(x[tokens], w13, counts).float().split(inter, dim=-1)  # [P, I] x 2
    down = _by_expert((F.silu(gate) * up).to(x.dtype), w2, counts)  # [P, H]
    weighted = down.float() * topk_weights.reshape(-1)[order, None]  # [P, H]
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, weighted).to(x.dtype)  # [N, H]


def _by_expert(rows: torch.Tensor,  # [P, In] grouped by expert, counts[e] rows each
               weight: torch.Tensor,  # [E, Out, In]
               counts: torch.Tensor,  # [E]
               ) -> torch.Tensor:  # [P, Out]: each row times its expert's weight, transposed
    """On the CPU one `F.grouped_mm` for all experts (as transformers 5 runs its experts: a loop of small
    products, each a parallel region of its own, is many times slower on a loaded machine), where its
    16-byte stride rule holds; elsewhere one product per expert with rows. Either storage order of the
    weight works (the CPU layout's [E, In, Out] storage is the faster: vlm_sdk/layers/moe.py)."""
    weight_t = weight.transpose(1, 2)  # [E, In, Out]
    if rows.device.type == "cpu" and _grouped_mm_takes(rows) and _grouped_mm_takes(weight_t):
        return F.grouped_mm(rows, weight_t, offs=counts.cumsum(0).to(torch.int32))
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start:start + count] = F.linear(rows[start:start + count], weight[expert])
            start += count
    return out


def _grouped_mm_takes(t: torch.Tensor) -> bool:
    """grouped_mm's stride rule: one of the last two dims has stride 1 and every other stride is a
    multiple of 16 bytes."""
    strides = t.stride()
    if 1 not in strides[-2:]:
        return False
    unit = -1 if strides[-1] == 1 else -2
    return all(s * t.element_size() % 16 == 0 for d, s in enumerate(strides) if d != t.dim() + unit)
