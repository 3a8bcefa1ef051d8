"""The experts of a sparse MoE layer in two grouped products (Triton), beside kernels/fused_moe_torch.py
(`fused_moe_ref`: the same operands, the oracle).

    x [N, H], w13 [E, 2I, H] (gate rows | up rows), w2 [E, H, I], topk_weights [N, K] f32, topk_ids [N, K]
    (an id of -1: a pair whose expert another rank holds, under expert parallelism: skipped, adds 0)

    1. align (torch on the device, no host read): the P = N*K (token, choice) pairs sorted by expert
       (stable) and each expert's run padded to a multiple of BLOCK_M rows:
           sorted_pairs  [P_pad]            pair index p (token p // K), or P for a padding row
           block_expert  [P_pad / BLOCK_M]  the expert of each run of BLOCK_M rows, -1 past the last
       P_pad = P + min(E, P) * (BLOCK_M - 1), rounded up to BLOCK_M: static for a token count, so the
       launch needs nothing from the device (CUDA graphs capture it). Skipped pairs (-1) get no slot
       (never computed: their rows of pair_out stay zero).
    2. gate_up with SiLU-and-mul: a program takes BLOCK_M rows of one expert and BLOCK_N of its I
       columns, multiplies the rows' tokens by the expert's gate rows and up rows (two float32
       accumulators over H) and stores silu(gate) * up        -> inter [P, I] (x's dtype), row p
    3. down with the routing weights: inter's rows by the expert's w2 (over I), times topk_weights[p]
                                                              -> pair_out [P, H] (x's dtype), row p
    4. out = pair_out.view(N, K, H).sum(1) in float32, cast once -> [N, H]

Programs whose block is padding past the last expert (-1) return at once; padding rows of a block
are masked (never loaded, never stored). An expert no pair chose has no block. One kernel serves both
products (`GATED`, `WEIGHTED` and the row divisor `TOP_K` are constexprs). No per-expert loop on the
host: two launches plus the align's few torch ops, whatever the routing.

Tiles: BLOCK_M 16 rows for steps of at most 32 tokens (decode: each routed expert's rows are few), 64
beyond; the warm-up's decode and long prefill steps reach both. float32 dots are exact ("ieee") for
the parity path; bf16/fp16 use the tensor cores. The interpreter (CPU) gets small tiles so that
test-sized inputs span several.

Block-wise FP8 experts (`ExpertScales`: the Qwen3-VL-*-FP8 checkpoints): each weight tile is loaded as
float8_e4m3fn, multiplied in float32 by its blocks' scales (gathered per element, so any tile shape fits
any block) and rounded to the activations' dtype before the dot: W8A16, half the weight bytes read, the
activations not quantized (vLLM's W8A8 path also quantizes them per token; this one is the reference's
arithmetic exactly). Triton has the e4m3 type from sm_89 (Ada, Hopper); an older GPU is refused.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.fused_moe_torch import ExpertScales, check_moe_inputs

_SMALL_STEP_TOKENS = 32  # steps of at most this many tokens use 16-row blocks


@triton.jit(do_not_specialize=["num_pairs"])
def _fused_moe_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, experts_ptr, s_ptr,
                      num_pairs, n_out, k_in, stride_am, stride_we, stride_wn, stride_om,
                      stride_se, stride_sn,
                      TOP_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr,
                      SCALE_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the last expert's rows
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)  # the operand's row: the token (first product) or the pair (second)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    col_ok = cols < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    # W[e, cols, k] read as [BLOCK_K, BLOCK_N]: the product is a @ W^T
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    # FP8 weights: the scale rows of this tile's columns, in the expert's [rows / SCALE_N, k_in / SCALE_K] scales
    s_cols = s_ptr + expert * stride_se + (cols // SCALE_N)[None, :].to(tl.int64) * stride_sn  # [1, BLOCK_N]
    s_up = (n_out // SCALE_N) * stride_sn  # the up rows' scales (n_out is a multiple of SCALE_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if SCALED:  # dequantized in float32, rounded once to the activations' dtype
            s_ptrs = s_cols + ((k0 + offs_k) // SCALE_K)[:, None]  # [BLOCK_K, BLOCK_N]
            w = (w.to(tl.float32) * tl.load(s_ptrs, mask=w_mask, other=0.0)).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        if GATED:  # the up rows sit n_out rows below the gate rows
            up = tl.load(w_ptrs + n_out * stride_wn, mask=w_mask, other=0.0)
            if SCALED:
                up = (up.to(tl.float32) * tl.load(s_ptrs + s_up, mask=w_mask, other=0.0)).to(a.dtype)
            acc_up = tl.dot(a, up, acc_up, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in float32
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def moe_launch_config(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a step of x's tokens."""
    if x.device.type == "cpu":  # interpreter: test-sized operands span several tiles
        return 16, 16, 32, 4, 1
    block_m = 16 if x.shape[0] <= _SMALL_STEP_TOKENS else 64
    if x.element_size() == 4:  # exact fp32 dots on the FMA units: a parity path, small tiles
        return block_m, 32, 32, 4, 2
    return block_m, 64, 64, 4, 3


def moe_align(topk_ids: torch.Tensor,  # [N, K]
              num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P_pad] int32, block_expert [P_pad / block_m] int32), module docstring step 1."""
    num_pairs = topk_ids.numel()
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    padded = -(-padded // block_m) * block_m
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [P]
    flat = torch.where(flat < 0, num_experts, flat)  # skipped pairs: bucket E, sorted last, given no run
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E + 1]
    runs = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E] each expert's rows, padded
    run_ends = runs.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert
    expert_of = flat[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]  # [P] within its run
    starts = torch.cat([run_ends - runs, run_ends.new_full((1,), padded)])  # [E + 1]
    slots = torch.where(expert_of < num_experts, starts[expert_of] + rank, padded)  # [P]; skipped: one spare slot
    sorted_pairs = torch.full((padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs = sorted_pairs.scatter_(0, slots, order.to(torch.int32))[:padded]
    block_starts = torch.arange(0, padded, block_m, device=device)  # [P_pad / block_m]
    block_expert = torch.searchsorted(run_ends, block_starts, right=True)  # E past the last run
    return sorted_pairs, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


def _product(a, w, out, topk_weights, sorted_pairs, block_expert, num_pairs, top_k, gated, config,
             scale: torch.Tensor | None, block: tuple[int, int]):
    block_m, block_n, block_k, num_warps, num_stages = config
    n_out = out.shape[1]
    grid = (triton.cdiv(n_out, block_n), block_expert.shape[0])
    s = w if scale is None else scale  # unread without SCALED
    _fused_moe_kernel[grid](
        a, w, out, topk_weights, sorted_pairs, block_expert, s, num_pairs, n_out, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), s.stride(0), s.stride(1),
        TOP_K=top_k, GATED=gated, WEIGHTED=not gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", SCALED=scale is not None,
        SCALE_N=block[0], SCALE_K=block[1], num_warps=num_warps, num_stages=num_stages)


def fused_moe(x: torch.Tensor,  # [N, H]
              w13: torch.Tensor,  # [E, 2I, H]
              w2: torch.Tensor,  # [E, H, I]
              topk_weights: torch.Tensor,  # [N, K] float32
              topk_ids: torch.Tensor,  # [N, K]
              scales: ExpertScales | None = None,
              ) -> torch.Tensor:  # [N, H] in x.dtype
    """The routed experts' weighted sum per token (module docstring); equals `fused_moe_ref`. FP8 experts
    (float8_e4m3fn w13 and w2 with their block `scales`) are dequantized per tile in the kernel."""
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, scales)
    if scales is not None and x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(x.device)
        raise ValueError(f"FP8 experts need a GPU with e4m3 (sm_89 or newer: Ada, Hopper) for the fused MoE kernel's "
                         f"tiles; this one is sm_{major}{minor}: serve the BF16 checkpoint on it")
    extra = () if scales is None else (("w13 scales", scales.w13), ("w2 scales", scales.w2))
    for name, t in (("x", x), ("w13", w13), ("w2", w2), *extra):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    n, k = topk_ids.shape
    h, inter, num_pairs = x.shape[1], w2.shape[2], n * k
    if num_pairs == 0:
        return torch.zeros_like(x)
    config = moe_launch_config(x)
    sorted_pairs, block_expert = moe_align(topk_ids, w13.shape[0], config[0])
    weights = topk_weights.contiguous()
    inter_out = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]
    s13, s2, block = (None, None, (1, 1)) if scales is None else (scales.w13, scales.w2, scales.block)
    _product(x, w13, inter_out, weights, sorted_pairs, block_expert, num_pairs, k, True, config, s13, block)
    pair_out = torch.zeros(num_pairs, h, dtype=x.dtype, device=x.device)  # [P, H]: skipped pairs' rows stay 0
    _product(inter_out, w2, pair_out, weights, sorted_pairs, block_expert, num_pairs, 1, False, config, s2, block)
    return pair_out.view(n, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)  # [N, H]
